"""sa.frozen_weights: lifted weight operands kept per weight version, equal to the
uncached path, rebuilt after a tracked in-place write, dropped when the scope exits."""

from __future__ import annotations

import pytest
import torch

import semiring_autograd as sa
from semiring_autograd.kernels.workspace import is_scratch
from semiring_autograd.semirings.entropy import _entropy_weights
from semiring_autograd.semirings.frozen import kept_operand

SEMIRINGS = [sa.Log, sa.Counting, sa.Entropy]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)
    )
    with torch.no_grad():
        model[2].weight[1, 2] = 0.0  # a zero entry: Counting's and Entropy's special case
    return model.eval()


def _grad(model: torch.nn.Module, semiring, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaf = x.clone().requires_grad_(True)
    with sa.patch(model, semiring):
        out = model(leaf)
    return tuple(sa.grad(out[:, 1].sum(), leaf, raw=True).value)


def _assert_same(a: tuple, b: tuple) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("make", SEMIRINGS, ids=lambda m: m.__name__)
def test_values_equal_uncached_path(make):
    model, x = _model(), torch.randn(3, 6)
    plain = _grad(model, make(), x)
    with sa.frozen_weights(model):
        first = _grad(model, make(), x)
        again = _grad(model, make(), x)
    _assert_same(first, plain)
    _assert_same(again, plain)


def test_log_values_against_path_sums():
    """Log through the last two (linear) layers: log Σ_paths Π|w| = log(|W3| |W2|)[1, j]."""
    model = _model()
    h = torch.randn(2, 5)
    tail = torch.nn.Sequential(model[2], model[3])
    leaf = h.clone().requires_grad_(True)
    with sa.frozen_weights(model):
        for _ in range(2):
            with sa.patch(tail, sa.Log()):
                out = tail(leaf)
            got = sa.grad(out[:, 1].sum(), leaf)
    w2, w3 = (m.weight.detach().double().abs() for m in (model[2], model[3]))
    expected = torch.log(w3 @ w2)[1].expand(2, 5).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", SEMIRINGS, ids=lambda m: m.__name__)
def test_tracked_in_place_write_rebuilds(make):
    model, x = _model(), torch.randn(3, 6)
    with sa.frozen_weights(model):
        before = _grad(model, make(), x)
        with torch.no_grad():
            model[2].weight.mul_(-3.0)  # bumps the version counter
            model[3].weight[1, 0] = 0.0  # Counting sees only zeros
        after = _grad(model, make(), x)
    fresh = _grad(model, make(), x)
    _assert_same(after, fresh)
    assert not all(torch.equal(a, b) for a, b in zip(before, after))


@torch.no_grad()  # as in a backward
def test_operand_kept_per_version_and_dropped_on_exit():
    w = torch.nn.Parameter(torch.randn(4, 3))
    log = sa.Log()
    assert is_scratch(log.linear_lift(w))
    with sa.frozen_weights([w]):
        first = log.linear_lift(w)
        assert not is_scratch(first) and log.linear_lift(w) is first
        torch.testing.assert_close(first, w.detach().abs(), rtol=0, atol=0)
        pair = _entropy_weights(w)
        assert _entropy_weights(w) is pair
        torch.testing.assert_close(pair[:4], w.detach().abs(), rtol=0, atol=0)
        w.add_(1.0)
        rebuilt = log.linear_lift(w)
        assert rebuilt is not first
        torch.testing.assert_close(rebuilt, w.detach().abs(), rtol=0, atol=0)
        assert is_scratch(log.linear_lift(torch.randn(4, 3)))  # not declared
        assert is_scratch(log.linear_lift(w.detach().clone()))  # other storage
    assert is_scratch(log.linear_lift(w))


def test_not_kept_under_vmap_or_a_dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    w = torch.randn(4, 3)
    log = sa.Log()
    with sa.frozen_weights([w]):
        with Passing():
            assert is_scratch(log.linear_lift(w))
        seen = []
        torch.vmap(lambda v: seen.append(kept_operand("abs", v, torch.abs)) or v)(w[None])
        assert seen == [None]
        assert log.linear_lift(w) is log.linear_lift(w)


def test_nested_scopes_and_bad_input():
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    log = sa.Log()
    with sa.frozen_weights([a]):
        with sa.frozen_weights(b):
            assert log.linear_lift(a) is log.linear_lift(a)
            assert log.linear_lift(b) is log.linear_lift(b)
        assert is_scratch(log.linear_lift(b))
        assert not is_scratch(log.linear_lift(a))
    with pytest.raises(TypeError, match="frozen_weights takes modules, tensors"):
        with sa.frozen_weights(3):
            pass
