"""Top paths vs explicit path enumeration, and their structure on a Hugging Face model."""

from __future__ import annotations

import math

import pytest
import torch
from model_zoo import tiny_inputs, tiny_model
from op_checks import Apply
from oracle import Program, best_paths, every_path
from small_models import MODELS, flat_index, record_with_paths, setup_model

import semiring_autograd as sa
from semiring_autograd.ops.decompositions import DECOMPOSITIONS
from semiring_autograd.engine.graph import reachable_nodes
from semiring_autograd.explain.k_paths import top_paths_from
from semiring_autograd.explain.paths import OUTSIDE, Path, PathFinder, Step, product_column
from semiring_autograd.semirings import BUILTIN_SEMIRINGS


@pytest.mark.parametrize("element", [(1, 2), (0, 0)])
@pytest.mark.parametrize("name", list(MODELS))
def test_top_path_is_the_argmax_of_path_enumeration(name: str, element: tuple[int, int]):
    """Every input element: the same nodes, the same local derivatives, the same weight."""
    out, x, program = record_with_paths(name, sa.MaxProduct())
    flat_out = flat_index(element, tuple(out.shape))
    finder = PathFinder(out[element], x)
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
    finder = PathFinder(out[1, 2], x, which=which)
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
    finder = PathFinder(logits[1, 1], x)
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
    assert all(sa.node_info(n) is None or sa.node_info(n).recorded is None for n in nodes)
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


@pytest.mark.parametrize("S", [c() for c in BUILTIN_SEMIRINGS], ids=lambda s: type(s).__name__)
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
    finder = PathFinder(out[element], x)
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


# ----- element indices ---------------------------------------------------------------
@pytest.mark.parametrize(
    "index, message",
    [
        (
            (0, 3),
            r"\(0, 3\) is out of range for the input of shape \(2, 3\).*size 3 \(allowed -3..2\)",
        ),
        ((0, -4), r"\(0, -4\) is out of range .*entry 1 is -4.*\(allowed -3..2\)"),
        ((2, 0), r"\(2, 0\) is out of range .*dimension 0 has size 2 \(allowed -2..1\)"),
        ((-3, 1), r"\(-3, 1\) is out of range .*\(allowed -2..1\)"),
        (6, r"index 6 is out of range for the input of shape \(2, 3\).*-6..5"),
        (-7, r"index -7 is out of range .*-6..5"),
        ((1,), r"\(1,\) has 1 entries for the input of shape \(2, 3\): give one per dimension"),
        ((0, 1, 0), r"has 3 entries .*one per dimension \(2\)"),
    ],
)
def test_out_of_range_index_is_refused_by_every_path_function(index, message: str):
    out, x, _ = record_with_paths("mlp", sa.MaxProduct())
    finder = PathFinder(out[1, 2], x)
    calls = {
        "top_path": lambda: sa.top_path(out[1, 2], x, index),
        "PathFinder.path": lambda: finder.path(index),
        "top_paths": lambda: sa.top_paths(out[1, 2], x, 2, index=index),
        "top_paths_from": lambda: top_paths_from(finder, 2, index),
    }
    for name, call in calls.items():
        with pytest.raises(IndexError, match=message):
            call()
        assert x.grad is None, name


@pytest.mark.parametrize("index", [True, 1.0, (0, 1.5), "01", torch.tensor([0, 1])])
def test_index_of_the_wrong_type_is_refused(index):
    out, x, _ = record_with_paths("mlp", sa.MaxProduct())
    with pytest.raises(TypeError, match="path index .*use"):
        sa.top_path(out[1, 2], x, index)


def test_negative_indices_in_range_count_from_the_end():
    out, x, _ = record_with_paths("mlp", sa.MaxProduct())
    finder = PathFinder(out[1, 2], x)
    for negative, positive in [((1, -1), (1, 2)), ((-1, -3), (1, 0)), (-2, 4), (-3, 3)]:
        got, want = finder.path(negative), finder.path(positive)
        assert got.steps == want.steps and got.weight == want.weight
        assert [p.steps for p in top_paths_from(finder, 3, negative)] == [
            p.steps for p in top_paths_from(finder, 3, positive)
        ]
    assert finder.path(torch.tensor(4)).steps == finder.path(4).steps


