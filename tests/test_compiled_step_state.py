"""The model state a compiled step keys its programs by, where the module tree shares a
settings object or holds an empty submodule slot: each test changes the state after the
program was captured and checked, and asserts the next call equals the eager run of the
same call bit for bit (the oracle: ``sa.patch`` + ``sa.grad``, itself checked elsewhere)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

import semiring_autograd as sa
from semiring_autograd.engine.compiled import backward as compiled_backward

SEMIRING = sa.MaxProduct()


@pytest.fixture(autouse=True)
def _fresh():
    compiled_backward.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield
    compiled_backward.clear()


class _Settings:
    """Settings several modules hold and read, as a Hugging Face config."""

    def __init__(self) -> None:
        self.scale = 2.0
        self.shift = 0.5


class _Scaled(nn.Module):
    def __init__(self, settings: _Settings, reads: str) -> None:
        super().__init__()
        self.settings = settings
        self.reads = reads
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * getattr(self.settings, self.reads)


class _Pair(nn.Module):
    """Two layers holding one settings object; an optional third layer."""

    def __init__(self) -> None:
        super().__init__()
        shared = _Settings()
        self.first = _Scaled(shared, "scale")
        self.second = _Scaled(shared, "shift")
        self.extra: nn.Module | None = nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        x = self.second(self.first(x))
        return x if self.extra is None else self.extra(x)


def _read(m: nn.Module, x: Tensor) -> Tensor:
    return m(x)[:, 0].sum()


def _x(seed: int) -> Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check(step, model: nn.Module, seed: int) -> None:
    x = _x(seed)
    got = step(x.clone().requires_grad_(True))
    y = x.clone().requires_grad_(True)
    with sa.patch(model, SEMIRING):
        out = _read(model, y)
    expected = sa.grad(out, y)
    assert got.dtype == expected.dtype and bool((got == expected).all()), (got, expected)


def _captured_step(model: nn.Module):
    step = sa.compiled_step(model, SEMIRING, _read)
    for seed in range(3):  # a capture, the checked first replay, a replay
        _check(step, model, seed)
    assert compiled_backward.stats()["replays"] >= 2
    return step


@pytest.mark.parametrize("name", ["scale", "shift"])
def test_a_setting_of_a_shared_config_changed_after_capture(name):
    """Either holder of a shared settings object reads the changed value."""
    torch.manual_seed(0)
    model = _Pair().double()
    step = _captured_step(model)
    setattr(model.first.settings, name, -3.0)
    _check(step, model, 10)
    captures = compiled_backward.stats()["captures"]
    assert captures == 2, captures


def test_a_submodule_removed_after_capture():
    """A submodule slot set to None (the module tree changed) is captured anew."""
    torch.manual_seed(0)
    model = _Pair().double()
    step = _captured_step(model)
    model.extra = None
    _check(step, model, 10)
    assert compiled_backward.stats()["captures"] == 2


@pytest.mark.parametrize("raw", [False, True])
def test_a_replay_returns_ordinary_tensors(raw):
    """A replay runs in inference mode; what it returns is an ordinary tensor: written in
    place and used under autograd outside it, with the eager run's values."""
    torch.manual_seed(0)
    model = _Pair().double()
    step = sa.compiled_step(model, SEMIRING, _read, raw=raw)
    for seed in range(3):
        found = step(_x(seed).requires_grad_(True))
    assert compiled_backward.stats()["replays"] >= 2
    tensors = found.value if raw else (found,)
    for t in tensors:
        assert not t.is_inference()
        expected = t.clone()
        t.add_(1.0)  # (an inference tensor refuses this outside inference mode)
        assert torch.equal(t, expected + 1.0)
        w = torch.ones_like(t, requires_grad=True)
        (w * t).sum().backward()
        assert torch.equal(w.grad, t)
