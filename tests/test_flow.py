"""Path flow through tensors and first edges against explicit path enumeration: the paths
of the small models' programs filtered by the tensor or first op they pass through."""

from __future__ import annotations

import math

import pytest
import torch
from model_zoo import tiny_inputs, tiny_model
from oracle import every_path
from small_models import flat_index, setup_model

import semiring_autograd as sa
from semiring_autograd.explain.flow import capture

ELEMENT = (1, 2)
RTOL = 1e-10

# semiring → (how the enumerated products of a set of paths read out, its empty value)
READOUTS = {
    sa.MaxProduct(): lambda ps: max((abs(p) for p in ps), default=0.0),
    sa.Log(): lambda ps: math.log(sum(abs(p) for p in ps)) if ps else -math.inf,
    sa.Real(): lambda ps: sum(ps),
    sa.Real(formulas=True): lambda ps: sum(ps),
    sa.Counting(): lambda ps: math.log(len(ps)) if ps else -math.inf,
}

# model → {capture name: the program tensor of that module's (last) output}
THROUGH = {
    "mlp": {"fc1": "a1", "mid": "a3", "fc2": "a4"},
    "attention": {"q": "q", "k": "k", "v": "v"},
}


def _expected(paths: dict[int, list], keep, readout, numel: int) -> torch.Tensor:
    return torch.tensor(
        [readout([p for p, trail in paths.get(j, []) if keep(trail)]) for j in range(numel)],
        dtype=torch.float64,
    )


@pytest.mark.parametrize("semiring", list(READOUTS), ids=repr)
@pytest.mark.parametrize("name", list(THROUGH))
def test_module_flow_is_the_paths_through_the_module(name: str, semiring):
    model, x0, program = setup_model(name)
    x = x0.clone().requires_grad_()
    with sa.patch(model, semiring), capture(model, list(THROUGH[name])) as seen:
        out = model(x)
    flows = sa.module_flow(out[ELEMENT], x, seen)
    paths = every_path(program, "out", flat_index(ELEMENT, out.shape), "x")
    for module, tensor in THROUGH[name].items():
        want = _expected(
            paths, lambda t: any(n[0] == tensor for n, _ in t), READOUTS[semiring], x.numel()
        )
        torch.testing.assert_close(
            flows[module].reshape(-1), want, rtol=RTOL, atol=1e-12, msg=lambda m: f"{module}: {m}"
        )
    # the graph is kept: the whole readout still comes out
    assert sa.grad(out[ELEMENT], x).shape == x.shape


@pytest.mark.parametrize("semiring", list(READOUTS), ids=repr)
@pytest.mark.parametrize("name", list(THROUGH))
def test_consumer_flow_splits_by_first_edge(name: str, semiring):
    model, x0, program = setup_model(name)
    x = x0.clone().requires_grad_()
    with sa.patch(model, semiring):
        out = model(x)
    flows = sa.consumer_flow(out[ELEMENT], x)
    paths = every_path(program, "out", flat_index(ELEMENT, out.shape), "x")
    first = {n[0] for trails in paths.values() for _, t in trails for n, _ in t[:1]}
    # mlp: x → fc1 (linear) and the residual add; attention: x → the q, k, v projections
    assert len(flows) == len(first)
    by_module = {f.module: f for f in flows}
    names = {"mlp": {"fc1": "a1", "TinyMLP": "out"}, "attention": {"q": "q", "k": "k", "v": "v"}}[
        name
    ]
    assert set(by_module) == set(names)
    for module, tensor in names.items():
        want = _expected(paths, lambda t: t[0][0][0] == tensor, READOUTS[semiring], x.numel())
        torch.testing.assert_close(
            by_module[module].readout.reshape(-1), want, rtol=RTOL, atol=1e-12
        )


def test_consumer_flows_merge_into_the_readout():
    model, x0, _ = setup_model("mlp")
    x = x0.clone().requires_grad_()
    with sa.patch(model, sa.MaxProduct()):
        out = model(x)
    flows = sa.consumer_flow(out[ELEMENT], x)
    merged = torch.stack([f.readout for f in flows]).amax(0)
    torch.testing.assert_close(merged, sa.grad(out[ELEMENT], x), rtol=0, atol=0)
    assert {f.op for f in flows} == {"linear", "add.Tensor"}


def test_flow_refusals():
    model, x0, _ = setup_model("mlp")
    with pytest.raises(ValueError, match="not submodules"):
        with capture(model, ["fc9"]):
            pass
    x = x0.clone().requires_grad_()
    with sa.patch(model, sa.MaxProduct()):
        out = model(x)
    with pytest.raises(sa.SemiringAutogradError, match="not a tensor of the recorded graph"):
        sa.module_flow(out[ELEMENT], x, {"x": x0})


def test_tiny_bert_attention_input_splits_into_query_key_value_and_residual():
    """§5.1's question: which consumer of the attention block's input carries the flow."""
    model = tiny_model("BertForSequenceClassification")
    emb, mask = tiny_inputs(model)
    x = emb.clone().requires_grad_()
    with sa.patch(model, sa.MaxProduct()), capture(model, ["bert.embeddings"]) as seen:
        logits = model(inputs_embeds=x, attention_mask=mask).logits
    h = seen["bert.embeddings"]
    flows = sa.consumer_flow(logits[1, 1], h)
    kinds = {f.module.rsplit(".", 1)[-1]: f for f in flows}
    assert set(kinds) == {"query", "key", "value", "output"}, [f.module for f in flows]
    assert kinds["output"].op == "add.Tensor"  # the residual into the attention output
    merged = torch.stack([f.readout for f in flows]).amax(0)
    with sa.patch(model, sa.MaxProduct()), capture(model, ["bert.embeddings"]) as seen:
        logits = model(inputs_embeds=emb.clone().requires_grad_(), attention_mask=mask).logits
    h = seen["bert.embeddings"]
    torch.testing.assert_close(merged, sa.grad(logits[1, 1], h), rtol=0, atol=0)
