"""Top paths vs explicit path enumeration, and their structure on a Hugging Face model."""

from __future__ import annotations

import pytest
import torch
from hf_models import tiny_inputs, tiny_model
from oracle import best_paths
from small_models import MODELS, flat_index, record_with_paths, setup_model

import semiring_autograd as sa
from semiring_autograd.ops.decompositions import DECOMPOSITIONS
from semiring_autograd.engine.graph import reachable_nodes


@pytest.mark.parametrize("element", [(1, 2), (0, 0)])
@pytest.mark.parametrize("name", list(MODELS))
def test_top_path_is_the_argmax_of_path_enumeration(name: str, element: tuple[int, int]):
    """Every input element: the same nodes, the same local derivatives, the same weight."""
    out, x, program = record_with_paths(name, sa.MaxProduct())
    flat_out = flat_index(element, tuple(out.shape))
    finder = sa.PathFinder(out[element], x)
    oracle = best_paths(program, "out", flat_out, "x")
    assert oracle, "the oracle found no path"
    for j, (product, trail) in oracle.items():
        path = finder.path(j)
        # out[element] is taken outside the patch: its select steps are weight-1 edges
        outside = [s for s in path.steps[1:] if s.module == "(outside sa.patch)"]
        assert [s.op for s in outside] == ["SelectBackward0"] * 2
        assert all(s.local_derivative == 1.0 for s in outside)
        steps = [s for s in path.steps[1:] if s.module != "(outside sa.patch)"]
        assert [flat_index(s.index, s.shape) for s in steps] == [node[1] for node, _ in trail]
        assert [s.shape for s in steps] == [tuple(program.values[n[0]].shape) for n, _ in trail]
        torch.testing.assert_close(
            torch.tensor([s.local_derivative for s in steps], dtype=torch.float64),
            torch.tensor([w for _, w in trail], dtype=torch.float64),
            rtol=1e-12,
            atol=0.0,
        )
        assert path.weight == pytest.approx(abs(product), rel=1e-12)
        assert path.weight == pytest.approx(float(finder.readout.reshape(-1)[j]), rel=1e-12)


@pytest.mark.parametrize("which", ["max", "min"])
def test_signed_top_path_is_the_extreme_signed_product(which: str):
    out, x, program = record_with_paths("mlp", sa.SignedMaxProduct())
    finder = sa.PathFinder(out[1, 2], x, which=which)
    oracle = best_paths(program, "out", flat_index((1, 2), tuple(out.shape)), "x", which=which)
    readout = sa.grad(out[1, 2], x, retain_graph=True)[0 if which == "max" else 1]
    for j, (product, trail) in oracle.items():
        path = finder.path(j)
        assert path.weight == pytest.approx(product, rel=1e-12)
        assert path.weight == pytest.approx(float(readout.reshape(-1)[j]), rel=1e-12)
        signed = 1.0
        for step in path.steps[1:]:
            signed *= step.local_derivative
        assert signed == pytest.approx(product, rel=1e-12)


def test_default_index_is_the_best_element_and_path_prints():
    out, x, _ = record_with_paths("attention", sa.MaxProduct())
    path = sa.top_path(out[2, 1], x)
    readout = sa.grad(out[2, 1], x)
    assert path.steps[0].index == tuple(int(i) for i in divmod(int(readout.argmax()), 4))
    assert path.weight == pytest.approx(float(readout.max()), rel=1e-12)
    text = path.format(hide_identity=False)
    assert "MaxProduct path" in text and "v  linear" in text and "(outside sa.patch)" in text
    assert "(outside sa.patch)" not in str(path) and "2 steps of weight 1 hidden" in str(path)


def test_tiny_bert_path_names_modules_indices_and_edges():
    model = tiny_model("BertForSequenceClassification")
    modules = dict(model.named_modules())
    emb, mask = tiny_inputs(model)
    x = emb.clone().requires_grad_()
    with sa.patch(model, sa.MaxProduct(), paths=True):
        logits = model(inputs_embeds=x, attention_mask=mask).logits
    finder = sa.PathFinder(logits[1, 1], x)
    # a token other than [CLS] reaches the pooled [CLS] output only through attention
    token = 2
    path = finder.path((1, token, int(finder.readout[1, token].argmax())))
    product = 1.0
    for prev, step in zip(path.steps, path.steps[1:]):
        assert step.module in modules or step.module == "(outside sa.patch)", step.module
        assert len(step.index) == len(step.shape)
        assert all(0 <= i < n for i, n in zip(step.index, step.shape))
        assert step.local_derivative != 0
        product *= abs(step.local_derivative)
        if step.op == "linear":  # the edge is W[i, j] of that module's own weight
            weight = modules[step.module].weight
            assert step.index[:-1] == prev.index[:-1]
            want = weight.detach()[step.index[-1], prev.index[-1]]
            assert step.local_derivative == pytest.approx(float(want), rel=1e-12)
    assert product == pytest.approx(path.weight, rel=1e-9)
    assert path.weight == pytest.approx(float(finder.readout[1, token].max()), rel=1e-12)
    ops = [s.op for s in path.steps]
    assert "scaled_dot_product_attention: softmax" in ops or any(
        o.startswith("scaled_dot_product_attention: matmul") for o in ops
    )
    assert any(s.module.endswith("attention.self") for s in path.steps)


