"""The Entropy semiring: the entropy of the distribution over paths, in log space."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels
from ..kernels import log_entries
from ..kernels import standardize as kernels_standardize
from ..kernels.workspace import scratch
from .base import Semiring, Value, _message, keeps_algebra
from .batching import batched
from .frozen import kept_operand
from .log_space import LOG_TERMS, LogSpaceGemm, matmul_by_weight, top_two_shifts
from .tensor_ops import (
    NEG_INF,
    POS_INF,
    filled,
    folded_middle,
    ratio_or_zero,
    safe_weight,
    scatter_extreme,
)


def _same_shape(a: Value) -> Value:
    """The components (log Z, r) broadcast to one shape (as they are, where they share it)."""
    la, r = a
    return (la, r) if la.shape == r.shape else tuple(torch.broadcast_tensors(la, r))


def _entropy_loo(la: Tensor, r: Tensor, dim: int) -> Value:
    """Leave-one-out ⊕ of Entropy values (log Z, r) along ``dim``, with the shifts of
    :func:`log_loo`: r of the rest is Σ_{j≠i} w_j r_j / Σ_{j≠i} w_j (0 where no j has
    weight). Fresh tensors are updated in place (fewer passes)."""
    n = la.shape[dim]
    if n <= 1:
        return torch.full_like(la, NEG_INF), torch.zeros_like(r)
    if dim in (-1, la.dim() - 1):
        fused = kernels.loo_log(la, r)
        if fused is not None:
            return fused
    first, s1, s2 = top_two_shifts(la, dim)
    e = torch.sub(la, s1).exp_()
    er = e * r
    den = e.sum(dim, keepdim=True).sub(e).clamp_min_(0.0)
    # den ≥ 1 but at the argmax (its sum is replaced below) and in all -inf rows (0/0)
    rest = torch.sub(er.sum(dim, keepdim=True), er, out=None if batched(er) else er)
    rest_r = ratio_or_zero(rest, den)
    rest_l = den.log_().add_(s1)
    e2 = torch.sub(la, s2).exp_()
    e2 = e2.scatter(dim, first, 0.0) if batched(e2) else e2.scatter_(dim, first, 0.0)
    den2 = e2.sum(dim, keepdim=True)
    at_r = ratio_or_zero(e2.mul_(r).sum(dim, keepdim=True), den2)
    at_l = den2.log_().add_(s2)
    if batched(rest_l, rest_r):  # torch.vmap batches scatter out of place only
        return rest_l.scatter(dim, first, at_l), rest_r.scatter(dim, first, at_r)
    return rest_l.scatter_(dim, first, at_l), rest_r.scatter_(dim, first, at_r)


def _entropy_weights(w: Tensor) -> Tensor:
    """The Entropy GEMM operand of lift(w) (…, k, n): [|w|; |w|·(-log|w|)] stacked along the
    rows (…, 2k, n), kept per weight version inside ``sa.frozen_weights``, else in scratch
    storage (valid for the calling matmul only)."""
    kept = kept_operand("entropy", w, _fresh_entropy_weights)
    if kept is not None:
        return kept
    k, n = w.shape[-2:]
    out = scratch("entropy_weights", (*w.shape[:-2], 2 * k, n), w.dtype, w.device)
    return _entropy_weights_into(w, out)


def _fresh_entropy_weights(w: Tensor) -> Tensor:
    """:func:`_entropy_weights` in a fresh tensor."""
    k, n = w.shape[-2:]
    return _entropy_weights_into(w, w.new_empty(*w.shape[:-2], 2 * k, n))


def _entropy_weights_into(w: Tensor, out: Tensor) -> Tensor:
    """[|w|; |w|·(-log|w|)] written into ``out`` (…, 2k, n). -|w|log|w| is 0 at w = 0 (where
    it is 0·inf = NaN) and at NaN, whose Z sums are NaN anyway."""
    k = w.shape[-2]
    if kernels.entropy_weights(w, out):
        return out
    magnitude = torch.abs(w, out=out[..., :k, :])
    # in place, several times faster than xlogy, and nan_to_num_ than a masked fill, on CPU
    weighted = torch.log(magnitude, out=out[..., k:, :]).mul_(magnitude).neg_()
    weighted.nan_to_num_(nan=0.0, posinf=POS_INF, neginf=NEG_INF)
    return out


class Entropy(Semiring):
    """The expectation semiring ⟨|w|, −|w| log|w|⟩ kept in log space as (log Z, r), with
    r = (Σ_paths p̃·(−log p̃)) / Z. ⊕: (logaddexp, Z-weighted mean of r); ⊗: (+, +).
    The readout log Z + r is the entropy (nats) of paths with p ∝ Π|w| (0 for ≤ 1 path)."""

    name = "entropy"
    terms = LOG_TERMS
    n_components = 2

    def zero(self, shape, like):
        return (filled(shape, NEG_INF, like), filled(shape, 0.0, like))

    def one(self, shape, like):
        return (filled(shape, 0.0, like), filled(shape, 0.0, like))

    def lift(self, w):
        la = torch.log(w.abs())
        return (la, (-la).masked_fill(w == 0, 0.0))

    def add(self, a, b):
        fused = kernels.entropy_add(a[0], a[1], b[0], b[1])
        if fused is not None:
            return fused
        la = torch.logaddexp(a[0], b[0])
        r = safe_weight(a[0], la) * a[1] + safe_weight(b[0], la) * b[1]
        return (la, r)

    def add_into(self, acc, b):
        """acc ← acc ⊕ b in place, (log Z, r) each: one kernel pass on the CPU where acc and
        b lie in rows (``log_entries.entropy_add_``), else the default (⊕, then a copy), as
        for a subclass with its own ⊕."""
        if type(self).add is Entropy.add and log_entries.entropy_add_(acc, b):
            return
        super().add_into(acc, b)

    def mul(self, a, b):
        la = a[0] + b[0]
        return (la, (a[1] + b[1]).masked_fill(torch.isneginf(la), 0.0))

    def readout(self, a):
        la, r = _same_shape(a)
        h = (la + r).clamp_min(0.0)
        return torch.where(torch.isneginf(la), torch.zeros_like(h), h)

    def _reduce(self, a, dims, keepdim):
        la, r = a
        if dims == (la.dim() - 1,) and la.shape[-1] > 0:
            fused = kernels.entropy_reduce_rows(la, r)
            if fused is not None:
                return fused if keepdim else tuple(c.squeeze(-1) for c in fused)
        folded = folded_middle(self, a, dims, keepdim)
        if folded is not None:
            return folded
        total = torch.logsumexp(la, dim=dims, keepdim=True)
        rs = (safe_weight(la, total) * r).sum(dim=dims, keepdim=keepdim)
        return (total if keepdim else total.squeeze(dims), rs)

    def matmul(self, a, b):
        la, ra = _same_shape(a)
        lb, rb = _same_shape(b)
        return LogSpaceGemm.run(la, lb, ra, rb)

    def matmul_lift(self, a, w):
        return matmul_by_weight(self, a, w, _entropy_weights)

    def _matmul_lift(self, a, w):
        la, ra = _same_shape(a)
        return LogSpaceGemm.run(la, None, ra, None, b_linear=_entropy_weights(w))

    def mul_lift(self, a, w):
        fused = kernels.entropy_mul_lift(a[0], a[1], w)
        if fused is not None:
            return fused
        log_w = torch.log(w.abs())  # -inf at 0: no edge
        la = a[0] + log_w
        return (la, (a[1] - log_w).masked_fill(torch.isneginf(la), 0.0))

    def softmax_backward(self, a, probs, dim):
        """The default's paths in one pass per row on the CPU kernel: t = a ⊗ lift(p) and
        its leave-one-out ⊕ L give t ⊗ lift(1 − p) ⊕ L ⊗ lift(p) (|−p| = p)."""
        fused = kernels.entropy_softmax_backward(*_same_shape(a), _message(probs), dim)
        return super().softmax_backward(a, probs, dim) if fused is None else fused

    def standardize(self, a, centred, rstd, dims):
        """Layer norm's composition in one kernel call per tensor on the CPU (where no
        row's terms hold NaN or +inf and its r is finite)."""
        # a subclass with its own ⊕ or ⊗ takes the composition
        if keeps_algebra(type(self), Entropy):
            fused = kernels_standardize.entropy_standardize(*_same_shape(a), centred, rstd, dims)
            if fused is not None:
                return fused
        return super().standardize(a, centred, rstd, dims)

    def loo(self, a, dim):
        return _entropy_loo(*_same_shape(a), dim)

    def index_add(self, a, index, size):
        la, r = _same_shape(a)
        top = scatter_extreme(la, index, size, "amax", NEG_INF)
        shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        idx = index.reshape(-1)
        w = torch.exp(la - shift[idx])
        z = torch.zeros_like(top).index_add(0, idx, w)
        num = torch.zeros_like(top).index_add(0, idx, w * r)
        out_r = torch.where(z > 0, num / torch.where(z > 0, z, torch.ones_like(z)), 0.0)
        return (torch.log(z) + shift, out_r)
