"""What the op-table tests share: the op as a module, random cotangents, and comparing a raw
``sa.grad`` result with an oracle's semiring value."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

import semiring_autograd as sa
from semiring_autograd.semirings import Semiring, Value
from semiring_autograd.ops.message import Message


class Apply(nn.Module):
    """The op under test as a module: forward(*inputs) = fn(*inputs)."""

    def __init__(self, fn: Callable[..., Any]):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs: Tensor) -> Any:
        return self.fn(*inputs)


def random_cotangent(shape: torch.Size, g: torch.Generator) -> Tensor:
    """A random real cotangent with no zeros: float64 entries of magnitude in [0.5, 1.5),
    both signs."""
    magnitude = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
    sign = torch.randint(0, 2, shape, generator=g).to(torch.float64) * 2 - 1
    return magnitude * sign


def raw_value(S: Semiring, message: Tensor | None, like: Tensor) -> Value:
    """The semiring value of a raw ``sa.grad`` result (None: no path, the zero)."""
    if message is None:
        return S.zero(like.shape, like.detach())
    assert message.shape == like.shape, (message.shape, like.shape)
    if isinstance(message, Message):
        assert message.semiring == S
        return message.value
    assert isinstance(S, sa.Real), f"raw result for {S!r} is a plain {type(message).__name__}"
    return (message,)


def assert_value_close(
    actual: Value, expected: Value, what: str, rtol: float, atol: float, equal_nan: bool = False
) -> None:
    """Component by component, ``torch.testing.assert_close`` at the given tolerances."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} components, want {len(expected)}"
    for k, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(
            a,
            e,
            rtol=rtol,
            atol=atol,
            equal_nan=equal_nan,
            msg=lambda m: f"{what}, component {k}: {m}",
        )
