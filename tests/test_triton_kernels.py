"""The Triton matmul kernels (``kernels/triton_matmul.py``, the operators' CUDA kernels) in
Triton's interpreter, on CPU tensors, against two oracles: the CPU operators
``torch.ops.semiring_autograd.*`` (to the bit on every input: values, NaN and the signs of
zeros) and broadcast torch formulas of the operators' definitions (values).

Where the two oracles differ: a term of signed_times or lift_times with some but not all of
its products NaN (a NaN end, or ±inf·0). The formulas skip the whole term; the kernels, on
the CPU and in Triton alike, keep what their selects return
(``test_terms_with_a_nan_product_follow_the_cpu_selects``). The library sends operands
holding NaN to its eager formulas, so only ±inf·0 reaches the kernels this way; outputs with
such a term are left out of the comparison with the formulas.

The module is loaded under a private name with ``TRITON_INTERPRET=1`` set only while it is
imported (``triton.jit`` reads it then), so nothing else in the session is affected.
"""

from __future__ import annotations

import importlib.util
import os
import zlib
from pathlib import Path

import pytest
import torch

from semiring_autograd import kernels
from semiring_autograd.kernels.operators import op

pytest.importorskip("triton")

# the interpreter multiplies with numpy, which warns at ±inf·0 (a NaN product, skipped)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.float64]
SOURCE = Path(kernels.__file__).with_name("triton_matmul.py")
SENTINEL = 12345.0

# name: (batch, m, k, n, batch of b/w, layout), layout one of
# "plain" (contiguous operands, padded output as operators._padded_result makes),
# "transposed" (a, b and w transposed views, a_lo contiguous, output transposed)
CASES = {
    "random": (2, 17, 33, 9, 2, "plain"),
    "one": (1, 1, 1, 1, 1, "plain"),
    "k1": (2, 5, 1, 7, 2, "plain"),
    "broadcast": (3, 17, 6, 20, 1, "plain"),
    "transposed": (2, 19, 12, 18, 2, "transposed"),
    "tiles": (1, 37, 40, 35, 1, "transposed"),
}
# how the operands are filled: plain values, or sprinkled with NaN, ±inf, 0 and -0.0 and,
# for the pairs, empty entries (NaN for signed_times, hi < lo for lift_times), with rows and
# columns that have no term at all
FILLS = ["values", "specials"]


def _max_times_formula(a, b, init: float):
    """max(init, max_k a·b) by broadcasting; a NaN product never wins."""
    p = a[:, :, :, None] * b[:, None, :, :]
    p = torch.where(torch.isnan(p), torch.full_like(p, init), p)
    return p.amax(dim=2).clamp_min(init)


def _signed_formula(a_hi, a_lo, b_hi, b_lo):
    """(max_k, min_k) of the four corner products by broadcasting; a term with a NaN corner
    is empty; an output without a term is (-inf, +inf)."""
    ah, al = a_hi[:, :, :, None], a_lo[:, :, :, None]
    bh, bl = b_hi[:, None, :, :], b_lo[:, None, :, :]
    p1, p2, p3, p4 = ah * bh, ah * bl, al * bh, al * bl
    top = torch.maximum(torch.maximum(p1, p2), torch.maximum(p3, p4))
    bottom = torch.minimum(torch.minimum(p1, p2), torch.minimum(p3, p4))
    empty = torch.isnan(top)
    top = torch.where(empty, torch.full_like(top, float("-inf")), top)
    bottom = torch.where(empty, torch.full_like(bottom, float("inf")), bottom)
    return top.amax(dim=2), bottom.amin(dim=2)


@pytest.fixture(scope="module")
def tm():
    """triton_matmul.py imported under TRITON_INTERPRET=1, the variable restored after."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location("_triton_matmul_interpreted", SOURCE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    assert os.environ.get("TRITON_INTERPRET") == saved
    return module


@pytest.fixture(autouse=True)
def _cpu_operators():
    if not kernels.available():
        pytest.skip("the CPU kernels (oracle) are switched off or could not be built here")


def test_kernels_run_interpreted_on_cpu(tm):
    from triton.runtime.interpreter import InterpretedFunction

    for kernel in (tm._max_times_kernel, tm._signed_times_kernel, tm._lift_times_kernel):
        assert isinstance(kernel, InterpretedFunction)
    a = torch.tensor([[[2.0, -1.0]]])
    b = torch.tensor([[[3.0], [-5.0]]])
    out = tm.max_times(a, b, -INF, False, torch.empty(1, 1, 1))
    assert out.device.type == "cpu" and out.item() == 6.0


def test_launchers_refuse_mismatched_operands(tm):
    a, out = torch.zeros(2, 3, 4), torch.zeros(2, 3, 5)
    for b in (torch.zeros(2, 5, 5), torch.zeros(3, 4, 5), torch.zeros(2, 4, 5).double()):
        with pytest.raises(ValueError):
            tm.max_times(a, b, 0.0, False, out)
    with pytest.raises(ValueError):
        tm.lift_times(a, a, torch.zeros(1, 4, 6), False, out, out)


def _generator(*key) -> torch.Generator:
    """A generator seeded from the test's parameters (the same on every run)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _fill(shape, dtype, gen, specials: bool) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if specials:
        values = torch.tensor([NAN, INF, -INF, 0.0, -0.0], dtype=torch.float64)
        pick = values[torch.randint(0, len(values), shape, generator=gen)]
        x = torch.where(torch.rand(shape, generator=gen) < 0.1, pick, x)
    return x.to(dtype)


