"""Fused semiring kernels as torch operators (``torch.ops.semiring_autograd.*``, defined in
``operators.py``): matmuls that never hold the m×k×n product, and fused elementwise and
per-row kernels — the signed ``mul_lift`` (torch needs eight passes and its select is slow),
Entropy's ``mul_lift`` and ⊕, and the Entropy operands of a lifted weight, |w| and
-|w|·log|w| (torch needs five to nine passes each; the kernels take log and exp from
vectorised series of their own, within 3 ulp of torch's, subnormal results included; on
AVX-512 float, 16 lanes at a time from getexp/getmant and scalef), a ratio that is 0 at 0/0
without a select; and per-row kernels in log space: the leave-one-out ⊕, Entropy's
⊕-reduction and the shifted message operand of a log-space GEMM.

There is no BLAS for max-times. Two fused paths compute it exactly:

- CPU: ``extreme_matmul.h``, register-blocked SIMD loops (and ``k_best.h``, KBest's
  matmul: bounds tested a vector at a time, k-best lists kept per column), registered as the operators' CPU
  kernels by ``operators.cpp``, which ``build.py`` compiles on first use with
  ``torch.utils.cpp_extension`` (``-O3 -march=native -fno-trapping-math -fopenmp``) into a
  per-machine cache. With OpenMP the kernels share the libgomp torch loaded, so their team
  is torch's intra-op threads.
- CUDA: the operators' CUDA kernels are hand-tiled Triton kernels (``triton_matmul.py``):
  one 64×64 output tile per program, k walked in order by rank-1 updates of a multiply and
  a compare-and-select, bit-identical to the CPU kernels (tested in Triton's interpreter).

The functions here check what the kernels take (device, dtype, shapes, non-empty) and call
the operators; they return None (or False) where a kernel does not apply, and the callers
then use blocked eager evaluation and torch formulas, which give the same values (those
with a log or exp within 3 ulp).

``SEMIRING_AUTOGRAD_KERNELS`` (read on every call; an unknown value raises ValueError):

- ``check`` (default): the first use of each kernel per (device, dtype) in a process runs
  it on small deterministic operands against the torch formula it replaces
  (``checks.py``; the matmuls to the value, the log/exp kernels within 8 ulp of the scale;
  about 1 to 10 ms per kernel on the CPU) before the caller's data. A mismatch, or a kernel
  that raises (a Triton kernel that does not compile), gives one RuntimeWarning naming the
  kernel, the device (``cuda:0 (<GPU name>)``, ``cpu (<CPU model>)``) and the dtype; that
  kernel then returns None for that device and dtype for the rest of the process.
- ``trust``: no check; a kernel that raises is still dropped with one warning.
- ``off`` (or ``eager``): no fused kernel runs.

A failed or refused build (``build.py``) turns the CPU kernels off, with one warning.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from . import build, checks, operators
from .build import _ENVIRON, _KEY, _PARSED, LOADED as _LOADED, available, built, mode
from .checks import _VERDICTS
from .operators import op

_FLOATS = (torch.float32, torch.float64)
CPU = torch.device("cpu")
#: ``os.environ``'s mapping and the kernel mode parsed per raw value (``build.mode``'s
#: caches), read inline on every kernel call; both empty where ``os.environ`` has no such
#: mapping (``mode()`` is then called)
_ENV, _MODES = (_ENVIRON, _PARSED) if _ENVIRON is not None else ({}, {})
#: the modes in which a kernel that passed its check runs
_ON = ("check", "trust")


#: the innermost active functorch transform's level (None: none)
_functorch_level = torch._C._functorch.maybe_current_level


def _transformed() -> bool:
    """Whether a functorch transform (``torch.vmap``) is active: the fused kernels, custom
    ops without a batching rule, do not run under it."""
    return _functorch_level() is not None


def enabled() -> bool:
    """Whether the fused kernels may run: ``SEMIRING_AUTOGRAD_KERNELS`` is not ``off`` and no
    ``torch.vmap`` is active (the kernels have no batching rule: the torch formulas run)."""
    return build.enabled() and not _transformed()


def _ready(how: str, name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether kernel ``name`` may compute on ``device`` for ``dtype`` in mode ``how``: never
    ``off``; in ``trust`` mode unless a call of it failed; in ``check`` mode once its
    self-check passed."""
    if how == "trust":
        return not checks.failed((name, device, dtype))
    return how == "check" and checks.verified(name, device, dtype, lambda *args: op(name)(*args))


