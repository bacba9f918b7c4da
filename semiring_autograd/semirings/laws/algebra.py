"""The algebraic laws: the shape of values, lift a monoid homomorphism, the semiring axioms,
elementwise broadcasting and a readout without NaN."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from ..base import Value
from .checker import Checker, LawFailure
from .values import expand, fmt_value, mismatch, nan_index, take, value_shape


def check_structure(ck: Checker) -> None:
    S, n = ck.S, ck.n
    law = "value structure"
    x = ck.reals(n)
    for what, v, shape in (
        ("zero((n,))", S.zero((n,), ck.like), (n,)),
        ("one((n,))", S.one((n,), ck.like), (n,)),
        ("zero(())", S.zero((), ck.like), ()),
        ("lift(x)", S.lift(x), (n,)),
    ):
        if not isinstance(v, tuple) or not all(isinstance(c, Tensor) for c in v):
            raise LawFailure(law, f"{what} returned {type(v).__name__}, not a tuple of tensors")
        if len(v) != S.n_components:
            raise LawFailure(
                law, f"{what} has {len(v)} components but n_components = {S.n_components}"
            )
        got = value_shape(v)
        if got != tuple(shape):
            raise LawFailure(law, f"{what} has shape {got}, expected {tuple(shape)}")
        for i, c in enumerate(v):
            if c.is_floating_point() and c.dtype != ck.dtype:
                raise LawFailure(
                    law, f"{what} component {i} has dtype {c.dtype}, expected {ck.dtype}"
                )
        bad = nan_index(v)
        if bad is not None:
            raise LawFailure(
                law,
                f"{what} contains NaN at {bad}"
                + (f" (x = {x[bad].item()})" if "x" in what else ""),
            )


def check_lift(ck: Checker) -> None:
    S, n = ck.S, ck.n
    x = ck.reals(n)
    zeros = torch.zeros(n, dtype=ck.dtype)
    ones = torch.ones(n, dtype=ck.dtype)

    def lift0() -> None:
        ck.compare("lift(0) == zero", {}, "lift(0)", S.lift(zeros), "zero", S.zero((n,), ck.like))

    def lift1() -> None:
        ck.compare("lift(1) == one", {}, "lift(1)", S.lift(ones), "one", S.one((n,), ck.like))

    def hom() -> None:
        y = x[torch.randperm(n, generator=ck.gen)]
        ck.compare(
            "lift homomorphism lift(x·y) == lift(x) ⊗ lift(y)",
            {"x": x, "y": y},
            "lift(x·y)",
            S.lift(x * y),
            "lift(x) ⊗ lift(y)",
            S.mul(S.lift(x), S.lift(y)),
        )

    ck.run_law("lift(0) == zero", lift0)
    ck.run_law("lift(1) == one", lift1)
    ck.run_law("lift homomorphism lift(x·y) == lift(x) ⊗ lift(y)", hom)


def check_axioms(ck: Checker) -> None:
    S, n = ck.S, ck.n
    a, b, c = ck.triple()
    abc = {"a": a, "b": b, "c": c}
    zero, one = S.zero((n,), ck.like), S.one((n,), ck.like)
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
        ck.run_law(law, functools.partial(ck.compare_lazy, law, inputs, ln, lf, rn, rf))

    def broadcasting() -> None:
        m = min(n, 8)
        col, row = take(a, (slice(0, m), None)), take(b, (None, slice(0, m)))
        full_col, full_row = expand(col, (m, m)), expand(row, (m, m))
        for sym, op in (("⊕", add), ("⊗", mul)):
            ck.compare(
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

    ck.run_law("⊕/⊗ broadcast elementwise", broadcasting)

    def readout() -> None:
        r = S.readout(ck.pool)
        if not isinstance(r, Tensor):
            raise LawFailure(
                "readout has no NaN", f"readout returned {type(r).__name__}, not a tensor"
            )
        bad = nan_index(r)
        if bad is not None:
            raise LawFailure(
                "readout has no NaN",
                f"readout of {fmt_value(ck.pool, (bad[-1],))} contains NaN",
            )

    ck.run_law("readout has no NaN", readout)

    try:
        if mismatch(mul(a, b), mul(b, a), ck.rtol, ck.atol) is None:
            ck.info.append("⊗ is commutative on the samples")
        else:
            ck.info.append("⊗ is not commutative (allowed)")
    except Exception as e:  # noqa: BLE001 - a probe for an info line, not a law
        ck.info.append(f"⊗ commutativity not probed: {type(e).__name__}: {e}")


# -- the primitives against their definitions --
