"""Small models written with ordinary torch ops, each with the same composition as a
:class:`Program` of elementary ops (the oracle's granularity: one torch op, one op)."""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F
from oracle import Program
from torch import Tensor, nn

import semiring_autograd as sa


class TinyMLP(nn.Module):
    """3 → 4 → 4 → 4 → 3 with tanh, one 4×4 weight used twice and a residual branch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.mid = nn.Linear(4, 4, bias=False)
        self.fc2 = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.mid(h))
        h = self.mid(h)
        return torch.tanh(self.fc2(h)) + x


class OneHeadAttention(nn.Module):
    """softmax(q kᵀ / √d) v, then an output projection; x is (tokens, d)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.d = d
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(0, 1) / math.sqrt(self.d)
        return self.o(torch.softmax(scores, dim=-1) @ v)


def _mlp_program(model: TinyMLP, x: Tensor) -> Program:
    p = Program(
        x=x,
        w1=model.fc1.weight,
        b1=model.fc1.bias,
        wm=model.mid.weight,
        w2=model.fc2.weight,
        b2=model.fc2.bias,
    )
    p.op("a1", F.linear, "x", "w1", "b1")
    p.op("h1", torch.tanh, "a1")
    p.op("a2", F.linear, "h1", "wm")
    p.op("h2", torch.tanh, "a2")
    p.op("a3", F.linear, "h2", "wm")
    p.op("a4", F.linear, "a3", "w2", "b2")
    p.op("t", torch.tanh, "a4")
    p.op("out", torch.add, "t", "x")
    return p


def _attention_program(model: OneHeadAttention, x: Tensor) -> Program:
    params = {}
    for name in "qkvo":
        layer = getattr(model, name)
        params[f"w{name}"], params[f"b{name}"] = layer.weight, layer.bias
    p = Program(x=x, **params)
    for name in "qkv":
        p.op(name, F.linear, "x", f"w{name}", f"b{name}")
    p.op("kt", lambda k: k.transpose(0, 1), "k")
    p.op("s0", torch.matmul, "q", "kt")
    p.op("s", lambda s0: s0 / math.sqrt(model.d), "s0")
    p.op("p", lambda s: torch.softmax(s, dim=-1), "s")
    p.op("ctx", torch.matmul, "p", "v")
    p.op("out", F.linear, "ctx", "wo", "bo")
    return p


MODELS = {
    # name: (model class, input shape, program builder, (weight attribute, program name)...)
    "mlp": (TinyMLP, (2, 3), _mlp_program, (("mid.weight", "wm"), ("fc1.weight", "w1"))),
    "attention": (
        OneHeadAttention,
        (3, 4),
        _attention_program,
        (("q.weight", "wq"), ("v.weight", "wv")),
    ),
}


@lru_cache(maxsize=None)
def setup_model(name: str) -> tuple[nn.Module, Tensor, Program]:
    """The model ``name`` of :data:`MODELS` in float64 (seed 7), an input, its program."""
    cls, shape, build, _ = MODELS[name]
    torch.manual_seed(7)
    model = cls().double()
    x = torch.randn(*shape, dtype=torch.float64)
    return model, x, build(model, x)


def flat_index(index: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """The row-major flat position of ``index`` in a tensor of ``shape``."""
    flat = 0
    for i, size in zip(index, shape):
        flat = flat * size + i
    return flat


def record_with_paths(name: str, semiring):
    """The model ``name``'s forward under ``sa.patch(model, semiring, paths=True)`` on a
    fresh leaf copy of its input: (output, input, program)."""
    model, x, program = setup_model(name)
    x = x.clone().requires_grad_()
    with sa.patch(model, semiring, paths=True):
        out = model(x)
    return out, x, program
