"""KBest's fused CPU matmul (``kernels.k_best_times``) and its ⊕ against brute force: every
product of the two operands' lists formed and the k largest kept by a full sort. The kernel
is compared bit for bit (``torch.equal``); NaN and infinite operands must decline (None)."""

from __future__ import annotations

import pytest
import torch

import semiring_autograd as sa
from semiring_autograd import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the CPU kernels did not build")


def brute_force(a: torch.Tensor, b: torch.Tensor, k: int, abs_b: bool) -> torch.Tensor:
    """(k, B, m, n): per output the k largest of a[r, bt, i, q] · b'[s, bt, q, j] over
    (q, r, s), sorted descending, zeros appended (b' = |b| when ``abs_b``)."""
    b = b.abs() if abs_b else b
    ka, batch, m, l = a.shape
    kb, n = b.shape[0], b.shape[-1]
    b = b.expand(kb, batch, l, n)
    out = torch.zeros(k, batch, m, n, dtype=a.dtype)
    for bt in range(batch):
        for i in range(m):
            # terms[j] = every a[r, bt, i, q] · b[s, bt, q, j], over (r, s, q)
            terms = (a[:, None, bt, i, :, None] * b[None, :, bt]).reshape(-1, n).T
            terms = torch.cat([terms, torch.zeros(n, k, dtype=a.dtype)], 1)
            out[:, bt, i] = terms.sort(1, descending=True).values[:, :k].T
    return out


def lists(*shape: int, dtype=torch.float32, sort: bool = True, seed: int = 0) -> torch.Tensor:
    """Non-negative weights on a grid of quarters (exact ties, zeros), components first;
    sorted descending along the components unless ``sort`` is False."""
    g = torch.Generator().manual_seed(seed)
    x = ((torch.rand(*shape, generator=g) * 4).floor() / 4).to(dtype)
    return x.sort(0, descending=True).values if sort else x


