"""k best paths: the KBest semiring's readout and ``sa.top_paths`` against explicit path
enumeration (every path walked, its product taken, the list sorted)."""

from __future__ import annotations

import pytest
import torch
from model_zoo import tiny_inputs, tiny_model
from op_checks import Apply
from oracle import every_path
from small_models import MODELS, flat_index, record_with_paths

import semiring_autograd as sa
from semiring_autograd.explain.k_paths import top_paths_from
from semiring_autograd.explain.paths import Path, PathFinder

RTOL = 1e-12  # float64 models: products of the same float64 derivatives


def _enumerated(program, element: int, shape) -> dict[int, list[tuple[float, list]]]:
    return every_path(program, "out", flat_index(element, tuple(shape)), "x")


def _k_largest(values: list[float], k: int) -> list[float]:
    best = sorted(values, reverse=True)[:k]
    return best + [0.0] * (k - len(best))


def _nodes(path: Path) -> list[tuple[int, float]]:
    """The path's (flat element, local derivative) per edge, outside-patch steps dropped."""
    steps = [s for s in path.steps[1:] if s.module != "(outside sa.patch)"]
    return [(flat_index(s.index, s.shape), s.local_derivative) for s in steps]


def _assert_distinct_enumerated(paths: list[Path], enumerated: list[tuple[float, list]]):
    """Each returned path is one of the enumerated paths (same elements, same local
    derivatives), no enumerated path returned twice."""
    pool = [[(node[1], w) for node, w in trail] for _, trail in enumerated]
    for path in paths:
        got = _nodes(path)
        match = next(
            (
                n
                for n, want in enumerate(pool)
                if want is not None
                and [e for e, _ in want] == [e for e, _ in got]
                and all(w == pytest.approx(g, rel=RTOL) for (_, w), (_, g) in zip(want, got))
            ),
            None,
        )
        assert match is not None, f"not an enumerated path (or one returned twice):\n{path}"
        pool[match] = None


# ----- the KBest semiring ------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 5])
def test_k_best_satisfies_the_semiring_laws(k: int):
    sa.check_semiring(sa.KBest(k))


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("name", list(MODELS))
def test_k_best_readout_is_the_k_largest_path_weights(name: str, k: int):
    out, x, program = record_with_paths(name, sa.KBest(k))
    element = (1, 2)
    readout = sa.grad(out[element], x)
    assert readout.shape == (k, *x.shape)
    paths = _enumerated(program, element, out.shape)
    want = torch.zeros(k, x.numel(), dtype=torch.float64)
    for j, found in paths.items():
        want[:, j] = torch.tensor(_k_largest([abs(p) for p, _ in found], k), dtype=torch.float64)
    torch.testing.assert_close(readout.reshape(k, -1), want, rtol=RTOL, atol=0.0)


@pytest.mark.parametrize("name", list(MODELS))
def test_k_best_with_a_seed_over_every_output_element(name: str):
    k = 4
    out, x, program = record_with_paths(name, sa.KBest(k))
    seed = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    readout = sa.grad(out, x, seed=seed)
    weights: dict[int, list[float]] = {}
    for i in range(out.numel()):
        for j, found in every_path(program, "out", i, "x").items():
            weights.setdefault(j, []).extend(abs(float(seed.reshape(-1)[i]) * p) for p, _ in found)
    want = torch.zeros(k, x.numel(), dtype=torch.float64)
    for j, values in weights.items():
        want[:, j] = torch.tensor(_k_largest(values, k), dtype=torch.float64)
    torch.testing.assert_close(readout.reshape(k, -1), want, rtol=RTOL, atol=0.0)


def test_k_best_of_one_is_max_product():
    out, x, _ = record_with_paths("attention", sa.KBest(1))
    (best,) = sa.grad(out[2, 1], x)
    out, x, _ = record_with_paths("attention", sa.MaxProduct())
    torch.testing.assert_close(best, sa.grad(out[2, 1], x), rtol=RTOL, atol=0.0)


