"""Hand-tiled Triton kernels of the three semiring matmuls: ``max_times``, ``signed_times`` and
``lift_times`` (the semantics of the operators of the same names in ``operators.py``).

Design. A program computes one BLOCK_M × BLOCK_N output tile of one batch entry, its
accumulators in registers (one tile for max_times, a hi and a lo tile for the pairs). It walks
k from 0 to K in order: per k it loads a column of a (BLOCK_M entries) and a row of b (BLOCK_N
entries) and applies their outer product to the tile, as a GEMM's rank-1 update; for
max_times that is one multiply and one compare-and-select per entry. The tile is held as
(BLOCK_N / 8, BLOCK_M, 8), (column group, row, column in the group), so that Triton's default
layout puts a warp's lanes on 4 rows × 8 columns: a thread of a 64 × 64 tile of 4 warps holds
4 rows × 8 columns and loads 4 entries of a and 8 of b per k for 32 terms (a plain
(BLOCK_M, BLOCK_N) tile gets 32 rows × 1 column a thread: 33 loads for 32 terms). Rows and
columns past the matrix are read clamped to the last one, so the k loop has no masks; the
store is masked. The k loop is unrolled BLOCK_K times. Programs go in groups of GROUP_M tile
rows, so that programs running together share their a rows and b columns in L2.

Compiled ahead of time for sm_90 (Triton's ptxas; not run on a GPU), float32, the k loop took
per term max_times 3.9 instructions (3 floating point), 128 to 168 registers a thread and no
spills (float64: up to 252, no spills either).

Why no ``tl.dot``: tensor cores only add products; here ⊕ is max or min. Why compare and
select, ``vmax(x, y) = x > y ? x : y``, and not ``tl.maximum``: these are the CPU kernels'
own selects (``extreme_matmul.h``), applied in the same order, so every entry is
bit-identical to the CPU kernels' on every input (zeros' signs and NaN cases included), on
the GPU and in the interpreter alike, where ``max.f32`` and numpy pick between -0.0 and +0.0
by rules of their own. No tiling can change a value: each entry sees its terms in the same
order whatever the tile sizes (a split of k over programs would change the sign of some zero
results; there is none).

Per term and output entry (``acc = vmax(p, acc)``: a NaN never replaces the accumulator, a
tie keeps it):

- max_times: p = a·b' (b' = |b| when ``abs_b``, |-0.0| = -0.0 as on the CPU); the
  accumulator starts at ``init``.
- signed_times: the corners p1..p4 = a_hi·b_hi, a_lo·b_hi, a_hi·b_lo, a_lo·b_lo (the first
  two when b is a point), top = vmax(vmax(p1, p2), vmax(p3, p4)) and bottom the same with
  vmin; accumulators start at (-inf, +inf).
- lift_times: an a entry with a_hi < a_lo is made NaN, and so is a w entry of 0 when
  ``zero_empty``; (top, bottom) = (a_hi·w, a_lo·w) where w > 0, else (a_lo·w, a_hi·w): the
  corner products of the pair and the point w, in 2 products.

A term whose corners are NaN in some places but not all (±inf·0) keeps, as on the CPU, what
the selects return; the broadcast formulas of the tests skip such a term whole.

The launchers take 3-D tensors on one device (CUDA, or CPU when the module was imported with
``TRITON_INTERPRET=1``), float32 or float64, any strides (passed to the kernels, no copies);
b and w may have batch size 1 (read with batch stride 0). They write into given outputs of
any strides, so that the caller allocates the layout its fake implementation promises.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

#: (BLOCK_M, BLOCK_N, num_warps): on a GPU 64 × 64 tiles of 4 warps (32 entries per thread);
#: in the interpreter, which runs each program as numpy operations on its tile, 16 × 16 of 1
TILE = (16, 16, 1) if triton.knobs.runtime.interpret else (64, 64, 4)

#: TILE's exceptions on a GPU, by (kernel, dtype): max_times in float32 takes 64 × 128 tiles of
#: 4 warps, the fastest of the seven tiles ``benchmarks/max_times_gemm.py --tiles`` times (an
#: NVIDIA H200, n = 8192, triton 3.6: 6.4 T terms/s, 5.1 with 64 × 64; the same result to the
#: bit). Float64 and the pair kernels keep TILE: their tiles are not measured on a GPU.
TILES = {} if triton.knobs.runtime.interpret else {("max_times", torch.float32): (64, 128, 4)}

#: BLOCK_K, the unroll of the k loop: 4 for max_times (3.9 instructions per term instead of
#: 4.6 unrolled once; 128 registers instead of 72, from ptxas for sm_90), 1 for the pairs
#: (their two accumulator tiles leave little room for unrolled registers; the unroll of the
#: pair kernels in their present form is not measured)
UNROLL = {"max_times": 4, "pairs": 1}

#: tile rows per group of programs (the L2 reuse of the ordering)
GROUP_M = 8

#: columns of a tile per lane group: a tile is held as (BLOCK_N / LANES_N, BLOCK_M, LANES_N)
LANES_N = tl.constexpr(8)


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's batch entry (int64), output rows (BLOCK_M) and output columns
    (BLOCK_N / LANES_N, LANES_N): programs are numbered by batch entry, then by groups of
    GROUP_M tile rows, column by column within a group."""
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    bt = pid // (tiles_m * tiles_n)
    tile = pid % (tiles_m * tiles_n)
    in_group = tile % (GROUP_M * tiles_n)
    first = tile // (GROUP_M * tiles_n) * GROUP_M
    height = tl.minimum(tiles_m - first, GROUP_M)
    rows = (first + in_group % height) * BLOCK_M + tl.arange(0, BLOCK_M)
    groups = tl.arange(0, BLOCK_N // LANES_N)[:, None] * LANES_N
    cols = in_group // height * BLOCK_N + groups + tl.arange(0, LANES_N)[None, :]
    return bt.to(tl.int64), rows, cols


@triton.jit
def _start(x, bt, idx, size, s_batch, s_idx):
    """Pointers to x[bt, min(idx, size - 1), 0] (strides s_batch, s_idx), in int64: rows or
    columns past the matrix read its last one, unmasked."""
    return x + bt * s_batch + tl.minimum(idx, size - 1).to(tl.int64) * s_idx


@triton.jit
def _store(out, bt, rows, cols, M, N, s_batch, s_row, s_col, value):
    """out[bt, rows, cols] = value (BLOCK_N / LANES_N, BLOCK_M, LANES_N), for the rows < M
    and columns < N."""
    rows, cols = rows[None, :, None], cols[:, None, :]
    ptrs = out + bt * s_batch + rows.to(tl.int64) * s_row + cols.to(tl.int64) * s_col
    tl.store(ptrs, value, mask=(rows < M) & (cols < N))


@triton.jit
def _max_times_kernel(
    a, b, out, M, N, K,
    a_sb, a_sm, a_sk, b_sb, b_sk, b_sn, o_sb, o_sm, o_sn, init,
    ABS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """out[bt, i, j] = max(init, max_k a[bt, i, k]·b'[bt, k, j]), NaN products skipped."""
    bt, rows, cols = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    a_ptrs = _start(a, bt, rows, M, a_sb, a_sm)
    b_ptrs = _start(b, bt, cols, N, b_sb, b_sn)
    acc = tl.broadcast_to(tl.load(init), (BLOCK_N // LANES_N, BLOCK_M, LANES_N))
    for _ in tl.range(0, K, loop_unroll_factor=BLOCK_K):
        x = tl.load(a_ptrs)[None, :, None]
        y = tl.load(b_ptrs)[:, None, :]
        if ABS_B:
            y = tl.where(y < 0, -y, y)
        p = x * y
        acc = _vmax(p, acc)
        a_ptrs += a_sk
        b_ptrs += b_sk
    _store(out, bt, rows, cols, M, N, o_sb, o_sm, o_sn, acc)


@triton.jit
def _vmax(x, y):
    """The CPU kernels' vmax: x > y ? x : y (y on a tie and where either is NaN)."""
    return tl.where(x > y, x, y)


@triton.jit
def _vmin(x, y):
    """The CPU kernels' vmin: x < y ? x : y."""
    return tl.where(x < y, x, y)


@triton.jit
def _signed_times_kernel(
    a_hi, a_lo, b_hi, b_lo, out_hi, out_lo, M, N, K,
    ah_sb, ah_sm, ah_sk, al_sb, al_sm, al_sk, bh_sb, bh_sk, bh_sn, bl_sb, bl_sk, bl_sn,
    oh_sb, oh_sm, oh_sn, ol_sb, ol_sm, ol_sn,
    POINT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """(out_hi, out_lo)[bt, i, j] = (max_k, min_k) of the corner products of a[bt, i, k] and
    b[bt, k, j] (b = (b_hi, b_hi) when POINT), by the CPU kernels' selects."""
    bt, rows, cols = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    ah_ptrs = _start(a_hi, bt, rows, M, ah_sb, ah_sm)
    al_ptrs = _start(a_lo, bt, rows, M, al_sb, al_sm)
    bh_ptrs = _start(b_hi, bt, cols, N, bh_sb, bh_sn)
    bl_ptrs = _start(b_lo, bt, cols, N, bl_sb, bl_sn)
    shape: tl.constexpr = (BLOCK_N // LANES_N, BLOCK_M, LANES_N)
    acc_hi = tl.full(shape, float("-inf"), out_hi.dtype.element_ty)
    acc_lo = tl.full(shape, float("inf"), out_hi.dtype.element_ty)
    for _ in tl.range(0, K, loop_unroll_factor=BLOCK_K):
        xh = tl.load(ah_ptrs)[None, :, None]
        xl = tl.load(al_ptrs)[None, :, None]
        yh = tl.load(bh_ptrs)[:, None, :]
        p1 = xh * yh
        p2 = xl * yh
        top = _vmax(p1, p2)
        bottom = _vmin(p1, p2)
        if not POINT:
            yl = tl.load(bl_ptrs)[:, None, :]
            p3 = xh * yl
            p4 = xl * yl
            top = _vmax(top, _vmax(p3, p4))
            bottom = _vmin(bottom, _vmin(p3, p4))
            bl_ptrs += bl_sk
        acc_hi = _vmax(top, acc_hi)
        acc_lo = _vmin(bottom, acc_lo)
        ah_ptrs += ah_sk
        al_ptrs += al_sk
        bh_ptrs += bh_sk
    _store(out_hi, bt, rows, cols, M, N, oh_sb, oh_sm, oh_sn, acc_hi)
    _store(out_lo, bt, rows, cols, M, N, ol_sb, ol_sm, ol_sn, acc_lo)


@triton.jit
def _lift_times_kernel(
    a_hi, a_lo, w, out_hi, out_lo, M, N, K,
    ah_sb, ah_sm, ah_sk, al_sb, al_sm, al_sk, w_sb, w_sk, w_sn,
    oh_sb, oh_sm, oh_sn, ol_sb, ol_sm, ol_sn,
    ZERO_EMPTY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """(out_hi, out_lo)[bt, i, j] = (max_k, min_k) of a[bt, i, k] times lift(w[bt, k, j]):
    (a_hi·w, a_lo·w) where w > 0, else (a_lo·w, a_hi·w); empty a entries (a_hi < a_lo) and
    zero w entries when ZERO_EMPTY are NaN, which never replaces an accumulator."""
    bt, rows, cols = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    ah_ptrs = _start(a_hi, bt, rows, M, ah_sb, ah_sm)
    al_ptrs = _start(a_lo, bt, rows, M, al_sb, al_sm)
    w_ptrs = _start(w, bt, cols, N, w_sb, w_sn)
    shape: tl.constexpr = (BLOCK_N // LANES_N, BLOCK_M, LANES_N)
    acc_hi = tl.full(shape, float("-inf"), out_hi.dtype.element_ty)
    acc_lo = tl.full(shape, float("inf"), out_hi.dtype.element_ty)
    for _ in tl.range(0, K, loop_unroll_factor=BLOCK_K):
        xh = tl.load(ah_ptrs)
        xl = tl.load(al_ptrs)
        empty = xh < xl
        xh = tl.where(empty, float("nan"), xh)[None, :, None]
        xl = tl.where(empty, float("nan"), xl)[None, :, None]
        y = tl.load(w_ptrs)
        if ZERO_EMPTY:
            y = tl.where(y == 0, float("nan"), y)
        positive = (y > 0)[:, None, :]
        y = y[:, None, :]
        top = tl.where(positive, xh, xl) * y
        bottom = tl.where(positive, xl, xh) * y
        acc_hi = _vmax(top, acc_hi)
        acc_lo = _vmin(bottom, acc_lo)
        ah_ptrs += ah_sk
        al_ptrs += al_sk
        w_ptrs += w_sk
    _store(out_hi, bt, rows, cols, M, N, oh_sb, oh_sm, oh_sn, acc_hi)
    _store(out_lo, bt, rows, cols, M, N, ol_sb, ol_sm, ol_sn, acc_lo)


def _check(left: tuple[Tensor, ...], right: tuple[Tensor, ...], outs: tuple[Tensor, ...]):
    """Raise ValueError unless the left operands are (B, m, k), the right ones (B or 1, k, n)
    and the outputs (B, m, n), all 3-D of one float dtype on one device."""
    first = left[0]
    tensors = (*left, *right, *outs)
    if any(t.dim() != 3 for t in tensors):
        raise ValueError("triton_matmul: every operand and output must be 3-D")
    if first.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"triton_matmul: float32 or float64, got {first.dtype}")
    if any(t.dtype != first.dtype or t.device != first.device for t in tensors):
        raise ValueError("triton_matmul: operands and outputs of one dtype and device")
    batch, m, k = first.shape
    n = right[0].shape[2]
    if any(t.shape != first.shape for t in left) or any(
        t.shape[1:] != (k, n) or t.shape[0] not in (1, batch) for t in right
    ):
        raise ValueError("triton_matmul: operands (B, m, k) and (B or 1, k, n) expected")
    if any(t.shape != (batch, m, n) for t in outs):
        raise ValueError(f"triton_matmul: outputs of shape {(batch, m, n)} expected")


def _strides(x: Tensor) -> tuple[int, int, int]:
    """x's strides, batch stride 0 when its batch size is 1 (broadcast over the batch)."""
    return (0 if x.shape[0] == 1 else x.stride(0), x.stride(1), x.stride(2))


def _launch(kernel, operands: tuple[Tensor, ...], k: int, *extra, block_k: int, tile=None, **flags):
    """Run ``kernel`` with the operands, (m, n, k), the operands' strides and ``extra``, on one
    program per output tile (``tile``, default TILE); the last operand is an output (B, m, n)."""
    tile = tile or TILE
    batch, m, n = operands[-1].shape
    if operands[-1].numel() == 0:
        return
    block_m, block_n, warps = tile
    kernel[(batch * triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)](
        *operands,
        m,
        n,
        k,
        *(s for x in operands for s in _strides(x)),
        *extra,
        **flags,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=GROUP_M,
        num_warps=warps,
    )


def max_times(a: Tensor, b: Tensor, init: float, abs_b: bool, out: Tensor) -> Tensor:
    """out[bt, i, j] = max(init, max_k a[bt, i, k]·b'[bt, k, j]) for a (B, m, k) and b
    (B or 1, k, n), with b' = |b| when ``abs_b``; a NaN product never wins. Writes into
    ``out`` (B, m, n) and returns it."""
    _check((a,), (b,), (out,))
    start = torch.full((1,), init, dtype=out.dtype, device=out.device)  # exact in float64
    _launch(
        _max_times_kernel,
        (a, b, out),
        a.shape[2],
        start,
        block_k=UNROLL["max_times"],
        tile=TILES.get(("max_times", a.dtype)),
        ABS_B=abs_b,
    )
    return out


def signed_times(
    a_hi: Tensor,
    a_lo: Tensor,
    b_hi: Tensor,
    b_lo: Tensor | None,
    out_hi: Tensor,
    out_lo: Tensor,
) -> tuple[Tensor, Tensor]:
    """(max_k, min_k) over the corner products of the signed pairs a (B, m, k) and b
    (B or 1, k, n); ``b_lo=None`` when b is a point. A NaN never replaces an accumulator
    (the CPU kernels' selects); an output with no term that does is (-inf, +inf). Writes
    into ``out_hi`` and ``out_lo`` (B, m, n) and returns them."""
    point = b_lo is None
    b_lo = b_hi if point else b_lo
    _check((a_hi, a_lo), (b_hi, b_lo), (out_hi, out_lo))
    operands = (a_hi, a_lo, b_hi, b_lo, out_hi, out_lo)
    _launch(_signed_times_kernel, operands, a_hi.shape[2], block_k=UNROLL["pairs"], POINT=point)
    return out_hi, out_lo


def lift_times(
    a_hi: Tensor, a_lo: Tensor, w: Tensor, zero_empty: bool, out_hi: Tensor, out_lo: Tensor
) -> tuple[Tensor, Tensor]:
    """The signed matmul of the pair a (B, m, k) and lift(w) for a real w (B or 1, k, n):
    (max_k, min_k) of (a_hi·w, a_lo·w) where w > 0, else of (a_lo·w, a_hi·w). An a entry
    with a_hi < a_lo is empty, and so is a w entry of 0 when ``zero_empty``; a NaN product
    never replaces an accumulator; an output with no term that does is (-inf, +inf). Writes
    into ``out_hi`` and ``out_lo`` (B, m, n) and returns them."""
    _check((a_hi, a_lo), (w,), (out_hi, out_lo))
    operands = (a_hi, a_lo, w, out_hi, out_lo)
    _launch(
        _lift_times_kernel,
        operands,
        a_hi.shape[2],
        block_k=UNROLL["pairs"],
        ZERO_EMPTY=zero_empty,
    )
    return out_hi, out_lo
