"""The primitives with generic defaults against their definitions, evaluated here with
explicit folds of ⊕ and ⊗: sum, exclusive_scan and loo, softmax_backward, standardize,
matmul, index_add, sum_to."""

from __future__ import annotations

import itertools
import math

import torch

from ..base import Value
from .checker import Checker
from .values import at, at_row, expand, stack, take


def check_sum(ck: Checker) -> None:
    S = ck.S
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
        a = ck.pick(shape, zero_rows=True)
        nd = len(shape)
        d = tuple(range(nd)) if dims is None else (dims,) if isinstance(dims, int) else dims
        d = tuple(sorted({x % nd for x in d}))
        kept = [i for i in range(nd) if i not in d]
        perm = kept + list(d)
        kept_shape = [shape[i] for i in kept]
        flat = tuple(c.expand(shape).permute(perm).reshape(*kept_shape, -1) for c in a)
        length = flat[0].shape[-1]
        expected = ck.fold([at(flat, i) for i in range(length)], kept_shape)
        if keepdim:
            out_shape = [1 if i in d else s for i, s in enumerate(shape)]
            expected = tuple(c.reshape(out_shape) for c in expand(expected, kept_shape))
        got = S.sum(a, dims, keepdim)
        ck.compare(
            law,
            {"a": a},
            f"sum(a, dims={dims}, keepdim={keepdim})",
            got,
            "fold of ⊕",
            expected,
            elementwise=False,
        )
    # an input whose components are a non-contiguous (transposed, expanded) view
    a = ck.pick((4, 1, 3))
    a = tuple(c.expand(4, 2, 3).transpose(0, 2) for c in a)
    flat = tuple(c.reshape(3, 8) for c in a)
    expected = ck.fold([at(flat, i) for i in range(8)], (3,))
    ck.compare(
        law,
        {"a": a},
        "sum(a, dims=(1, 2)) of a strided view",
        S.sum(a, (1, 2)),
        "fold of ⊕",
        expected,
        elementwise=False,
    )


def check_scan_and_loo(ck: Checker) -> None:
    S = ck.S
    for shape, dim in (
        ((3, 5), 1),
        ((4, 3), 0),
        ((2, 7, 2), 1),
        ((3, 2), -1),
        ((3, 1), 1),
        ((2, 0), 1),
    ):
        a = ck.pick(shape, zero_rows=True)
        nd = len(shape)
        dd = dim % nd
        n = shape[dd]
        rest = [s for i, s in enumerate(shape) if i != dd]
        moved = tuple(c.expand(shape).movedim(dd, -1) for c in a)
        items = [at(moved, i) for i in range(n)]

        def assemble(values: list[Value]) -> Value:
            if not values:
                return S.zero(tuple(shape), ck.like)
            return tuple(c.movedim(-1, dd) for c in stack([expand(v, rest) for v in values], -1))

        scan = assemble([ck.fold(items[:i], rest) for i in range(n)])
        loo = assemble([ck.fold(items[:i] + items[i + 1 :], rest) for i in range(n)])

        def scan_law() -> None:
            ck.compare(
                "exclusive_scan == prefix fold of ⊕",
                {"a": a},
                f"exclusive_scan(a, dim={dim})",
                S.exclusive_scan(a, dim),
                "⊕ of the elements before",
                scan,
                elementwise=False,
            )

        def loo_law() -> None:
            ck.compare(
                "loo == ⊕ of the others",
                {"a": a},
                f"loo(a, dim={dim})",
                S.loo(a, dim),
                "⊕ of the other elements",
                loo,
                elementwise=False,
            )

        ck.run_law("exclusive_scan == prefix fold of ⊕", scan_law)
        ck.run_law("loo == ⊕ of the others", loo_law)


def check_softmax_backward(ck: Checker) -> None:
    """softmax_backward(a, p, dim)_i = a_i ⊗ lift(p_i(1 − p_i)) ⊕ (⊕_{j≠i} a_j ⊗ lift(p_j))
    ⊗ lift(−p_i), on probabilities with an exact 0 (a −inf logit) and a one-hot row."""
    S = ck.S
    law = "softmax_backward == its Jacobian's fold"
    for shape, dim in (((3, 5), 1), ((4, 3), 0), ((2, 3, 4), -1), ((3, 1), 1)):
        a = ck.pick(shape, zero_rows=True)
        nd = len(shape)
        dd = dim % nd
        n = shape[dd]
        rest = [s for i, s in enumerate(shape) if i != dd]
        logits = torch.randn((*rest, n), generator=ck.gen, dtype=torch.float64)
        flat = logits.view(-1, n)
        if flat.shape[0] >= 2 and n >= 2:
            flat[0, 0] = -math.inf
            flat[1, :-1] = -math.inf
        p_moved = torch.softmax(logits, -1).to(ck.dtype)
        probs = p_moved.movedim(-1, dd)
        moved = tuple(c.expand(shape).movedim(dd, -1) for c in a)
        items = [at(moved, i) for i in range(n)]
        p = [p_moved[..., i] for i in range(n)]
        weighted = [S.mul(items[j], S.lift(p[j])) for j in range(n)]
        terms = []
        for i in range(n):
            own = S.mul(items[i], S.lift(p[i] * (1 - p[i])))
            others = ck.fold(weighted[:i] + weighted[i + 1 :], rest)
            terms.append(expand(S.add(own, S.mul(others, S.lift(-p[i]))), rest))
        expected = tuple(c.movedim(-1, dd) for c in stack(terms, -1))
        ck.compare(
            law,
            {"a": a, "probs": probs},
            f"softmax_backward(a, probs, dim={dim})",
            S.softmax_backward(a, probs, dim),
            "the Jacobian's terms folded by ⊕ and ⊗",
            expected,
            elementwise=False,
        )


