"""Fused semiring matmuls that never hold the m×k×n product, and fused elementwise kernels:
the signed ``mul_lift`` (torch needs eight passes and its select is slow), Entropy's
``mul_lift`` and ⊕, and the Entropy operands of a lifted weight, |w| and -|w|·log|w| (torch
needs five to nine passes each; the kernels take log and exp from vectorised series of
their own, within 3 ulp of torch's, subnormal results included; on AVX-512 float, 16
lanes at a time from getexp/getmant and scalef), a ratio that is 0 at
0/0 without a select; and per-row kernels in log space: the leave-one-out ⊕, Entropy's
⊕-reduction and the shifted message operand of a log-space GEMM.

There is no BLAS for max-times. Two fused paths compute it exactly:

- CPU: ``extreme_matmul.cpp``, register-blocked SIMD loops, compiled on first use with the
  system C++ compiler (``-O3 -march=native -fno-trapping-math -fopenmp``, and
  ``-mprefer-vector-width=512`` on x86-64) into a per-machine
  cache and called through ctypes (which releases the GIL) on ``torch.get_num_threads()``
  threads. With OpenMP the library shares the libgomp torch loaded, so its team is torch's
  intra-op threads; a pool of other threads would compete with them, as torch's idle
  OpenMP workers spin for milliseconds after each op. Without OpenMP it falls back to a thread pool of its own.
- CUDA: ``torch.compile`` of broadcast-multiply + reduction, which Inductor turns into one
  Triton kernel (dynamic shapes, so one compilation serves every shape).

``SEMIRING_AUTOGRAD_KERNELS=eager`` turns all of them off; so does a failed compilation (with
one warning). Callers then fall back to blocked eager evaluation and torch formulas, which
give the same values (those with a log or exp within 3 ulp).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

_SOURCE = Path(__file__).with_name("extreme_matmul.cpp")
_ENV = "SEMIRING_AUTOGRAD_KERNELS"
_LOCK = threading.Lock()
#: below this many multiply-reduce steps a call runs on one thread
_PARALLEL_WORK = 1 << 18
#: an elementwise kernel's entries count as this many steps (parallel from 2**15 entries),
#: and are split among threads in blocks of _ENTRY_BLOCK (without OpenMP)
_ENTRY_COST, _ENTRY_BLOCK = 8, 1 << 12


def enabled() -> bool:
    """False when ``SEMIRING_AUTOGRAD_KERNELS=eager`` asks for eager evaluation."""
    return os.environ.get(_ENV, "").strip().lower() != "eager"


def _cache_dir() -> Path:
    root = os.environ.get("SEMIRING_AUTOGRAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "semiring_autograd"
    )
    return Path(root)


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and its flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


_FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-shared", "-fPIC", "-std=c++17"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # the auto-vectorised loops are 256 bits wide by default even where the CPU has
    # AVX-512 (the matmul kernels use its registers explicitly); 512 runs them faster
    _FLAGS.append("-mprefer-vector-width=512")
#: tried first: the kernels then run on torch's own OpenMP threads (see the .cpp)
_OPENMP_FLAGS = ["-fopenmp"]


def _build(cxx: str, flags: list[str], target: Path) -> str | None:
    """Compile the source into ``target``; the compiler's error output on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        proc = subprocess.run(
            [cxx, *flags, str(_SOURCE), "-o", str(built)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            return proc.stderr[-2000:]
        os.replace(built, target)  # atomic: concurrent builders each install a whole file
    return None


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled CPU kernels (built once per source, compiler and CPU), or None."""
    cxx = _compiler()
    if cxx is None:
        _warn("no C++ compiler found (set CXX)")
        return None
    source = _SOURCE.read_bytes()
    target = None
    for flags in (_FLAGS + _OPENMP_FLAGS, _FLAGS):
        key = hashlib.sha256(source + " ".join([cxx, *flags]).encode() + _cpu_signature().encode())
        target = _cache_dir() / f"extreme_matmul-{key.hexdigest()[:16]}.so"
        if target.exists():
            break
        error = _build(cxx, flags, target)
        if error is None:
            break
        target = None
    if target is None:
        _warn(f"{cxx} failed:\n{error}")
        return None
    lib = ctypes.CDLL(str(target))
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.uses_openmp.restype = i32
    for suffix, scalar in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
        getattr(lib, f"block_width_{suffix}").restype = i32
        getattr(lib, f"max_times_{suffix}").argtypes = [ptr] * 3 + [i64] * 7 + [scalar, i32, i32]
        getattr(lib, f"max_times_{suffix}").restype = None
        getattr(lib, f"signed_times_{suffix}").argtypes = [ptr] * 6 + [i64] * 7 + [i32]
        getattr(lib, f"signed_times_{suffix}").restype = None
        getattr(lib, f"lift_times_{suffix}").argtypes = (
            [ptr, i64, i64, i64] + [ptr] * 2 + [i64] * 3 + [ptr] * 2 + [i64] * 7 + [i32, i32]
        )
        getattr(lib, f"lift_times_{suffix}").restype = None
        getattr(lib, f"signed_mul_lift_{suffix}").argtypes = [ptr] * 5 + [i64, i32]
        getattr(lib, f"signed_mul_lift_{suffix}").restype = None
        getattr(lib, f"entropy_weights_{suffix}").argtypes = [ptr] * 2 + [i64] * 5 + [i32]
        getattr(lib, f"entropy_weights_{suffix}").restype = None
        getattr(lib, f"entropy_mul_lift_{suffix}").argtypes = [ptr] * 5 + [i64, i32]
        getattr(lib, f"entropy_mul_lift_{suffix}").restype = None
        getattr(lib, f"entropy_add_{suffix}").argtypes = [ptr] * 6 + [i64, i32]
        getattr(lib, f"entropy_add_{suffix}").restype = None
        getattr(lib, f"ratio_where_positive_{suffix}").argtypes = [ptr] * 2 + [i64, i32]
        getattr(lib, f"ratio_where_positive_{suffix}").restype = None
        getattr(lib, f"zero_where_no_path_{suffix}").argtypes = [ptr] * 2 + [i64, i32]
        getattr(lib, f"zero_where_no_path_{suffix}").restype = None
        getattr(lib, f"loo_log_{suffix}").argtypes = [ptr] * 5 + [i64] * 3 + [i32]
        getattr(lib, f"loo_log_{suffix}").restype = None
        getattr(lib, f"log_space_rows_{suffix}").argtypes = [ptr] * 5 + [i64] * 3 + [i32]
        getattr(lib, f"log_space_rows_{suffix}").restype = None
        getattr(lib, f"entropy_reduce_rows_{suffix}").argtypes = [ptr] * 5 + [i64] * 3 + [i32]
        getattr(lib, f"entropy_reduce_rows_{suffix}").restype = None
    return lib


def _warn(reason: str) -> None:
    warnings.warn(
        f"semiring_autograd: fused CPU semiring matmul unavailable ({reason}); using blocked "
        f"eager evaluation, which is slower. Set {_ENV}=eager to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="semiring-kernel")


_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def _cpu_ready(*tensors: Tensor) -> ctypes.CDLL | None:
    if not enabled() or any(t.device.type != "cpu" or t.dtype not in _SUFFIX for t in tensors):
        return None
    if len({t.dtype for t in tensors}) != 1:
        return None
    with _LOCK:
        return _library()


def _pad_columns(b: Tensor, width: int, fill: float) -> Tensor:
    """``b`` (batch, k, n) contiguous with n padded to a multiple of ``width``."""
    n = b.shape[-1]
    padded = -(-n // width) * width
    if padded == n:
        return b.contiguous()
    out = b.new_full((*b.shape[:-1], padded), fill)
    out[..., :n] = b
    return out


def _run(fn, args_of, batch: int, blocks: int, work: int, openmp: bool) -> None:
    """Call ``fn(*args_of(b0, b1, c0, c1), threads)`` over every (batch, column block): once,
    on torch's OpenMP threads, when the library has OpenMP; else on disjoint ranges in a
    thread pool of our own."""
    threads = max(1, torch.get_num_threads())
    if threads == 1 or work < _PARALLEL_WORK:
        fn(*args_of(0, batch, 0, blocks), 1)
        return
    if openmp:
        fn(*args_of(0, batch, 0, blocks), threads)
        return
    if blocks >= threads or blocks >= batch:
        step = -(-blocks // threads)
        ranges = [(0, batch, c, min(c + step, blocks)) for c in range(0, blocks, step)]
    else:
        step = -(-batch // threads)
        ranges = [(b, min(b + step, batch), 0, blocks) for b in range(0, batch, step)]
    list(_pool(threads).map(lambda r: fn(*args_of(*r), 1), ranges))


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _cpu_call(
    name: str,
    a_parts: list[Tensor],
    b_parts: list[Tensor | None],
    fill: float,
    outputs: int,
    extra: tuple = (),
    cost: int = 1,
) -> list[Tensor] | None:
    """Run the C kernel ``name`` on (B, m, k) operands ``a_parts`` and (B, k, n) operands
    ``b_parts`` (None passes a null pointer), whose columns are padded with ``fill`` to the
    block width; returns ``outputs`` (B, m, n) tensors, or None when unavailable or a
    dimension is empty."""
    if a_parts[0].numel() == 0 or b_parts[0].numel() == 0:
        return None
    lib = _cpu_ready(*a_parts, *(t for t in b_parts if t is not None))
    if lib is None:
        return None
    suffix = _SUFFIX[a_parts[0].dtype]
    width = getattr(lib, f"block_width_{suffix}")()
    batch, m, k = a_parts[0].shape
    n = b_parts[0].shape[-1]
    a_parts = [t.contiguous() for t in a_parts]
    b_parts = [None if t is None else _pad_columns(t, width, fill) for t in b_parts]
    padded = b_parts[0].shape[-1]
    outs = [a_parts[0].new_empty((batch, m, padded)) for _ in range(outputs)]
    pointers = tuple(map(_ptr, (*a_parts, *b_parts, *outs)))
    _run(
        getattr(lib, f"{name}_{suffix}"),
        lambda b0, b1, c0, c1: pointers + (m, k, padded, b0, b1, c0, c1, *extra),
        batch,
        padded // width,
        batch * m * k * padded * cost,
        bool(lib.uses_openmp()),
    )
    return [o[..., :n] if padded != n else o for o in outs]


def max_times(a: Tensor, b: Tensor, init: float = 0.0, abs_b: bool = False) -> Tensor | None:
    """max(init, max_k a[bt, i, k] · b[bt, k, j]) for 3-D ``a`` (B, m, k) and ``b``
    (B, k, n) on the fused path, with |b| in place of b when ``abs_b`` (read while packing
    b); None when the fused path is unavailable (the caller falls back). NaN entries never
    win. On the CPU, terms whose bound |a|·max|b| cannot pass the row's accumulators are
    skipped (branch and bound; the result is the same to the bit)."""
    if a.device.type == "cuda" and enabled():
        return _cuda_call("max", a, b.abs() if abs_b else b, init)
    # NaN padding: no term, so the padded columns do not hold back the pruning bounds
    out = _cpu_call("max_times", [a], [b], float("nan"), 1, extra=(init, int(abs_b)))
    return None if out is None else out[0]


def signed_times(
    a_hi: Tensor, a_lo: Tensor, b_hi: Tensor, b_lo: Tensor | None
) -> tuple[Tensor, Tensor] | None:
    """(max_k, min_k) over the corner products of signed pairs a (B, m, k) and b (B, k, n);
    ``b_lo=None`` when b is a point (hi == lo). NaN marks an empty entry; an output with no
    non-empty term is (-inf, +inf). None when the fused path is unavailable."""
    if a_hi.device.type == "cuda" and enabled():
        return _cuda_call("signed", a_hi, a_lo, b_hi, b_hi if b_lo is None else b_lo)
    cost = 2 if b_lo is None else 4
    out = _cpu_call("signed_times", [a_hi, a_lo], [b_hi, b_lo], float("nan"), 2, cost=cost)
    return None if out is None else (out[0], out[1])


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
    if w.device.type == "cuda" and enabled():
        empty = a_hi < a_lo
        nan = torch.tensor(float("nan"), dtype=w.dtype, device=w.device)
        if zero_empty:
            w = torch.where(w == 0, nan, w)
        a_hi, a_lo = torch.where(empty, nan, a_hi), torch.where(empty, nan, a_lo)
        return _cuda_call("signed", a_hi, a_lo, w, w)
    if a_hi.numel() == 0 or w.numel() == 0:
        return None
    lib = _cpu_ready(w, a_hi, a_lo)
    if lib is None:
        return None
    if a_hi.stride() != a_lo.stride():
        a_hi, a_lo = a_hi.contiguous(), a_lo.contiguous()
    suffix = _SUFFIX[w.dtype]
    width = getattr(lib, f"block_width_{suffix}")()
    batch, m, k = a_hi.shape
    n = w.shape[-1]
    hi, lo = (w.new_empty((batch, m, n)) for _ in range(2))
    # the kernel computes lift(wᵀ) ⊗ aᵀ, transposed: wᵀ's rows are its point rows
    w_strides = (w.stride(0) if w.shape[0] > 1 else 0, w.stride(2), w.stride(1))
    a_strides = (a_hi.stride(0), a_hi.stride(2), a_hi.stride(1))
    head = (w.data_ptr(), *w_strides, a_hi.data_ptr(), a_lo.data_ptr(), *a_strides)
    tail = (hi.data_ptr(), lo.data_ptr(), n, k, m)
    blocks = -(-m // width)
    _run(
        getattr(lib, f"lift_times_{suffix}"),
        lambda b0, b1, c0, c1: head + tail + (b0, b1, c0, c1, int(zero_empty)),
        batch,
        blocks,
        batch * m * k * n * 2,
        bool(lib.uses_openmp()),
    )
    return hi, lo


def _elementwise(name: str, *inputs: Tensor) -> tuple[Tensor, Tensor] | None:
    """Run the elementwise C kernel ``name`` on ``inputs`` (broadcast together), giving two
    tensors of the broadcast shape; None off the CPU or without the library."""
    lib = _cpu_ready(*inputs)
    if lib is None:
        return None
    shape = inputs[0].shape
    if any(t.shape != shape for t in inputs):  # (broadcast_shapes alone costs ~9 µs)
        shape = torch.broadcast_shapes(*(t.shape for t in inputs))
        inputs = tuple(t.expand(shape) for t in inputs)
    inputs = tuple(t.contiguous() for t in inputs)
    first, second = torch.empty_like(inputs[0]), torch.empty_like(inputs[0])
    _over_entries(lib, name, (*inputs, first, second))
    return first, second


def _over_entries(lib: ctypes.CDLL, name: str, tensors: tuple[Tensor, ...]) -> None:
    """Call the elementwise C kernel ``name`` on contiguous ``tensors`` of one shape and
    dtype (pointers in order, then the entry count), split in blocks of ``_ENTRY_BLOCK``
    entries."""
    count, size = tensors[0].numel(), tensors[0].element_size()
    pointers = [t.data_ptr() for t in tensors]

    def args_of(b0: int, b1: int, c0: int, c1: int) -> tuple:
        start, stop = c0 * _ENTRY_BLOCK, min(count, c1 * _ENTRY_BLOCK)
        return (*(p + start * size for p in pointers), stop - start)

    blocks = -(-count // _ENTRY_BLOCK)
    fn = getattr(lib, f"{name}_{_SUFFIX[tensors[0].dtype]}")
    _run(fn, args_of, 1, blocks, count * _ENTRY_COST, bool(lib.uses_openmp()))


def signed_mul_lift(a_hi: Tensor, a_lo: Tensor, w: Tensor) -> tuple[Tensor, Tensor] | None:
    """The signed pair a times lift(w) elementwise (broadcasting), in one pass on the CPU:
    w > 0 keeps (a_hi, a_lo), w < 0 swaps them, each times w; w = 0 gives the empty
    (-inf, +inf), and an empty a stays empty. None off the CPU or without the library."""
    return _elementwise("signed_mul_lift", a_hi, a_lo, w)


def entropy_mul_lift(la: Tensor, r: Tensor, w: Tensor) -> tuple[Tensor, Tensor] | None:
    """The Entropy value (la, r) times lift(w) elementwise (broadcasting), in one pass on the
    CPU: (la + log|w|, r - log|w|), with r = 0 where the new la is -inf (no path; a NaN
    in r stays). log|w| is within 2 ulp of torch.log's. A ``w`` smaller than the value (a
    scalar, a row or a column broadcast over it) takes torch.log of w alone and two
    broadcasting torch ops instead: no w-sized copy of the value's size, no log per entry.
    None off the CPU or without the library."""
    if la.shape == r.shape and w.numel() < la.numel() and la.dim() >= w.dim():
        lib = _cpu_ready(la, r, w)
        if lib is None:
            return None
        log_w = torch.log(w.abs())
        sum_, rest = torch.add(la, log_w), torch.sub(r, log_w)
        if sum_.is_contiguous() and rest.is_contiguous():
            _over_entries(lib, "zero_where_no_path", (rest, sum_))
            return sum_, rest
    return _elementwise("entropy_mul_lift", la, r, w)


def entropy_add(la: Tensor, ra: Tensor, lb: Tensor, rb: Tensor) -> tuple[Tensor, Tensor] | None:
    """The Entropy ⊕ of (la, ra) and (lb, rb) elementwise (broadcasting), in one pass on the
    CPU: (logaddexp(la, lb), the Z-weighted mean of ra and rb), (-inf, 0) where both are
    -inf. None off the CPU or without the library."""
    return _elementwise("entropy_add", la, ra, lb, rb)


def ratio_where_positive(num: Tensor, den: Tensor) -> bool:
    """num / den where den > 0, else 0 (a sum without terms, 0/0), in place on ``num`` in
    one pass on the CPU; a NaN in num stays where den > 0. False (num untouched) off the
    CPU, without the library, or unless both are contiguous and of one shape."""
    lib = _cpu_ready(num, den)
    if lib is None or num.shape != den.shape:
        return False
    if not (num.is_contiguous() and den.is_contiguous()):
        return False
    _over_entries(lib, "ratio_where_positive", (num, den))
    return True


def _over_rows(lib: ctypes.CDLL, name: str, head: tuple, rows: int, work: int, dtype) -> None:
    """Call the row kernel ``name`` with the arguments ``head`` and a row range, over
    ``rows`` rows split among threads (``work``: the entries they hold)."""

    def args_of(b0: int, b1: int, c0: int, c1: int) -> tuple:
        return (*head, c0, c1)

    fn = getattr(lib, f"{name}_{_SUFFIX[dtype]}")
    _run(fn, args_of, 1, rows, work * _ENTRY_COST, bool(lib.uses_openmp()))


def _rows_with_fallback(
    lib: ctypes.CDLL, name: str, x: Tensor, r: Tensor | None, out: Tensor, out_r: Tensor | None
) -> bool:
    """Run the row kernel ``name`` (log-space rows that decline NaN and +inf) over the rows
    of the contiguous ``x`` (and ``r``) into ``out`` (and ``out_r``); False when some row
    was declined, so that the caller's torch formula handles them all."""
    n = x.shape[-1]
    rows = x.numel() // n
    bad = torch.empty(rows, dtype=torch.uint8)
    head = (x.data_ptr(), _ptr(r), out.data_ptr(), _ptr(out_r), bad.data_ptr(), n)
    _over_rows(lib, name, head, rows, x.numel(), x.dtype)
    return not bool(bad.any())


