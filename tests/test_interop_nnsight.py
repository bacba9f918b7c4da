"""nnsight's ``NNsight`` and ``LanguageModel`` wrappers under ``sa.patch``: patching the
wrapper patches the module it runs, and its calls and traces (interventions included) give
the readouts of the unwrapped model — path enumeration on a tiny MLP, the patched Hugging
Face model (Real: torch.autograd) for a tiny GPT-2 fed ``inputs_embeds``; inside
``sa.seeding()`` a ``with loss.backward():`` block reads the semiring messages."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from oracle import Program
from torch import nn

import semiring_autograd as sa
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

transformers = pytest.importorskip("transformers")
nnsight = pytest.importorskip("nnsight")
tokenizers = pytest.importorskip("tokenizers")

SEMIRINGS = [cls() for cls in BUILTIN_SEMIRINGS]
IDS = [type(s).__name__ for s in SEMIRINGS]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double().eval()


def _enumerated(model: nn.Module, x: torch.Tensor, semiring, seed, cut: int | None = None):
    """The readout at x by enumerating every path of the MLP's scalar graph; ``cut``: a
    hidden unit set to 0 before the tanh (no edge into it)."""
    first, last = model[0], model[2]
    keep = torch.ones(4, dtype=x.dtype)
    if cut is not None:
        keep[cut] = 0.0
    p = Program(x=x)
    p.op("h", lambda x: x @ first.weight.detach().T + first.bias.detach(), "x")
    p.op("c", lambda h: h * keep, "h")
    p.op("a", torch.tanh, "c")
    p.op("out", lambda a: a @ last.weight.detach().T + last.bias.detach(), "a")
    (value,) = p.path_sum(semiring, "out", seed, ["x"])
    return semiring.readout(value)


def _x() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, 5, dtype=torch.float64, generator=gen).requires_grad_()


def _seed() -> torch.Tensor:
    seed = torch.zeros(2, 3, dtype=torch.float64)
    seed[:, 1] = 1.0
    return seed


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
def test_nnsight_wrapper_is_patched_as_its_module(S):
    model = _mlp()
    wrapper = nnsight.NNsight(model)
    x = _x()
    forwards = [vars(m).get("forward") for m in model.modules()]  # nnsight's own wrappers
    want = _enumerated(model, x, S, _seed())
    with sa.patch(wrapper, S):
        called = wrapper(x)
    torch.testing.assert_close(sa.grad(called, x, _seed()), want, rtol=1e-12, atol=1e-14)
    with sa.patch(wrapper, S):
        with wrapper.trace(x):
            traced = wrapper.output.save()
    torch.testing.assert_close(traced.detach(), model(x).detach(), rtol=0, atol=0)
    torch.testing.assert_close(sa.grad(traced, x, _seed()), want, rtol=1e-12, atol=1e-14)
    assert [vars(m).get("forward") for m in model.modules()] == forwards


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
def test_an_intervention_in_a_trace_removes_the_paths_it_cuts(S):
    """``wrapper[0].output[:, 2] = 0`` inside the trace: no path through hidden unit 2."""
    model = _mlp()
    wrapper = nnsight.NNsight(model)
    x = _x()
    with sa.patch(wrapper, S):
        with wrapper.trace(x):
            wrapper[0].output[:, 2] = 0.0
            out = wrapper.output.save()
    want = _enumerated(model, x, S, _seed(), cut=2)
    torch.testing.assert_close(sa.grad(out, x, _seed()), want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
def test_gradients_read_in_a_backward_block_are_the_semiring_messages(S):
    """nnsight's ``with loss.backward(): g = h.grad.save()`` inside ``sa.seeding()``: the
    message reaching the first layer's output, against path enumeration from there."""
    model = _mlp()
    wrapper = nnsight.NNsight(model)
    x = _x()
    with sa.patch(wrapper, S), sa.seeding():
        with wrapper.trace(x):
            hidden = wrapper[0].output.save()
            out = wrapper.output
            with out[:, 1].sum().backward():
                message = hidden.grad.save()
    last = model[2]
    p = Program(h=hidden.detach())
    p.op("a", torch.tanh, "h")
    p.op("out", lambda a: a @ last.weight.detach().T + last.bias.detach(), "a")
    (value,) = p.path_sum(S, "out", _seed(), ["h"])
    got = message if isinstance(S, sa.Real) else message.semiring.readout(message.value)
    torch.testing.assert_close(got, S.readout(value), rtol=1e-12, atol=1e-14)
    model.zero_grad(set_to_none=True)  # the parameters' .grad hold messages


