"""The fused semiring matmuls against a plain broadcast-and-reduce oracle.

The fused paths (C++ on CPU, Triton on CUDA) must give exactly the values of the eager
formula: every product is the same floating-point multiply, and max/min are exact. The
shapes cover block tails (rows not a multiple of 4, columns not a multiple of the SIMD
block), empty-entry markers, batches and the multi-threaded split.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import semiring_autograd as sa
from semiring_autograd import kernels
from semiring_autograd.semirings import BUILTIN_SEMIRINGS, MaxProduct, SignedMaxProduct, tensor_ops

NAN, INF = float("nan"), float("inf")
SHAPES = [
    (1, 1, 1, 1),
    (1, 5, 7, 3),
    (2, 9, 33, 70),
    (3, 4, 16, 32),
    (1, 130, 64, 100),  # above the threading threshold, column split
    (8, 64, 48, 20),  # above the threading threshold, batch split
    (1, 8, 512, 100),  # a few rows above the threading threshold, column tail
    (6, 3, 256, 70),  # a few rows, batch and column split
]
DTYPES = [torch.float32, torch.float64]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _eager_max(a, b):
    return (a[:, :, :, None] * b[:, None, :, :]).amax(2)


def _eager_signed(ah, al, bh, bl):
    corners = torch.stack([x[:, :, :, None] * y[:, None] for x in (ah, al) for y in (bh, bl)])
    empty = torch.isnan(corners).any(0)
    top = torch.where(empty, -INF, corners.amax(0)).amax(2)
    bottom = torch.where(empty, INF, corners.amin(0)).amin(2)
    return top, bottom


def _signed_operand(shape, dtype, device, gen, point):
    hi = torch.randn(shape, dtype=dtype, generator=gen).to(device)
    lo = hi if point else hi - torch.rand(shape, dtype=dtype, generator=gen).to(device)
    empty = torch.rand(shape, generator=gen).to(device) < 0.3
    return hi.masked_fill(empty, NAN), lo.masked_fill(empty, NAN)


@pytest.fixture(autouse=True)
def _fused_available():
    if not kernels.enabled():
        pytest.skip("SEMIRING_AUTOGRAD_KERNELS=eager: the fused kernels are switched off")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_max_times_equals_broadcast_amax(shape, dtype, device):
    gen = torch.Generator().manual_seed(sum(shape))
    batch, m, k, n = shape
    a = torch.rand(batch, m, k, dtype=dtype, generator=gen).to(device)
    b = torch.rand(batch, k, n, dtype=dtype, generator=gen).to(device)
    a[a < 0.2] = 0.0  # exact zeros: no edge, product 0
    got = kernels.max_times(a, b)
    assert got is not None, "the fused kernel is unavailable on this machine"
    torch.testing.assert_close(got, _eager_max(a, b), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("point", [False, True], ids=["interval", "point"])
def test_signed_times_equals_corner_products(shape, dtype, device, point):
    gen = torch.Generator().manual_seed(sum(shape) + point)
    batch, m, k, n = shape
    ah, al = _signed_operand((batch, m, k), dtype, device, gen, point=False)
    bh, bl = _signed_operand((batch, k, n), dtype, device, gen, point=point)
    got = kernels.signed_times(ah, al, bh, None if point else bl)
    assert got is not None, "the fused kernel is unavailable on this machine"
    expected = _eager_signed(ah, al, bh, bl)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("zero_empty", [False, True], ids=["zero", "zero_empty"])
@pytest.mark.parametrize("w_layout", ["rows", "columns"])
def test_pair_lift_matmul_equals_corner_products(shape, dtype, device, zero_empty, w_layout):
    """The point-first kernel (a ⊗ lift(w) for a signed pair a and a real w) against the
    corner products: empty entries given as hi < lo, exact zeros in w (no edge when
    ``zero_empty``), a w shared by the batch, w read along its rows (small problems run
    their terms directly) or across them (any strides)."""
    gen = torch.Generator().manual_seed(sum(shape) + zero_empty)
    batch, m, k, n = shape
    ah, al = _signed_operand((batch, m, k), dtype, device, gen, point=False)
    empty = torch.isnan(ah)
    w = torch.randn(1, n, k, dtype=dtype, generator=gen).to(device).mT  # strides (.., 1, k)
    if w_layout == "rows":
        w = w.contiguous()
    w = w.masked_fill(torch.rand(w.shape, generator=gen).to(device) < 0.2, 0.0)
    got = kernels.pair_lift_matmul(
        ah.masked_fill(empty, -INF), al.masked_fill(empty, INF), w, zero_empty
    )
    assert got is not None, "the fused kernel is unavailable on this machine"
    point = w.masked_fill(w == 0, NAN) if zero_empty else w
    expected = _eager_signed(ah, al, point.expand(batch, k, n), point.expand(batch, k, n))
    for g, e in zip(got, expected):
        assert g.is_contiguous()
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def _pruning_case(scenario: str, shape, dtype, gen):
    """Operands a (B, m, k) and b (B, k, n) on which the kernels skip most terms: the
    magnitudes decay along k, so the early terms set the maxima and the later ones cannot
    reach them. "late_winner" puts terms at the last k that must still win (a large one,
    and a large negative one for the signed minimum); "uneven_rows" scales rows and
    columns by up to 10^±3, so that one row's bound never stands in for another's;
    "specials" adds infinities, exact zeros and a row of zeros. k spans several k blocks
    (resumed accumulators), m and n are not multiples of the row group or the block width
    (padding columns: dead for the pruning marks)."""
    batch, m, k, n = shape
    decay = 2.0 ** (-torch.arange(k, dtype=torch.float64) / 16)
    a = torch.randn(batch, m, k, dtype=torch.float64, generator=gen) * decay
    b = torch.randn(batch, k, n, dtype=torch.float64, generator=gen) * decay[:, None]
    if scenario == "late_winner":
        a[:, 3, -1], a[:, 5, -1] = 1e3, -1e3
        b[:, -1, 2] = 1e3
    elif scenario == "uneven_rows":
        a *= 10.0 ** (torch.arange(m, dtype=torch.float64) % 7 - 3)[:, None]
        b *= 10.0 ** (torch.arange(n, dtype=torch.float64) % 7 - 3)
    elif scenario == "specials":
        a[:, 1, 200], a[:, 2, 250] = INF, -INF
        b[:, 40, 3] = INF
        a[:, 4] = 0.0
        b[:, 10:60:7, :] = 0.0
    return a.to(dtype), b.to(dtype)


PRUNING_SHAPE = (2, 37, 300, 70)
#: three k blocks, the last one partial
LONG_K_SHAPE = (2, 37, 600, 70)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scenario", ["decaying", "late_winner", "uneven_rows", "specials"])
@pytest.mark.parametrize("shape", [PRUNING_SHAPE, LONG_K_SHAPE], ids=["k300", "k600"])
def test_pruned_max_times_is_exact(scenario, dtype, shape):
    """max_times skips the terms that cannot pass its accumulators (branch and bound): the
    result is still exactly max(0, the broadcast max), NaN products (0 · inf) never
    winning, with b or |b|, for a non-negative a (MaxProduct's messages) or any a."""
    gen = torch.Generator().manual_seed(7)
    signed, b = _pruning_case(scenario, shape, dtype, gen)
    for a, abs_b in [(signed.abs(), False), (signed.abs(), True), (signed, False)]:
        got = kernels.max_times(a, b, abs_b=abs_b)
        assert got is not None, "the fused kernel is unavailable on this machine"
        products = a[:, :, :, None] * (b.abs() if abs_b else b)[:, None]
        expected = products.nan_to_num(nan=-INF, posinf=INF, neginf=-INF).amax(2).clamp_min(0)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


#: a prompt's few rows: b read along its rows in chunks of columns (several, the last one
#: partial: n past STREAM_COLUMNS), or on two threads in shares of its rows (one chunk)
FEW_ROWS = [(1, 1, 700, 2100), (2, 3, 300, 1030), (1, 8, 900, 100), (1, 5, 3, 37)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", FEW_ROWS, ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_max_times_of_few_rows_equals_the_definition(shape, dtype, threads):
    """Up to 8 rows, max_times streams b's rows: max(init, the broadcast max) to the bit, with
    b or |b|, for any a, NaN products (a NaN in a, 0 · inf) never winning; max_times_finite
    the same on finite operands and None where an entry of a or of b (in the last chunk, or
    in the last share of b's rows) is NaN or infinite; one thread or two alike."""
    gen = torch.Generator().manual_seed(sum(shape))
    batch, m, k, n = shape
    a = torch.randn(batch, m, k, dtype=dtype, generator=gen)
    b = torch.randn(batch, k, n, dtype=dtype, generator=gen)
    a[a.abs() < 0.2] = 0.0
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for operand, abs_b, init in ((a.abs(), True, 0.0), (a, False, -INF), (a, True, -INF)):
            products = operand[:, :, :, None] * (b.abs() if abs_b else b)[:, None]
            expected = products.amax(2).clamp_min(init)
            got = kernels.max_times_finite(operand, b, init, abs_b)
            assert got is not None, "the fused kernel is unavailable on this machine"
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
            holed = operand.clone()
            holed[-1, -1, k // 2] = NAN
            kept = products.clone()
            kept[-1, -1, k // 2] = NAN
            expected = kept.nan_to_num(nan=-INF, posinf=INF, neginf=-INF).amax(2)
            got = kernels.max_times(holed, b, init, abs_b)
            torch.testing.assert_close(got, expected.clamp_min(init), rtol=0, atol=0)
            assert kernels.max_times_finite(holed, b, init, abs_b) is None
        for at in ((-1, -1, -1), (0, k - 1, 0)):
            bent = b.clone()
            bent[at] = INF
            assert kernels.max_times_finite(a.abs(), bent, 0.0, True) is None
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scenario", ["decaying", "late_winner", "uneven_rows", "specials"])
@pytest.mark.parametrize("zero_empty", [False, True], ids=["zero", "zero_empty"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_pruned_pair_lift_matmul_is_exact(scenario, dtype, zero_empty, layout):
    """pair_lift_matmul skips the terms that cannot pass its (hi, lo) accumulators: both
    ends stay exactly the corner products', with empty message entries, a message row
    with no entry at all (a dead column for the pruning marks), and w read along its rows
    or across them."""
    gen = torch.Generator().manual_seed(11)
    a, w = _pruning_case(scenario, PRUNING_SHAPE, dtype, gen)
    batch, m, k, n = PRUNING_SHAPE
    ah = a
    spread = torch.rand(a.shape, dtype=dtype, generator=gen) * a.abs()
    al = torch.where(a.isinf(), a, a - spread)  # (inf, inf): a point at infinity
    empty = torch.rand(a.shape, generator=gen) < 0.2
    empty[:, 6] = True  # a message row without entries
    ah, al = ah.masked_fill(empty, NAN), al.masked_fill(empty, NAN)
    if layout == "transposed":
        w = w.mT.contiguous().mT
    got = kernels.pair_lift_matmul(
        ah.masked_fill(empty, -INF), al.masked_fill(empty, INF), w, zero_empty
    )
    assert got is not None, "the fused kernel is unavailable on this machine"
    point = w.masked_fill(w == 0, NAN) if zero_empty else w
    expected = _eager_signed(ah, al, point, point)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", [((70000,), (70000,)), ((300, 1), (300, 250))], ids=str)
def test_signed_mul_lift_kernel_equals_formula(dtype, shapes, monkeypatch):
    """The one-pass signed a ⊗ lift(w) above the threading threshold and with a broadcast
    operand, against the semiring's torch formula (kernels switched off), bit for bit: with
    empty pairs, zero weights of both signs, NaN and infinite ends and weights (a NaN end
    times lift(0) is NaN, an infinite end times a finite weight infinite, 0 times an
    infinite weight NaN)."""
    gen = torch.Generator().manual_seed(5)
    a_shape, w_shape = shapes

    def where(p, shape):
        return torch.rand(shape, generator=gen) < p

    hi = torch.randn(a_shape, dtype=dtype, generator=gen)
    lo = hi - torch.rand(a_shape, dtype=dtype, generator=gen)
    empty = where(0.2, a_shape)
    hi = hi.masked_fill(empty, -INF).masked_fill(where(0.05, a_shape), NAN)
    hi = hi.masked_fill(where(0.05, a_shape), INF).masked_fill(where(0.05, a_shape), 0.0)
    lo = lo.masked_fill(empty, INF).masked_fill(where(0.05, a_shape), NAN)
    lo = lo.masked_fill(where(0.05, a_shape), -INF)
    w = torch.randn(w_shape, dtype=dtype, generator=gen)
    w = w.masked_fill(where(0.2, w_shape), 0.0).masked_fill(where(0.1, w_shape), -0.0)
    w = w.masked_fill(where(0.05, w_shape), INF).masked_fill(where(0.05, w_shape), NAN)
    got = kernels.signed_mul_lift(hi, lo, w)
    assert got is not None, "the fused kernel is unavailable on this machine"
    monkeypatch.setenv("SEMIRING_AUTOGRAD_KERNELS", "eager")
    expected = SignedMaxProduct().mul_lift((hi, lo), w)
    for g, e in zip(got, expected):
        assert torch.equal(g.isnan(), e.isnan())
        assert torch.equal(g.nan_to_num(0.0).signbit(), e.nan_to_num(0.0).signbit())
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)
        assert bool(e.isnan().any()) and bool(e.isinf().any())


def test_all_empty_row_is_the_semiring_zero():
    ah = torch.full((1, 2, 5), NAN)
    bh = torch.randn(1, 5, 3)
    hi, lo = kernels.signed_times(ah, ah, bh, None)
    assert torch.all(hi == -INF) and torch.all(lo == INF)


@pytest.mark.parametrize("semiring", [MaxProduct(), SignedMaxProduct()], ids=repr)
def test_semiring_matmul_fused_equals_eager(semiring, monkeypatch):
    """The semiring's matmul (batch broadcasting, a point operand on either side, lifted
    zeros) gives the same value with the kernels on and off."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1, 6, 40, dtype=torch.float64, generator=gen)
    w = torch.randn(3, 40, 9, dtype=torch.float64, generator=gen)
    x[x.abs() < 0.5] = 0.0
    message = semiring.matmul(semiring.lift(x), semiring.lift(w))  # an interval value
    cases = [
        (message, semiring.lift(torch.randn(9, 17, dtype=torch.float64, generator=gen))),
        (semiring.lift(torch.randn(5, 6, dtype=torch.float64, generator=gen)), message),
        (message, semiring.lift(torch.zeros(9, 4, dtype=torch.float64))),
    ]
    fused = [semiring.matmul(a, b) for a, b in cases]
    monkeypatch.setenv("SEMIRING_AUTOGRAD_KERNELS", "eager")
    eager = [semiring.matmul(a, b) for a, b in cases]
    for f, e in zip(fused, eager):
        for fc, ec in zip(f, e):
            torch.testing.assert_close(fc, ec, rtol=0, atol=0)


NON_FINITE = [
    ("a", (0, 0, 0), NAN),
    ("a", (-1, -1, -1), INF),
    ("b", (0, 1, 2), -INF),
    ("b", (-1, -1, -1), NAN),  # the last real column: beside the block's padding
    ("b", (-1, 0, 0), INF),  # the last batch only
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
def test_max_times_finite_flags_non_finite_operands(shape, dtype):
    """max_times_finite: the broadcast amax on finite operands (|b| with abs_b); None where
    some entry of a or b is NaN or ±inf, wherever it sits (first or last batch, the last
    real column next to the NaN padding, above the threading threshold)."""
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    batch, m, k, n = shape
    a = torch.rand(batch, m, k, dtype=dtype, generator=gen)
    b = torch.randn(batch, k, n, dtype=dtype, generator=gen)
    a[a < 0.2] = 0.0
    for abs_b, operand in ((True, b), (False, b.abs())):
        got = kernels.max_times_finite(a, operand, abs_b=abs_b)
        assert got is not None, "the fused kernel is unavailable on this machine"
        torch.testing.assert_close(got, _eager_max(a, b.abs()), rtol=0, atol=0)
    for which, at, value in NON_FINITE:
        operands = {"a": a.clone(), "b": b.clone()}
        operands[which][at] = value
        assert kernels.max_times_finite(operands["a"], operands["b"], abs_b=True) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", NON_FINITE, ids=str)
def test_max_product_non_finite_operands_follow_the_definition(where, dtype):
    """MaxProduct's matmul and matmul_lift with a NaN, +inf or -inf operand entry equal the
    definition max_k a·|w| as torch evaluates it: a NaN term (a NaN entry, ∞·0) gives NaN,
    ∞ times a positive entry gives ∞."""
    gen = torch.Generator().manual_seed(11)
    a = torch.rand(2, 5, 40, dtype=dtype, generator=gen)
    w = torch.randn(2, 40, 37, dtype=dtype, generator=gen)
    a[a < 0.2] = 0.0
    w[:, 3] = 0.0  # a row of w meeting an infinite a[..., 3] gives ∞·0 = NaN
    which, at, value = where
    operands = {"a": a, "b": w}
    operands[which][at] = value
    if which == "a":
        a[1, 2, 3] = INF
    expected = (a[..., :, None] * w.abs()[..., None, :, :]).amax(-2)
    S = MaxProduct()
    (lifted,) = S.matmul_lift((a,), w)
    (plain,) = S.matmul((a,), (w.abs(),))
    for got in (lifted, plain):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert bool(torch.isnan(expected).any() | torch.isinf(expected).any())


def _k_best_value(gen, k, *shape, dtype=torch.float64, signed=False):
    """A KBest value: k components best first, on a grid of quarters (ties), some zero."""
    x = (torch.randn((k, *shape), generator=gen, dtype=dtype) * 4).round() / 4
    return tuple(x if signed else x.abs().sort(0, descending=True).values)


K_BEST_CASES = [  # (k, a's shape (…, m, l), b's shape (…, l, n))
    (1, (3, 40), (40, 7)),
    (5, (2, 5, 37), (37, 4)),
    (5, (6, 33), (2, 33, 70)),  # b batched, a broadcast
    (3, (2, 1, 4, 9), (3, 9, 20)),  # batch dims broadcast on both sides
    (7, (1, 16, 76), (76, 64)),  # fewer than k paths for some entries
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", K_BEST_CASES, ids=str)
def test_k_best_kernel_equals_the_torch_formulas(case, dtype, monkeypatch):
    """KBest's matmul_lift (a weight) and matmul (two values) with the fused kernel equal
    the torch formulas (kernels off) to the bit, and the brute force over every term:
    ties on a grid of quarters, indices without a path, batch broadcasting."""
    k, a_shape, b_shape = case
    gen = torch.Generator().manual_seed(k + len(a_shape))
    a = _k_best_value(gen, k, *a_shape, dtype=dtype)
    a = tuple(c.index_fill(-1, torch.arange(0, a_shape[-1], 3), 0.0) for c in a)
    w = _k_best_value(gen, 1, *b_shape, dtype=dtype, signed=True)[0]
    b = _k_best_value(gen, k, *b_shape, dtype=dtype)
    S = sa.KBest(k)
    ran = []
    real = kernels.k_best_times
    monkeypatch.setattr(kernels, "k_best_times", lambda *x, **kw: _noted(ran, real(*x, **kw)))
    fused = [S.matmul_lift(a, w), S.matmul(a, b)]
    assert ran == [True, True], "the fused kernel did not run"
    brute = [_k_best_brute(a, (w.abs(),), k), _k_best_brute(a, b, k)]
    monkeypatch.setenv("SEMIRING_AUTOGRAD_KERNELS", "off")
    formulas = [S.matmul_lift(a, w), S.matmul(a, b)]
    for got, torch_formula, every_term in zip(fused, formulas, brute):
        torch.testing.assert_close(torch.stack(got), torch.stack(torch_formula), rtol=0, atol=0)
        torch.testing.assert_close(torch.stack(got), every_term, rtol=0, atol=0)


def _noted(ran: list, out):
    ran.append(out is not None)
    return out


def _k_best_brute(a, b, k):
    """(k, …, m, n): every term a[r][…, i, l] · b[s][…, l, j] listed, sorted, the k first
    kept (0 where fewer)."""
    a_ = torch.stack(torch.broadcast_tensors(*a), -1)  # (…, m, l, ka)
    b_ = torch.stack(torch.broadcast_tensors(*b), -1)  # (…, l, n, kb)
    terms = a_[..., :, :, None, :, None] * b_[..., None, :, :, None, :]  # (…, m, l, n, ka, kb)
    terms = terms.movedim(-4, -3).flatten(-3)  # (…, m, n, l·ka·kb)
    terms = torch.cat([terms, terms.new_zeros((*terms.shape[:-1], k))], -1)
    return terms.sort(-1, descending=True).values[..., :k].movedim(-1, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("order", ["sorted", "unsorted"])
@pytest.mark.parametrize("kb", [1, 3])
def test_k_best_times_is_the_brute_force_top_k(kb, order, dtype):
    """The operator on lists in either order (its early stops assume none) and with more
    columns than one vector, against every product listed and sorted."""
    gen = torch.Generator().manual_seed(kb)
    a = (torch.rand(4, 2, 6, 50, generator=gen, dtype=dtype) * 8).floor() / 8
    b = (torch.randn(kb, 2, 50, 37, generator=gen, dtype=dtype) * 8).round() / 8
    if order == "sorted":
        a, b = a.sort(0, descending=True).values, b.abs().sort(0, descending=True).values
    for k in (1, 4, 9):
        got = kernels.k_best_times(a, b, k, abs_b=True)
        assert got is not None, "the fused kernel is unavailable on this machine"
        want = _k_best_brute(tuple(a), tuple(b.abs()), k)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=str)
@pytest.mark.parametrize("where", ["a", "w", "b"])
def test_k_best_non_finite_operands_take_the_formulas(where, value, monkeypatch):
    """A NaN or an infinity in a value or a weight (∞ · 0 = NaN) gives the torch formulas'
    result (the kernel declines), NaN included."""
    gen = torch.Generator().manual_seed(5)
    S = sa.KBest(3)
    a = _k_best_value(gen, 3, 4, 9)
    w = _k_best_value(gen, 1, 9, 6, signed=True)[0]
    b = _k_best_value(gen, 3, 9, 6)
    target = {"a": a[0], "w": w, "b": b[1]}[where]
    target[2, 1] = value if where == "w" else abs(value)
    a[1][0, 2] = 0.0
    fused = [S.matmul_lift(a, w), S.matmul(a, b)]
    monkeypatch.setenv("SEMIRING_AUTOGRAD_KERNELS", "off")
    formulas = [S.matmul_lift(a, w), S.matmul(a, b)]
    for got, want in zip(fused, formulas):
        torch.testing.assert_close(
            torch.stack(got), torch.stack(want), rtol=0, atol=0, equal_nan=True
        )


def test_signed_infinite_ends_take_the_formulas(monkeypatch):
    """Where an infinite end of a non-empty pair (or an infinite weight) meets a 0, a
    corner product is NaN: the kernels would read it as no term, the formulas propagate it
    as torch does. SignedMaxProduct gives the formulas' value with the kernels on."""
    S = SignedMaxProduct()
    gen = torch.Generator().manual_seed(8)

    def pair(*shape):
        hi = torch.randn(*shape, dtype=torch.float64, generator=gen)
        return hi, hi - torch.rand(*shape, dtype=torch.float64, generator=gen)

    a, b, c = pair(3, 4), pair(4, 5), pair(3, 4)
    a[0][0, 1], a[1][1, 2] = INF, -INF  # (inf, x) and (x, -inf): non-empty
    b[0][1], b[1][1] = 0.0, -1.0  # (0, -1) meets hi = inf
    b[0][2], b[1][2] = 1.0, 0.0  # (1, 0) meets lo = -inf
    c[0][:, 0], c[1][:, 0] = 0.0, -1.0  # (0, -1) meets an infinite weight
    w = torch.randn(4, 5, dtype=torch.float64, generator=gen)
    w[0, 3] = INF
    w_elementwise = torch.randn(3, 4, dtype=torch.float64, generator=gen)
    w_elementwise[2, 0], w_elementwise[0, 1] = -INF, 0.0
    calls = [
        lambda: S.matmul(a, b),
        lambda: S.matmul((b[0].mT, b[1].mT), (a[0].mT, a[1].mT)),
        lambda: S.matmul_lift(c, w),
        lambda: S.mul_lift(c, w_elementwise),
        lambda: S.mul_lift(a, w_elementwise),
    ]
    fused = [call() for call in calls]
    monkeypatch.setenv("SEMIRING_AUTOGRAD_KERNELS", "eager")
    for call, got in zip(calls, fused):
        expected = call()
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)
    assert all(bool(torch.isnan(hi).any() | torch.isnan(lo).any()) for hi, lo in fused[:4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_entropy_matmul_fused_equals_eager(dtype, monkeypatch):
    """Entropy's matmuls (two messages, and a message by a lifted weight) agree with the
    kernels on and off, where sums underflow (the exact fallback runs: checked), where a row
    or a column has no term (0/0 in r), and with an empty k: within 4 ulp."""
    import semiring_autograd.semirings.log_space as log_space

    E = sa.Entropy()
    gen = torch.Generator().manual_seed(21)
    tiny = 1e-33 if dtype == torch.float32 else 1e-300
    x = torch.randn(2, 5, 7, dtype=dtype, generator=gen)
    x[0, 1] = 0.0  # a row without terms
    x[..., :4] *= tiny  # row maxima and weight-column maxima at different k: products
    b = torch.randn(2, 7, 4, dtype=dtype, generator=gen)  # underflow after the shift
    b[:, :, 2] = 0.0  # a column without terms
    w = torch.randn(7, 4, dtype=dtype, generator=gen)
    w[4:] *= tiny
    w[:, 1] = 0.0
    a, lb = E.lift(x), E.lift(b)
    cases = [(a, lb, None), (a, None, w), (E.lift(x[..., :0]), None, w[:0])]
    exact_calls = []
    run_exact = log_space._exact_terms
    monkeypatch.setattr(
        log_space, "_exact_terms", lambda *args: exact_calls.append(1) or run_exact(*args)
    )

    def run():
        return [E.matmul(p, q) if v is None else E.matmul_lift(p, v) for p, q, v in cases]

    fused = run()
    assert len(exact_calls) >= 2, "the underflow fallback did not run"
    monkeypatch.setenv("SEMIRING_AUTOGRAD_KERNELS", "eager")
    eager = run()
    eps = torch.finfo(dtype).eps
    for f, e in zip(fused, eager):
        for fc, ec in zip(f, e):
            torch.testing.assert_close(fc, ec, rtol=4 * eps, atol=4 * eps)


def test_eager_switch_gives_the_same_model_result(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 50), torch.nn.Tanh(), torch.nn.Linear(50, 7))
    x = torch.randn(4, 30, requires_grad=True)
    results = {}
    for mode in ("fused", "eager"):
        if mode == "eager":
            monkeypatch.setenv("SEMIRING_AUTOGRAD_KERNELS", "eager")
        for S in (sa.MaxProduct(), sa.SignedMaxProduct()):
            with sa.patch(model, S):
                y = model(x)
            results[mode, repr(S)] = sa.grad(y, x)
    for S in ("MaxProduct()", "SignedMaxProduct()"):
        torch.testing.assert_close(results["fused", S], results["eager", S], rtol=0, atol=0)


@pytest.mark.parametrize("semiring", [cls() for cls in BUILTIN_SEMIRINGS], ids=repr)
@pytest.mark.parametrize("extreme", [False, True], ids=["plain", "underflow"])
def test_matmul_lift_equals_matmul_of_lift(semiring, extreme):
    """The generator turns matmul(x, lift(w)) into matmul_lift(x, w); each semiring's fast
    path must equal the definition (batch broadcasting, exact zeros in w, and products
    so small that shift-and-GEMM underflows and the exact fallback runs)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=gen)
    w = torch.randn(8, 6, dtype=torch.float64, generator=gen)
    w[w.abs() < 0.4] = 0.0
    if extreme:
        x[..., :4] *= 1e-200  # row maxima and column maxima sit at different k
        w[4:, :] *= 1e-200
    x[0, 0, 0, :3] = 0.0  # no edge (empty for the signed semiring)
    a = semiring.matmul(semiring.lift(x), semiring.lift(torch.eye(8, dtype=torch.float64)))
    # intervals too (hi > lo for the signed semiring)
    a = semiring.add(a, semiring.lift(torch.randn(x.shape, dtype=torch.float64, generator=gen)))
    got = semiring.matmul_lift(a, w)
    expected = semiring.matmul(a, semiring.lift(w))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("semiring", [cls() for cls in BUILTIN_SEMIRINGS], ids=repr)
@pytest.mark.parametrize(
    "shapes", [((3, 4), (3, 4)), ((3, 1), (1, 4)), ((2, 3, 4), ()), ((4,), (3, 4))], ids=str
)
def test_mul_lift_equals_mul_of_lift(semiring, shapes):
    """The generator turns mul(x, lift(w)) into mul_lift(x, w): equal to the definition for
    points, intervals and empty entries, both signs and exact zeros in w, broadcasting."""
    gen = torch.Generator().manual_seed(3)
    a_shape, w_shape = shapes
    x = torch.randn(a_shape, dtype=torch.float64, generator=gen)
    x[x.abs() < 0.3] = 0.0
    a = semiring.lift(x)
    other = semiring.lift(torch.randn(a_shape, dtype=torch.float64, generator=gen))
    a = tuple(torch.where(x > 0.5, s, c) for s, c in zip(semiring.add(a, other), a))
    w = torch.randn(w_shape, dtype=torch.float64, generator=gen)
    w[w.abs() < 0.4] = 0.0
    got = semiring.mul_lift(a, w)
    expected = semiring.mul(a, semiring.lift(w))
    # Entropy's kernel takes log|w| from its own series (within 2 ulp of torch.log's)
    tol = 1e-15 if isinstance(semiring, sa.Entropy) and kernels.enabled() else 0.0
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol)


@pytest.mark.parametrize("semiring", [sa.Log(), sa.Counting(), sa.Entropy()], ids=repr)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_top_two_loo_equals_scan_loo(semiring, dim):
    """The top-two leave-one-out (Log, Entropy) against the generic prefix/suffix-scan ⊕,
    with empty entries, ties, a gap of 1000 nats and rows that are all empty."""
    gen = torch.Generator().manual_seed(11)
    la = torch.randn(4, 6, 5, dtype=torch.float64, generator=gen) * 20
    la[0, 1, :] = -INF
    la[1, :, 2] = -INF
    la[2, 3, :] = 3.0
    la[3, 2, 4] = 1000.0
    value = (la,) if semiring.n_components == 1 else (la, torch.rand(la.shape, generator=gen))
    value = semiring.mul(value, semiring.one(la.shape, la))  # r = 0 where la = -inf
    got = semiring.loo(value, dim)
    expected = sa.Semiring.loo(semiring, value, dim)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES[-2:], ids=str)
def test_kernels_split_over_threads(shape, monkeypatch):
    """Every kernel split over an uneven number of torch threads (3) equals its oracle: the
    matmuls' column and batch splits, the elementwise kernels' entry split and the row
    kernels' row split (each call above its threading threshold)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        _check_every_kernel(shape, monkeypatch)
    finally:
        torch.set_num_threads(threads)


def _check_every_kernel(shape, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    batch, m, k, n = shape
    a = torch.rand(batch, m, k, generator=gen)
    b = torch.rand(batch, k, n, generator=gen)
    torch.testing.assert_close(kernels.max_times(a, b), _eager_max(a, b), rtol=0, atol=0)
    ah, al = _signed_operand((batch, m, k), torch.float32, "cpu", gen, point=False)
    bh, bl = _signed_operand((batch, k, n), torch.float32, "cpu", gen, point=False)
    got = kernels.signed_times(ah, al, bh, bl)
    for g, e in zip(got, _eager_signed(ah, al, bh, bl)):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    empty = torch.isnan(ah)
    got = kernels.pair_lift_matmul(ah.masked_fill(empty, -INF), al.masked_fill(empty, INF), bh)
    for g, e in zip(got, _eager_signed(ah, al, bh, bh)):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    w = torch.randn(batch, m, k, generator=gen)
    w[w.abs() < 0.3] = 0.0
    got = kernels.signed_mul_lift(ah.nan_to_num(-INF), al.nan_to_num(INF), w)
    expected = SignedMaxProduct().mul(
        (ah.nan_to_num(-INF), al.nan_to_num(INF)), SignedMaxProduct().lift(w)
    )
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    wide = torch.randn(2, 3 * 8192 + 5, generator=gen)
    out = torch.empty(2, 2, wide.shape[-1])
    assert kernels.entropy_weights(wide[:, None], out)
    torch.testing.assert_close(out, _entropy_weights_formula(wide[:, None]))
    la, r = torch.randn(2, *wide.shape, generator=gen)
    got = kernels.entropy_mul_lift(la, r, wide)
    log_w = torch.log(wide.abs())
    torch.testing.assert_close(got, (la + log_w, r - log_w), rtol=1e-6, atol=1e-6)
    num, den = la.clone(), r.clone()
    assert kernels.ratio_where_positive(num, den)
    torch.testing.assert_close(num, torch.where(r > 0, la / r, 0.0))
    # the row kernels, 7 rows over 3 threads
    rows, weights = la[0, :4662].reshape(7, 666), r[0, :4662].reshape(7, 666).abs()
    log_z, rest = _loo_oracle(rows, weights)
    loo_l, loo_r = kernels.loo_log(rows, weights)
    torch.testing.assert_close(loo_l.double(), log_z, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loo_r.double(), rest, rtol=1e-6, atol=1e-6)
    total, mean = kernels.entropy_reduce_rows(rows, weights)
    torch.testing.assert_close(total, torch.logsumexp(rows, -1, keepdim=True))
    torch.testing.assert_close(mean, (torch.softmax(rows, -1) * weights).sum(-1, keepdim=True))
    stacked = torch.empty(7, 1332)
    shift, live = kernels.log_space_rows(rows, weights, stacked)
    assert live.all() and torch.equal(shift, rows.amax(-1, keepdim=True))
    torch.testing.assert_close(stacked[:, 666:], torch.exp(rows - shift))
    got = kernels.entropy_add(la, r, log_w, r.flip(-1))
    monkeypatch.setenv("SEMIRING_AUTOGRAD_KERNELS", "eager")  # the torch formula, in float64
    expected = sa.Entropy().add((la.double(), r.double()), (log_w.double(), r.flip(-1).double()))
    torch.testing.assert_close(got, tuple(e.float() for e in expected), rtol=1e-6, atol=1e-5)


def _entropy_weights_formula(w: torch.Tensor) -> torch.Tensor:
    """[|w|; -|w|·log|w|] per batch (…, 2k, n) by torch ops: 0 at w = 0 and NaN."""
    magnitude = w.abs()
    weighted = (-(magnitude * torch.log(magnitude))).nan_to_num(nan=0.0, posinf=INF, neginf=-INF)
    return torch.cat([magnitude, weighted], dim=-2)


def _special_weights(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Zeros of both signs, infinities, NaN, subnormals, the extremes, values around 1 and
    √2 (the series' fold), and random magnitudes over 60 orders."""
    fi = torch.finfo(dtype)
    edges = [0.0, -0.0, INF, -INF, float("nan"), fi.tiny, -fi.tiny / 7, fi.tiny * fi.eps]
    edges += [fi.max, -fi.max, 1.0, -1.0, 1 + fi.eps, 1 - fi.eps / 2, 2**0.5, -(2**-0.5)]
    spread = torch.randn(4000, generator=gen, dtype=torch.float64)
    spread = spread * 10.0 ** torch.randint(-30, 30, (4000,), generator=gen)
    values = torch.cat([torch.tensor(edges, dtype=torch.float64), spread])
    return values.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_ratio_where_positive(dtype):
    """num / den in place where den > 0, 0 where den is 0 (a sum without terms) or
    negative; a NaN numerator stays NaN where den > 0 (it hides nothing)."""
    num = torch.tensor([1.0, 0.0, float("nan"), float("nan"), 3.0, float("inf")], dtype=dtype)
    den = torch.tensor([2.0, 0.0, 1.0, 0.0, -1.0, 4.0], dtype=dtype)
    assert kernels.ratio_where_positive(num, den)
    expected = torch.tensor([0.5, 0.0, float("nan"), 0.0, 0.0, float("inf")], dtype=dtype)
    torch.testing.assert_close(num, expected, rtol=0, atol=0, equal_nan=True)
    assert not kernels.ratio_where_positive(num, den[:3])  # shapes differ: the caller's job


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_entropy_weights_kernel_equals_formula(dtype):
    """The one-pass Entropy GEMM operands against torch's log: within 2 ulp (the kernel's
    own log series), specials (0, ±inf, NaN, subnormals) exactly; batched weights stack
    [|w|; -|w|log|w|] per batch."""
    gen = torch.Generator().manual_seed(5)
    w = _special_weights(dtype, gen).reshape(2, 8, -1)
    out = torch.empty(2, 16, w.shape[-1], dtype=dtype)
    assert kernels.entropy_weights(w, out)
    expected = _entropy_weights_formula(w)
    # relative 2 ulp; the absolute floor covers results below the normal range
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    torch.testing.assert_close(out, expected, rtol=2 * eps, atol=tiny, equal_nan=True)
    special = ~torch.isfinite(expected) | (expected == 0)
    torch.testing.assert_close(out[special], expected[special], rtol=0, atol=0, equal_nan=True)
    strided = w.transpose(-1, -2)  # any strides: read through a contiguous copy
    out_t = torch.empty(2, 2 * strided.shape[-2], 8, dtype=dtype)
    assert kernels.entropy_weights(strided, out_t)
    expected_t = _entropy_weights_formula(strided)
    torch.testing.assert_close(out_t, expected_t, rtol=2 * eps, atol=tiny, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(
    "shapes", [((4, 1000), (4, 1000)), ((3, 1, 5), (4, 1)), ((4, 100), (100,))], ids=str
)
def test_entropy_mul_lift_kernel_equals_formula(dtype, shapes, monkeypatch):
    """Entropy's one-pass mul_lift against its torch formula (kernels off): log|w| within
    2 ulp, r = 0 where the new log Z is not finite, special weights, broadcasting."""
    gen = torch.Generator().manual_seed(9)
    a_shape, w_shape = shapes
    w = _special_weights(dtype, gen)[: torch.Size(w_shape).numel()].reshape(w_shape)
    la = torch.randn(a_shape, generator=gen, dtype=dtype) * 5
    la[..., :1] = -INF  # no path: r is 0 there by convention
    r = torch.rand(a_shape, generator=gen, dtype=dtype).masked_fill(la == -INF, 0.0)
    got = kernels.entropy_mul_lift(la, r, w)
    monkeypatch.setenv("SEMIRING_AUTOGRAD_KERNELS", "eager")
    expected = sa.Entropy().mul_lift((la, r), w)
    eps = torch.finfo(dtype).eps
    for g, e in zip(got, expected):
        # log|w| within 2 ulp; la and r add a term of up to ~|log| 700, hence the floor
        torch.testing.assert_close(g, e, rtol=2 * eps, atol=1e3 * eps, equal_nan=True)
        assert torch.equal(torch.isfinite(g), torch.isfinite(e))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shapes", [((5000,), (5000,)), ((3, 1, 40), (7, 1))], ids=str)
def test_entropy_add_kernel_equals_formula(dtype, shapes):
    """Entropy's one-pass ⊕ against float64 oracles: log Z = logaddexp within 2 ulp of the
    operands' scale; r = σ(la - lb)·ra + σ(lb - la)·rb (the Z-weighted mean; accurate, where
    the torch formula's weights exp(a - log Z) inherit log Z's rounding: ~30 ulp in float32)
    within 2 ulp for float32 and 8 for float64. Both empty gives (-inf, 0), one empty the
    other operand; ties; a NaN gives a NaN log Z; broadcasting."""
    gen = torch.Generator().manual_seed(17)
    a_shape, b_shape = shapes
    la = torch.randn(a_shape, generator=gen, dtype=dtype) * 30
    lb = torch.randn(b_shape, generator=gen, dtype=dtype) * 30
    la.view(-1)[:40] = -INF
    lb.view(-1)[:3] = -INF
    if la.shape == lb.shape:
        lb[-2:] = la[-2:]
    ra = torch.rand(a_shape, generator=gen, dtype=dtype).masked_fill(la == -INF, 0.0)
    rb = torch.rand(b_shape, generator=gen, dtype=dtype).masked_fill(lb == -INF, 0.0)
    got = [g.double() for g in kernels.entropy_add(la, ra, lb, rb)]
    la, ra, lb, rb = (t.double() for t in (la, ra, lb, rb))
    log_z = torch.logaddexp(la, lb)
    r = torch.sigmoid(la - lb) * ra + torch.sigmoid(lb - la) * rb
    r = r.nan_to_num(nan=0.0)  # both empty: σ(NaN); r is 0 there
    eps = torch.finfo(dtype).eps
    scale = torch.maximum(la.abs(), lb.abs()).nan_to_num(posinf=0.0)
    finite = torch.isfinite(log_z)
    assert torch.equal(got[0][~finite], log_z[~finite])
    assert ((got[0] - log_z).abs()[finite] <= 2 * eps * scale[finite]).all()
    tol = (2 if dtype == torch.float32 else 8) * eps
    torch.testing.assert_close(got[1], r, rtol=tol, atol=tol)
    nan = torch.tensor([float("nan"), 1.0], dtype=dtype)
    assert torch.isnan(kernels.entropy_add(nan, nan.clone(), nan.flip(0), nan.clone())[0]).all()


@pytest.mark.parametrize(
    "semiring",
    [MaxProduct(), SignedMaxProduct(), sa.Log(), sa.Counting(), sa.Entropy(), sa.Boolean()],
    ids=repr,
)
def test_matmul_lift_rows_without_terms(semiring):
    """Rows of a without any term (every token but one, as in a model's last layer) are
    skipped by matmul_lift: with finite weights the result still equals the definition,
    with the semiring zero in those rows; all-empty inputs give all-zero outputs; a
    float32 message times a float64 weight keeps the promoted dtype."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2, 6, 8, dtype=torch.float64, generator=gen)
    w = torch.randn(8, 5, dtype=torch.float64, generator=gen)
    a = semiring.mul(semiring.lift(x), semiring.one(x.shape, x))
    dead = torch.tensor([True, False, True, True, False, True]).expand(2, 6).clone()
    dead[1, 1] = True  # one batch with a single live row
    zero = semiring.zero(x.shape, x)
    a = tuple(torch.where(dead[..., None], z, c) for z, c in zip(zero, a))
    got = semiring.matmul_lift(a, w)
    expected = semiring.matmul(a, semiring.lift(w))
    for g, e, z in zip(got, expected, semiring.zero((2, 6, 5), x)):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-300)
        assert torch.equal(g[dead], z[dead])
    nothing = semiring.matmul_lift(semiring.zero(x.shape, x), w)
    for g, z in zip(nothing, semiring.zero((2, 6, 5), x)):
        assert torch.equal(g, z)
    if not isinstance(semiring, (sa.Log, sa.Entropy, sa.Boolean)):  # (one dtype; bool)
        single = tuple(c.float() for c in a)
        mixed = semiring.matmul_lift(single, w)
        for g, e in zip(mixed, semiring.matmul(single, semiring.lift(w))):
            assert g.dtype == e.dtype == torch.float64
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize(
    "semiring",
    [MaxProduct(), SignedMaxProduct(), sa.Log(), sa.Counting(), sa.Entropy(), sa.Boolean()],
    ids=repr,
)
def test_low_precision_weight_converts_the_rows_it_reaches(semiring):
    """The matmul_lift primitive converts a bfloat16 weight to message precision after
    dropping the k columns no live row reaches (a read-out of one logit: one row of an
    lm_head), and gives what the semiring's matmul_lift gives on the whole float32 weight,
    bit for bit; with every row live the whole weight is converted."""
    from semiring_autograd.ops import primitives as P

    gen = torch.Generator().manual_seed(14)
    w = torch.randn(9, 5, generator=gen).to(torch.bfloat16)
    x = torch.randn(2, 4, 9, generator=gen)
    a = semiring.mul(semiring.lift(x), semiring.one(x.shape, x))
    zero = semiring.zero(x.shape, x)
    reached = torch.zeros(2, 4, 9, dtype=torch.bool)
    reached[1, 3, [2, 6]] = True  # one live row, two of its columns
    sparse = tuple(torch.where(reached, c, z) for c, z in zip(a, zero))
    ref = (torch.bfloat16, x.device)
    for value, rows in ((sparse, 2), (a, 9)):
        parts, weight = P.weight_operands(semiring, value, w, ref)
        assert weight.dtype == torch.float32 and weight.shape == (rows, 5)
        got = P.matmul_lift(semiring, value, w, ref)
        expected = semiring.matmul_lift(value, w.float())
        for g, e in zip(got, expected):
            assert torch.equal(g, e)


def test_nan_in_entropy_r_is_never_zeroed():
    """A NaN in the r component survives ⊗, ⊗ by a lift, ⊕, matmuls and the leave-one-out
    wherever its log Z is finite (the 0-where-no-path rules hide nothing), kernels on."""
    E = sa.Entropy()
    la = torch.tensor([[0.5, 1.0, -0.3]], dtype=torch.float64)
    ra = torch.tensor([[float("nan"), 0.2, 0.1]], dtype=torch.float64)
    b = E.lift(torch.tensor([[0.7, -1.2], [2.0, 0.4], [0.3, 0.9]], dtype=torch.float64))
    w = torch.tensor([0.7, -1.2, 2.0], dtype=torch.float64)
    results = {
        "mul": E.mul((la, ra), E.lift(w)),
        "mul_lift": E.mul_lift((la, ra), w),
        "add": E.add((la, ra), (la.flip(-1), ra.flip(-1))),
        "matmul": E.matmul((la, ra), b),
        "matmul_lift": E.matmul_lift((la, ra), b[0].exp()),
        "loo": E.loo((la, ra), -1),
    }
    for name, (log_z, r) in results.items():
        assert torch.isnan(E.readout((log_z, r))).any(), name


@pytest.mark.parametrize("semiring", [sa.Log(), sa.Entropy()], ids=repr)
def test_nan_weight_shows_in_log_space_matmul(semiring):
    """A NaN weight makes the log Z of every output it feeds NaN (and so the readout): the
    arithmetic masks that zero r where log Z is not finite hide no NaN."""
    x = torch.randn(3, 4, dtype=torch.float64)
    w = torch.randn(4, 2, dtype=torch.float64)
    w[1, 0] = float("nan")
    out = semiring.matmul_lift(semiring.lift(x), w)
    readout = semiring.readout(out)
    assert torch.isnan(readout[:, 0]).all() and torch.isfinite(readout[:, 1]).all()


def test_openmp_build_shares_torch_runtime():
    """Built with OpenMP, the library must not load a second OpenMP runtime next to torch's
    (two teams would compete for the cores). Checked in a fresh process that imports torch
    and loads the kernels alone: other packages a test process imports (sentencepiece, say)
    may bring their own runtime."""
    if not kernels.build.uses_openmp():
        pytest.skip("the kernels were built without OpenMP on this machine")
    script = (
        "import json, torch\n"
        "from semiring_autograd.kernels import build\n"
        "assert build.uses_openmp()\n"
        "with open('/proc/self/maps') as f:\n"
        "    print(json.dumps(sorted({l.split()[-1] for l in f if 'gomp' in l or 'iomp' in l})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    runtimes = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(runtimes) == 1, runtimes


def _loo_oracle(la: torch.Tensor, r: torch.Tensor):
    """Leave-one-out ⊕ along the last dim by enumeration in float64: each entry's others as
    a row of an (…, n, n) matrix with the entry itself set to -inf."""
    la, r = la.double(), r.double()
    n = la.shape[-1]
    others = la[..., None, :].expand(*la.shape, n).clone()
    others.diagonal(dim1=-2, dim2=-1).fill_(-INF)
    log_z = torch.logsumexp(others, -1)
    weights = torch.softmax(others, -1).nan_to_num(nan=0.0)  # a row of -inf: no weight
    return log_z, (weights * r[..., None, :]).sum(-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 12, 7, 128), (6, 5), (4, 2)], ids=str)
def test_loo_log_kernel_equals_enumeration(dtype, shape):
    """The one-pass leave-one-out ⊕ (Log: log Z only; Entropy: log Z and r) against
    enumeration in float64, with -inf entries, a row of -inf, a row with one finite entry,
    tied maxima, gaps of 59.5 and 60.5 nats between the two largest (the others 100 below)
    and a gap of 1000 nats; within a few ulp of each row's scale. Rows holding
    NaN or +inf are left to the torch formula (None)."""
    gen = torch.Generator().manual_seed(23)
    la = torch.randn(shape, generator=gen, dtype=dtype) * 20
    flat = la.view(-1, shape[-1])
    flat[0, :] = -INF
    flat[1, 1:] = -INF
    flat[2, :] = 3.0  # all tied
    flat[-1, 0] = 1000.0
    flat.view(-1)[5::7] = -INF
    if flat.shape[0] > 5:  # the argmax's others summed in its frame (a gap of 59.5), or not
        for row, gap in ((3, 59.5), (4, 60.5)):
            flat[row, :] = -100.0 - torch.rand(shape[-1], generator=gen, dtype=dtype)
            flat[row, 0], flat[row, 1] = 0.0, -gap
    r = torch.rand(shape, generator=gen, dtype=dtype).masked_fill(la == -INF, 0.0)
    log_z, rest = _loo_oracle(la, r)
    eps = torch.finfo(dtype).eps
    scale = 1 + la.double().nan_to_num(neginf=0.0).abs().amax(-1, keepdim=True)
    for with_r in (False, True):
        got = kernels.loo_log(la, r if with_r else None)
        if got is None:
            pytest.skip("the CPU kernels are unavailable")
        assert torch.equal(torch.isinf(got[0]), torch.isinf(log_z))
        finite = torch.isfinite(log_z)
        err = (got[0].double() - log_z).abs().where(finite, 0.0)
        assert (err <= 4 * eps * scale).all(), err.max()
        if with_r:
            torch.testing.assert_close(got[1].double(), rest, rtol=16 * eps, atol=16 * eps)
        else:
            assert got[1] is None
    for special in (NAN, INF):
        bad = la.clone()
        bad.view(-1)[3] = special
        assert kernels.loo_log(bad, r) is None and kernels.loo_log(bad, None) is None


@pytest.mark.parametrize("semiring", [sa.Log(), sa.Entropy()], ids=repr)
def test_loo_with_and_without_kernel_agree(semiring, monkeypatch):
    """A semiring's loo along the last dim through the kernel and through its torch formula
    (the kernel off): float32 within 4 ulp of the scale; with a NaN or +inf entry the
    kernel declines the call, and the result is the formula's."""
    gen = torch.Generator().manual_seed(29)
    la = torch.randn(2, 12, 33, generator=gen) * 10
    la[0, 0, :4] = -INF
    value = (la,) if semiring.n_components == 1 else (la, torch.rand(la.shape, generator=gen))
    value = semiring.mul(value, semiring.one(la.shape, la))
    special = tuple(c.clone() for c in value)
    special[0][1, 2, 3], special[0][1, 4, 5] = NAN, INF
    assert kernels.loo_log(*special, *((None,) if len(special) == 1 else ())) is None
    fused = [semiring.loo(v, -1) for v in (value, special)]
    monkeypatch.setattr(kernels, "loo_log", lambda *args: None)
    formula = [semiring.loo(v, -1) for v in (value, special)]
    for g, e in zip(fused[0], formula[0]):
        torch.testing.assert_close(g, e, rtol=4e-7, atol=4e-6)
    for g, e in zip(fused[1], formula[1]):
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_r", [False, True], ids=["log", "entropy"])
def test_log_space_rows_kernel_equals_formula(dtype, with_r):
    """The fused message operand of the log-space GEMM against torch's passes: each row's
    shift (its finite maximum, else 0) and liveness exactly; e^(a - shift) within 3 ulp of
    torch.exp, subnormal results within one subnormal step (a tiny e times a large |w| can
    dominate a GEMM sum), and e·r; rows of -inf, rows holding NaN or +inf (their e follows
    IEEE arithmetic: NaN and inf stay)."""
    gen = torch.Generator().manual_seed(31)
    a = torch.randn(3, 70, 300, generator=gen, dtype=dtype) * 30
    a[0, 0, :] = -INF
    a[0, 1, ::3] = -INF
    a[1, 2, 7] = NAN
    a[1, 3, 9] = INF
    a[2, 4, :] = 5.0
    # down through the subnormal range of e, to below its smallest value
    a[2, 5, :] = -torch.linspace(0, 760 if dtype == torch.float64 else 110, 300)
    r = torch.rand(a.shape, generator=gen, dtype=dtype) if with_r else None
    out = torch.full((*a.shape[:-1], 600 if with_r else 300), 7.0, dtype=dtype)
    got = kernels.log_space_rows(a, r, out)
    if got is None:
        pytest.skip("the CPU kernels are unavailable")
    shift, live = got
    row_max = a.amax(-1, keepdim=True)
    assert torch.equal(live, torch.isfinite(row_max))
    assert torch.equal(shift, row_max.masked_fill(~torch.isfinite(row_max), 0.0))
    expected = torch.exp(a - shift)
    smallest = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # the smallest subnormal
    assert ((expected > 0) & (expected < torch.finfo(dtype).tiny)).any()  # subnormals met
    e = out[..., -300:]
    torch.testing.assert_close(
        e, expected, rtol=3 * torch.finfo(dtype).eps, atol=smallest, equal_nan=True
    )
    if with_r:
        torch.testing.assert_close(out[..., :300], e * r, rtol=0.0, atol=0.0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 128, 768), (5, 3), (4, 1)], ids=str)
def test_entropy_reduce_rows_kernel_equals_oracle(dtype, shape):
    """Entropy's one-pass ⊕ along the last dim against float64 torch: log Z within 4 ulp of
    the row's scale, r (the weighted mean) within 8 ulp; rows of -inf give (-inf, 0), -inf
    entries have no weight, a gap of 1000 nats; rows holding NaN or +inf are left to the
    torch formula (None), and the semiring's sum through the kernel and without it agree."""
    gen = torch.Generator().manual_seed(37)
    la = torch.randn(shape, generator=gen, dtype=dtype) * 20
    flat = la.view(-1, shape[-1])
    flat[0, :] = -INF
    flat[-1, 0] = 1000.0
    flat.view(-1)[1::5] = -INF
    r = torch.rand(shape, generator=gen, dtype=dtype).masked_fill(la == -INF, 0.0)
    got = kernels.entropy_reduce_rows(la, r)
    if got is None:
        pytest.skip("the CPU kernels are unavailable")
    l64, r64 = la.double(), r.double()
    log_z = torch.logsumexp(l64, -1, keepdim=True)
    mean = (torch.softmax(l64, -1).nan_to_num(nan=0.0) * r64).sum(-1, keepdim=True)
    eps = torch.finfo(dtype).eps
    scale = 1 + l64.nan_to_num(neginf=0.0).abs().amax(-1, keepdim=True)
    assert torch.equal(torch.isinf(got[0]), torch.isinf(log_z))
    err = (got[0].double() - log_z).abs().where(torch.isfinite(log_z), 0.0)
    assert (err <= 4 * eps * scale).all(), err.max()
    torch.testing.assert_close(got[1].double(), mean, rtol=8 * eps, atol=8 * eps)
    E = sa.Entropy()
    fused = E.sum((la, r), -1)
    for special in (NAN, INF):
        bad = la.clone()
        bad.view(-1)[-1] = special
        assert kernels.entropy_reduce_rows(bad, r) is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "entropy_reduce_rows", lambda *args: None)
        formula = E.sum((la, r), -1)
    for g, e in zip(fused, formula):
        torch.testing.assert_close(g, e, rtol=64 * eps, atol=64 * eps * scale.max().item())


def test_entropy_log_within_two_ulp_over_dense_floats():
    """log|w| as the Entropy kernels take it (entropy_mul_lift with la = r = 0), float32,
    against float64 torch.log: within 2 ulp of the result over every 8th float of the
    binades [2^-3, 2^3) (the fold of the mantissa at 0.75/1.5 or √2 and the sign of log
    change there), the subnormals in steps, and every 8th float of 2^100 and 2^-100."""
    binades = torch.arange(124 << 23, 130 << 23, 8, dtype=torch.int64)
    subnormal = torch.arange(1, 1 << 23, 997, dtype=torch.int64)
    far = torch.cat([torch.arange(e << 23, (e + 1) << 23, 8) for e in (27, 227)])
    bits = torch.cat([binades, subnormal, far]).to(torch.int32)
    w = bits.view(torch.float32)
    zero = torch.zeros_like(w)
    got = kernels.entropy_mul_lift(zero, zero, w)
    if got is None:
        pytest.skip("the CPU kernels are unavailable")
    expected = torch.log(w.double())
    ulp = torch.ldexp(torch.ones_like(expected), torch.frexp(expected).exponent - 24)
    err = (got[0].double() - expected).abs() / ulp  # float32's ulp at the true result
    assert err.max() <= 2.0, (err.max(), w[err.argmax()])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_entropy_add_small_terms_relative(dtype):
    """Entropy's ⊕ of (0, 0) and (-x, 1) for x up to 80 nats: log Z = log(1 + e^-x) and r =
    e^-x / (1 + e^-x), each within a few ulp of itself (not of the operands' scale): the
    rounding of 1 + t is corrected, and a small term keeps its weight in r."""
    x = torch.linspace(0.01, 80.0, 4001, dtype=torch.float64)
    zero = torch.zeros_like(x, dtype=dtype)
    got = kernels.entropy_add(zero, zero, (-x).to(dtype), torch.ones_like(zero))
    if got is None:
        pytest.skip("the CPU kernels are unavailable")
    log_z = torch.log1p(torch.exp(-x.to(dtype).double()))
    r = torch.sigmoid(-x.to(dtype).double())
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got[0].double(), log_z, rtol=4 * eps, atol=0.0)
    torch.testing.assert_close(got[1].double(), r, rtol=4 * eps, atol=0.0)


@pytest.mark.parametrize(
    "semiring", [MaxProduct(), SignedMaxProduct(), sa.Log(), sa.Entropy(), sa.Boolean()], ids=repr
)
def test_matmul_lift_columns_without_terms(semiring, monkeypatch):
    """A read-out of one logit: one live row holding terms in two of its k columns (the
    product pruned to its live rows and columns whatever its size). The
    columns without a term are dropped with their rows of w: the result equals the
    definition (finite weights). Inf or NaN weights in the dropped rows of w change nothing
    where the zero annihilates them (SignedMaxProduct, Boolean); where zero ⊗ lift(∞) is NaN
    (MaxProduct, Log, Entropy: IEEE 0·∞, as in torch) nothing is dropped and the result is
    the definition's, NaN included, whatever the other rows hold. In log space a NaN weight
    in a kept row still shows (the max kernels take a NaN weight for no edge)."""
    monkeypatch.setattr(tensor_ops, "PRUNE_PRODUCTS", 0)
    gen = torch.Generator().manual_seed(41)
    x = torch.randn(1, 5, 9, dtype=torch.float64, generator=gen)
    w = torch.randn(9, 4, dtype=torch.float64, generator=gen)
    a = semiring.mul(semiring.lift(x), semiring.one(x.shape, x))
    term = torch.zeros(1, 5, 9, dtype=torch.bool)
    term[0, 3, 2] = term[0, 3, 7] = True
    zero = semiring.zero(x.shape, x)
    a = tuple(torch.where(term, c, z) for c, z in zip(a, zero))
    got = semiring.matmul_lift(a, w)
    expected = semiring.matmul(a, semiring.lift(w))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-300)
    unreached = w.clone()
    unreached[0, :2], unreached[5, 1:] = INF, NAN
    if semiring.terms.nan_at_zero_times_inf:
        got = semiring.matmul(a, semiring.lift(unreached))
        assert torch.isnan(semiring.readout(got)).all()
    for g, e in zip(semiring.matmul_lift(a, unreached), got):
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)
    if isinstance(semiring, (sa.Log, sa.Entropy)):
        reached = w.clone()
        reached[7, 2] = NAN
        readout = semiring.readout(semiring.matmul_lift(a, reached))
        assert torch.isnan(readout[0, 3, 2]) and not torch.isnan(readout[0, 3, :2]).any()


PORTABLE = [
    "test_pruned_max_times_is_exact",
    "test_max_times_of_few_rows_equals_the_definition",
    "test_pruned_pair_lift_matmul_is_exact",
    "test_entropy_weights_kernel_equals_formula",
    "test_entropy_add_kernel_equals_formula",
    "test_entropy_add_small_terms_relative",
    "test_loo_log_kernel_equals_enumeration",
    "test_log_space_rows_kernel_equals_formula",
    "test_entropy_reduce_rows_kernel_equals_oracle",
    "test_entropy_mul_lift_kernel_equals_formula",
    "test_k_best_kernel_equals_the_torch_formulas",
    # tests/test_log_entries.py
    "test_plus_log_abs_equals_the_formula",
    "test_log_add_equals_torch_logaddexp",
    "test_log_add_of_strided_operands",
    "test_entropy_add_into_an_accumulator",
    # tests/test_softmax_backward.py
    "test_log_override_equals_the_jacobian_paths",
    # tests/test_attention_layouts.py
    "test_softmax_rows_kernel_equals_softmax",
    # tests/test_entropy_softmax.py
    "test_rows_in_the_largest_terms_frame_and_the_rows_it_declines",
    "test_the_kernel_reads_lift_of_signed_probabilities",
    # tests/test_operators.py
    "test_log_gemm_finish_equals_its_formula",
    # tests/test_k_best_kernel.py
    "test_k_best_times_over_long_rows_to_the_bit",
    "test_k_best_times_reads_lists_of_any_strides_to_the_bit",
    # tests/test_k_best_merge.py
    "test_merge_is_topk_of_both_lists",
    "test_merge_declines_nan_and_unsorted_lists",
]


#: the other files whose tests PORTABLE names
PORTABLE_FILES = [
    str(Path(__file__).with_name(name))
    for name in (
        "test_log_entries.py",
        "test_softmax_backward.py",
        "test_operators.py",
        "test_attention_layouts.py",
        "test_entropy_softmax.py",
        "test_k_best_kernel.py",
        "test_k_best_merge.py",
    )
]


def test_portable_paths_without_avx512(tmp_path):
    """The float kernels with their AVX-512 paths compiled out (``-mno-avx512f``), against
    the same oracles as above (this machine may have AVX-512; another may not). Run in a
    child pytest: a process holds one build of the operators."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the AVX-512 paths exist on x86-64 only")
    env = {
        **os.environ,
        "SEMIRING_AUTOGRAD_CACHE": str(tmp_path),
        "SEMIRING_AUTOGRAD_CXXFLAGS": "-mno-avx512f",
    }
    # the float32 cases (the AVX-512 paths are float's), and the log series test
    select = " or ".join(f"({name} and float32)" for name in PORTABLE)
    select += " or test_entropy_log_within_two_ulp_over_dense_floats"
    child = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, *PORTABLE_FILES, "-q"]
        + ["-p", "no:cacheprovider", "-k", select],
        env=env,
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    passed = re.search(r"(\d+) passed", child.stdout)
    assert passed and int(passed.group(1)) >= len(PORTABLE), child.stdout[-2000:]
    # the child's build took the flag
    commands = [p.read_text() for p in tmp_path.glob("*/build.ninja")]
    assert commands and all("-mno-avx512f" in c for c in commands)