def test_paths_need_recording_and_a_max_semiring():
    model, x, _ = setup_model("mlp")
    x = x.clone().requires_grad_()
    with sa.patch(model, sa.MaxProduct()):
        out = model(x)
    nodes = reachable_nodes([out.grad_fn])
    assert any(sa.node_info(n) is not None for n in nodes)
    assert all(sa.node_info(n) is None or sa.node_info(n).replay is None for n in nodes)
    with pytest.raises(sa.SemiringAutogradError, match="paths=True"):
        sa.top_path(out[0, 0], x)
    with sa.patch(model, sa.Log(), paths=True):
        out = model(x)
    with pytest.raises(sa.SemiringAutogradError, match="MaxProduct"):
        sa.top_path(out[0, 0], x)
    with sa.patch(model, sa.MaxProduct(), paths=True):
        out = model(x)
    with pytest.raises(ValueError, match="scalar output"):
        sa.top_path(out, x)


_COMPOSITES = {
    "layer_norm": (
        lambda x, w, b: torch.nn.functional.layer_norm(x, (4,), w, b),
        lambda x, w, b: DECOMPOSITIONS["layer_norm"](x, (4,), w, b),
        lambda g: (
            torch.randn(3, 4, generator=g),
            torch.randn(4, generator=g),
            torch.randn(4, generator=g),
        ),
    ),
    "batch_norm.batch_stats": (
        lambda x, w, b: torch.nn.functional.batch_norm(x, None, None, w, b, training=True),
        lambda x, w, b: DECOMPOSITIONS["batch_norm.batch_stats"](x, None, None, w, b, True),
        lambda g: (
            torch.randn(3, 2, 2, generator=g),
            torch.randn(2, generator=g),
            torch.randn(2, generator=g),
        ),
    ),
    "group_norm": (
        lambda x, w, b: torch.nn.functional.group_norm(x, 2, w, b),
        lambda x, w, b: DECOMPOSITIONS["group_norm"](x, 2, w, b),
        lambda g: (
            torch.randn(2, 4, 2, generator=g),
            torch.randn(4, generator=g),
            torch.randn(4, generator=g),
        ),
    ),
    "instance_norm": (
        lambda x, w, b: torch.nn.functional.instance_norm(x, weight=w, bias=b),
        lambda x, w, b: DECOMPOSITIONS["instance_norm"](x, weight=w, bias=b),
        lambda g: (
            torch.randn(2, 2, 3, generator=g),
            torch.randn(2, generator=g),
            torch.randn(2, generator=g),
        ),
    ),
    "rms_norm": (
        lambda x, w: torch.nn.functional.rms_norm(x, (4,), w),
        lambda x, w: DECOMPOSITIONS["rms_norm"](x, (4,), w),
        lambda g: (torch.randn(3, 4, generator=g), torch.randn(4, generator=g)),
    ),
    "scaled_dot_product_attention": (
        lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=_MASK, enable_gqa=True
        ),
        lambda q, k, v: DECOMPOSITIONS["scaled_dot_product_attention"](
            q, k, v, attn_mask=_MASK, enable_gqa=True
        ),
        lambda g: tuple(
            torch.randn(*s, generator=g) for s in ((1, 4, 3, 2), (1, 2, 4, 2), (1, 2, 4, 3))
        ),
    ),
    "_weight_norm": (
        lambda v, g: torch._weight_norm(v, g, 2),
        lambda v, g: DECOMPOSITIONS["_weight_norm"](v, g, 2),
        lambda g: (torch.randn(2, 3, 4, generator=g), torch.rand(1, 1, 4, generator=g) + 0.5),
    ),
}
_MASK = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.bool)


class _Apply(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def test_every_decomposition_is_checked():
    assert set(_COMPOSITES) == set(DECOMPOSITIONS)


@pytest.mark.parametrize("S", [c() for c in sa.BUILTIN_SEMIRINGS], ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("name", list(_COMPOSITES))
def test_decomposition_is_the_stated_composition(name, S):
    """Path recovery re-runs composite ops as their decomposition: it must compute the same
    forward and, under every semiring, the same messages as the op's own formula."""
    op, decomposition, sample = _COMPOSITES[name]
    inputs = [t.double() for t in sample(torch.Generator().manual_seed(3))]
    results = []
    for fn in (op, decomposition):
        xs = [t.clone().requires_grad_() for t in inputs]
        module = _Apply(fn)
        with sa.patch(module, S):
            out = module(*xs)
        results.append((out.detach(), sa.grad(out, xs)))
    (out_a, grads_a), (out_b, grads_b) = results
    torch.testing.assert_close(out_a, out_b, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", list(MODELS))
def test_boolean_top_path_is_a_witness(name: str):
    """Under Boolean a top path is one path that exists: an enumerated path, its weight the
    product of its |local derivatives|; an element without a path is refused."""
    from oracle import every_path

    out, x, program = record_with_paths(name, sa.Boolean())
    element = (1, 2)
    flat_out = flat_index(element, tuple(out.shape))
    paths = every_path(program, "out", flat_out, "x")
    finder = sa.PathFinder(out[element], x)
    for j in range(x.numel()):
        if j not in paths:
            assert not bool(finder.readout.reshape(-1)[j])
            with pytest.raises(sa.SemiringAutogradError, match="no path reaches"):
                finder.path(j)
            continue
        path = finder.path(j)
        steps = [s for s in path.steps[1:] if s.module != "(outside sa.patch)"]
        got = [(flat_index(s.index, s.shape), s.local_derivative) for s in steps]
        assert any(
            [e for e, _ in got] == [n[1] for n, _ in trail]
            and all(g == pytest.approx(w, rel=1e-12) for (_, g), (_, w) in zip(got, trail))
            for _, trail in paths[j]
        ), f"not an enumerated path:\n{path}"
        product = 1.0
        for _, w in got:
            product *= abs(w)
        assert path.weight == pytest.approx(product, rel=1e-12) and path.weight > 0
    with pytest.raises(sa.SemiringAutogradError, match="witness"):
        sa.top_paths(out[element], x, 2)