def loo_log(x: Tensor, r: Tensor | None) -> tuple[Tensor, Tensor | None] | None:
    """The leave-one-out ⊕ in log space along the last dim, in one C call on the CPU:
    log Σ_{j≠i} e^{x_j} and, given ``r`` (Entropy's, of x's shape), the e^x-weighted mean of
    the other entries' r (0 where no other entry has weight). Shifted by the top two of each
    row, as ``builtin_semirings._log_loo``. None off the CPU, without the library, or when a
    row holds NaN or +inf (the caller's torch formula then handles every row)."""
    parts = (x,) if r is None else (x, r)
    lib = _cpu_ready(*parts)
    if lib is None or x.dim() == 0 or (r is not None and r.shape != x.shape):
        return None
    x, r = x.contiguous(), None if r is None else r.contiguous()
    out_l = torch.empty_like(x)
    out_r = None if r is None else torch.empty_like(r)
    if x.shape[-1] and not _rows_with_fallback(lib, "loo_log", x, r, out_l, out_r):
        return None
    return out_l, out_r


def entropy_reduce_rows(la: Tensor, r: Tensor) -> tuple[Tensor, Tensor] | None:
    """Entropy's ⊕-reduction along the last dim (kept, size 1), in one C pass per row:
    log Σ e^la and the e^la-weighted mean of r (0 where no entry has weight), shifted by
    each row's maximum. None off the CPU, without the library, for rows of length 0, or when
    a row holds NaN or +inf (the caller's torch formula then handles every row)."""
    lib = _cpu_ready(la, r)
    if lib is None or la.dim() == 0 or la.shape[-1] == 0 or r.shape != la.shape:
        return None
    la, r = la.contiguous(), r.contiguous()
    out_l = la.new_empty((*la.shape[:-1], 1))
    out_r = la.new_empty(out_l.shape)
    if not _rows_with_fallback(lib, "entropy_reduce_rows", la, r, out_l, out_r):
        return None
    return out_l, out_r


