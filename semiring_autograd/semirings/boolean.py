"""The Boolean semiring (or, and): whether a path with all derivatives non-zero exists."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import extreme_entries
from .base import InlineForms, Semiring, Terms, Value
from .tensor_ops import nonzero_operand, on_live_rows


class Boolean(Semiring):
    """(or, and): whether any path with all local derivatives non-zero exists."""

    name = "boolean"
    terms = Terms(False)  # a true entry
    inline = InlineForms(
        lift="{w} != 0", mul="{a} & {b}", add="{a} | {b}", mul_lift="{a} & ({w} != 0)"
    )

    def zero(self, shape, like):
        return (torch.zeros(tuple(shape), dtype=torch.bool, device=like.device),)

    def one(self, shape, like):
        return (torch.ones(tuple(shape), dtype=torch.bool, device=like.device),)

    def lift(self, w):
        return (w != 0,)

    def add(self, a, b):
        return (a[0] | b[0],)

    def mul(self, a, b):
        return (a[0] & b[0],)

    def readout(self, a):
        return a[0]

    def _reduce(self, a, dims, keepdim):
        return (a[0].any(dim=dims, keepdim=keepdim),)

    def loo(self, a, dim):
        count = a[0].to(torch.int64)
        return ((count.sum(dim, keepdim=True) - count) > 0,)

    def matmul(self, a, b):
        # a GEMM of 0/1 entries: a sum of 0s and 1s is > 0 exactly when some term is 1, in
        # any float format (no term rounds away and a positive sum never rounds to 0)
        return ((a[0].to(torch.float32) @ b[0].to(torch.float32)) > 0,)

    def matmul_lift(self, a, w):
        """On the GEMM operand w ≠ 0 in scratch storage, without a bool lift(w) and its
        float copy per call; on the live rows and columns only (see ``on_live_rows``)."""
        result = on_live_rows(a, self.terms, w, self._matmul_lift, (False,), torch.bool)
        return result or self._matmul_lift(a, w)

    def _matmul_lift(self, a, w):
        return ((a[0].to(torch.float32) @ nonzero_operand(w, torch.float32)) > 0,)

    def index_add(self, a, index, size):
        x = a[0].to(torch.int64)
        out = x.new_zeros((size, *x.shape[1:])).index_add(0, index.reshape(-1), x)
        return (out > 0,)

    def softmax_backward(self, a: Value, probs: Tensor, dim: int) -> Value:
        """The default formula, (a_i ∧ p_i(1 − p_i) ≠ 0) ∨ ((∨_{j≠i} a_j ∧ p_j ≠ 0) ∧ p_i ≠ 0),
        in one pass over the rows by the fused CPU kernel where it applies (the same
        values)."""
        fused = extreme_entries.softmax_backward_or(a[0], probs, dim)
        return (fused,) if fused is not None else super().softmax_backward(a, probs, dim)
