"""granularity="tensor" (the paper's max-gradient) against an op-by-op evaluation of the
small models' programs with dense Jacobians (tests/oracle.tensor_level)."""

from __future__ import annotations

import pytest
import torch
from oracle import tensor_level
from small_models import MODELS, setup_model

import semiring_autograd as sa

RTOL, ATOL = 1e-10, 1e-14


def _run(name: str, semiring, element):
    model, x0, program = setup_model(name)
    x = x0.clone().requires_grad_()
    with sa.patch(model, semiring):
        out = model(x)
    seed = torch.zeros_like(out)
    seed[element] = 1.0
    return out, x, program, seed


@pytest.mark.parametrize("element", [(1, 2), (0, 0)])
@pytest.mark.parametrize("name", list(MODELS))
def test_tensor_max_product_is_the_op_by_op_max_gradient(name, element):
    out, x, program, seed = _run(name, sa.MaxProduct(granularity="tensor"), element)
    got = sa.grad(out[element], x)
    want, _ = tensor_level(program, "out", seed, "x", signed=False)
    torch.testing.assert_close(got.reshape(-1), want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("element", [(1, 2), (0, 0)])
@pytest.mark.parametrize("name", list(MODELS))
def test_tensor_signed_max_product_is_the_op_by_op_pair(name, element):
    out, x, program, seed = _run(name, sa.SignedMaxProduct(granularity="tensor"), element)
    got = sa.grad(out[element], x)
    hi, lo = tensor_level(program, "out", seed, "x", signed=True)
    assert got.shape == (2, *x.shape)
    torch.testing.assert_close(got[0].reshape(-1), hi, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got[1].reshape(-1), lo, rtol=RTOL, atol=ATOL)


def test_tensor_level_differs_from_element_level_inside_a_matmul():
    """y = x @ w read as Σ_j y[1, j]: tensor level sums over j inside the matmul (Σ_j |w|),
    element level takes the best path (max_j |w|)."""
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64)

    class M(torch.nn.Module):
        def forward(self, t):
            return t @ w

    want = {"tensor": w.abs().sum(1), "element": w.abs().amax(1)}
    for granularity, expected in want.items():
        model = M()
        with sa.patch(model, sa.MaxProduct(granularity=granularity)):
            y = model(x)
        torch.testing.assert_close(sa.grad(y[1].sum(), x)[1], expected, rtol=1e-12, atol=0)


def test_tensor_level_options_and_refusals():
    assert repr(sa.MaxProduct(granularity="tensor")) == "MaxProduct(granularity='tensor')"
    assert sa.MaxProduct(granularity="element") == sa.MaxProduct()
    assert sa.MaxProduct(granularity="tensor") != sa.MaxProduct()
    with pytest.raises(ValueError, match="granularity"):
        sa.SignedMaxProduct(granularity="node")
    sa.check_semiring(sa.MaxProduct(granularity="tensor"))
    sa.check_semiring(sa.SignedMaxProduct(granularity="tensor"))
    model, x0, _ = setup_model("mlp")
    x = x0.clone().requires_grad_()
    with sa.patch(model, sa.MaxProduct(granularity="tensor"), paths=True):
        out = model(x)
    with pytest.raises(sa.SemiringAutogradError, match="top paths need"):
        sa.top_path(out[1, 2], x)


class _MergeThenMix(torch.nn.Module):
    """h = g W₁ is read twice (a merge: its pair's ends differ); its message crosses g W₁
    (signed weights mix the ends) and must be put back in order before crossing g = x W₀."""

    def __init__(self, w0: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w0, self.w1, self.w2 = w0, w1, w2

    def forward(self, x):
        h = (x @ self.w0) @ self.w1
        return (torch.tanh(h) + h * 0.5) @ self.w2


@pytest.mark.parametrize("signed", [True, False])
def test_tensor_level_after_a_merge(signed: bool):
    from oracle import Program

    gen = torch.Generator().manual_seed(5)
    x0 = torch.randn(2, 3, dtype=torch.float64, generator=gen)
    w0 = torch.randn(3, 3, dtype=torch.float64, generator=gen)
    w1 = torch.randn(3, 4, dtype=torch.float64, generator=gen)
    w2 = torch.randn(4, 3, dtype=torch.float64, generator=gen)
    program = Program(x=x0, w0=w0, w1=w1, w2=w2)
    program.op("g", torch.matmul, "x", "w0")
    program.op("h", torch.matmul, "g", "w1")
    program.op("t", torch.tanh, "h")
    program.op("hh", lambda h: h * 0.5, "h")
    program.op("s", torch.add, "t", "hh")
    program.op("out", torch.matmul, "s", "w2")
    model = _MergeThenMix(w0, w1, w2)
    semiring = (
        sa.SignedMaxProduct(granularity="tensor") if signed else sa.MaxProduct(granularity="tensor")
    )
    for element in [(0, 0), (1, 2)]:
        x = x0.clone().requires_grad_()
        with sa.patch(model, semiring):
            out = model(x)
        seed = torch.zeros_like(out)
        seed[element] = 1.0
        hi, lo = tensor_level(program, "out", seed, "x", signed=signed)
        got = sa.grad(out[element], x)
        if signed:
            torch.testing.assert_close(got[0].reshape(-1), hi, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(got[1].reshape(-1), lo, rtol=RTOL, atol=ATOL)
        else:
            torch.testing.assert_close(got.reshape(-1), hi, rtol=RTOL, atol=ATOL)


def test_attribute_refuses_tensor_level():
    with pytest.raises(ValueError, match="real sum used inside ops"):
        sa.attribute(torch.nn.Identity(), "text", 0, sa.SignedMaxProduct(granularity="tensor"))