# ----- steps after the patched region ------------------------------------------------
#: read-outs taken after the ``with sa.patch`` block, on the model's output
READOUTS = {
    "scalar mul": lambda out: (3 * out).sum(),
    "mean": lambda out: out.mean(),
    "sum": lambda out: out.sum(),
    "indexing": lambda out: out[1, 2],
    "division": lambda out: (out / -4).sum(),
    "view chain": lambda out: out.reshape(-1)[1:5].reshape(2, 2).t().unsqueeze(0)[0, 1, 0] * 2.5,
}


def _program_with_readout(name: str, readout):
    """A fresh program of model ``name`` with the read-out as its last op ("r"): the
    oracle's scalar graph from the read-out to the input."""
    model, x, _ = setup_model(name)
    program = MODELS[name][2](model, x)
    program.op("r", readout, "out")
    return program


def _split_at_patch(path: Path) -> tuple[list, list]:
    """(steps inside the patched region, steps over native nodes after it)."""
    steps = list(path.steps[1:])
    inside = [s for s in steps if s.module != "(outside sa.patch)"]
    outside = [s for s in steps if s.module == "(outside sa.patch)"]
    assert steps == inside + outside, "a native step sits inside the patched region"
    return inside, outside


@pytest.mark.parametrize("readout", list(READOUTS))
@pytest.mark.parametrize("name", list(MODELS))
def test_steps_after_the_patch_carry_their_local_derivatives(name: str, readout: str):
    """The product of every step's local derivative, lifted (|w|), is path.weight, which is
    the best enumerated path's |product| through the read-out; the native steps multiply
    to the read-out's own derivative at the element the path leaves the model by."""
    fn = READOUTS[readout]
    out, x, _ = record_with_paths(name, sa.MaxProduct())
    program = _program_with_readout(name, fn)
    oracle = best_paths(program, "r", 0, "x")
    finder = PathFinder(fn(out), x)
    assert oracle
    for j, (product, trail) in oracle.items():
        for path in (finder.path(j), top_paths_from(finder, 2, j)[0]):
            inside, outside = _split_at_patch(path)
            assert outside, "the read-out's native nodes are no steps"
            assert path.weight == pytest.approx(abs(product), rel=1e-12)
            lifted = math.prod(abs(s.local_derivative) for s in path.steps[1:])
            assert lifted == pytest.approx(path.weight, rel=1e-12)
            # the oracle's last edge, r ← out, is the read-out's derivative
            _, w_readout = trail[-1]
            native = math.prod(s.local_derivative for s in outside)
            assert native == pytest.approx(w_readout, rel=1e-12)
            assert [flat_index(s.index, s.shape) for s in inside] == [
                node[1] for node, _ in trail[:-1]
            ]


@pytest.mark.parametrize("which", ["max", "min"])
def test_signed_steps_after_the_patch_carry_their_signs(which: str):
    """SignedMaxProduct: the signed product of the steps (a negative scale after the patch
    among them) is the extreme signed product of the enumerated paths."""
    fn = READOUTS["division"]
    out, x, _ = record_with_paths("mlp", sa.SignedMaxProduct())
    program = _program_with_readout("mlp", fn)
    finder = PathFinder(fn(out), x, which=which)
    for j, (product, _) in best_paths(program, "r", 0, "x", which=which).items():
        for path in (finder.path(j), top_paths_from(finder, 1, j)[0]):
            assert path.weight == pytest.approx(product, rel=1e-12)
            signed = math.prod(s.local_derivative for s in path.steps[1:])
            assert signed == pytest.approx(product, rel=1e-12)


@pytest.mark.parametrize("readout", ["scalar mul", "mean", "view chain"])
def test_k_best_paths_through_a_readout_are_the_enumerated_ones(readout: str):
    fn = READOUTS[readout]
    out, x, _ = record_with_paths("attention", sa.MaxProduct())
    program = _program_with_readout("attention", fn)
    for j, found in every_path(program, "r", 0, "x").items():
        got = sa.top_paths(fn(out), x, 4, index=j)
        want = sorted((abs(p) for p, _ in found), reverse=True)[:4]
        torch.testing.assert_close(
            torch.tensor([p.weight for p in got], dtype=torch.float64),
            torch.tensor(want, dtype=torch.float64),
            rtol=1e-12,
            atol=0.0,
        )
        for path in got:
            lifted = math.prod(abs(s.local_derivative) for s in path.steps[1:])
            assert lifted == pytest.approx(path.weight, rel=1e-12)


