"""Self-tests of the brute-force oracles in ``oracle.py`` (no library formulas involved):
with the Real semiring they must equal torch.autograd, the two oracles must agree with each
other in every semiring, and small hand-computed cases come out as the mathematics says."""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from op_checks import random_cotangent
from oracle import Program, merge_positions, op_oracle
from torch import Tensor

from semiring_autograd.semirings import (
    BUILTIN_SEMIRINGS,
    Counting,
    Entropy,
    Log,
    MaxProduct,
    Real,
)
from semiring_autograd.semirings import Semiring

ALL = [cls() for cls in BUILTIN_SEMIRINGS]
IDS = [type(s).__name__ for s in ALL]


def _randn(*shape: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _seed_like(out: Tensor, seed: int) -> Tensor:
    return random_cotangent(out.shape, torch.Generator().manual_seed(seed))


FUNCTIONS: list[tuple[str, Callable[..., Tensor], list[Tensor]]] = [
    ("matmul", torch.matmul, [_randn(2, 3, 4, seed=1), _randn(4, 2, seed=2)]),
    ("mul_broadcast", torch.mul, [_randn(3, 1, seed=3), _randn(2, 1, 4, seed=4)]),
    ("softmax", lambda x: torch.softmax(x, -1), [_randn(3, 4, seed=5)]),
    ("sum_dim", lambda x: x.sum(0), [_randn(3, 4, seed=6)]),
    ("sum_all", lambda x: x.sum(), [_randn(3, 4, seed=7)]),
    ("layer_norm", lambda x: F.layer_norm(x, (4,)), [_randn(3, 4, seed=8)]),
    ("transposed_arg", lambda x, y: x.exp() * y, [_randn(4, 3, seed=9).t(), _randn(3, 4, seed=10)]),
]


@pytest.mark.parametrize("name, fn, args", FUNCTIONS, ids=[f[0] for f in FUNCTIONS])
def test_op_oracle_real_is_vjp(name: str, fn: Callable[..., Tensor], args: list[Tensor]):
    seed = _seed_like(fn(*args), 11)
    _, vjps = torch.autograd.functional.vjp(fn, tuple(args), seed)
    for value, vjp in zip(op_oracle(Real(), fn, args, seed), vjps):
        torch.testing.assert_close(value[0], vjp, rtol=1e-12, atol=1e-14)
    ones = torch.ones_like(seed)
    _, vjps = torch.autograd.functional.vjp(fn, tuple(args), ones)
    for value, vjp in zip(op_oracle(Real(), fn, args, None), vjps):
        torch.testing.assert_close(value[0], vjp, rtol=1e-12, atol=1e-14)


def test_merge_positions_same_tensor_twice():
    x = _randn(3, 4, seed=12).requires_grad_()
    seed = _seed_like(x, 13)
    (expected,) = torch.autograd.grad(x * x, x, seed)
    values = op_oracle(Real(), torch.mul, [x, x], seed)
    (merged,) = merge_positions(Real(), values, [0, 0])
    torch.testing.assert_close(merged[0], expected, rtol=1e-12, atol=1e-14)


def _mlp_program() -> tuple[Program, Callable[..., Tensor]]:
    """A small composition with a reused weight, a residual branch and a shared tensor."""
    x, w1, w2 = _randn(2, 3, seed=20), _randn(3, 3, seed=21), _randn(3, 3, seed=22)

    def reference(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
        h = torch.tanh(F.linear(x, w1))
        g = torch.tanh(F.linear(h, w2))
        return torch.softmax(F.linear(g, w2) + x * h, -1)

    p = Program(x=x, w1=w1, w2=w2)
    p.op("a", F.linear, "x", "w1")
    p.op("h", torch.tanh, "a")
    p.op("b", F.linear, "h", "w2")
    p.op("g", torch.tanh, "b")
    p.op("c", F.linear, "g", "w2")
    p.op("r", torch.mul, "x", "h")
    p.op("s", torch.add, "c", "r")
    p.op("y", lambda s: torch.softmax(s, -1), "s")
    return p, reference


def test_path_enumeration_real_is_autograd():
    p, reference = _mlp_program()
    leaves = [p.values[n].clone().requires_grad_() for n in ("x", "w1", "w2")]
    out = reference(*leaves)
    torch.testing.assert_close(out, p.values["y"], rtol=0, atol=0)
    seed = _seed_like(out, 23)
    expected = torch.autograd.grad(out, leaves, seed)
    for value, grad in zip(p.path_sum(Real(), "y", seed, ["x", "w1", "w2"]), expected):
        torch.testing.assert_close(value[0], grad, rtol=1e-12, atol=1e-14)


def test_counting_is_number_of_paths():
    p, _ = _mlp_program()
    seed = torch.zeros(2, 3, dtype=torch.float64)
    seed[1, 2] = 1.0
    flat_index = 1 * 3 + 2
    for target in ("x", "w2"):
        (value,) = p.path_sum(Counting(), "y", seed, [target])
        counts = torch.tensor(p.count_paths("y", flat_index, target), dtype=torch.float64)
        torch.testing.assert_close(value[0].reshape(-1), counts.log(), rtol=1e-12, atol=0)
    (x_count,) = p.path_sum(Counting(), "y", seed, ["x"])
    assert torch.isneginf(x_count[0][0]).all()  # the other batch row: no path
    assert torch.isfinite(x_count[0][1]).all()


@pytest.mark.parametrize("S", ALL, ids=IDS)
def test_oracles_agree_on_a_single_op(S: Semiring):
    x, w = _randn(2, 3, seed=30), _randn(4, 3, seed=31)
    seed = _seed_like(torch.zeros(2, 4), 32)
    seed[0, 1] = 0.0  # a zero seed starts no path
    p = Program(x=x, w=w)
    p.op("y", F.linear, "x", "w")
    for a, b in zip(p.path_sum(S, "y", seed, ["x", "w"]), op_oracle(S, F.linear, [x, w], seed)):
        for ca, cb in zip(a, b):
            torch.testing.assert_close(ca, cb, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "S, twice, doubled",
    [
        (Real(), 2.0, 2.0),
        (MaxProduct(), 2.0, 1.0),
        (Log(), math.log(2.0), math.log(2.0)),
        (Counting(), 0.0, math.log(2.0)),
        (Entropy(), 0.0, math.log(2.0)),
    ],
    ids=["Real", "MaxProduct", "Log", "Counting", "Entropy"],
)
def test_granularity_two_x_versus_x_plus_x(S: Semiring, twice: float, doubled: float):
    """y = 2x is one edge of weight 2; y = x + x is two parallel edges of weight 1."""
    x = _randn(3, seed=40)
    one_edge = Program(x=x)
    one_edge.op("y", lambda x: 2 * x, "x")
    two_edges = Program(x=x)
    two_edges.op("y", torch.add, "x", "x")
    for program, expected in ((one_edge, twice), (two_edges, doubled)):
        (value,) = program.path_sum(S, "y", None, ["x"])
        readout = S.readout(value)
        torch.testing.assert_close(readout, torch.full_like(readout, expected))
