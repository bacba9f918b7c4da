"""Batched attribution (explain/batched.py): each example's readouts in a padded batch are
its one-at-a-time readouts (the oracle: ``sa.attribute`` on the text alone, itself checked
against torch.autograd and brute force in test_attribution.py)."""

from __future__ import annotations

import pytest
import torch
import transformers
from model_zoo import llama_config, minilm

import semiring_autograd as sa
from semiring_autograd.explain import batched
from semiring_autograd.explain.paths import OUTSIDE
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

SEMIRINGS = [cls() for cls in BUILTIN_SEMIRINGS]
RECORDS = [
    {"text": "the keys are here .", "target": 7},
    {"text": "a cat sat", "target": "table", "position": 2},
    {"text": "one two three four five six seven", "target": 9, "position": -3},
    {"text": "hello", "target": 11},
]
#: a float64 model: batched and single runs agree to rounding (a reduction over a padded
#: length rounds differently)
TOLERANCE = dict(rtol=1e-7, atol=1e-9)
#: (semiring name, record index) → the record's one-at-a-time attribution
_ALONE: dict = {}


@pytest.fixture(scope="module")
def llama_and_tokenizer():
    """A tiny random float64 Llama over MiniLM's real vocabulary and tokenizer."""
    _, tokenizer = minilm()
    torch.manual_seed(0)
    config = llama_config(vocab_size=tokenizer.vocab_size)
    return transformers.LlamaForCausalLM(config).double().eval(), tokenizer


def _prepared(model, tokenizer) -> list[batched.Prepared]:
    """RECORDS tokenized and checked for ``model``."""
    limit, logits = batched.context_limit(model), batched.logit_count(model)
    return [
        batched.prepare(i, batched.as_record(r), tokenizer, None, -1, limit, logits)
        for i, r in enumerate(RECORDS)
    ]


def _one(model, tokenizer, record, semiring, paths=False):
    return sa.attribute(
        model,
        record["text"],
        record["target"],
        semiring,
        tokenizer=tokenizer,
        position=record.get("position", -1),
        paths=paths,
    )


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("S", SEMIRINGS, ids=[type(s).__name__ for s in SEMIRINGS])
def test_batched_readouts_equal_one_at_a_time(llama_and_tokenizer, side, S, monkeypatch):
    model, tokenizer = llama_and_tokenizer
    monkeypatch.setattr(tokenizer, "padding_side", side)
    prepared = _prepared(model, tokenizer)
    kept: list[batched.BatchResult] = []
    found = batched.attribute_batch(model, prepared, S, tokenizer, paths=False, keep=kept)
    (result,) = kept
    mask = result.padded.mask.bool()
    assert (~mask).any(), "the batch has padding"
    if side == "left":
        assert not mask[:, 0].all() and mask[:, -1].all()
    else:
        assert mask[:, 0].all() and not mask[:, -1].all()
    # padding tokens get no score: no path reaches them, their readout is the zero's
    assert not result.reached[~mask].any()
    zero = S.readout(S.zero(result.reached.shape, result.scores.double()))
    torch.testing.assert_close(result.scores[..., ~mask], zero[..., ~mask].to(result.scores))
    for i, (record, attribution) in enumerate(zip(RECORDS, found)):
        key = (type(S).__name__, i)
        if key not in _ALONE:  # shared by the two padding sides
            _ALONE[key] = _one(model, tokenizer, record, S)
        alone = _ALONE[key]
        assert attribution.tokens == alone.tokens
        torch.testing.assert_close(attribution.scores, alone.scores, **TOLERANCE)
        assert attribution.prediction.position == alone.prediction.position
        assert attribution.prediction.target_logit == pytest.approx(
            alone.prediction.target_logit, rel=1e-12
        )
        assert attribution.target == alone.target


#: a path's weight and local derivatives, batched against one at a time (float64 model)
PATH_REL = 1e-9
PATH_SEMIRINGS = [sa.MaxProduct(), sa.SignedMaxProduct()]


def _multiplying(path):
    """The steps that multiply (not views, casts, copies; not the native read-out): where
    the batch and a lone text differ in weight-1 steps only (the batch repeats key and
    value heads before attention, a lone text inside it)."""
    return [s for s in path.steps[1:] if not s.is_identity and s.module != OUTSIDE]


def _assert_same_element(mine, alone, b, offset, padded, kept):
    """Step ``mine`` of example b's batched path at the element of ``alone``: row b for the
    lone text's 0, a padded position (a dim of the padded length) at the text's own
    position + ``offset``, the logits' kept column at the read position."""
    assert len(mine.shape) == len(alone.shape), (mine, alone)
    for d, (m, a, i, j) in enumerate(zip(mine.shape, alone.shape, mine.index, alone.index)):
        if d == 0:
            assert (i, a, j) == (b, 1, 0), (mine, alone)
        elif m == a:
            assert i == j, (mine, alone)
        elif m == padded:
            assert i - offset == j, (mine, alone)
        else:  # the read-out projects the kept read positions only
            assert mine.module == "lm_head" and int(kept[i]) - offset == j, (mine, alone)


def _assert_same_path(mine, alone, b, offset, padded, kept):
    """The same input element, the same multiplying steps (module, op, note, element, local
    derivative), the same attention edges in the text's positions, the same weight."""
    _assert_same_element(mine.steps[0], alone.steps[0], b, offset, padded, kept)
    assert mine.weight == pytest.approx(alone.weight, rel=PATH_REL)
    ours, theirs = _multiplying(mine), _multiplying(alone)
    assert len(ours) == len(theirs)
    for s, t in zip(ours, theirs):
        assert (s.module, s.op, s.note, s.attention) == (t.module, t.op, t.note, t.attention)
        assert s.local_derivative == pytest.approx(t.local_derivative, rel=PATH_REL)
        _assert_same_element(s, t, b, offset, padded, kept)