# ----- labels ------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tiny_llama_path_names_rotary_embedding_and_attention_scale(attn: str):
    """From a query projection's output every path crosses the rotary embedding's add
    (x·cos + rotate_half(x)·sin) and the 1/√d scale of the scores: both named, the rotary
    add not shown as a residual stream (the decoder layer's adds still are)."""
    model = tiny_model("LlamaForCausalLM", attn)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    emb, mask = tiny_inputs(model)
    x = emb.clone().requires_grad_()
    seen = {}
    hook = model.model.layers[1].self_attn.q_proj.register_forward_hook(
        lambda module, args, out: seen.__setitem__("q", out)
    )
    try:
        with sa.patch(model, sa.MaxProduct(), paths=True):
            logits = model(inputs_embeds=x, attention_mask=mask).logits
    finally:
        hook.remove()
    path = sa.top_path(logits[0, -1, 3], seen["q"], (0, 5, 1))
    rotary = [s for s in path.steps if "rotary embedding" in s.note]
    assert [(s.module, s.op, s.local_derivative) for s in rotary] == [
        ("model.layers.1.self_attn", "add.Tensor", 1.0)
    ]
    scale = [s for s in path.steps if "attention scale" in s.note]
    assert len(scale) == 1 and scale[0].note == f"× attention scale 1/√d (d = {head_dim})"
    assert scale[0].local_derivative == pytest.approx(head_dim**-0.5, rel=1e-12)
    assert scale[0].op.endswith("mul.Scalar")
    text = str(path)
    residual = [line for line in text.splitlines() if "residual stream" in line]
    assert residual and all("self_attn" not in line for line in residual), text
    assert "rotary embedding" in text and "attention scale 1/√d" in text
    if attn == "eager":  # the causal mask is added to the scores as a separate op
        assert any(s.op == "add.Tensor" and s.note == "+ attention mask" for s in path.steps)
    lifted = math.prod(abs(s.local_derivative) for s in path.steps[1:])
    assert lifted == pytest.approx(path.weight, rel=1e-6)  # RMSNorm computes in float32


@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Log()], ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("readout", list(READOUTS))
def test_semiring_grad_through_a_readout_is_the_path_sum(readout: str, S):
    """The read-out's native backward nodes run on messages (a view of a transposed
    message among them): sa.grad equals path enumeration through the read-out."""
    fn = READOUTS[readout]
    model, x, _ = setup_model("attention")
    x = x.clone().requires_grad_()
    with sa.patch(model, S):
        out = model(x)
    program = _program_with_readout("attention", fn)
    (want,) = program.path_sum(S, "r", None, ["x"])
    torch.testing.assert_close(sa.grad(fn(out), x), S.readout(want), rtol=1e-12, atol=1e-12)


class _Scores(torch.nn.Module):
    """x·xᵀ (dot products of dim 4) times ½ plus x·xᵀ divided by a 0-d tensor 2, plus
    x[:, :1] times ½ (no dot products)."""

    def forward(self, x):
        scores = x @ x.transpose(0, 1)
        other = torch.full((), 2.0, dtype=x.dtype)
        return scores * 0.5 + scores / other + x[:, :1] * 0.5


@pytest.mark.parametrize("element", [0, 1, 2, 3])
def test_attention_scale_is_named_only_on_dot_products(element: int):
    """×½ after x·xᵀ of dim 4 is 1/√d, ÷ a tensor 2 is √d; ×½ of x itself (no dot products,
    not in an attention module) is left bare. Every path's product is its weight."""
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x.requires_grad_()
    module = _Scores()
    with sa.patch(module, sa.MaxProduct(), paths=True):
        out = module(x)
    notes: dict[tuple[str, tuple[int, ...]], set[str]] = {}  # (op, output shape) → notes
    for path in sa.top_paths(out[1, 2], x, 50, index=(1, element)):
        lifted = math.prod(abs(s.local_derivative) for s in path.steps[1:])
        assert lifted == pytest.approx(path.weight, rel=1e-12)
        for step in path.steps[1:]:
            if step.op in ("mul.Scalar", "div.Tensor"):
                notes.setdefault((step.op, step.shape), set()).add(step.note)
    assert notes[("mul.Scalar", (3, 3))] == {"× attention scale 1/√d (d = 4)"}
    assert notes[("div.Tensor", (3, 3))] == {"÷ attention scale √d (d = 4)"}
    if element == 0:  # x[:, :1] * 0.5 reaches only column 0
        assert notes[("mul.Scalar", (3, 1))] == {""}


