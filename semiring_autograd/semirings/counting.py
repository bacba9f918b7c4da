"""The Counting semiring: the number of non-zero paths, kept in log space."""

from __future__ import annotations

import torch

from .base import InlineForms, Semiring, message_dtype
from .frozen import kept_operand
from .log import Log
from .tensor_ops import NEG_INF, nonzero_operand


class Counting(Log):
    """(+, ×) on path counts, kept in log space: lift(w) = 1 if w ≠ 0 else 0; the readout
    is the natural log of the number of non-zero paths (-inf where none)."""

    name = "counting"
    inline = InlineForms(
        lift=None,  # where(w != 0, 0, -inf) needs w twice: the method's one call
        mul="{a} + {b}",
        add="S.log_add({a}, {b})",
        mul_lift="torch.where({w} == 0, -math.inf, {a})",
    )

    def lift(self, w):
        return (torch.where(w != 0, 0.0, NEG_INF).to(message_dtype(w.dtype)),)

    def linear_lift(self, w):
        """exp(lift(w)) = (w ≠ 0) as 0/1 in the message dtype: kept per weight version
        inside ``sa.frozen_weights``, else in scratch storage (valid for the calling matmul
        only)."""
        dtype = message_dtype(w.dtype)
        kept = kept_operand(("nonzero", dtype), w, lambda w: torch.ne(w, 0).to(dtype))
        return nonzero_operand(w, dtype) if kept is None else kept

    def mul_lift(self, a, w):
        return (torch.where(w == 0, NEG_INF, a[0]),)

    #: the generic formula: Log's override reads lift(w) as log|w|
    softmax_backward = Semiring.softmax_backward
