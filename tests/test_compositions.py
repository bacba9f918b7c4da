"""Small models vs explicit scalar-path enumeration, for every built-in semiring.

Each model is an ``nn.Module`` written with ordinary torch ops; its oracle is the same
composition written as a :class:`Program` of elementary ops (granularity per torch op: a
``linear`` is one op whose Jacobian gives edges from input and weight elements, a softmax is
one op, …). One output element is seeded (a single 1, zeros elsewhere: a zero seed starts no
path) and every path from it to the input and to the weights is enumerated.
"""

from __future__ import annotations

import math
from functools import lru_cache

import pytest
import torch
import torch.nn.functional as F
from oracle import Program
from torch import Tensor, nn

import semiring_autograd as sa
from semiring_autograd.semirings import Semiring, Value

RTOL, ATOL = 1e-7, 1e-9
SEMIRINGS = [cls() for cls in sa.BUILTIN_SEMIRINGS]
SEMIRING_IDS = [type(s).__name__ for s in SEMIRINGS]


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
SEEDED = [(1, 2), (0, 0)]


@lru_cache(maxsize=None)
def _setup(name: str) -> tuple[nn.Module, Tensor, Program]:
    cls, shape, build, _ = MODELS[name]
    torch.manual_seed(7)
    model = cls().double()
    x = torch.randn(*shape, dtype=torch.float64)
    return model, x, build(model, x)


def _raw_value(S: Semiring, message: Tensor | None, like: Tensor) -> Value:
    """The semiring value of a raw ``sa.grad`` result (None: no path, the zero)."""
    if message is None:
        return S.zero(like.shape, like)
    assert message.shape == like.shape, (message.shape, like.shape)
    if isinstance(message, sa.Message):
        return message.value
    assert isinstance(S, sa.Real), f"raw result for {S!r} is a plain {type(message).__name__}"
    return (message,)


@pytest.mark.parametrize("S", SEMIRINGS, ids=SEMIRING_IDS)
@pytest.mark.parametrize("element", SEEDED, ids=[f"out{e}" for e in SEEDED])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_against_path_enumeration(name: str, element: tuple[int, int], S: Semiring):
    model, x0, program = _setup(name)
    weight_specs = MODELS[name][3]
    weights = [model.get_parameter(attr) for attr, _ in weight_specs]
    x = x0.clone().requires_grad_()
    with sa.patch(model, S):
        out = model(x)
    assert torch.equal(out, model(x0)), "the patched forward differs from the unpatched one"
    torch.testing.assert_close(out.detach(), program.values["out"], rtol=1e-13, atol=0)

    seed = torch.zeros_like(out)
    seed[element] = 1.0
    targets = [x, *weights]
    raw = sa.grad(out, targets, seed=seed, raw=True, retain_graph=True)
    readouts = sa.grad(out, targets, seed=seed)
    expected = program.path_sum(S, "out", seed, ["x", *(n for _, n in weight_specs)])
    labels = ["x", *(attr for attr, _ in weight_specs)]
    for label, target, message, readout, want in zip(labels, targets, raw, readouts, expected):
        got = _raw_value(S, message, target)
        assert len(got) == len(want)
        for k, (a, e) in enumerate(zip(got, want)):
            torch.testing.assert_close(
                a, e, rtol=RTOL, atol=ATOL, msg=lambda m: f"{label} component {k}: {m}"
            )
        torch.testing.assert_close(
            readout, S.readout(want), rtol=RTOL, atol=ATOL, msg=lambda m: f"{label} readout: {m}"
        )

    if isinstance(S, sa.Real):
        native = torch.autograd.grad(model(x), targets, seed)
        for label, message, g in zip(labels, raw, native):
            torch.testing.assert_close(
                message, g, rtol=1e-10, atol=1e-12, msg=lambda m: f"{label} vs autograd: {m}"
            )


@pytest.mark.parametrize("name", list(MODELS))
def test_path_counts_are_nontrivial(name: str):
    """The enumerated graphs are what the docstring says: many paths, several per element."""
    _, _, program = _setup(name)
    counts = program.count_paths("out", 1 * program.values["out"].shape[1] + 2, "x")
    assert sum(counts) > 150 and max(counts) > 50
