"""``sa.check_semiring``: verify the semiring laws, the lift homomorphism and every primitive.

A semiring (K, ⊕, ⊗, 0, 1) needs

* ⊕ associative and commutative with identity 0,
* ⊗ associative with identity 1 (commutativity is not required),
* ⊗ distributing over ⊕ from both sides, and 0 annihilating under ⊗;

and the backward pass additionally needs ``lift`` to be a monoid homomorphism from
(ℝ, ×) into (K, ⊗): lift(0) = 0, lift(1) = 1, lift(a·b) = lift(a) ⊗ lift(b).

The primitives with generic defaults (``sum``, ``loo``, ``exclusive_scan``, ``matmul``,
``index_add``, ``sum_to``) are checked against their definitions, evaluated here with
explicit folds of ``add``/``mul``, so a fast override that disagrees is caught.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from ..errors import SemiringLawError
from .base import Semiring, Value

_log = logging.getLogger(__name__)

# Numbers printed per component tensor in a counterexample.
_MAX_PRINTED = 48


class _LawFailure(Exception):
    """One violated law, with its counterexample (internal; collected into SemiringLawError)."""

    def __init__(self, law: str, detail: str) -> None:
        super().__init__(f"{law}: {detail}")
        self.law = law
        self.detail = detail


# ----- formatting -----------------------------------------------------------------------


def _fmt_number(x: float | bool | int) -> str:
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.17g}" if x == int(x) and abs(x) < 1e15 else f"{x:.10g}"


def _fmt_tensor(t: Tensor) -> str:
    """A tensor as nested lists (truncated when large)."""
    t = t.detach().cpu()
    if t.dim() == 0:
        return _fmt_number(t.item())
    flat = [_fmt_number(x) for x in t.reshape(-1).tolist()[:_MAX_PRINTED]]
    if t.numel() > _MAX_PRINTED:
        return f"<shape {tuple(t.shape)}: {', '.join(flat)}, ...>"
    it = iter(flat)

    def nest(shape: Sequence[int]) -> str:
        if not shape:
            return next(it)
        return "[" + ", ".join(nest(shape[1:]) for _ in range(shape[0])) + "]"

    return nest(tuple(t.shape))


def _fmt_value(v: Value | Tensor, index: tuple[int, ...] | None = None) -> str:
    """A value (tuple of components) or real tensor, at ``index`` when given."""
    if isinstance(v, Tensor):
        return _fmt_tensor(v if index is None else v[index])
    try:
        shape = _value_shape(v)
        comps = [c.expand(shape) for c in v]
    except Exception:  # shapes do not broadcast: print them as they are
        comps = list(v)
        index = None
    if index is not None:
        comps = [c[index] for c in comps]
    return "(" + ", ".join(_fmt_tensor(c) for c in comps) + ("," if len(comps) == 1 else "") + ")"


# ----- values -----------------------------------------------------------------------------


def _value_shape(v: Value) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*(c.shape for c in v)))


def _take(v: Value, index: Tensor | tuple) -> Value:
    """Elements ``index`` of a value (each component broadcast to the value's shape first)."""
    shape = _value_shape(v)
    return tuple(c.expand(shape)[index] for c in v)


def _at(v: Value, *index: int | slice) -> Value:
    """``v[..., *index]`` for every component."""
    shape = _value_shape(v)
    return tuple(c.expand(shape)[(Ellipsis, *index)] for c in v)


def _expand(v: Value, shape: Sequence[int]) -> Value:
    return tuple(c.expand(tuple(shape)) for c in v)


def _where(mask: Tensor, a: Value, b: Value) -> Value:
    """Elementwise choice between two values of the same shape."""
    return tuple(torch.where(mask, ca, cb) for ca, cb in zip(a, b))


def _stack(values: Sequence[Value], dim: int) -> Value:
    shape = torch.broadcast_shapes(*(_value_shape(v) for v in values))
    return tuple(
        torch.stack([v[i].expand(shape) for v in values], dim) for i in range(len(values[0]))
    )


def _mismatch(
    lhs: Value, rhs: Value, rtol: float, atol: float
) -> tuple[str, tuple[int, ...] | None] | None:
    """``None`` when the values agree, else (reason, first differing index or None).

    Equal infinities are equal, bool and integer components must match exactly, floating
    components up to |l - r| <= atol + rtol·max(|l|, |r|); a NaN on either side differs."""
    if len(lhs) != len(rhs):
        return f"{len(lhs)} components vs {len(rhs)}", None
    try:
        sl, sr = _value_shape(lhs), _value_shape(rhs)
    except RuntimeError as e:
        return f"components do not broadcast ({e})", None
    if sl != sr:
        return f"shape {sl} vs {sr}", None
    bad = torch.zeros(sl, dtype=torch.bool, device=lhs[0].device)
    reasons: list[str] = []
    for i, (cl, cr) in enumerate(zip(lhs, rhs)):
        cl, cr = cl.expand(sl), cr.to(cl.device).expand(sl)
        if cl.is_floating_point() != cr.is_floating_point() or (cl.dtype == torch.bool) != (
            cr.dtype == torch.bool
        ):
            return f"component {i} dtype {cl.dtype} vs {cr.dtype}", None
        if not cl.is_floating_point():
            diff = cl != cr
        else:
            cl64, cr64 = cl.double(), cr.double()
            nan = torch.isnan(cl64) | torch.isnan(cr64)
            if nan.any():
                reasons.append(f"NaN in component {i}")
            finite = torch.isfinite(cl64) & torch.isfinite(cr64)
            scale = torch.maximum(cl64.abs(), cr64.abs())
            dl = torch.where(finite, cl64, torch.zeros_like(cl64))
            dr = torch.where(finite, cr64, torch.zeros_like(cr64))
            close = torch.where(finite, (dl - dr).abs() <= atol + rtol * scale, cl64 == cr64)
            diff = nan | ~close
        bad |= diff
    if not bad.any():
        return None
    first = tuple(int(i) for i in bad.nonzero()[0].tolist())
    return ("; ".join(reasons) or "values differ"), first


def _nan_index(v: Value | Tensor) -> tuple[int, ...] | None:
    comps = (v,) if isinstance(v, Tensor) else v
    for c in comps:
        if c.is_floating_point() and torch.isnan(c).any():
            return tuple(int(i) for i in torch.isnan(c).nonzero()[0].tolist())
    return None


# ----- the checker ------------------------------------------------------------------------


class _Checker:
    """Runs every law on one semiring instance, collecting failures."""

    def __init__(
        self, S: Semiring, samples: int, seed: int, dtype: torch.dtype, rtol: float, atol: float
    ) -> None:
        self.S = S
        self.n = max(int(samples), 8)
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.rtol, self.atol = rtol, atol
        self.like = torch.empty((), dtype=dtype)
        self.failures: list[_LawFailure] = []
        self.info: list[str] = []

    # -- helpers --
    def fail(self, law: str, detail: str) -> None:
        self.failures.append(_LawFailure(law, detail))

    def run_law(self, law: str, fn: Callable[[], None]) -> None:
        """Run one law (skipped once it has failed); an exception inside the semiring is
        reported as that law failing."""
        if any(f.law == law for f in self.failures):
            return
        try:
            fn()
        except _LawFailure as f:
            self.failures.append(f)
        except Exception as e:  # noqa: BLE001 - any crash of the semiring is a failure
            self.fail(law, f"evaluating it raised {type(e).__name__}: {e}")

    def compare(
        self,
        law: str,
        inputs: dict[str, Value | Tensor],
        lhs_name: str,
        lhs: Value,
        rhs_name: str,
        rhs: Value,
        elementwise: bool = True,
    ) -> None:
        """Raise a _LawFailure with a counterexample unless ``lhs`` == ``rhs``."""
        bad = _mismatch(lhs, rhs, self.rtol, self.atol)
        if bad is None:
            return
        reason, index = bad
        lines = [f"{reason}"]
        if elementwise and index is not None:
            lines[0] += f" (sample {index[0] if len(index) == 1 else index})"
            for name, v in inputs.items():
                lines.append(f"  {name} = {_fmt_value(v, index)}")
            lines.append(f"  {lhs_name} = {_fmt_value(lhs, index)}")
            lines.append(f"  {rhs_name} = {_fmt_value(rhs, index)}")
        else:
            if index is not None:
                lines[0] += f" at output index {index}"
            for name, v in inputs.items():
                lines.append(f"  {name} = {_fmt_value(v)}")
            if index is not None:
                lines.append(f"  {lhs_name}{list(index)} = {_fmt_value(lhs, index)}")
                lines.append(f"  {rhs_name}{list(index)} = {_fmt_value(rhs, index)}")
            lines.append(f"  {lhs_name} = {_fmt_value(lhs)}")
            lines.append(f"  {rhs_name} = {_fmt_value(rhs)}")
        raise _LawFailure(law, "\n".join(lines))

    def compare_lazy(
        self,
        law: str,
        inputs: dict[str, Value | Tensor],
        lhs_name: str,
        lhs: Callable[[], Value],
        rhs_name: str,
        rhs: Callable[[], Value],
    ) -> None:
        """:meth:`compare` of two sides evaluated only now (inside :meth:`run_law`)."""
        self.compare(law, inputs, lhs_name, lhs(), rhs_name, rhs())

    def fold(self, values: Sequence[Value], shape: Sequence[int]) -> Value:
        """v_0 ⊕ v_1 ⊕ … left to right; ``zero`` of ``shape`` for no values."""
        if not values:
            return self.S.zero(tuple(shape), self.like)
        acc = values[0]
        for v in values[1:]:
            acc = self.S.add(acc, v)
        return _expand(acc, shape)

    def pick(self, shape: Sequence[int], zero_rows: bool = False) -> Value:
        """Pool samples arranged in ``shape`` (row 0 all zero when ``zero_rows``)."""
        idx = torch.randint(0, self.n, tuple(shape), generator=self.gen)
        if zero_rows and idx.dim() >= 1 and idx.shape[0] > 0:
            idx[0] = 0
            if idx.dim() >= 2 and idx.shape[-1] > 1:
                idx[..., -1] = 1
        return _take(self.pool, idx)

    # -- the pool of samples --
    def reals(self, n: int) -> Tensor:
        """Random reals: exact zeros, ±1, magnitudes in (0.05, 20) of either sign."""
        special = torch.tensor([0.0, 1.0, -1.0, 0.0, 2.0, -0.5, 3.5, -4.0, 0.25, 10.0])
        mag = torch.empty(n, dtype=torch.float64).uniform_(-3.0, 3.0, generator=self.gen).exp()
        sign = torch.where(torch.rand(n, generator=self.gen) < 0.5, -1.0, 1.0)
        x = sign * mag
        kind = torch.rand(n, generator=self.gen)
        x = torch.where(kind < 0.15, torch.zeros_like(x), x)
        x = torch.where((kind >= 0.15) & (kind < 0.25), sign, x)
        k = min(n, special.numel())
        x[:k] = special[:k]
        return x.to(self.dtype)

    def check_structure(self) -> None:
        S, n = self.S, self.n
        law = "value structure"
        x = self.reals(n)
        for what, v, shape in (
            ("zero((n,))", S.zero((n,), self.like), (n,)),
            ("one((n,))", S.one((n,), self.like), (n,)),
            ("zero(())", S.zero((), self.like), ()),
            ("lift(x)", S.lift(x), (n,)),
        ):
            if not isinstance(v, tuple) or not all(isinstance(c, Tensor) for c in v):
                raise _LawFailure(
                    law, f"{what} returned {type(v).__name__}, not a tuple of tensors"
                )
            if len(v) != S.n_components:
                raise _LawFailure(
                    law, f"{what} has {len(v)} components but n_components = {S.n_components}"
                )
            got = _value_shape(v)
            if got != tuple(shape):
                raise _LawFailure(law, f"{what} has shape {got}, expected {tuple(shape)}")
            for i, c in enumerate(v):
                if c.is_floating_point() and c.dtype != self.dtype:
                    raise _LawFailure(
                        law, f"{what} component {i} has dtype {c.dtype}, expected {self.dtype}"
                    )
            bad = _nan_index(v)
            if bad is not None:
                raise _LawFailure(
                    law,
                    f"{what} contains NaN at {bad}"
                    + (f" (x = {x[bad].item()})" if "x" in what else ""),
                )

    def build_pool(self) -> None:
        """n samples: zero, one, lifted reals and their ⊕/⊗ combinations."""
        S, n = self.S, self.n
        x1, x2, x3 = (
            self.reals(n),
            self.reals(n)[torch.randperm(n, generator=self.gen)],
            self.reals(n),
        )
        l1, l2, l3 = S.lift(x1), S.lift(x2), S.lift(x3)
        s12, p12 = S.add(l1, l2), S.mul(l1, l2)
        mixed = S.add(p12, l3)
        for name, v in (
            ("lift(x) ⊕ lift(y)", s12),
            ("lift(x) ⊗ lift(y)", p12),
            ("(lift(x) ⊗ lift(y)) ⊕ lift(z)", mixed),
        ):
            bad = _nan_index(v)
            if bad is not None:
                i = bad[0]
                raise _LawFailure(
                    "⊕/⊗ produce no NaN",
                    f"{name} is NaN for x = {x1[i].item()}, y = {x2[i].item()}"
                    + (f", z = {x3[i].item()}" if "z" in name else "")
                    + f": {_fmt_value(v, (i,))}",
                )
        kind = torch.arange(n) % 4
        pool = _expand(l1, (n,))
        for k, v in ((1, s12), (2, p12), (3, mixed)):
            pool = _where(kind == k, _expand(v, (n,)), pool)
        pool = _where(torch.arange(n) == 0, _expand(S.zero((n,), self.like), (n,)), pool)
        pool = _where(torch.arange(n) == 1, _expand(S.one((n,), self.like), (n,)), pool)
        self.pool: Value = tuple(c.clone() for c in pool)

    def triple(self) -> tuple[Value, Value, Value]:
        n = self.n
        return tuple(_take(self.pool, torch.randperm(n, generator=self.gen)) for _ in range(3))

    # -- the algebraic laws --
    def check_lift(self) -> None:
        S, n = self.S, self.n
        x = self.reals(n)
        zeros = torch.zeros(n, dtype=self.dtype)
        ones = torch.ones(n, dtype=self.dtype)

        def lift0() -> None:
            self.compare(
                "lift(0) == zero", {}, "lift(0)", S.lift(zeros), "zero", S.zero((n,), self.like)
            )

        def lift1() -> None:
            self.compare(
                "lift(1) == one", {}, "lift(1)", S.lift(ones), "one", S.one((n,), self.like)
            )

        def hom() -> None:
            y = x[torch.randperm(n, generator=self.gen)]
            self.compare(
                "lift homomorphism lift(x·y) == lift(x) ⊗ lift(y)",
                {"x": x, "y": y},
                "lift(x·y)",
                S.lift(x * y),
                "lift(x) ⊗ lift(y)",
                S.mul(S.lift(x), S.lift(y)),
            )

        self.run_law("lift(0) == zero", lift0)
        self.run_law("lift(1) == one", lift1)
        self.run_law("lift homomorphism lift(x·y) == lift(x) ⊗ lift(y)", hom)

    def check_axioms(self) -> None:
        S, n = self.S, self.n
        a, b, c = self.triple()
        abc = {"a": a, "b": b, "c": c}
        zero, one = S.zero((n,), self.like), S.one((n,), self.like)
        add, mul = S.add, S.mul
        laws: list[tuple[str, dict, str, Callable[[], Value], str, Callable[[], Value]]] = [
            (
                "⊕ associativity",
                abc,
                "(a ⊕ b) ⊕ c",
                lambda: add(add(a, b), c),
                "a ⊕ (b ⊕ c)",
                lambda: add(a, add(b, c)),
            ),
            (
                "⊕ commutativity",
                {"a": a, "b": b},
                "a ⊕ b",
                lambda: add(a, b),
                "b ⊕ a",
                lambda: add(b, a),
            ),
            ("⊕ identity (zero)", {"a": a}, "a ⊕ zero", lambda: add(a, zero), "a", lambda: a),
            ("⊕ identity (zero)", {"a": a}, "zero ⊕ a", lambda: add(zero, a), "a", lambda: a),
            (
                "⊗ associativity",
                abc,
                "(a ⊗ b) ⊗ c",
                lambda: mul(mul(a, b), c),
                "a ⊗ (b ⊗ c)",
                lambda: mul(a, mul(b, c)),
            ),
            ("⊗ identity (one)", {"a": a}, "a ⊗ one", lambda: mul(a, one), "a", lambda: a),
            ("⊗ identity (one)", {"a": a}, "one ⊗ a", lambda: mul(one, a), "a", lambda: a),
            (
                "left distributivity",
                abc,
                "a ⊗ (b ⊕ c)",
                lambda: mul(a, add(b, c)),
                "(a ⊗ b) ⊕ (a ⊗ c)",
                lambda: add(mul(a, b), mul(a, c)),
            ),
            (
                "right distributivity",
                abc,
                "(a ⊕ b) ⊗ c",
                lambda: mul(add(a, b), c),
                "(a ⊗ c) ⊕ (b ⊗ c)",
                lambda: add(mul(a, c), mul(b, c)),
            ),
            (
                "zero annihilates under ⊗",
                {"a": a},
                "a ⊗ zero",
                lambda: mul(a, zero),
                "zero",
                lambda: zero,
            ),
            (
                "zero annihilates under ⊗",
                {"a": a},
                "zero ⊗ a",
                lambda: mul(zero, a),
                "zero",
                lambda: zero,
            ),
        ]
        for law, inputs, ln, lf, rn, rf in laws:
            self.run_law(law, functools.partial(self.compare_lazy, law, inputs, ln, lf, rn, rf))

        def broadcasting() -> None:
            m = min(n, 8)
            col, row = _take(a, (slice(0, m), None)), _take(b, (None, slice(0, m)))
            full_col, full_row = _expand(col, (m, m)), _expand(row, (m, m))
            for sym, op in (("⊕", add), ("⊗", mul)):
                self.compare(
                    "⊕/⊗ broadcast elementwise",
                    {"a": full_col, "b": full_row},
                    f"a[:, None] {sym} b[None, :]",
                    op(col, row),
                    f"a {sym} b on expanded copies",
                    op(
                        tuple(t.contiguous() for t in full_col),
                        tuple(t.contiguous() for t in full_row),
                    ),
                )

        self.run_law("⊕/⊗ broadcast elementwise", broadcasting)

        def readout() -> None:
            r = S.readout(self.pool)
            if not isinstance(r, Tensor):
                raise _LawFailure(
                    "readout has no NaN", f"readout returned {type(r).__name__}, not a tensor"
                )
            bad = _nan_index(r)
            if bad is not None:
                raise _LawFailure(
                    "readout has no NaN",
                    f"readout of {_fmt_value(self.pool, (bad[-1],))} contains NaN",
                )

        self.run_law("readout has no NaN", readout)

        try:
            if _mismatch(mul(a, b), mul(b, a), self.rtol, self.atol) is None:
                self.info.append("⊗ is commutative on the samples")
            else:
                self.info.append("⊗ is not commutative (allowed)")
        except Exception:  # noqa: BLE001 - informational only
            pass

    # -- the primitives against their definitions --
    def check_sum(self) -> None:
        S = self.S
        law = "sum == fold of ⊕"
        cases: list[tuple[tuple[int, ...], int | tuple[int, ...] | None, bool]] = [
            ((2, 3, 4), 0, False),
            ((2, 3, 4), 1, True),
            ((2, 3, 4), -1, False),
            ((2, 3, 4), (0, 2), False),
            ((2, 3, 4), (-1, 0), True),
            ((2, 3, 4), None, False),
            ((2, 3, 4), None, True),
            ((5,), 0, False),
            ((3, 1), 1, False),
            ((3, 0, 2), 1, False),
            ((3, 0, 2), (0, 1), True),
        ]
        for shape, dims, keepdim in cases:
            a = self.pick(shape, zero_rows=True)
            nd = len(shape)
            d = tuple(range(nd)) if dims is None else (dims,) if isinstance(dims, int) else dims
            d = tuple(sorted({x % nd for x in d}))
            kept = [i for i in range(nd) if i not in d]
            perm = kept + list(d)
            kept_shape = [shape[i] for i in kept]
            flat = tuple(c.expand(shape).permute(perm).reshape(*kept_shape, -1) for c in a)
            length = flat[0].shape[-1]
            expected = self.fold([_at(flat, i) for i in range(length)], kept_shape)
            if keepdim:
                out_shape = [1 if i in d else s for i, s in enumerate(shape)]
                expected = tuple(c.reshape(out_shape) for c in _expand(expected, kept_shape))
            got = S.sum(a, dims, keepdim)
            self.compare(
                law,
                {"a": a},
                f"sum(a, dims={dims}, keepdim={keepdim})",
                got,
                "fold of ⊕",
                expected,
                elementwise=False,
            )
        # an input whose components are a non-contiguous (transposed, expanded) view
        a = self.pick((4, 1, 3))
        a = tuple(c.expand(4, 2, 3).transpose(0, 2) for c in a)
        flat = tuple(c.reshape(3, 8) for c in a)
        expected = self.fold([_at(flat, i) for i in range(8)], (3,))
        self.compare(
            law,
            {"a": a},
            "sum(a, dims=(1, 2)) of a strided view",
            S.sum(a, (1, 2)),
            "fold of ⊕",
            expected,
            elementwise=False,
        )

    def check_scan_and_loo(self) -> None:
        S = self.S
        for shape, dim in (
            ((3, 5), 1),
            ((4, 3), 0),
            ((2, 7, 2), 1),
            ((3, 2), -1),
            ((3, 1), 1),
            ((2, 0), 1),
        ):
            a = self.pick(shape, zero_rows=True)
            nd = len(shape)
            dd = dim % nd
            n = shape[dd]
            rest = [s for i, s in enumerate(shape) if i != dd]
            moved = tuple(c.expand(shape).movedim(dd, -1) for c in a)
            items = [_at(moved, i) for i in range(n)]

            def assemble(values: list[Value]) -> Value:
                if not values:
                    return S.zero(tuple(shape), self.like)
                return tuple(
                    c.movedim(-1, dd) for c in _stack([_expand(v, rest) for v in values], -1)
                )

            scan = assemble([self.fold(items[:i], rest) for i in range(n)])
            loo = assemble([self.fold(items[:i] + items[i + 1 :], rest) for i in range(n)])

            def scan_law() -> None:
                self.compare(
                    "exclusive_scan == prefix fold of ⊕",
                    {"a": a},
                    f"exclusive_scan(a, dim={dim})",
                    S.exclusive_scan(a, dim),
                    "⊕ of the elements before",
                    scan,
                    elementwise=False,
                )

            def loo_law() -> None:
                self.compare(
                    "loo == ⊕ of the others",
                    {"a": a},
                    f"loo(a, dim={dim})",
                    S.loo(a, dim),
                    "⊕ of the other elements",
                    loo,
                    elementwise=False,
                )

            self.run_law("exclusive_scan == prefix fold of ⊕", scan_law)
            self.run_law("loo == ⊕ of the others", loo_law)

    def check_matmul(self) -> None:
        S = self.S
        law = "matmul == ⊕ of ⊗ products"
        for sa, sb in (
            ((3, 4), (4, 2)),
            ((1, 3), (3, 1)),
            ((2, 1, 2, 3), (3, 3, 2)),
            ((2, 2, 2), (1, 2, 3)),
            ((2, 0), (0, 3)),
            ((0, 3), (3, 2)),
            ((2, 3), (3, 0)),
        ):
            a, b = self.pick(sa, zero_rows=True), self.pick(sb, zero_rows=True)
            m, k, n = sa[-2], sa[-1], sb[-1]
            batch = tuple(torch.broadcast_shapes(sa[:-2], sb[:-2]))
            if m == 0 or n == 0:
                expected = S.zero((*batch, m, n), self.like)
            else:
                rows = []
                for i in range(m):
                    row = []
                    for j in range(n):
                        terms = [S.mul(_at(a, i, kk), _at(b, kk, j)) for kk in range(k)]
                        row.append(self.fold(terms, batch))
                    rows.append(_stack(row, -1))
                expected = _stack(rows, -2)
            self.compare(
                law,
                {"a": a, "b": b},
                "matmul(a, b)",
                S.matmul(a, b),
                "explicit ⊕_k a[..., i, k] ⊗ b[..., k, j]",
                expected,
                elementwise=False,
            )

    def check_index_add(self) -> None:
        S = self.S
        law = "index_add == ⊕-scatter"
        for index, size, trail in (
            ([0, 2, 2, 1, 2, 0], 4, (3,)),
            ([1, 1, 1], 2, ()),
            ([3, 0, 3, 3, 1], 5, (2, 2)),
            ([], 3, (2,)),
        ):
            idx = torch.tensor(index, dtype=torch.int64)
            a = self.pick((len(index), *trail))
            rows = []
            for r in range(size):
                members = [_at_row(a, i) for i in range(len(index)) if index[i] == r]
                rows.append(self.fold(members, trail))
            expected = _stack(rows, 0)
            self.compare(
                law,
                {"a": a, "index": idx},
                f"index_add(a, index, size={size})",
                S.index_add(a, idx, size),
                "explicit ⊕ of the rows with that index",
                expected,
                elementwise=False,
            )

    def check_sum_to(self) -> None:
        S = self.S
        law = "sum_to == ⊕ over broadcast dims"
        for full, shape in (
            ((2, 3, 4), (3, 1)),
            ((2, 3, 4), (1, 3, 1)),
            ((2, 3, 4), (4,)),
            ((2, 3, 4), ()),
            ((2, 3, 4), (2, 3, 4)),
            ((3, 1, 2), (1, 1, 2)),
        ):
            a = self.pick(full, zero_rows=True)
            lead = len(full) - len(shape)
            groups: dict[tuple[int, ...], list[Value]] = {}
            for idx in itertools.product(*(range(s) for s in full)):
                out = tuple(0 if shape[d] == 1 else idx[lead + d] for d in range(len(shape)))
                groups.setdefault(out, []).append(_take(a, idx))
            flat = [
                self.fold(groups.get(o, []), ())
                for o in itertools.product(*(range(s) for s in shape))
            ]
            expected = tuple(c.reshape(shape) for c in _stack(flat, 0))
            self.compare(
                law,
                {"a": a},
                f"sum_to(a, {shape})",
                S.sum_to(a, shape),
                "explicit ⊕ over the broadcast dims",
                expected,
                elementwise=False,
            )

    # -- driver --
    def run(self) -> None:
        try:
            self.check_structure()
            self.build_pool()
        except _LawFailure as f:
            self.failures.append(f)
            return
        except Exception as e:  # noqa: BLE001 - the basics crashed: nothing else can run
            self.fail(
                "basic operations", f"evaluating zero/one/lift/⊕/⊗ raised {type(e).__name__}: {e}"
            )
            return
        self.check_lift()
        self.check_axioms()
        self.run_law("sum == fold of ⊕", self.check_sum)
        self.check_scan_and_loo()
        self.run_law("matmul == ⊕ of ⊗ products", self.check_matmul)
        self.run_law("index_add == ⊕-scatter", self.check_index_add)
        self.run_law("sum_to == ⊕ over broadcast dims", self.check_sum_to)


def _at_row(v: Value, i: int) -> Value:
    shape = _value_shape(v)
    return tuple(c.expand(shape)[i] for c in v)


def check_semiring(
    S: Semiring | type[Semiring],
    *,
    samples: int = 64,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    rtol: float = 1e-6,
    atol: float = 1e-9,
) -> None:
    """Verify that ``S`` is a semiring with a homomorphic ``lift`` and correct primitives.

    Checks, on ``samples`` random values (lifted reals, including exact zeros, ±1, negatives
    and magnitudes above and below 1, and their ⊕/⊗ combinations):
    (a ⊕ b) ⊕ c = a ⊕ (b ⊕ c), a ⊕ b = b ⊕ a, a ⊕ 0 = a, (a ⊗ b) ⊗ c = a ⊗ (b ⊗ c),
    a ⊗ 1 = 1 ⊗ a = a, a ⊗ (b ⊕ c) = a⊗b ⊕ a⊗c, (a ⊕ b) ⊗ c = a⊗c ⊕ b⊗c, a ⊗ 0 = 0 ⊗ a = 0,
    lift(0) = 0, lift(1) = 1, lift(xy) = lift(x) ⊗ lift(y); and that ``sum``, ``loo``,
    ``exclusive_scan``, ``matmul``, ``index_add`` and ``sum_to`` equal explicit folds of
    ⊕/⊗. ⊗ need not be commutative. Values agree when every component agrees within
    ``rtol``/``atol`` (equal infinities agree, bool components exactly); NaN never agrees.
    Comparison is componentwise, so each element needs one canonical representation
    (e.g. a single representation of zero). ``samples`` is at least 8.

    A class is instantiated with no arguments. Raises :class:`SemiringLawError` naming the
    semiring, every violated law and a counterexample for each; returns None otherwise.
    """
    if isinstance(S, type):
        if not issubclass(S, Semiring):
            raise TypeError(f"check_semiring needs a Semiring subclass, got {S!r}")
        S = S()
    if not isinstance(S, Semiring):
        raise TypeError(f"check_semiring needs a Semiring, got {type(S).__name__}")
    checker = _Checker(S, samples, seed, dtype, rtol, atol)
    checker.run()
    label = f"{type(S).__name__} (name={S.name!r})"
    for line in checker.info:
        _log.info("%s: %s", label, line)
    if checker.failures:
        laws = list(dict.fromkeys(f.law for f in checker.failures))
        header = f"semiring {label} violates {len(laws)} law(s): " + "; ".join(laws)
        body = "\n".join(f"- {f.law}: {f.detail}" for f in checker.failures)
        err = SemiringLawError(f"{header}\n{body}")
        err.failures = [(f.law, f.detail) for f in checker.failures]  # type: ignore[attr-defined]
        raise err
