"""MaxProduct's, Boolean's and SignedMaxProduct's ``softmax_backward`` (the attention
rule's message at the scores) on the fused CPU kernels (``softmax_backward_max``,
``softmax_backward_or``, ``softmax_backward_signed``): bit for bit the generic formula
(``Semiring.softmax_backward`` on the semiring's ⊕, ⊗ and lift) and the kernels-off path,
and against the Jacobian's path enumeration in float64 (the strongest path; whether a path
exists; the largest and smallest signed path), with p = 0, p = 1, ties, zero messages,
empty pairs, +inf and NaN; and the attention backward with and without the kernels."""

from __future__ import annotations

import pytest
import torch

import semiring_autograd as sa
from semiring_autograd import kernels
from semiring_autograd.kernels import extreme_entries
from semiring_autograd.kernels.build import ENV
from semiring_autograd.ops import attention_helpers
from semiring_autograd.semirings.base import Semiring

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.float64]
LENGTHS = [1, 2, 9, 16, 37, 128]


@pytest.fixture(autouse=True)
def _built():
    if not kernels.available():
        pytest.skip("the CPU kernels are switched off or could not be built here")


def _probs(dtype: torch.dtype, n: int, rows: int = 6) -> torch.Tensor:
    """(2, rows, n) softmax rows: excluded keys (p = 0), a single key (p = 1), a row within
    an ulp of 1, a row spread over 60 nats."""
    gen = torch.Generator().manual_seed(n)
    scores = torch.randn(2, rows, n, generator=gen, dtype=torch.float64) * 4
    excluded = (torch.arange(scores.numel()) % 4 == 1).reshape(scores.shape)
    excluded[..., 0] = False
    scores = scores.masked_fill(excluded, -INF)
    scores[0, 0, 1:] = -INF
    scores[0, 1, 0] = 60.0
    scores[1, 1] = torch.linspace(-60, 0, n, dtype=torch.float64)
    return torch.softmax(scores, -1).to(dtype)


def _max_messages(dtype: torch.dtype, n: int, rows: int = 6) -> torch.Tensor:
    """MaxProduct messages (≥ 0) of (2, rows, n): exact zeros, a row of ties, a row of 0."""
    gen = torch.Generator().manual_seed(100 + n)
    g = torch.rand(2, rows, n, generator=gen, dtype=torch.float64) * 50
    g.view(-1)[::5] = 0.0
    g[1, 2] = 0.0
    g[1, 3] = 7.0
    return g.to(dtype)


