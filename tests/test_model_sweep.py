"""The architecture sweep: a tiny random-weight model of every family in
:mod:`model_zoo` (text encoders and decoders, mixture of experts, state-space and hybrid
decoders, encoder-decoders, vision transformers and CNNs, speech), in float64, patched as a user would patch it. Per family,
on one output element's readout with respect to the model's float input:

* the patched forward equals the unpatched one;
* ``Real(formulas=True)`` equals ``torch.autograd.grad`` (rtol 1e-7, atol 1e-10; a family
  that computes a part in float32 at the tolerance its ``real_tolerance`` states) and is not
  zero everywhere;
* MaxProduct ≤ exp(Log) elementwise (the best path's weight is at most the sum of all
  paths' weights), and Boolean marks exactly the elements Counting counts paths from.
"""

from __future__ import annotations

import pytest
import torch
from model_zoo import FAMILIES, Family, build, model_input, score

import semiring_autograd as sa

FAMILY_IDS = [f.name for f in FAMILIES]


def _readout(model, family: Family, semiring) -> tuple[torch.Tensor, torch.Tensor]:
    key, x0, other = model_input(family, model, torch.float64)
    x = x0.clone().requires_grad_()
    with sa.patch(model, semiring):
        out = model(**{key: x}, **other)
    return score(out).detach(), sa.grad(score(out), x)


@pytest.mark.filterwarnings("ignore:sa.patch. the custom autograd.Function")
@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
def test_family(family: Family):
    model = build(family)
    key, x0, other = model_input(family, model, torch.float64)
    x = x0.clone().requires_grad_()
    want_score = score(model(**{key: x}, **other))
    want = torch.autograd.grad(want_score, x)[0]
    readouts = {}
    for semiring in (
        sa.Real(formulas=True),
        sa.MaxProduct(),
        sa.Log(),
        sa.Boolean(),
        sa.Counting(),
    ):
        got_score, readouts[type(semiring).__name__] = _readout(model, family, semiring)
        torch.testing.assert_close(got_score, want_score.detach(), rtol=0, atol=0)
    real = readouts["Real"]
    rtol, atol = family.real_tolerance
    torch.testing.assert_close(real, want, rtol=rtol, atol=atol)
    assert real.abs().max() > 0, "the readout does not depend on the input"
    best, total = readouts["MaxProduct"], readouts["Log"].exp()
    assert bool((best <= total * (1 + 1e-9) + 1e-300).all()), (best - total).max()
    assert torch.equal(readouts["Boolean"], readouts["Counting"] > 0)


def test_the_sweep_covers_the_families_asked_for():
    asked = {
        "bert",
        "roberta",
        "albert",
        "electra",
        "deberta-v2",
        "distilbert",
        "gpt2",
        "gpt-neox",
        "gpt-j",
        "opt",
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3",
        "phi",
        "phi3",
        "olmo2",
        "t5",
        "bart",
        "bloom",
        "falcon",
        "mixtral",
        "deepseek-v3",
        "llama4",
        "mamba",
        "falcon-h1",
        "vit",
        "swin",
        "convnext",
        "resnet",
        "clip-vision",
        "siglip-vision",
        "beit",
        "whisper",
        "segformer",
        "yolos",
    }
    assert asked <= set(FAMILY_IDS), sorted(asked - set(FAMILY_IDS))
    assert len(FAMILIES) >= 35
