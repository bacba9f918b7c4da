"""The formula primitives on the one component of a one-component semiring's values.

A module generated for a one-component built-in semiring (MaxProduct, Log, Counting,
Boolean) holds each value as its single component tensor. It spells ⊕, ⊗ and lift as
the semiring's :class:`InlineForms`, the structural primitives as tensor expressions
(``codegen/formulas.py: STRUCTURAL``), and calls the rest here: each is its namesake in :mod:`.primitives` on a one-tuple.
"""

from __future__ import annotations

from numbers import Number
from typing import Any, Sequence

import torch
from torch import Tensor

from ..semirings.base import Semiring
from . import primitives as P
from .einsum_helpers import Contraction
from .primitives import Ref, as_message


def lift(S: Semiring, w: Tensor | Number, ref: Ref) -> Tensor:
    return S.lift(as_message(w, ref))[0]


def zero(S: Semiring, shape: Sequence[int], ref: Ref) -> Tensor:
    return P.zero(S, shape, ref)[0]


def sum(S: Semiring, a: Tensor, dims: Any = None, keepdim: bool = False) -> Tensor:
    return S.sum((a,), dims, keepdim)[0]


def sum_to(S: Semiring, a: Tensor, shape: Sequence[int]) -> Tensor:
    if a.shape == tuple(shape):
        return a
    return S.sum_to((a,), shape)[0]


def matmul(S: Semiring, a: Tensor, b: Tensor) -> Tensor:
    return S.matmul((a,), (b,))[0]


def contract(S: Semiring, a: Tensor, b: Tensor, spec: Contraction) -> Tensor:
    return P.contract(S, (a,), (b,), spec)[0]


def contract_lift(S: Semiring, a: Tensor, w: Tensor, spec: Contraction, ref: Ref) -> Tensor:
    return P.contract_lift(S, (a,), w, spec, ref)[0]


def matmul_lift(S: Semiring, a: Tensor, w: Tensor, ref: Ref) -> Tensor:
    if w.dtype in P.OWN_PRECISION:  # weight_operands' answer, inline: (a, w) as they are
        return S.matmul_lift((a,), w)[0]
    return S.matmul_lift(*P.weight_operands(S, (a,), w, ref))[0]


def mul_lift(S: Semiring, a: Tensor, w: Tensor | Number, ref: Ref) -> Tensor:
    return S.mul_lift((a,), as_message(w, ref))[0]


def loo(S: Semiring, a: Tensor, dim: int) -> Tensor:
    return P.loo(S, (a,), dim)[0]


def softmax_backward(S: Semiring, a: Tensor, probs: Tensor, dim: int) -> Tensor:
    return S.softmax_backward((a,), probs, dim)[0]


def standardize(S: Semiring, a: Tensor, centred: Tensor, rstd: Tensor, dims: Any) -> Tensor:
    return P.standardize(S, (a,), centred, rstd, dims)[0]


def index_add(S: Semiring, a: Tensor, index: Tensor, size: int) -> Tensor:
    return S.index_add((a,), index, size)[0]


def getitem_backward(S: Semiring, a: Tensor, shape: Sequence[int], index: Any) -> Tensor:
    return P.getitem_backward(S, (a,), shape, index)[0]


def fill_zero(
    S: Semiring, parts: Sequence[Tensor | None], shapes: Sequence[Sequence[int]], ref: Ref
) -> list[Tensor]:
    return [zero(S, s, ref) if p is None else p for p, s in zip(parts, shapes)]


def cast(S: Semiring, a: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    return a.to(device)
