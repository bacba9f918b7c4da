"""The Log semiring's elementwise primitives on fused CPU operators (``log_entries.h``):
``plus_log_abs`` (a + log|w|, or log|w|: ⊗ lift and lift) and ``log_add`` (⊕, as
torch.logaddexp), one pass each where torch takes three passes or a slower series;
``softmax_backward``, the message at softmax's input, in one operator call per tensor
where the semiring formula takes about a dozen passes; and ``log_space_columns``, the
shifted message of a log-space GEMM read from a transposed message where it lies.

Each takes contiguous CPU float32/float64 operands of one shape and dtype (the elementwise
two with at least ``MIN_ENTRIES`` entries: below that an operator call costs what it saves;
``plus_log_abs`` of an ``a`` that broadcasts to ``w``'s shape and ``log_add`` of an operand
that broadcasts to the other's take the full-size operand, as below; ``log_space_columns``
takes its own layout) and returns None otherwise, or where the
kernels are off, unbuilt or failed their check (``kernels``'s modes); the callers then take
the torch formula. Their log and exp are the kernels' own series (on AVX-512 float, within
1 ulp of the true values), within 3 ulp of torch's.
"""

from __future__ import annotations

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
    ``torch.logaddexp`` broadcasting)."""
    if not _nonempty_ready("log_add", a, b):
        return None
    if a.shape != b.shape:
        a, b = _spread_pair(a, b)
    return op("log_add")(a, b) if _takes(a, b) else None


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
