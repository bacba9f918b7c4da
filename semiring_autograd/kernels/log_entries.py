"""The Log semiring's elementwise primitives on fused CPU operators (``log_entries.h``):
``plus_log_abs`` (a + log|w|, or log|w|: ⊗ lift and lift) and ``log_add`` (⊕, as
torch.logaddexp; ``log_add_`` into an accumulator), one pass each where torch takes three
passes or a slower series; Entropy's ⊕ into an accumulator (``entropy_add_``), whose log Z
is Log's ⊕, over the same rows;
``softmax_backward``, the message at softmax's input, in one operator call per tensor
where the semiring formula takes about a dozen passes; and ``log_space_columns``, the
shifted message of a log-space GEMM read from a transposed message where it lies.

Each takes contiguous CPU float32/float64 operands of one shape and dtype (the elementwise
two with at least ``MIN_ENTRIES`` entries: below that an operator call costs what it saves;
``plus_log_abs`` of an ``a`` that broadcasts to ``w``'s shape and ``log_add`` of an operand
that broadcasts to the other's take the full-size operand, as below; ``log_add`` and
``log_add_`` also take operands that lie in rows one stride apart, through
``log_add_rows_``, and ``entropy_add_`` through ``entropy_add_rows_``;
``log_space_columns`` takes its own layout) and returns None (False)
otherwise, or where the
kernels are off, unbuilt or failed their check (``kernels``'s modes); the callers then take
the torch formula. Their log and exp are the kernels' own series (on AVX-512 float, within
1 ulp of the true values), within 3 ulp of torch's.
"""

from __future__ import annotations

import math

from torch import Tensor

from . import _nonempty_ready
from .operators import op

#: the fewest entries the fused kernels take
MIN_ENTRIES = 1 << 14


def _takes(x: Tensor, y: Tensor) -> bool:
    """Whether ``x`` and ``y`` are operands of one elementwise kernel call."""
    return (
        x.numel() >= MIN_ENTRIES and x.shape == y.shape and x.is_contiguous() and y.is_contiguous()
    )


def _spreads(small: Tensor, full: Tensor) -> bool:
    """Whether ``small`` broadcasts to ``full``'s shape (of ``full``'s dtype and device)."""
    if small.dim() > full.dim() or small.dtype != full.dtype or small.device != full.device:
        return False
    for s, f in zip(reversed(small.shape), reversed(full.shape)):
        if s != 1 and s != f:
            return False
    return True


def plus_log_abs(a: Tensor | None, w: Tensor) -> Tensor | None:
    """a + log|w| (log|w| where ``a`` is None) by the fused CPU kernel, or None. Where
    ``a`` broadcasts to ``w``'s shape: log|w| by the kernel, then a added in place (two
    passes where the formula takes three)."""
    x = w if a is None else a
    if not _takes(x, w):
        if a is not None and a.shape != w.shape and _spreads(a, w):
            log_w = plus_log_abs(None, w)
            return None if log_w is None else log_w.add_(a)
        return None
    if not (
        _nonempty_ready("plus_log_abs", w) if a is None else _nonempty_ready("plus_log_abs", a, w)
    ):
        return None
    return op("plus_log_abs")(a, w)


def log_add(a: Tensor, b: Tensor) -> Tensor | None:
    """log(e^a + e^b) by the fused CPU kernel, or None. An operand that broadcasts to the
    other's shape is expanded to it first (a copy and the kernel take less time than
    ``torch.logaddexp`` broadcasting). Operands of one shape that are not contiguous but
    lie in rows in ``a``'s layout (:func:`_layout`, :func:`_rows`: narrowed, unbound or
    transposed slices of dense tensors) go to ``log_add_rows_``, into a new tensor of that
    layout."""
    if not _nonempty_ready("log_add", a, b):
        return None
    if a.shape != b.shape:
        a, b = _spread_pair(a, b)
    if _takes(a, b):
        return op("log_add")(a, b)
    if a.shape != b.shape:
        return None
    order = _layout(a)
    a_rows, b_rows = a.permute(order), b.permute(order)
    pair = _row_views(a_rows, b_rows)
    if pair is None or not _nonempty_ready("log_add_rows_", a, b):
        return None
    out = a_rows.new_empty(a_rows.shape)
    op("log_add_rows_")(out.view(pair[0].shape), *pair)
    return out.permute(_inverse(order))


def log_add_(acc: Tensor, b: Tensor) -> bool:
    """acc = log(e^acc + e^b) in place by ``log_add_rows_``: True, or False (``acc``
    untouched) where they are not operands of one call (:func:`_accumulator_rows`), off the
    CPU or without the kernels."""
    views = _accumulator_rows((acc,), (b,))
    if views is None or not _nonempty_ready("log_add_rows_", acc, b):
        return False
    op("log_add_rows_")(views[0], *views)
    return True


