"""The Log semiring's one-pass elementwise kernels (kernels/log_entries.h): a + log|w|,
log|w| and log(e^a + e^b) (contiguous, in strided rows, into an accumulator) against
torch's formulas in float64, specials included, the fallbacks where a kernel does not
apply, and Log's backward with the kernels on and off."""

from __future__ import annotations

import pytest
import torch

import semiring_autograd as sa
from semiring_autograd import kernels
from semiring_autograd.kernels import log_entries
from semiring_autograd.kernels.build import ENV

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.float64]
#: entries: enough for the kernels (MIN_ENTRIES), with a tail after the 16-float vectors
COUNT = log_entries.MIN_ENTRIES + 21


@pytest.fixture(autouse=True)
def _built():
    if not kernels.available():
        pytest.skip("the CPU kernels are switched off or could not be built here")


def _operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(COUNT, generator=gen, dtype=torch.float64) * 20
    w = torch.randn(COUNT, generator=gen, dtype=torch.float64)
    w = w * 10.0 ** (torch.rand(COUNT, generator=gen, dtype=torch.float64) * 60 - 30)
    specials = torch.tensor([0.0, -0.0, INF, -INF, NAN, 1e-40, -1e-45, 3.4e38])
    w[: len(specials)] = specials  # and again in the tail, after the last full vector
    w[-len(specials) :] = specials
    a[8:16] = torch.tensor([-INF, INF, NAN, -INF, 0.0, -INF, INF, 1.0])
    a[-16:-8] = a[8:16]
    return a.to(dtype), w.to(dtype)


def _ulps(dtype: torch.dtype, n: float, scale: torch.Tensor) -> torch.Tensor:
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    return n * eps * scale.abs().nan_to_num(posinf=0.0) + tiny * eps


def _assert_within(got, want, tol) -> None:
    got, want = got.double(), want.double()
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    close = same | ((got - want).abs() <= tol)
    assert bool(close.all()), (got[~close][:5], want[~close][:5])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plus_log_abs_equals_the_formula(dtype):
    """Within 2 ulp of the scale (|a| + |log|w||) of the float64 formula, and of the
    same infinities and NaN; log|w| alone within 2 ulp of |log|w||."""
    a, w = _operands(dtype)
    log_w = torch.log(w.double().abs())
    got = log_entries.plus_log_abs(a, w)
    assert got is not None and got.dtype == dtype
    _assert_within(got, a.double() + log_w, _ulps(dtype, 2, a.double().abs() + log_w.abs()))
    alone = log_entries.plus_log_abs(None, w)
    _assert_within(alone, log_w, _ulps(dtype, 2, log_w))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_log_add_equals_torch_logaddexp(dtype):
    """Within 3 ulp of max(|a|, |b|) + |result| of float64 torch.logaddexp, infinities and
    NaN as torch's (two -inf: -inf; +inf with anything but NaN: +inf)."""
    a, b = _operands(dtype)
    b = b.clamp(-1e30, 1e30).nan_to_num(nan=NAN, posinf=INF, neginf=-INF) * 1e-28 * 30
    b[20:40] = a[20:40]  # ties
    b[40:60] = a[40:60] - 1e-3  # log1p near log 2
    b[60:80] = a[60:80] - 90  # t below the rounding of 1 + t
    b[80:84] = torch.tensor([-INF, INF, -INF, NAN])
    a[80:84] = torch.tensor([-INF, INF, INF, 0.0])
    want = torch.logaddexp(a.double(), b.double())
    scale = torch.maximum(a.double().abs(), b.double().abs()) + want.abs()
    got = log_entries.log_add(a, b)
    assert got is not None
    _assert_within(got, want, _ulps(dtype, 3, scale))


def test_the_kernels_decline_what_they_do_not_take():
    a, w = _operands(torch.float32)
    small = a[: log_entries.MIN_ENTRIES - 1]
    assert log_entries.plus_log_abs(small, small) is None
    assert log_entries.plus_log_abs(a, w.double()) is None  # two dtypes
    assert log_entries.log_add(a[::2], w[::2]) is None  # not contiguous
    assert log_entries.log_add(a.reshape(-1, 1)[:, :1].expand(-1, 2), w[:1]) is None


