"""The per-call shortcuts of the dispatch path keep their meaning: binding a call's values to
a signature's types, the kernel mode read from the environment on every call, and the
NodeInfo each recorded node carries."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import semiring_autograd as sa
from semiring_autograd.engine.graph import NodeInfo
from semiring_autograd.kernels import build
from semiring_autograd.ops.spec import OpSpec, ParamSpec

ENV = "SEMIRING_AUTOGRAD_KERNELS"


def _spec(type_: str) -> OpSpec:
    return OpSpec(
        "probe", f"probe({type_} v)", (ParamSpec("v", type_, False, None, False),), (), "op", ""
    )


#: (parameter type, value, whether a call passing it binds), stated from the YAML types
BINDINGS = [
    ("Scalar", 2, True),
    ("Scalar", 2.5, True),
    ("Scalar", True, True),
    ("Scalar", np.float64(0.5), True),
    ("Scalar", np.int64(3), True),
    ("Scalar", torch.tensor(1.0), False),
    ("Scalar", "2", False),
    ("Scalar", None, False),
    ("Scalar?", None, True),
    ("Scalar?", 1.0, True),
    ("float", 0.5, True),
    ("float", 3, True),
    ("float", np.float32(0.5), True),
    ("float", True, False),
    ("float", torch.tensor(0.5), False),
    ("float?", None, True),
    ("int", 3, True),
    ("int", True, False),
    ("int", 3.0, False),
    ("int", np.int64(3), False),
    ("int?", None, True),
    ("int?", False, False),
    ("int[]", [1, 2], True),
    ("int[]", (1,), True),
    ("int[]", torch.Size([2, 3]), True),
    ("int[]", 4, True),
    ("int[]", [1, True], False),
    ("int[]", [1, 2.0], False),
    ("int[]", "12", False),
    ("Tensor[]", [torch.zeros(1), torch.ones(2)], True),
    ("Tensor[]", (torch.zeros(1),), True),
    ("Tensor[]", [torch.zeros(1), 1.0], False),
    ("Tensor[]", torch.zeros(2), False),
]


@pytest.mark.parametrize("type_,value,binds", BINDINGS)
def test_bind_checks_each_value_against_its_type(type_, value, binds):
    for _ in range(2):  # the first call works out the call shape's layout, the second reuses it
        bound = _spec(type_).bind((value,), {})
        assert (bound is not None) == binds
        if binds:
            assert bound["v"] is value


def test_bind_by_keyword_checks_the_same_way():
    spec = _spec("int")
    assert spec.bind((), {"v": 3}) == {"v": 3}
    assert spec.bind((), {"v": True}) is None


@pytest.fixture
def restore_env():
    before = os.environ.get(ENV)
    yield
    if before is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = before


@pytest.mark.usefixtures("restore_env")
def test_mode_follows_every_write_to_the_environment():
    os.environ.pop(ENV, None)
    assert build.mode() == "check"
    os.environ[ENV] = "trust"
    assert build.mode() == "trust"
    os.environ[ENV] = "eager"
    assert build.mode() == "off"
    os.environ[ENV] = " Check "
    assert build.mode() == "check"
    os.environ.update({ENV: "off"})
    assert build.mode() == "off"
    del os.environ[ENV]
    assert build.mode() == "check"
    os.environ[ENV] = "sometimes"
    with pytest.raises(ValueError, match="'sometimes' is not a kernel mode"):
        build.mode()


class _Scaled(torch.nn.Module):
    def forward(self, x):
        return (x * 2.0).exp()


@pytest.mark.parametrize("semiring", [sa.MaxProduct(), sa.Entropy(), sa.Real()], ids=repr)
def test_each_node_names_its_op_module_and_semiring(semiring):
    model = torch.nn.Sequential(_Scaled())
    x = torch.rand(3, requires_grad=True)
    with sa.patch(model, semiring):
        y = model(x)
    info = sa.node_info(y.grad_fn)
    assert type(info) is NodeInfo
    assert (info.op, info.module, info.semiring) == ("exp", "0", semiring)
    assert info.recorded is None
    if semiring == sa.Real():  # torch's own nodes: the call's range of sequence numbers
        assert info.sequence_nrs is not None and len(info.sequence_nrs) == 1
        assert info.input_nodes == (y.grad_fn.next_functions[0][0],)
    else:
        assert (info.sequence_nrs, info.input_nodes) == (None, ())


class _Casts(torch.nn.Module):
    """Casts to a value's own dtype and a contiguous of a contiguous tensor (torch hands
    the value back), then a real cast and a contiguous copy of a transpose."""

    def forward(self, x):
        scaled = x * 3.0
        same = scaled.to(torch.float32).float().type(torch.float32).contiguous()
        self.handed_back = same is scaled
        wide = same.to(torch.float64)
        return (wide.mT.contiguous() * wide.mT).sum(0)


def _recorded_ops(out: torch.Tensor) -> list[str]:
    ops, seen = [], set()
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        info = sa.node_info(node)
        ops.append(info.op if info is not None else node.name())
        stack.extend(n for n, _ in node.next_functions)
    return ops


@pytest.mark.parametrize("semiring", [sa.Real(formulas=True), sa.MaxProduct(), sa.Log()], ids=repr)
def test_a_call_handing_back_its_input_records_nothing(semiring):
    """A cast to a value's own dtype or ``contiguous`` of a contiguous tensor is the value
    itself, as in torch, with no node of its own; the real cast and the copying contiguous
    are recorded. The messages match torch.autograd (Real, in float64) and the path sums
    of the same computation without the casts (x → 3x → (3x)² has one path per element of
    weight 2·9·x, two edges of 3·3x merged by ⊕)."""
    model = _Casts()
    x = (torch.rand(4, 3) + 0.5).requires_grad_(True)
    with sa.patch(model, semiring):
        out = model(x)
    assert model.handed_back
    ops = _recorded_ops(out)
    assert ops.count("to") == 1 and ops.count("contiguous") == 1
    assert "float" not in ops and "type" not in ops
    got = sa.grad(out, x)
    wide = 3.0 * x.detach().double()
    if isinstance(semiring, sa.Real):
        expected = 18.0 * x.detach().double()
    elif isinstance(semiring, sa.MaxProduct):  # max over the two edges of weight 3·wide
        expected = 3.0 * wide
    else:  # log-sum-exp of the two paths' log weights: log(2·3·wide)
        expected = torch.log(2.0 * 3.0 * wide)
    torch.testing.assert_close(got.double(), expected.to(got.device), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("semiring", [sa.MaxProduct(), sa.Log()], ids=repr)
def test_a_call_handing_back_a_leaf_is_recorded(semiring):
    """A cast of a leaf (or of a tensor made outside the patch) to its own dtype is recorded
    as a node, so that a forward of nothing else still names its semiring: its message is
    the seed (identity edges)."""
    model = torch.nn.Identity()
    model.forward = lambda x: x.to(torch.float32)
    x = torch.rand(5, requires_grad=True)
    with sa.patch(model, semiring):
        out = model(x)
    assert out is not x and _recorded_ops(out)[0] == "to"
    expected = torch.ones(5) if isinstance(semiring, sa.MaxProduct) else torch.zeros(5)
    torch.testing.assert_close(sa.grad(out, x), expected)


def test_a_call_handing_back_another_semirings_tensor_is_recorded():
    """A value recorded under one semiring, cast to its own dtype under another's patch, is
    recorded there: the backward then names both semirings and refuses to mix them, as it
    does for any other op."""
    first, second = torch.nn.Identity(), torch.nn.Identity()
    first.forward = lambda x: x * 2.0
    second.forward = lambda y: y.float()
    x = torch.rand(4, requires_grad=True)
    with sa.patch(first, sa.MaxProduct()):
        y = first(x)
    with sa.patch(second, sa.Log()):
        out = second(y)
    assert out is not y and _recorded_ops(out)[0] == "float"
    with pytest.raises(sa.SemiringMismatchError, match="must use one semiring"):
        sa.grad(out, x)
