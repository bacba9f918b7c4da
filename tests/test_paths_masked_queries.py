"""Top paths through attention with a query row whose keys are all masked (a left-padded
batch's padding rows): the op gives such a row 0 and no edges, so no path crosses it. The
oracle: the attention probabilities by torch's softmax over the row's allowed keys."""

from __future__ import annotations

import math

import pytest
import torch

import semiring_autograd as sa
from semiring_autograd.explain.paths import PathFinder
from semiring_autograd.ops.decompositions import DECOMPOSITIONS, excluded_queries

HEADS, QUERIES, KEYS, DIM = 2, 4, 4, 3
#: query 0 attends to no key; the others to keys 1.. (and query 3 to all but key 0)
ALLOWED = torch.tensor([[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
#: the output read: every element of the masked query 0 (times 100, so a path through it
#: would win), and element 1 of query 2
READ_ROW, READ_DIM = 2, 1


def _mask(kind: str) -> torch.Tensor:
    if kind == "bool":
        return ALLOWED
    return torch.zeros(QUERIES, KEYS, dtype=torch.float64).masked_fill(~ALLOWED, -math.inf)


class _Attention(torch.nn.Module):
    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return 100.0 * o[0, :, 0].sum() + o[0, :, READ_ROW, READ_DIM].sum()


def _inputs():
    g = torch.Generator().manual_seed(5)
    return [
        torch.randn(1, HEADS, n, DIM, generator=g, dtype=torch.float64).requires_grad_()
        for n in (QUERIES, KEYS, KEYS)
    ]


def test_excluded_queries_names_the_rows_without_keys():
    q, k, v = _inputs()
    for kind in ("bool", "float"):
        rows = excluded_queries(q, k, v, attn_mask=_mask(kind))
        assert rows.reshape(-1).tolist() == [True, False, False, False]
    assert excluded_queries(q, k, v, is_causal=True) is None


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_decomposition_is_finite_and_equal_on_rows_with_keys(kind):
    q, k, v = (t.detach() for t in _inputs())
    mask = _mask(kind)
    mine = DECOMPOSITIONS["scaled_dot_product_attention"](q, k, v, attn_mask=mask)
    torch_ = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(mine).all()
    torch.testing.assert_close(mine[..., 1:, :], torch_[..., 1:, :], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize(
    "S", [sa.MaxProduct(), sa.SignedMaxProduct()], ids=lambda s: type(s).__name__
)
def test_no_path_crosses_a_query_without_keys(S, kind):
    """The path to v[h, j, READ_DIM] runs through query READ_ROW's probability of key j, its
    weight that probability (the read adds every element of query 0 too, whose output is a
    constant); the steps multiply to the weight."""
    q, k, v = _inputs()
    module = _Attention(_mask(kind))
    with sa.patch(module, S, paths=True):
        y = module(q, k, v)
    scores = (q @ k.transpose(-2, -1)).detach() / math.sqrt(DIM)
    probs = scores[0, :, READ_ROW].masked_fill(~ALLOWED[READ_ROW], -math.inf).softmax(-1)
    finder = PathFinder(y, v)
    readout = finder.readout if finder.readout.dim() == 4 else finder.readout[0]
    for h in range(HEADS):
        for j in range(KEYS):
            for d in range(DIM):
                expected = float(probs[h, j]) if d == READ_DIM else 0.0
                assert float(readout[0, h, j, d]) == pytest.approx(expected, rel=1e-12, abs=0)
                if expected == 0.0:
                    continue
                path = finder.path((0, h, j, d))
                assert path.weight == pytest.approx(expected, rel=1e-12)
                product = math.prod(s.local_derivative for s in path.steps[1:])
                assert product == pytest.approx(expected, rel=1e-12)
                edges = [s.attention for s in path.steps if s.attention is not None]
                assert [(e.head, e.query, e.key) for e in edges] == [(h, READ_ROW, j)]
