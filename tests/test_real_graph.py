"""``sa.Real()`` records torch's own graph; ``sa.Real(formulas=True)`` the generated Functions.

Both are checked against ``torch.autograd.grad`` in float64, with a user semiring of Real's
definition (the generic module's formulas) beside them: composite ops, repeated arguments,
``retain_graph``, ops that hand back their input, unsupported ops, node naming and tracing.
"""

from __future__ import annotations

from typing import Callable

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

import semiring_autograd as sa
from semiring_autograd.engine.grad import recorded_semiring

RTOL, ATOL = 1e-10, 1e-12
F64 = torch.float64


class RealArithmetic(sa.Real):
    """Real's definition under another type: runs through the generic module's formulas."""

    name = "real_arithmetic"


MODES = [sa.Real(), sa.Real(formulas=True), RealArithmetic()]
MODE_IDS = ["torch-graph", "formulas", "generic"]


class Call(nn.Module):
    def __init__(self, fn: Callable[..., Tensor]):
        super().__init__()
        self.fn = fn

    def forward(self, *xs: Tensor) -> Tensor:
        return self.fn(*xs)


def _t(*shape: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).requires_grad_()


def _cases() -> list[tuple[str, Callable[..., Tensor], list[Tensor]]]:
    x = _t(2, 3, 5, seed=1)
    mask = torch.rand(2, 3, 3, generator=torch.Generator().manual_seed(9)) > 0.3
    mask[..., 0] = True
    return [
        ("linear_3d", lambda a, w, b: F.linear(a, w, b), [x, _t(4, 5, seed=2), _t(4, seed=3)]),
        (
            "layer_norm",
            lambda a, w, b: F.layer_norm(a, (5,), w, b),
            [x, _t(5, seed=2), _t(5, seed=3)],
        ),
        (
            "sdpa_qkv",
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
            [_t(2, 3, 4, seed=5), _t(2, 3, 4, seed=6), _t(2, 3, 4, seed=7)],
        ),
        ("sdpa_self", lambda h: F.scaled_dot_product_attention(h, h, h, is_causal=True), [x]),
        (
            "sdpa_mask",
            lambda q, k: F.scaled_dot_product_attention(q, k, k, attn_mask=mask),
            [_t(2, 3, 5, seed=8), x],
        ),
        ("layer_norm_no_affine", lambda a: F.layer_norm(a, (3, 5)), [_t(2, 3, 5, seed=4)]),
        ("gelu_tanh_softmax", lambda a: torch.softmax(F.gelu(a, approximate="tanh"), -1), [x]),
        ("silu", F.silu, [x]),
        ("softmax", lambda a: torch.softmax(a, 1), [x]),
        ("log_softmax", lambda a: F.log_softmax(a, dim=1), [x]),
        ("contiguous_after_op", lambda a: (a * 2).contiguous().sum(-1), [x]),
        ("dropout_eval_only", lambda a: F.dropout(a, 0.5, training=False), [x]),
        ("split_and_cat", lambda a: torch.cat(a.split([2, 3], -1)[::-1], -1) * a, [x]),
    ]


CASES = _cases()


def _seed_like(out: Tensor) -> Tensor:
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=F64)


