"""Entropy's message at softmax's input (``Entropy.softmax_backward``, one kernel call per
tensor on the CPU) against the semiring's definition in float64: out_i = ⊕_j g_j ⊗
lift(∂p_j/∂s_i), ∂p_j/∂s_i = p_j(δ_ij − p_i), the ⊕ of Entropy values (l, r) being log Σ e^l
and the e^l-weighted mean of r. Where the kernel does not apply (a row holding NaN, another
dim, operands not contiguous) the default formula answers, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import semiring_autograd as sa
from semiring_autograd import kernels
from semiring_autograd.kernels.operators import op
from semiring_autograd.semirings.base import Semiring

S = sa.Entropy()
INF = float("inf")


def _oracle(gl: Tensor, gr: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
    """⊕_j (gl_j + log|J_ij|, gr_j − log|J_ij|) in float64, every pair (i, j) a term."""
    gl, gr, p = gl.double(), gr.double(), p.double()
    eye = torch.eye(p.shape[-1], dtype=torch.float64)
    log_j = torch.log((p[..., None, :] * (eye - p[..., :, None])).abs())  # [..., i, j]
    terms, values = gl[..., None, :] + log_j, gr[..., None, :] - log_j
    total = torch.logsumexp(terms, -1)
    weight = torch.exp(terms - total[..., None]).nan_to_num(nan=0.0)
    mean = torch.where(weight > 0, weight * values, 0.0).sum(-1)
    return total, torch.where(torch.isneginf(total), 0.0, mean)


def _operands(dtype: torch.dtype, n: int = 11) -> tuple[Tensor, Tensor, Tensor]:
    """g with -inf entries (no path) and a row of -inf; p with excluded keys (p = 0), a row
    with one key (p = 1) and a row with p within an ulp of 1."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, n, generator=gen, dtype=torch.float64) * 4
    if n > 1:  # (a row of one key keeps it)
        scores.view(-1)[2::5] = -INF
    scores[0, 1, 1:] = -INF
    scores[1, 2, 0] = 40.0
    p = torch.softmax(scores, -1).to(dtype)
    gl = (torch.randn(2, 3, n, generator=gen, dtype=torch.float64) * 10).to(dtype)
    gl.view(-1)[3::7] = -INF
    gl[1, 0] = -INF
    gr = torch.randn(2, 3, n, generator=gen, dtype=torch.float64).to(dtype)
    return gl, gr.masked_fill(torch.isneginf(gl), 0.0), p


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("n", [1, 11, 40])
def test_entropy_softmax_backward_equals_its_definition(dtype, n):
    gl, gr, p = _operands(dtype, n)
    got_l, got_r = S.softmax_backward((gl, gr), p, -1)
    want_l, want_r = _oracle(gl, gr, p)
    eps = torch.finfo(dtype).eps
    # within 8 ulp of each row's largest |term| (log Z), 64 ulp of its spread (r)
    scale_l = 1 + want_l.nan_to_num(neginf=0.0).abs() + gl.double().nan_to_num(neginf=0).abs()
    scale_l = scale_l.amax(-1, keepdim=True) + 40
    scale_r = 1 + gr.double().abs().amax(-1, keepdim=True) + 40
    assert torch.equal(torch.isneginf(got_l), torch.isneginf(want_l))
    finite = torch.isfinite(want_l)
    assert bool(((got_l.double() - want_l).abs() <= 8 * eps * scale_l)[finite].all())
    assert bool(((got_r.double() - want_r).abs() <= 64 * eps * scale_r).all())
    assert bool((got_r[~finite] == 0).all())  # no path: r is 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_where_the_kernel_does_not_apply_the_default_formula_answers(dtype):
    gl, gr, p = _operands(dtype)
    gl[0, 2, 4] = float("nan")  # a row holding NaN: declined
    cases = [((gl, gr), p, -1), ((gl.mT, gr.mT), p.mT, -2), ((gl.mT, gr.mT), p.mT, 1)]
    cases.append(((gl[..., ::2], gr[..., ::2]), p[..., ::2], -1))  # not contiguous
    for a, probs, dim in cases:
        got = S.softmax_backward(a, probs, dim)
        want = Semiring.softmax_backward(S, a, probs, dim)
        for g, w in zip(got, want):
            assert torch.equal(g.isnan(), w.isnan())
            assert torch.equal(g.nan_to_num(), w.nan_to_num())