def _padding_free(path, length):
    """Whether no attention edge of ``path`` reads a position outside the text."""
    edges = [s.attention for s in path.steps if s.attention is not None]
    return all(0 <= e.query < length and 0 <= e.key < length for e in edges)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("S", PATH_SEMIRINGS, ids=[type(s).__name__ for s in PATH_SEMIRINGS])
def test_batched_top_paths_equal_one_at_a_time(llama_and_tokenizer, side, S, monkeypatch):
    """Every token's strongest path (and SignedMaxProduct's smallest) in a padded batch is
    its one-at-a-time path: positions shifted by the example's left padding, its weight the
    token's score; no path reaches or crosses a padding position."""
    model, tokenizer = llama_and_tokenizer
    monkeypatch.setattr(tokenizer, "padding_side", side)
    prepared = _prepared(model, tokenizer)
    kept: list[batched.BatchResult] = []
    found = batched.attribute_batch(model, prepared, S, tokenizer, paths=True, keep=kept)
    padded = kept[0].padded
    offsets, length = padded.offsets, padded.ids.shape[1]
    assert any(offsets) == (side == "left")
    columns = torch.unique(padded.positions)
    for b, (record, attribution) in enumerate(zip(RECORDS, found)):
        key = (type(S).__name__, b, "paths")
        if key not in _ALONE:  # shared by the two padding sides
            _ALONE[key] = _one(model, tokenizer, record, S, paths=True)
        alone = _ALONE[key]
        pairs = [(attribution.paths, alone.paths)]
        if isinstance(S, sa.SignedMaxProduct):
            pairs.append((attribution.min_paths, alone.min_paths))
        for mine_paths, alone_paths in pairs:
            assert len(mine_paths) == len(alone_paths) == len(alone.tokens)
            for t, (mine, single) in enumerate(zip(mine_paths, alone_paths)):
                assert (mine is None) == (single is None), t
                if mine is None:
                    continue
                assert mine.steps[0].index[1] == t + offsets[b]
                assert _padding_free(mine, len(alone.tokens))
                _assert_same_path(mine, single, b, offsets[b], length, columns)
        best = attribution.best_token()
        assert attribution.paths[best].weight == pytest.approx(
            float(attribution.display_scores()[best]), rel=PATH_REL
        )


@pytest.mark.parametrize("side", ["right", "left"])
def test_sa_attribute_batches_records_with_top_paths(llama_and_tokenizer, side, monkeypatch):
    model, tokenizer = llama_and_tokenizer
    monkeypatch.setattr(tokenizer, "padding_side", side)
    records = [RECORDS[1], RECORDS[3]]
    found = sa.attribute(model, records, None, "max-product", tokenizer=tokenizer, batch_size=2)
    assert len(found) == len(records)
    for record, attribution in zip(records, found):
        alone = _one(model, tokenizer, record, sa.MaxProduct(), paths=True)
        torch.testing.assert_close(attribution.scores, alone.scores, **TOLERANCE)
        assert len(attribution.paths) == len(alone.paths) == len(alone.tokens)
        for t, (path, single) in enumerate(zip(attribution.paths, alone.paths)):
            assert (path is None) == (single is None)
            if path is not None:
                assert path.weight == pytest.approx(single.weight, rel=1e-7)
                assert path.weight == pytest.approx(float(attribution.scores[t]), rel=1e-9)
                offset = path.steps[0].shape[1] - len(alone.tokens) if side == "left" else 0
                assert path.steps[0].index[1] == t + offset
                edges = [s.attention for s in path.steps if s.attention is not None]
                assert edges == [s.attention for s in single.steps if s.attention is not None]


def test_compiled_batches_replay_one_program_per_shape(llama_and_tokenizer):
    model, tokenizer = llama_and_tokenizer
    texts = [r["text"] for r in RECORDS] * 2
    eager = sa.attribute(model, iter(texts), 7, tokenizer=tokenizer, batch_size=3, paths=False)
    compiled = sa.attribute(
        model, texts, 7, tokenizer=tokenizer, batch_size=3, paths=False, compile=True
    )
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a.scores, b.scores, **TOLERANCE)
    # lengths bucketed to multiples of 8 and batches filled to 3 rows: one padded shape
    limit, logits = batched.context_limit(model), batched.logit_count(model)
    prepared = [
        batched.prepare(i, batched.Record(t), tokenizer, 7, -1, limit, logits)
        for i, t in enumerate(texts)
    ]
    shapes = {
        tuple(batched.pad(b, tokenizer, True, size=3, multiple=8).ids.shape)
        for b in batched.buckets(prepared, 3, len(prepared))
    }
    assert shapes == {(3, 8), (3, 16)}  # lengths 3 3 5 | 5 7 7 | 9 9 (+ a copy)


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"text": "  "}, "the text is empty"),
        ({"text": "a cat", "target": "tablecloths"}, "is 3 tokens"),
        ({"text": "a cat", "position": 9}, "position 9 is outside the sequence of 4 tokens"),
        ({"text": "a cat", "target": 10**6}, "outside the model's 30522 logits"),
        ({"text": "a " * 3000}, "the model reads at most 2048"),
        ({"text": "a", "colour": 1}, "got also \\['colour'\\]"),
    ],
)
def test_bad_record_is_named(llama_and_tokenizer, record, reason):
    model, tokenizer = llama_and_tokenizer
    with pytest.raises(ValueError, match=f"record 1: .*{reason}"):
        sa.attribute(model, [{"text": "fine"}, record], 7, tokenizer=tokenizer, batch_size=2)