def check_standardize(ck: Checker) -> None:
    """standardize(a, c, s, -1)_j = g_c,j ⊕ (⊕_i g_c,i) ⊗ lift(−1) ⊗ lift(1/n), with
    g_c,j = a_j ⊗ lift(s) ⊕ (⊕_i a_i ⊗ lift(c_i)) ⊗ lift(−s³/2) ⊗ lift(2c_j/n): layer
    norm's composition, per row of n, on rows of a normalised input (one of width 1)."""
    S = ck.S
    law = "standardize == its composition's fold"
    for shape in ((3, 5), (2, 3, 4), (3, 1)):
        a = ck.pick(shape, zero_rows=True)
        x = torch.randn(shape, generator=ck.gen, dtype=torch.float64) * 2
        centred = (x - x.mean(-1, keepdim=True)).to(ck.dtype)
        rstd = torch.rsqrt((centred * centred).mean(-1, keepdim=True) + 1e-5)
        n, rest = shape[-1], list(shape[:-1])
        items = [at(a, j) for j in range(n)]
        c = [centred[..., j] for j in range(n)]
        s = rstd[..., 0]
        g_s = ck.fold([S.mul(items[j], S.lift(c[j])) for j in range(n)], rest)
        g_v = S.mul(g_s, S.lift(-0.5 * s.pow(3)))
        g_c = [
            S.add(S.mul(items[j], S.lift(s)), S.mul(g_v, S.lift(2.0 * c[j] / n))) for j in range(n)
        ]
        g_mu = S.mul(ck.fold(g_c, rest), S.lift(torch.full_like(s, -1.0)))
        back = S.mul(g_mu, S.lift(torch.full_like(s, 1.0 / n)))
        expected = stack([expand(S.add(g, back), rest) for g in g_c], -1)
        ck.compare(
            law,
            {"a": a, "centred": centred, "rstd": rstd},
            "standardize(a, centred, rstd, -1)",
            S.standardize(a, centred, rstd, (-1,)),
            "the composition's terms folded by ⊕ and ⊗",
            expected,
            elementwise=False,
        )


def check_matmul(ck: Checker) -> None:
    S = ck.S
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
        a, b = ck.pick(sa, zero_rows=True), ck.pick(sb, zero_rows=True)
        m, k, n = sa[-2], sa[-1], sb[-1]
        batch = tuple(torch.broadcast_shapes(sa[:-2], sb[:-2]))
        if m == 0 or n == 0:
            expected = S.zero((*batch, m, n), ck.like)
        else:
            rows = []
            for i in range(m):
                row = []
                for j in range(n):
                    terms = [S.mul(at(a, i, kk), at(b, kk, j)) for kk in range(k)]
                    row.append(ck.fold(terms, batch))
                rows.append(stack(row, -1))
            expected = stack(rows, -2)
        ck.compare(
            law,
            {"a": a, "b": b},
            "matmul(a, b)",
            S.matmul(a, b),
            "explicit ⊕_k a[..., i, k] ⊗ b[..., k, j]",
            expected,
            elementwise=False,
        )


def check_index_add(ck: Checker) -> None:
    S = ck.S
    law = "index_add == ⊕-scatter"
    for index, size, trail in (
        ([0, 2, 2, 1, 2, 0], 4, (3,)),
        ([1, 1, 1], 2, ()),
        ([3, 0, 3, 3, 1], 5, (2, 2)),
        ([], 3, (2,)),
    ):
        idx = torch.tensor(index, dtype=torch.int64)
        a = ck.pick((len(index), *trail))
        rows = []
        for r in range(size):
            members = [at_row(a, i) for i in range(len(index)) if index[i] == r]
            rows.append(ck.fold(members, trail))
        expected = stack(rows, 0)
        ck.compare(
            law,
            {"a": a, "index": idx},
            f"index_add(a, index, size={size})",
            S.index_add(a, idx, size),
            "explicit ⊕ of the rows with that index",
            expected,
            elementwise=False,
        )


def check_sum_to(ck: Checker) -> None:
    S = ck.S
    law = "sum_to == ⊕ over broadcast dims"
    for full, shape in (
        ((2, 3, 4), (3, 1)),
        ((2, 3, 4), (1, 3, 1)),
        ((2, 3, 4), (4,)),
        ((2, 3, 4), ()),
        ((2, 3, 4), (2, 3, 4)),
        ((3, 1, 2), (1, 1, 2)),
    ):
        a = ck.pick(full, zero_rows=True)
        lead = len(full) - len(shape)
        groups: dict[tuple[int, ...], list[Value]] = {}
        for idx in itertools.product(*(range(s) for s in full)):
            out = tuple(0 if shape[d] == 1 else idx[lead + d] for d in range(len(shape)))
            groups.setdefault(out, []).append(take(a, idx))
        flat = [
            ck.fold(groups.get(o, []), ()) for o in itertools.product(*(range(s) for s in shape))
        ]
        expected = tuple(c.reshape(shape) for c in stack(flat, 0))
        ck.compare(
            law,
            {"a": a},
            f"sum_to(a, {shape})",
            S.sum_to(a, shape),
            "explicit ⊕ over the broadcast dims",
            expected,
            elementwise=False,
        )


# -- driver --
