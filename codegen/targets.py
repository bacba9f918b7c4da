"""Which generated modules to emit, read from the semiring registry.

A built-in semiring whose registry entry says ``module="own"`` gets a module specialised to
it; every other semiring (user semirings, and built-ins that gain nothing from their own
module) runs the generic module, which takes the semiring as an argument. Each target says
how its module spells formulas and what it prints before its rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from semiring_autograd.semirings.registry import SEMIRINGS, SemiringSpec

from .formulas import Flavour


class CodegenError(ValueError):
    """A semiring or entry that loads but cannot be generated."""


@dataclass(frozen=True)
class Target:
    """One generated module: its file name, how its formulas are spelled, the parameters
    its rules take before the incoming message, and the text before its rules (imports
    and the module's ``Rule`` base)."""

    module: str
    flavour: Flavour
    title: str
    description: str
    lead: tuple[str, ...]
    imports: tuple[str, ...]
    preamble: str


_PRIMITIVES = {
    "plain": "from semiring_autograd.ops import real_primitives as RP",
    "single": "from semiring_autograd.ops import component_primitives as C",
    "generic": "from semiring_autograd.ops import primitives as P",
}

GENERIC = Target(
    "generic",
    Flavour("generic"),
    "Semiring backward Functions for any semiring",
    "Each Function takes the semiring as its first argument; values are tuples of component\n"
    "tensors and every primitive is a call P.<name>(S, ...). User-defined semirings, and\n"
    "built-ins whose registry entry says module='generic', run these.",
    ("S",),
    (_PRIMITIVES["generic"], "from semiring_autograd.ops.function import GenericFunction"),
    'class Rule(GenericFunction):\n    """An op\'s Function: its vjp takes the semiring S first."""',
)


def _own_target(spec: SemiringSpec) -> Target:
    cls = spec.cls
    if cls.inline is None or cls.n_components != 1:
        raise CodegenError(
            f"semiring registry: {cls.__name__} asks for its own module, which needs one "
            "component and InlineForms (cls.inline); give it those or set module='generic'"
        )
    if spec.plain_messages:
        kind, base = "plain", "PlainFunction"
        messages = "messages are ordinary gradients in the primal's dtype"
    else:
        kind, base = "single", "ComponentFunction"
        messages = "messages are Message wrappers of that tensor"
    forms = cls.inline
    name = cls.__name__
    return Target(
        spec.name,
        Flavour(kind, forms),
        f"Semiring backward Functions specialised to {name}",
        f"A value is its one component tensor ({messages}):\n"
        f"a ⊕ b is `{forms.add.format(a='a', b='b')}`, a ⊗ b is `{forms.mul.format(a='a', b='b')}`, "
        f"lift(w) is `{(forms.lift or 'S.lift({w})').format(w='w')}`.",
        (),
        (
            _PRIMITIVES[kind],
            f"from semiring_autograd.ops.function import {base}",
            f"from semiring_autograd.semirings import {name}",
        ),
        f"S = {name}()\n\n\nclass Rule({base}):\n"
        f'    """An op\'s Function under {name}."""\n\n    semiring = S',
    )


def targets() -> list[Target]:
    """The modules to generate: one per built-in semiring with its own module, and the
    generic one."""
    return [_own_target(s) for s in SEMIRINGS if s.module == "own"] + [GENERIC]
