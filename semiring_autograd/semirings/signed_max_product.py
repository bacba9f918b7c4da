"""The SignedMaxProduct semiring: the largest and smallest signed path products."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels
from ..kernels import extreme_entries
from .tensor_level import TensorSignedMaxProduct, tensor_level_instance
from .base import Semiring, Terms, Value
from .tensor_ops import (
    CHUNK_ELEMENTS,
    NEG_INF,
    POS_INF,
    batch_flatten,
    filled,
    any_nan_or_inf,
    loo_max,
    on_live_rows,
    scatter_extreme,
)


def _fusable(pairs: tuple[Value, ...], reals: tuple[Tensor, ...] = ()) -> bool:
    """Whether the fused kernels agree with ``_signed_combine`` on a product of these
    operands. The kernels read a NaN corner product as "no term"; in the formulas it
    propagates, as in torch. A corner is NaN only from a NaN operand or from ±inf·0, so the
    kernels take operands with no NaN and finite non-empty pairs: no hi = +inf and no
    lo = -inf (the only infinite ends a non-empty pair hi ≥ lo can have besides these are
    the other ends of (+inf, +inf) and (-inf, -inf)), and finite real weights. The empty
    pair (-inf, +inf) passes."""
    pairs_signs = (1, -1) * len(pairs)
    tensors = tuple(c for pair in pairs for c in pair) + reals
    return not any_nan_or_inf(tensors, pairs_signs + (0,) * len(reals))


class SignedMaxProduct(Semiring):
    """Pairs (largest, smallest) signed path product. Zero is (-inf, +inf), the empty set;
    lift(w) = (w, w) and lift(0) = zero; ⊗ takes the extremes of the four cross products."""

    name = "signed_max_product"
    terms = Terms(signed=True)  # a pair with hi ≥ lo (the empty pair is (-inf, +inf))
    n_components = 2

    def __new__(cls, granularity: str = "element"):
        tensor_level = tensor_level_instance(
            cls, SignedMaxProduct, granularity, TensorSignedMaxProduct
        )
        return tensor_level if tensor_level is not None else super().__new__(cls)

    def __init__(self, granularity: str = "element"):
        """``granularity="tensor"``: the paper's tensor-level max-gradient, a
        :class:`TensorSignedMaxProduct` (see :mod:`semiring_autograd.semirings.tensor_level`)."""

    def zero(self, shape, like):
        return (filled(shape, NEG_INF, like), filled(shape, POS_INF, like))

    def one(self, shape, like):
        return (filled(shape, 1.0, like), filled(shape, 1.0, like))

    def lift(self, w):
        nz = w != 0
        return (
            torch.where(nz, w, torch.full_like(w, NEG_INF)),
            torch.where(nz, w, torch.full_like(w, POS_INF)),
        )

    def add(self, a, b):
        return (torch.maximum(a[0], b[0]), torch.minimum(a[1], b[1]))

    def mul(self, a, b):
        return _signed_combine(a, b, None)

    def readout(self, a):
        hi, lo = torch.broadcast_tensors(*a)
        empty = hi < lo
        nan = torch.isnan(hi) | torch.isnan(lo)  # a NaN in either end: both read NaN
        hi = hi.masked_fill(empty, 0.0).masked_fill(nan, float("nan"))
        lo = lo.masked_fill(empty, 0.0).masked_fill(nan, float("nan"))
        return torch.stack([hi, lo])

    def _reduce(self, a, dims, keepdim):
        return (a[0].amax(dim=dims, keepdim=keepdim), a[1].amin(dim=dims, keepdim=keepdim))

    def loo(self, a, dim):
        hi, lo = torch.broadcast_tensors(*a)
        return (loo_max(hi, dim, NEG_INF), -loo_max(-lo, dim, NEG_INF))

    def matmul(self, a, b):
        fused = _signed_matmul_fused(a, b)
        return fused if fused is not None else _signed_combine(a, b, "matmul")

    def matmul_lift(self, a, w):
        result = on_live_rows(a, self.terms, w, self._matmul_lift, (NEG_INF, POS_INF))
        return result or self._matmul_lift(a, w)

    def _matmul_lift(self, a, w):
        fused = _signed_lift_fused(a, w)
        return fused if fused is not None else _signed_combine(a, self.lift(w), "matmul")

    def mul_lift(self, a, w):
        fused = kernels.signed_mul_lift(a[0], a[1], w)  # the formula below, in one pass
        if fused is not None:
            return fused
        # w > 0 keeps the order of (hi, lo), w < 0 swaps it; an empty (-inf, +inf) stays
        # empty either way, and w = 0 is no edge
        pos = w > 0
        hi = torch.where(pos, a[0], a[1]) * w
        lo = torch.where(pos, a[1], a[0]) * w
        # no edge where w = 0, except from a NaN value: NaN ⊗ lift(0) is NaN, as in torch
        zero = (w == 0) & ~(torch.isnan(a[0]) | torch.isnan(a[1]))
        return (hi.masked_fill(zero, NEG_INF), lo.masked_fill(zero, POS_INF))

    def softmax_backward(self, a: Value, probs: Tensor, dim: int) -> Value:
        """The default formula in one pass over the rows by the fused CPU kernel where it
        applies (the same bits; rows holding NaN take the formula)."""
        fused = extreme_entries.softmax_backward_signed(a, probs, dim)
        return fused if fused is not None else super().softmax_backward(a, probs, dim)

    def index_add(self, a, index, size):
        hi, lo = torch.broadcast_tensors(*a)
        return (
            scatter_extreme(hi, index, size, "amax", NEG_INF),
            scatter_extreme(lo, index, size, "amin", POS_INF),
        )


def _nan_empty(a: Value) -> tuple[Tensor, Tensor, bool]:
    """A signed value's (hi, lo) with NaN marking empty entries, and whether it is a point
    (hi == lo wherever it is not empty: a lifted derivative)."""
    hi, lo = torch.broadcast_tensors(*a)
    empty = hi < lo
    point = torch.equal(torch.where(empty, 0.0, hi), torch.where(empty, 0.0, lo))
    nan = torch.tensor(float("nan"), dtype=hi.dtype, device=hi.device)
    return torch.where(empty, nan, hi), torch.where(empty, nan, lo), point


def _signed_matmul_fused(a: Value, b: Value):
    """The fused signed matmul of a and b; None when the kernel is unavailable or a
    dimension is empty. A point operand halves the corner products; a point on the left is
    moved to the right by transposing. (a ⊗ lift(w) for a real w: `_signed_lift_fused`.)"""
    if not kernels.enabled() or not _fusable((a, b)):
        return None
    ah, al, a_point = _nan_empty(a)
    bh, bl, b_point = _nan_empty(b)
    if 0 in (ah.shape[-2], ah.shape[-1], bh.shape[-1]):
        return None
    swap = a_point and not b_point
    if swap:
        ah, al, bh, bl = bh.mT, bl.mT, ah.mT, al.mT
    a3h, b3h, batch = batch_flatten(ah, bh)
    a3l, b3l, _ = batch_flatten(al, bl)
    out = kernels.signed_times(a3h, a3l, b3h, None if (a_point or b_point) else b3l)
    if out is None:
        return None
    shape = (*batch, a3h.shape[-2], b3h.shape[-1])
    hi, lo = (c.reshape(shape) for c in out)
    return (hi.mT, lo.mT) if swap else (hi, lo)


def _signed_lift_fused(a: Value, w: Tensor) -> Value | None:
    """a ⊗ lift(w) (semiring matmul) on the fused path; a 2-D w folds a's batch dimensions
    into its rows. None when the kernel is unavailable or a dimension is empty."""
    if not kernels.enabled() or not _fusable((a,), (w,)):
        return None
    hi, lo = torch.broadcast_tensors(*a)
    if 0 in (hi.shape[-2], hi.shape[-1], w.shape[-1]):
        return None
    if w.dim() == 2:
        shape = (*hi.shape[:-1], w.shape[-1])
        h3, l3, w3 = hi.reshape(1, -1, hi.shape[-1]), lo.reshape(1, -1, lo.shape[-1]), w[None]
    else:
        h3, w3, batch = batch_flatten(hi, w)
        l3 = lo.expand(*batch, *lo.shape[-2:]).reshape(h3.shape)
        shape = (*batch, hi.shape[-2], w.shape[-1])
    out = kernels.pair_lift_matmul(h3, l3, w3, zero_empty=True)
    return None if out is None else tuple(c.reshape(shape) for c in out)


def _signed_combine(a: Value, b: Value, mode: str | None) -> Value:
    """⊗ (mode None) or semiring matmul (mode "matmul") of signed (hi, lo) pairs."""
    if mode == "matmul":
        hi_a, lo_a, hi_b, lo_b = a[0], a[1], b[0], b[1]
        a3h, b3h, batch = batch_flatten(hi_a, hi_b)
        a3l, b3l, _ = batch_flatten(lo_a.expand_as(hi_a), lo_b.expand_as(hi_b))
        m, k, n = a3h.shape[-2], a3h.shape[-1], b3h.shape[-1]
        rows = max(1, CHUNK_ELEMENTS // max(1, 4 * k * n * a3h.shape[0]))
        his, los = [], []
        for s in range(0, m, rows):
            pa = (a3h[:, s : s + rows, :, None], a3l[:, s : s + rows, :, None])
            pb = (b3h[:, None, :, :], b3l[:, None, :, :])
            hi, lo = _signed_combine(pa, pb, None)
            his.append(hi.amax(dim=-2) if k else hi.sum(-2))
            los.append(lo.amin(dim=-2) if k else lo.sum(-2))
        if not his or k == 0:
            shape = (*batch, m, n)
            return (a3h.new_full(shape, NEG_INF), a3h.new_full(shape, POS_INF))
        return (torch.cat(his, -2).reshape(*batch, m, n), torch.cat(los, -2).reshape(*batch, m, n))
    # empty: hi < lo, which a NaN never is, so NaN propagates through the products
    empty_a, empty_b = a[0] < a[1], b[0] < b[1]
    valid = ~(empty_a | empty_b)
    zero = torch.zeros((), dtype=a[0].dtype, device=a[0].device)
    ah, al = torch.where(empty_a, zero, a[0]), torch.where(empty_a, zero, a[1])
    bh, bl = torch.where(empty_b, zero, b[0]), torch.where(empty_b, zero, b[1])
    p1, p2, p3, p4 = ah * bh, ah * bl, al * bh, al * bl
    hi = torch.maximum(torch.maximum(p1, p2), torch.maximum(p3, p4))
    lo = torch.minimum(torch.minimum(p1, p2), torch.minimum(p3, p4))
    return (
        torch.where(valid, hi, torch.full_like(hi, NEG_INF)),
        torch.where(valid, lo, torch.full_like(lo, POS_INF)),
    )