# ----- columns read off a matrix product's other operand ----------------------------------
def _quarters(*shape: int, seed: int) -> torch.Tensor:
    """Values on a grid of quarters in [-1, 1]: many equal products (tied paths)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g, dtype=torch.float64) * 8 - 4).round() / 4


_PRODUCTS = {
    "linear 3-D": (torch.nn.functional.linear, [(2, 3, 4), (5, 4), (5,)]),
    "matmul 4-D": (torch.matmul, [(2, 2, 3, 4), (2, 2, 4, 5)]),
    "matmul 2-D": (torch.matmul, [(3, 4), (4, 5)]),
    "bmm": (torch.bmm, [(2, 3, 4), (2, 4, 5)]),
    "mm": (torch.mm, [(3, 4), (4, 5)]),
}


@pytest.mark.parametrize("name", list(_PRODUCTS))
def test_product_columns_are_the_jacobian_columns(name: str):
    """Every element's column of a linear layer or matrix product, read off the other
    operand at the outputs it reaches, equals torch.autograd's Jacobian column."""
    fn, shapes = _PRODUCTS[name]
    inputs = [_quarters(*s, seed=n).requires_grad_() for n, s in enumerate(shapes)]
    module = Apply(lambda *t: fn(*t))
    with sa.patch(module, sa.MaxProduct(), paths=True):
        out = module(*inputs)
    info = sa.node_info(out.grad_fn)
    jacobians = torch.autograd.functional.jacobian(lambda *t: fn(*t), tuple(inputs))
    for position in (0, 1):
        jacobian = jacobians[position].reshape(out.numel(), -1)
        for element in range(inputs[position].numel()):
            column = product_column(info, position, element)
            dense = torch.zeros(out.numel(), dtype=torch.float64)
            dense[column.at] = column.values
            torch.testing.assert_close(dense, jacobian[:, element], rtol=0, atol=0)
            assert column.at.numel() == len(set(column.at.tolist()))


def _batched_program(x: torch.Tensor, w: torch.Tensor) -> Program:
    """out = linear((x @ xᵀ) @ x, w): batched matrix products, then a linear layer."""
    p = Program(x=x, w=w)
    p.op("xt", lambda t: t.transpose(-1, -2), "x")
    p.op("s", torch.matmul, "x", "xt")
    p.op("c", torch.matmul, "s", "x")
    p.op("out", torch.nn.functional.linear, "c", "w")
    return p


@pytest.mark.parametrize("semiring", [sa.MaxProduct(), sa.SignedMaxProduct()], ids=repr)
def test_paths_through_batched_products_with_ties_are_the_enumerated_ones(semiring):
    """One output element read (its message reaches one element of the linear's output):
    top_paths' weights are the enumerated paths' k best, each path an enumerated one,
    top_path's weight the best, on values with many tied products."""
    x, w = _quarters(2, 3, 2, seed=5), _quarters(3, 2, seed=6)
    module = Apply(lambda t: torch.nn.functional.linear((t @ t.transpose(-1, -2)) @ t, w))
    leaf = x.clone().requires_grad_()
    with sa.patch(module, semiring, paths=True):
        out = module(leaf)
    element = (1, 2, 1)
    enumerated = every_path(_batched_program(x, w), "out", flat_index(element, out.shape), "x")
    signed = isinstance(semiring, sa.SignedMaxProduct)

    def inside(step: Step) -> bool:  # the read-out's indexing runs outside the patch
        return step.module != OUTSIDE

    for j, found in enumerated.items():
        want = sorted((p if signed else abs(p) for p, _ in found), reverse=True)[:6]
        got = sa.top_paths(out[element], leaf, 6, index=j)
        torch.testing.assert_close(
            torch.tensor([p.weight for p in got], dtype=torch.float64),
            torch.tensor(want, dtype=torch.float64),
            rtol=1e-12,
            atol=0.0,
        )
        steps = [
            [(flat_index(s.index, s.shape), s.local_derivative) for s in p.steps[1:] if inside(s)]
            for p in got
        ]
        pool = [[(node[1], d) for node, d in trail] for _, trail in found]
        for trail in steps:
            assert trail in pool, f"not an enumerated path: {trail}"
            pool.remove(trail)
        assert sa.top_path(out[element], leaf, j).weight == pytest.approx(want[0], rel=1e-12)
