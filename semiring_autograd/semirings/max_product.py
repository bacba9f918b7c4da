"""The MaxProduct semiring (max, ×) over |w|: the weight of the strongest path."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels
from ..kernels import extreme_entries
from ..kernels import standardize as kernels_standardize
from .tensor_level import TensorMaxProduct, tensor_level_instance
from .base import InlineForms, Semiring, Terms, Value, keeps_algebra
from .tensor_ops import (
    CHUNK_ELEMENTS,
    all_finite,
    batch_flatten,
    filled,
    loo_max,
    on_live_rows,
    scatter_extreme,
)


class MaxProduct(Semiring):
    """(max, ×) over |w|: the weight of the strongest path. Zero is 0, one is 1."""

    name = "max_product"
    terms = Terms(0.0, nan_at_zero_times_inf=True)  # a path weight above 0; 0·∞ is NaN
    inline = InlineForms(
        lift="{w}.abs()", mul="{a} * {b}", add="torch.maximum({a}, {b})", mul_lift="{a} * {w}.abs()"
    )

    def __new__(cls, granularity: str = "element"):
        tensor_level = tensor_level_instance(cls, MaxProduct, granularity, TensorMaxProduct)
        return tensor_level if tensor_level is not None else super().__new__(cls)

    def __init__(self, granularity: str = "element"):
        """``granularity="tensor"``: the paper's tensor-level max-gradient, a
        :class:`TensorMaxProduct` (see :mod:`semiring_autograd.semirings.tensor_level`)."""

    def zero(self, shape, like):
        return (filled(shape, 0.0, like),)

    def one(self, shape, like):
        return (filled(shape, 1.0, like),)

    def lift(self, w):
        return (w.abs(),)

    def add(self, a, b):
        return (torch.maximum(a[0], b[0]),)

    def mul(self, a, b):
        return (a[0] * b[0],)

    def readout(self, a):
        return a[0]

    def _reduce(self, a, dims, keepdim):
        return (_amax(a[0], dims, keepdim),)

    def loo(self, a, dim):
        return (loo_max(a[0], dim, 0.0),)

    def matmul(self, a, b):
        return (max_times(a[0], b[0]),)

    def matmul_lift(self, a, w):
        result = on_live_rows(a, self.terms, w, self._matmul_lift, (0.0,))
        return result or self._matmul_lift(a, w)

    def _matmul_lift(self, a, w):
        return (max_times(a[0], w, abs_b=True),)

    def index_add(self, a, index, size):
        return (scatter_extreme(a[0], index, size, "amax", 0.0),)

    def softmax_backward(self, a: Value, probs: Tensor, dim: int) -> Value:
        """The default formula, max(a_i·|p_i(1 − p_i)|, (max_{j≠i} a_j·|p_j|)·|p_i|), in
        one pass over the rows by the fused CPU kernel where it applies (the same bits but
        for the sign of a zero where +0 and −0 tie for a row's largest term)."""
        fused = extreme_entries.softmax_backward_max(a[0], probs, dim)
        return (fused,) if fused is not None else super().softmax_backward(a, probs, dim)

    def standardize(self, a, centred, rstd, dims):
        """Layer norm's composition in one kernel call per tensor on the CPU (the
        composition's values to the bit)."""
        # a subclass with its own ⊕ or ⊗ takes the composition
        if keeps_algebra(type(self), MaxProduct):
            fused = kernels_standardize.standardize_max(a[0], centred, rstd, dims)
            if fused is not None:
                return (fused,)
        return super().standardize(a, centred, rstd, dims)


def max_times(a: Tensor, b: Tensor, abs_b: bool = False) -> Tensor:
    """max_k a[..., i, k] · b[..., k, j] for non-negative a, b (0 where k is empty), or
    with |b| when ``abs_b`` (b a real derivative): the fused kernel, else in row blocks so
    m×k×n is never held at once. Operands with a NaN or an infinity take the blocks, which
    propagate NaN (and give ∞·0 = NaN) as torch does; the kernel drops NaN terms. A
    transposed ``a`` with more rows than b has columns (the key's message in attention, (b
    ⊗ a)ᵀ there) is read as the product's transpose, bᵀ ⊗ aᵀ, the same terms: copying ``a``
    to rows would cost more than the product."""
    if _transposed(a, b):
        return max_times((b.abs() if abs_b else b).mT, a.mT).mT
    a3, b3, batch = batch_flatten(a, b)
    m, k, n = a3.shape[-2], a3.shape[-1], b3.shape[-1]
    if k == 0:
        return a.new_zeros((*batch, m, n))
    fused = _fused(a3, b3, abs_b)
    if fused is not None:
        return fused.reshape(*batch, m, n)
    if abs_b:
        b3 = b3.abs()
    rows = max(1, CHUNK_ELEMENTS // max(1, k * n * a3.shape[0]))
    out = (
        torch.cat(
            [
                (a3[:, s : s + rows, :, None] * b3[:, None, :, :]).amax(dim=-2)
                for s in range(0, m, rows)
            ],
            dim=-2,
        )
        if m
        else a3.new_zeros((a3.shape[0], 0, n))
    )
    return out.reshape(*batch, m, n)


def _amax(x: Tensor, dims: tuple[int, ...], keepdim: bool) -> Tensor:
    """``x.amax(dims)``; where x is stored as its transpose (``max_times``'s transposed
    products) and ``dims`` leave its last two dims, amax of the stored layout, transposed
    back: the same maxima, read in memory order."""
    last = x.dim() - 2
    if last > 0 and not x.is_contiguous() and x.mT.is_contiguous() and max(dims) < last:
        return x.mT.amax(dim=dims, keepdim=keepdim).mT
    return x.amax(dim=dims, keepdim=keepdim)


def _transposed(a: Tensor, b: Tensor) -> bool:
    """Whether CPU ``a`` (…, m, k) is stored as its transpose (k, m rows) and b (…, k, n)
    has n < m columns: then ``max_times`` reads the product transposed."""
    if a.dim() < 2 or b.dim() < 2 or not a.is_cpu or a.is_contiguous():
        return False
    return b.shape[-1] < a.shape[-2] and a.mT.is_contiguous()


def _fused(a3: Tensor, b3: Tensor, abs_b: bool) -> Tensor | None:
    """The fused max_times of 3-D operands whose entries are all finite, else None: on the
    CPU the kernel tests the entries as it packs and reads them (no pass of its own); on
    other devices a scan chooses."""
    if a3.device.type == "cpu":
        return kernels.max_times_finite(a3, b3, abs_b=abs_b)
    return kernels.max_times(a3, b3, abs_b=abs_b) if all_finite(a3, b3) else None
