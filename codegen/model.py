"""The typed model of derivatives/*.yaml that code generation renders.

The loader (:mod:`.loader`) builds one :class:`OpEntry` per YAML entry, complete and
immutable: which tensors the forward saves and for which formulas, which metadata it keeps
instead of a tensor, which intermediates each formula needs and in what order.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .formulas import Analysis
from .schema import Param, Schema


@dataclass(frozen=True)
class Formula:
    """One expression of an entry: the message for a differentiable input (``target`` is the
    parameter) or, as an :class:`Intermediate`, a named value formulas share."""

    target: str
    source: str
    tree: ast.Expression
    reads: Analysis
    #: the intermediates it needs, transitively
    needs: frozenset[str] = frozenset()

    @property
    def names_read(self) -> set[str]:
        """Every name it reads: as a value, as metadata or through ``shapes(...)``."""
        return self.reads.full | {n for n, _ in self.reads.meta} | self.reads.shapes


@dataclass(frozen=True)
class Intermediate(Formula):
    """A named expression computed once in backward, before the formulas that need it."""

    #: the differentiable inputs whose formulas need it (it is computed when any is needed)
    users: tuple[str, ...] = ()


@dataclass(frozen=True)
class SavedValue:
    """A tensor the forward saves (``save_for_backward``), kept only when a formula reading
    it will run: ``name`` is a parameter, ``result`` or ``aux``."""

    name: str
    readers: tuple[str, ...]


@dataclass(frozen=True)
class Kept:
    """A non-tensor value the forward keeps for backward, read under ``name``: ``kind`` is
    ``meta`` (attribute ``attr`` of tensor ``source``: ``x.shape`` in a formula reads
    ``x__shape``), ``shapes`` (the shapes of a tensor list or of the results, read through
    ``shapes(x)``) or ``param`` (a non-tensor parameter)."""

    kind: str
    source: str
    attr: str = ""

    @property
    def name(self) -> str:
        if self.kind == "meta":
            return f"{self.source}__{self.attr}"
        if self.kind == "shapes":
            return f"{self.source}__shapes"
        return self.source


@dataclass(frozen=True)
class OpEntry:
    """One validated YAML entry and what its generated Function saves and computes."""

    schema: Schema
    torch_functions: tuple[str, ...]
    granularity: str
    formulas: dict[str, Formula]
    intermediates: tuple[Intermediate, ...]
    non_differentiable: tuple[str, ...]
    accepts: str | None
    forward: str | None
    output_differentiability: tuple[bool, ...]
    #: a condition on the arguments under which the op returns (output, aux), as torch's
    #: ``return_indices=True`` forms do; otherwise it returns the output alone
    returns_aux: str | None
    #: the type of that pair (a torch.return_types struct sequence), or a plain tuple
    aux_type: str | None
    source_file: str
    #: PyTorch OpInfo names (``name`` or ``name.variant``) whose samples call this entry
    opinfo: tuple[str, ...]
    #: whether torch hands back the first argument itself for some arguments (such a call
    #: records nothing: the argument's own node takes its messages)
    may_return_input: bool
    saved: tuple[SavedValue, ...]
    kept: tuple[Kept, ...]
    #: whether its formulas only move, copy or reshape messages (no ⊕, ⊗ or lift): one rule,
    #: written once for every semiring
    structural: bool

    @property
    def name(self) -> str:
        return self.schema.full_name

    @property
    def has_aux(self) -> bool:
        return len(self.output_differentiability) > 1

    @property
    def multi_output(self) -> bool:
        return self.schema.returns == "Tensor[]"

    @property
    def tensor_list(self) -> Param | None:
        """The ``Tensor[]`` parameter, passed to ``apply`` unpacked after the others."""
        return next((p for p in self.schema.params if p.is_tensor_list), None)

    @property
    def tensor_params(self) -> set[str]:
        return {p.name for p in self.schema.params if p.is_tensor}

    @property
    def differentiable(self) -> tuple[str, ...]:
        """The parameters with a formula, in signature order."""
        return tuple(p.name for p in self.schema.params if p.name in self.formulas)

    @property
    def param_names(self) -> tuple[str, ...]:
        return self.schema.param_names

    @property
    def granularity_short(self) -> str:
        return self.granularity.splitlines()[0]
