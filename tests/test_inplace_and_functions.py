"""In-place tensor methods and custom autograd Functions inside a patched model.

An in-place method runs out of place under its op's formula and is written back, so a model
written with ``x.add_(y)`` or ``x /= s`` gets exactly the readouts of the same model written
out of place (itself checked against the oracles in the op table). A custom
``torch.autograd.Function`` runs as the ops of its forward: its readouts are those of its
forward written inline.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import semiring_autograd as sa
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

SEMIRINGS = [sa.Real(formulas=True)] + [cls() for cls in BUILTIN_SEMIRINGS] + [sa.KBest(2)]
#: the semirings that record semiring formulas (sa.Real() records torch's own graph)
FORMULA_SEMIRINGS = [s for s in SEMIRINGS if repr(s) != "Real()"]


def _x() -> torch.Tensor:
    return torch.linspace(-1.5, 2.0, 12, dtype=torch.float64).reshape(3, 4)


class _Residual(nn.Module):
    """h = W x; h += x; h *= σ(x); h /= h.sum(-1); h.masked_fill_; writes ``h[i] = v`` by a
    basic, a boolean and an advanced index; an index_add_ of h's rows into zeros (the
    mixture-of-experts pattern); written in place or out of place."""

    def __init__(self, inplace: bool):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 4).double()
        self.inplace = inplace

    def forward(self, x):
        h = self.linear(x)
        s = x.sigmoid()
        if self.inplace:
            h += x
            h.mul_(s)
            h /= h.sum(-1, keepdim=True)
            h.sub_(s, alpha=0.5)
            h.masked_fill_(x > 1.5, 0.0)
            h[:, 0] = s[:, 1]
            h[x < -1.0] = 0.25
            h[torch.tensor([2, 0]), 3:] = x[:2, :1] * 2
            out = torch.zeros(2, 4, dtype=x.dtype)
            out.index_add_(0, torch.tensor([1, 0, 1]), h)
        else:
            h = h + x
            h = h.mul(s)
            h = h / h.sum(-1, keepdim=True)
            h = h.sub(s, alpha=0.5)
            h = h.masked_fill(x > 1.5, 0.0)
            h = torch.cat([s[:, 1:2], h[:, 1:]], 1)
            h = h.masked_fill(x < -1.0, 0.25)
            last = torch.cat([(x[:2, :1] * 2)[1:], h[1:2, 3:], (x[:2, :1] * 2)[:1]])
            h = torch.cat([h[:, :3], last], 1)
            out = torch.zeros(2, 4, dtype=x.dtype).index_add(0, torch.tensor([1, 0, 1]), h)
        return out


def _readout(model: nn.Module, semiring) -> tuple[torch.Tensor, torch.Tensor]:
    x = _x().requires_grad_()
    with sa.patch(model, semiring):
        out = model(x)
    seed = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).reshape(out.shape)
    return out.detach(), sa.grad(out, x, seed=seed)


@pytest.mark.parametrize("semiring", SEMIRINGS, ids=repr)
def test_inplace_methods_equal_their_out_of_place_forms(semiring):
    out_a, got = _readout(_Residual(inplace=True), semiring)
    out_b, want = _readout(_Residual(inplace=False), semiring)
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-300)


def test_inplace_real_equals_torch_autograd():
    model = _Residual(inplace=True)
    _, got = _readout(model, sa.Real(formulas=True))
    x = _x().requires_grad_()
    out = model(x)
    seed = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).reshape(out.shape)
    torch.testing.assert_close(got, torch.autograd.grad(out, x, seed)[0], rtol=1e-12, atol=0)


class _Swish(torch.autograd.Function):
    """x·tanh(x) with a deliberately wrong backward: a patch must not use it."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        index = x.argmax(-1)
        ctx.mark_non_differentiable(index)
        return x * torch.tanh(x) * scale, index

    @staticmethod
    def backward(ctx, grad, _):
        raise AssertionError("the Function's own backward ran")


class _WithFunction(nn.Module):
    def __init__(self, inline: bool, function: type = _Swish):
        super().__init__()
        self.inline = inline
        self.function = function

    def forward(self, x):
        if self.inline:
            y = x * torch.tanh(x) * 0.5
        else:
            y, index = self.function.apply(x, 0.5)
            assert not index.requires_grad
        return y.exp()


@pytest.mark.filterwarnings("ignore:sa.patch. the custom autograd.Function")
@pytest.mark.parametrize("semiring", FORMULA_SEMIRINGS, ids=repr)
def test_custom_function_runs_as_its_forward_ops(semiring):
    _, got = _readout(_WithFunction(inline=False), semiring)
    _, want = _readout(_WithFunction(inline=True), semiring)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-300)


def test_custom_function_warns_once_and_apply_is_restored():
    class Fresh(_Swish):
        pass

    apply = torch.autograd.Function.__dict__["apply"]
    model = _WithFunction(inline=False, function=Fresh)
    for expected in (1, 0):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _readout(model, sa.MaxProduct())
        said = [w for w in caught if "Fresh runs as the ops of its forward" in str(w.message)]
        assert len(said) == expected
    assert torch.autograd.Function.__dict__["apply"] is apply
    with pytest.raises(ZeroDivisionError):
        with sa.patch(model, sa.MaxProduct()):
            model(_x().requires_grad_())
            raise ZeroDivisionError
    assert torch.autograd.Function.__dict__["apply"] is apply


def test_real_records_the_functions_own_backward():
    """Under sa.Real() (torch's own graph) a custom Function is torch's: its backward runs."""
    model = _WithFunction(inline=False)
    x = _x().requires_grad_()
    with sa.patch(model, sa.Real()):
        out = model(x)
    with pytest.raises(AssertionError, match="own backward ran"):
        sa.grad(out.sum(), x)


@pytest.mark.parametrize("semiring", [sa.MaxProduct(), sa.SignedMaxProduct()], ids=repr)
def test_paths_cross_inplace_writes(semiring):
    """A top path and the k best paths run through an in-place op's copy and write-back:
    the same weights as through the model written out of place."""
    found = []
    for inplace in (True, False):
        model = _Residual(inplace=inplace)
        x = _x().requires_grad_()
        with sa.patch(model, semiring, paths=True):
            out = model(x)
        best = sa.top_path(out[1, 2], x)
        three = sa.top_paths(out[1, 2], x, 3)
        found.append(([best.weight], [p.weight for p in three]))
    (best_a, three_a), (best_b, three_b) = found
    assert best_a == pytest.approx(best_b, rel=1e-12)
    assert three_a == pytest.approx(three_b, rel=1e-12)