def _cpu_ready(name: str, *tensors: Tensor) -> bool:
    """Whether CPU kernel ``name`` takes these operands: float32/float64 of one dtype on
    the CPU, with the kernels enabled, built and (in ``check`` mode) checked."""
    dtype = tensors[0].dtype
    if dtype not in _FLOATS:
        return False
    for t in tensors:  # a loop, not a generator: this runs on every kernel call
        if t.dtype != dtype or not t.is_cpu:  # is_cpu: t.device makes an object per read
            return False
    if (  # _cpu_kernel's answer, inline, once the kernel passed its check
        _LOADED
        and _VERDICTS.get((name, CPU, dtype))
        and _MODES.get(_ENV.get(_KEY)) in _ON
        and _functorch_level() is None
    ):
        return True
    return _cpu_kernel(name, dtype)


def _cpu_kernel(name: str, dtype: torch.dtype) -> bool:
    """Whether CPU kernel ``name`` may compute for ``dtype``: enabled, built and ready
    (``mode()``, ``built()`` and ``checks.verified``, each read from its cache without a
    call once it holds the answer)."""
    how = _MODES.get(_ENV.get(_KEY))
    if how is None:
        how = mode()
    if how == "off" or _functorch_level() is not None or not (_LOADED or built()):
        return False
    verdict = _VERDICTS.get((name, CPU, dtype))
    if how == "trust":  # _ready, inline
        return verdict is not False
    if verdict is not None:
        return verdict
    return checks.verified(name, CPU, dtype, lambda *args: op(name)(*args))


def _nonempty_ready(name: str, *tensors: Tensor) -> bool:
    """``_cpu_ready``, and no operand empty (the matmul and elementwise kernels)."""
    for t in tensors:
        if not t.numel():
            return False
    return _cpu_ready(name, *tensors)


def max_times(a: Tensor, b: Tensor, init: float = 0.0, abs_b: bool = False) -> Tensor | None:
    """max(init, max_k a[bt, i, k] · b[bt, k, j]) for 3-D ``a`` (B, m, k) and ``b``
    (B, k, n) on the fused path, with |b| in place of b when ``abs_b`` (read while packing
    b); None when the fused path is unavailable (the caller falls back). NaN entries never
    win. On the CPU, terms whose bound |a|·max|b| cannot pass the row's accumulators are
    skipped (branch and bound; the result is the same to the bit)."""
    if a.is_cuda and enabled():
        return _cuda_call("max_times", a, b, init, abs_b)
    if not _nonempty_ready("max_times", a, b):
        return None
    return op("max_times")(a, b, init, abs_b)


def max_times_finite(a: Tensor, b: Tensor, init: float = 0.0, abs_b: bool = False) -> Tensor | None:
    """``max_times`` on the CPU where every entry of ``a`` and ``b`` is finite, with the
    operands' test in the same pass (one operator call, one parallel region); None where
    some entry is NaN or infinite, off the CPU, or without the kernels (the caller then
    takes its torch formula)."""
    if not _nonempty_ready("max_times_finite", a, b):
        return None
    out, nonfinite = op("max_times_finite")(a, b, init, abs_b)
    return None if bool(nonfinite) else out


def k_best_times(
    a: Tensor | Sequence[Tensor],
    b: Tensor | Sequence[Tensor],
    k: int,
    abs_b: bool = False,
    dead_count: bool = True,
) -> Tensor | None:
    """The k-best matmul on the CPU: out[t, bt, i, j] = the t-th largest (best first) of
    a[r][bt, i, q] · b[s][bt, q, j] over (q, r, s), 0 where fewer than k products are above
    0, for lists of non-negative weights a (ka components (B, m, l)) and b (kb components
    (B or 1, l, n)), each given as its components or stacked along a first dim (|b| when
    ``abs_b``); (k, B, m, n). The same products as the torch formula, kept by comparisons:
    its values to the bit. None where an entry is NaN or infinite (of b: at an index q
    where some row of a has a weight, or at any q when ``dead_count``), off the CPU, for
    empty operands or without the kernels."""
    a = list(a.unbind(0)) if isinstance(a, Tensor) else list(a)
    b = list(b.unbind(0)) if isinstance(b, Tensor) else list(b)
    if not _nonempty_ready("k_best_times", *a, *b):
        return None
    out, nonfinite = op("k_best_times")(a, b, k, abs_b, dead_count)
    return None if bool(nonfinite) else out


