"""scaled_dot_product_attention's backward in blocks of query rows
(semiring_autograd/ops/attention_helpers.py): the same messages as the unblocked rule and
as path enumeration, under every built-in semiring, with every kind of mask and GQA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from composition_oracles import attention_paths
from op_checks import Apply, assert_value_close, random_cotangent, raw_value

import semiring_autograd as sa
from semiring_autograd.ops import attention_helpers
from semiring_autograd.semirings import BUILTIN_SEMIRINGS, Semiring

#: Real() itself runs torch's own SDPA backward; Real(formulas=True) runs the rule
SEMIRINGS = [sa.Real(formulas=True)] + [cls() for cls in BUILTIN_SEMIRINGS if cls is not sa.Real]
SEMIRINGS.append(sa.KBest(3))
#: ⊕ that picks one operand (max, or): regrouping the ⊕ over blocks changes no bit
IDEMPOTENT = (sa.MaxProduct, sa.SignedMaxProduct, sa.Boolean, sa.KBest)
#: a float ⊕ regrouped over blocks rounds differently, by a few ulps in float64
RTOL, ATOL = 1e-12, 1e-12
#: path enumeration against the rule (the tolerance of tests/test_ops_oracle.py)
ORACLE_RTOL, ORACLE_ATOL = 1e-7, 1e-9
#: batch 2 × heads 2 × 6 keys = 24 elements a query row: 48 makes blocks of 2 queries
SMALL_BLOCK = 48


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bool_mask(*shape: int) -> torch.Tensor:
    """A random boolean mask (True = attend) in which every query attends to key 0."""
    mask = torch.rand(*shape, generator=_gen(3)) < 0.6
    mask[..., 0] = True
    return mask


CASES: dict[str, tuple[dict[str, Any], bool]] = {
    # name: (keyword arguments of F.scaled_dot_product_attention, float mask as an input)
    "plain": ({}, False),
    "causal": ({"is_causal": True}, False),
    "bool_rows": ({"attn_mask": _bool_mask(2, 2, 7, 6)}, False),
    "bool_keys": ({"attn_mask": _bool_mask(1, 6)}, False),
    "float_rows": ({"attn_mask": torch.randn(2, 1, 7, 6, generator=_gen(4))}, True),
    "float_keys": ({"attn_mask": torch.randn(2, 1, 1, 6, generator=_gen(5))}, True),
    "float_vector": ({"attn_mask": torch.randn(6, generator=_gen(6))}, True),
    "gqa": ({"enable_gqa": True}, False),
    "gqa_causal_scale": ({"enable_gqa": True, "is_causal": True, "scale": 0.3}, False),
}


def _inputs(name: str) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """(q, k, v[, float mask]) leaves in float64 and the remaining keyword arguments:
    7 queries, 6 keys, 2 query heads (on 1 key/value head for GQA)."""
    kwargs, mask_input = CASES[name]
    kwargs = dict(kwargs)
    kv_heads = 1 if kwargs.get("enable_gqa") else 2
    g = _gen(sum(map(ord, name)))
    leaves = [
        torch.randn(2, 2, 7, 4, generator=g, dtype=torch.float64),
        torch.randn(2, kv_heads, 6, 4, generator=g, dtype=torch.float64),
        torch.randn(2, kv_heads, 6, 3, generator=g, dtype=torch.float64),
    ]
    if mask_input:
        leaves.append(kwargs.pop("attn_mask").to(torch.float64))
    return [t.requires_grad_() for t in leaves], kwargs


def _messages(S: Semiring, name: str) -> tuple[list[torch.Tensor], list, torch.Tensor]:
    """(leaves, their raw messages, seed) of a seeded sa.grad through the attention."""
    leaves, kwargs = _inputs(name)
    module = Apply(lambda q, k, v, *m: F.scaled_dot_product_attention(q, k, v, *m, **kwargs))
    with sa.patch(module, S):
        out = module(*leaves)
    seed = random_cotangent(out.shape, _gen(7))
    raw = sa.grad(out, leaves, seed=seed, raw=True)
    return leaves, [raw_value(S, m, x) for m, x in zip(raw, leaves)], seed


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("S", SEMIRINGS, ids=repr)
def test_blocked_backward_matches_unblocked(S: Semiring, name: str, monkeypatch):
    _, whole, _ = _messages(S, name)  # 7 queries fill less than the default block
    blocks = []
    run_blocks = attention_helpers._run_blocks

    def counted(rule, call, rows, *rest):
        blocks.append(rows)
        return run_blocks(rule, call, rows, *rest)

    monkeypatch.setattr(attention_helpers, "_run_blocks", counted)
    monkeypatch.setattr(attention_helpers, "BLOCK_ELEMENTS", SMALL_BLOCK)
    monkeypatch.setattr(attention_helpers, "MIN_ROWS", 1)
    leaves, blocked, seed = _messages(S, name)
    assert blocks == [2], "the backward did not run in blocks of 2 queries"
    for k, (b, w) in enumerate(zip(blocked, whole)):
        if isinstance(S, IDEMPOTENT):
            for c, (bc, wc) in enumerate(zip(b, w)):
                assert torch.equal(bc, wc), f"input {k}, component {c}: not bit-identical"
        else:
            assert_value_close(b, w, f"input {k} blocked vs unblocked", RTOL, ATOL)
    kwargs = _inputs(name)[1]
    names = ["q", "k", "v", "m"]
    given = dict(zip(["q", "k", "v", "attn_mask"], [x.detach() for x in leaves]))
    expected = attention_paths(S, seed, **given, **kwargs)
    for k, (b, n) in enumerate(zip(blocked, names)):
        assert_value_close(b, expected[n], f"input {k} vs paths", ORACLE_RTOL, ORACLE_ATOL)


def test_query_rows_fill_the_block(monkeypatch):
    monkeypatch.setattr(attention_helpers, "BLOCK_ELEMENTS", 100)
    monkeypatch.setattr(attention_helpers, "MIN_ROWS", 2)
    assert attention_helpers.query_rows(batch_heads=2, queries=9, keys=10) == 5
    assert attention_helpers.query_rows(batch_heads=3, queries=9, keys=50) == 2
    assert attention_helpers.query_rows(batch_heads=1, queries=4, keys=10) == 4
    assert attention_helpers.query_rows(batch_heads=1, queries=1, keys=1000) == 1


def test_query_rows_on_an_accelerator_fill_its_larger_block(monkeypatch):
    monkeypatch.setattr(attention_helpers, "BLOCK_ELEMENTS", 100)
    monkeypatch.setattr(attention_helpers, "DEVICE_BLOCK_ELEMENTS", 1000)
    monkeypatch.setattr(attention_helpers, "MIN_ROWS", 2)
    assert (
        attention_helpers.query_rows(batch_heads=2, queries=90, keys=10, device_type="cuda") == 50
    )
    assert attention_helpers.query_rows(batch_heads=2, queries=90, keys=10, device_type="cpu") == 5
    # Llama-2-7B's 32 heads at 512 tokens: one block on a GPU
    monkeypatch.undo()
    assert attention_helpers.query_rows(32, 512, 512, "cuda") == 512