def _operand(shape, dtype, gen, specials: bool, transposed: bool) -> torch.Tensor:
    """A (batch, rows, cols) operand; stored transposed (a .mT view) when ``transposed``."""
    batch, rows, cols = shape
    if transposed:
        return _fill((batch, cols, rows), dtype, gen, specials).mT
    return _fill(shape, dtype, gen, specials)


def _pair(shape, dtype, gen, specials: bool, transposed: bool, empty: str):
    """(hi, lo) with lo ≤ hi, and with specials: empty entries (``empty``: "nan" sets both
    ends NaN, "crossed" sets hi < lo), a row of empty entries and a column of them."""
    hi = _operand(shape, dtype, gen, specials, transposed)
    lo = (hi - torch.rand(shape, generator=gen, dtype=dtype)).contiguous()
    if specials:
        gone = torch.rand(shape, generator=gen) < 0.2
        gone[:, -1, :] = True
        gone[:, :, 0] = True
        hi.masked_fill_(gone, NAN if empty == "nan" else -1.0)
        lo.masked_fill_(gone, NAN if empty == "nan" else 1.0)
    return hi, lo


def _outputs(case, dtype, count: int):
    """Tensors holding outputs (batch, m, n) in the case's layout, filled with SENTINEL: a
    wider tensor (n padded to 32 columns, as operators._padded_result makes), or a
    transposed view; ``_trim`` takes the output from it."""
    batch, m, _, n, _, layout = case
    if layout == "transposed":
        return [torch.full((batch, n, m), SENTINEL, dtype=dtype).mT for _ in range(count)]
    return [torch.full((batch, m, -(-n // 32) * 32), SENTINEL, dtype=dtype) for _ in range(count)]


def _trim(wide: torch.Tensor, n: int) -> torch.Tensor:
    return wide[..., :n]


def _check_padding(wide: torch.Tensor, n: int):
    assert (wide[..., n:] == SENTINEL).all(), "a store went past the output's columns"


def _same_bits(got: torch.Tensor, expected: torch.Tensor, where: torch.Tensor | None = None):
    """Equal values and signs (zeros' signs included), NaN where NaN, at ``where``."""
    if where is not None:
        got, expected = got[where], expected[where]
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(expected)), "signs of zeros differ"


def _same_values(got: torch.Tensor, expected: torch.Tensor):
    """Equal values (-0.0 == 0.0), NaN where NaN."""
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def _expand(x: torch.Tensor, batch: int) -> torch.Tensor:
    """x broadcast over the batch: the CPU matmul operators read b with a's batch size."""
    return x.expand(batch, *x.shape[1:])


def _partial(products: list[torch.Tensor]) -> torch.Tensor:
    """(batch, m, n): outputs with a term whose products are NaN in some but not all places
    (products of shape (batch, m, k, n)), where the kernels differ from the formula."""
    nan = torch.stack([torch.isnan(p) for p in products])
    return (nan.any(0) & ~nan.all(0)).any(2)


def _case_params(*flags):
    return [
        pytest.param(
            name,
            fill,
            dtype,
            *values,
            id=f"{name}-{fill}-{str(dtype)[6:]}-" + "-".join(str(v) for v in values),
        )
        for name in CASES
        for fill in FILLS
        for dtype in DTYPES
        for values in flags
    ]


@pytest.mark.parametrize(
    "name, fill, dtype, init, abs_b",
    _case_params((0.0, False), (-INF, False), (0.0, True), (-INF, True)),
)
def test_max_times(tm, name, fill, dtype, init, abs_b):
    case = CASES[name]
    batch, m, k, n, b_batch, layout = case
    gen = _generator(name, fill)
    specials, transposed = fill == "specials", layout == "transposed"
    a = _operand((batch, m, k), dtype, gen, specials, transposed)
    b = _operand((b_batch, k, n), dtype, gen, specials, transposed)
    if specials:
        a[:, -1, :] = NAN  # a row without terms: init
    (wide,) = _outputs(case, dtype, 1)
    got = tm.max_times(a, b, init, abs_b, _trim(wide, n))
    _check_padding(wide, n)
    _same_bits(got, op("max_times")(a, _expand(b, batch), init, abs_b))
    _same_values(got, _max_times_formula(a, b.abs() if abs_b else b, init))


@pytest.mark.parametrize("name, fill, dtype, point", _case_params((False,), (True,)))
def test_signed_times(tm, name, fill, dtype, point):
    case = CASES[name]
    batch, m, k, n, b_batch, layout = case
    gen = _generator(name, fill, point)
    specials, transposed = fill == "specials", layout == "transposed"
    a_hi, a_lo = _pair((batch, m, k), dtype, gen, specials, transposed, "nan")
    if point:
        b_hi = _operand((b_batch, k, n), dtype, gen, specials, transposed)
        b_lo = None
    else:
        b_hi, b_lo = _pair((b_batch, k, n), dtype, gen, specials, transposed, "nan")
    wide_hi, wide_lo = _outputs(case, dtype, 2)
    got = tm.signed_times(a_hi, a_lo, b_hi, b_lo, _trim(wide_hi, n), _trim(wide_lo, n))
    _check_padding(wide_hi, n)
    _check_padding(wide_lo, n)
    bl = b_hi if point else b_lo
    corners = [x[:, :, :, None] * y[:, None] for x in (a_hi, a_lo) for y in (b_hi, bl)]
    agreed = ~_partial(corners)
    expand_lo = None if point else _expand(b_lo, batch)
    cpu = op("signed_times")(a_hi, a_lo, _expand(b_hi, batch), expand_lo)
    for g, c, f in zip(got, cpu, _signed_formula(a_hi, a_lo, b_hi, bl)):
        _same_bits(g, c)
        _same_values(g[agreed], f[agreed])
    if not specials:
        assert agreed.all()


def _lift_formula(a_hi, a_lo, w, zero_empty):
    """lift_times by the corner formula: empty a entries (hi < lo) and, when
    ``zero_empty``, w = 0 made NaN, then the pair times (w, w)."""
    empty = a_hi < a_lo
    if zero_empty:
        w = w.masked_fill(w == 0, NAN)
    a_hi, a_lo = a_hi.masked_fill(empty, NAN), a_lo.masked_fill(empty, NAN)
    return _signed_formula(a_hi, a_lo, w, w)


@pytest.mark.parametrize("name, fill, dtype, zero_empty", _case_params((False,), (True,)))
def test_lift_times(tm, name, fill, dtype, zero_empty):
    case = CASES[name]
    batch, m, k, n, w_batch, layout = case
    gen = _generator(name, fill, zero_empty)
    specials, transposed = fill == "specials", layout == "transposed"
    a_hi, a_lo = _pair((batch, m, k), dtype, gen, specials, transposed, "crossed")
    w = _operand((w_batch, k, n), dtype, gen, specials, transposed)
    if not specials:
        w = w.masked_fill(torch.rand(w.shape, generator=gen) < 0.2, 0.0)
    wide_hi, wide_lo = _outputs(case, dtype, 2)
    got = tm.lift_times(a_hi, a_lo, w, zero_empty, _trim(wide_hi, n), _trim(wide_lo, n))
    _check_padding(wide_hi, n)
    _check_padding(wide_lo, n)
    empty = (a_hi < a_lo)[:, :, :, None]
    point = w.masked_fill(w == 0, NAN) if zero_empty else w
    ends = [(x[:, :, :, None] * point[:, None]).masked_fill(empty, NAN) for x in (a_hi, a_lo)]
    agreed = ~_partial(ends)
    cpu = op("lift_times")(a_hi, a_lo, w, zero_empty)
    for g, c, f in zip(got, cpu, _lift_formula(a_hi, a_lo, w, zero_empty)):
        _same_bits(g, c)
        _same_values(g[agreed], f[agreed])
    if not specials:
        assert agreed.all()


# one term each whose products are NaN in some places but not all (a NaN end, ±inf·0).
# name: (operator, operands (signed_times: a_hi, a_lo, b_hi, b_lo or None; lift_times: a_hi,
# a_lo, w, with zero_empty off))
PARTIAL = {
    "signed-inf_times_zero": ("signed_times", (INF, 0.0, 0.0, None)),
    "signed-zero_then_nan": ("signed_times", (0.0, -INF, 0.0, None)),
    "signed-nan_hi": ("signed_times", (NAN, 1.0, 2.0, None)),
    "signed-nan_lo": ("signed_times", (1.0, NAN, 2.0, None)),
    "signed-zero_times_inf": ("signed_times", (2.0, 0.0, INF, 1.0)),
    "lift-inf_times_zero": ("lift_times", (INF, 0.0, 0.0)),
    "lift-zero_times_inf": ("lift_times", (1.0, 0.0, INF)),
    "lift-nan_lo": ("lift_times", (1.0, NAN, 2.0)),
}


def _scalars(values) -> list[torch.Tensor | None]:
    return [None if v is None else torch.tensor([[[v]]]) for v in values]


@pytest.mark.parametrize("name", PARTIAL)
def test_terms_with_a_nan_product_follow_the_cpu_selects(tm, name):
    """Such a term gives, to the bit, what the CPU operator gives (its selects in its order),
    which the broadcast formula (the term skipped: (-inf, +inf)) does not always give."""
    operator, values = PARTIAL[name]
    outs = (torch.empty(1, 1, 1), torch.empty(1, 1, 1))
    extra = () if operator == "signed_times" else (False,)
    cpu = op(operator)(*_scalars(values), *extra)
    if operator == "signed_times":
        got = tm.signed_times(*_scalars(values), *outs)
    else:
        got = tm.lift_times(*_scalars(values), False, *outs)
    for g, c in zip(got, cpu):
        _same_bits(g, c)
