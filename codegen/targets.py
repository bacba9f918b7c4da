"""Which generated modules to emit, read from the semiring registry.

A built-in semiring whose registry entry says ``module="own"`` gets a module specialised to
it; every other semiring (user semirings, and built-ins that gain nothing from their own
module) runs the generic module, which takes the semiring as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

from semiring_autograd.semirings.registry import SEMIRINGS, SemiringSpec

from .formulas import Flavour


class CodegenError(ValueError):
    """A semiring or entry that loads but cannot be generated."""


@dataclass(frozen=True)
class Target:
    """One generated module: its file name, the semiring class it is bound to (None: the
    generic module) and how its formulas are spelled."""

    module: str
    semiring_class: str | None
    flavour: Flavour
    title: str
    description: str

    @property
    def kind(self) -> str:
        return self.flavour.kind


GENERIC = Target(
    "generic",
    None,
    Flavour("generic"),
    "Semiring backward Functions for any semiring",
    "Each Function takes the semiring as its first argument; values are tuples of component\n"
    "tensors and every primitive is a call P.<name>(S, ...). User-defined semirings, and\n"
    "built-ins whose registry entry says module='generic', run these.",
)


def _own_target(spec: SemiringSpec) -> Target:
    cls = spec.cls
    if cls.inline is None or cls.n_components != 1:
        raise CodegenError(
            f"semiring registry: {cls.__name__} asks for its own module, which needs one "
            "component and InlineForms (cls.inline); give it those or set module='generic'"
        )
    if spec.plain_messages:
        kind, messages = "plain", "messages are ordinary gradients in the primal's dtype"
    else:
        kind, messages = "single", "messages are sa.Message wrappers of that tensor"
    forms = cls.inline
    return Target(
        spec.name,
        cls.__name__,
        Flavour(kind, forms),
        f"Semiring backward Functions specialised to {cls.__name__}",
        f"A value is its one component tensor ({messages}):\n"
        f"a ⊕ b is `{forms.add.format(a='a', b='b')}`, a ⊗ b is `{forms.mul.format(a='a', b='b')}`, "
        f"lift(w) is `{(forms.lift or 'S.lift({w})').format(w='w')}`.",
    )


def targets() -> list[Target]:
    """The modules to generate: one per built-in semiring with its own module, and the
    generic one."""
    return [_own_target(s) for s in SEMIRINGS if s.module == "own"] + [GENERIC]
