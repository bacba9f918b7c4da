"""Log-space building blocks shared by Log, Counting and Entropy: the shift-and-GEMM
semiring matmul with its exact fallback, and the leave-one-out logsumexp."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from .. import kernels
from ..kernels import log_entries
from ..kernels.workspace import scratch
from .base import Semiring, Terms, Value, broadcast_shape
from .batching import anywhere, batched
from .tensor_ops import (
    CHUNK_ELEMENTS,
    NEG_INF,
    POS_INF,
    batch_flatten,
    flat_batch,
    on_live_rows,
    ratio_or_zero,
    safe_weight,
    top_two,
    worth_pruning,
)

# The largest shifted message operand of a log-space GEMM kept in scratch storage.
_MESSAGE_SCRATCH_BYTES = 16 << 20


def finite_max(x: Tensor, dim: int) -> Tensor:
    """amax with keepdim, replacing an all -inf slice's max by 0 (a harmless shift)."""
    m = x.amax(dim=dim, keepdim=True)
    return m.masked_fill(~torch.isfinite(m), 0.0)


#: a log value has a term above -inf; -inf + log|±∞ or NaN| is NaN
LOG_TERMS = Terms(NEG_INF, nan_at_zero_times_inf=True)


def gemm_exact_formula(z: Tensor, live: Tensor, tiny: float, may_overflow: bool) -> bool:
    """Whether every shifted GEMM sum in ``z`` (count, m, n) is trustworthy: in the rows
    whose maximum is finite (``live``, (count, m, 1); a row of -inf has no term and its sums
    are rightly 0), none below ``tiny`` (where the products may have underflowed; NaN fails
    too) and, when ``may_overflow``, none infinite. Reductions instead of elementwise masks,
    over the whole tensor when every row is live (several times faster than per row). The
    operator ``log_gemm_finish_`` runs this test on the CPU."""
    if z.numel() == 0:
        return True
    if batched(z, live):  # rows differ: the caller tests each entry
        return False
    if bool(live.all()):
        low, high = torch.aminmax(z)
    else:
        low, high = torch.aminmax(z, dim=-1, keepdim=True)
        low, high = low.masked_fill(~live, POS_INF).min(), high.masked_fill(~live, 0.0).max()
    return bool(low >= tiny) and not (may_overflow and bool(high == POS_INF))