@pytest.mark.parametrize("name, fn, inputs", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("S", MODES, ids=MODE_IDS)
def test_matches_autograd(name, fn, inputs, S):
    seed = _seed_like(fn(*inputs))
    expected = torch.autograd.grad(fn(*inputs), inputs, seed)
    module = Call(fn)
    with sa.patch(module, S):
        out = module(*inputs)
    assert torch.equal(out, fn(*inputs))
    node, info = out.grad_fn, sa.node_info(out.grad_fn)
    assert info is not None and info.semiring == S
    if type(S) is sa.Real and not S.formulas:
        assert not hasattr(type(node), "_forward_cls")  # one of torch's own nodes
        assert node._sequence_nr() in info.sequence_nrs
    else:
        assert info.sequence_nrs is None
        module_name = type(node)._forward_cls.__module__
        assert module_name.endswith("real" if type(S) is sa.Real else "generic")
    got = sa.grad(out, inputs, seed)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("S", MODES, ids=MODE_IDS)
def test_repeated_argument_counted_once_per_edge(S):
    """sdpa(h, h, h): three edges from h, summed once each."""
    h = _t(1, 4, 3, seed=11)
    module = Call(lambda a: F.scaled_dot_product_attention(a, a, a))
    with sa.patch(module, S):
        out = module(h)
    (expected,) = torch.autograd.grad(F.scaled_dot_product_attention(h, h, h).sum(), h)
    torch.testing.assert_close(sa.grad(out, h), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("S", MODES, ids=MODE_IDS)
def test_retain_graph_and_second_backward(S):
    x, w = _t(3, 5, seed=12), _t(5, seed=13)
    module = Call(lambda a, b: F.layer_norm(a, (5,), b))
    with sa.patch(module, S):
        out = module(x, w)
    first = sa.grad(out, [x, w], retain_graph=True)
    second = sa.grad(out, [x, w])
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="second time"):
        sa.grad(out, x)


def test_op_handing_back_its_input_gets_its_own_node():
    """``x.contiguous()`` returns x itself: under Real() the op still gets a node of its own
    (a view), and the node of the op that made x keeps its name."""
    x = _t(3, 4, seed=14)
    module = Call(lambda a: (a * 3).contiguous())
    with sa.patch(module, sa.Real()):
        out = module(x)
    assert sa.node_info(out.grad_fn).op == "contiguous"
    producer = out.grad_fn.next_functions[0][0]
    assert sa.node_info(producer).op == "mul.Scalar"
    torch.testing.assert_close(sa.grad(out, x), torch.full_like(x, 3.0), rtol=0, atol=0)


def test_graph_recorded_in_both_modes_is_one_semiring():
    x = _t(3, 5, seed=15)
    first, second = Call(torch.tanh), Call(lambda a: F.layer_norm(a, (5,)))
    with sa.patch(first, sa.Real()):
        h = first(x)
    with sa.patch(second, sa.Real(formulas=True)):
        out = second(h)
    assert recorded_semiring(out) == sa.Real()
    expected = torch.autograd.grad(F.layer_norm(torch.tanh(x), (5,)).sum(), x)[0]
    torch.testing.assert_close(sa.grad(out.sum(), x), expected, rtol=RTOL, atol=ATOL)


def test_unsupported_op_raises_under_torch_graph_too():
    """Every semiring binds each call to its YAML entry, Real's torch graph included: a
    model that runs under Real() runs under every semiring."""
    model = Call(torch.sin)
    x = _t(3, seed=16)
    with pytest.raises(sa.UnsupportedOpError, match="torch.sin"):
        with sa.patch(model, sa.Real()):
            model(x)
    assert type(model(x).grad_fn).__name__ == "SinBackward0"
    assert sa.node_info(model(x).grad_fn) is None


def test_trace_names_torch_nodes_by_their_op():
    """A 3-d linear records view, addmm and transpose nodes; each reports as 'linear'."""
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh()).double()
    x = _t(2, 3, 5, seed=17)
    with sa.patch(model, sa.Real()):
        out = model(x)
    with sa.trace(file=None) as t:
        got = sa.grad(out, [x, model[0].weight])
    expected = torch.autograd.grad(model(x).sum(), [x, model[0].weight])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL)
    ops = [(e.op, e.node) for e in t.events]
    assert ops[0] == ("tanh", "TanhBackward0") and t.events[0].module == "1"
    assert ("linear", "AddmmBackward0") in ops
    assert {op for op, _ in ops} == {"tanh", "linear"}
    assert len(ops) >= 3
    assert t.events[0].received == ("(2, 3, 4): readout in [1, 1]",)


def test_top_paths_are_refused_on_a_real_graph():
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh()).double()
    x = _t(3, 5, seed=18)
    with sa.patch(model, sa.Real(), paths=True):
        out = model(x)
    assert sa.node_info(out.grad_fn).recorded is None
    with pytest.raises(sa.SemiringAutogradError, match="MaxProduct"):
        sa.top_path(out[0, 1], x)


def test_subclass_is_a_user_semiring():
    class MyReal(sa.Real):
        def __init__(self):  # does not call Real's
            pass

    assert repr(MyReal()) == "MyReal()" and repr(RealArithmetic()) == "RealArithmetic()"
    assert repr(sa.Real(formulas=True)) == "Real(formulas=True)"
    assert sa.Real() == sa.Real(formulas=True) and RealArithmetic() != sa.Real()


