"""The per-call fast paths of the CPU kernels' readiness and of the formula primitives give
the answers of their slow paths: a verdict recorded after a kernel passed its check still
yields to a later failure, a reset or a forgotten build; the primitives' shortcuts equal
the semiring's own methods and torch's broadcasting."""

from __future__ import annotations

import pytest
import torch

import semiring_autograd as sa
from semiring_autograd import kernels
from semiring_autograd.kernels import build, checks
from semiring_autograd.ops import primitives as P
from semiring_autograd.semirings.base import MESSAGE_DTYPES, broadcast_shape, message_dtype

CPU = torch.device("cpu")


def _operands() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(1, 3, 4, generator=gen), torch.randn(1, 4, 5, generator=gen)


def _max_times_oracle(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """max(0, max_k a[i, k]·b[k, j]) by broadcasting every product (float64)."""
    products = a.double().unsqueeze(-1) * b.double().unsqueeze(-3)
    return products.amax(-2).clamp_min(0.0)


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.setenv("SEMIRING_AUTOGRAD_KERNELS", "check")
    if not kernels.available():
        pytest.skip("the CPU kernels are switched off or could not be built here")
    yield
    checks.reset()


def test_a_failure_after_a_passed_check_stops_the_kernel(kernels_on):
    a, b = _operands()
    out = kernels.max_times_finite(a, b)
    assert out is not None  # checked, passed: the verdict is recorded
    torch.testing.assert_close(out.double(), _max_times_oracle(a, b), rtol=1e-6, atol=1e-6)
    with pytest.warns(RuntimeWarning, match="max_times_finite"):
        checks.fail(("max_times_finite", CPU, torch.float32), "failed in this test")
    assert kernels.max_times_finite(a, b) is None
    checks.reset()  # forgotten: checked again on the next use, which passes
    again = kernels.max_times_finite(a, b)
    assert again is not None
    torch.testing.assert_close(again.double(), _max_times_oracle(a, b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode, runs", [("off", False), ("eager", False), ("trust", True)])
def test_the_mode_is_read_on_every_call_after_a_passed_check(kernels_on, monkeypatch, mode, runs):
    a, b = _operands()
    assert kernels.max_times_finite(a, b) is not None
    monkeypatch.setenv("SEMIRING_AUTOGRAD_KERNELS", mode)
    assert (kernels.max_times_finite(a, b) is not None) is runs


def test_clearing_the_build_cache_forgets_the_loaded_build(kernels_on):
    assert build.built() and build.LOADED
    build._built.cache_clear()
    assert not build.LOADED
    assert build.built() and build.LOADED  # loaded again, from the cache


@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 3), (2, 3)),
        ((), (2, 3)),
        ((2, 3), ()),
        ((), ()),
        ((1, 3), (2, 1)),
        ((3,), (2, 3)),
        ([2, 3], (2, 3)),
        ((0, 3), (1, 3)),
    ],
)
def test_broadcast_shape_is_torchs(shapes):
    assert broadcast_shape(*shapes) == torch.broadcast_shapes(*shapes)


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.bool]
)
def test_message_dtypes_table_is_message_dtype(dtype):
    assert MESSAGE_DTYPES.get(dtype, message_dtype(dtype)) == message_dtype(dtype)


@pytest.mark.parametrize("semiring", [sa.Entropy(), sa.SignedMaxProduct(), sa.MaxProduct()])
@pytest.mark.parametrize("shape", [(2, 3), (1, 3), (3,), ()])
def test_sum_to_shortcut_is_the_semirings_sum_to(semiring, shape):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(2, 3, generator=gen)
    a = semiring.lift(w)
    got = P.sum_to(semiring, a, shape)
    want = semiring.sum_to(a, shape)
    assert len(got) == len(want)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    if tuple(shape) == (2, 3):
        assert all(g is c for g, c in zip(got, a))  # nothing broadcast: a itself


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.int32])
def test_mul_lift_shortcut_is_mul_of_lift(dtype):
    S = sa.Log()
    gen = torch.Generator().manual_seed(2)
    a = S.lift(torch.randn(2, 3, generator=gen, dtype=torch.float64))
    w = (torch.randn(2, 3, generator=gen) * 4).to(dtype)
    got = P.mul_lift(S, a, w, (torch.float64, CPU))
    want = S.mul(
        a, S.lift(w.to(message_dtype(dtype if dtype.is_floating_point else torch.float64)))
    )
    for g, e in zip(got, want):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=1e-12, atol=0)
