"""KBest's message at softmax's input on the CPU (``kernels.k_best_softmax_backward``, one
operator call per tensor) against the default formula, ``Semiring.softmax_backward`` (its
own products, leave-one-out and ⊕), to the bit, and against enumerating the Jacobian's
paths. Where the kernel does not apply the default answers."""

from __future__ import annotations

import pytest
import torch

import semiring_autograd as sa
from semiring_autograd import kernels
from semiring_autograd.kernels.operators import op
from semiring_autograd.semirings.base import Semiring

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the CPU kernels did not build")


def _operands(k: int, n: int, dtype: torch.dtype, seed: int = 0):
    """Descending lists on a grid of quarters (ties, zeros: rows and positions without a
    path) and softmax probabilities with excluded keys (p = 0) and a row of one key (p = 1)."""
    g = torch.Generator().manual_seed(seed)
    lists = ((torch.rand(k, 3, 4, n, generator=g) * 4).floor() / 4).to(dtype)
    lists = lists.sort(0, descending=True).values
    lists[:, 0, 1] = 0.0  # a row without a path
    lists[:, 1, 2, : n // 2] = 0.0
    scores = torch.randn(3, 4, n, generator=g, dtype=torch.float64) * 3
    scores[2, :, 1::3] = -float("inf")  # excluded keys
    scores[2, 3, 1:], scores[2, 3, 0] = -float("inf"), 0.0  # one key
    return lists, torch.softmax(scores, -1).to(dtype)


def _enumerated(lists: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """out_i = the k largest of lists_j·|∂p_j/∂s_i| over every j and list entry, with
    ∂p_j/∂s_i = p_j(δ_ij − p_i), computed as the formula rounds them: p_i(1 − p_i) for the
    own path, (lists_j·|p_j|)·|−p_i| for the others (zeros appended)."""
    k, n = lists.shape[0], lists.shape[-1]
    out = torch.empty_like(lists)
    for i in range(n):
        own = lists[..., i] * (p[..., i] * (1 - p[..., i])).abs()
        others = [lists[..., j] * p[..., j].abs() * (-p[..., i]).abs() for j in range(n) if j != i]
        pool = torch.cat([own, *others, torch.zeros_like(own)], 0)
        out[..., i] = pool.topk(k, dim=0).values
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("k, n", [(1, 6), (3, 1), (5, 37), (4, 300)])
def test_the_kernel_is_the_default_formula_to_the_bit(k, n, dtype):
    lists, p = _operands(k, n, dtype)
    out, declined = op("k_best_softmax_backward")(list(lists), p)
    assert not bool(declined)
    want = Semiring.softmax_backward(sa.KBest(k), tuple(lists), p, -1)
    assert all(torch.equal(o, w) for o, w in zip(out, want))
    got = sa.KBest(k).softmax_backward(tuple(lists), p, -1)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    if n <= 37:
        assert torch.equal(out, _enumerated(lists, p))


def test_where_the_kernel_does_not_apply_the_default_answers():
    """A NaN, a list out of order, another dim, probabilities of another dtype, and a KBest
    with its own leave-one-out: the default formula, bit for bit."""
    k = 3
    lists, p = _operands(k, 9, torch.float32)
    nan, disorder = lists.clone(), lists.clone()
    nan[1, 0, 2, 4] = float("nan")
    disorder[2, 1, 0, 3] = disorder[0, 1, 0, 3] + 1.0
    assert bool(op("k_best_softmax_backward")(list(nan), p)[1])
    assert bool(op("k_best_softmax_backward")(list(disorder), p)[1])

    class OwnLoo(sa.KBest):
        def loo(self, a, dim):
            return sa.KBest.loo(self, a, dim)

    cases = [
        (sa.KBest(k), tuple(nan), p, -1),
        (sa.KBest(k), tuple(disorder), p, -1),
        (sa.KBest(k), tuple(c.mT for c in lists), p.mT, -2),
        (sa.KBest(k), tuple(lists), p, 1),
        (OwnLoo(k), tuple(lists), p, -1),
    ]
    for S, a, probs, dim in cases:
        got = S.softmax_backward(a, probs, dim)
        want = Semiring.softmax_backward(S, a, probs, dim)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
