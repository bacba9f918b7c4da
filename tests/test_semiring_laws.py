"""Semiring laws: ``sa.check_semiring`` on every built-in, property tests of the laws, the
checker catching broken semirings, generic defaults vs. built-in overrides, and Entropy's
meaning (the entropy of the normalised distribution over paths)."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from user_semirings import Tropical

import semiring_autograd as sa
from semiring_autograd.semirings import (
    BUILTIN_SEMIRINGS,
    Boolean,
    Counting,
    Entropy,
    Log,
    MaxProduct,
    Real,
    SignedMaxProduct,
)
from semiring_autograd.errors import SemiringLawError
from semiring_autograd.semirings import Semiring, Value

F64 = torch.float64
IDS = [cls.__name__ for cls in BUILTIN_SEMIRINGS]
LIKE = torch.empty((), dtype=F64)


# ----- helpers --------------------------------------------------------------------------


def vshape(v: Value) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*(c.shape for c in v)))


def assert_no_nan(v: Value | Tensor, what: str = "") -> None:
    comps = (v,) if isinstance(v, Tensor) else v
    for i, c in enumerate(comps):
        if c.is_floating_point():
            assert not torch.isnan(c).any(), f"NaN in component {i} of {what}: {c}"


def assert_same(
    lhs: Value, rhs: Value, *, rtol: float = 1e-9, atol: float = 1e-9, what: str = ""
) -> None:
    """Values agree: same shape, equal infinities, exact bools, close floats, no NaN."""
    assert len(lhs) == len(rhs), what
    shape = vshape(lhs)
    assert shape == vshape(rhs), f"{what}: shape {shape} vs {vshape(rhs)}"
    assert_no_nan(lhs, what + " (lhs)")
    assert_no_nan(rhs, what + " (rhs)")
    for i, (cl, cr) in enumerate(zip(lhs, rhs)):
        cl, cr = cl.expand(shape), cr.expand(shape)
        assert cl.dtype == cr.dtype, f"{what}: component {i} dtype {cl.dtype} vs {cr.dtype}"
        if not cl.is_floating_point():
            assert torch.equal(cl, cr), f"{what}: component {i}\n{cl}\nvs\n{cr}"
            continue
        finite = torch.isfinite(cl) & torch.isfinite(cr)
        same_inf = ~finite & (cl == cr)
        tol = atol + rtol * torch.maximum(cl.abs(), cr.abs())
        close = torch.where(finite, (cl - cr).abs() <= tol, same_inf)
        assert close.all(), f"{what}: component {i} differs\n{cl}\nvs\n{cr}"


class GenericView(Semiring):
    """``base`` with only its definition (zero/one/lift/⊕/⊗/readout): every other primitive
    is the generic default of :class:`Semiring`, never the base's override."""

    def __init__(self, base: Semiring) -> None:
        self.base = base
        self.n_components = base.n_components
        self.name = f"generic_{base.name}"

    def zero(self, shape, like):
        return self.base.zero(shape, like)

    def one(self, shape, like):
        return self.base.one(shape, like)

    def lift(self, w):
        return self.base.lift(w)

    def add(self, a, b):
        return self.base.add(a, b)

    def mul(self, a, b):
        return self.base.mul(a, b)

    def readout(self, a):
        return self.base.readout(a)


def random_weights(shape: Sequence[int], gen: torch.Generator, zero_frac: float = 0.3) -> Tensor:
    """Real local derivatives: both signs, magnitudes in (0.05, 20), some exact zeros."""
    mag = torch.empty(tuple(shape), dtype=F64).uniform_(-3, 3, generator=gen).exp()
    sign = torch.where(torch.rand(tuple(shape), generator=gen) < 0.5, -1.0, 1.0).to(F64)
    zero = torch.rand(tuple(shape), generator=gen) < zero_frac
    return torch.where(zero, torch.zeros_like(mag), sign * mag)


