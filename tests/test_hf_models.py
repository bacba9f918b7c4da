"""Unmodified Hugging Face models (BERT, GPT-2, Llama) under every semiring.

Real-semiring messages w.r.t. ``inputs_embeds`` equal ``torch.autograd``; patched forwards
equal unpatched ones; every semiring's readouts satisfy the invariants that tie the
semirings together (all computed on the same graph):

* Boolean is true exactly where a path exists: where MaxProduct > 0, where Log and Counting
  are finite, and wherever the Real gradient is non-zero;
* MaxProduct ≤ exp(Log) ≤ exp(Counting) · MaxProduct (the total weight is at least the
  best path and at most #paths × the best path), compared in log space;
* max(|SignedMaxProduct.max|, |SignedMaxProduct.min|) = MaxProduct;
* 0 ≤ Entropy ≤ Counting (entropy of a distribution over n paths is at most log n);
* everything finite where a path exists (and the zeros' readouts where none does).
"""

from __future__ import annotations

import pytest
import torch
from model_zoo import TINY, minilm, smollm2, tiny_inputs, tiny_model
from torch import Tensor, nn

import semiring_autograd as sa
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

SEMIRINGS = [cls() for cls in BUILTIN_SEMIRINGS] + [sa.Real(formulas=True)]


def _logits(model: nn.Module, emb: Tensor, mask: Tensor) -> Tensor:
    out = model(inputs_embeds=emb, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _target(out: Tensor) -> Tensor:
    """The scalar traced back: the padded row's last position, component 1."""
    return out[1, 1] if out.dim() == 2 else out[1, -3, 1]


def readouts_of_every_semiring(
    model: nn.Module, emb: Tensor, mask: Tensor, target=_target
) -> dict[str, Tensor]:
    """Readout w.r.t. the input embeddings of ``target(output)`` under each semiring; each
    patched forward is checked to equal the unpatched one exactly."""
    with torch.no_grad():
        reference = _logits(model, emb, mask)
    results = {}
    for S in SEMIRINGS:
        x = emb.clone().requires_grad_()
        with sa.patch(model, S):
            out = _logits(model, x, mask)
        assert torch.equal(out, reference), f"{S!r}: patched forward differs"
        results[repr(S).replace("(formulas=True)", "-formulas").strip("()")] = sa.grad(
            target(out), x
        )
    return results


def assert_invariants(r: dict[str, Tensor], rtol: float, log_atol: float) -> None:
    real, boolean, best, log, count = (
        r["Real"],
        r["Boolean"],
        r["MaxProduct"],
        r["Log"],
        r["Counting"],
    )
    signed, entropy = r["SignedMaxProduct"], r["Entropy"]
    assert boolean.dtype == torch.bool
    assert boolean.any() and not boolean.all(), "the test needs elements with and without paths"
    assert torch.equal(boolean, best > 0), "Boolean vs MaxProduct > 0"
    assert torch.equal(boolean, torch.isfinite(log)), "Boolean vs finite Log"
    assert torch.equal(boolean, torch.isfinite(count)), "Boolean vs finite Counting"
    assert boolean[real != 0].all(), "a non-zero gradient without a path"
    for name, value in r.items():
        assert not torch.isnan(value.float()).any(), f"{name} has NaN"
    for name in ("Real", "MaxProduct", "SignedMaxProduct", "Entropy"):
        assert torch.isfinite(r[name]).all(), f"{name} not finite"
    b = boolean
    log_best = best[b].log()
    assert (log_best <= log[b] + log_atol + rtol * log[b].abs()).all(), "MaxProduct > exp(Log)"
    assert (
        log[b] <= count[b] + log_best + log_atol + rtol * log[b].abs()
    ).all(), "exp(Log) > exp(Counting) · MaxProduct"
    torch.testing.assert_close(
        torch.maximum(signed[0].abs(), signed[1].abs()), best, rtol=rtol, atol=0.0
    )
    assert (entropy >= 0).all(), "negative entropy"
    assert (entropy[~b] == 0).all(), "entropy where no path exists"
    assert (
        entropy[b] <= count[b] + log_atol + rtol * count[b].abs()
    ).all(), "Entropy > log(#paths)"


# ----------------------------------------------------------------------------- tiny models
@pytest.mark.parametrize("formulas", [False, True], ids=["torch-graph", "formulas"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(TINY))
def test_real_equals_autograd_and_forward_unchanged(name: str, attn: str, formulas: bool):
    model = tiny_model(name, attn)
    emb, mask = tiny_inputs(model)
    x_ref = emb.clone().requires_grad_()
    ref = _logits(model, x_ref, mask)
    x = emb.clone().requires_grad_()
    with sa.patch(model, sa.Real(formulas=formulas)):
        out = _logits(model, x, mask)
    assert torch.equal(out, ref)
    seed = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=ref.dtype)
    (want,) = torch.autograd.grad(ref, x_ref, seed)
    got = sa.grad(out, x, seed)
    assert want.abs().max() > 0
    # Llama's eager attention takes its softmax in float32 even in a float64 model: there the
    # two backward passes round differently (1e-8 relative); everything else is float64
    rtol = 1e-6 if (name, attn) == ("LlamaForCausalLM", "eager") else 1e-9
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(TINY))
def test_every_semiring_satisfies_the_invariants(name: str, attn: str):
    model = tiny_model(name, attn)
    emb, mask = tiny_inputs(model)
    r = readouts_of_every_semiring(model, emb, mask)
    assert_invariants(r, rtol=1e-9, log_atol=1e-9)
    # the padded row's target cannot see the other batch row, nor (BERT) its padded tokens
    assert not r["Boolean"][0].any()
    if name.startswith("Bert"):
        assert not r["Boolean"][1, -2:].any()


