"""The CPU workspace's kept ones (``workspace.ones``) and the derivative helpers that read
them: dense ones where they apply, the same derivatives to the bit as from a broadcast of
one element, and autograd's derivative in float64."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from semiring_autograd.kernels import workspace
from semiring_autograd.ops import tensor_helpers as TH


def _broadcast_ones(x: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=x.dtype).expand_as(x)


def test_ones_are_dense_ones_kept_and_grown():
    x = torch.empty(3, 5)
    first = workspace.ones(x)
    assert first.shape == x.shape and first.dtype == x.dtype and first.is_contiguous()
    assert torch.equal(first, torch.ones(3, 5))
    again = workspace.ones(torch.empty(15))
    assert again.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    larger = workspace.ones(torch.empty(4, 100, dtype=torch.float32))
    assert torch.equal(larger, torch.ones(4, 100))
    doubles = workspace.ones(torch.empty(2, 2, dtype=torch.float64))
    assert doubles.dtype == torch.float64 and torch.equal(doubles, torch.ones(2, 2).double())


def test_ones_made_in_inference_mode_serve_outside_it():
    with torch.inference_mode():
        made = workspace.ones(torch.empty(7, dtype=torch.float16))
    assert not made.is_inference()
    x = torch.randn(7, dtype=torch.float16, requires_grad=True)
    (gradient,) = torch.autograd.grad((workspace.ones(x) * x).sum(), x)
    assert torch.equal(gradient, torch.ones(7, dtype=torch.float16))


def test_ones_decline_where_a_kept_buffer_does_not_belong():
    assert workspace.ones(torch.empty(3, device="meta")) is None
    assert workspace.ones(torch.empty((16 << 20) // 4 + 1)) is None  # over 16 MiB
    assert workspace.ones(torch.nn.Parameter(torch.empty(3))) is None  # not a plain tensor

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passing():
        assert workspace.ones(torch.empty(3)) is None
    seen = []
    torch.vmap(lambda row: seen.append(workspace.ones(row)) or row)(torch.empty(2, 3))
    assert seen == [None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "derivative, kernel",
    [
        (lambda x: TH.gelu_derivative(x, "none"), lambda g, x: torch.ops.aten.gelu_backward(g, x)),
        (
            lambda x: TH.gelu_derivative(x, "tanh"),
            lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
        ),
        (TH.silu_derivative, torch.ops.aten.silu_backward),
    ],
    ids=["gelu", "gelu_tanh", "silu"],
)
def test_derivatives_equal_the_broadcast_kernel_to_the_bit(dtype, derivative, kernel):
    x = (torch.randn(3, 37, 70, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    got = derivative(x)
    assert torch.equal(got, kernel(_broadcast_ones(x), x))
    assert torch.equal(workspace.ones(x), torch.ones_like(x))  # read, never written


@pytest.mark.parametrize(
    "derivative, f",
    [
        (lambda x: TH.gelu_derivative(x, "none"), torch.nn.functional.gelu),
        (
            lambda x: TH.gelu_derivative(x, "tanh"),
            lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
        ),
        (TH.silu_derivative, torch.nn.functional.silu),
    ],
    ids=["gelu", "gelu_tanh", "silu"],
)
def test_derivatives_match_autograd_in_float64(derivative, f):
    x = torch.randn(4, 33, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 4
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(f(leaf).sum(), leaf)
    torch.testing.assert_close(derivative(x), want, rtol=1e-12, atol=1e-12)