def log_space_rows(a: Tensor, r: Tensor | None, out: Tensor) -> tuple[Tensor, Tensor] | None:
    """The message operand of a shift-and-GEMM in log space, in one C pass over the rows of
    ``a`` (…, m, k): each row's shift (its maximum where finite, else 0) and liveness (that
    maximum is finite), both (…, m, 1), and e = exp(a - shift) written into ``out``: (…, m, k),
    or, given ``r``, [e·r | e] (…, m, 2k). None (``out`` untouched) off the CPU, without
    the library, for k = 0, or unless a, r and out are contiguous."""
    parts = (a, out) if r is None else (a, r, out)
    lib = _cpu_ready(*parts)
    if lib is None or not all(t.is_contiguous() for t in parts) or a.dim() < 2:
        return None
    k = a.shape[-1]
    if k == 0:
        return None
    if out.shape != (*a.shape[:-1], k if r is None else 2 * k):
        raise ValueError(
            f"log_space_rows: out has shape {tuple(out.shape)} for a of shape {tuple(a.shape)}"
        )
    rows = a.numel() // max(1, k)
    shift = a.new_empty((*a.shape[:-1], 1))
    live = torch.empty(shift.shape, dtype=torch.bool)
    head = (a.data_ptr(), _ptr(r), out.data_ptr(), shift.data_ptr(), live.data_ptr(), k)
    _over_rows(lib, "log_space_rows", head, rows, a.numel(), a.dtype)
    return shift, live