def random_value(S: Semiring, shape: Sequence[int], gen: torch.Generator) -> Value:
    """Lifted weights, ⊕ of two lifts and ⊗ of two lifts mixed elementwise, with zeros."""
    l1, l2 = S.lift(random_weights(shape, gen)), S.lift(random_weights(shape, gen))
    choice = torch.randint(0, 3, tuple(shape), generator=gen)
    out = tuple(c.expand(tuple(shape)) for c in l1)
    for k, v in ((1, S.add(l1, l2)), (2, S.mul(l1, l2))):
        out = tuple(torch.where(choice == k, cv.expand(tuple(shape)), co) for cv, co in zip(v, out))
    return out


def with_zero_row(S: Semiring, v: Value) -> Value:
    """``v`` with its first row (along dim 0) replaced by the semiring zero."""
    shape = vshape(v)
    if shape[0] == 0:
        return v
    z = S.zero(shape, LIKE)
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[0] = True
    return tuple(torch.where(mask, zc.expand(shape), vc.expand(shape)) for zc, vc in zip(z, v))


def extreme_value(S: Semiring, shape: Sequence[int], gen: torch.Generator) -> Value:
    """Values spanning hundreds of orders of magnitude (products of tiny/huge lifts), where a
    naive shift-and-GEMM or exp() would underflow; zeros included. Semirings that hold plain
    products (Real, max-product) get 1e-150 only, whose products stay finite and non-zero."""
    w = random_weights(shape, gen)
    scale = torch.randint(0, 3, tuple(shape), generator=gen)
    log_space = isinstance(S, (Log, Entropy))
    small, big = (1e-200, 1e200) if log_space else (1e-150, 1e-75)
    factor = torch.tensor([1.0, small, big], dtype=F64)[scale]
    return S.mul(S.lift(w), S.mul(S.lift(factor), S.lift(factor)))


# ----- (a) the checker passes for every built-in ------------------------------------------


def test_builtin_tuple_is_complete():
    assert set(BUILTIN_SEMIRINGS) == {
        Real,
        MaxProduct,
        SignedMaxProduct,
        Log,
        Entropy,
        Boolean,
        Counting,
    }
    assert sa.check_semiring is not None


@pytest.mark.parametrize("cls", BUILTIN_SEMIRINGS, ids=IDS)
def test_check_semiring_passes_for_builtin_class(cls):
    assert sa.check_semiring(cls) is None


@pytest.mark.parametrize("cls", BUILTIN_SEMIRINGS, ids=IDS)
def test_check_semiring_passes_for_builtin_instance_other_seed(cls):
    sa.check_semiring(cls(), samples=24, seed=7)


@pytest.mark.parametrize("cls", BUILTIN_SEMIRINGS, ids=IDS)
def test_check_semiring_passes_in_float32(cls):
    sa.check_semiring(cls, samples=32, seed=1, dtype=torch.float32, rtol=1e-4, atol=1e-5)


def test_check_semiring_rejects_non_semirings():
    with pytest.raises(TypeError):
        sa.check_semiring(int)
    with pytest.raises(TypeError):
        sa.check_semiring("max")


def test_check_semiring_reports_commutativity_as_info(caplog):
    with caplog.at_level("INFO", logger="semiring_autograd.semirings.laws"):
        sa.check_semiring(Real, samples=16)
    assert "commutative" in caplog.text


# ----- (b) property tests of the laws on random floats ------------------------------------

magnitudes = st.floats(min_value=1e-3, max_value=1e2, allow_nan=False, allow_infinity=False)
reals = st.one_of(
    st.just(0.0), st.just(-0.0), st.just(1.0), magnitudes, magnitudes.map(lambda x: -x)
)
# a value: a lifted real, or the ⊕ / ⊗ of two lifted reals
values = st.tuples(st.sampled_from(["lift", "add", "mul"]), reals, reals)


def make(S: Semiring, spec: tuple[str, float, float]) -> Value:
    kind, x, y = spec
    lx, ly = S.lift(torch.tensor([x], dtype=F64)), S.lift(torch.tensor([y], dtype=F64))
    return lx if kind == "lift" else S.add(lx, ly) if kind == "add" else S.mul(lx, ly)


