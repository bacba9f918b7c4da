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

import logging

import torch

from ...errors import SemiringLawError
from ..base import Semiring
from .algebra import check_axioms, check_lift, check_structure
from .checker import Checker, LawFailure
from .primitives import (
    check_index_add,
    check_matmul,
    check_scan_and_loo,
    check_softmax_backward,
    check_standardize,
    check_sum,
    check_sum_to,
)

_log = logging.getLogger(__name__)


def _run(ck: Checker) -> None:
    """Every law, in order; the rest are skipped when the basic operations fail."""
    try:
        check_structure(ck)
        ck.build_pool()
    except LawFailure as f:
        ck.failures.append(f)
        return
    except Exception as e:  # noqa: BLE001 - the basics crashed: nothing else can run
        ck.fail("basic operations", f"evaluating zero/one/lift/⊕/⊗ raised {type(e).__name__}: {e}")
        return
    check_lift(ck)
    check_axioms(ck)
    ck.run_law("sum == fold of ⊕", lambda: check_sum(ck))
    check_scan_and_loo(ck)
    ck.run_law("softmax_backward == its Jacobian's fold", lambda: check_softmax_backward(ck))
    ck.run_law("standardize == its composition's fold", lambda: check_standardize(ck))
    ck.run_law("matmul == ⊕ of ⊗ products", lambda: check_matmul(ck))
    ck.run_law("index_add == ⊕-scatter", lambda: check_index_add(ck))
    ck.run_law("sum_to == ⊕ over broadcast dims", lambda: check_sum_to(ck))


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
    ``exclusive_scan``, ``softmax_backward``, ``standardize``, ``matmul``, ``index_add`` and
    ``sum_to`` equal explicit folds of ⊕/⊗. ⊗ need not be commutative. Values agree when every component agrees within
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
    checker = Checker(S, samples, seed, dtype, rtol, atol)
    _run(checker)
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