def entropy_add_(acc: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> bool:
    """Entropy's acc = acc ⊕ b in place, (log Z, r) each, by ``entropy_add_rows_``: True,
    or False (``acc`` untouched) where they are not operands of one call
    (:func:`_accumulator_rows`), off the CPU or without the kernels."""
    views = _accumulator_rows(acc, b)
    if views is None or not _nonempty_ready("entropy_add_rows_", *acc, *b):
        return False
    op("entropy_add_rows_")(views[0], views[1], *views)
    return True


def _accumulator_rows(acc: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> tuple[Tensor, ...] | None:
    """The components of ``acc`` then of ``b`` as (rows, n) views (:func:`_row_views`) in the
    layout of ``acc``'s first: None where they are not of one shape, where an accumulator's
    entries overlap, or where two accumulators, or an accumulator and a ``b``, share
    storage."""
    first = acc[0]
    if any(t.shape != first.shape for t in (*acc, *b)):
        return None
    into = {t.untyped_storage().data_ptr() for t in acc}
    if len(into) < len(acc) or into & {t.untyped_storage().data_ptr() for t in b}:
        return None
    order = _layout(first)
    views = _row_views(*(t.permute(order) for t in (*acc, *b)))
    if views is None:
        return None
    for v in views[: len(acc)]:
        if v.shape[0] > 1 and v.stride(0) < v.shape[1]:
            return None
    return views


def _layout(x: Tensor) -> list[int]:
    """The dims of ``x`` from the largest stride to the smallest (ties in order): the
    permutation under which a dense ``x`` is contiguous (a transposed message's too)."""
    return sorted(range(x.dim()), key=lambda d: -x.stride(d))


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return inverse


def _row_views(*tensors: Tensor) -> tuple[Tensor, ...] | None:
    """``tensors`` (one shape, dtype and device, at least ``MIN_ENTRIES`` entries) as 2-D
    (rows, n) views of their storage for the ⊕ over rows (``log_add_rows_``,
    ``entropy_add_rows_``): n the entries of the trailing dims that are one contiguous block
    in each (at least 16, a vector), the rows the rest, one stride apart; None for other
    operands."""
    first = tensors[0]
    for t in tensors:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            return None
    if first.numel() < MIN_ENTRIES:
        return None
    start = max(_block_start(t) for t in tensors)
    n = math.prod(first.shape[start:])
    if n < 16:
        return None
    rows = [_rows(t, start, n) for t in tensors]
    return None if any(r is None for r in rows) else tuple(rows)


def _block_start(x: Tensor) -> int:
    """The first of the trailing dims of ``x`` that together are one contiguous block (dims
    of one entry aside)."""
    expected, start = 1, x.dim()
    for d in range(x.dim() - 1, -1, -1):
        if x.shape[d] != 1 and x.stride(d) != expected:
            break
        expected *= x.shape[d]
        start = d
    return start


def _rows(x: Tensor, start: int, n: int) -> Tensor | None:
    """``x`` as (rows, n): dims from ``start`` on one contiguous block of n entries, the
    dims before it one stride apart (0: every row the same entries); None otherwise."""
    stride, span = None, 1
    for d in range(start - 1, -1, -1):
        if x.shape[d] == 1:
            continue
        if stride is None:
            stride, span = x.stride(d), x.shape[d]
        elif x.stride(d) == stride * span:
            span *= x.shape[d]
        else:
            return None
    return x.as_strided((span, n), (n if stride is None else stride, 1))


def _spread_pair(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """(a, b) with the one that broadcasts to the other's shape expanded to it, contiguous,
    where the other is an operand the kernel takes; else (a, b) as they are."""
    for small, full in ((b, a), (a, b)):
        if _takes(full, full) and _spreads(small, full):
            spread = small.expand(full.shape).contiguous()
            return (full, spread) if full is a else (spread, full)
    return a, b


def log_space_columns(a: Tensor, r: Tensor | None, out: Tensor) -> tuple[Tensor, Tensor] | None:
    """The message operand of a shift-and-GEMM in log space for a message whose transpose
    ``a`` (count, k, m) has unit stride along m (a transposed message, read where it lies):
    per column of ``a`` its shift (the maximum over k where finite, else 0) and liveness,
    each (count, m, 1), and e = exp(a - shift) written into ``out`` (count, k, m), or,
    given ``r`` (a's shape, unit stride along m), e·r and e stacked along k into ``out``
    (count, 2k, m): ``log_space_rows``' values, transposed. None (``out`` untouched) for
    other operands, k = 0, off the CPU or without the kernels."""
    if a.dim() != 3 or a.shape[1] == 0 or a.stride(-1) != 1:
        return None
    if r is not None and (r.shape != a.shape or r.stride(-1) != 1):
        return None
    count, k, m = a.shape
    if out.shape != (count, k if r is None else 2 * k, m) or not out.is_contiguous():
        return None
    if not _nonempty_ready("log_space_columns", a, out, *(() if r is None else (r,))):
        return None
    return op("log_space_columns")(a, r, out)


def softmax_backward(g: Tensor, p: Tensor, dim: int) -> Tensor | None:
    """Log's message at softmax's input s from the message ``g`` at its output p =
    softmax(s) along ``dim`` (the last): with t = g + log p and L_i = log Σ_{j≠i} e^{t_j},
    log(e^{t_i + log(1 - p_i)} + e^{L_i + log p_i}), by the fused CPU kernel; None where it
    does not apply or a row holds NaN or +inf."""
    if g.dim() == 0 or dim not in (-1, g.dim() - 1) or g.shape != p.shape:
        return None
    if not (g.is_contiguous() and p.is_contiguous()):
        return None
    if not _nonempty_ready("softmax_backward_log", g, p):
        return None
    out, declined = op("softmax_backward_log")(g, p)
    return None if declined else out
