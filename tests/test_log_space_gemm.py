"""The log-space GEMM by a weight (semirings/log_space.py, gemm_by_weight): Entropy's and
Log's matmul by a lifted 2-D weight against their definitions in float64, on contiguous,
transposed and batched messages, with rows without a term and rows whose shifted sums
underflow (the exact fallback), and the path taken where the kernels are built."""

from __future__ import annotations

import pytest
import torch

import semiring_autograd as sa
from semiring_autograd import kernels
from semiring_autograd.semirings import log_space


def _entropy_formula(la: torch.Tensor, ra: torch.Tensor, w: torch.Tensor):
    """(log Σ_k e^{la_k}|w_kj|, Σ_k p_kj (ra_k - log|w_kj|)) with p ∝ e^{la_k}|w_kj|, r = 0
    where no term, by brute force over k in float64."""
    la, ra, w = la.double(), ra.double(), w.double()
    log_w = torch.log(w.abs())  # (k, n), -inf at 0
    terms = la[..., :, None] + log_w  # (…, m, k, n)
    total = torch.logsumexp(terms, dim=-2)
    p = torch.exp(terms - total[..., None, :]).nan_to_num(nan=0.0)
    r_terms = (ra[..., :, None] - log_w).masked_fill(torch.isneginf(terms), 0.0)
    return total, (p * r_terms).sum(-2)


