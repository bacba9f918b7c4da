"""A matmul by a lifted weight on the live rows and columns of its message only
(``tensor_ops.on_live_rows``): against the product's definition, ⊕_k a[i, k] ⊗ lift(w[k, j])
folded over k, in float64, for every built-in semiring that prunes; and the size bound
under which every row is computed."""

from __future__ import annotations

import importlib

import pytest
import torch

import semiring_autograd as sa
from semiring_autograd.semirings import log_space, tensor_ops

PRUNING = ("MaxProduct", "SignedMaxProduct", "Log", "Entropy", "Boolean", "Counting")


def _definition(S, a, w):
    """⊕_k a[..., k] ⊗ lift(w[k, :]), folded over k with the semiring's own ⊕ and ⊗."""
    lifted = S.lift(w)
    out = None
    for k in range(w.shape[0]):
        term = S.mul(tuple(c[..., k : k + 1] for c in a), tuple(c[k] for c in lifted))
        out = term if out is None else S.add(out, term)
    return out


def _message(S, rows: int, k: int, live_rows: list[int], live_columns: list[int]):
    """lift(x) of a random x (rows, k) that is 0 (the semiring zero once lifted) outside the
    given rows and columns."""
    gen = torch.Generator().manual_seed(rows * 7 + k)
    x = torch.rand(rows, k, generator=gen, dtype=torch.float64) + 0.5
    keep = torch.zeros(rows, k, dtype=torch.bool)
    keep[torch.tensor(live_rows)[:, None], torch.tensor(live_columns)] = True
    x = torch.where(keep, x, 0.0)
    a = S.lift(x)
    return tuple(c.clone() for c in a)  # components of their own storage


def _weight(k: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(k + n)
    w = torch.randn(k, n, generator=gen, dtype=torch.float64)
    w[0, :3] = 0.0  # no edge
    return w


def _assert_value(got, expected) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if e.dtype == torch.bool:
            assert torch.equal(g, e)
        else:
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("name", PRUNING)
def test_pruned_rows_and_columns_match_the_definition(name, monkeypatch):
    """With the size bound lifted, a message with rows and columns without a term takes the
    pruned product, which equals the definition (a dead row's result is the zero)."""
    monkeypatch.setattr(tensor_ops, "PRUNE_PRODUCTS", 0)
    S = getattr(sa, name)()
    a = _message(S, 9, 12, live_rows=[1, 4, 8], live_columns=[0, 3, 5, 11])
    w = _weight(12, 7)
    taken = []
    run = tensor_ops.on_live_rows

    def spy(*args, **kwargs):
        result = run(*args, **kwargs)
        taken.append(result is not None)
        return result

    # the module defining the semiring's matmul_lift, or log_space's matmul_by_weight for
    # the log-space semirings, calls on_live_rows by its own name
    for module in (importlib.import_module(type(S).matmul_lift.__module__), log_space):
        if hasattr(module, "on_live_rows"):
            monkeypatch.setattr(module, "on_live_rows", spy)
    _assert_value(S.matmul_lift(a, w), _definition(S, a, w))
    assert taken == [True]


@pytest.mark.parametrize("name", PRUNING)
def test_small_products_compute_every_row(name):
    """Below the size bound the product is not pruned (finding the live rows costs more than
    the rows save), and equals the definition."""
    S = getattr(sa, name)()
    a = _message(S, 6, 10, live_rows=[5], live_columns=[2])
    w = _weight(10, 4)
    assert 6 * 10 * 4 < tensor_ops.PRUNE_PRODUCTS
    assert tensor_ops.on_live_rows(a, S.terms, w, S._matmul_lift, (0.0,)) is None
    _assert_value(S.matmul_lift(a, w), _definition(S, a, w))


@pytest.mark.parametrize("name", ["MaxProduct", "Log"])
def test_large_products_are_pruned(name):
    """Above the size bound a message with one live row takes the pruned product."""
    S = getattr(sa, name)()
    rows, k, n = 64, 512, 256
    assert rows * k * n >= tensor_ops.PRUNE_PRODUCTS
    a = _message(S, rows, k, live_rows=[63], live_columns=list(range(0, k, 5)))
    w = _weight(k, n)
    empty = tuple(float(c.reshape(-1)[0]) for c in S.zero((1,), w))
    pruned = tensor_ops.on_live_rows(a, S.terms, w, S._matmul_lift, empty)
    assert pruned is not None
    _assert_value(pruned, _definition(S, a, w))