def _finish(
    z: Tensor,
    r: Tensor | None,
    shift: Tensor,
    shift_b: Tensor | None,
    live: Tensor,
    tiny: float,
    may_overflow: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """From the shifted sums ``z`` and r's numerators: (log z + shift (+ shift_b), r / z (0
    where z is 0), the entries to recompute exactly or None), in place."""
    done = kernels.log_gemm_finish(z, r, shift, shift_b, live, tiny, may_overflow)
    if done:
        return z, r, None
    bad = None
    if done is False or not gemm_exact_formula(z, live, tiny, may_overflow):
        bad = (z < tiny) & live
        if may_overflow:  # |w| unshifted: the sum may overflow
            bad |= torch.isinf(z)
    if r is not None:  # 0 where no term (z = 0)
        r = ratio_or_zero(r, z)
    out = z.log_().add_(shift)
    if shift_b is not None:
        out.add_(shift_b)
    return out, r, bad


def _has_term(a3: Tensor, b3: Tensor) -> Tensor:
    """Where the log-space product of a3 (count, m, k) and b3 (count, k, n) has a finite
    term: some k with a3[., i, k] and b3[., k, j] both finite."""
    dtype = a3.dtype
    return (torch.isfinite(a3).to(dtype) @ torch.isfinite(b3).to(dtype)) > 0


def _exact_terms(
    a3: Tensor,
    b3: Tensor,
    ra3: Tensor | None,
    rb3: Tensor | None,
    bad: Tensor,
    out: Tensor,
    r: Tensor | None,
) -> None:
    """Recompute the ``bad`` entries of ``out`` (and ``r``) that have a term, each by an
    exact logsumexp over its k terms (log-space a3 (count, m, k), b3 (count, k, n))."""
    reach = _has_term(a3, b3)
    where = (bad & reach).nonzero()
    step = max(1, CHUNK_ELEMENTS // max(1, a3.shape[-1]))
    for s in range(0, where.shape[0], step):
        bt, i, j = where[s : s + step].unbind(1)
        terms = a3[bt, i, :] + b3[bt, :, j]
        total = torch.logsumexp(terms, dim=-1)
        out[bt, i, j] = total
        if r is not None:
            w = safe_weight(terms, total[:, None])
            r[bt, i, j] = (w * (ra3[bt, i, :] + rb3[bt, :, j])).sum(-1)


def _exact_entries(
    a3: Tensor,
    b3: Tensor,
    ra3: Tensor | None,
    rb3: Tensor | None,
    bad: Tensor,
    out: Tensor,
    r: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """``_exact_terms`` out of place, for operands batched by ``torch.vmap`` (whose rows
    differ in which entries are bad): every entry's exact logsumexp over its k terms, in
    blocks of rows of a3, taken where ``bad`` has a term."""
    reach = _has_term(a3, b3)
    step = max(1, CHUNK_ELEMENTS // max(1, a3.shape[-1] * b3.shape[-1]))
    totals, sums = [], []
    for s in range(0, a3.shape[-2], step):
        terms = a3[:, s : s + step, :, None] + b3[:, None]  # (count, rows, k, n)
        total = torch.logsumexp(terms, dim=-2)
        totals.append(total)
        if r is not None:
            w = safe_weight(terms, total[:, :, None])
            sums.append((w * (ra3[:, s : s + step, :, None] + rb3[:, None])).sum(-2))
    redo = bad & reach
    out = torch.where(redo, torch.cat(totals, 1), out)
    return out, (None if r is None else torch.where(redo, torch.cat(sums, 1), r))


class LogSpaceGemm:
    """(logsumexp, weighted mean) matmul via shift-and-GEMM, exact blocked fallback where
    the shifted products underflow.

    The r component costs two more GEMM products: Σ_k ea·eb·(ra + rb) = (ea·ra) @ eb +
    ea @ (eb·rb)."""

    @staticmethod
    def run(
        la: Tensor,
        lb: Tensor | None,
        ra: Tensor | None,
        rb: Tensor | None,
        b_linear: Tensor | None = None,
    ):
        """``lb`` (and ``rb``) is b in log space; or pass ``lb=None`` and ``b_linear``, b as
        linear GEMM operands needing no shift (a lifted weight): exp(lb) = |w| (…, k, n)
        without r, or [exp(lb); exp(lb)·rb] stacked (…, 2k, n) with r (``rb=None``)."""
        if b_linear is not None and b_linear.dim() == 2:
            done = _by_weight(la, ra, b_linear)
            if done is not None:
                return done
        with_r = ra is not None
        if b_linear is not None:
            k = b_linear.shape[-2] // (2 if with_r else 1)
            batch = broadcast_shape(la.shape[:-2], b_linear.shape[:-2])
            a3, b_lin, b3 = flat_batch(la, batch), flat_batch(b_linear, batch), None
        else:
            a3, b3, batch = batch_flatten(la, lb)
            k = a3.shape[-1]
        count, m, n = a3.shape[0], a3.shape[-2], (b_lin if b3 is None else b3).shape[-1]
        if k == 0:
            out = a3.new_full((*batch, m, n), NEG_INF)
            return out, (None if ra is None else torch.zeros_like(out))
        mb = None
        vmapped = batched(*(t for t in (a3, b3, b_linear, ra, rb) if t is not None))
        if b3 is not None:
            mb = finite_max(b3, -2)
            if vmapped:  # torch.vmap batches no out= op
                eb = torch.exp(b3 - mb)
                b_lin = torch.cat((eb, eb * flat_batch(rb, batch)), -2) if with_r else eb
            else:
                b_lin = b3.new_empty(count, (2 if with_r else 1) * k, n)
                torch.sub(b3, mb, out=b_lin[:, :k]).exp_()
                if with_r:
                    torch.mul(b_lin[:, :k], flat_batch(rb, batch), out=b_lin[:, k:])
        ra3 = flat_batch(ra, batch) if with_r else None
        held = None if vmapped else _held_transposed(a3, ra3)
        if held is not None:  # read where it lies
            fused, stacked = held[:2], held[2]
        else:
            stacked = _message_operand((count, m, (2 if with_r else 1) * k), a3)
            ra3 = ra3.contiguous() if with_r else None
            fused = kernels.log_space_rows(a3.contiguous(), ra3, stacked)
        if fused is not None:
            ma, live = fused
            ea = stacked[..., -k:]
        else:
            row_max = a3.amax(dim=-1, keepdim=True)
            live = torch.isfinite(row_max)
            ma = row_max.masked_fill(~live, 0.0)
            if vmapped:
                ea = torch.exp(a3 - ma)
                stacked = torch.cat((ea * ra3, ea), -1) if with_r else ea
            else:
                ea = torch.sub(a3, ma, out=stacked[..., -k:]).exp_()
                if with_r:
                    torch.mul(ea, ra3, out=stacked[..., :k])
        z = torch.bmm(ea, b_lin[:, :k])
        # r's numerators: Σ ea·eb·(ra + rb) = [ea·ra | ea] @ [eb; eb·rb], then divided by z
        r = torch.bmm(stacked, b_lin) if with_r else None
        out, r, bad = _finish(z, r, ma, mb, live, _tiny(z.dtype), b3 is None)
        if bad is not None and anywhere(bad):
            if b3 is None:  # back to log space from the linear operands
                b3, rb3 = _log_operands(b_lin, k, with_r)
            else:
                rb3 = flat_batch(rb, batch) if with_r else None
            if vmapped:
                out, r = _exact_entries(a3, b3, ra3, rb3, bad, out, r)
            else:
                _exact_terms(a3, b3, ra3, rb3, bad, out, r)
        out = out.reshape(*batch, m, n)
        return out, (None if r is None else r.reshape(*batch, m, n))


def _tiny(dtype: torch.dtype) -> float:
    """The smallest shifted GEMM sum trusted (below it the products may have underflowed)."""
    return torch.finfo(dtype).tiny / torch.finfo(dtype).eps


def _held_transposed(a3: Tensor, ra3: Tensor | None) -> tuple[Tensor, Tensor, Tensor] | None:
    """For a message a3 (count, m, k) held transposed (unit stride along m), and ra3 alike:
    (shift, live, stacked) from one pass of ``log_space_columns`` over it where it lies,
    with ``stacked`` [ea·ra | ea] (count, m, 2k) (or ea) a transposed view of the operand,
    which the GEMM reads as such; None for other layouts or where the kernel does not run."""
    if a3.stride(-2) != 1 or a3.stride(-1) == 1:
        return None
    if ra3 is not None and (ra3.stride(-2) != 1 or ra3.stride(-1) == 1):
        return None
    count, m, k = a3.shape
    held = _message_operand((count, (1 if ra3 is None else 2) * k, m), a3)
    fused = log_entries.log_space_columns(a3.mT, None if ra3 is None else ra3.mT, held)
    return None if fused is None else (*fused, held.mT)


def _message_operand(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """Storage for the shifted message (and its r product), GEMM operands only: scratch up
    to a bound (a message grows with batch and sequence, and scratch stays resident)."""
    if math.prod(shape) * like.element_size() <= _MESSAGE_SCRATCH_BYTES:
        return scratch("log_space_a", shape, like.dtype, like.device)
    return like.new_empty(shape)


def _log_operands(b_lin: Tensor, k: int, with_r: bool) -> tuple[Tensor, Tensor | None]:
    """The linear operands [eb; eb·rb] (…, 2k, n) (or eb alone) back in log space: log eb
    and rb (0 where eb is 0)."""
    eb = b_lin[..., :k, :]
    rb = torch.where(eb > 0, b_lin[..., k:, :] / eb, 0.0) if with_r else None
    return torch.log(eb), rb


class ShiftedRows(NamedTuple):
    """A message's rows (count, k), and r's, made ready for a GEMM by a weight: ``stacked``
    holds e = exp(rows - shift) in its first ``count`` rows (and room for e·r after them);
    ``shift`` and ``live`` (count, 1) are each row's shift and whether it has a term;
    ``batch`` the message's shape but its last dim."""

    rows: Tensor
    r_rows: Tensor | None
    stacked: Tensor
    shift: Tensor
    live: Tensor
    batch: tuple[int, ...]


def shifted_rows(la: Tensor, ra: Tensor | None) -> ShiftedRows | None:
    """The first step of :func:`gemm_by_weight`, on the CPU kernels: ``la`` (…, m, k)
    (and ``ra``, of its shape) as contiguous rows, and e in one pass over them. None where
    that path does not apply (operands batched by ``torch.vmap``, ``ra`` of another shape,
    k = 0, no kernels, or under autocast, whose GEMMs' dtype an in-place ``addmm_`` would
    not follow)."""
    if la.dim() < 2 or la.shape[-1] == 0 or batched(la):
        return None
    if torch.is_autocast_enabled(la.device.type):
        return None
    if ra is not None and (ra.shape != la.shape or batched(ra)):
        return None
    k = la.shape[-1]
    rows = la.reshape(-1, k).contiguous()
    r_rows = None if ra is None else ra.reshape(-1, k).contiguous()
    stacked = _message_operand(((1 if ra is None else 2) * rows.shape[0], k), rows)
    fused = kernels.log_space_rows(rows, None, stacked[: rows.shape[0]])
    if fused is None:
        return None
    return ShiftedRows(rows, r_rows, stacked, *fused, tuple(la.shape[:-1]))


def gemm_by_weight(shifted: ShiftedRows, b_linear: Tensor) -> tuple[Tensor, Tensor | None]:
    """:meth:`LogSpaceGemm.run` by a 2-D linear operand (a lifted weight, (k, n), or (2k, n)
    with r) from the shifted rows of a message: each row is a row of one 2-D GEMM. With r
    the rows e and their products e·r are stacked along m, so that one GEMM by eb gives
    z = e @ eb over e·r @ eb (a larger m runs faster than two GEMMs: eb is packed once), and
    r's numerators add e @ (eb·rb) in place."""
    rows, r_rows, stacked, shift, live, batch = shifted
    count, k = rows.shape
    e = stacked[:count]
    if r_rows is not None:
        torch.mul(e, r_rows, out=stacked[count:])
        both = torch.mm(stacked, b_linear[:k])
        z, num = both[:count], both[count:]
        num.addmm_(e, b_linear[k:])
    else:
        z, num = torch.mm(e, b_linear), None
    out, num, bad = _finish(z, num, shift, None, live, _tiny(z.dtype), True)
    if bad is not None and anywhere(bad):
        b3, rb3 = _log_operands(b_linear[None], k, r_rows is not None)
        ra3, r3 = (None, None) if r_rows is None else (r_rows[None], num[None])
        _exact_terms(rows[None], b3, ra3, rb3, bad[None], out[None], r3)
    shape = (*batch, b_linear.shape[-1])
    return out.view(shape), (None if num is None else num.view(shape))


def matmul_by_weight(
    S: Semiring, a: Value, w: Tensor, operand: Callable[[Tensor], Tensor]
) -> Value:
    """``S.matmul_lift(a, w)`` of a log-space semiring (a's components: log values, and r
    for Entropy), ``operand(w)`` its linear GEMM operand: a product too small for
    ``on_live_rows`` to prune runs whole at once (``S._matmul_lift``); by a 2-D weight,
    one GEMM of the shifted rows of ``a`` when every row has a term (the pass that shifts
    them tells); else only the rows with a term (``on_live_rows``, the zero's components
    in the rows without)."""
    if w.dim() == 2 and not worth_pruning(a, w):
        return S._matmul_lift(a, w)  # no row pruned (on_live_rows): no liveness test
    by_weight = w.dim() == 2 and w.shape[0] == a[0].shape[-1]
    r_a = a[1] if len(a) > 1 else None
    shifted = shifted_rows(a[0], r_a) if by_weight else None
    if shifted is not None and bool(shifted.live.all()):  # no row to drop
        out, r = gemm_by_weight(shifted, operand(w))
        return (out,) if r is None else (out, r)
    empty = (NEG_INF,) if len(a) == 1 else (NEG_INF, 0.0)
    result = on_live_rows(a, S.terms, w, S._matmul_lift, empty)
    return result or S._matmul_lift(a, w)


def _by_weight(
    la: Tensor, ra: Tensor | None, b_linear: Tensor
) -> tuple[Tensor, Tensor | None] | None:
    """:func:`gemm_by_weight` where :func:`shifted_rows` applies, else None."""
    if la.shape[-1] != b_linear.shape[0] // (1 if ra is None else 2):
        return None
    shifted = shifted_rows(la, ra)
    return None if shifted is None else gemm_by_weight(shifted, b_linear)


def top_two_shifts(x: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Along ``dim`` (n ≥ 2): the argmax position and the largest and second largest
    entries as shifts (0 where not finite), each with ``dim`` kept as size 1."""
    first, second, at = top_two(x, dim)
    shifts = [t.masked_fill(~torch.isfinite(t), 0.0) for t in (first, second)]
    return at, shifts[0], shifts[1]


def log_loo(x: Tensor, dim: int) -> Tensor:
    """log Σ_{j≠i} exp(x_j) along ``dim`` from the top two entries (no scan).

    Shifted by the maximum, every position but the argmax keeps the argmax's term 1 in its
    sum, so total - e_i loses no precision. The argmax position sums the others afresh,
    shifted by the second largest, so a gap between the two never underflows."""
    n = x.shape[dim]
    if n <= 1:
        return torch.full_like(x, NEG_INF)
    if dim in (-1, x.dim() - 1):
        fused = kernels.loo_log(x, None)
        if fused is not None:
            return fused[0]
    first, s1, s2 = top_two_shifts(x, dim)
    e = torch.exp(x - s1)
    rest = torch.log((e.sum(dim, keepdim=True) - e).clamp_min(0.0)) + s1
    others = torch.exp(x - s2).scatter(dim, first, 0.0).sum(dim, keepdim=True)
    at_max = torch.log(others) + s2
    return rest.scatter(dim, first, at_max)
