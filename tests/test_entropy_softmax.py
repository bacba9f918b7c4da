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
from semiring_autograd.semirings.base import Semiring

S = sa.Entropy()
INF = float("inf")


def _oracle(gl: Tensor, gr: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
    """⊕_j (gl_j + log|J_ij|, gr_j − log|J_ij|) in float64, by enumerating j."""
    gl, gr, p = gl.double(), gr.double(), p.double()
    n = p.shape[-1]
    out_l, out_r = torch.empty_like(p), torch.empty_like(p)
    for i in range(n):
        ls, rs = [], []
        for j in range(n):
            jac = p[..., j] * ((1.0 if i == j else 0.0) - p[..., i])
            log_j = torch.log(jac.abs())
            ls.append(gl[..., j] + log_j)
            rs.append(gr[..., j] - log_j)
        terms, values = torch.stack(ls, -1), torch.stack(rs, -1)
        total = torch.logsumexp(terms, -1)
        weight = torch.exp(terms - total[..., None]).nan_to_num(nan=0.0)
        mean = torch.where(weight > 0, weight * values, 0.0).sum(-1)
        out_l[..., i], out_r[..., i] = total, torch.where(torch.isneginf(total), 0.0, mean)
    return out_l, out_r


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