def tolerance(S: Semiring, *specs: tuple[str, float, float]) -> float:
    """Absolute tolerance: Real's ⊕ cancels, so scale with the largest product of two values
    (each value is at most m², so products reach m⁴); relative 1e-12 of that."""
    if not isinstance(S, Real):
        return 1e-9
    m = max(max(abs(x), abs(y)) for _, x, y in specs)
    return 1e-9 + 1e-12 * (1 + m) ** 4


SEMIRINGS = [cls() for cls in BUILTIN_SEMIRINGS]
PROPS = settings(max_examples=40, deadline=None, derandomize=True)


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
@PROPS
@given(a=values, b=values, c=values)
def test_add_associative_commutative(S, a, b, c):
    va, vb, vc = make(S, a), make(S, b), make(S, c)
    atol = tolerance(S, a, b, c)
    assert_same(S.add(S.add(va, vb), vc), S.add(va, S.add(vb, vc)), atol=atol, what="⊕ assoc")
    assert_same(S.add(va, vb), S.add(vb, va), atol=atol, what="⊕ comm")
    assert_same(S.add(va, S.zero((1,), LIKE)), va, atol=atol, what="⊕ identity")


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
@PROPS
@given(a=values, b=values, c=values)
def test_distributive_and_annihilating(S, a, b, c):
    va, vb, vc = make(S, a), make(S, b), make(S, c)
    atol = tolerance(S, a, b, c)
    add, mul = S.add, S.mul
    assert_same(mul(va, add(vb, vc)), add(mul(va, vb), mul(va, vc)), atol=atol, what="left")
    assert_same(mul(add(va, vb), vc), add(mul(va, vc), mul(vb, vc)), atol=atol, what="right")
    assert_same(mul(mul(va, vb), vc), mul(va, mul(vb, vc)), atol=atol, what="⊗ assoc")
    zero, one = S.zero((1,), LIKE), S.one((1,), LIKE)
    assert_same(mul(va, zero), zero, what="a ⊗ 0")
    assert_same(mul(zero, va), zero, what="0 ⊗ a")
    assert_same(mul(va, one), va, atol=atol, what="a ⊗ 1")
    assert_same(mul(one, va), va, atol=atol, what="1 ⊗ a")


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
@PROPS
@given(x=reals, y=reals)
def test_lift_homomorphism(S, x, y):
    tx, ty = torch.tensor([x], dtype=F64), torch.tensor([y], dtype=F64)
    assert_same(S.lift(tx * ty), S.mul(S.lift(tx), S.lift(ty)), what="lift(xy)")
    assert_same(S.lift(torch.zeros(1, dtype=F64)), S.zero((1,), LIKE), what="lift(0)")
    assert_same(S.lift(torch.ones(1, dtype=F64)), S.one((1,), LIKE), what="lift(1)")
    assert_no_nan(S.readout(S.lift(tx)), "readout")


# ----- (c) the checker catches broken semirings ---------------------------------------------


class MaxPlusAsAdd(MaxProduct):
    """⊕ = + on |w|: itself a fine semiring, but MaxProduct's amax overrides now disagree."""

    def add(self, a, b):
        return (a[0] + b[0],)


class MaxWithPlusMul(MaxProduct):
    """⊗ = +: 1 is no identity, 0 does not annihilate, lift is no homomorphism."""

    def mul(self, a, b):
        return (a[0] + b[0],)


class MaxWithoutAbs(MaxProduct):
    """lift(w) = w: max does not distribute over products with negatives, 0 ⊕ a ≠ a."""

    def lift(self, w):
        return (w,)


class LogClampedLift(Log):
    """lift(0) = -1e30 instead of -inf (lift(0) ≠ zero; within tolerance everywhere else)."""

    def lift(self, w):
        return (torch.log(w.abs()).clamp_min(-1e30),)