class _Outer(nn.Module):
    """Calls a model that is not its submodule: each can be patched on its own."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.lin = nn.Linear(5, 5).double()
        self.inner = [inner]  # not registered

    def forward(self, x: Tensor) -> Tensor:
        return self.inner[0](torch.tanh(self.lin(x))).sum(-1)


NESTINGS = [
    (sa.MaxProduct(), sa.Real()),
    (sa.Real(), sa.MaxProduct()),
    (sa.Real(formulas=True), sa.Log()),
    (sa.Log(), sa.MaxProduct()),
]


@pytest.mark.parametrize("outer_S, inner_S", NESTINGS, ids=repr)
def test_nested_patch_with_another_semiring_is_refused_at_forward(outer_S, inner_S):
    inner = nn.Sequential(nn.Linear(5, 3), nn.Sigmoid()).double()
    outer = _Outer(inner)
    x = _t(2, 5, seed=19)
    with pytest.raises(sa.SemiringMismatchError, match="one graph takes one semiring"):
        with sa.patch(outer, outer_S), sa.patch(inner, inner_S):
            outer(x)
    assert not torch._C._is_torch_function_mode_enabled()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in outer.modules())
    assert sa.node_info(outer(x).grad_fn) is None  # both restored
    with sa.patch(outer, outer_S):  # and each can be patched again
        outer(x)


def test_nested_patch_with_the_same_semiring():
    inner = nn.Sequential(nn.Linear(5, 3), nn.Sigmoid()).double()
    outer = _Outer(inner)
    x = _t(2, 5, seed=19)
    with sa.patch(outer, sa.Real(formulas=True)), sa.patch(inner, sa.Real()):
        out = outer(x)
    (expected,) = torch.autograd.grad(outer(x).sum(), x)
    torch.testing.assert_close(sa.grad(out.sum(), x), expected, rtol=RTOL, atol=ATOL)


def test_out_none_is_the_default():
    model = Call(lambda a, b: torch.cat([torch.add(a, b, out=None), a], -1, out=None))
    a, b = _t(2, 3, seed=21), _t(2, 3, seed=22)
    for S in (sa.Real(), sa.MaxProduct()):
        with sa.patch(model, S):
            out = model(a, b)
        assert torch.equal(out, torch.cat([a + b, a], -1))


def test_input_nodes_are_the_edges_only():
    """``x.expand_as(other)`` has no edge to ``other``: the name recorded keeps no
    reference to other's graph, which torch frees as it would unpatched."""
    x = _t(1, 3, seed=23)
    model = Call(lambda a, o: a.expand_as(o))
    other = torch.tanh(_t(4, 3, seed=24))
    with sa.patch(model, sa.Real()):
        out = model(x, other)
    assert sa.node_info(out.grad_fn).input_nodes == ()  # x is a leaf; other has no edge
    saved = StorageWeakRef(other.untyped_storage())  # tanh's node saves its result
    del other
    assert saved.expired()


def _in_new_thread(fn: Callable[[], Tensor]) -> Tensor:
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def test_input_made_in_another_thread():
    """Sequence numbers count per thread, from 0. An input recorded in one thread whose node
    has the number the op's node gets in another: the op handing it back still gets its own
    node, and the trace stops at the input's node instead of taking it in as the op's."""
    leaf = _t(3, 4, seed=20)
    x = _in_new_thread(lambda: leaf * 1.0)
    model = nn.Sequential(Call(lambda a: a.contiguous()), nn.Linear(4, 2).double())

    def patched_forward() -> Tensor:
        with sa.patch(model, sa.Real()):
            return model(x)

    out = _in_new_thread(patched_forward)
    hand_back = out.grad_fn.next_functions[1][0]  # addmm's input: contiguous's own view
    assert x.grad_fn._sequence_nr() in sa.node_info(hand_back).sequence_nrs
    (expected,) = torch.autograd.grad(model(x).sum(), leaf, retain_graph=True)
    with sa.trace(file=None) as t:
        got = sa.grad(out, leaf)  # through the other thread's node
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert [e.op for e in t.events if e.node == "ViewBackward0"][-1:] == ["contiguous"]
    assert {e.op for e in t.events} == {"linear", "contiguous"}
    assert all(e.node != "MulBackward0" for e in t.events)
