"""The kernels as torch operators: ``torch.library.opcheck`` on every operator (schema,
fake implementation against the real kernel's shapes, dtypes and strides, dispatch under
``torch.compile``'s AOT tracing).

The values of the kernels are tested in test_kernels.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from semiring_autograd import kernels
from semiring_autograd.kernels import operators
from semiring_autograd.semirings import tensor_ops

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
        "max_times_finite": [
            (a.abs(), b, 0.0, True),
            (a.abs(), b.abs(), -INF, False),
        ],
        "k_best_times": [
            (list(rand(3, 2, 5, 7).abs()), list(rand(1, 1, 7, 19)), 4, True, False),
            (list(rand(3, 2, 5, 7).abs()), list(rand(2, 2, 7, 19).abs()), 2, False, True),
            # rows in tiles, the lists read transposed where they lie
            (list(rand(3, 2, 7, 70).abs().mT), list(rand(1, 1, 7, 19)), 3, True, False),
        ],
        "k_best_add": [
            (
                list(rand(5, 40).abs().sort(0, descending=True).values),
                list(rand(5, 40).abs().sort(0, descending=True).values),
            ),
        ],
        "k_best_loo": [
            (list(rand(4, 3, 9).abs().sort(0, descending=True).values),),
            (list(rand(2, 5).abs().sort(0, descending=True).values),),
        ],
        "k_best_softmax_backward": [
            (list(rand(4, 3, 9).abs().sort(0, descending=True).values), rand(3, 9).abs()),
            (list(rand(2, 40).abs().sort(0, descending=True).values), rand(40).abs()),
        ],
        "signed_times": [(hi, lo, b, None), (hi, lo, b, b - 1)],
        "lift_times": [(hi, lo, b, True), (hi, lo, rand(1, 7, 3).transpose(1, 2).mT, False)],
        "signed_mul_lift": [(hi, lo, rand(7))],
        "entropy_mul_lift": [(la, r, rand(3, 40)), (la, r, rand(40)), (la, r, rand(3, 1))],
        "entropy_add": [(la, r, rand(1, 40), rand(3, 1).abs())],
        "ratio_where_positive_": [(la.clone(), r)],
        "loo_log": [(rows, None), (rows, rows.abs())],
        "entropy_reduce_rows": [(rows, rows.abs())],
        "log_space_rows": [(rows, None, torch.empty_like(rows)), (rows, rows, rows.repeat(1, 2))],
        "log_space_columns": [
            (rows[None].mT.contiguous(), None, torch.empty_like(rows[None].mT.contiguous())),
            (la[None, :, :2], r[None, :, :2], torch.empty(1, 6, 2, dtype=dtype)),
        ],
        "entropy_weights": [(rand(2, 3, 5), torch.empty(2, 6, 5, dtype=dtype))],
        "plus_log_abs": [(la, rand(3, 40)), (None, rand(2, 37))],
        "log_add": [(la, rand(3, 40))],
        "log_add_rows_": [
            (torch.empty(3, 40, dtype=dtype), la, rand(3, 40)),
            (
                torch.empty(3, 47, dtype=dtype)[:, :40],
                rand(3, 45)[:, 5:],
                rand(1, 40).expand(3, 40),
            ),
        ],
        "entropy_add_rows_": [
            (*(torch.empty(3, 40, dtype=dtype) for _ in "lr"), la, r, rand(3, 40), r),
            (
                *(torch.empty(3, 47, dtype=dtype)[:, :40] for _ in "lr"),
                rand(3, 45)[:, 5:],
                rand(3, 45)[:, 5:],
                rand(1, 40).expand(3, 40),
                rand(1, 40).expand(3, 40),
            ),
        ],
        "softmax_backward_log": [
            (la, torch.softmax(rand(3, 40), -1)),
            (rand(2, 1, 7), rand(2, 1, 7)),
        ],
        "softmax_backward_max": [(r, torch.softmax(rand(3, 40), -1)), (rows.abs(), rand(4, 9))],
        "softmax_backward_or": [(la > 0, torch.softmax(rand(3, 40), -1)), (rows > 0, rand(4, 9))],
        "softmax_backward_signed": [
            (la, la - r, torch.softmax(rand(3, 40), -1)),
            (hi, lo, rand(2, 5, 7)),
        ],
        "entropy_softmax_backward": [
            (la, r, torch.softmax(rand(3, 40), -1)),
            (rand(2, 1, 7), rand(2, 1, 7), rand(2, 1, 7)),
        ],
        "standardize_max": [(r, la - la.mean(-1, keepdim=True), rand(3, 1).abs())],
        "standardize_log": [(la, la - la.mean(-1, keepdim=True), rand(3, 1).abs())],
        "entropy_standardize": [(la, r, la - la.mean(-1, keepdim=True), rand(3).abs())],
        "where_zero": [
            (la.masked_fill(la > 0.5, 0.0), torch.tensor(-INF, dtype=dtype), r),
            (rand(40).masked_fill(r[0] > 0.5, 0.0), torch.tensor(0.5, dtype=dtype), r),
        ],
        "softmax_rows_": [
            (rand(2, 4, 40), torch.arange(40) <= torch.arange(20, 24)[:, None], 0.125),
            (rand(3, 40), None, 1.0),
        ],
        "any_nan_or_inf": [([la, r], [0, 0]), ([la.masked_fill(la > 1, INF), r], [-1, 1])],
        "all_rows_live": [(rows, None, 0.0), (hi, lo, 0.0)],
        "log_gemm_finish_": [
            (r.exp(), la.clone(), la[:, :1], None, torch.ones(3, 1, dtype=torch.bool), 1e-30, True),
            (r.exp(), None, la[:, :1], la[:1], torch.tensor([[True], [False], [True]]), 2.0, False),
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
def test_tests_equal_their_formulas(dtype, monkeypatch):
    """any_nan_or_inf against the torch formula it stands for, with every sign, on NaN,
    infinities of one and both signs, strided and broadcast tensors, integers and half
    precision: the operator, and the torch test that runs without it."""
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(4, 7, generator=gen, dtype=dtype), torch.randn(3, generator=gen)
    cases = [(a, b), (a.masked_fill(a > 1, NAN), b), (a.masked_fill(a > 1, INF), b)]
    cases += [(a.masked_fill(a > 1, -INF), b), (b, a.masked_fill(a > 1, INF))]
    cases += [(a.masked_fill(a > 1, INF), -b.abs() * INF)]
    cases += [(a.masked_fill(a > 1, INF).masked_fill(a < -1, -INF), b)]
    cases += [(a.masked_fill(a > 1, NAN).t(), torch.arange(3))]
    cases += [(a[:, 1::2].masked_fill(a[:, 1::2] > 1, NAN), b[None].expand(5, 3))]
    cases += [(a[:, 1::2], b.masked_fill(b > 0, -INF)[None].expand(5, 3))]
    cases += [(a.half().masked_fill(a > 1, INF), b.to(torch.bfloat16).masked_fill(b > 0, -INF))]
    outcomes = set()
    for tensors in cases:
        for signs in itertools.product((-1, 0, 1), repeat=2):
            expected = any(
                bool(t.isnan().any())
                or (sign >= 0 and bool(t.isposinf().any()))
                or (sign <= 0 and bool(t.isneginf().any()))
                for t, sign in zip(tensors, signs)
            )
            outcomes.add(expected)
            assert kernels.any_nan_or_inf(tensors, signs) == expected, (tensors, signs)
            with monkeypatch.context() as off:
                off.setattr(kernels, "any_nan_or_inf", lambda tensors, signs: None)
                assert tensor_ops.any_nan_or_inf(tensors, signs) == expected, (tensors, signs)
    assert outcomes == {True, False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_all_rows_live_equals_the_live_formulas(dtype):
    """all_rows_live (behind ``Terms.all_live``) against the row tests it stands for
    (``Terms.live``: a maximum not equal to the zero; a signed pair's hi - lo not below 0),
    with dead rows, NaN and infinities."""
    from semiring_autograd.semirings.base import Terms

    log_terms, magnitude_terms, signed_terms = Terms(-INF), Terms(0.0), Terms(signed=True)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 4, 5, generator=gen, dtype=dtype)
    cases = []
    for row in (None, (1, 2), (2, 0)):
        for value in (None, NAN, INF):
            bent = x.clone()
            if row is not None:
                bent[row] = -INF
                if value is not None:
                    bent[row][3] = value
            cases.append(bent)
    decided, decided_signed = set(), set()
    for bent in cases:
        expected = bool(log_terms.live((bent,), -1).all())
        decided.add(expected)
        assert kernels.all_rows_live(bent, None, -INF) == expected
        assert log_terms.all_live((bent,)) == expected
        magnitude = (bent.exp(),)
        expected = bool(magnitude_terms.live(magnitude, -1).all())
        assert kernels.all_rows_live(magnitude[0], None, 0.0) == expected
        assert magnitude_terms.all_live(magnitude) == expected
        pair = (bent, x - 1)  # hi ≥ lo but where hi is -inf: an empty pair
        signed = bool(signed_terms.live(pair, -1).all())
        decided_signed.add(signed)
        assert kernels.all_rows_live(*pair, 0.0) == signed
        assert signed_terms.all_live(pair) == signed
    assert decided == decided_signed == {True, False}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_all_rows_live_reads_long_rows_to_their_end(dtype):
    """Rows longer than the kernel's chunk whose deciding entry comes late: a term only at
    the end, a NaN at the end, every entry below the zero (a maximum not equal to it), and a
    row at the zero but one entry below it (no term); against the maximum's test."""
    n = 200
    rows = torch.full((6, n), -1.0, dtype=dtype)
    rows[0, 150] = 2.0  # a term after the first chunks
    rows[1, 199] = NAN
    rows[3, :] = 0.0  # at the zero everywhere: no term
    rows[4, :] = 0.0
    rows[4, 190] = -1.0  # the maximum is the zero: no term
    rows[5, 70] = 0.0  # the zero once, the rest below: the maximum is the zero
    for row in range(6):
        x = rows[row : row + 1]
        expected = bool((x.amax(-1) != 0.0).all()) or bool(x.isnan().any())
        assert kernels.all_rows_live(x, None, 0.0) == expected, row
    assert [kernels.all_rows_live(rows[i : i + 1], None, 0.0) for i in range(6)] == [
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    pair_hi = torch.zeros(2, n, dtype=dtype)
    pair_lo = torch.ones(2, n, dtype=dtype)  # hi < lo: empty entries
    pair_lo[0, 180] = 0.0  # one entry with hi ≥ lo, late in the row
    assert kernels.all_rows_live(pair_hi[:1], pair_lo[:1], 0.0) is True
    assert kernels.all_rows_live(pair_hi, pair_lo, 0.0) is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_log_gemm_finish_equals_its_formula(dtype):
    """log_gemm_finish_ decides exactness as gemm_exact_formula does (underflow, NaN and
    infinities in live and dead rows) and, where exact, writes num / z (0 at 0/0) as torch
    does, bit for bit, and log z + shift (+ shift_b) within 4 ulp of the scale (|log z| +
    |shift| + |shift_b|) of the float64 formula, its infinities and NaN included (rows of 6
    entries and of 37: 16-float vectors and their tail); where not, writes nothing."""
    gen = torch.Generator().manual_seed(5)
    tiny = torch.finfo(dtype).tiny / torch.finfo(dtype).eps
    small = 1e-300 if dtype == torch.float64 else 1e-38
    lives = {"all": torch.ones(2, 5, 1, dtype=torch.bool)}
    lives["some"] = torch.tensor([True, False, True, True, False] * 2).reshape(2, 5, 1)
    decided = set()
    for n in (6, 37):
        z = torch.rand(2, 5, n, generator=gen, dtype=dtype) * 10.0 ** torch.randint(
            -30, 30, (2, 5, n), generator=gen
        ).to(dtype)
        z = z.clamp_min(tiny)
        num = torch.randn(2, 5, n, generator=gen, dtype=dtype)
        shift = torch.randn(2, 5, 1, generator=gen, dtype=dtype) * 50
        shift_b = torch.randn(2, 1, n, generator=gen, dtype=dtype) * 50
        variants = {"plain": z, "zeros": z.masked_fill(z < z.median(), 0.0)}
        for where in ((0, 1, 2), (1, 4, n - 1)):
            for name, value in (("small", small), ("inf", INF), ("nan", NAN), ("-0", -0.0)):
                bent = z.clone()
                bent[where] = value
                variants[f"{name}{where}"] = bent
        decided |= _finish_cases(variants, lives, num, shift, shift_b, tiny)
    assert decided == {True, False}


def _finish_cases(variants, lives, num, shift, shift_b, tiny) -> set:
    """log_gemm_finish_ on every variant of z and liveness (test_log_gemm_finish_equals_its
    _formula); the exactness decisions seen."""
    from semiring_autograd.semirings.log_space import gemm_exact_formula

    decided = set()
    for name, zz in variants.items():
        for live_name, live in lives.items():
            for may_overflow in (False, True):
                for with_num, with_b in ((True, True), (False, False)):
                    expected = gemm_exact_formula(zz, live, tiny, may_overflow)
                    decided.add(expected)
                    got_z, got_num = zz.clone(), num.clone() if with_num else None
                    done = kernels.log_gemm_finish(
                        got_z,
                        got_num,
                        shift,
                        shift_b if with_b else None,
                        live,
                        tiny,
                        may_overflow,
                    )
                    assert done == expected, (name, live_name, may_overflow)
                    if not done:
                        assert torch.equal(got_z.nan_to_num(), zz.nan_to_num())
                        assert not with_num or torch.equal(got_num, num)
                        continue
                    log_z, b = zz.double().log(), shift_b.double() if with_b else 0.0
                    want = log_z + shift.double() + b
                    scale = log_z.abs() + shift.double().abs() + abs(b)
                    _assert_within(got_z, want, _ulps(zz.dtype, 4, scale))
                    if with_num:
                        ratio = torch.where(zz > 0, num / zz, 0.0)
                        torch.testing.assert_close(got_num, ratio, rtol=0, atol=0, equal_nan=True)
    return decided


def _ulps(dtype: torch.dtype, n: float, scale: torch.Tensor) -> torch.Tensor:
    """n ulp of ``scale`` (per entry; infinities count 0), at least a subnormal step."""
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    return n * eps * scale.nan_to_num(posinf=0.0) + tiny * eps


def _assert_within(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> None:
    """got within tol of want (float64), with the same infinities and NaN."""
    got = got.double()
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    close = same | ((got - want).abs() <= tol)
    assert bool(close.all()), (got[~close][:5], want[~close][:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_block_width_matches_the_kernel(dtype):
    """The fake max_times' padded strides come from operators.block_width; the kernel's
    result must have the same."""
    a, b = torch.rand(1, 3, 4, dtype=dtype), torch.rand(1, 4, 5, dtype=dtype)
    out = operators.op("max_times")(a, b, 0.0, False)
    assert out.stride(1) == operators.block_width(dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", ["max_times", "signed_times", "lift_times"])
def test_opcheck_cuda(name):
    """The CUDA kernels of the matmuls (compiled formulas) against their schemas and fakes."""
    for args in _samples(torch.float32)[name]:
        moved = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(operators.op(name), moved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_where_zero_equals_torchs_where(dtype):
    """The CPU loop against torch's where(eq(w, 0), fill, y), to the bit: w per entry (rows
    long enough for the vector loop and its tail), per row and per column of a broadcast,
    with ±0 (both zero) and NaN (not zero) in w."""
    g = torch.Generator().manual_seed(4)
    y = torch.randn(6, 7, 53, generator=g, dtype=dtype)
    w = torch.randn(6, 7, 53, generator=g, dtype=dtype)
    w[w.abs() < 0.5] = 0.0
    w[0, 0, :20] = -0.0
    w[1, 2, 17] = float("nan")
    for fill in (torch.tensor(float("-inf"), dtype=dtype), torch.tensor(0.25, dtype=dtype)):
        for ww in (w, w[:, :1, :1].contiguous(), w[0, 0].contiguous(), w[:1, :, :1].contiguous()):
            expected = torch.where(torch.eq(ww, 0), fill, y)
            got = operators.op("where_zero")(ww, fill, y)
            assert torch.equal(got.isnan(), expected.isnan())
            torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_where_zero_with_a_cuda_y_is_torchs_where():
    """A compiled program may call ``where_zero`` with a CPU number-like w and fill and a
    CUDA y: the operator's other-device kernel, torch's where(eq(w, 0), fill, y)."""
    y = torch.randn(3, 4, device="cuda")
    fill = torch.tensor(float("-inf"))
    for w in (torch.tensor(0.0), torch.tensor(2.0), torch.tensor([0.0, 1.0, 0.0, 3.0]).cuda()):
        expected = torch.where(torch.eq(w, 0), fill, y)
        torch.testing.assert_close(operators.op("where_zero")(w, fill, y), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "name, args",
    [
        ("max_times", (torch.rand(2, 3, 4), torch.rand(1, 4, 5), 0.0, False)),
        ("max_times", (torch.rand(2, 3, 4), torch.rand(2, 3, 5), 0.0, False)),
        ("max_times_finite", (torch.rand(2, 3, 4), torch.rand(1, 4, 5), 0.0, False)),
        ("k_best_times", ([torch.rand(2, 3, 4)] * 2, [torch.rand(2, 3, 5)], 2, False, True)),
        ("k_best_times", ([torch.rand(2, 3, 4)] * 2, [torch.rand(3, 4, 5)], 2, False, True)),
        ("signed_times", (torch.rand(2, 3, 4), torch.rand(2, 3, 3), torch.rand(2, 4, 5), None)),
        ("signed_times", (torch.rand(2, 3, 4), torch.rand(2, 3, 4), torch.rand(1, 4, 5), None)),
        ("lift_times", (torch.rand(2, 3, 4), torch.rand(2, 3, 4), torch.rand(3, 4, 5), True)),
        ("lift_times", (torch.rand(2, 3, 4), torch.rand(2, 3, 4), torch.rand(4, 5), True)),
    ],
)
def test_matmul_operators_refuse_operands_that_do_not_fit(name, args):
    """The kernels read operands at offsets from a's shape: an operand of another batch or
    inner size is refused with its shape named, never read out of bounds."""
    with pytest.raises(RuntimeError, match=f"{name}: .*(operand|w must be)"):
        operators.op(name)(*args)
