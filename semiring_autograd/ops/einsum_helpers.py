"""The label bookkeeping of ``torch.einsum`` for its semiring formula.

``out[O] = Σ_{labels not in O} Π_m operand_m[A_m]``. The edge from output element o to
element u of operand k weighs the real Jacobian entry

    J_k[o, u] = Σ_{labels in neither O nor A_k} Π_{m ≠ k} operand_m   (o, u agreeing on
    the labels they share; otherwise no edge),

a real einsum of the other operands, ``others_k`` (labels L_k = their labels that are in O
or A_k). The message at operand k is then the semiring contraction
``⊕_{O \\ A_k} grad[O] ⊗ lift(others_k[L_k])`` over the labels of A_k (a :class:`Contraction`),
placed into the operand: a label repeated in A_k (a diagonal) feeds only the diagonal, and a
dim of size 1 that einsum broadcasts gathers the ⊕ of the messages along it.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

_LETTERS = string.ascii_uppercase + string.ascii_lowercase


@dataclass(frozen=True)
class Contraction:
    """``out[c] = ⊕_{labels of a, b not in c} a[a_labels] ⊗ b[b_labels]`` for label strings
    without repeats; ``sizes`` gives every label's size (an ``out`` label in neither
    operand is a broadcast)."""

    a: str
    b: str
    out: str
    sizes: tuple[tuple[str, int], ...]

    @property
    def present(self) -> str:
        """The output's labels that an operand has, in the output's order."""
        return "".join(label for label in self.out if label in self.a + self.b)

    @property
    def spread(self) -> tuple[int, ...]:
        """The output's shape with 1 for each label neither operand has: a result over
        :attr:`present` reshaped to it expands to the output."""
        return tuple(
            n if label in self.present else 1 for label, n in zip(self.out, self.size(self.out))
        )

    def size(self, labels: str) -> tuple[int, ...]:
        return label_sizes(self.sizes, labels)

    def summed(self, own: str, other: str) -> tuple[int, ...]:
        """Dims of an operand (labels ``own``) that neither the other operand nor the
        output has: ⊕-reduced first."""
        return tuple(i for i, label in enumerate(own) if label not in other + self.out)

    def layout(self) -> tuple[str, str, str, str]:
        """(batch, left, inner, right) labels of the semiring batched matmul
        ``(batch, left, inner) × (batch, inner, right)``."""
        a, b = self.kept(self.a, self.b), self.kept(self.b, self.a)
        batch = "".join(label for label in self.out if label in a and label in b)
        left = "".join(label for label in a if label in self.out and label not in b)
        right = "".join(label for label in b if label in self.out and label not in a)
        inner = "".join(label for label in a if label in b and label not in self.out)
        return batch, left, inner, right

    def kept(self, own: str, other: str) -> str:
        """An operand's labels after its own ⊕-reduction (:meth:`summed`)."""
        return "".join(label for label in own if label in other + self.out)


def label_sizes(sizes: tuple[tuple[str, int], ...], labels: str) -> tuple[int, ...]:
    table = dict(sizes)
    return tuple(table[label] for label in labels)


def contraction_dims(labels: str, order: str) -> tuple[int, ...]:
    """The permutation taking a tensor with ``labels`` to the label order ``order``."""
    return tuple(labels.index(label) for label in order)


@dataclass(frozen=True)
class EinsumPlan:
    """One ``torch.einsum(equation, *operands)`` call, its labels made explicit: each
    operand's labels (ellipsis dims as letters the equation does not use), the output's,
    and every label's size."""

    terms: tuple[str, ...]
    out: str
    sizes: tuple[tuple[str, int], ...]
    shapes: tuple[tuple[int, ...], ...]

    def others(self, k: int, operands: Sequence[Tensor]) -> Tensor:
        """The real Jacobian factor of operand ``k``: the other operands contracted over
        every label that neither the output nor operand ``k`` has (labels
        :meth:`others_labels`); a scalar 1 for a single operand."""
        labels = self.others_labels(k)
        rest = [(t, x) for m, (t, x) in enumerate(zip(self.terms, operands)) if m != k]
        if not rest:
            return torch.ones((), dtype=operands[k].dtype, device=operands[k].device)
        equation = ",".join(t for t, _ in rest) + "->" + labels
        return torch.einsum(equation, *(x for _, x in rest))

    def others_labels(self, k: int) -> str:
        seen = "".join(t for m, t in enumerate(self.terms) if m != k)
        wanted = self.out + self.terms[k]
        return "".join(dict.fromkeys(label for label in seen if label in wanted))

    def contraction(self, k: int) -> Contraction:
        """The contraction giving operand ``k``'s message over its distinct labels (in the
        order they first appear in its term) at full label sizes."""
        own = "".join(dict.fromkeys(self.terms[k]))
        return Contraction(self.out, self.others_labels(k), own, self.sizes)

    def positions(self, k: int, device: torch.device) -> Tensor | None:
        """The flat position in operand ``k`` that each element of its message (distinct
        labels, full sizes) lands on; None where that is each element's own (no repeated
        label, no broadcast size-1 dim)."""
        term, shape = self.terms[k], self.shapes[k]
        own = "".join(dict.fromkeys(term))
        full = label_sizes(self.sizes, own)
        if own == term and full == tuple(shape):
            return None
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        coords = torch.meshgrid(*(torch.arange(n, device=device) for n in full), indexing="ij")
        flat = torch.zeros(full, dtype=torch.long, device=device)
        for d, label in enumerate(term):
            if shape[d] != 1:
                flat = flat + coords[own.index(label)] * strides[d]
        return flat.reshape(-1)

    def numel(self, k: int) -> int:
        return math.prod(self.shapes[k])


def einsum_plan(equation: str, shapes: Sequence[Sequence[int]]) -> EinsumPlan:
    """Parse ``equation`` (explicit ``->`` output or implicit, ``...`` broadcasting, spaces)
    for operands of ``shapes``; the errors are torch's (the forward ran first)."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    raw = lhs.split(",")
    spare = iter(c for c in _LETTERS if c not in equation)
    width = max(
        (len(shape) - len(t.replace("...", "")) for t, shape in zip(raw, shapes) if "..." in t),
        default=0,
    )
    ellipsis = "".join(next(spare) for _ in range(width))
    terms = []
    for t, shape in zip(raw, shapes):
        if "..." in t:
            n = len(shape) - len(t.replace("...", ""))
            t = t.replace("...", ellipsis[width - n :])
        terms.append(t)
    if arrow:
        out = rhs.replace("...", ellipsis)
    else:
        counts = "".join(t.replace("...", "") for t in raw)
        out = ellipsis + "".join(sorted(c for c in set(counts) if counts.count(c) == 1))
    sizes: dict[str, int] = {}
    for t, shape in zip(terms, shapes):
        for label, n in zip(t, shape):
            sizes[label] = n if sizes.get(label, 1) == 1 else sizes[label]
    return EinsumPlan(
        tuple(terms), out, tuple(sorted(sizes.items())), tuple(tuple(s) for s in shapes)
    )


HELPERS = ("einsum_plan",)
