"""Ops marked ``real_backward: native``: the Real Function runs torch's own backward.

Checked against ``torch.autograd.grad`` in float64: repeated arguments (self-attention on one
tensor), unrequested inputs, ``retain_graph``; and the YAML formulas these ops keep for every
other semiring still give torch's gradient when run with real arithmetic through the generic
module (a user semiring with Real's definition), so the fast path and the formulas agree.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import semiring_autograd as sa

RTOL, ATOL = 1e-10, 1e-12
F64 = torch.float64


class RealArithmetic(sa.Real):
    """Real's definition under another type: runs through the generic module (its
    formulas), not the generated Real one (torch's backward for these ops)."""

    name = "real_arithmetic"


class Call(nn.Module):
    def __init__(self, fn: Callable[..., Tensor]):
        super().__init__()
        self.fn = fn

    def forward(self, *xs: Tensor) -> Tensor:
        return self.fn(*xs)


def _t(*shape: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).requires_grad_()


def _cases() -> list[tuple[str, Callable[..., Tensor], list[Tensor]]]:
    x = _t(2, 3, 5, seed=1)
    mask = torch.rand(2, 3, 3, generator=torch.Generator().manual_seed(9)) > 0.3
    mask[..., 0] = True
    return [
        (
            "layer_norm",
            lambda a, w, b: F.layer_norm(a, (5,), w, b),
            [x, _t(5, seed=2), _t(5, seed=3)],
        ),
        ("layer_norm_no_affine", lambda a: F.layer_norm(a, (3, 5)), [_t(2, 3, 5, seed=4)]),
        (
            "sdpa_qkv",
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
            [_t(2, 3, 4, seed=5), _t(2, 3, 4, seed=6), _t(2, 3, 4, seed=7)],
        ),
        ("sdpa_self", lambda h: F.scaled_dot_product_attention(h, h, h, is_causal=True), [x]),
        (
            "sdpa_mask",
            lambda q, k: F.scaled_dot_product_attention(q, k, k, attn_mask=mask),
            [_t(2, 3, 5, seed=8), x],
        ),
        ("gelu_tanh", lambda a: F.gelu(a, approximate="tanh"), [x]),
        ("silu", F.silu, [x]),
        ("softmax", lambda a: torch.softmax(a, -1), [x]),
        ("log_softmax", lambda a: F.log_softmax(a, dim=1), [x]),
    ]


CASES = _cases()


@pytest.mark.parametrize("name, fn, inputs", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("S", [sa.Real(), RealArithmetic()], ids=["Real", "generic"])
def test_matches_autograd(name, fn, inputs, S):
    seed = torch.randn(fn(*inputs).shape, generator=torch.Generator().manual_seed(0), dtype=F64)
    expected = torch.autograd.grad(fn(*inputs), inputs, seed)
    module = Call(fn)
    with sa.patch(module, S):
        out = module(*inputs)
    module_name = type(out.grad_fn)._forward_cls.__module__
    assert module_name.endswith("real" if type(S) is sa.Real else "generic")
    got = sa.grad(out, inputs, seed)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL)


def test_repeated_argument_counted_once_per_edge():
    """sdpa(h, h, h): three edges from h, and torch's backward of the call sums them once."""
    h = _t(1, 4, 3, seed=11)
    module = Call(lambda a: F.scaled_dot_product_attention(a, a, a))
    with sa.patch(module, sa.Real()):
        out = module(h)
    (expected,) = torch.autograd.grad(F.scaled_dot_product_attention(h, h, h).sum(), h)
    torch.testing.assert_close(sa.grad(out, h), expected, rtol=RTOL, atol=ATOL)


def test_retain_graph_and_second_backward():
    x, w = _t(3, 5, seed=12), _t(5, seed=13)
    module = Call(lambda a, b: F.layer_norm(a, (5,), b))
    with sa.patch(module, sa.Real()):
        out = module(x, w)
    first = sa.grad(out, [x, w], retain_graph=True)
    second = sa.grad(out, [x, w])
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="second time"):
        sa.grad(out, x)


def test_only_requested_inputs_are_differentiated():
    """sa.grad(out, x) with a weight that requires grad: torch's backward is asked for x
    only (the weight's gradient would be dropped by the engine)."""
    x, w = _t(3, 5, seed=14), _t(5, seed=15)
    module = Call(lambda a, b: F.layer_norm(a, (5,), b))
    with sa.patch(module, sa.Real()):
        out = module(x, w)
    sent = []
    out.grad_fn.register_hook(lambda grad_in, grad_out: sent.append(grad_in))
    sa.grad(out, x)
    assert len(sent[0]) == 2  # one edge per tensor argument: x, then the weight
    assert sent[0][0] is not None and sent[0][1] is None