def _kernel(gl: Tensor, gr: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
    """The operator itself, past the first-use check that would hand a wrong kernel's
    tensors to the torch formula; every row computed (none declined)."""
    if not kernels.available():
        pytest.skip("the CPU kernels are switched off or could not be built here")
    out_l, out_r, declined = op("entropy_softmax_backward")(gl, gr, p)
    assert not bool(declined)
    return out_l, out_r


def _assert_definition(got: tuple[Tensor, Tensor], gl: Tensor, gr: Tensor, p: Tensor) -> None:
    """Within 8 ulp of each row's largest |term| (log Z) and 128 ulp of its spread (r: a
    row's terms reach |log p| = 400 in double) of the definition; no path where the
    definition has none."""
    want_l, want_r = _oracle(gl, gr, p)
    eps = torch.finfo(p.dtype).eps
    log_p = torch.log(p.double().abs()).nan_to_num(neginf=0.0).abs().amax(-1, keepdim=True)
    scale_l = 1 + want_l.nan_to_num(neginf=0.0).abs() + gl.double().nan_to_num(neginf=0).abs()
    scale_l = scale_l.amax(-1, keepdim=True) + log_p
    scale_r = 1 + gr.double().abs().amax(-1, keepdim=True) + log_p
    assert torch.equal(torch.isneginf(got[0]), torch.isneginf(want_l))
    finite = torch.isfinite(want_l)
    assert bool(((got[0].double() - want_l).abs() <= 8 * eps * scale_l)[finite].all())
    assert bool(((got[1].double() - want_r).abs() <= 128 * eps * scale_r).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rows_in_the_largest_terms_frame_and_the_rows_it_declines(dtype):
    """Rows the kernel sums in the frame of their largest term (terms spread over 40 nats,
    excluded keys, a long row past one chunk of sums) and rows it hands to log space (a
    nonzero p under 2^-64 in float and 2^-500 in double, a gap of 80 and 600 nats between the
    two largest terms, one live term): each equals the definition."""
    gen = torch.Generator().manual_seed(5)
    n = 37
    scores = torch.randn(8, n, generator=gen, dtype=torch.float64) * 3
    scores[1, ::4] = -INF  # excluded keys
    scores[2, 0] = -400.0 if dtype == torch.float64 else -80.0  # p under the least it takes
    scores[3, 1:] = -INF  # one key: p = 1
    p = torch.softmax(scores, -1)
    gl = torch.randn(8, n, generator=gen, dtype=torch.float64) * 10
    gl[0] = torch.linspace(-40, 0, n, dtype=torch.float64)  # terms over 40 nats
    gl[4, 5] = 80.0 if dtype == torch.float32 else 600.0  # a gap past the shared frame
    gl[5, 6] = 59.0  # a gap within it
    gr = torch.randn(8, n, generator=gen, dtype=torch.float64) * 3
    gl, gr, p = gl.to(dtype), gr.to(dtype), p.to(dtype)
    _assert_definition(_kernel(gl, gr, p), gl, gr, p)
    long = torch.randn(2, 1100, generator=gen, dtype=torch.float64)
    lp, lgl, lgr = torch.softmax(long * 2, -1), long * 4, torch.randn_like(long)
    lgl, lgr, lp = lgl.to(dtype), lgr.to(dtype), lp.to(dtype)
    _assert_definition(_kernel(lgl, lgr, lp), lgl, lgr, lp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_the_kernel_reads_lift_of_signed_probabilities(dtype):
    """p not a softmax (entries of either sign, as ``softmax_backward``'s contract allows):
    the kernel reads |p| and |1 − p| as lift does, in both frames."""
    gen = torch.Generator().manual_seed(11)
    p = (torch.randn(2, 6, 37, generator=gen, dtype=torch.float64) * 0.3).to(dtype)
    gl = (torch.randn(2, 6, 37, generator=gen, dtype=torch.float64) * 5).to(dtype)
    gl[1, 2, 0] = 300.0  # a gap past the shared frame in float: log space
    gr = torch.randn(2, 6, 37, generator=gen, dtype=torch.float64).to(dtype)
    _assert_definition(_kernel(gl, gr, p), gl, gr, p)
