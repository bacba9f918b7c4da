"""Each op's Function runs a ``setup`` and a ``backward`` written out for its plan
(``ops/function.py``): every generated module's are made and compile, and the cases their
sources branch on (one input with a formula, several, a tensor list, part of the inputs
requested) give the readouts of the semiring's definition."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import semiring_autograd as sa
from semiring_autograd.generated import MODULES
from semiring_autograd.ops.function import _specialised_backward, _specialised_setup


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_op_of_every_module_has_its_written_setup_and_backward(module: str):
    for name, record in MODULES[module].FUNCTIONS.items():
        function = record.__self__
        assert callable(_specialised_setup(function)), name
        assert callable(_specialised_backward(function)), name


class _Cat(nn.Module):
    """out = w · cat(3a, b², c) summed: a list op, a several-input op (mul.Tensor), and
    one-input ops (mul.Scalar, pow)."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = w

    def forward(self, a, b, c):
        return (torch.cat([a * 3.0, b.pow(2), c]) * self.w).sum()


def _inputs() -> tuple[torch.Tensor, ...]:
    a = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([2.0, -0.25, 1.5], dtype=torch.float64, requires_grad=True)
    c = torch.tensor([-3.0], dtype=torch.float64, requires_grad=True)
    return a, b, c


W = torch.tensor([1.5, -2.0, 0.5, 4.0, -1.0, 0.25], dtype=torch.float64)


@pytest.mark.parametrize("wanted", [(0,), (2,), (0, 2), (0, 1, 2)])
def test_real_formulas_of_part_of_the_inputs_equal_torch_autograd(wanted):
    a, b, c = _inputs()
    model = _Cat(W)
    with sa.patch(model, sa.Real(formulas=True)):
        out = model(a, b, c)
    inputs = [(a, b, c)[i] for i in wanted]
    got = sa.grad(out, inputs)
    got = got if isinstance(got, tuple) else (got,)
    fresh = _inputs()
    want = torch.autograd.grad(model(*fresh), [fresh[i] for i in wanted])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-15)


@pytest.mark.parametrize("wanted", [(0,), (1,), (2,), (0, 2)])
def test_max_product_of_part_of_the_inputs_is_the_product_of_its_path(wanted):
    """Each input element reaches the sum by one path: the MaxProduct readout is the product
    of the path's |local derivatives|: 3·|w| for a, |2b|·|w| for b, |w| for c."""
    a, b, c = _inputs()
    model = _Cat(W)
    with sa.patch(model, sa.MaxProduct()):
        out = model(a, b, c)
    inputs = [(a, b, c)[i] for i in wanted]
    got = sa.grad(out, inputs)
    got = got if isinstance(got, tuple) else (got,)
    w = W.abs()
    paths = (3.0 * w[:2], (2 * b.detach()).abs() * w[2:5], w[5:])
    for g, i in zip(got, wanted):
        torch.testing.assert_close(g, paths[i], rtol=0, atol=1e-15)


def test_a_traceback_through_a_written_backward_shows_its_source_lines():
    import traceback

    module = MODULES[sorted(MODULES)[0]]
    function = next(iter(module.FUNCTIONS.values())).__self__
    backward = _specialised_backward(function)

    class Bare:  # a ctx without the semiring the backward reads first
        pass

    with pytest.raises(AttributeError) as raised:
        backward(Bare(), None)
    text = "".join(traceback.format_exception(raised.value))
    assert f"<semiring_autograd {function.__module__}.{function.__qualname__}.backward>" in text
    assert "S = ctx.semiring" in text
