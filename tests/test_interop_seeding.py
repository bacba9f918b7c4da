"""``sa.seeding()``: a plain ``.backward()``, ``torch.autograd.backward`` or
``torch.autograd.grad`` over a patched forward starts from the semiring seed; the messages it
leaves equal path enumeration on a tiny MLP (Real: torch.autograd)."""

from __future__ import annotations

import functools

import pytest
import torch
from oracle import Program
from torch import nn

import semiring_autograd as sa
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

SEMIRINGS = [cls() for cls in BUILTIN_SEMIRINGS]
IDS = [type(s).__name__ for s in SEMIRINGS]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double().eval()


def _x() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, 5, dtype=torch.float64, generator=gen).requires_grad_()


def _enumerated(model: nn.Module, x: torch.Tensor, semiring, seed: torch.Tensor):
    first, last = model[0], model[2]
    p = Program(x=x)
    p.op("h", lambda x: x @ first.weight.detach().T + first.bias.detach(), "x")
    p.op("a", torch.tanh, "h")
    p.op("out", lambda a: a @ last.weight.detach().T + last.bias.detach(), "a")
    (value,) = p.path_sum(semiring, "out", seed, ["x"])
    return semiring.readout(value)


def _readout(message: torch.Tensor) -> torch.Tensor:
    semiring = getattr(message, "semiring", None)
    return message if semiring is None else semiring.readout(message.value)


def _weights() -> torch.Tensor:
    """Real seed weights: 2 at logit 1 of example 0, 0.5 at logit 2 of example 1."""
    w = torch.zeros(2, 3, dtype=torch.float64)
    w[0, 1], w[1, 2] = 2.0, 0.5
    return w


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
@pytest.mark.parametrize("call", ["Tensor.backward", "autograd.backward", "autograd.grad"])
def test_a_plain_backward_is_seeded_with_the_lifted_gradient(S, call):
    model, x = _mlp(), _x()
    with sa.patch(model, S):
        y = model(x)
    with sa.seeding():
        if call == "Tensor.backward":
            y.backward(_weights(), inputs=[x])
            got = x.grad
        elif call == "autograd.backward":
            torch.autograd.backward([y], [_weights()], inputs=[x])
            got = x.grad
        else:
            (got,) = torch.autograd.grad(y, x, _weights())
    want = _enumerated(model, x, S, _weights())
    torch.testing.assert_close(_readout(got), want, rtol=1e-12, atol=1e-14)
    if isinstance(S, sa.Real):
        plain = model(x)
        (autograd,) = torch.autograd.grad(plain, x, _weights())
        torch.testing.assert_close(got, autograd, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
def test_without_a_gradient_every_element_starts_a_path_with_the_seed(S):
    """A non-scalar output with no gradient given: lift(seed) everywhere (1 when the
    block's seed is None), as sa.grad seeds; a scalar's ``.backward()`` likewise."""
    model, x = _mlp(), _x()
    with sa.patch(model, S):
        y = model(x)
    with sa.seeding(_weights()):
        (got,) = torch.autograd.grad(y, [x])
    want = _enumerated(model, x, S, _weights())
    torch.testing.assert_close(_readout(got), want, rtol=1e-12, atol=1e-14)
    with sa.patch(model, S):
        total = model(x)[:, 1].sum()
    with sa.seeding():
        total.backward()
    ones = torch.zeros(2, 3, dtype=torch.float64)
    ones[:, 1] = 1.0
    want = _enumerated(model, x, S, ones)
    torch.testing.assert_close(_readout(x.grad), want, rtol=1e-12, atol=1e-14)


def test_messages_and_unpatched_graphs_pass_through_unchanged():
    """sa.grad (whose seeds are messages) gives the same inside the block, and a graph
    recorded outside any patch runs torch's own backward there."""
    model, x = _mlp(), _x()
    with sa.patch(model, sa.Log()):
        y = model(x)
    want = sa.grad(y, x, _weights(), retain_graph=True)
    with sa.seeding():
        torch.testing.assert_close(sa.grad(y, x, _weights()), want, rtol=0, atol=0)
        plain = model(x)
        (got,) = torch.autograd.grad(plain, x, _weights())
    (autograd,) = torch.autograd.grad(model(x), x, _weights())
    torch.testing.assert_close(got, autograd, rtol=0, atol=0)


def test_a_plain_backward_outside_the_block_is_refused_naming_the_seed():
    model, x = _mlp(), _x()
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    with pytest.raises(sa.SemiringMismatchError, match="plain tensor"):
        y.sum().backward()


def test_a_seed_of_another_shape_is_refused():
    model, x = _mlp(), _x()
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    with pytest.raises(ValueError, match=r"seed has shape \(3,\) but the output has shape"):
        with sa.seeding(torch.ones(3, dtype=torch.float64)):
            y.backward()


def test_a_wrapped_tensor_backward_is_seeded(monkeypatch):
    """Another library's wrapper of ``Tensor.backward`` (nnsight installs one on import)
    is seeded as torch's own, and runs."""
    original = torch.Tensor.backward
    calls = []

    @functools.wraps(original)
    def wrapper(tensor, *args, **kwargs):
        calls.append(tensor)
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", wrapper)
    model, x = _mlp(), _x()
    with sa.patch(model, sa.Log()):
        y = model(x)
    with sa.seeding():
        y.backward(_weights(), inputs=[x])
    want = _enumerated(model, x, sa.Log(), _weights())
    torch.testing.assert_close(_readout(x.grad), want, rtol=1e-12, atol=1e-14)
    assert calls and calls[0] is y


def test_several_outputs_are_seeded_each():
    """``torch.autograd.grad([y0, y1], x)`` with no gradients seeds every element of both
    with one; a gradient given for one output is lifted, and None for the other is one, as
    torch's implicit gradient."""
    model, x = _mlp(), _x()
    with sa.patch(model, sa.Log()):
        y = model(x)
    first, second = y[:, 1], y[:, 2]
    with sa.seeding():
        (got,) = torch.autograd.grad([first, second], x, retain_graph=True)
        (weighted,) = torch.autograd.grad(
            [first, second], x, [torch.tensor([2.0, 0.5], dtype=torch.float64), None]
        )
    seed = torch.zeros(2, 3, dtype=torch.float64)
    seed[:, 1:] = 1.0
    want = _enumerated(model, x, sa.Log(), seed)
    torch.testing.assert_close(_readout(got), want, rtol=1e-12, atol=1e-14)
    seed[:, 1] = torch.tensor([2.0, 0.5])
    want = _enumerated(model, x, sa.Log(), seed)
    torch.testing.assert_close(_readout(weighted), want, rtol=1e-12, atol=1e-14)