def _strongest_paths(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """max_j g_j·|∂p_j/∂s_i| along the last dim in float64, ∂p_j/∂s_i = p_j(δ_ij − p_i)."""
    g, p = g.double(), p.double()
    eye = torch.eye(p.shape[-1], dtype=torch.float64)
    jacobian = p[..., None, :] * (eye - p[..., :, None])  # [i, j] = ∂p_j/∂s_i
    return (g[..., None, :] * jacobian.abs()).amax(-1)


def _some_path(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """∨_j g_j ∧ (∂p_j/∂s_i ≠ 0) along the last dim, the Jacobian in float64."""
    p = p.double()
    eye = torch.eye(p.shape[-1], dtype=torch.float64)
    jacobian = p[..., None, :] * (eye - p[..., :, None])
    return (g[..., None, :] & (jacobian != 0)).any(-1)


def _signed_messages(dtype: torch.dtype, n: int, rows: int = 6) -> tuple:
    """SignedMaxProduct messages (hi ≥ lo) of (2, rows, n): signs mixed, empty pairs
    (-inf, +inf), a row of ties, a row of points (hi = lo)."""
    gen = torch.Generator().manual_seed(300 + n)
    hi = torch.randn(2, rows, n, generator=gen, dtype=torch.float64) * 20
    lo = hi - torch.rand(2, rows, n, generator=gen, dtype=torch.float64) * 10
    empty = (torch.arange(hi.numel()) % 6 == 2).reshape(hi.shape)
    hi, lo = hi.masked_fill(empty, -INF), lo.masked_fill(empty, INF)
    hi[1, 3], lo[1, 3] = 4.0, -4.0
    lo[0, 4] = hi[0, 4]
    return hi.to(dtype), lo.to(dtype)


def _signed_paths(hi: torch.Tensor, lo: torch.Tensor, p: torch.Tensor) -> tuple:
    """The largest and smallest g_j·∂p_j/∂s_i over j and the ends of g_j, in float64;
    (-inf, +inf) where no edge (∂p_j/∂s_i = 0) or every g_j is empty."""
    hi, lo, p = hi.double(), lo.double(), p.double()
    eye = torch.eye(p.shape[-1], dtype=torch.float64)
    jacobian = p[..., None, :] * (eye - p[..., :, None])  # [i, j] = ∂p_j/∂s_i
    h, l = hi[..., None, :] * jacobian, lo[..., None, :] * jacobian
    dead = (jacobian == 0) | (hi < lo)[..., None, :]
    top = torch.maximum(h, l).masked_fill(dead, -INF).amax(-1)
    bottom = torch.minimum(h, l).masked_fill(dead, INF).amin(-1)
    return top, bottom


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to the bit (the sign of a zero included), NaN where NaN."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype == torch.bool:
        return torch.equal(got, want)
    bits = torch.int32 if got.dtype == torch.float32 else torch.int64
    nan = torch.isnan(got)
    return torch.equal(nan, torch.isnan(want)) and torch.equal(
        got.masked_fill(nan, 0).view(bits), want.masked_fill(nan, 0).view(bits)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS)
def test_max_product_kernel_is_the_generic_formula(dtype, n, monkeypatch):
    """MaxProduct: the kernel's message, the generic formula's and the kernels-off path's
    are the same bits; all within 2 ulp of the strongest path through the Jacobian."""
    g, p = _max_messages(dtype, n), _probs(dtype, n)
    S = sa.MaxProduct()
    assert extreme_entries.softmax_backward_max(g, p, -1) is not None
    (got,) = S.softmax_backward((g,), p, -1)
    (generic,) = Semiring.softmax_backward(S, (g,), p, -1)
    assert _same(got, generic)
    monkeypatch.setenv(ENV, "off")
    assert extreme_entries.softmax_backward_max(g, p, -1) is None
    assert _same(S.softmax_backward((g,), p, -1)[0], got)
    want = _strongest_paths(g, p)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), want, rtol=2 * eps, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", [INF, NAN])
def test_max_product_specials_are_the_generic_formula(dtype, value):
    """+inf and NaN messages and probabilities: ∞·0 and NaN rows, an infinite strongest
    path; the kernel gives the generic formula's bits (NaN where it gives NaN)."""
    g, p = _max_messages(dtype, 37), _probs(dtype, 37)
    g[0, 2, 3] = value  # a row of finite p: +inf wins or NaN spreads
    g[1, 0, 1] = value  # p = 0 there (excluded): ∞·0
    g[0, 0, 0] = value  # the p = 1 row
    p = p.clone()
    p[1, 4, 2] = value
    S = sa.MaxProduct()
    (got,) = S.softmax_backward((g,), p, -1)
    (generic,) = Semiring.softmax_backward(S, (g,), p, -1)
    assert _same(got, generic)
    assert bool(torch.isnan(got).any())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS)