class LogWrongLoo(Log):
    """loo that forgets to leave the element out."""

    def loo(self, a, dim):
        return (torch.logsumexp(a[0], dim, keepdim=True).expand_as(a[0]),)


class LogSoftmaxOwnTermOnly(Log):
    """softmax_backward that keeps each position's own term and drops the others'."""

    def softmax_backward(self, a, probs, dim):
        return self.mul_lift(a, probs * (1 - probs))


class MaxStandardizeWithoutMean(MaxProduct):
    """standardize that drops the paths through μ (the ⊕ over the row after x → c)."""

    def standardize(self, a, centred, rstd, dims):
        return self.add(
            self.mul_lift(a, rstd),
            self.mul_lift(
                self.mul_lift(self.sum(self.mul_lift(a, centred), dims, True), rstd.pow(3) / 2),
                2 * centred / centred.shape[-1],
            ),
        )


class MaxRealMatmul(MaxProduct):
    """Ordinary matmul for max-product (the shortcut "inside a matmul take a real matmul")."""

    def matmul(self, a, b):
        return (a[0] @ b[0],)


class RealIndexCopy(Real):
    """index_add that overwrites repeated rows instead of ⊕-ing them."""

    def index_add(self, a, index, size):
        out = a[0].new_zeros((size, *a[0].shape[1:]))
        return (out.index_copy(0, index.reshape(-1), a[0]),)


class EntropyNaN(Entropy):
    """⊕ without the guard for zero ⊕ zero: exp(-inf - -inf) = NaN."""

    def add(self, a, b):
        la = torch.logaddexp(a[0], b[0])
        return (la, torch.exp(a[0] - la) * a[1] + torch.exp(b[0] - la) * b[1])


class WrongSumKeepdim(Real):
    """sum override that drops keepdim."""

    def _reduce(self, a, dims, keepdim):
        return (a[0].sum(dim=dims),)


