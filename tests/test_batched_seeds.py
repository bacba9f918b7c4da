"""``sa.grad(..., is_grads_batched=True)``: B seeds stacked on a leading dimension, B
readouts stacked the same way, each row checked against path enumeration of the small
MLP's program (tests/oracle.py) under every built-in semiring, against the loop of
``sa.grad`` on the attention block and on a tiny Llama (the built-in semirings' one backward
under ``torch.vmap``; a user-defined semiring's backward per row), and under ``sa.Real()``
against torch.autograd's own ``is_grads_batched`` in float64."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from model_zoo import llama_config
from small_models import setup_model
from user_semirings import Tropical

import semiring_autograd as sa
from semiring_autograd.engine import grad as grad_module

SEMIRINGS = [
    sa.Real(),
    sa.Real(formulas=True),
    sa.MaxProduct(),
    sa.SignedMaxProduct(),
    sa.Log(),
    sa.Entropy(),
    sa.Boolean(),
    sa.Counting(),
    sa.KBest(3),
]
TOL = dict(rtol=1e-9, atol=1e-12)


def _recorded(name: str, S: sa.Semiring) -> tuple[torch.Tensor, torch.Tensor]:
    model, x, _ = setup_model(name)
    x = x.clone().requires_grad_()
    with sa.patch(model, S):
        y = model(x)
    return y, x


def _seeds(y: torch.Tensor, rows: int) -> torch.Tensor:
    seeds = torch.randn(rows, *y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(5))
    seeds[0] = 0
    seeds[0].view(-1)[1] = 1  # one element read
    seeds[1].view(-1)[::2] = 0  # a zero weight starts no path
    return seeds


@pytest.mark.parametrize("S", SEMIRINGS, ids=repr)
def test_each_row_is_the_enumerated_readout_of_its_seed(S):
    y, x = _recorded("mlp", S)
    seeds = _seeds(y, 3)
    got = sa.grad(y, x, seeds, is_grads_batched=True)
    _, _, program = setup_model("mlp")
    assert got.shape[0] == 3
    for row, seed in zip(got, seeds):
        (value,) = program.path_sum(S, "out", seed, ["x"])
        want = S.readout(value)
        torch.testing.assert_close(row, want.to(row.dtype), **TOL)


@pytest.mark.parametrize("S", SEMIRINGS, ids=repr)
def test_batched_seeds_equal_the_loop(S):
    y, x = _recorded("attention", S)
    model, _, _ = setup_model("attention")
    seeds = _seeds(y, 4)
    weight = model.v.weight
    got = sa.grad(y, [x, weight], seeds, is_grads_batched=True, retain_graph=True)
    loop = [sa.grad(y, [x, weight], s, retain_graph=True) for s in seeds]
    for k, readouts in enumerate(got):
        torch.testing.assert_close(readouts, torch.stack([row[k] for row in loop]), **TOL)


def test_real_equals_torch_autograd_is_grads_batched():
    model, x, _ = setup_model("attention")
    leaf = x.clone().requires_grad_()
    out = model(leaf)
    seeds = _seeds(out, 4)
    (want,) = torch.autograd.grad(out, leaf, seeds, is_grads_batched=True)
    y, x = _recorded("attention", sa.Real())
    torch.testing.assert_close(sa.grad(y, x, seeds, is_grads_batched=True), want, **TOL)


@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Log()], ids=repr)
def test_compiled_rows_equal_eager_rows(S):
    y, x = _recorded("attention", S)
    seeds = _seeds(y, 3)
    eager = torch.stack([sa.grad(y, x, s, retain_graph=True) for s in seeds])
    compiled = sa.grad(y, x, seeds, is_grads_batched=True, compile=True)
    assert torch.equal(compiled, eager)


def _vmapped_calls(monkeypatch) -> list:
    """Records each batched backward run under torch.vmap."""
    calls = []
    run = grad_module._vmapped

    def spy(*args):
        calls.append(args[0])
        return run(*args)

    monkeypatch.setattr(grad_module, "_vmapped", spy)
    return calls


@pytest.mark.parametrize(
    "S",
    [
        sa.MaxProduct(),
        sa.SignedMaxProduct(),
        sa.Log(),
        sa.Entropy(),
        sa.Counting(),
        sa.Boolean(),
        sa.KBest(3),
    ],
    ids=repr,
)
def test_tiny_llama_rows_equal_the_loop(S, monkeypatch):
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(llama_config(vocab_size=50)).eval().double()
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        emb = model.get_input_embeddings()(ids[:, :5]).requires_grad_(True)
    unused = torch.ones(3, dtype=torch.float64, requires_grad=True)  # no path: the zero
    with sa.patch(model, S):
        logits = model(inputs_embeds=emb).logits
    seeds = torch.zeros(4, *logits.shape, dtype=logits.dtype)
    seeds[torch.arange(3), 0, torch.arange(3), ids[0, 1:4]] = 1  # next-token logits
    seeds[3] = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    calls = _vmapped_calls(monkeypatch)
    got = sa.grad(logits, [emb, unused], seeds, is_grads_batched=True, retain_graph=True)
    # SignedMaxProduct runs a backward per row (its matmul under vmap is slower)
    assert calls == ([] if isinstance(S, sa.SignedMaxProduct) else [S])
    loop = [sa.grad(logits, [emb, unused], s, retain_graph=True) for s in seeds]
    # LlamaRMSNorm computes in float32: its reductions, ordered otherwise over a batch,
    # round differently in the last float32 bit
    for k, readouts in enumerate(got):
        want = torch.stack([row[k] for row in loop])
        torch.testing.assert_close(readouts, want, rtol=1e-6, atol=1e-6)


def test_a_user_semiring_runs_a_backward_per_row(monkeypatch):
    y, x = _recorded("attention", Tropical())
    seeds = _seeds(y, 3)
    calls = _vmapped_calls(monkeypatch)
    got = sa.grad(y, x, seeds, is_grads_batched=True, retain_graph=True)
    assert calls == []
    loop = torch.stack([sa.grad(y, x, s, retain_graph=True) for s in seeds])
    torch.testing.assert_close(got, loop, **TOL)


def test_several_outputs_take_a_seed_each():
    S = sa.MaxProduct()
    model, x, _ = setup_model("mlp")
    x = x.clone().requires_grad_()
    with sa.patch(model, S):
        a, b = model(x), model(2 * x)
    sa_ = _seeds(a, 2)
    sb = _seeds(b, 2).flip(0)
    got = sa.grad([a, b], x, [sa_, sb], is_grads_batched=True, retain_graph=True)
    for row in range(2):
        want = sa.grad([a, b], x, [sa_[row], sb[row]], retain_graph=True)
        torch.testing.assert_close(got[row], want, **TOL)


def test_bad_batched_seeds_are_refused():
    y, x = _recorded("mlp", sa.Log())
    with pytest.raises(ValueError, match=r"shape \(B, 2, 3\)"):
        sa.grad(y, x, torch.ones(2, 3), is_grads_batched=True, retain_graph=True)
    with pytest.raises(TypeError, match="leading dimension"):
        sa.grad(y, x, 1.0, is_grads_batched=True, retain_graph=True)
    with pytest.raises(TypeError, match="raw=True"):
        sa.grad(y, x, torch.ones(2, 2, 3), is_grads_batched=True, raw=True, retain_graph=True)
    with pytest.raises(ValueError, match="at least one"):
        sa.grad(y, x, torch.ones(0, 2, 3), is_grads_batched=True, retain_graph=True)


def test_a_rule_that_branches_on_values_under_vmap_is_named(monkeypatch):
    y, x = _recorded("mlp", sa.MaxProduct())
    readout = sa.MaxProduct.readout

    def branching(self, a):
        return readout(self, a) if bool(a[0].sum() >= 0) else -readout(self, a)

    monkeypatch.setattr(sa.MaxProduct, "readout", branching)
    with pytest.raises(sa.SemiringAutogradError, match=r"does not run under torch\.vmap.*per"):
        sa.grad(y, x, _seeds(y, 2), is_grads_batched=True, retain_graph=True)


def test_signed_rules_run_under_vmap_too():
    S = sa.SignedMaxProduct()
    y, x = _recorded("attention", S)
    seeds = _seeds(y, 3)
    (got,) = grad_module._vmapped(S, [y], [x], [seeds], True)
    loop = torch.stack([sa.grad(y, x, s, retain_graph=True) for s in seeds])
    torch.testing.assert_close(got, loop, **TOL)


def test_more_rows_than_one_vmap_takes_are_run_in_chunks():
    S = sa.Log()
    y, x = _recorded("attention", S)
    rows = grad_module.VMAP_ROWS + 3
    seeds = torch.randn(rows, *y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(7))
    loop = torch.stack([sa.grad(y, x, s, retain_graph=True) for s in seeds])
    got = sa.grad(y, x, seeds, is_grads_batched=True)  # the graph is kept until the last chunk
    torch.testing.assert_close(got, loop, **TOL)