def _tokenizer() -> "transformers.PreTrainedTokenizerFast":
    """A word-level tokenizer of words w0 … w47, built in memory (nothing is downloaded)."""
    words = ["<unk>", "<pad>"] + [f"w{i}" for i in range(48)]
    inner = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    inner.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=inner, unk_token="<unk>", pad_token="<pad>"
    )


@pytest.fixture(scope="module")
def language_model():
    config = transformers.GPT2Config(
        vocab_size=50, n_embd=16, n_layer=2, n_head=4, n_positions=16, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).double().eval()
    with warnings.catch_warnings():  # nnsight names TransformersModel as its successor
        warnings.filterwarnings("ignore", message="LanguageModel is deprecated")
        wrapped = nnsight.LanguageModel(hf, tokenizer=_tokenizer())
    return hf, wrapped


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
def test_language_model_with_inputs_embeds_equals_the_unwrapped_model(language_model, S):
    """A batch of two texts' embeddings (nnsight splits the batch it is given and reads each
    example's part of it) through ``LanguageModel.trace(inputs_embeds=...)``."""
    hf, wrapped = language_model
    ids = torch.tensor([[2, 9, 4, 11, 3], [5, 8, 8, 1, 7]])
    emb = hf.transformer.wte(ids).detach()
    ours = emb.clone().requires_grad_()
    with sa.patch(wrapped, S):
        with wrapped.trace(inputs_embeds=ours):
            logits = wrapped.output.logits.save()
    theirs = emb.clone().requires_grad_()
    if isinstance(S, sa.Real):
        want_logits = hf(inputs_embeds=theirs).logits
        want = torch.autograd.grad(want_logits[:, -1, 3].sum(), theirs)[0]
    else:
        with sa.patch(hf, S):
            want_logits = hf(inputs_embeds=theirs).logits
        want = sa.grad(want_logits[:, -1, 3], theirs)
    torch.testing.assert_close(logits.detach(), want_logits.detach(), rtol=0, atol=0)
    got = sa.grad(logits[:, -1, 3], ours)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_language_model_text_input_runs_patched(language_model):
    """A text prompt through the wrapper's tokenizer: the same logits as the model's own
    call on the token ids, and a readout at the embedding layer's output."""
    hf, wrapped = language_model
    with sa.patch(wrapped, sa.Log()):
        with wrapped.trace("w1 w7 w3"):
            embedded = wrapped.transformer.wte.output.save()
            logits = wrapped.output.logits.save()
    ids = torch.tensor([[3, 9, 5]])  # w1, w7, w3 after <unk> and <pad>
    torch.testing.assert_close(logits.detach(), hf(ids).logits.detach(), rtol=0, atol=0)
    leaf = hf.transformer.wte(ids).detach().requires_grad_()
    with sa.patch(hf, sa.Log()):
        want_logits = hf(inputs_embeds=leaf).logits
    want = sa.grad(want_logits[0, -1, 2], leaf)
    torch.testing.assert_close(sa.grad(logits[0, -1, 2], embedded), want, rtol=1e-10, atol=1e-12)


def test_an_object_that_is_no_module_nor_wrapper_is_refused():
    with pytest.raises(sa.PatchError, match="expects an nn.Module, got SimpleNamespace"):
        sa.patch(types.SimpleNamespace(_module="not a module"), sa.MaxProduct())