def entropy_weights(w: Tensor, out: Tensor) -> bool:
    """Fill ``out`` (…, 2k, n) with the Entropy GEMM operands of a lifted (…, k, n) ``w``,
    stacked along the row dim: |w| in rows [0, k) and |w|·(-log|w|) in rows [k, 2k) (0 where
    w is 0 or NaN, -inf where |w| is inf), in one pass on the CPU. False (``out`` untouched)
    off the CPU or without the library."""
    k, n = w.shape[-2:]
    if out.shape != (*w.shape[:-2], 2 * k, n):
        raise ValueError(
            f"entropy_weights: out has shape {tuple(out.shape)}, expected "
            f"{(*w.shape[:-2], 2 * k, n)} for w of shape {tuple(w.shape)}"
        )
    lib = _cpu_ready(w, out)
    if lib is None or not out.is_contiguous():
        return False
    w = w.contiguous()
    count = w.shape[-2] * w.shape[-1]
    batch = w.numel() // max(1, count)
    head = (w.data_ptr(), out.data_ptr(), count)

    def args_of(b0: int, b1: int, c0: int, c1: int) -> tuple:
        return (*head, c0 * _ENTRY_BLOCK, min(count, c1 * _ENTRY_BLOCK), b0, b1)

    fn = getattr(lib, f"entropy_weights_{_SUFFIX[w.dtype]}")
    blocks = -(-count // _ENTRY_BLOCK)
    _run(fn, args_of, batch, blocks, w.numel() * _ENTRY_COST, bool(lib.uses_openmp()))
    return True


# ----- CUDA: Inductor/Triton -------------------------------------------------------------
def _max_times_formula(a: Tensor, b: Tensor, init: float) -> Tensor:
    p = a[:, :, :, None] * b[:, None, :, :]
    p = torch.where(torch.isnan(p), torch.full_like(p, init), p)
    return p.amax(dim=2).clamp_min(init)


def _signed_formula(a_hi: Tensor, a_lo: Tensor, b_hi: Tensor, b_lo: Tensor):
    ah, al = a_hi[:, :, :, None], a_lo[:, :, :, None]
    bh, bl = b_hi[:, None, :, :], b_lo[:, None, :, :]
    p1, p2, p3, p4 = ah * bh, ah * bl, al * bh, al * bl
    top = torch.maximum(torch.maximum(p1, p2), torch.maximum(p3, p4))
    bottom = torch.minimum(torch.minimum(p1, p2), torch.minimum(p3, p4))
    empty = torch.isnan(top)
    top = torch.where(empty, torch.full_like(top, float("-inf")), top)
    bottom = torch.where(empty, torch.full_like(bottom, float("inf")), bottom)
    return top.amax(dim=2), bottom.amin(dim=2)


@functools.cache
def _compiled(name: str):
    formula = {"max": _max_times_formula, "signed": _signed_formula}[name]
    return torch.compile(formula, dynamic=True, fullgraph=True)


_CUDA_FAILED: set[str] = set()
_RECOMPILE_LIMIT = 64


def _cuda_call(name: str, *args):
    if any(a.numel() == 0 for a in args):
        return None
    if name not in _CUDA_FAILED:
        try:
            # one compilation per dtype and size-1 pattern; allow more than dynamo's default
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
                return _compiled(name)(*args)
        except Exception as error:  # noqa: BLE001 -- any compile failure means: fall back
            _CUDA_FAILED.add(name)
            warnings.warn(
                f"semiring_autograd: torch.compile of the CUDA {name} matmul failed "
                f"({type(error).__name__}: {error}); using blocked eager evaluation.",
                RuntimeWarning,
                stacklevel=3,
            )
    return None
