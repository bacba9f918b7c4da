"""Complex numbers inside a patched model: a complex element is two nodes of the gradient
graph, its real and imaginary parts. Llama 4's rotary embedding (``view_as_complex`` of real
pairs, a product by constant unit complex numbers, ``view_as_real``) equals path
enumeration through the same map on real pairs, its edges from ``torch.autograd``'s real
Jacobian, under every semiring; ``sa.Real()`` is torch's own complex autograd. Any other
use of a complex tensor requiring grad under semiring formulas is refused at forward,
naming the op, the module and the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_checks import assert_value_close, random_cotangent, raw_value
from oracle import Program
from torch import Tensor, nn
from user_semirings import Tropical

import semiring_autograd as sa
from semiring_autograd.semirings import BUILTIN_SEMIRINGS, Semiring

SEMIRINGS = (
    [sa.Real(formulas=True)] + [cls() for cls in BUILTIN_SEMIRINGS] + [sa.KBest(2), Tropical()]
)
RTOL, ATOL = 1e-7, 1e-9  # against the oracle (tests/test_ops_oracle.py's)


def _rotate(h: Tensor, freqs: Tensor, left: bool) -> Tensor:
    """Llama 4's rotary embedding of ``h``'s feature pairs (the frequencies on either
    side of the product)."""
    pairs = torch.view_as_complex(h.reshape(*h.shape[:-1], -1, 2))
    turned = pairs * freqs if left else freqs * pairs
    return torch.view_as_real(turned).flatten(-2)


class _Rotary(nn.Module):
    """``y = tanh(rotate(W x + b)) · rotate(…)`` over (batch, pos, feature); ``freqs`` unit
    complex numbers per position and pair, broadcast over the batch."""

    def __init__(self, left: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 4).double()
        angles = torch.linspace(0.1, 2.0, 6, dtype=torch.float64).reshape(3, 2)
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles))
        self.left = left

    def forward(self, x: Tensor) -> Tensor:
        r = _rotate(self.proj(x), self.freqs, self.left)
        return torch.tanh(r) * r


def _x() -> Tensor:
    return torch.linspace(-1.5, 2.0, 24, dtype=torch.float64).reshape(2, 3, 4)


@pytest.mark.parametrize("left", [True, False], ids=["pairs_times_freqs", "freqs_times_pairs"])
@pytest.mark.parametrize("S", SEMIRINGS, ids=repr)
def test_complex_rotary_equals_path_enumeration(S: Semiring, left: bool):
    model = _Rotary(left)
    x = _x().requires_grad_()
    ref = model(x)
    with sa.patch(model, S):
        out = model(x)
    assert torch.equal(out, ref), "the patched forward differs from the unpatched one"
    seed = random_cotangent(out.shape, torch.Generator().manual_seed(5))
    raw = sa.grad(out, x, seed=seed, raw=True, retain_graph=True)
    if isinstance(S, sa.Real):
        (want,) = torch.autograd.grad(ref, x, seed)
        torch.testing.assert_close(raw_value(S, raw, x)[0], want, rtol=1e-10, atol=1e-12)
    weight, bias = model.proj.weight.detach(), model.proj.bias.detach()
    p = Program(x=x)
    p.op("h", lambda x: F.linear(x, weight, bias), "x")
    p.op("r", lambda h: _rotate(h, model.freqs, left), "h")
    p.op("a", torch.tanh, "r")
    p.op("out", torch.mul, "a", "r")
    expected = p.path_sum(S, "out", seed, ["x"])[0]
    assert_value_close(raw_value(S, raw, x), expected, "raw value vs oracle", RTOL, ATOL)
    torch.testing.assert_close(
        sa.grad(out, x, seed=seed), S.readout(expected), rtol=RTOL, atol=ATOL
    )


def test_complex_rotary_under_real_is_torch_autograd():
    """Under ``sa.Real()`` the complex ops are torch's own."""
    model = _Rotary()
    x = _x().requires_grad_()
    ref = model(x)
    seed = random_cotangent(ref.shape, torch.Generator().manual_seed(3))
    (want,) = torch.autograd.grad(ref, x, seed)
    with sa.patch(model, sa.Real()):
        out = model(x)
    assert torch.equal(out, ref)
    torch.testing.assert_close(sa.grad(out, x, seed=seed), want, rtol=1e-12, atol=1e-14)


def _pairs(h: Tensor) -> Tensor:
    return torch.view_as_complex(h.reshape(3, 2, 2))


#: (what the net does with the projection h, the op the refusal names)
REFUSED = {
    "cast": (lambda h: torch.view_as_real(h.to(torch.complex128)), "torch.Tensor.to"),
    "real_times_complex": (
        lambda h: torch.view_as_real(h * torch.full((4,), 1j, dtype=torch.complex128)),
        "torch.Tensor.mul",
    ),
    "abs_of_pairs": (lambda h: _pairs(h).abs(), "torch.Tensor.abs"),
    "pairs_times_pairs": (lambda h: torch.view_as_real(_pairs(h) * _pairs(h)), "mul"),
    "pairs_plus_one": (lambda h: torch.view_as_real(_pairs(h) + 1), "torch.Tensor.add"),
}


@pytest.mark.parametrize("S", [sa.Real(formulas=True), sa.MaxProduct(), sa.Entropy()], ids=repr)
@pytest.mark.parametrize("name", list(REFUSED))
def test_other_complex_ops_are_refused_with_the_fix(name: str, S: Semiring):
    make, op = REFUSED[name]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4).double()

        def forward(self, x: Tensor) -> Tensor:
            return make(self.proj(x))

    model = Net()
    x = torch.linspace(-1.5, 2.0, 12, dtype=torch.float64).reshape(3, 4).requires_grad_()
    with pytest.raises(sa.UnsupportedOpError, match="complex") as info:
        with sa.patch(model, S):
            model(x)
    message = str(info.value)
    assert op in message and "(in module 'Net')" in message, message
    assert "rotate_half" in message and "sa.Real()" in message
    assert "forward" not in model.__dict__