def test_k_best_counts_tied_paths_separately():
    """x @ ones(3, 4), summed: four paths of weight 1 from each x element."""
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    module = Apply(lambda t: (t @ torch.ones(3, 4, dtype=torch.float64)).sum())
    with sa.patch(module, sa.KBest(6)):
        out = module(x)
    readout = sa.grad(out, x)
    want = torch.tensor([1.0, 1, 1, 1, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(readout, want[:, None, None].expand(6, 2, 3), rtol=0, atol=0)


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("shape", [(1, 3, 40, 7), (2, 5, 37, 4), (1, 16, 76, 64), (3, 4, 3, 9)])
def test_k_best_matmul_by_a_weight_is_the_k_best_of_every_term(k: int, shape):
    """matmul_lift(a, w)[i, j] against every term a[i, l, r] · |w[l, j]| sorted: values on a
    grid of quarters (many ties), a third of the indices l without a path, batched."""
    count, m, l, n = shape
    g = torch.Generator().manual_seed(k * 100 + l)
    a = (torch.rand(count, m, l, k, generator=g, dtype=torch.float64) * 4).round() / 4
    a[:, :, ::3] = 0
    a = a.sort(-1, descending=True).values
    w = (torch.randn(count, l, n, generator=g, dtype=torch.float64) * 4).round() / 4
    got = torch.stack(sa.KBest(k).matmul_lift(tuple(a.unbind(-1)), w), -1)
    terms = a[:, :, :, None, :] * w.abs()[:, None, :, :, None]  # (count, m, l, n, k)
    every = terms.permute(0, 1, 3, 2, 4).reshape(count, m, n, l * k)
    want = every.sort(-1, descending=True).values[..., :k]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("groups", [1, 3, 8, 9])
def test_k_best_sum_over_a_middle_dim_is_the_k_best_of_its_entries(groups: int, keepdim):
    """sum over a middle dim (the fold of ⊕ up to 8 entries: GQA's query groups; the
    stack and top-k beyond) against every entry sorted: ties, rows without paths."""
    k = 4
    g = torch.Generator().manual_seed(groups)
    a = (torch.rand(2, groups, 5, k, generator=g, dtype=torch.float64) * 4).round() / 4
    a[:, :, ::2] = 0
    a = a.sort(-1, descending=True).values
    got = torch.stack(sa.KBest(k).sum(tuple(a.unbind(-1)), 1, keepdim), -1)
    every = a.permute(0, 2, 1, 3).reshape(2, 5, groups * k)
    every = torch.cat([every, every.new_zeros(2, 5, k)], -1)
    want = every.sort(-1, descending=True).values[..., :k]
    torch.testing.assert_close(got, want.unsqueeze(1) if keepdim else want, rtol=0, atol=0)


@pytest.mark.parametrize("k", [0, -1, 2.0, True])
def test_k_best_needs_a_positive_int(k):
    with pytest.raises(ValueError, match="positive int"):
        sa.KBest(k)


def test_k_best_instances_compare_by_k():
    assert sa.KBest(3) == sa.KBest(3) and sa.KBest(3) != sa.KBest(4)
    assert hash(sa.KBest(2)) == hash(sa.KBest(2)) and repr(sa.KBest(5)) == "KBest(5)"


# ----- top_paths ---------------------------------------------------------------------------
@pytest.mark.parametrize("semiring", [sa.MaxProduct(), sa.KBest(3)], ids=repr)
@pytest.mark.parametrize("element", [(1, 2), (0, 0)])
@pytest.mark.parametrize("name", list(MODELS))
def test_top_paths_are_the_k_best_enumerated_paths(name, element, semiring):
    k = 5
    out, x, program = record_with_paths(name, semiring)
    paths = _enumerated(program, element, out.shape)
    for j, found in paths.items():
        got = sa.top_paths(out[element], x, k, index=j)
        want = sorted((abs(p) for p, _ in found), reverse=True)[:k]
        assert len(got) == len(want)
        torch.testing.assert_close(
            torch.tensor([p.weight for p in got], dtype=torch.float64),
            torch.tensor(want, dtype=torch.float64),
            rtol=RTOL,
            atol=0.0,
        )
        _assert_distinct_enumerated(got, found)
        for path in got:
            product = 1.0
            for step in path.steps[1:]:
                product *= step.local_derivative
            assert abs(product) == pytest.approx(path.weight, rel=RTOL)


@pytest.mark.parametrize("name", list(MODELS))
def test_top_paths_returns_every_path_when_k_exceeds_them(name: str):
    out, x, program = record_with_paths(name, sa.MaxProduct())
    element = (1, 2)
    j = 4
    found = _enumerated(program, element, out.shape)[j]
    got = sa.top_paths(out[element], x, 10_000, index=j)
    assert (
        len(got) == len(found) == program.count_paths("out", flat_index(element, out.shape), "x")[j]
    )
    torch.testing.assert_close(
        torch.tensor([p.weight for p in got], dtype=torch.float64),
        torch.tensor(sorted((abs(p) for p, _ in found), reverse=True), dtype=torch.float64),
        rtol=RTOL,
        atol=0.0,
    )
    _assert_distinct_enumerated(got, found)


@pytest.mark.parametrize("which", ["max", "min"])
@pytest.mark.parametrize("name", list(MODELS))
def test_signed_top_paths_are_the_extreme_signed_products(name: str, which: str):
    k = 6
    out, x, program = record_with_paths(name, sa.SignedMaxProduct())
    for j, found in _enumerated(program, (1, 2), out.shape).items():
        got = sa.top_paths(out[1, 2], x, k, index=j, which=which)
        want = sorted((p for p, _ in found), reverse=which == "max")[:k]
        torch.testing.assert_close(
            torch.tensor([p.weight for p in got], dtype=torch.float64),
            torch.tensor(want, dtype=torch.float64),
            rtol=RTOL,
            atol=1e-300,
        )
        _assert_distinct_enumerated(got, found)


def test_top_paths_through_tied_paths_are_distinct():
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    module = Apply(lambda t: (t @ torch.ones(3, 4, dtype=torch.float64)).sum())
    with sa.patch(module, sa.MaxProduct(), paths=True):
        out = module(x)
    got = sa.top_paths(out, x, 3, index=(1, 2))
    assert [p.weight for p in got] == [1.0, 1.0, 1.0]
    columns = {next(s.index for s in p.steps if s.op == "matmul") for p in got}
    assert len(columns) == 3 and all(c[0] == 1 for c in columns)
    assert len(sa.top_paths(out, x, 9, index=(1, 2))) == 4


def test_top_paths_on_tiny_bert_match_k_best_and_top_path():
    """Through attention and layer norm (compositions): the k best paths' weights equal the
    KBest semiring's readout (a different algorithm: one semiring backward), the first path
    is top_path's."""
    model = tiny_model("BertForSequenceClassification")
    emb, mask = tiny_inputs(model)
    k, token = 4, 2
    readouts = {}
    for semiring in (sa.KBest(k), sa.MaxProduct()):
        x = emb.clone().requires_grad_()
        with sa.patch(model, semiring, paths=True):
            logits = model(inputs_embeds=x, attention_mask=mask).logits
        readouts[semiring] = (logits[1, 1], x)
    y, x = readouts[sa.MaxProduct()]
    best = sa.grad(y, x, retain_graph=True)
    index = (1, token, int(best[1, token].argmax()))
    paths = sa.top_paths(y, x, k, index=index)
    ky, kx = readouts[sa.KBest(k)]
    want = sa.grad(ky, kx, retain_graph=True)[(slice(None), *index)]
    torch.testing.assert_close(
        torch.tensor([p.weight for p in paths], dtype=torch.float64),
        want.double(),
        rtol=1e-5,
        atol=0.0,
    )
    first = sa.top_path(y, x, index)
    assert paths[0].weight == pytest.approx(first.weight, rel=1e-9)
    assert [(s.op, s.index) for s in paths[0].steps] == [(s.op, s.index) for s in first.steps]
    assert len({tuple((s.op, s.index) for s in p.steps) for p in paths}) == k
    assert any(s.attention is not None for p in paths for s in p.steps)
    for path in paths:
        product = 1.0
        for step in path.steps[1:]:
            product *= abs(step.local_derivative)
        assert product == pytest.approx(path.weight, rel=1e-6)
    on_kbest = top_paths_from(PathFinder(ky, kx), k, index)
    assert [p.weight for p in on_kbest] == pytest.approx([p.weight for p in paths], rel=1e-6)


def test_top_paths_refusals():
    out, x, _ = record_with_paths("mlp", sa.MaxProduct())
    for k in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="positive int"):
            sa.top_paths(out[1, 2], x, k)
    with pytest.raises(ValueError, match="which"):
        sa.top_paths(out[1, 2], x, 3, which="min")
    with pytest.raises(ValueError, match="scalar output"):
        sa.top_paths(out, x, 3)
    out, x, _ = record_with_paths("mlp", sa.Log())
    with pytest.raises(sa.SemiringAutogradError, match=r"MaxProduct.*KBest"):
        sa.top_paths(out[1, 2], x, 3)
