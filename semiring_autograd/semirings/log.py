"""The Log semiring (logaddexp, +) over log|w|: the log of the total path weight."""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import log_entries
from ..kernels import standardize as kernels_standardize
from ..kernels.workspace import scratch
from .base import InlineForms, Semiring, _message, keeps_algebra
from .frozen import kept_operand
from .log_space import LOG_TERMS, LogSpaceGemm, log_loo, matmul_by_weight
from .tensor_ops import NEG_INF, filled, folded_middle, scatter_extreme


class Log(Semiring):
    """(logaddexp, +) over log|w|: log of the total |path| weight, -inf where no path."""

    name = "log"
    terms = LOG_TERMS
    inline = InlineForms(
        lift="S.log_abs({w})",
        mul="{a} + {b}",
        add="S.log_add({a}, {b})",
        mul_lift="S.plus_log_abs({a}, {w})",
    )

    def zero(self, shape, like):
        return (filled(shape, NEG_INF, like),)

    def one(self, shape, like):
        return (filled(shape, 0.0, like),)

    def lift(self, w):
        return (self.log_abs(w),)

    def add(self, a, b):
        return (self.log_add(a[0], b[0]),)

    def mul_lift(self, a, w):
        return (self.plus_log_abs(a[0], w),)

    @staticmethod
    def log_abs(w: Tensor) -> Tensor:
        """log|w| (-inf at 0), one pass on the CPU kernel where it applies."""
        fused = log_entries.plus_log_abs(None, w)
        return torch.log(w.abs()) if fused is None else fused

    @staticmethod
    def plus_log_abs(a: Tensor, w: Tensor) -> Tensor:
        """a + log|w| (a ⊗ lift(w)), one pass on the CPU kernel where it applies."""
        fused = log_entries.plus_log_abs(a, w)
        return a + torch.log(w.abs()) if fused is None else fused

    @staticmethod
    def log_add(a: Tensor, b: Tensor) -> Tensor:
        """log(e^a + e^b) (a ⊕ b, torch.logaddexp), one pass on the CPU kernel where it
        applies."""
        fused = log_entries.log_add(a, b)
        return torch.logaddexp(a, b) if fused is None else fused

    def mul(self, a, b):
        return (a[0] + b[0],)

    def add_into(self, acc, b):
        """acc ← log(e^acc + e^b) in place: one kernel pass on the CPU where acc and b lie
        in rows (``log_entries.log_add_``), else ``torch.logaddexp`` into acc; the default
        (⊕, then a copy) for a subclass with its own ⊕."""
        if type(self).add is not Log.add or type(self).log_add is not Log.log_add:
            return super().add_into(acc, b)
        if not log_entries.log_add_(acc[0], b[0]):
            torch.logaddexp(acc[0], b[0], out=acc[0])

    def softmax_backward(self, a, probs, dim):
        """The default's paths with log p taken once: for t = a + log p and the leave-one-out
        L_i = log Σ_{j≠i} e^{t_j}, log(e^{t_i + log|1 − p_i|} + e^{L_i + log p_i}); one
        kernel call per tensor on the CPU."""
        g = a[0]
        fused = log_entries.softmax_backward(g, probs, dim)
        if fused is not None:
            return (fused,)
        p = _message(probs)
        log_p = self.log_abs(p)
        t = g + log_p
        return (self.log_add(self.plus_log_abs(t, 1 - p), log_loo(t, dim) + log_p),)

    def standardize(self, a, centred, rstd, dims):
        """Layer norm's composition in one kernel call per tensor on the CPU (where no
        row's terms hold NaN or +inf)."""
        # a subclass with its own ⊕ or ⊗ takes the composition
        if keeps_algebra(type(self), Log):
            fused = kernels_standardize.standardize_log(a[0], centred, rstd, dims)
            if fused is not None:
                return (fused,)
        return super().standardize(a, centred, rstd, dims)

    def readout(self, a):
        return a[0]

    def _reduce(self, a, dims, keepdim):
        folded = folded_middle(self, a, dims, keepdim)
        if folded is not None:
            return folded
        return (torch.logsumexp(a[0], dim=dims, keepdim=keepdim),)

    def loo(self, a, dim):
        return (log_loo(a[0], dim),)

    def matmul(self, a, b):
        return (LogSpaceGemm.run(a[0], b[0], None, None)[0],)

    def linear_lift(self, w: Tensor) -> Tensor:
        """exp(lift(w)) = |w|, computed without exp or log: kept per weight version inside
        ``sa.frozen_weights``, else in scratch storage (valid for the calling matmul only)."""
        kept = kept_operand("abs", w, torch.abs)
        if kept is not None:
            return kept
        if w.dim() >= 2 and w.stride(-2) == 1 and w.stride(-1) != 1:
            # a transposed operand (attention's values): |w| in its own layout, transposed
            # back as a view (the GEMM reads it so), not a transposing copy
            held = w.mT
            return torch.abs(held, out=scratch("linear_lift", held.shape, w.dtype, w.device)).mT
        return torch.abs(w, out=scratch("linear_lift", w.shape, w.dtype, w.device))

    def matmul_lift(self, a, w):
        """a ⊗ lift(w) summed over k: by a 2-D weight, one GEMM of the shifted rows of
        ``a`` when every row has a term (the pass that shifts them tells), else only the
        rows with a term (``on_live_rows``); a product too small for it to prune, at once
        (``log_space.matmul_by_weight``)."""
        return matmul_by_weight(self, a, w, self.linear_lift)

    def _matmul_lift(self, a, w):
        return (LogSpaceGemm.run(a[0], None, None, None, b_linear=self.linear_lift(w))[0],)

    def index_add(self, a, index, size):
        x = a[0]
        top = scatter_extreme(x, index, size, "amax", NEG_INF)
        shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        idx = index.reshape(-1)
        z = torch.zeros_like(top).index_add(0, idx, torch.exp(x - shift[idx]))
        return (torch.log(z) + shift,)