def k_best_add(a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> Tensor | None:
    """KBest's ⊕ on the CPU: (k, *shape), out[t] = the t-th largest of the 2k entries of
    two descending lists ``a`` and ``b`` of k components each (one shape, any strides),
    the values of torch.topk on the stacked lists; None off the CPU, for components of
    several shapes, without the kernels, or where a list is not descending or holds a NaN
    (the caller then takes its torch formula)."""
    shape = a[0].shape
    if len(b) != len(a):
        return None
    for c in (*a, *b):  # a loop, not a generator: this runs on every ⊕
        if c.shape != shape:
            return None
    if not _nonempty_ready("k_best_add", a[0], *a[1:], *b):
        return None
    out, declined = op("k_best_add")(a, b)
    return None if bool(declined) else out


def k_best_loo(a: tuple[Tensor, ...]) -> Tensor | None:
    """KBest's leave-one-out ⊕ along the last dim on the CPU: (k, *shape), out[t][..., j] =
    the t-th largest entry of the lists at the positions j' ≠ j of the last dim, 0 where
    they hold fewer, for descending lists ``a`` of k components (one shape); the values of
    ``torch.topk`` over those entries to the bit. None off the CPU, for components of several
    shapes, for an empty or 0-d shape, without the kernels, or where a list is not descending
    or holds a NaN (the caller then takes its torch formula)."""
    shape = a[0].shape
    for c in a:  # a loop, not a generator: this runs on every attention block
        if c.shape != shape:
            return None
    if not len(shape) or not _nonempty_ready("k_best_loo", *a):
        return None
    out, declined = op("k_best_loo")(a)
    return None if bool(declined) else out


def k_best_softmax_backward(a: tuple[Tensor, ...], p: Tensor) -> Tensor | None:
    """KBest's message at softmax's input from descending lists ``a`` (k components) at its
    output ``p`` (their shape) along the last dim, on the CPU in one pass per row: (k,
    *shape), Semiring.softmax_backward's values to the bit. None off the CPU, for operands
    of several shapes or dtypes, for an empty or 0-d shape, without the kernels, or where a
    list is not descending or a product is NaN (the caller then takes its formula)."""
    shape = a[0].shape
    for c in a:  # a loop, not a generator: this runs on every attention block
        if c.shape != shape:
            return None
    if not len(shape) or p.shape != shape or p.dtype != a[0].dtype:
        return None
    if not _nonempty_ready("k_best_softmax_backward", *a, p):
        return None
    out, declined = op("k_best_softmax_backward")(a, p)
    return None if bool(declined) else out


def signed_times(
    a_hi: Tensor, a_lo: Tensor, b_hi: Tensor, b_lo: Tensor | None
) -> tuple[Tensor, Tensor] | None:
    """(max_k, min_k) over the corner products of signed pairs a (B, m, k) and b (B, k, n);
    ``b_lo=None`` when b is a point (hi == lo). NaN marks an empty entry; an output with no
    non-empty term is (-inf, +inf). None when the fused path is unavailable."""
    if a_hi.is_cuda and enabled():
        return _cuda_call("signed_times", a_hi, a_lo, b_hi, b_lo)
    parts = (a_hi, a_lo, b_hi) if b_lo is None else (a_hi, a_lo, b_hi, b_lo)
    if not _nonempty_ready("signed_times", *parts):
        return None
    return op("signed_times")(a_hi, a_lo, b_hi, b_lo)


def pair_lift_matmul(
    a_hi: Tensor, a_lo: Tensor, w: Tensor, zero_empty: bool = False
) -> tuple[Tensor, Tensor] | None:
    """The signed matmul of the pair a (B, m, k) and lift(w), for a real (B or 1, k, n)
    ``w``: (max_k, min_k) of a_hi·w where w > 0 and a_lo·w where w < 0, and the other ends,
    as contiguous (B, m, n) tensors. 2 products and 2 extremes per term where the corner
    form needs 6. An a entry with a_hi < a_lo is empty, and so is a w entry of 0 when
    ``zero_empty`` (lift(0) is no edge); an output with no non-empty term is (-inf, +inf).
    Any strides; None when the fused path is unavailable. On the CPU, terms that cannot
    pass either end's accumulators are skipped (branch and bound, exact)."""
    if w.is_cuda and enabled():
        return _cuda_call("lift_times", a_hi, a_lo, w, zero_empty)
    if not _nonempty_ready("lift_times", w, a_hi, a_lo):
        return None
    return op("lift_times")(a_hi, a_lo, w, zero_empty)


def signed_mul_lift(a_hi: Tensor, a_lo: Tensor, w: Tensor) -> tuple[Tensor, Tensor] | None:
    """The signed pair a times lift(w) elementwise (broadcasting), in one pass on the CPU:
    w > 0 keeps (a_hi, a_lo), w < 0 swaps them, each times w; w = 0 gives the empty
    (-inf, +inf) but from a NaN end, and an empty a stays empty: the semiring's torch
    formula to the bit, NaN and infinities included. None off the CPU or without the
    kernels."""
    if not _nonempty_ready("signed_mul_lift", a_hi, a_lo, w):
        return None
    return op("signed_mul_lift")(a_hi, a_lo, w)


def entropy_mul_lift(la: Tensor, r: Tensor, w: Tensor) -> tuple[Tensor, Tensor] | None:
    """The Entropy value (la, r) times lift(w) elementwise (broadcasting), in one pass on the
    CPU: (la + log|w|, r - log|w|), with r = 0 where the new la is -inf (no path; a NaN
    in r stays). log|w| is within 2 ulp of torch.log's. A ``w`` smaller than the value (a
    scalar, a row or a column broadcast over it) takes log|w| of w's entries alone, then
    one pass over the value reading it broadcast: no w-sized copy of the value's size, no
    log per entry. None off the CPU or without the kernels."""
    if not _nonempty_ready("entropy_mul_lift", la, r, w):
        return None
    return op("entropy_mul_lift")(la, r, w)


def entropy_add(la: Tensor, ra: Tensor, lb: Tensor, rb: Tensor) -> tuple[Tensor, Tensor] | None:
    """The Entropy ⊕ of (la, ra) and (lb, rb) elementwise (broadcasting), in one pass on the
    CPU: (logaddexp(la, lb), the Z-weighted mean of ra and rb), (-inf, 0) where both are
    -inf. None off the CPU or without the kernels."""
    if not _nonempty_ready("entropy_add", la, ra, lb, rb):
        return None
    return op("entropy_add")(la, ra, lb, rb)


def ratio_where_positive(num: Tensor, den: Tensor) -> bool:
    """num / den where den > 0, else 0 (a sum without terms, 0/0), in place on ``num`` in
    one pass on the CPU; a NaN in num stays where den > 0. False (num untouched) off the
    CPU, without the kernels, or unless both are contiguous and of one shape."""
    if num.shape != den.shape or not (num.is_contiguous() and den.is_contiguous()):
        return False
    if not _cpu_ready("ratio_where_positive_", num, den):
        return False
    op("ratio_where_positive_")(num, den)
    return True


def softmax_rows(scores: Tensor, keep: Tensor | None, factor: float) -> bool:
    """scores ← softmax(scores · factor) along the last dim in place, in one pass per row
    on the CPU, the entries where ``keep`` (bool, (query rows, keys), read by every batch
    and head) is false excluded: a row with NaN or +inf kept is NaN, a row with none kept
    0. False (scores untouched) unless ``scores`` is contiguous float32/float64 and
    ``keep`` a contiguous (rows, keys) bool whose rows divide the scores', off the CPU or
    without the kernels."""
    if scores.dim() == 0 or not scores.is_contiguous() or not scores.numel():
        return False
    if keep is not None:
        rows = scores.numel() // scores.shape[-1] if scores.shape[-1] else 0
        if keep.dtype != torch.bool or keep.dim() != 2 or not keep.is_contiguous():
            return False
        if not keep.is_cpu:
            return False
        if keep.shape[-1] != scores.shape[-1] or not keep.shape[0] or rows % keep.shape[0]:
            return False
    if not _cpu_ready("softmax_rows_", scores):
        return False
    op("softmax_rows_")(scores, keep, factor)
    return True


def loo_log(x: Tensor, r: Tensor | None) -> tuple[Tensor, Tensor | None] | None:
    """The leave-one-out ⊕ in log space along the last dim, in one kernel call on the CPU:
    log Σ_{j≠i} e^{x_j} and, given ``r`` (Entropy's, of x's shape), the e^x-weighted mean of
    the other entries' r (0 where no other entry has weight). Shifted by the top two of each
    row, as ``semirings.log_space.loo`` (the argmax's sum in the maximum's frame where the
    runner-up lies within ``LOO_SHARED_GAP``, extreme_matmul.h). None off the CPU, without
    the kernels, or when a row holds NaN or +inf (the caller's torch formula then handles
    every row)."""
    if x.dim() == 0 or (r is not None and r.shape != x.shape):
        return None
    if not _cpu_ready("loo_log", *((x,) if r is None else (x, r))):
        return None
    if x.shape[-1] == 0:
        return torch.empty_like(x), None if r is None else torch.empty_like(r)
    out_l, out_r, declined = op("loo_log")(x, r)
    if declined:
        return None
    return out_l, None if r is None else out_r


def entropy_reduce_rows(la: Tensor, r: Tensor) -> tuple[Tensor, Tensor] | None:
    """Entropy's ⊕-reduction along the last dim (kept, size 1), in one pass per row:
    log Σ e^la and the e^la-weighted mean of r (0 where no entry has weight), shifted by
    each row's maximum. None off the CPU, without the kernels, for rows of length 0, or when
    a row holds NaN or +inf (the caller's torch formula then handles every row)."""
    if la.dim() == 0 or la.shape[-1] == 0 or r.shape != la.shape:
        return None
    if not _cpu_ready("entropy_reduce_rows", la, r):
        return None
    out_l, out_r, declined = op("entropy_reduce_rows")(la, r)
    return None if declined else (out_l, out_r)


def entropy_softmax_backward(
    gl: Tensor, gr: Tensor, p: Tensor, dim: int
) -> tuple[Tensor, Tensor] | None:
    """Entropy's message at softmax's input s from the message (gl, gr) at its output p =
    softmax(s) along ``dim`` (the last), in one pass per row on the CPU: with t = g ⊗
    lift(p) and L its leave-one-out ⊕, t ⊗ lift(1 - p) ⊕ L ⊗ lift(p). None off the CPU,
    without the kernels, for operands not contiguous or not of one shape, or when a row of t
    holds NaN or +inf (the caller's formula then handles every row)."""
    if p.dim() == 0 or dim not in (-1, p.dim() - 1) or not gl.shape == gr.shape == p.shape:
        return None
    if not (gl.is_contiguous() and gr.is_contiguous() and p.is_contiguous()):
        return None
    if not _nonempty_ready("entropy_softmax_backward", gl, gr, p):
        return None
    out_l, out_r, declined = op("entropy_softmax_backward")(gl, gr, p)
    return None if declined else (out_l, out_r)


def log_space_rows(a: Tensor, r: Tensor | None, out: Tensor) -> tuple[Tensor, Tensor] | None:
    """The message operand of a shift-and-GEMM in log space, in one pass over the rows of
    ``a`` (…, m, k): each row's shift (its maximum where finite, else 0) and liveness (that
    maximum is finite), both (…, m, 1), and e = exp(a - shift) written into ``out``: (…, m, k),
    or, given ``r``, [e·r | e] (…, m, 2k). None (``out`` untouched) off the CPU, without
    the kernels, for k = 0, or unless a, r and out are contiguous."""
    parts = (a, out) if r is None else (a, r, out)
    if a.dim() < 2 or a.shape[-1] == 0:
        return None
    for t in parts:
        if not t.is_contiguous():
            return None
    k = a.shape[-1]
    if out.shape != (*a.shape[:-1], k if r is None else 2 * k):
        raise ValueError(
            f"log_space_rows: out has shape {tuple(out.shape)} for a of shape {tuple(a.shape)}"
        )
    if not _cpu_ready("log_space_rows", *parts):
        return None
    return op("log_space_rows")(a, r, out)


def entropy_weights(w: Tensor, out: Tensor) -> bool:
    """Fill ``out`` (…, 2k, n) with the Entropy GEMM operands of a lifted (…, k, n) ``w``,
    stacked along the row dim: |w| in rows [0, k) and |w|·(-log|w|) in rows [k, 2k) (0 where
    w is 0 or NaN, -inf where |w| is inf), in one pass on the CPU. False (``out`` untouched)
    off the CPU or without the kernels."""
    k, n = w.shape[-2:]
    if out.shape != (*w.shape[:-2], 2 * k, n):
        raise ValueError(
            f"entropy_weights: out has shape {tuple(out.shape)}, expected "
            f"{(*w.shape[:-2], 2 * k, n)} for w of shape {tuple(w.shape)}"
        )
    if not out.is_contiguous() or not _cpu_ready("entropy_weights", w, out):
        return False
    if w.numel():
        op("entropy_weights")(w, out)
    return True


def any_nan_or_inf(tensors: Sequence[Tensor], signs: Sequence[int]) -> bool | None:
    """Whether some tensor holds a NaN or an infinity of the sign given for it (+1: +inf,
    -1: -inf, 0: either), in one operator call on the CPU; None off the CPU or without the
    kernels."""
    if not tensors or not _tests_ready(tuple(tensors)):
        return None
    return bool(op("any_nan_or_inf")(list(tensors), list(signs)))


def all_rows_live(x: Tensor, y: Tensor | None, empty: float) -> bool | None:
    """Whether every row (along the last dim) of ``x`` has a term: its maximum is not
    ``empty``, or, given ``y`` (a signed pair's lo), the maximum of x - y is not below 0; a
    NaN counts as a term. One scan on the CPU; None off the CPU, without the kernels, or
    unless x (and y, of x's shape) are contiguous."""
    if x.dim() == 0 or not x.is_contiguous():
        return None
    if y is not None and (y.shape != x.shape or not y.is_contiguous()):
        return None
    if not _cpu_ready("all_rows_live", *((x,) if y is None else (x, y))):
        return None
    return bool(op("all_rows_live")(x, y, empty))


def log_gemm_finish(
    z: Tensor,
    num: Tensor | None,
    shift: Tensor,
    shift_b: Tensor | None,
    live: Tensor,
    tiny: float,
    may_overflow: bool,
) -> bool | None:
    """A log-space GEMM's last steps in one operator call on the CPU: when no sum of a live
    row of ``z`` (…, m, n) is below ``tiny`` (nor infinite, given ``may_overflow``; ``live``
    (…, m, 1) bool), ``num`` becomes num / z (0 where z is 0) and ``z`` log z + ``shift``
    (…, m, 1) (+ ``shift_b`` (…, 1, n)), in place, and True; otherwise nothing is written,
    and False. None off the CPU, without the kernels, for an empty ``z``, or unless z, num
    and live are contiguous."""
    floats = [t for t in (z, num, shift, shift_b) if t is not None]
    if z.numel() == 0 or live.shape != (*z.shape[:-1], 1) or live.dtype != torch.bool:
        return None
    if not (z.is_contiguous() and live.is_contiguous()):
        return None
    if num is not None and not num.is_contiguous():
        return None
    if not live.is_cpu or not _cpu_ready("log_gemm_finish_", *floats):
        return None
    return bool(op("log_gemm_finish_")(z, num, shift, shift_b, live, tiny, may_overflow))


def _tests_ready(tensors: tuple[Tensor, ...]) -> bool:
    """The test operators take CPU tensors of any dtype (checked per the first's dtype)."""
    for t in tensors:
        if not t.is_cpu:
            return False
    return _cpu_kernel("any_nan_or_inf", tensors[0].dtype)


def _cuda_call(name: str, *args):
    """The CUDA kernel of operator ``name`` (a Triton kernel) on ``args``; None for empty
    operands, before its self-check passed (``check`` mode), or after it failed its check
    or a call (one warning: a kernel that does not compile or launch)."""
    if any(isinstance(a, Tensor) and a.numel() == 0 for a in args):
        return None
    first = next(a for a in args if isinstance(a, Tensor))
    if not _ready(mode(), name, first.device, first.dtype):
        return None
    try:
        return op(name)(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # noqa: BLE001 -- a kernel that does not compile: fall back
        checks.fail((name, first.device, first.dtype), f"raised {type(error).__name__}: {error}")
    return None


__all__ = [
    "available",
    "checks",
    "enabled",
    "mode",
    "operators",
    "max_times",
    "max_times_finite",
    "k_best_times",
    "k_best_add",
    "k_best_loo",
    "k_best_softmax_backward",
    "signed_times",
    "pair_lift_matmul",
    "signed_mul_lift",
    "entropy_mul_lift",
    "entropy_add",
    "ratio_where_positive",
    "loo_log",
    "softmax_rows",
    "entropy_reduce_rows",
    "log_space_rows",
    "entropy_weights",
    "any_nan_or_inf",
    "all_rows_live",
    "log_gemm_finish",
]
