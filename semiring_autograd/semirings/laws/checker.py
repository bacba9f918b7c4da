"""The checker: one semiring instance, its pool of sample values, and the bookkeeping of
laws run, failed and the counterexamples found."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from ..base import Semiring, Value
from .values import expand, fmt_value, mismatch, nan_index, take, where


class LawFailure(Exception):
    """One violated law, with its counterexample (internal; collected into SemiringLawError)."""

    def __init__(self, law: str, detail: str) -> None:
        super().__init__(f"{law}: {detail}")
        self.law = law
        self.detail = detail


# ----- formatting -----------------------------------------------------------------------


class Checker:
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
        self.failures: list[LawFailure] = []
        self.info: list[str] = []

    # -- helpers --
    def fail(self, law: str, detail: str) -> None:
        self.failures.append(LawFailure(law, detail))

    def run_law(self, law: str, fn: Callable[[], None]) -> None:
        """Run one law (skipped once it has failed); an exception inside the semiring is
        reported as that law failing."""
        if any(f.law == law for f in self.failures):
            return
        try:
            fn()
        except LawFailure as f:
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
        """Raise a LawFailure with a counterexample unless ``lhs`` == ``rhs``."""
        bad = mismatch(lhs, rhs, self.rtol, self.atol)
        if bad is None:
            return
        reason, index = bad
        lines = [f"{reason}"]
        if elementwise and index is not None:
            lines[0] += f" (sample {index[0] if len(index) == 1 else index})"
            for name, v in inputs.items():
                lines.append(f"  {name} = {fmt_value(v, index)}")
            lines.append(f"  {lhs_name} = {fmt_value(lhs, index)}")
            lines.append(f"  {rhs_name} = {fmt_value(rhs, index)}")
        else:
            if index is not None:
                lines[0] += f" at output index {index}"
            for name, v in inputs.items():
                lines.append(f"  {name} = {fmt_value(v)}")
            if index is not None:
                lines.append(f"  {lhs_name}{list(index)} = {fmt_value(lhs, index)}")
                lines.append(f"  {rhs_name}{list(index)} = {fmt_value(rhs, index)}")
            lines.append(f"  {lhs_name} = {fmt_value(lhs)}")
            lines.append(f"  {rhs_name} = {fmt_value(rhs)}")
        raise LawFailure(law, "\n".join(lines))

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
        return expand(acc, shape)

    def pick(self, shape: Sequence[int], zero_rows: bool = False) -> Value:
        """Pool samples arranged in ``shape`` (row 0 all zero when ``zero_rows``)."""
        idx = torch.randint(0, self.n, tuple(shape), generator=self.gen)
        if zero_rows and idx.dim() >= 1 and idx.shape[0] > 0:
            idx[0] = 0
            if idx.dim() >= 2 and idx.shape[-1] > 1:
                idx[..., -1] = 1
        return take(self.pool, idx)

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
            bad = nan_index(v)
            if bad is not None:
                i = bad[0]
                raise LawFailure(
                    "⊕/⊗ produce no NaN",
                    f"{name} is NaN for x = {x1[i].item()}, y = {x2[i].item()}"
                    + (f", z = {x3[i].item()}" if "z" in name else "")
                    + f": {fmt_value(v, (i,))}",
                )
        kind = torch.arange(n) % 4
        pool = expand(l1, (n,))
        for k, v in ((1, s12), (2, p12), (3, mixed)):
            pool = where(kind == k, expand(v, (n,)), pool)
        pool = where(torch.arange(n) == 0, expand(S.zero((n,), self.like), (n,)), pool)
        pool = where(torch.arange(n) == 1, expand(S.one((n,), self.like), (n,)), pool)
        self.pool: Value = tuple(c.clone() for c in pool)

    def triple(self) -> tuple[Value, Value, Value]:
        n = self.n
        return tuple(take(self.pool, torch.randperm(n, generator=self.gen)) for _ in range(3))

    # -- the algebraic laws --
