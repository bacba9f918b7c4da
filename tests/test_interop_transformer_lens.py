"""TransformerLens under ``sa.patch``. ``TransformerBridge`` (built offline around a tiny
random GPT-2, and a tiny Llama): its readouts, with ``run_with_hooks`` edits, equal the unwrapped Hugging Face
model's with the same edit made by a plain PyTorch hook (Real also torch.autograd's), and
``run_with_cache(incl_bwd=True)`` inside ``sa.seeding()`` caches the semiring messages that
``sa.grad`` gives at the same activations. A ``HookedRootModule`` (TransformerLens' way to
hook any module): an edit in a hook and ``incl_bwd`` on a non-scalar output, against path
enumeration."""

from __future__ import annotations

import functools

import pytest
import torch
from oracle import Program
from torch import nn

import semiring_autograd as sa
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

transformers = pytest.importorskip("transformers")
bridge_module = pytest.importorskip("transformer_lens.model_bridge")
hook_points = pytest.importorskip("transformer_lens.hook_points")
hooked_root = pytest.importorskip("transformer_lens.HookedRootModule")

SEMIRINGS = [cls() for cls in BUILTIN_SEMIRINGS]
IDS = [type(s).__name__ for s in SEMIRINGS]
HEAD, D_HEAD = 2, 4
#: activations whose incl_bwd gradients are compared (hook_z is cached after a reshape of
#: the bridge's own tensor, so a forward hook does not see the tensor on the graph)
CACHED = ["blocks.0.hook_out", "blocks.1.attn.hook_pattern", "blocks.1.ln2.hook_out"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the Hugging Face GPT-2, the TransformerBridge around it), float64, no download."""
    config = transformers.GPT2Config(
        vocab_size=50,
        n_embd=16,
        n_layer=2,
        n_head=4,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).double().eval()
    folder = tmp_path_factory.mktemp("gpt2")
    config.save_pretrained(folder)  # the bridge reads the config; the weights are hf's
    bridge = bridge_module.TransformerBridge.boot_transformers(
        str(folder), hf_model=hf, tokenizer=None, dtype=torch.float64
    )
    return hf, bridge


def _ids() -> torch.Tensor:
    return torch.tensor([[1, 7, 3, 9, 4]])


def _ablate_in_place(z: torch.Tensor, hook) -> torch.Tensor:
    z[:, :, HEAD] = 0.0
    return z


def _ablate_out_of_place(z: torch.Tensor, hook) -> torch.Tensor:
    keep = torch.ones(z.shape[-2:], dtype=z.dtype)
    keep[HEAD] = 0.0
    return z * keep


def _hf_ablation(module, args):
    """The same ablation on the unwrapped model: head HEAD's columns of the input of the
    attention's output projection."""
    keep = torch.ones(args[0].shape[-1], dtype=args[0].dtype)
    keep[HEAD * D_HEAD : (HEAD + 1) * D_HEAD] = 0.0
    return (args[0] * keep,)


def _bridge_readout(bridge, semiring, emb, hooks):
    """Logits and the readout of logit 3 at the last position w.r.t. the embeddings."""
    leaf = emb.clone().requires_grad_()
    put = [("embed.hook_out", lambda e, hook: leaf)]
    with sa.patch(bridge, semiring):
        logits = bridge.run_with_hooks(_ids(), fwd_hooks=put + hooks)
    return logits.detach(), sa.grad(logits[0, -1, 3], leaf)


def _hf_readout(hf, semiring, emb, o_proj):
    """The same readout of the Hugging Face model with the ablation made by a pre-hook on
    the attention's output projection ``o_proj`` (``semiring=None``: torch.autograd,
    unpatched)."""
    leaf = emb.clone().requires_grad_()
    handle = o_proj.register_forward_pre_hook(_hf_ablation)
    try:
        if semiring is None:
            logits = hf(inputs_embeds=leaf).logits
            return logits.detach(), torch.autograd.grad(logits[0, -1, 3], leaf)[0]
        with sa.patch(hf, semiring):
            logits = hf(inputs_embeds=leaf).logits
    finally:
        handle.remove()
    return logits.detach(), sa.grad(logits[0, -1, 3], leaf)