CASES = [
    # (ka, kb, batch, b_batch, m, l, n, k)
    (3, 1, 1, 1, 5, 40, 37, 5),
    (5, 1, 2, 1, 3, 17, 16, 5),
    (2, 3, 2, 2, 4, 9, 33, 4),
    (1, 1, 1, 1, 2, 3, 5, 7),  # k above the number of terms: zeros at the end
    (4, 2, 3, 3, 1, 6, 1, 1),
    (5, 5, 1, 1, 6, 64, 48, 32),
    # more rows than the in-place path takes (K_BEST_IN_PLACE_ROWS): b's strips
    (3, 1, 2, 2, 70, 23, 35, 5),
    (2, 1, 1, 1, 65, 30, 16, 3),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("abs_b", [False, True])
def test_k_best_times_is_the_brute_force_k_best_to_the_bit(case, abs_b, dtype):
    ka, kb, batch, b_batch, m, l, n, k = case
    a = lists(ka, batch, m, l, dtype=dtype, seed=1)
    b = lists(kb, b_batch, l, n, dtype=dtype, seed=2)
    if abs_b:
        b = b * torch.where(lists(kb, b_batch, l, n, seed=3) > 0.5, -1.0, 1.0).to(dtype)
    got = kernels.k_best_times(a, b, k, abs_b=abs_b, dead_count=True)
    assert got is not None
    assert torch.equal(got, brute_force(a, b, k, abs_b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "m, l, n",
    [
        (20, 300, 40),  # in place; few column blocks: the 32 largest indices sorted, then the rest
        (100, 300, 40),  # rows in tiles, likewise
        (70, 300, 130),  # strips; many column blocks: every index sorted, in two groups
        (20, 300, 150),  # in place; many column blocks, in two groups
    ],
)
@pytest.mark.parametrize("kb", [1, 2])
@pytest.mark.parametrize("layout", ["rows", "transposed", "mixed"])
def test_k_best_times_over_long_rows_to_the_bit(m, l, n, kb, layout, dtype):
    """Weights over many orders of magnitude (the bounds stop a row early, in its sorted
    indices or past them) and rows of hundreds of indices, some without weight, the lists
    in rows, transposed or of two layouts: the brute-force k best, bit for bit."""
    g = torch.Generator().manual_seed(7)
    a = torch.exp(torch.randn(5, 2, m, l, generator=g, dtype=torch.float64) * 4).to(dtype)
    a = a.sort(0, descending=True).values
    a[:, :, :, ::7] = 0  # indices without weight
    b = torch.exp(torch.randn(kb, 2, l, n, generator=g, dtype=torch.float64) * 2).to(dtype)
    lists_a = list(a)
    if layout != "rows":
        flipped = [c.mT.contiguous().mT for c in lists_a]
        lists_a = flipped if layout == "transposed" else flipped[:2] + lists_a[2:]
    got = kernels.k_best_times(lists_a, b, 5, abs_b=False, dead_count=True)
    assert got is not None
    assert torch.equal(got, brute_force(a, b, 5, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["sliced rows", "sliced columns", "batch expanded", "gathered"])
def test_k_best_times_reads_lists_of_any_strides_to_the_bit(layout: str, dtype):
    """Rows in tiles read a's lists where they lie: rows of a wider tensor, columns of one
    (a transposed slice), one batch entry for all (stride 0), every other index and row."""
    g = torch.Generator().manual_seed(12)
    wide = torch.exp(torch.randn(5, 2, 150, 2 * 140, generator=g, dtype=torch.float64) * 3)
    wide = wide.to(dtype).sort(0, descending=True).values
    if layout == "sliced rows":
        a = wide[..., :140]
    elif layout == "sliced columns":
        a = wide.mT.contiguous().mT[..., :140]
    elif layout == "batch expanded":
        a = wide[:, :1, :, :140].expand(5, 2, 150, 140)
    else:
        a = wide[:, :, ::2, ::2]
    assert not a[0].is_contiguous()
    b = torch.exp(torch.randn(1, 2, 140, 40, generator=g, dtype=torch.float64) * 2).to(dtype)
    got = kernels.k_best_times(list(a), b, 5, abs_b=False, dead_count=True)
    assert got is not None
    assert torch.equal(got, brute_force(a.contiguous(), b, 5, False))


@pytest.mark.parametrize("transposed", [False, True])
def test_k_best_times_tiles_test_every_live_index_of_b(transposed: bool):
    """Rows in tiles of 64 each test b at the indices their own rows reach: an index only
    the second tile reaches still declines a NaN there; one no row reaches does not."""
    a = lists(2, 1, 130, 10, seed=13)
    a[:, :, :, 5] = 0  # index 5: no row has a path
    a[:, :, :64, 4] = 0  # index 4: only the rows past the first tile
    a[:, :, 64:, 4] = 1.0
    b = lists(1, 1, 10, 17, seed=14)
    b[0, 0, 5, 3] = float("nan")
    lists_a = [c.mT.contiguous().mT for c in a] if transposed else list(a)
    live = [q for q in range(10) if q != 5]
    got = kernels.k_best_times(lists_a, b, 3, abs_b=True, dead_count=False)
    assert torch.equal(got, brute_force(a[..., live], b[:, :, live], 3, True))
    b[0, 0, 4, 3] = float("nan")
    assert kernels.k_best_times(lists_a, b, 3, abs_b=True, dead_count=False) is None


@pytest.mark.parametrize("n", [40, 150])  # rows in tiles; strips in groups of blocks
def test_k_best_times_on_two_threads_equals_one_thread(n: int):
    """The tasks (tiles of rows, or runs of rows by groups of column blocks) on two threads:
    the same lists as on one, and a NaN in the last task's rows still declines."""
    g = torch.Generator().manual_seed(15)
    a = torch.exp(torch.randn(5, 3, 200, 120, generator=g) * 3).sort(0, descending=True).values
    lists_a = [c.mT.contiguous().mT for c in a]
    b = torch.randn(1, 3, 120, n, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.k_best_times(lists_a, b, 5, abs_b=True, dead_count=True)
        torch.set_num_threads(2)
        two = kernels.k_best_times(lists_a, b, 5, abs_b=True, dead_count=True)
        a[2, 2, 199, 7] = float("nan")
        declined = kernels.k_best_times(list(a), b, 5, abs_b=True, dead_count=True)
    finally:
        torch.set_num_threads(threads)
    assert one is not None and torch.equal(one, two)
    assert torch.equal(one[:, 1], brute_force(a[:, 1:2], b[:, 1:2], 5, True)[:, 0])
    assert declined is None


@pytest.mark.parametrize("kb", [1, 2])
def test_k_best_times_takes_unsorted_lists(kb: int):
    a = lists(4, 2, 3, 11, sort=False, seed=4)
    b = lists(kb, 1, 11, 19, sort=False, seed=5)
    assert not bool((a[1:] <= a[:-1]).all())
    got = kernels.k_best_times(a, b, 5, abs_b=False, dead_count=True)
    assert torch.equal(got, brute_force(a, b, 5, False))


def test_k_best_times_rows_and_indices_without_paths():
    a = lists(3, 1, 6, 20, seed=6)
    a[:, :, 2] = 0  # a row with no path: all zeros
    a[:, :, :, 5:9] = 0  # indices no row reaches
    b = lists(1, 1, 20, 21, seed=7)
    got = kernels.k_best_times(a, b, 4, abs_b=True, dead_count=True)
    assert torch.equal(got, brute_force(a, b, 4, True))
    assert torch.equal(got[:, :, 2], torch.zeros(4, 1, 21))


#: rows per batch entry: in place, and in tiles of 64 rows (one tile and a part, three)
ROWS = [3, 70, 130]


@pytest.mark.parametrize("m", ROWS)
def test_k_best_times_ignores_dead_indices_only_when_asked(m: int):
    a = lists(2, 1, m, 10, seed=8)
    a[:, :, :, 4] = 0  # index 4: no row has a path
    b = lists(1, 1, 10, 17, seed=9)
    b[0, 0, 4, 3] = float("nan")
    got = kernels.k_best_times(a, b, 3, abs_b=True, dead_count=False)
    live = [q for q in range(10) if q != 4]
    assert torch.equal(got, brute_force(a[..., live], b[:, :, live], 3, True))
    assert kernels.k_best_times(a, b, 3, abs_b=True, dead_count=True) is None


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["a", "b"])
def test_k_best_times_declines_non_finite_operands(bad: float, where: str, m: int):
    a = lists(2, 1, m, 8, seed=10)
    b = lists(1, 1, 8, 20, seed=11)
    (a if where == "a" else b)[0, 0, 1, 1] = bad
    assert kernels.k_best_times(a, b, 3, abs_b=True, dead_count=True) is None


def brute_add(a: tuple, b: tuple, k: int) -> tuple:
    """The k largest of the 2k entries per element, by a full sort."""
    x, y = torch.broadcast_tensors(torch.stack(a, -1), torch.stack(b, -1))
    top = torch.cat([x, y], -1).sort(-1, descending=True).values[..., :k]
    return tuple(top.unbind(-1))


@pytest.mark.parametrize("shapes", [((4, 7), (4, 7)), ((4, 7), (1, 7)), ((3, 1, 5), (2, 5))])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_k_best_add_is_the_k_largest_of_both_lists(shapes, k: int):
    S = sa.KBest(k)
    a = tuple(lists(k, *shapes[0], seed=12).unbind(0))
    b = tuple(lists(k, *shapes[1], seed=13).unbind(0))
    got = S.add(a, b)
    want = brute_add(a, b, k)
    assert len(got) == k
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_k_best_matmul_lift_does_not_copy_the_weight_or_the_lists_for_the_kernel():
    """matmul_lift hands the kernel a view of the weight and the lists' own components
    (no stack)."""
    S = sa.KBest(3)
    w = torch.randn(12, 9)
    seen = []
    original = kernels.k_best_times

    def spy(a_, b, k, abs_b=False, dead_count=True):
        seen.append(b[0].data_ptr() == w.data_ptr())
        seen.extend(mine.data_ptr() == given.data_ptr() for mine, given in zip(a_, a))
        return original(a_, b, k, abs_b, dead_count)

    a = tuple(c.clone() for c in lists(3, 4, 12, seed=14).unbind(0))
    kernels.k_best_times = spy
    try:
        got = S.matmul_lift(a, w)
    finally:
        kernels.k_best_times = original
    assert seen == [True] * 4
    want = brute_force(torch.stack(a)[:, None], w[None, None], 3, True)
    assert torch.equal(torch.stack(got), want[:, 0])


def brute_loo(lists: torch.Tensor) -> torch.Tensor:
    """(k, rows, n) → per row and position j the k largest of the other positions'
    entries, by a full sort, zeros appended."""
    k, rows, n = lists.shape
    out = torch.zeros_like(lists)
    for row in range(rows):
        for j in range(n):
            pool = torch.cat([lists[:, row, :j].flatten(), lists[:, row, j + 1 :].flatten()])
            pool = torch.cat([pool, torch.zeros(k, dtype=lists.dtype)])
            out[:, row, j] = pool.sort(descending=True).values[:k]
    return out


def lists_of(k: int, rows: int, n: int, dtype=torch.float32) -> torch.Tensor:
    """Descending lists with ties inside and across positions, and a row's first two
    positions without paths."""
    x = lists(k, rows, n, dtype=dtype, seed=14)
    x[:, 0, : min(2, n)] = 0.0
    if n > 3:
        x[:, :, 3] = x[:, :, 1]
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k, rows, n", [(1, 4, 6), (3, 2, 1), (5, 3, 9), (4, 2, 33)])
def test_k_best_loo_is_the_brute_force_to_the_bit(k, rows, n, dtype):
    x = lists_of(k, rows, n, dtype)
    got = kernels.k_best_loo(tuple(x))
    assert got is not None
    assert torch.equal(got, brute_loo(x))


@pytest.mark.parametrize("bad", ["nan", "order"])
def test_k_best_loo_declines_nan_and_unsorted_lists(bad: str):
    x = lists_of(3, 2, 7)
    x[2, 1, 5] = float("nan") if bad == "nan" else x[0, 1, 5] + 1.0
    assert kernels.k_best_loo(tuple(x)) is None
    # KBest.loo then takes its torch formula: the scans' values (NaN first, as topk)
    got = sa.KBest(3).loo(tuple(x), -1)
    scans = sa.Semiring.loo(sa.KBest(3), tuple(x), -1)
    torch.testing.assert_close(torch.stack(got), torch.stack(scans), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kernels_mode", ["check", "off"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_k_best_loo_along_any_dim_equals_the_scans(dim: int, kernels_mode: str, monkeypatch):
    """KBest.loo (the operator on the lists moved to the last dim; the top-2k formula with
    the kernels off) equals Semiring.loo's prefix and suffix scans of ⊕ to the bit."""
    monkeypatch.setenv("SEMIRING_AUTOGRAD_KERNELS", kernels_mode)
    S = sa.KBest(4)
    a = tuple(lists(4, 5, 6, 7, seed=15).unbind(0))
    got, scans = S.loo(a, dim), sa.Semiring.loo(S, a, dim)
    assert torch.equal(torch.stack(got), torch.stack(scans))
