"""MaxProduct's, Boolean's and SignedMaxProduct's ``softmax_backward`` on fused CPU
operators (``extreme_entries.h``): the message at softmax's input in one operator call per
tensor, where the semiring formula (``Semiring.softmax_backward``) takes about a dozen
passes over the rows. Each is that formula's operations entry by entry, so the results are
the formula's to the bit (MaxProduct's NaN rows included; the signed kernel declines rows
holding NaN), but for the sign of a zero where +0 and −0 tie for a row's largest term.

Each takes CPU operands of one shape along the last dim (``softmax_backward_max``: g and p,
``softmax_backward_signed``: g's two ends and p, float32 or float64 of one dtype;
``softmax_backward_or``: g bool, p float32 or float64), copied to contiguous rows where
they are not, and returns None otherwise, or where the kernels are off, unbuilt or failed
their check (``kernels``'s modes); the callers then take the torch formula.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _nonempty_ready
from .operators import op


def _rows(g: Tensor, p: Tensor, dim: int) -> bool:
    """Whether ``g`` and ``p`` are one shape with ``dim`` their last dim."""
    return g.dim() > 0 and dim in (-1, g.dim() - 1) and g.shape == p.shape


def softmax_backward_max(g: Tensor, p: Tensor, dim: int) -> Tensor | None:
    """MaxProduct's message at softmax's input s from ``g`` at its output p = softmax(s)
    along ``dim`` (the last): with L_i = max_{j≠i} g_j·|p_j|, max(g_i·|p_i(1 − p_i)|,
    L_i·|p_i|), by the fused CPU kernel; None where it does not apply."""
    if not _rows(g, p, dim) or not _nonempty_ready("softmax_backward_max", g, p):
        return None
    return op("softmax_backward_max")(g.contiguous(), p.contiguous())


def softmax_backward_or(g: Tensor, p: Tensor, dim: int) -> Tensor | None:
    """Boolean's message at softmax's input from the bool ``g`` at its output ``p`` along
    ``dim`` (the last): (g_i ∧ p_i(1 − p_i) ≠ 0) ∨ ((∨_{j≠i} g_j ∧ p_j ≠ 0) ∧ p_i ≠ 0), by
    the fused CPU kernel; None where it does not apply."""
    if g.dtype != torch.bool or not g.is_cpu or not _rows(g, p, dim):
        return None
    if not _nonempty_ready("softmax_backward_or", p):
        return None
    return op("softmax_backward_or")(g.contiguous(), p.contiguous())


def softmax_backward_signed(g: tuple[Tensor, Tensor], p: Tensor, dim: int) -> tuple | None:
    """SignedMaxProduct's message at softmax's input from the pair ``g`` = (hi, lo) at its
    output ``p`` along ``dim`` (the last): g_i ⊗ lift(p_i(1 − p_i)) ⊕ (⊕_{j≠i} g_j ⊗
    lift(p_j)) ⊗ lift(−p_i), by the fused CPU kernel; None where it does not apply or a row
    holds NaN."""
    hi, lo = g
    if not (_rows(hi, p, dim) and lo.shape == p.shape):
        return None
    if not _nonempty_ready("softmax_backward_signed", hi, lo, p):
        return None
    out_hi, out_lo, declined = op("softmax_backward_signed")(
        hi.contiguous(), lo.contiguous(), p.contiguous()
    )
    return None if declined else (out_hi, out_lo)