def test_log_methods_fall_back_to_the_formulas():
    """Log's lift, ⊗ lift and ⊕ where the kernels do not apply (a full-size a times a
    broadcast w; two operands that both broadcast) equal torch's formulas exactly."""
    S = sa.Log()
    a = torch.randn(300, 64)
    w = torch.randn(64)
    torch.testing.assert_close(S.plus_log_abs(a, w), a + torch.log(w.abs()), rtol=0, atol=0)
    torch.testing.assert_close(S.mul_lift((a,), w)[0], a + torch.log(w.abs()), rtol=0, atol=0)
    column = a[:, :1].contiguous()
    torch.testing.assert_close(S.log_add(column, w), torch.logaddexp(column, w), rtol=0, atol=0)


def _full_and_rows(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A full-size operand (rows, 64) with specials, and one entry per row (rows, 1)."""
    a, w = _operands(dtype)
    rows = (COUNT // 64) + 1
    full = torch.cat((w, w[: rows * 64 - COUNT])).reshape(rows, 64)
    return full, a[:rows].reshape(rows, 1).contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plus_log_abs_of_a_broadcast_a(dtype):
    """a (rows, 1) + log|w| (rows, 64): log|w| by the kernel, a added; within 2 ulp of the
    scale of the float64 formula, specials of both operands included."""
    w, a = _full_and_rows(dtype)
    want = a.double() + torch.log(w.double().abs())
    got = log_entries.plus_log_abs(a, w)
    assert got is not None and got.shape == w.shape and got.dtype == dtype
    scale = a.double().abs() + torch.log(w.double().abs()).abs()
    _assert_within(got, want, _ulps(dtype, 2, scale))
    torch.testing.assert_close(sa.Log.plus_log_abs(a, w), got, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_log_add_of_a_broadcast_operand(dtype):
    """log(e^a + e^b) with one operand broadcast along rows or columns, either side:
    within 3 ulp of float64 torch.logaddexp, infinities and NaN as torch's."""
    full, rows = _full_and_rows(dtype)
    full = full.clamp(-1e30, 1e30).nan_to_num(nan=NAN, posinf=INF, neginf=-INF) * 1e-28 * 30
    columns = rows[:64].reshape(64)
    for a, b in ((full, rows), (rows, full), (columns, full), (full, columns)):
        want = torch.logaddexp(a.double(), b.double())
        got = log_entries.log_add(a, b)
        assert got is not None and got.shape == full.shape
        scale = torch.maximum(a.double().abs(), b.double().abs()) + want.abs()
        _assert_within(got, want, _ulps(dtype, 3, scale))


def _strided_pairs(dtype: torch.dtype):
    """Operand pairs of one shape that are not contiguous but lie in rows: narrowed keys of
    a wider tensor, two query groups unbound from one message (attention's ⊕ over a key
    head's query groups) and the same with both transposed, and a row read by every row."""
    gen = torch.Generator().manual_seed(9)

    def randn(*shape):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 20).to(dtype)

    wide, other, groups = randn(2, 3, 300, 64), randn(2, 3, 280, 64), randn(2, 3, 2, 280, 64)
    wide[0, 1, :5] = torch.tensor([-INF, INF, NAN, -INF, 0.0], dtype=dtype)[:, None]
    other[0, 1, :5] = torch.tensor([-INF, -INF, 1.0, INF, NAN], dtype=dtype)[:, None]
    flipped = groups.transpose(-1, -2).contiguous().transpose(-1, -2)
    return [
        (wide[..., :280, :], other),
        (groups[:, :, 0], groups[:, :, 1]),
        (flipped[:, :, 0], flipped[:, :, 1]),
        (wide[..., :280, :], randn(1, 1, 280, 64).expand(2, 3, 280, 64)),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_log_add_of_strided_operands(dtype):
    """Operands in rows (``log_add_rows_``): within 3 ulp of float64 torch.logaddexp,
    infinities and NaN as torch's, into a new tensor of the first operand's layout."""
    for a, b in _strided_pairs(dtype):
        assert not a.is_contiguous()
        want = torch.logaddexp(a.double(), b.double())
        got = log_entries.log_add(a, b)
        assert got is not None and got.shape == a.shape and got.dtype == dtype
        assert [got.stride(d) > got.stride(d + 1) for d in range(2, 3)] == [
            a.stride(d) > a.stride(d + 1) for d in range(2, 3)
        ]
        scale = torch.maximum(a.double().abs(), b.double().abs()) + want.abs()
        _assert_within(got, want, _ulps(dtype, 3, scale))


def _accumulator_cases(dtype: torch.dtype) -> list[tuple[str, torch.Tensor, bool]]:
    """(an accumulator's layout, an operand b, whether the kernel takes the two) for the
    in-place ⊕ into a narrowed (…, 280, 64) view of a (…, 300, 64) accumulator."""
    _, groups, flipped, spread = _strided_pairs(dtype)
    transposed = flipped[0].contiguous().transpose(-1, -2).contiguous().transpose(-1, -2)
    return [
        ("rows", groups[1], True),
        ("rows", spread[1], True),
        ("transposed", transposed, True),
        ("rows", flipped[1], False),
        ("transposed", flipped[1], False),  # two strides between b's rows: not one call
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_log_add_into_an_accumulator(dtype):
    """``log_add_`` and Log's ``add_into``: acc ⊕= b in place over a narrowed view of an
    accumulator (its other entries untouched), in rows or transposed, within 3 ulp of
    float64 torch.logaddexp; where the kernel declines (b laid out otherwise than acc, b
    sharing acc's storage, acc's rows overlapping) ``log_add_`` writes nothing and
    ``add_into`` writes torch.logaddexp exactly."""
    for layout, b, takes in _accumulator_cases(dtype):
        full = torch.randn(2, 3, 300, 64, dtype=torch.float64).to(dtype)
        if layout == "transposed":
            full = full.transpose(-1, -2).contiguous().transpose(-1, -2)
        before = full.clone()
        acc = full[..., :280, :]
        assert log_entries.log_add_(acc, b) is takes, (layout, b.stride())
        if takes:
            want = torch.logaddexp(before[..., :280, :].double(), b.double())
            scale = torch.maximum(before[..., :280, :].double().abs(), b.double().abs())
            _assert_within(acc, want, _ulps(dtype, 3, scale + want.abs()))
        else:
            assert torch.equal(full, before)
            sa.Log().add_into((acc,), (b,))
            expected = torch.logaddexp(before[..., :280, :], b)
            torch.testing.assert_close(acc, expected, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(full[..., 280:, :], before[..., 280:, :])
    x = torch.randn(4, 64, 64, dtype=dtype)
    assert not log_entries.log_add_(x[:, :32], x[:, 32:])  # one storage
    assert not log_entries.log_add_(x[:1].expand(4, 64, 64), x.clone())  # rows overlap


def test_add_into_of_a_subclass_with_its_own_add():
    """A Log subclass with its own ⊕ accumulates by that ⊕ (the base's add_into)."""

    class Halved(sa.Log):
        def add(self, a, b):
            return (torch.logaddexp(a[0], b[0]) - 1.0,)

    acc, b = torch.randn(64, 300), torch.randn(64, 300)
    expected = torch.logaddexp(acc, b) - 1.0
    Halved().add_into((acc,), (b,))
    torch.testing.assert_close(acc, expected, rtol=0, atol=0)


def _entropy_pair(like: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An Entropy value (log Z, r) laid out as ``like``: r in [0, 1), 0 where log Z is -inf."""
    gen = torch.Generator().manual_seed(seed)
    r = torch.rand(like.shape, generator=gen, dtype=torch.float64).to(like.dtype)
    r = torch.empty_like(like).copy_(r.masked_fill(like == -INF, 0.0))
    return like, r


def _entropy_sum(a, b) -> tuple[torch.Tensor, torch.Tensor]:
    """(log Z, r) of a ⊕ b in float64: logaddexp and the Z-weighted mean of r."""
    la, lb = a[0].double(), b[0].double()
    r = torch.sigmoid(la - lb) * a[1].double() + torch.sigmoid(lb - la) * b[1].double()
    return torch.logaddexp(la, lb), r.nan_to_num(nan=0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_entropy_add_into_an_accumulator(dtype):
    """``entropy_add_`` and Entropy's ``add_into``: acc ⊕= b in place, log Z and r, over a
    narrowed view of an accumulator (its other entries untouched), in rows or transposed,
    within 3 ulp (log Z) and 8 ulp (r) of the float64 ⊕; where the kernel declines (b laid
    out otherwise than acc, b or acc's other component sharing acc's storage, acc's rows
    overlapping) ``entropy_add_`` writes nothing and ``add_into`` writes Entropy's ⊕
    exactly."""
    for layout, b_l, takes in _accumulator_cases(dtype):
        full_l = torch.randn(2, 3, 300, 64, dtype=torch.float64).to(dtype) * 20
        if layout == "transposed":
            full_l = full_l.transpose(-1, -2).contiguous().transpose(-1, -2)
        full = _entropy_pair(full_l, 1)
        b = _entropy_pair(b_l, 2)
        before = tuple(c.clone() for c in full)
        acc = tuple(c[..., :280, :] for c in full)
        assert log_entries.entropy_add_(acc, b) is takes, (layout, b_l.stride())
        if takes:
            want_l, want_r = _entropy_sum(tuple(c[..., :280, :] for c in before), b)
            scale = torch.maximum(before[0][..., :280, :].double().abs(), b_l.double().abs())
            _assert_within(acc[0], want_l, _ulps(dtype, 3, scale + want_l.abs()))
            _assert_within(acc[1], want_r, _ulps(dtype, 8, 1 + want_r))
        else:
            assert all(torch.equal(c, d) for c, d in zip(full, before))
            sa.Entropy().add_into(acc, b)
            expected = sa.Entropy().add(tuple(c[..., :280, :] for c in before), b)
            for c, e in zip(acc, expected):
                torch.testing.assert_close(c, e, rtol=0, atol=0, equal_nan=True)
        for c, d in zip(full, before):
            assert torch.equal(c[..., 280:, :], d[..., 280:, :])
    x = torch.randn(4, 64, 64, dtype=dtype)
    y = (torch.randn(4, 32, 64, dtype=dtype), torch.rand(4, 32, 64, dtype=dtype))
    assert not log_entries.entropy_add_((x[:, :32], x[:, 32:]), y)  # acc's two in one storage
    assert not log_entries.entropy_add_((x[:, :32], y[1].clone()), (x[:, 32:], y[1]))
    spread_rows = (x[:1].expand(4, 64, 64), x[:1].expand(4, 64, 64).clone())
    assert not log_entries.entropy_add_(spread_rows, (x.clone(), x.clone()))  # rows overlap


def test_entropy_add_into_of_a_subclass_with_its_own_add():
    """An Entropy subclass with its own ⊕ accumulates by that ⊕ (the base's add_into)."""

    class Shifted(sa.Entropy):
        def add(self, a, b):
            la, r = sa.Entropy.add(self, a, b)
            return (la - 1.0, r)

    acc = (torch.randn(64, 300), torch.rand(64, 300))
    b = (torch.randn(64, 300), torch.rand(64, 300))
    expected = Shifted().add(acc, b)
    Shifted().add_into(acc, b)
    for c, e in zip(acc, expected):
        torch.testing.assert_close(c, e, rtol=0, atol=0)


def _log_grad(model, x):
    leaf = x.clone().requires_grad_(True)
    with sa.patch(model, sa.Log()):
        out = model(leaf)
    return sa.grad(out[:, 0].sum(), leaf)


def test_log_backward_with_and_without_the_kernels(monkeypatch):
    """A GELU MLP large enough for the kernels (GELU's ⊗ lift, the sum's ⊕): the backward
    with the kernels equals the torch formulas' (kernels off) within float32 rounding, and
    the path sums of its last two layers computed in float64."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)
    ).eval()
    x = torch.randn(64, 64)
    fused = _log_grad(model, x)
    monkeypatch.setenv(ENV, "off")
    plain = _log_grad(model, x)
    torch.testing.assert_close(fused, plain, rtol=2e-6, atol=2e-5)
    # oracle: log Σ_j |W2[0, j]| · |gelu'(h_j)| · |W1[j, i]| per row
    h = model[0](x).double()
    cdf = 0.5 * (1 + torch.erf(h / 2**0.5))
    gelu_d = cdf + h * torch.exp(-0.5 * h * h) / (2 * torch.pi) ** 0.5
    w1, w2 = model[0].weight.double(), model[2].weight.double()
    want = torch.log((w2[0].abs() * gelu_d.abs()) @ w1.abs())
    torch.testing.assert_close(fused.double(), want, rtol=1e-5, atol=1e-5)
