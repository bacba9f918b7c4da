"""Batched and dataset-scale attribution on CUDA against the same runs on the CPU (which
test_dataset_batched.py and test_dataset_runs.py check against one-at-a-time attribution):
a float64 model, so CUDA and CPU agree to float64 rounding. ``scripts/gpu-check`` runs these
(``pytest -m cuda``); without a CUDA device they skip. Attention's output reaches the same
elements on both devices, through one layout copy more where the device's attention kernel
returns it in the other layout: routes compare with those copies counted once, and the CPU's
two attention kernels check that rule here without a GPU."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from model_zoo import gpt2_config
from test_dataset_batched import RECORDS, SEMIRINGS

import semiring_autograd as sa
from semiring_autograd.explain.paths import Path


def on_cuda(test):
    """A test that needs a CUDA device (``pytest -m cuda``), skipped without one."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    return pytest.mark.cuda(skip(test))


#: float64 on both devices: reductions in another order round differently
TOLERANCE = dict(rtol=1e-9, atol=1e-12)


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the records' words (built in memory: the GPU machine
    has no package that ships one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for r in RECORDS for w in r["text"].split()} | {"table"})
    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]"
    )


@pytest.fixture(scope="module")
def cpu_model():
    """A tiny random float64 GPT-2 (learned positions: no float32 tables, which a Llama's
    rotary embedding holds and each device computes in its own rounding) over a word-level
    tokenizer."""
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    config = gpt2_config(vocab_size=tokenizer.vocab_size)
    return transformers.GPT2LMHeadModel(config).double().eval(), tokenizer


@pytest.fixture(scope="module")
def models(cpu_model):
    """The float64 GPT-2 on the CPU and (the same weights) on CUDA."""
    cpu, tokenizer = cpu_model
    cuda = transformers.GPT2LMHeadModel(cpu.config).double().eval()
    cuda.load_state_dict(cpu.state_dict())
    return cpu, cuda.cuda(), tokenizer


#: ops that copy an element to the same index of a tensor of the same shape in another layout
LAYOUT_COPIES = frozenset({"contiguous", "clone"})


def route(path: Path) -> list[tuple]:
    """The (shape, index) elements a path visits in order, a layout copy of its predecessor's
    element counted once (``contiguous`` after the transpose of an attention output the
    device's kernel returned in the other layout)."""
    out: list[tuple] = []
    for step in path.steps:
        here = (tuple(step.shape), tuple(step.index))
        if not (out and step.op in LAYOUT_COPIES and out[-1] == here):
            out.append(here)
    return out


def test_attention_kernels_take_the_same_routes(cpu_model):
    """The math attention kernel (the one float64 runs on CUDA) returns its output in the
    layout that needs a ``contiguous`` copy after the transpose; the CPU's flash kernel does
    not. Their top paths differ in those steps alone: same weights, same routes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, tokenizer = cpu_model
    S = sa.MaxProduct()
    flash = sa.attribute(model, RECORDS, None, S, tokenizer=tokenizer, batch_size=4, progress=False)
    with sdpa_kernel(SDPBackend.MATH):
        math = sa.attribute(
            model, RECORDS, None, S, tokenizer=tokenizer, batch_size=4, progress=False
        )
    copies = 0
    for mine, theirs in zip(math, flash):
        torch.testing.assert_close(mine.scores, theirs.scores, **TOLERANCE)
        for a, b in zip(mine.paths, theirs.paths):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.weight == pytest.approx(b.weight, rel=1e-9)
                assert route(a) == route(b)
                copies += len(a.steps) - len(b.steps)
    assert copies > 0  # the math kernel's paths did take the layout copy


@on_cuda
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("S", SEMIRINGS, ids=[type(s).__name__ for s in SEMIRINGS])
def test_batched_attribution_on_cuda_equals_cpu(models, S, side, monkeypatch):
    """Scores, reached tokens, predictions and (max semirings) top-path weights of a padded
    batch on CUDA equal the CPU's."""
    cpu, cuda, tokenizer = models
    monkeypatch.setattr(tokenizer, "padding_side", side)
    runs = [
        sa.attribute(m, RECORDS, None, S, tokenizer=tokenizer, batch_size=4, progress=False)
        for m in (cpu, cuda)
    ]
    for on_cpu, on_cuda in zip(*runs):
        assert on_cuda.tokens == on_cpu.tokens
        assert on_cuda.scores.device.type == "cuda"
        torch.testing.assert_close(on_cuda.scores.cpu(), on_cpu.scores, **TOLERANCE)
        assert on_cuda.prediction.token == on_cpu.prediction.token
        assert on_cuda.prediction.target_logit == pytest.approx(
            on_cpu.prediction.target_logit, rel=1e-9
        )
        assert len(on_cuda.paths) == len(on_cpu.paths)
        for mine, theirs in zip(on_cuda.paths, on_cpu.paths):
            assert (mine is None) == (theirs is None)
            if mine is not None:
                assert mine.weight == pytest.approx(theirs.weight, rel=1e-9)
                assert route(mine) == route(theirs)


@on_cuda
@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Log()], ids=repr)
def test_one_text_on_cuda_equals_cpu(models, S):
    """``sa.attribute`` of one text (the tokenizer's tensors on the CPU, the model on
    CUDA) equals the CPU's, top paths included."""
    cpu, cuda, tokenizer = models
    found = [sa.attribute(m, "a cat sat", "table", S, tokenizer=tokenizer) for m in (cpu, cuda)]
    torch.testing.assert_close(found[1].scores.cpu(), found[0].scores, **TOLERANCE)
    for mine, theirs in zip(found[1].paths, found[0].paths):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert mine.weight == pytest.approx(theirs.weight, rel=1e-9)


@on_cuda
def test_attribute_dataset_on_cuda_writes_the_cpu_rows(models, tmp_path):
    """``sa.attribute_dataset`` with the model on CUDA writes the rows the CPU run writes
    (JSONL, so the test needs no pyarrow), an error row included."""
    cpu, cuda, tokenizer = models
    records = RECORDS + [{"text": "", "target": 3}]
    rows = {}
    for name, model in (("cpu", cpu), ("cuda", cuda)):
        out = sa.attribute_dataset(
            model,
            records,
            tmp_path / name,
            tokenizer=tokenizer,
            semirings=("max-product", "log"),
            batch_size=2,
            format="jsonl",
            progress=False,
        )
        rows[name] = [json.loads(line) for line in open(out)]
    assert len(rows["cuda"]) == len(rows["cpu"]) == len(records)
    for mine, theirs in zip(rows["cuda"], rows["cpu"]):
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            if isinstance(value, float) or (
                isinstance(value, list) and value and isinstance(value[0], float)
            ):
                assert mine[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
            else:
                assert mine[key] == value, key
    assert sum(row["error"] is not None for row in rows["cuda"]) == 1
