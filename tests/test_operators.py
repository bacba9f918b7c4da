"""The kernels as torch operators: ``torch.library.opcheck`` on every operator (schema,
fake implementation against the real kernel's shapes, dtypes and strides, dispatch under
``torch.compile``'s AOT tracing).

The values of the kernels are tested in test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from semiring_autograd import kernels
from semiring_autograd.kernels import operators

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _built():
    if not kernels.available():
        pytest.skip("the CPU kernels are switched off or could not be built here")


def _samples(dtype):
    gen = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(shape, generator=gen, dtype=dtype)

    a, b = rand(2, 5, 7), rand(2, 7, 19)
    hi = rand(2, 5, 7)
    lo = hi - rand(2, 5, 7).abs()
    la, r = rand(3, 40), rand(3, 40).abs()
    rows = rand(4, 9)
    return {
        "max_times": [(a, b, 0.0, False), (a, b, -INF, True)],
        "signed_times": [(hi, lo, b, None), (hi, lo, b, b - 1)],
        "lift_times": [(hi, lo, b, True), (hi, lo, rand(1, 7, 3).transpose(1, 2).mT, False)],
        "signed_mul_lift": [(hi, lo, rand(7))],
        "entropy_mul_lift": [(la, r, rand(3, 40))],
        "entropy_add": [(la, r, rand(1, 40), rand(3, 1).abs())],
        "zero_where_no_path_": [(r.clone(), la.masked_fill(la > 1, -INF))],
        "ratio_where_positive_": [(la.clone(), r)],
        "loo_log": [(rows, None), (rows, rows.abs())],
        "entropy_reduce_rows": [(rows, rows.abs())],
        "log_space_rows": [(rows, None, torch.empty_like(rows)), (rows, rows, rows.repeat(1, 2))],
        "entropy_weights": [(rand(2, 3, 5), torch.empty(2, 6, 5, dtype=dtype))],
        "any_nan_sum": [([la, r],), ([la, r.masked_fill(r > 0.5, NAN)],)],
        "all_finite_sum": [([la, r],), ([la.masked_fill(la > 1, INF), r],)],
        "gemm_exact": [
            (r.exp(), torch.ones(3, 1, dtype=torch.bool), 1e-30, True),
            (r.exp(), torch.tensor([[True], [False], [True]]), 2.0, False),
        ],
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", sorted(operators.SCHEMAS))
def test_opcheck(name, dtype):
    for args in _samples(dtype)[name]:
        torch.library.opcheck(operators.op(name), args)


def test_every_operator_has_a_sample():
    assert set(_samples(torch.float32)) == set(operators.SCHEMAS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_tests_equal_their_formulas(dtype):
    """The fused-path tests against the torch formulas they stand for, on NaN, infinities,
    empty rows and a live mask."""
    from semiring_autograd.semirings.log_space import gemm_exact_formula

    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(4, 7, generator=gen, dtype=dtype), torch.randn(3, generator=gen)
    cases = [(a, b), (a.masked_fill(a > 1, NAN), b), (a.masked_fill(a > 1, INF), b)]
    cases += [(a.masked_fill(a > 1, INF), -b.abs() * INF)]
    for tensors in cases:
        assert kernels.any_nan_sum(tensors) == any(bool(torch.isnan(t.sum())) for t in tensors)
        total = sum(t.sum() for t in tensors)
        assert kernels.all_finite_sum(tensors) == (not bool(torch.isnan(total - total)))
    z = torch.rand(2, 5, 6, generator=gen, dtype=dtype)
    z[0, 1, 2] = 1e-300 if dtype == torch.float64 else 1e-38
    z[1, 3, 0] = INF
    for live_rows in (torch.ones(2, 5, 1, dtype=torch.bool), z[..., :1] > 0.5):
        for tiny in (1e-40, 0.5):
            for may_overflow in (False, True):
                expected = gemm_exact_formula(z, live_rows, tiny, may_overflow)
                assert kernels.gemm_exact(z, live_rows, tiny, may_overflow) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_block_width_matches_the_kernel(dtype):
    """The fake max_times' padded strides come from operators.block_width; the kernel's
    result must have the same."""
    a, b = torch.rand(1, 3, 4, dtype=dtype), torch.rand(1, 4, 5, dtype=dtype)
    out = operators.op("max_times")(a, b, 0.0, False)
    assert out.stride(1) == operators.block_width(dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", ["max_times", "signed_times", "lift_times"])
def test_opcheck_cuda(name):
    """The CUDA kernels of the matmuls (compiled formulas) against their schemas and fakes."""
    for args in _samples(torch.float32)[name]:
        moved = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(operators.op(name), moved)