@pytest.mark.parametrize(
    "cls, laws",
    [
        (MaxPlusAsAdd, ["sum == fold of ⊕", "loo == ⊕ of the others", "matmul", "index_add"]),
        (MaxWithPlusMul, ["lift homomorphism", "⊗ identity (one)", "zero annihilates under ⊗"]),
        (MaxWithoutAbs, ["⊕ identity (zero)", "left distributivity", "right distributivity"]),
        (LogClampedLift, ["lift(0) == zero"]),
        (LogWrongLoo, ["loo == ⊕ of the others"]),
        (LogSoftmaxOwnTermOnly, ["softmax_backward == its Jacobian's fold"]),
        (MaxStandardizeWithoutMean, ["standardize == its composition's fold"]),
        (MaxRealMatmul, ["matmul == ⊕ of ⊗ products"]),
        (RealIndexCopy, ["index_add == ⊕-scatter"]),
        (EntropyNaN, ["NaN"]),
        (WrongSumKeepdim, ["sum == fold of ⊕"]),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else "",
)
def test_check_semiring_catches(cls, laws):
    with pytest.raises(SemiringLawError) as info:
        sa.check_semiring(cls)
    msg = str(info.value)
    assert cls.__name__ in msg
    for law in laws:
        assert law in msg, f"{law!r} not named in:\n{msg}"
    # a concrete counterexample: inputs and both sides
    assert " = " in msg
    assert info.value.failures and all(law and detail for law, detail in info.value.failures)


def test_counterexample_is_concrete():
    with pytest.raises(SemiringLawError) as info:
        sa.check_semiring(LogClampedLift())
    msg = str(info.value)
    assert "lift(0) = (-1e+30,)" in msg and "zero = (-inf,)" in msg


def test_loo_counterexample_names_both_sides():
    with pytest.raises(SemiringLawError) as info:
        sa.check_semiring(LogWrongLoo)
    msg = str(info.value)
    assert "loo(a, dim=" in msg and "⊕ of the other elements" in msg and "a = " in msg


def test_user_defined_semiring_passes_with_generic_defaults():
    sa.check_semiring(Tropical)
    sa.check_semiring(Tropical(), samples=16, seed=3)


def test_generic_defaults_of_user_semiring_are_right():
    """The tropical semiring's generic primitives against torch's own min-reductions."""
    S, gen = Tropical(), torch.Generator().manual_seed(0)
    x = S.lift(random_weights((4, 5, 3), gen))[0]
    assert torch.equal(S.sum((x,), (0, 2))[0], x.amin(dim=(0, 2)))
    loo = S.loo((x,), 1)[0]
    for i in range(5):
        others = torch.cat([x[:, :i], x[:, i + 1 :]], 1)
        assert torch.equal(loo[:, i], others.amin(1))
    scan = S.exclusive_scan((x,), 2)[0]
    assert torch.isposinf(scan[..., 0]).all()
    assert torch.equal(scan[..., 1:], torch.cummin(x, -1).values[..., :-1])
    a, b = S.lift(random_weights((2, 3), gen))[0], S.lift(random_weights((3, 4), gen))[0]
    assert torch.equal(S.matmul((a,), (b,))[0], (a[:, :, None] + b[None]).amin(1))
    idx = torch.tensor([2, 0, 2])
    out = S.index_add((b,), idx, 4)[0]
    assert torch.equal(out[2], torch.minimum(b[0], b[2]))
    assert torch.equal(out[0], b[1]) and torch.isposinf(out[[1, 3]]).all()
    assert torch.equal(S.sum_to((x,), (5, 1))[0], x.amin(dim=(0, 2)).reshape(5, 1))


# ----- (d) generic defaults == built-in overrides ------------------------------------------


def inputs(S: Semiring, shape: Sequence[int], seed: int) -> list[Value]:
    """Ordinary values, values with a whole zero row, and extreme-range values."""
    gen = torch.Generator().manual_seed(seed)
    out = [random_value(S, shape, gen), with_zero_row(S, random_value(S, shape, gen))]
    out.append(with_zero_row(S, extreme_value(S, shape, gen)))
    out.append(S.zero(shape, LIKE))
    return out


def compare_generic(
    S: Semiring, call: Callable[[Semiring], Value], what: str, *, atol: float = 1e-9
) -> None:
    G = GenericView(S)
    fast, slow = call(S), call(G)
    assert_same(fast, slow, rtol=1e-9, atol=atol, what=f"{type(S).__name__}.{what}")


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
@pytest.mark.parametrize(
    "dims, keepdim",
    [
        (0, False),
        (1, True),
        (-1, False),
        ((0, 2), True),
        ((2, 0), False),
        (None, False),
        (None, True),
    ],
)
def test_sum_override_matches_generic(S, dims, keepdim):
    for v in inputs(S, (3, 4, 5), seed=1):
        compare_generic(S, lambda T: T.sum(v, dims, keepdim), f"sum({dims}, {keepdim})")


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
@pytest.mark.parametrize(
    "shape, dim", [((4, 6), 1), ((4, 6), -1), ((5, 3), 0), ((2, 3, 4), 1), ((3, 1), 1), ((3, 2), 1)]
)
def test_loo_override_matches_generic(S, shape, dim):
    for v in inputs(S, shape, seed=2):
        compare_generic(S, lambda T: T.loo(v, dim), f"loo(dim={dim})")
        # and the unbound generic default called on the built-in itself
        assert_same(S.loo(v, dim), Semiring.loo(S, v, dim), what="unbound Semiring.loo")


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
@pytest.mark.parametrize(
    "sa_, sb_",
    [((3, 4), (4, 5)), ((2, 1, 3, 4), (3, 4, 2)), ((1, 3, 4), (2, 1, 4, 2)), ((1, 1), (1, 6))],
)
def test_matmul_override_matches_generic(S, sa_, sb_):
    for a, b in zip(inputs(S, sa_, seed=3), inputs(S, sb_, seed=4)):
        compare_generic(S, lambda T: T.matmul(a, b), f"matmul({sa_}, {sb_})")
        assert_same(S.matmul(a, b), Semiring.matmul(S, a, b), what="unbound Semiring.matmul")


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
@pytest.mark.parametrize("sa_, sb_", [((2, 0), (0, 3)), ((0, 3), (3, 2)), ((2, 3), (3, 0))])
def test_matmul_with_empty_dims(S, sa_, sb_):
    gen = torch.Generator().manual_seed(5)
    a, b = random_value(S, sa_, gen), random_value(S, sb_, gen)
    compare_generic(S, lambda T: T.matmul(a, b), f"matmul({sa_}, {sb_})")


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
@pytest.mark.parametrize(
    "index, size, trail",
    [([0, 2, 2, 1, 2, 0], 4, (3,)), ([1, 1, 1, 1], 3, ()), ([4, 0, 4], 6, (2, 2)), ([], 2, (3,))],
)
def test_index_add_override_matches_generic(S, index, size, trail):
    idx = torch.tensor(index, dtype=torch.int64)
    for v in inputs(S, (len(index), *trail), seed=6):
        compare_generic(S, lambda T: T.index_add(v, idx, size), f"index_add({index})")
        assert_same(S.index_add(v, idx, size), Semiring.index_add(S, v, idx, size))


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
@pytest.mark.parametrize(
    "full, shape", [((2, 3, 4), (3, 1)), ((2, 3, 4), (4,)), ((2, 3, 4), ()), ((3, 1, 2), (1, 1, 2))]
)
def test_sum_to_override_matches_generic(S, full, shape):
    for v in inputs(S, full, seed=7):
        compare_generic(S, lambda T: T.sum_to(v, shape), f"sum_to({shape})")


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
def test_exclusive_scan_negative_dim(S):
    gen = torch.Generator().manual_seed(8)
    v = random_value(S, (3, 5), gen)
    assert_same(S.exclusive_scan(v, -1), S.exclusive_scan(v, 1), what="exclusive_scan(-1)")


@pytest.mark.parametrize("S", SEMIRINGS, ids=IDS)
def test_loo_of_empty_dim(S):
    gen = torch.Generator().manual_seed(9)
    v = random_value(S, (3, 0), gen)
    compare_generic(S, lambda T: T.loo(v, 1), "loo over an empty dim")


@pytest.mark.parametrize(
    "S", [s for s in SEMIRINGS if s.n_components > 1], ids=lambda s: type(s).__name__
)
def test_overrides_accept_components_of_different_shapes(S):
    """A value's components need only broadcast: (3, 5) next to (1, 5) is one (3, 5) value."""
    gen = torch.Generator().manual_seed(10)
    row = random_value(S, (1, 5), gen)
    mixed = (row[0].expand(3, 5).clone(), *row[1:])
    full = tuple(c.expand(3, 5) for c in row)
    for what, call in [
        ("sum", lambda T, v: T.sum(v, 0)),
        ("loo", lambda T, v: T.loo(v, 0)),
        ("matmul", lambda T, v: T.matmul(v, tuple(c.transpose(0, 1) for c in v))),
        ("index_add", lambda T, v: T.index_add(v, torch.tensor([1, 0, 1]), 2)),
    ]:
        assert_same(call(S, mixed), call(GenericView(S), full), what=what)


def test_log_matmul_exact_where_shifted_products_underflow():
    """Shift-and-GEMM underflows for [[0, -1400]] @ [[-1400], [0]]; the result is exact."""
    S = Log()
    a = (torch.tensor([[0.0, -1400.0]], dtype=F64),)
    b = (torch.tensor([[-1400.0], [0.0]], dtype=F64),)
    out = S.matmul(a, b)[0]
    assert torch.allclose(out, torch.tensor([[-1400.0 + math.log(2.0)]], dtype=F64))
    E = Entropy()
    ea, eb = (a[0], torch.tensor([[1.0, 2.0]], dtype=F64)), (
        b[0],
        torch.tensor([[3.0], [5.0]], dtype=F64),
    )
    assert_same(E.matmul(ea, eb), GenericView(E).matmul(ea, eb), what="entropy underflow")


@pytest.mark.parametrize("S", [SignedMaxProduct(), Entropy()], ids=["SignedMaxProduct", "Entropy"])
def test_all_zero_inputs_never_nan(S):
    z = S.zero((3, 4), LIKE)
    zt = S.zero((4, 2), LIKE)
    for out in (
        S.sum(z, 1),
        S.loo(z, 1),
        S.matmul(z, zt),
        S.index_add(z, torch.tensor([0, 0, 2]), 3),
        S.sum_to(z, (4,)),
        S.mul(z, z),
        S.add(z, z),
    ):
        assert_no_nan(out)
        assert_same(out, S.zero(vshape(out), LIKE))
    assert_no_nan(S.readout(z))


# ----- (e) Entropy means the entropy of the distribution over paths ------------------------


def path_entropy(weights: Tensor) -> float:
    """H(p), p ∝ |w| over the non-zero weights, in nats, computed with plain torch."""
    p = weights.abs()
    p = p[p > 0]
    if p.numel() == 0:
        return 0.0
    p = p / p.sum()
    return float(-(p * p.log()).sum())


def entropy_of_paths(weights: Sequence[float]) -> Tensor:
    E = Entropy()
    acc = E.zero((), LIKE)
    for w in weights:
        acc = E.add(acc, E.lift(torch.tensor(w, dtype=F64)))
    return E.readout(acc)


@pytest.mark.parametrize(
    "weights",
    [[1.0, 1.0], [0.5, -0.5, 2.0], [3.0, 0.0, 1e-3, -7.0], [1.0] * 8, [1e-150, 1e150, 1.0]],
)
def test_entropy_readout_is_path_entropy(weights):
    got = entropy_of_paths(weights)
    assert not torch.isnan(got)
    assert math.isclose(float(got), path_entropy(torch.tensor(weights, dtype=F64)), abs_tol=1e-9)
    # the same through the ⊕-reduction override
    E = Entropy()
    summed = E.readout(E.sum(E.lift(torch.tensor(weights, dtype=F64)), 0))
    assert math.isclose(float(summed), float(got), rel_tol=1e-9, abs_tol=1e-12)


def test_entropy_uniform_is_log_n():
    for n in (1, 2, 5, 100):
        assert math.isclose(float(entropy_of_paths([2.5] * n)), math.log(n), abs_tol=1e-9)


def test_entropy_one_path_and_no_path_are_zero():
    E = Entropy()
    assert float(entropy_of_paths([-3.7])) == 0.0
    # one path of several edges
    path = E.mul(
        E.mul(E.lift(torch.tensor(2.0, dtype=F64)), E.lift(torch.tensor(-0.1, dtype=F64))),
        E.one((), LIKE),
    )
    assert abs(float(E.readout(path))) < 1e-12
    # no path
    assert float(E.readout(E.zero((), LIKE))) == 0.0
    assert float(entropy_of_paths([])) == 0.0
    assert float(entropy_of_paths([0.0, 0.0])) == 0.0
    assert float(E.readout(E.lift(torch.zeros(3, dtype=F64))).abs().sum()) == 0.0


def test_entropy_over_two_layer_paths():
    """matmul(lift(A), lift(B))[i, j]: paths i → k → j with weight |A_ik · B_kj|."""
    gen = torch.Generator().manual_seed(11)
    A, B = random_weights((3, 4), gen), random_weights((4, 5), gen)
    A[0] = 0.0
    E = Entropy()
    got = E.readout(E.matmul(E.lift(A), E.lift(B)))
    assert not torch.isnan(got).any()
    for i in range(3):
        for j in range(5):
            assert math.isclose(float(got[i, j]), path_entropy(A[i] * B[:, j]), abs_tol=1e-9)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(reals, min_size=0, max_size=12))
def test_entropy_property(weights):
    got = entropy_of_paths(weights)
    assert not torch.isnan(got)
    assert math.isclose(float(got), path_entropy(torch.tensor(weights, dtype=F64)), abs_tol=1e-9)
