"""``inplace=True`` flags and in-place functional forms inside a patched model.

``F.relu(h, inplace=True)``, ``nn.Hardswish(inplace=True)``, ``nn.Dropout(inplace=True)``,
``F.elu_(h)`` … run as the functional op with ``inplace=False`` on a copy of ``h`` and the
result is written into ``h``: the output aliases ``h``, and a later read of ``h`` sees the new
value. Each row is one such layer inside a small net, ``out = act(h) * h`` with
``h = W x + b`` (``h`` read again after the write, so ``out = act(h)²``). Per semiring, every
row's patched forward equals the unpatched one exactly; its readout at ``x`` equals path
enumeration through ``x → h → a = act(h) → out = a · a`` (the act's edges from the
out-of-place layer's Jacobian, ``tests/oracle.py``), Real also ``torch.autograd.grad`` of the
unpatched in-place net, and every semiring the same net written out of place. A call that
cannot run is refused at forward, naming the op, the module and the fix.
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from op_checks import assert_value_close, random_cotangent, raw_value
from oracle import Program
from torch import Tensor, nn
from user_semirings import Tropical

import semiring_autograd as sa
from semiring_autograd.semirings import BUILTIN_SEMIRINGS, Semiring

SEMIRINGS = (
    [sa.Real(formulas=True)] + [cls() for cls in BUILTIN_SEMIRINGS] + [sa.KBest(2), Tropical()]
)
RTOL, ATOL = 1e-7, 1e-9  # against the oracle (tests/test_ops_oracle.py's)
REAL_RTOL, REAL_ATOL = 1e-10, 1e-12  # Real against torch.autograd, and in place against out
FROM_RESULT = (1e-6, 1e-7)  # see Row.from_result
RNG_SEED = 1234


class _Fn(nn.Module):
    """A layer that calls ``fn``."""

    def __init__(self, fn: Callable[[Tensor], Tensor]):
        super().__init__()
        self.fn = fn

    def forward(self, h: Tensor) -> Tensor:
        return self.fn(h)


@dataclass(frozen=True)
class Row:
    name: str
    layer: Callable[[], nn.Module]  # writes into its input, returns it
    plain: Callable[[Tensor], Tensor]  # the same op out of place (the oracle's edges)
    shape: tuple[int, ...] = (3, 4)  # x's shape; the linear maps its last dim
    random: bool = False  # a training-mode mask: no Jacobian oracle (it would draw anew)
    #: torch's in-place form differentiates from its result (celu_: elu_backward reads
    #: result + alpha, which cancels where the result nears -alpha; 2e-7 relative here in
    #: float64): Real is held to the unpatched in-place net at FROM_RESULT (the oracle, from
    #: the input, at RTOL)
    from_result: bool = False


def _module(cls: type, *args, train: bool = False) -> Callable[[], nn.Module]:
    return lambda: cls(*args, inplace=True).train(train)


def _fn(fn: Callable[[Tensor], Tensor]) -> Callable[[], nn.Module]:
    return lambda: _Fn(fn)


ROWS = [
    # the nn.Module forms (each calls its functional op with inplace=True)
    Row("nn.ReLU", _module(nn.ReLU), F.relu),
    Row("nn.ReLU6", _module(nn.ReLU6), F.relu6),
    Row("nn.Hardtanh", _module(nn.Hardtanh, -1.5, 2.0), lambda h: F.hardtanh(h, -1.5, 2.0)),
    Row("nn.Hardswish", _module(nn.Hardswish), F.hardswish),
    Row("nn.Hardsigmoid", _module(nn.Hardsigmoid), F.hardsigmoid),
    Row("nn.LeakyReLU", _module(nn.LeakyReLU, 0.2), lambda h: F.leaky_relu(h, 0.2)),
    Row("nn.ELU", _module(nn.ELU, 0.7), lambda h: F.elu(h, 0.7)),
    Row("nn.SELU", _module(nn.SELU), F.selu),
    Row("nn.CELU", _module(nn.CELU, 1.3), lambda h: F.celu(h, 1.3), from_result=True),
    Row("nn.SiLU", _module(nn.SiLU), F.silu),
    Row("nn.Mish", _module(nn.Mish), F.mish),
    Row("nn.Threshold", _module(nn.Threshold, 0.5, -2.0), lambda h: F.threshold(h, 0.5, -2.0)),
    Row(
        "nn.RReLU.eval",
        _module(nn.RReLU, 0.1, 0.3),
        lambda h: F.rrelu(h, 0.1, 0.3, training=False),
    ),
    Row("nn.Dropout.eval", _module(nn.Dropout, 0.4), lambda h: h),
    Row("nn.Dropout.p0_train", _module(nn.Dropout, 0.0, train=True), lambda h: h),
    Row("nn.Dropout1d.eval", _module(nn.Dropout1d, 0.4), lambda h: h, (2, 3, 2)),
    Row("nn.Dropout2d.eval", _module(nn.Dropout2d, 0.4), lambda h: h, (2, 2, 1, 3)),
    Row(
        "nn.Dropout3d.p0_train",
        _module(nn.Dropout3d, 0.0, train=True),
        lambda h: h,
        (2, 1, 1, 2, 2),
    ),
    Row("nn.AlphaDropout.eval", _module(nn.AlphaDropout, 0.5), lambda h: h),
    Row(
        "nn.FeatureAlphaDropout.eval",
        _module(nn.FeatureAlphaDropout, 0.5),
        lambda h: h,
        (2, 2, 1, 3),
    ),
    # training-mode masks, drawn as torch draws them in place (same seed, same output)
    Row("nn.Dropout.train", _module(nn.Dropout, 0.4, train=True), None, random=True),
    Row("nn.Dropout2d.train", _module(nn.Dropout2d, 0.5, train=True), None, (2, 3, 1, 2), True),
    # functional flags no module above passes
    Row("F.relu6", _fn(lambda h: F.relu6(h, inplace=True)), F.relu6),
    Row(
        "F.alpha_dropout.p0_train", _fn(lambda h: F.alpha_dropout(h, 0.0, True, True)), lambda h: h
    ),
    Row(
        "F.feature_alpha_dropout.eval",
        _fn(lambda h: F.feature_alpha_dropout(h, 0.5, False, inplace=True)),
        lambda h: h,
        (2, 2, 1, 3),
    ),
    # the in-place functional forms
    Row("F.relu_", _fn(F.relu_), F.relu),
    Row("F.elu_", _fn(lambda h: F.elu_(h, 0.7)), lambda h: F.elu(h, 0.7)),
    Row("F.leaky_relu_", _fn(lambda h: F.leaky_relu_(h, 0.2)), lambda h: F.leaky_relu(h, 0.2)),
    Row(
        "F.hardtanh_", _fn(lambda h: F.hardtanh_(h, -1.5, 2.0)), lambda h: F.hardtanh(h, -1.5, 2.0)
    ),
    Row(
        "F.threshold_",
        _fn(lambda h: F.threshold_(h, 0.5, -2.0)),
        lambda h: F.threshold(h, 0.5, -2.0),
    ),
    Row("F.rrelu_", _fn(lambda h: F.rrelu_(h, 0.1, 0.3)), lambda h: F.rrelu(h, 0.1, 0.3)),
    Row("torch.selu_", _fn(torch.selu_), F.selu),
    Row(
        "torch.celu_",
        _fn(lambda h: torch.celu_(h, 1.3)),
        lambda h: F.celu(h, 1.3),
        from_result=True,
    ),
    Row("torch.dropout_.eval", _fn(lambda h: torch.dropout_(h, 0.4, False)), lambda h: h),
    Row("torch._C._nn.hardswish_", _fn(torch._C._nn.hardswish_), F.hardswish),
    Row("torch._C._nn.silu_", _fn(torch._C._nn.silu_), F.silu),
]


class _Net(nn.Module):
    """``out = act(h) · h`` with ``h = W x + b`` (``W``, ``b`` fixed); ``inplace``: the row's
    layer, which writes into ``h`` (so ``out = act(h)²``); else the layer with
    ``inplace=False`` (or the out-of-place function) and ``out = act(h) · act(h)``."""

    def __init__(self, row: Row, inplace: bool):
        super().__init__()
        width = row.shape[-1]
        g = torch.Generator().manual_seed(zlib.crc32(row.name.encode()))
        self.linear = nn.Linear(width, width).double()
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(width, width, generator=g, dtype=torch.float64))
            self.linear.bias.copy_(torch.randn(width, generator=g, dtype=torch.float64))
        self.act = row.layer()
        self.inplace = inplace
        if not inplace:
            if hasattr(self.act, "inplace"):
                self.act = copy.copy(self.act)
                self.act.inplace = False
            else:
                self.act = _Fn(row.plain)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear(x)
        a = self.act(h)
        return a * h if self.inplace else a * a


def _x(row: Row) -> Tensor:
    n = torch.Size(row.shape).numel()
    return torch.linspace(-3.0, 3.0, n, dtype=torch.float64).reshape(row.shape)


def _seed(row: Row, like: Tensor) -> Tensor:
    return random_cotangent(
        like.shape, torch.Generator().manual_seed(zlib.crc32(row.name.encode()))
    )


def _patched(model: nn.Module, S: Semiring, x: Tensor) -> Tensor:
    with sa.patch(model, S):
        torch.manual_seed(RNG_SEED)
        return model(x)


def _oracle(row: Row, model: _Net, S: Semiring, x: Tensor, seed: Tensor):
    """Path enumeration through x → h → a = act(h) → out = a · a."""
    weight, bias = model.linear.weight.detach(), model.linear.bias.detach()
    p = Program(x=x)
    p.op("h", lambda x: F.linear(x, weight, bias), "x")
    p.op("a", row.plain, "h")
    p.op("out", torch.mul, "a", "a")
    return p.path_sum(S, "out", seed, ["x"])[0]


def _check(row: Row, S: Semiring) -> None:
    model = _Net(row, inplace=True)
    ref_x = _x(row).requires_grad_()
    torch.manual_seed(RNG_SEED)
    ref = model(ref_x)
    x = _x(row).requires_grad_()
    out = _patched(model, S, x)
    assert torch.equal(out, ref), "the patched forward differs from the unpatched one"
    assert "forward" not in model.act.__dict__
    seed = _seed(row, out)
    raw = sa.grad(out, x, seed=seed, raw=True, retain_graph=True)
    got = sa.grad(out, x, seed=seed)

    if isinstance(S, sa.Real):
        (want,) = torch.autograd.grad(ref, ref_x, seed)
        tol = FROM_RESULT if row.from_result else (REAL_RTOL, REAL_ATOL)
        torch.testing.assert_close(raw_value(S, raw, x)[0], want, rtol=tol[0], atol=tol[1])
    if not row.random:
        expected = _oracle(row, model, S, x, seed)
        assert_value_close(raw_value(S, raw, x), expected, "raw value vs oracle", RTOL, ATOL)
        torch.testing.assert_close(got, S.readout(expected), rtol=RTOL, atol=ATOL)

    plain_x = _x(row).requires_grad_()
    plain_out = _patched(_Net(row, inplace=False), S, plain_x)
    assert torch.equal(plain_out, out), "the out-of-place net's forward differs"
    want = sa.grad(plain_out, plain_x, seed=seed)
    torch.testing.assert_close(got, want, rtol=REAL_RTOL, atol=REAL_ATOL)


@pytest.mark.filterwarnings("ignore:dropout2d. Received a")
@pytest.mark.parametrize("S", SEMIRINGS, ids=repr)
def test_inplace_flags_equal_their_oracles(S: Semiring):
    """Every row under ``S`` (one test per semiring; every failing row reported)."""
    failures = []
    for row in ROWS:
        try:
            _check(row, S)
        except Exception as exc:  # noqa: BLE001 - reported with its row, below
            failures.append(f"{row.name}: {type(exc).__name__}: {exc}")
    assert not failures, f"{len(failures)} of {len(ROWS)} rows fail under {S!r}:\n" + "\n".join(
        failures
    )


class _WritesIntoView(nn.Module):
    """``nn.ReLU(inplace=True)`` on a view of ``h`` (its columns 1:), then ``h`` read."""

    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = x * 2
        self.act(h[:, 1:])
        return h * x


@pytest.mark.parametrize("S", SEMIRINGS, ids=repr)
def test_inplace_flag_into_a_view(S: Semiring):
    """Into a view of an intermediate: the write reaches the base, whose later read has the
    edges torch.autograd gives it (the view's elements through the relu, the others
    straight), equal to path enumeration through x → h = 2x → r = h with relu on its
    columns 1: → out = r · x; Real also to ``torch.autograd.grad``."""
    model = _WritesIntoView()
    x = torch.linspace(-1.5, 2.0, 12, dtype=torch.float64).reshape(3, 4).requires_grad_()
    ref = model(x)
    out = _patched(model, S, x)
    assert torch.equal(out, ref)
    seed = _seed(Row("view", None, None), out)
    raw = sa.grad(out, x, seed=seed, raw=True, retain_graph=True)
    if isinstance(S, sa.Real):
        (want,) = torch.autograd.grad(ref, x, seed)
        torch.testing.assert_close(raw_value(S, raw, x)[0], want, rtol=REAL_RTOL, atol=REAL_ATOL)
    p = Program(x=x)
    p.op("h", lambda x: x * 2, "x")
    p.op("r", lambda h: torch.cat([h[:, :1], F.relu(h[:, 1:])], 1), "h")
    p.op("out", torch.mul, "r", "x")
    expected = p.path_sum(S, "out", seed, ["x"])[0]
    assert_value_close(raw_value(S, raw, x), expected, "raw value vs oracle", RTOL, ATOL)
    torch.testing.assert_close(
        sa.grad(out, x, seed=seed), S.readout(expected), rtol=RTOL, atol=ATOL
    )


class _OnLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(x)


@pytest.mark.parametrize("S", [sa.Real(), sa.MaxProduct()], ids=repr)
def test_inplace_flag_on_a_leaf_is_refused_as_torch_refuses_it(S: Semiring):
    """A leaf that requires grad (the model's input) cannot be written in place: the patch
    says what torch says, before anything is written, and leaves the model as it was."""
    model = _OnLeaf()
    x = torch.linspace(-1.5, 2.0, 12, dtype=torch.float64).reshape(3, 4).requires_grad_()
    before = x.detach().clone()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad") as info:
        model(x)
    with pytest.raises(RuntimeError, match=str(info.value)[:40]):
        _patched(model, S, x)
    assert torch.equal(x.detach(), before)
    assert all("forward" not in m.__dict__ for m in model.modules())


#: calls that cannot run: (layer, what the refusal names besides the op and the module)
REFUSED = [
    ("nn.RReLU.train", lambda: nn.RReLU(inplace=True).train(), "rrelu", "not training"),
    (
        "F.alpha_dropout.train",
        lambda: _Fn(lambda h: F.alpha_dropout(h, 0.5, True, inplace=True)),
        "alpha_dropout",
        "not training or p == 0",
    ),
    (
        "nn.FeatureAlphaDropout.train",
        lambda: nn.FeatureAlphaDropout(0.5, inplace=True).train(),
        "feature_alpha_dropout",
        "not training or p == 0",
    ),
    (
        "F.elu_.scale",
        lambda: _Fn(lambda h: torch._C._nn.elu_(h, 1.0, 2.0)),
        "elu_",
        "only with the arguments torch.nn.functional.elu takes",
    ),
]


@pytest.mark.parametrize("S", [sa.Real(), sa.Entropy()], ids=repr)
@pytest.mark.parametrize("name, layer, op, fix", REFUSED, ids=[r[0] for r in REFUSED])
def test_inplace_call_that_cannot_run_is_refused(name, layer, op, fix, S: Semiring):
    row = Row(name, layer, None)
    model = _Net(row, inplace=True)
    x = _x(row).requires_grad_()
    with pytest.raises(sa.UnsupportedOpError) as info:
        _patched(model, S, x)
    message = str(info.value)
    assert op in message and "(in module 'act')" in message and fix in message, message
    assert all("forward" not in m.__dict__ for m in model.modules())
