"""A PEFT LoRA model under ``sa.patch``, on one device and dispatched by ``accelerate``: its
readouts equal path enumeration over the LoRA graph (each adapted layer is the base linear
plus ``scaling · B(A(x))``: two sets of paths), Real equals torch.autograd, and a LoRA
Hugging Face model gives torch.autograd's gradient under ``sa.Real()``."""

from __future__ import annotations

import copy

import pytest
import torch
from oracle import Program
from torch import nn

import semiring_autograd as sa
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
accelerate = pytest.importorskip("accelerate")

SEMIRINGS = [cls() for cls in BUILTIN_SEMIRINGS]
IDS = [type(s).__name__ for s in SEMIRINGS]


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(5, 4)
        self.act = nn.Tanh()
        self.down = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def _lora_mlp() -> nn.Module:
    """The MLP with rank-2 LoRA adapters on both linears, random A and B (B is not 0)."""
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["up", "down"], lora_dropout=0.0, init_lora_weights=False
    )
    return peft.get_peft_model(_MLP().double(), config).eval()


def _lora(program: Program, out: str, layer: nn.Module, arg: str) -> None:
    """``out = base(arg) + scaling · B(A(arg))`` of a LoRA linear, op by op."""
    base, a = layer.base_layer, layer.lora_A["default"]
    b, scaling = layer.lora_B["default"], layer.scaling["default"]
    program.op(out + ".base", lambda t: t @ base.weight.detach().T + base.bias.detach(), arg)
    program.op(out + ".a", lambda t: t @ a.weight.detach().T, arg)
    program.op(out + ".b", lambda t: t @ b.weight.detach().T, out + ".a")
    program.op(out + ".scaled", lambda t: t * scaling, out + ".b")
    program.op(out, torch.add, out + ".base", out + ".scaled")


def _enumerated(model: nn.Module, x: torch.Tensor, semiring, seed: torch.Tensor):
    inner = model.base_model.model
    p = Program(x=x)
    _lora(p, "h", inner.up, "x")
    p.op("a", torch.tanh, "h")
    _lora(p, "out", inner.down, "a")
    (value,) = p.path_sum(semiring, "out", seed, ["x"])
    return semiring.readout(value)


def _x() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, 5, dtype=torch.float64, generator=gen).requires_grad_()


def _seed() -> torch.Tensor:
    seed = torch.zeros(2, 3, dtype=torch.float64)
    seed[0, 1], seed[1, 2] = 1.0, 1.0
    return seed


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
@pytest.mark.parametrize("placement", ["one device", "cpu_offload"])
def test_lora_readouts_are_path_enumeration(S, placement):
    model = _lora_mlp()
    x = _x()
    want = _enumerated(model, x, S, _seed())
    plain = model(x).detach()
    if placement == "cpu_offload":  # weights on the meta device, loaded by hooks per call
        model = accelerate.cpu_offload(copy.deepcopy(model), torch.device("cpu"))
        assert model.base_model.model.up.base_layer.weight.is_meta
    with sa.patch(model, S):
        y = model(x)
    torch.testing.assert_close(y.detach(), plain, rtol=0, atol=0)
    torch.testing.assert_close(sa.grad(y, x, _seed()), want, rtol=1e-12, atol=1e-14)
    if isinstance(S, sa.Real):
        (autograd,) = torch.autograd.grad(_lora_mlp()(x), x, _seed())
        torch.testing.assert_close(want, autograd, rtol=1e-12, atol=1e-14)


def test_lora_llama_under_real_is_torch_autograd():
    """A tiny Llama with LoRA on q_proj and v_proj: Real equals torch.autograd, and the
    strongest path (MaxProduct) weighs at most all paths together (exp of Log)."""
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).double().eval()
    lora = peft.LoraConfig(
        r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    model = peft.get_peft_model(base, lora).eval()
    emb = base.get_input_embeddings()(torch.tensor([[3, 1, 4, 1, 5]])).detach()
    ours = emb.clone().requires_grad_()
    with sa.patch(model, sa.MaxProduct()):
        logits = model(inputs_embeds=ours).logits
    top = sa.grad(logits[0, -1, 7], ours)
    ours = emb.clone().requires_grad_()
    with sa.patch(model, sa.Real()):
        logits = model(inputs_embeds=ours).logits
    got = sa.grad(logits[0, -1, 7], ours)
    theirs = emb.clone().requires_grad_()
    (want,) = torch.autograd.grad(model(inputs_embeds=theirs).logits[0, -1, 7], theirs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # the strongest path's weight is at most the total weight of all paths
    leaf = emb.clone().requires_grad_()
    with sa.patch(model, sa.Log()):
        logits = model(inputs_embeds=leaf).logits
    total = sa.grad(logits[0, -1, 7], leaf)
    assert bool((top <= total.exp() * (1 + 1e-12)).all())