def _check_ablation(hf, bridge, o_proj, semiring, ablate) -> None:
    """The bridge's readout with ``ablate`` on layer 0's hook_z equals the unwrapped
    model's with the pre-hook ablation (Real: torch.autograd's too)."""
    emb = hf.get_input_embeddings()(_ids()).detach()
    hooks = [("blocks.0.attn.hook_z", ablate)]
    logits, got = _bridge_readout(bridge, semiring, emb, hooks)
    want_logits, want = _hf_readout(hf, semiring, emb, o_proj)
    torch.testing.assert_close(logits, want_logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    if isinstance(semiring, sa.Real):
        _, autograd = _hf_readout(hf, None, emb, o_proj)
        torch.testing.assert_close(got, autograd, rtol=1e-10, atol=1e-12)
    assert "forward" not in vars(bridge) and "forward" not in vars(hf)  # the patch is gone


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
@pytest.mark.parametrize("edit", ["in place", "out of place"])
def test_run_with_hooks_edits_equal_the_unwrapped_model(models, S, edit):
    hf, bridge = models
    ablate = _ablate_in_place if edit == "in place" else _ablate_out_of_place
    _check_ablation(hf, bridge, hf.transformer.h[0].attn.c_proj, S, ablate)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(a tiny Llama: rotary, grouped-query attention; its TransformerBridge), float64,
    with a word-level tokenizer built in memory (the bridge loads one for Llama)."""
    tokenizers = pytest.importorskip("tokenizers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).double().eval()
    words = ["<unk>", "<pad>"] + [f"w{i}" for i in range(30)]
    inner = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    inner.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=inner, unk_token="<unk>", pad_token="<pad>"
    )
    folder = tmp_path_factory.mktemp("llama")
    config.save_pretrained(folder)
    bridge = bridge_module.TransformerBridge.boot_transformers(
        str(folder), hf_model=hf, tokenizer=tokenizer, dtype=torch.float64
    )
    return hf, bridge


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
def test_llama_bridge_head_ablation_equals_the_unwrapped_model(llama, S):
    hf, bridge = llama
    _check_ablation(hf, bridge, hf.model.layers[0].self_attn.o_proj, S, _ablate_in_place)


def _readout(message: torch.Tensor) -> torch.Tensor:
    """A message's readout (a Real gradient is a plain tensor)."""
    semiring = getattr(message, "semiring", None)
    return message if semiring is None else semiring.readout(message.value)


def _keep(cache: dict, tensor: torch.Tensor, hook, name: str) -> None:
    cache[name] = tensor


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
def test_incl_bwd_caches_the_semiring_messages(models, S):
    """TransformerLens calls ``loss.backward()`` itself; inside ``sa.seeding()`` that
    backward starts from the semiring's one, and each ``<name>_grad`` of the cache is the
    message sa.grad computes at that activation (Real: TransformerLens' own gradients)."""
    _, bridge = models
    with sa.patch(bridge, S), sa.seeding():
        loss, cache = bridge.run_with_cache(
            _ids(), return_type="loss", incl_bwd=True, names_filter=CACHED
        )
    acts: dict = {}
    hooks = [(name, functools.partial(_keep, acts, name=name)) for name in CACHED]
    with sa.patch(bridge, S):
        again = bridge.run_with_hooks(_ids(), return_type="loss", fwd_hooks=hooks)
    want = sa.grad(again, [acts[name] for name in CACHED])
    torch.testing.assert_close(loss.detach(), again.detach(), rtol=0, atol=0)
    for name, expected in zip(CACHED, want):
        torch.testing.assert_close(_readout(cache[name + "_grad"]), expected)
    if isinstance(S, sa.Real):
        _, theirs = bridge.run_with_cache(
            _ids(), return_type="loss", incl_bwd=True, names_filter=CACHED
        )
        for name in CACHED:
            torch.testing.assert_close(cache[name + "_grad"], theirs[name + "_grad"])
    bridge.zero_grad(set_to_none=True)  # the parameters' .grad hold messages


def test_incl_bwd_without_seeding_is_refused(models):
    _, bridge = models
    with sa.patch(bridge, sa.MaxProduct()):
        with pytest.raises(sa.SemiringMismatchError, match="plain tensor"):
            bridge.run_with_cache(_ids(), return_type="loss", incl_bwd=True, names_filter=CACHED)
    bridge.zero_grad(set_to_none=True)


class _HookedMLP(hooked_root.HookedRootModule):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(5, 4)
        self.hook_pre = hook_points.HookPoint()
        self.down = nn.Linear(4, 3)
        self.setup()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.hook_pre(self.up(x))))


def _enumerated(model: _HookedMLP, x: torch.Tensor, semiring, seed, cut: int | None):
    """The readout at x over every path of the MLP's scalar graph, hidden unit ``cut``
    (before the tanh) set to 0: no edge into it."""
    keep = torch.ones(4, dtype=x.dtype)
    if cut is not None:
        keep[cut] = 0.0
    up, down = model.up, model.down
    p = Program(x=x)
    p.op("h", lambda x: x @ up.weight.detach().T + up.bias.detach(), "x")
    p.op("c", lambda h: h * keep, "h")
    p.op("a", torch.tanh, "c")
    p.op("out", lambda a: a @ down.weight.detach().T + down.bias.detach(), "a")
    (value,) = p.path_sum(semiring, "out", seed, ["x"])
    return semiring.readout(value)


def _cut_unit_2(h: torch.Tensor, hook) -> torch.Tensor:
    h[:, 2] = 0.0
    return h


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
def test_hooked_root_module_edit_and_incl_bwd_are_path_enumeration(S):
    torch.manual_seed(0)
    model = _HookedMLP().double()
    x = torch.randn(2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    seed = torch.zeros(2, 3, dtype=torch.float64)
    seed[0, 1], seed[1, 2] = 1.0, 1.0
    leaf = x.clone().requires_grad_()
    with sa.patch(model, S):
        out = model.run_with_hooks(leaf, fwd_hooks=[("hook_pre", _cut_unit_2)])
    want = _enumerated(model, x, S, seed, cut=2)
    torch.testing.assert_close(sa.grad(out, leaf, seed), want, rtol=1e-12, atol=1e-14)
    leaf = x.clone().requires_grad_()
    with sa.patch(model, S), sa.seeding(seed):  # the logits are not a scalar: seed them
        _, cache = model.run_with_cache(leaf, incl_bwd=True)
    want = _enumerated(model, x, S, seed, cut=None)
    torch.testing.assert_close(_readout(leaf.grad), want, rtol=1e-12, atol=1e-14)
    assert set(cache) == {"hook_pre", "hook_pre_grad"}
    model.zero_grad(set_to_none=True)
