"""The typed model of derivatives/*.yaml that the templates render.

The loader (:mod:`.loader`) builds one :class:`OpEntry` per YAML entry and validates it;
everything a generated Function needs is decided here, once: which tensors the forward
saves and for which formulas, which metadata it keeps instead of a tensor, which
intermediates each formula needs and in what order.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from .formulas import Analysis
from .schema import Param, Schema


@dataclass
class Formula:
    """One expression of an entry: the message for a differentiable input (``target`` is the
    parameter) or, as an :class:`Intermediate`, a named value formulas share."""

    target: str
    source: str
    tree: ast.Expression
    reads: Analysis
    #: the intermediates it needs, transitively
    needs: set[str] = field(default_factory=set)

    @property
    def names_read(self) -> set[str]:
        """Every name it reads: as a value, as metadata or through ``shapes(...)``."""
        return self.reads.full | {n for n, _ in self.reads.meta} | self.reads.shapes


@dataclass
class Intermediate(Formula):
    """A named expression computed once in backward, before the formulas that need it."""

    #: the differentiable inputs whose formulas need it (it is computed when any is needed)
    users: tuple[str, ...] = ()


@dataclass(frozen=True)
class SavedValue:
    """A tensor the forward saves (``save_for_backward``), kept only when a formula reading
    it will run: ``source`` is the forward's variable (``output`` for the result)."""

    name: str
    source: str
    readers: tuple[str, ...]
    #: a tensor list (``Tensor[]``, ``Tensor...``): saved as its elements, read back as a list
    many: bool = False

    @property
    def target(self) -> str:
        """Its name where backward unpacks ``ctx.saved_tensors``."""
        return f"*{self.name}" if self.many else self.name


@dataclass(frozen=True)
class SavedMeta:
    """Metadata of a tensor parameter kept instead of the tensor (``x.shape``, ``x.dtype``,
    ``x.device`` in a formula): the generated code reads it as ``{name}__{attr}``."""

    name: str
    attr: str


@dataclass
class OpEntry:
    """One validated YAML entry and what its generated Function saves and computes."""

    schema: Schema
    torch_functions: list[str]
    granularity: str
    formulas: dict[str, Formula]
    intermediates: list[Intermediate]
    non_differentiable: list[str]
    accepts: str | None
    forward: str | None
    output_differentiability: list[bool]
    #: a condition on the arguments under which the op returns (output, aux), as torch's
    #: ``return_indices=True`` forms do; otherwise it returns the output alone
    returns_aux: str | None
    #: the type of that pair (a torch.return_types struct sequence), or a plain tuple
    aux_type: str | None
    source_file: str
    #: PyTorch OpInfo names (``name`` or ``name.variant``) whose samples call this entry
    opinfo: list[str] = field(default_factory=list)
    saved: list[SavedValue] = field(default_factory=list)
    metas: list[SavedMeta] = field(default_factory=list)
    #: names read through ``shapes(...)``: the forward keeps their shapes
    shapes: list[str] = field(default_factory=list)
    #: non-tensor parameters a formula reads, kept on ctx
    ctx_params: list[str] = field(default_factory=list)

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
    def positional(self) -> list[Param]:
        """The parameters ``apply`` receives one by one (all but the ``Tensor[]``)."""
        return [p for p in self.schema.params if not p.is_tensor_list]

    def position(self, name: str) -> int:
        """The index of parameter ``name`` among :attr:`positional`."""
        return next(i for i, p in enumerate(self.positional) if p.name == name)

    @property
    def tensor_params(self) -> set[str]:
        return {p.name for p in self.schema.params if p.is_tensor}

    @property
    def granularity_short(self) -> str:
        return self.granularity.splitlines()[0]
