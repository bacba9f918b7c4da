"""Behaviour of sa.patch / sa.grad: restoring, threads, errors, engine integration."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import semiring_autograd as sa
from semiring_autograd.engine.grad import message_value, seed_message
from semiring_autograd.ops.message import Message
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

#: Real twice: torch's own graph (the default) and the generated formulas
ALL = [cls() for cls in BUILTIN_SEMIRINGS] + [sa.Real(formulas=True)]
#: the semirings recorded as generated Functions (all but Real's torch graph)
FUNCTIONS = [s for s in ALL if repr(s) != "Real()"]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 4, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("S", ALL, ids=repr)
def test_forward_identical_and_restored(S):
    model, x = _mlp(), _x()
    expected = model(x)
    assert sa.node_info(expected.grad_fn) is None
    with sa.patch(model, S):
        y = model(x)
        info = sa.node_info(y.grad_fn)
        assert (info.op, info.module, info.semiring, info.recorded) == ("linear", "2", S, None)
        torch_graph = type(S) is sa.Real and not S.formulas
        assert (info.sequence_nrs is not None) == torch_graph
    assert torch.equal(y, expected)
    assert sa.node_info(model(x).grad_fn) is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_handle_remove_and_double_patch_error():
    model = _mlp()
    handle = sa.patch(model, sa.MaxProduct())
    with pytest.raises(sa.PatchError, match="already patched"):
        sa.patch(model, sa.Log())
    with pytest.raises(sa.PatchError, match="already patched"):
        sa.patch(model[0], sa.Log())
    handle.remove()
    with sa.patch(model, sa.Log()):
        pass


def test_bad_semiring_argument():
    with pytest.raises(sa.PatchError, match=r"pass an instance: MaxProduct\(\)"):
        sa.patch(_mlp(), sa.MaxProduct)
    with pytest.raises(sa.PatchError, match="semiring instance"):
        sa.patch(_mlp(), "max")
    with pytest.raises(sa.PatchError, match="nn.Module"):
        sa.patch(lambda x: x, sa.Real())


def test_restore_on_exception():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.lin(x)).foo_does_not_exist()

    model, x = Boom().double(), _x()
    with pytest.raises(AttributeError):
        with sa.patch(model, sa.MaxProduct()):
            model(x)
    assert type(torch.tanh(x).grad_fn).__name__ == "TanhBackward0"
    assert type(model.lin(x).grad_fn).__name__ == "AddmmBackward0"
    with sa.patch(model, sa.Log()):  # patchable again: nothing was left registered
        pass


def test_thread_isolation():
    model, x = _mlp(), _x()
    results: dict[str, str] = {}
    barrier = threading.Barrier(2)

    def other():
        barrier.wait()
        results["other"] = type(model(x).grad_fn).__name__

    t = threading.Thread(target=other)
    with sa.patch(model, sa.MaxProduct()):
        t.start()
        barrier.wait()
        results["mine"] = type(model(x).grad_fn).__name__
        t.join()
    assert results["other"] == "AddmmBackward0"
    assert results["mine"] == "LinearBackward"


def test_unsupported_op_names_function_module_and_yaml():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4))
            self.inner = Sin()

        def forward(self, x):
            return self.inner(self.block(x))

    class Sin(nn.Module):
        def forward(self, x):
            return torch.sin(x)

    model, x = Net().double(), _x()
    with pytest.raises(sa.UnsupportedOpError) as info:
        with sa.patch(model, sa.MaxProduct()):
            model(x)
    msg = str(info.value)
    assert "torch.sin" in msg and "'inner'" in msg and "derivatives/" in msg
    assert type(model(x).grad_fn).__name__ == "SinBackward0"


def test_unsupported_arguments_are_explained():
    model = nn.Sequential(nn.Linear(4, 4))
    x = _x().float()

    class AttentionDropout(nn.Module):
        def forward(self, x):
            q = x.reshape(1, 1, *x.shape)
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)

    m = nn.Sequential(model, AttentionDropout())
    with pytest.raises(sa.UnsupportedOpError, match="dropout_p == 0"):
        with sa.patch(m, sa.Log()):
            m(x)


def test_inplace_op_without_an_out_of_place_entry_is_rejected():
    class Inplace(nn.Module):
        def forward(self, x):
            y = x * 2
            y.sinh_()
            return y

    model = Inplace()
    with pytest.raises(sa.UnsupportedOpError, match="in place"):
        with sa.patch(model, sa.Real(formulas=True)):
            model(_x())


def test_no_grad_records_nothing():
    model, x = _mlp(), _x()
    with sa.patch(model, sa.MaxProduct()):
        with torch.no_grad():
            y = model(x)
        with torch.inference_mode():
            z = model(x)
    assert y.grad_fn is None and z.grad_fn is None
    assert torch.equal(y, model(x).detach())


def test_ops_on_tensors_without_grad_run_untouched():
    model = _mlp()
    model.requires_grad_(False)
    x = torch.randn(2, 4, dtype=torch.float64)
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    assert y.grad_fn is None


def test_foreign_graph_error_at_backward():
    model, x = _mlp(), _x()
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    z = y.tanh().sum()  # a native TanhBackward sits between the output and the patched graph
    with pytest.raises(sa.ForeignOpError, match="aten.tanh_backward"):
        sa.grad(z, x)


def test_structural_native_ops_after_patch_are_allowed():
    """Indexing / summing the output outside patch only moves or ⊕-merges messages."""
    model, x = _mlp(), _x()
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    a = sa.grad(y[0, 1], x, retain_graph=True)
    with sa.patch(model, sa.MaxProduct()):
        y2 = model(x)
        picked = y2[0, 1]
    b = sa.grad(picked, x, retain_graph=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    whole = sa.grad(y.sum(), x)
    with sa.patch(model, sa.MaxProduct()):
        total = model(x).sum()
    torch.testing.assert_close(whole, sa.grad(total, x), rtol=0, atol=0)


def test_no_graph_error():
    x = _x()
    with pytest.raises(sa.SemiringAutogradError, match="sa.patch"):
        sa.grad((x * 2).sum(), x)


@pytest.mark.parametrize("S", ALL, ids=repr)
def test_retain_graph_twice_same_result(S):
    model, x = _mlp(), _x()
    with sa.patch(model, S):
        y = model(x)
    a = sa.grad(y, x, retain_graph=True)
    b = sa.grad(y, x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="second time|freed"):
        sa.grad(y, x)


def test_inplace_change_of_saved_tensor_raises_version_error():
    class Exp(nn.Module):
        def forward(self, x):
            return torch.exp(x)

    model, x = Exp(), _x()
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        sa.grad(y.sum(), x)


@pytest.mark.parametrize("S", ALL, ids=repr)
def test_backward_and_autograd_grad_with_seed_message(S):
    model, x = _mlp(), _x()
    with sa.patch(model, S):
        y = model(x)
    expected = sa.grad(y, x, retain_graph=True, raw=True)
    seed = seed_message(S, y)
    (via_grad,) = torch.autograd.grad(y, x, seed, retain_graph=True)
    y.backward(seed)
    for got in (via_grad, x.grad):
        for a, b in zip(message_value(got, S, x), message_value(expected, S, x)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_backward_accumulates_with_semiring_add():
    """Two .backward() calls accumulate into x.grad with ⊕ (max for MaxProduct)."""
    model, x = _mlp(), _x()
    S = sa.MaxProduct()
    weights = torch.tensor([[0.5, 3.0], [2.0, 0.1]], dtype=torch.float64)
    with sa.patch(model, S):
        y = model(x)
    first = sa.grad(y, x, retain_graph=True)
    second = sa.grad(y, x, seed=weights, retain_graph=True)
    y.backward(seed_message(S, y), retain_graph=True)
    y.backward(seed_message(S, y, weights))
    assert not torch.equal(first, second)
    torch.testing.assert_close(x.grad.value[0], torch.maximum(first, second), rtol=0, atol=0)


def test_plain_grad_then_semiring_backward_is_explained():
    model, x = _mlp(), _x()
    model(x).sum().backward()
    S = sa.Log()
    with sa.patch(model, S):
        y = model(x)
    with pytest.raises(sa.ForeignOpError, match=r"x.grad = None"):
        y.backward(seed_message(S, y))


@pytest.mark.parametrize("S", ALL, ids=repr)
def test_hooks_see_messages(S):
    model, x = _mlp(), _x()
    with sa.patch(model, S):
        y = model(x)
    seen = []
    y.grad_fn.register_prehook(lambda grad_out: seen.append(("pre", grad_out[0])))
    y.grad_fn.register_hook(lambda grad_in, grad_out: seen.append(("post", grad_in)))
    sa.grad(y, x)
    expected = torch.Tensor if isinstance(S, sa.Real) else Message
    assert seen[0][0] == "pre" and isinstance(seen[0][1], expected)
    assert seen[1][0] == "post"
    assert any(isinstance(g, expected) for g in seen[1][1] if g is not None)


def test_mixing_semirings_is_an_error():
    model, x = _mlp(), _x()
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    with pytest.raises(sa.SemiringMismatchError):
        torch.autograd.grad(y, x, seed_message(sa.Log(), y))
    with pytest.raises(sa.SemiringMismatchError, match="plain tensor"):
        torch.autograd.grad(y, x, torch.ones_like(y))


def test_needs_input_grad_no_weight_messages():
    """Only the input is asked for: no weight message is computed (engine sees None)."""
    model, x = _mlp(), _x()
    model.requires_grad_(False)
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    node = y.grad_fn
    outs = []
    node.register_hook(lambda grad_in, grad_out: outs.append(grad_in))
    sa.grad(y, x)
    assert len(outs[0]) == 3  # (input, weight, bias): the tensor inputs of linear
    assert isinstance(outs[0][0], Message)
    assert outs[0][1] is None and outs[0][2] is None


@pytest.mark.parametrize("S", [sa.Log(), sa.Entropy(), sa.Counting(), sa.SignedMaxProduct()])
def test_zero_derivatives_give_no_nan(S):
    class Dead(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 6)

        def forward(self, x):
            h = torch.relu(self.lin(x) - 100.0)  # every unit dead: all derivatives 0
            return (h * x.sum(-1, keepdim=True)).sum() + (x[:, :2] ** 2).sum()

    torch.manual_seed(0)
    model = Dead().double()
    x = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    with sa.patch(model, S):
        y = model(x)
    msg = sa.grad(y, x, raw=True)
    value = message_value(msg, S, x)
    for comp in value:
        assert not torch.isnan(comp).any()
    assert not torch.isnan(S.readout(value)).any()


@pytest.mark.parametrize("S", FUNCTIONS, ids=repr)
def test_unrequested_weights_get_no_message(S):
    """Weights require grad but only the input is asked for: the engine would drop their
    messages, so none is computed; asking for a weight still gets its message, and
    ``.backward()`` still accumulates into every leaf. (Under ``sa.Real()`` torch records
    its own nodes, and its engine skips the unrequested edges itself.)"""
    model, x = _mlp(), _x()
    with sa.patch(model, S):
        y = model(x)
    sent = []
    y.grad_fn.register_hook(lambda grad_in, grad_out: sent.append(grad_in))
    sa.grad(y, x, retain_graph=True)
    assert sent[-1][0] is not None and sent[-1][1] is None and sent[-1][2] is None
    weight = model[2].weight
    sa.grad(y, [x, weight], retain_graph=True)
    assert sent[-1][1] is not None and sent[-1][2] is None
    hidden = model[1](model[0](x))  # a non-leaf input: its producer's edges are used
    with sa.patch(model[2], S):
        z = model[2](hidden)
    z.grad_fn.register_hook(lambda grad_in, grad_out: sent.append(grad_in))
    sa.grad(z, hidden)
    assert sent[-1][0] is not None and sent[-1][1] is None
    y.backward(seed_message(S, y))
    assert all(p.grad is not None for p in model.parameters())
