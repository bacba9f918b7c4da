"""KBest's ⊕ on the fused CPU operator (kernels.k_best_add) against the torch formula it
replaces: torch.topk over the two lists stacked, compared bit for bit (torch.equal)."""

import pytest
import torch

from semiring_autograd import kernels
from semiring_autograd.semirings.k_best import KBest, _best, _stacked

INF, NAN = float("inf"), float("nan")


@pytest.fixture(autouse=True)
def _built():
    if not kernels.available():
        pytest.skip("the CPU kernels are switched off or could not be built here")


def _lists(gen, k, shape, dtype, grid=False):
    """k descending components of ``shape``: random, or on a grid of quarters (ties)."""
    x = torch.rand((k, *shape), generator=gen, dtype=torch.float64)
    x = (x * 4).floor() / 4 if grid else x * 10.0 ** torch.randn(x.shape, generator=gen)
    return tuple(x.to(dtype).sort(0, descending=True).values)


def _formula(a, b, k):
    """The torch formula of KBest's ⊕: one stack of both lists, then top-k."""
    return torch.stack(_best(_stacked((*a, *b)), k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("k", [1, 5, 8, 32])
@pytest.mark.parametrize("grid", [False, True])
def test_merge_is_topk_of_both_lists(k, dtype, grid):
    gen = torch.Generator().manual_seed(k)
    for shape in ((3, 7), (600,), (2, 300, 5)):  # a block tail, several blocks
        a, b = _lists(gen, k, shape, dtype, grid), _lists(gen, k, shape, dtype, grid)
        got = kernels.k_best_add(a, b)
        assert got is not None
        assert torch.equal(got, _formula(a, b, k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 5, 8])
def test_merge_of_zeros_and_infinities(k, dtype):
    """KBest's zero (all 0), a list equal to the other, ±inf entries: topk's values."""
    gen = torch.Generator().manual_seed(10 + k)
    a, b = _lists(gen, k, (4, 50), dtype), _lists(gen, k, (4, 50), dtype)
    zero = tuple(torch.zeros(4, 50, dtype=dtype) for _ in range(k))
    a = tuple(c.clone() for c in a)
    a[0][0, :5] = INF
    a[-1][1, :5] = -INF
    b[0][2, 7] = INF
    for x, y in ((a, b), (zero, b), (a, zero), (a, a), (zero, zero)):
        got = kernels.k_best_add(x, y)
        assert got is not None
        assert torch.equal(got, _formula(x, y, k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("at", [3, 40, 273, 299])
@pytest.mark.parametrize("k", [1, 5])
def test_merge_declines_nan_and_unsorted_lists(k, at, dtype):
    """A NaN (topk orders it first) or a list not descending: None, the formula runs. At
    entries inside the vector passes of a block of 256 and in a block's last partial vector,
    in the last component and in a middle one."""
    gen = torch.Generator().manual_seed(20 + k)
    a, b = _lists(gen, k, (300,), dtype), _lists(gen, k, (300,), dtype)
    assert kernels.k_best_add(a, b) is not None
    for t in {k - 1, k // 2}:
        bent = tuple(c.clone() for c in b)
        bent[t][at] = NAN
        assert kernels.k_best_add(a, bent) is None
        assert kernels.k_best_add(bent, a) is None
    if k > 1:
        swapped = tuple(c.clone() for c in a)
        swapped[1][at], swapped[2][at] = a[2][at], a[1][at] + 1
        assert kernels.k_best_add(swapped, b) is None
        assert kernels.k_best_add(b, swapped) is None


@pytest.mark.parametrize("k", [1, 5])
def test_merge_of_strided_components(k):
    """Components that are views (topk's unbind(-1), a transpose, a slice, 0-d)."""
    gen = torch.Generator().manual_seed(25 + k)
    a, b = _lists(gen, k, (3, 9, 5), torch.float32), _lists(gen, k, (3, 9, 5), torch.float32)
    views = (
        tuple(torch.stack(b, -1).unbind(-1)),
        tuple(c.transpose(0, 2).contiguous().transpose(0, 2) for c in b),
        tuple(torch.cat([c, c], 1)[:, 2:11] for c in b),
    )
    for v in views:
        assert k == 1 or not v[0].is_contiguous()  # k = 1: stack(-1) adds a dim of 1
        assert torch.equal(kernels.k_best_add(a, v), _formula(a, v, k))
        assert torch.equal(kernels.k_best_add(v, a), _formula(v, a, k))
    x, y = tuple(c[1, 2, 3] for c in a), tuple(c[0, 0, 0] for c in b)
    assert torch.equal(kernels.k_best_add(x, y), _formula(x, y, k))


def test_merge_declines_what_it_does_not_take():
    """Broadcast shapes, other dtypes, lists of two lengths."""
    gen = torch.Generator().manual_seed(30)
    a, b = _lists(gen, 3, (4, 6), torch.float32), _lists(gen, 3, (4, 6), torch.float32)
    assert kernels.k_best_add(a, tuple(c[:1] for c in b)) is None
    assert kernels.k_best_add(a, tuple(c.half() for c in b)) is None
    assert kernels.k_best_add(tuple(c.half() for c in a), tuple(c.half() for c in b)) is None
    assert kernels.k_best_add(a, b[:2]) is None


@pytest.mark.parametrize("k", [1, 5])
def test_semiring_add_matches_formula(k):
    """KBest.add (the operator where it applies, the formula where it declines) against
    the formula, with broadcasting and a NaN."""
    s = KBest(k)
    gen = torch.Generator().manual_seed(40 + k)
    a, b = _lists(gen, k, (5, 9), torch.float64), _lists(gen, k, (5, 9), torch.float64)
    narrow = tuple(c[:1] for c in b)
    nan = tuple(c.clone() for c in b)
    nan[0][2, 3] = NAN
    for x, y in ((a, b), (a, narrow), (a, nan)):
        got = torch.stack(s.add(x, y))
        want = _formula(x, y, k)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
