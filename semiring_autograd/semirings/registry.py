"""The built-in semirings, each declared once.

An entry names the class, its command-line alias, what its readout means, which generated
module serves it and what it can do. Code generation (which modules to emit), the patch
(which module records a call, whether torch records its own graph), ``sa.grad`` (plain
or wrapped messages), top paths, attribution, the CLI and the tests all read this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import _LIBRARY_PREFIX, Semiring
from .boolean import Boolean
from .counting import Counting
from .entropy import Entropy
from .k_best import KBest
from .log import Log
from .max_product import MaxProduct
from .real import Real
from .signed_max_product import SignedMaxProduct


@dataclass(frozen=True)
class SemiringSpec:
    """One built-in semiring and its capabilities.

    ``module``: ``"own"`` — a generated module specialised to this semiring (its ⊕, ⊗ and
    lift emitted as the tensor ops they are); ``"generic"`` — the generic module, which
    takes the semiring as an argument (as user semirings do). ``top_paths``: how
    :func:`sa.top_path` follows a path (``"max"``: the largest product; ``"signed"``: the
    largest or smallest signed product; ``"witness"``: a path that exists, not a best one);
    None where paths are not defined.
    ``plain_messages``: messages are ordinary gradients, not
    :class:`~semiring_autograd.ops.message.Message` wrappers. ``torch_graph``: under ``sa.patch`` torch records its own
    graph of each op unless the instance asks for the formulas (``Real(formulas=True)``).
    ``kernels``: the fused kernels (:mod:`semiring_autograd.kernels`) its primitives use.
    ``meaning`` and ``unit``: what a readout from an output to an input element is, and its
    unit; ``signed``: readouts can be negative. ``scale``: how reports colour readouts —
    ``"zero"``: anchored at zero (diverging when ``signed``); ``"from_best"``: by the
    difference from the largest readout (logs, in nats: only differences carry meaning);
    ``"presence"``: two colours, path or no path.
    """

    cls: type[Semiring]
    cli_name: str
    meaning: str
    unit: str
    module: Literal["own", "generic"]
    signed: bool = False
    top_paths: Literal["max", "signed", "witness"] | None = None
    plain_messages: bool = False
    torch_graph: bool = False
    kernels: tuple[str, ...] = ()
    scale: Literal["zero", "from_best", "presence"] = "zero"

    @property
    def name(self) -> str:
        """The semiring's short name: its generated module's name."""
        return self.cls.name

    @property
    def generated_module(self) -> str:
        """The name of the generated module whose Functions record its ops."""
        return self.name if self.module == "own" else "generic"


SEMIRINGS: tuple[SemiringSpec, ...] = (
    SemiringSpec(
        Real,
        "real",
        "summed gradient",
        "∂output/∂input",
        module="own",
        signed=True,
        plain_messages=True,
        torch_graph=True,
    ),
    SemiringSpec(
        MaxProduct,
        "max-product",
        "weight of the strongest path",
        "∂output/∂input",
        module="own",
        top_paths="max",
        kernels=("max_times_finite", "max_times"),
    ),
    SemiringSpec(
        SignedMaxProduct,
        "signed-max-product",
        "largest signed path product",
        "∂output/∂input",
        module="generic",
        signed=True,
        top_paths="signed",
        kernels=("signed_times", "pair_lift_matmul", "signed_mul_lift"),
    ),
    SemiringSpec(
        Log,
        "log",
        "log of the total path weight",
        "ln of ∂output/∂input",
        module="own",
        signed=True,
        kernels=("log_space_rows", "loo_log"),
        scale="from_best",
    ),
    SemiringSpec(
        Entropy,
        "entropy",
        "entropy of the path distribution",
        "nats",
        module="generic",
        kernels=(
            "log_space_rows",
            "loo_log",
            "entropy_add",
            "entropy_mul_lift",
            "entropy_reduce_rows",
            "entropy_weights",
            "ratio_where_positive",
        ),
        scale="from_best",
    ),
    SemiringSpec(
        Boolean,
        "boolean",
        "whether any path exists",
        "1 = yes, 0 = no",
        module="own",
        top_paths="witness",
        scale="presence",
    ),
    SemiringSpec(
        Counting,
        "counting",
        "log of the number of paths",
        "ln of a count",
        module="own",
        kernels=("log_space_rows", "loo_log"),
        scale="from_best",
    ),
)

#: the built-in semiring classes, in registry order
BUILTIN_SEMIRINGS: tuple[type[Semiring], ...] = tuple(s.cls for s in SEMIRINGS)

_BY_CLASS = {s.cls: s for s in SEMIRINGS}
_BY_CLI_NAME = {s.cli_name: s for s in SEMIRINGS}


def spec_of(semiring: Semiring) -> SemiringSpec | None:
    """The entry of a built-in semiring instance; None for any other semiring, subclasses
    of built-ins included (a subclass may change any primitive: it runs the generic
    module and the formulas)."""
    return _BY_CLASS.get(type(semiring))


def inherited_spec(semiring: Semiring) -> SemiringSpec | None:
    """The entry of the nearest built-in class ``semiring`` derives from: what a readout
    means and whether top paths are defined follow a subclass."""
    for cls in type(semiring).__mro__:
        if cls in _BY_CLASS:
            return _BY_CLASS[cls]
    return None


def path_kind(semiring: Semiring) -> Literal["max", "signed", "witness"] | None:
    """How paths are followed in a graph recorded with ``semiring``: its entry's
    ``top_paths``; ``"max"`` for :class:`KBest` (its best path is MaxProduct's);
    None where paths are not defined."""
    if isinstance(semiring, KBest):
        return "max"
    spec = inherited_spec(semiring)
    return None if spec is None else spec.top_paths


def defined_by_library(semiring: Semiring) -> bool:
    """Whether this library defines ``semiring``'s class (not a user's subclass): its laws
    are tested with the library, and its rules branch on values only as the library knows."""
    return type(semiring).__module__.startswith(_LIBRARY_PREFIX)


def records_torch_graph(semiring: Semiring) -> bool:
    """Whether ``sa.patch`` lets torch record its own graph of each op (``sa.Real()``):
    its messages are torch's gradients, so torch's nodes compute them."""
    spec = spec_of(semiring)
    return spec is not None and spec.torch_graph and not getattr(semiring, "formulas", False)


def plain_messages(semiring: Semiring) -> bool:
    """Whether the backward's messages are ordinary gradients (no :class:`~semiring_autograd.ops.message.Message`)."""
    spec = spec_of(semiring)
    return spec is not None and spec.plain_messages


def cli_names() -> tuple[str, ...]:
    """The command-line names of the built-in semirings, in registry order."""
    return tuple(_BY_CLI_NAME)


def semiring_named(name: str | Semiring) -> Semiring:
    """A semiring instance from a name such as ``"max-product"`` (or the instance itself)."""
    if isinstance(name, Semiring):
        return name
    key = str(name).lower().replace("_", "-")
    if key not in _BY_CLI_NAME:
        raise ValueError(f"unknown semiring {name!r}; choose one of {', '.join(_BY_CLI_NAME)}")
    return _BY_CLI_NAME[key].cls()
