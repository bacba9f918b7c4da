"""Causal scaled_dot_product_attention's backward in blocks of query rows, each block
reading the keys and values up to its last query (semiring_autograd/ops/attention_helpers.py):
the messages of the unblocked rule (within rounding: a block's probabilities are normalised
by sums over fewer keys, which round differently from the whole row's, by an ulp or so)
and of path enumeration under every built-in semiring, with fewer queries than keys (keys
no query reaches get the semiring zero), more queries than keys, and GQA; and a compiled
backward of the blocks against the eager one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from composition_oracles import attention_paths
from op_checks import Apply, assert_value_close, random_cotangent, raw_value

import semiring_autograd as sa
from semiring_autograd.ops import attention_helpers
from semiring_autograd.semirings import BUILTIN_SEMIRINGS, Semiring

SEMIRINGS = [sa.Real(formulas=True)] + [cls() for cls in BUILTIN_SEMIRINGS if cls is not sa.Real]
SEMIRINGS.append(sa.KBest(3))
#: float64 rounding of the probabilities' sums and of a float ⊕ regrouped over blocks
RTOL, ATOL = 1e-12, 1e-12
ORACLE_RTOL, ORACLE_ATOL = 1e-7, 1e-9
#: (queries, keys, query heads, key/value heads)
SHAPES = {"fewer_queries": (5, 9, 2, 2), "more_queries": (9, 5, 2, 2), "gqa": (8, 8, 4, 2)}


def _messages(S: Semiring, shape: str, seed: int = 0):
    """(leaves, their raw messages, seed) of a seeded sa.grad through causal attention."""
    queries, keys, heads, kv_heads = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    leaves = [
        torch.randn(2, heads, queries, 4, generator=gen, dtype=torch.float64),
        torch.randn(2, kv_heads, keys, 4, generator=gen, dtype=torch.float64),
        torch.randn(2, kv_heads, keys, 3, generator=gen, dtype=torch.float64),
    ]
    leaves = [t.requires_grad_() for t in leaves]
    gqa = heads != kv_heads
    module = Apply(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    )
    with sa.patch(module, S):
        out = module(*leaves)
    cotangent = random_cotangent(out.shape, torch.Generator().manual_seed(7))
    raw = sa.grad(out, leaves, seed=cotangent, raw=True)
    return leaves, [raw_value(S, m, x) for m, x in zip(raw, leaves)], cotangent


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("S", SEMIRINGS, ids=repr)
def test_causal_blocks_read_keys_up_to_their_last_query(S: Semiring, shape: str, monkeypatch):
    whole = _messages(S, shape)[1]  # one block
    reads = []
    rule_blocks = attention_helpers._causal_block

    def recorded(block, start, size, keys):
        rule_blocks(block, start, size, keys)
        reads.append(block["key"].shape[-2])

    monkeypatch.setattr(attention_helpers, "_causal_block", recorded)
    monkeypatch.setattr(attention_helpers, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(attention_helpers, "MIN_ROWS", 2)
    leaves, blocked, cotangent = _messages(S, shape)
    queries, keys = SHAPES[shape][:2]
    assert reads == [min(keys, start + 2, queries) for start in range(0, queries, 2)]
    for k, (b, w) in enumerate(zip(blocked, whole)):
        assert_value_close(b, w, f"input {k} blocked vs unblocked", RTOL, ATOL)
    given = dict(zip(["q", "k", "v"], [x.detach() for x in leaves]))
    gqa = SHAPES[shape][2] != SHAPES[shape][3]
    expected = attention_paths(S, cotangent, **given, is_causal=True, enable_gqa=gqa)
    for k, (b, n) in enumerate(zip(blocked, ["q", "k", "v"])):
        assert_value_close(b, expected[n], f"input {k} vs paths", ORACLE_RTOL, ORACLE_ATOL)
    if shape == "fewer_queries":  # keys 5..8 follow every query: no path reaches them
        zero = S.zero((2, 2, keys - queries, 4), leaves[1])
        for c, z in zip(blocked[1], zero):
            assert torch.equal(c[..., queries:, :], z.to(c.dtype).expand_as(c[..., queries:, :]))


@pytest.mark.parametrize(
    "S, queries", [(sa.Log(), 160), (sa.Entropy(), 12), (sa.MaxProduct(), 12), (sa.KBest(3), 12)]
)
def test_compiled_blocks_equal_eager(S: Semiring, queries: int, monkeypatch):
    """A compiled backward replays the blocks' in-place ⊕ into the key's and value's
    accumulators (under Log, 160 queries of 64 dims per key/value head reach the fused
    log_add_rows_): its messages equal the eager backward's, grouped heads included."""
    monkeypatch.setattr(attention_helpers, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(attention_helpers, "MIN_ROWS", queries // 3)
    gen = torch.Generator().manual_seed(3)
    given = [torch.randn(1, h, queries, 64, generator=gen) for h in (4, 2, 2)]
    module = Apply(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    )
    runs = []
    for compile in (False, True, True):  # eager; captured; replayed
        leaves = [t.clone().requires_grad_() for t in given]
        with sa.patch(module, S):
            out = module(*leaves)
        runs.append(sa.grad(out[0, :, -1].sum(), leaves, compile=compile))
    for replayed in runs[1:]:
        for a, b in zip(runs[0], replayed):
            torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