def test_boolean_kernel_is_the_generic_formula(dtype, n, monkeypatch):
    """Boolean: the kernel's message equals the generic formula, the kernels-off path and
    the existence of a path through the Jacobian; rows with no, one and many live terms."""
    p = _probs(dtype, n)
    gen = torch.Generator().manual_seed(200 + n)
    g = torch.rand(p.shape, generator=gen) < 0.4
    g[1, 2] = False
    g[1, 3] = False
    g[1, 3, n // 2] = True  # one live term
    S = sa.Boolean()
    assert extreme_entries.softmax_backward_or(g, p, -1) is not None
    (got,) = S.softmax_backward((g,), p, -1)
    assert _same(got, Semiring.softmax_backward(S, (g,), p, -1)[0])
    assert torch.equal(got, _some_path(g, p))
    monkeypatch.setenv(ENV, "off")
    assert extreme_entries.softmax_backward_or(g, p, -1) is None
    assert torch.equal(S.softmax_backward((g,), p, -1)[0], got)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", LENGTHS)
def test_signed_kernel_is_the_generic_formula(dtype, n, monkeypatch):
    """SignedMaxProduct: the kernel's pair, the generic formula's and the kernels-off
    path's are the same bits; within 2 ulp (and a subnormal step) of the largest and
    smallest signed path through the Jacobian."""
    (hi, lo), p = _signed_messages(dtype, n), _probs(dtype, n)
    S = sa.SignedMaxProduct()
    assert extreme_entries.softmax_backward_signed((hi, lo), p, -1) is not None
    got = S.softmax_backward((hi, lo), p, -1)
    generic = Semiring.softmax_backward(S, (hi, lo), p, -1)
    assert all(_same(g, w) for g, w in zip(got, generic))
    monkeypatch.setenv(ENV, "off")
    assert extreme_entries.softmax_backward_signed((hi, lo), p, -1) is None
    assert all(_same(g, w) for g, w in zip(S.softmax_backward((hi, lo), p, -1), got))
    eps, step = torch.finfo(dtype).eps, torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    for g, w in zip(got, _signed_paths(hi, lo, p)):  # products of two tiny p underflow
        torch.testing.assert_close(g.double(), w, rtol=2 * eps, atol=step)


@pytest.mark.parametrize("value", [INF, NAN])
def test_signed_specials_are_the_generic_formula(value):
    """An infinite end (a path of infinite weight; ∞·0 where p = 0 is no edge) on the
    kernel, a NaN (declined: the formula's NaN) on the formula: the generic formula's bits."""
    (hi, lo), p = _signed_messages(torch.float64, 37), _probs(torch.float64, 37)
    hi[0, 2, 3] = value
    hi[1, 0, 1] = value  # p = 0 there
    S = sa.SignedMaxProduct()
    fused = extreme_entries.softmax_backward_signed((hi, lo), p, -1)
    assert (fused is None) == (value != value)
    got = S.softmax_backward((hi, lo), p, -1)
    assert all(_same(g, w) for g, w in zip(got, Semiring.softmax_backward(S, (hi, lo), p, -1)))


def test_boolean_nan_probability_is_an_edge():
    """A NaN derivative is non-zero: an edge, as lift(NaN) = (NaN ≠ 0) says."""
    p = _probs(torch.float32, 16).clone()
    p[0, 2, 3] = NAN
    g = torch.zeros(p.shape, dtype=torch.bool)
    g[0, 2, 6] = True  # p ≠ 0 there
    S = sa.Boolean()
    (got,) = S.softmax_backward((g,), p, -1)
    assert _same(got, Semiring.softmax_backward(S, (g,), p, -1)[0])
    assert bool(got[0, 2, 3])


@pytest.mark.parametrize("semiring", ["MaxProduct", "Boolean"])
def test_other_layouts_take_the_formula_or_a_contiguous_copy(semiring):
    """Strided rows (copied to contiguous for the kernel), a dim that is not the last, and
    broadcast or bfloat16 probabilities (the generic formula): the same bits throughout."""
    S = getattr(sa, semiring)()
    p = _probs(torch.float32, 32)
    g = _max_messages(torch.float32, 32) if semiring == "MaxProduct" else p > 0.01
    kernel = (
        extreme_entries.softmax_backward_max
        if semiring == "MaxProduct"
        else extreme_entries.softmax_backward_or
    )
    cases = [
        (g[..., ::2], p[..., ::2], -1, True),
        (g.transpose(-1, -2), p.transpose(-1, -2), -2, False),
        (g, p[:1], -1, False),
        (g, p.to(torch.bfloat16), -1, False),
    ]
    for gi, pi, dim, fused in cases:
        assert (kernel(gi, pi, dim) is not None) == fused
        (got,) = S.softmax_backward((gi,), pi, dim)
        assert _same(got, Semiring.softmax_backward(S, (gi,), pi, dim)[0])


@pytest.mark.parametrize("semiring", ["MaxProduct", "Boolean", "SignedMaxProduct"])
@pytest.mark.parametrize("length", [100, 300])
def test_attention_backward_with_and_without_the_kernels(semiring, length, monkeypatch):
    """The backward through grouped-query causal F.scaled_dot_product_attention (one block
    of query rows at 100, three at 300) with the kernels equals the torch formulas' (the
    kernels off), to the bit. The probabilities are rebuilt by torch's chain in both runs:
    ``softmax_rows`` rounds differently (its values are tested in test_attention_layouts.py)."""
    monkeypatch.setattr(attention_helpers, "BLOCK_ELEMENTS", 1)  # blocks of MIN_ROWS
    monkeypatch.setattr(kernels, "softmax_rows", lambda scores, keep, factor: False)
    gen = torch.Generator().manual_seed(length)
    q = torch.randn(1, 6, length, 16, generator=gen)
    k, v = (torch.randn(1, 2, length, 16, generator=gen) for _ in range(2))
    model = _GroupedCausalAttention(k, v)

    def messages():
        leaf = q.clone().requires_grad_(True)
        with sa.patch(model, getattr(sa, semiring)()):
            out = model(leaf)
        return sa.grad(out[0, :, -3:].sum(), leaf)

    fused = messages()
    monkeypatch.setenv(ENV, "off")
    plain = messages()
    if semiring == "SignedMaxProduct":
        assert all(_same(f, w) for f, w in zip(fused, plain))
    else:
        assert _same(fused, plain)


class _GroupedCausalAttention(torch.nn.Module):
    """Causal attention of a query over a fixed key and value, three query heads a group."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor):
        super().__init__()
        self.key, self.value = key, value

    def forward(self, query: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            query, self.key, self.value, is_causal=True, enable_gqa=True
        )