def test_sdpa_and_eager_attention_give_the_same_readouts():
    """The two attention implementations compute the same function by different ops (eager:
    matmul, +mask, softmax, matmul; sdpa: one op stated as that composition): every
    semiring must agree."""
    # Llama's eager softmax runs in float32 even in a float64 model
    for name, rtol in (("BertForMaskedLM", 1e-9), ("LlamaForCausalLM", 1e-6)):
        emb, mask = tiny_inputs(tiny_model(name))
        a = readouts_of_every_semiring(tiny_model(name, "sdpa"), emb, mask)
        b = readouts_of_every_semiring(tiny_model(name, "eager"), emb, mask)
        for key in a:
            atol = rtol * float(a[key].float().abs().max())
            torch.testing.assert_close(
                a[key], b[key], rtol=rtol, atol=atol, msg=lambda m: f"{name} {key}: {m}"
            )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_match_float32(dtype: torch.dtype):
    """A half-precision model carries float32 messages (documented): its readouts equal the
    float32 model's (same weights, rounded) within the precision of its forward."""
    base = tiny_model("LlamaForCausalLM", dtype=torch.float32)
    emb, mask = tiny_inputs(base)
    half = tiny_model("LlamaForCausalLM", dtype=torch.float32).to(dtype)
    full = tiny_model("LlamaForCausalLM", dtype=torch.float32).to(dtype).to(torch.float32)
    emb = emb.to(dtype)
    r_half = readouts_of_every_semiring(half, emb, mask)
    r_full = readouts_of_every_semiring(full, emb.to(torch.float32), mask)
    for name in ("MaxProduct", "SignedMaxProduct", "Entropy", "Counting", "Log", "Boolean"):
        assert r_half[name].dtype in (torch.float32, torch.bool), (name, r_half[name].dtype)
    assert torch.equal(r_half["Boolean"], r_full["Boolean"])
    assert torch.equal(r_half["Counting"], r_full["Counting"])
    # measured: bfloat16 within 1.1% (max-product), 0.01 (log, entropy); float16 ~20× closer
    scale = r_full["Real"].abs().max()
    torch.testing.assert_close(r_half["Real"].float(), r_full["Real"], rtol=0.05, atol=0.02 * scale)
    for name in ("MaxProduct", "SignedMaxProduct"):
        torch.testing.assert_close(
            r_half[name], r_full[name], rtol=0.03, atol=0.005 * r_full[name].abs().max()
        )
    for name in ("Log", "Entropy"):
        torch.testing.assert_close(r_half[name], r_full[name], rtol=0.003, atol=0.02)


def test_unsupported_op_in_a_model_fails_at_forward_and_leaves_it_unpatched():
    class Sine(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return torch.sin(x)

    model = tiny_model("BertForSequenceClassification")
    model.bert.encoder.layer[1].intermediate.intermediate_act_fn = Sine()
    emb, mask = tiny_inputs(model)
    x = emb.clone().requires_grad_()
    with pytest.raises(sa.UnsupportedOpError) as info:
        with sa.patch(model, sa.MaxProduct()):
            _logits(model, x, mask)
    message = str(info.value)
    assert "torch.sin" in message
    assert "bert.encoder.layer.1.intermediate.intermediate_act_fn" in message
    assert "derivatives/" in message
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    out = _logits(model, x, mask)  # unpatched: runs, with an ordinary graph
    assert out.grad_fn is not None and sa.node_info(out.grad_fn) is None
    with sa.patch(model, sa.Real()):  # and can be patched again
        pass


def test_attention_dropout_in_training_mode_is_refused_with_the_fix():
    model = tiny_model("BertForSequenceClassification").train()
    emb, mask = tiny_inputs(model)
    with pytest.raises(sa.UnsupportedOpError, match=r"dropout_p == 0"):
        with sa.patch(model, sa.Log()):
            _logits(model, emb.clone().requires_grad_(), mask)


# ----------------------------------------------------------------------------- pretrained
def _pretrained_checks(model: nn.Module, tokenizer, texts: list[str], target) -> None:
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    mask = enc["attention_mask"]
    with torch.no_grad():
        emb = model.get_input_embeddings()(enc["input_ids"])
    x_ref = emb.clone().requires_grad_()
    (want,) = torch.autograd.grad(target(_logits(model, x_ref, mask)), x_ref)
    r = readouts_of_every_semiring(model, emb, mask, target)
    scale = want.abs().max()
    assert scale > 0
    torch.testing.assert_close(r["Real"], want, rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(r["Real-formulas"], want, rtol=1e-4, atol=1e-5 * scale)
    assert_invariants(r, rtol=1e-4, log_atol=1e-3)


def test_minilm_pretrained():
    model, tokenizer = minilm()
    _pretrained_checks(
        model,
        tokenizer,
        ["The keys to the cabinet are on the table.", "The key is here."],
        lambda out: out[1, 0, 7],
    )


@pytest.fixture(scope="session")
def smollm2_model():
    return smollm2()


@pytest.mark.slow
def test_smollm2_pretrained(smollm2_model):
    model, tokenizer = smollm2_model
    (paris,) = tokenizer(" Paris")["input_ids"]
    texts = ["The capital of France is", "Hello"]
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    _pretrained_checks(model, tokenizer, texts, lambda out: out[1, -1, paris])