def _messages(shape: tuple[int, ...], k: int, transposed: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    la = torch.randn(*shape, k, generator=gen) * 3
    ra = torch.randn(*shape, k, generator=gen)
    la.view(-1, k)[1] = float("-inf")  # a row without a term
    la.view(-1, k)[2, : k // 2] -= 200.0  # a row whose shifted products underflow
    if transposed:  # a message laid out column-major, as from a transposed view
        la, ra = (t.mT.contiguous().mT for t in (la, ra))
    return la, ra


def _weight(k: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(k, n, generator=gen)
    w[0, 1] = 0.0  # no edge
    w[k // 2 :, 0] *= 1e-36  # with the underflowing row: sums below the trusted range
    return w


CASES = [((6,), 9, 5, False), ((6,), 9, 5, True), ((2, 4), 7, 3, False), ((5,), 33, 17, True)]


@pytest.mark.parametrize("shape,k,n,transposed", CASES)
def test_entropy_matmul_by_weight_equals_definition(shape, k, n, transposed):
    la, ra = _messages(shape, k, transposed, seed=k)
    w = _weight(k, n, seed=n)
    got_l, got_r = sa.Entropy().matmul_lift((la, ra), w)
    want_l, want_r = _entropy_formula(la, ra, w)
    assert got_l.shape == got_r.shape == (*shape, n)
    torch.testing.assert_close(got_l.double(), want_l, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_r.double(), want_r, rtol=1e-5, atol=1e-4)
    assert torch.isneginf(got_l.reshape(-1, n)[1]).all()  # the row without a term
    assert (got_r.reshape(-1, n)[1] == 0).all()


@pytest.mark.parametrize("shape,k,n,transposed", CASES)
def test_log_matmul_by_weight_equals_definition(shape, k, n, transposed):
    la, _ = _messages(shape, k, transposed, seed=k)
    w = _weight(k, n, seed=n)
    (got,) = sa.Log().matmul_lift((la,), w)
    want = torch.logsumexp(la.double()[..., :, None] + torch.log(w.double().abs()), dim=-2)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not kernels.available(), reason="the CPU kernels did not build")
def test_entropy_lifted_matmul_takes_the_weight_path(monkeypatch):
    """With every row live, Entropy's matmul by a 2-D weight runs gemm_by_weight (its
    exact fallback included: the underflowing row), and its values are the general
    path's (two GEMMs of the message) to float32 rounding."""
    calls, exact = [], []
    run, run_exact = log_space.gemm_by_weight, log_space._exact_terms
    # called from matmul_by_weight or from LogSpaceGemm.run, both in log_space
    monkeypatch.setattr(log_space, "gemm_by_weight", lambda *a: calls.append(1) or run(*a))
    monkeypatch.setattr(log_space, "_exact_terms", lambda *a: exact.append(1) or run_exact(*a))
    la, ra = _messages((2, 6), 24, transposed=False, seed=3)
    la.view(-1, 24)[1] = 0.5  # every row live
    w = _weight(24, 10, seed=4)
    got = sa.Entropy().matmul_lift((la, ra), w)
    assert calls and exact, "the weight path or its exact fallback did not run"
    monkeypatch.setattr(log_space, "shifted_rows", lambda *a: None)
    monkeypatch.setattr(log_space, "_by_weight", lambda *a: None)
    general = sa.Entropy().matmul_lift((la, ra), w)
    for g, e in zip(got, general):
        torch.testing.assert_close(g, e, rtol=4e-6, atol=4e-6)


def _held_transposed(count: int, m: int, k: int, seed: int, dtype: torch.dtype):
    """A message (count, m, k) held transposed, its batches strided apart, with a row of
    -inf, a row holding NaN, one holding +inf, one a gap of 200 nats."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(count, m, k, generator=gen, dtype=torch.float64) * 3
    rows[0, 1] = float("-inf")
    rows[0, 2, 3] = float("nan")
    rows[1, 0, 1] = float("inf")
    rows[1, 3, : k // 2] -= 200.0
    held = torch.zeros(count, k, m + 5, dtype=dtype)
    held[..., :m] = rows.mT
    return held[..., :m].mT  # (count, m, k), unit stride along m


@pytest.mark.skipif(not kernels.available(), reason="the CPU kernels did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_log_space_columns_equals_log_space_rows(dtype):
    """The shifted message read from a transposed message where it lies equals the row
    kernel's on the same message made contiguous, bit for bit: shift, liveness, e and e·r."""
    from semiring_autograd.kernels import log_entries

    a = _held_transposed(3, 6, 11, seed=1, dtype=dtype)
    r = _held_transposed(3, 6, 11, seed=2, dtype=dtype).nan_to_num(nan=0.5, posinf=2.0)
    count, m, k = a.shape
    for rr in (None, r):
        width = k if rr is None else 2 * k
        held = torch.full((count, width, m), 7.0, dtype=dtype)
        got = log_entries.log_space_columns(a.mT, None if rr is None else rr.mT, held)
        rows = torch.full((count, m, width), 7.0, dtype=dtype)
        rr_rows = None if rr is None else rr.contiguous()
        want = kernels.log_space_rows(a.contiguous(), rr_rows, rows)
        assert got is not None and want is not None
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        torch.testing.assert_close(held.mT, rows, rtol=0, atol=0, equal_nan=True)


def _lifted_batched_formula(la, ra, w):
    """Per batch: Log's log Σ_k e^{la_k}|w_kj| and Entropy's pair, in float64."""
    pairs = [_entropy_formula(la[b], ra[b], w[b]) for b in range(la.shape[0])]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


@pytest.mark.skipif(not kernels.available(), reason="the CPU kernels did not build")
@pytest.mark.parametrize("semiring", ["Log", "Entropy", "Counting"])
def test_transposed_message_by_a_lifted_operand(semiring, monkeypatch):
    """A transposed message (attention's) times a lifted batched operand is read where it
    lies (log_space_columns ran) and equals the product of the contiguous message bit for
    bit, and the definition in float64 (Log, Entropy)."""
    from semiring_autograd.kernels import log_entries

    S = getattr(sa, semiring)()
    gen = torch.Generator().manual_seed(7)
    la = torch.randn(3, 9, 6, generator=gen).mT * 3  # (3, 6, 9), unit stride along m
    la[0, 1] = float("-inf")
    ra = torch.randn(3, 9, 6, generator=gen).mT
    w = torch.randn(3, 9, 5, generator=gen)
    w[1, 2, 3] = 0.0
    a = (la, ra) if semiring == "Entropy" else (la,)
    calls = []
    run = log_entries.log_space_columns
    monkeypatch.setattr(log_entries, "log_space_columns", lambda *x: calls.append(1) or run(*x))
    got = S.matmul_lift(a, w)
    assert calls, "the transposed message was not read where it lies"
    contiguous = S.matmul_lift(tuple(t.contiguous() for t in a), w)
    for g, c in zip(got, contiguous):
        torch.testing.assert_close(g, c, rtol=0, atol=0)
    if semiring == "Counting":
        return
    want_l, want_r = _lifted_batched_formula(la, ra, w)
    torch.testing.assert_close(got[0].double(), want_l, rtol=1e-5, atol=1e-5)
    if semiring == "Entropy":
        torch.testing.assert_close(got[1].double(), want_r, rtol=1e-5, atol=1e-4)
