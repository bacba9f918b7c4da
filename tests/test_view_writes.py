"""Writes into views inside a patched model, under every semiring.

``z[:, :, head] = 0`` (TransformerLens' head ablation), ``y[:, :2].mul_(3)``,
``out[:, :n].copy_(x)``, ``F.relu(y[:, 1:], inplace=True)`` … write through a view that a
patched op returned (a slice, a reshape, a transpose, a diagonal …) into its base. The
graph has the edges torch.autograd gives the same code: the written elements read the new
value, the others keep their edges, and a view taken before the write reads its base's new
value. Each row is one such write inside ``t = write(h, x)`` with ``h = W x + b``, then
``out = tanh(t) · t``; per semiring, the patched forward equals the unpatched one exactly,
and the readout at ``x`` equals path enumeration through ``x → h → t → a = tanh(t) →
out = a · t``, the write's edges taken from ``torch.autograd``'s Jacobian of the row run on a
copy of ``h`` (``tests/oracle.py``); Real also equals ``torch.autograd.grad`` of the
unpatched net.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from op_checks import assert_value_close, random_cotangent, raw_value
from oracle import Program, best_paths
from torch import Tensor, nn
from user_semirings import Tropical

import semiring_autograd as sa
from semiring_autograd.semirings import BUILTIN_SEMIRINGS, Semiring

SEMIRINGS = (
    [sa.Real(formulas=True)] + [cls() for cls in BUILTIN_SEMIRINGS] + [sa.KBest(2), Tropical()]
)
RTOL, ATOL = 1e-7, 1e-9  # against the oracle (tests/test_ops_oracle.py's)
REAL_RTOL, REAL_ATOL = 1e-10, 1e-12  # Real against torch.autograd of the unpatched net


def _heads(h: Tensor, x: Tensor) -> Tensor:
    z = h.view(3, 2, 2)  # (pos, head, d_head)
    z[:, 1] = 0.0
    return h


def _slice_mul(h: Tensor, x: Tensor) -> Tensor:
    h[:, :2].mul_(3.0)
    return h


def _slice_of_slice(h: Tensor, x: Tensor) -> Tensor:
    h[:, :2][0] = 1.0
    return h


def _transposed_add(h: Tensor, x: Tensor) -> Tensor:
    h.t()[1:3].add_(x.t()[:2])
    return h


def _strided_from_x(h: Tensor, x: Tensor) -> Tensor:
    h.view(2, 6)[1, ::2] = x.reshape(-1)[:3] * 2.0
    return h


def _copy_into_slice(h: Tensor, x: Tensor) -> Tensor:
    h[:, 1:3].copy_(x[:, :2])
    return h


def _copy_broadcast(h: Tensor, x: Tensor) -> Tensor:
    h[1:].copy_(x[0])
    return h


def _fresh_buffer(h: Tensor, x: Tensor) -> Tensor:
    out = torch.empty(3, 6, dtype=h.dtype)  # Mamba / DeepSeek-V3 expand_kv style
    out[:, :4].copy_(h)
    out[:, 4:].copy_(x[:, :2])
    return out


def _zeros_then_assign(h: Tensor, x: Tensor) -> Tensor:
    out = torch.zeros(3, 5, dtype=h.dtype)
    out[:, 1:] = h
    return out


def _fill(h: Tensor, x: Tensor) -> Tensor:
    h[1].fill_(0.5)
    h[:, -1].zero_()
    return h


def _torch_fill(h: Tensor, x: Tensor) -> Tensor:
    torch.fill_(h[:, 0], 2.0)
    torch.zero_(h[2, 1:3])
    return h


def _fill_tensor(h: Tensor, x: Tensor) -> Tensor:
    h[:, 2].fill_(x[0, 0] * 3.0)
    return h


def _relu_flag(h: Tensor, x: Tensor) -> Tensor:
    F.relu(h[:, 1:], inplace=True)
    return h


def _diagonal(h: Tensor, x: Tensor) -> Tensor:
    h[:, :3].diagonal().mul_(-2.0)
    return h


def _masked(h: Tensor, x: Tensor) -> Tensor:
    h[:, 2:].masked_fill_(x[:, :2] > 0.5, 0.0)
    return h


def _advanced(h: Tensor, x: Tensor) -> Tensor:
    h.t()[[0, 3]] = x.t()[1:3] * 0.5
    return h


def _view_read_after(h: Tensor, x: Tensor) -> Tensor:
    v = h[:, 1:]  # taken before its base is written
    h[0] = 0.0
    h[:, 2].div_(x[:, 0].exp())
    return v


def _two_views(h: Tensor, x: Tensor) -> Tensor:
    a, b = h[:, :2], h[:, 2:]
    a.sub_(b)
    b.mul_(-0.5)
    return h.flatten()


def _unsqueezed_permuted(h: Tensor, x: Tensor) -> Tensor:
    z = h.unsqueeze(0).permute(2, 0, 1)
    z[1:3, :, ::2] = z[0:2, :, 1::2].tanh()
    return h


@dataclass(frozen=True)
class Row:
    name: str
    write: Callable[[Tensor, Tensor], Tensor]  # writes into views of h; returns what is read


ROWS = [
    Row("heads_of_a_reshape", _heads),
    Row("slice_mul_", _slice_mul),
    Row("slice_of_slice_setitem", _slice_of_slice),
    Row("transpose_add_from_x", _transposed_add),
    Row("strided_setitem_from_x", _strided_from_x),
    Row("copy_into_slice", _copy_into_slice),
    Row("copy_broadcast", _copy_broadcast),
    Row("copy_into_fresh_buffer", _fresh_buffer),
    Row("zeros_then_slice_assign", _zeros_then_assign),
    Row("fill_and_zero", _fill),
    Row("torch_fill_and_zero", _torch_fill),
    Row("fill_with_tensor", _fill_tensor),
    Row("relu_inplace_flag", _relu_flag),
    Row("diagonal_mul_", _diagonal),
    Row("masked_fill_", _masked),
    Row("advanced_index_of_transpose", _advanced),
    Row("view_taken_before_base_write", _view_read_after),
    Row("two_views_of_one_base", _two_views),
    Row("unsqueezed_permuted_setitem", _unsqueezed_permuted),
]


class _Net(nn.Module):
    """``t = write(h, x)`` with ``h = W x + b`` (``W``, ``b`` fixed), ``out = tanh(t) · t``."""

    def __init__(self, row: Row):
        super().__init__()
        g = torch.Generator().manual_seed(zlib.crc32(row.name.encode()))
        self.linear = nn.Linear(4, 4).double()
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(4, 4, generator=g, dtype=torch.float64))
            self.linear.bias.copy_(torch.randn(4, generator=g, dtype=torch.float64))
        self.write = row.write

    def forward(self, x: Tensor) -> Tensor:
        t = self.write(self.linear(x), x)
        return torch.tanh(t) * t


def _x() -> Tensor:
    return torch.linspace(-1.5, 2.0, 12, dtype=torch.float64).reshape(3, 4)


def _oracle(row: Row, model: _Net, S: Semiring, x: Tensor, seed: Tensor):
    """Path enumeration through x → h → t = write(h, x) → a = tanh(t) → out = a · t."""
    weight, bias = model.linear.weight.detach(), model.linear.bias.detach()
    p = Program(x=x)
    p.op("h", lambda x: F.linear(x, weight, bias), "x")
    p.op("t", lambda h, x: row.write(h.clone(), x), "h", "x")
    p.op("a", torch.tanh, "t")
    p.op("out", torch.mul, "a", "t")
    return p.path_sum(S, "out", seed, ["x"])[0]


def _check(row: Row, S: Semiring) -> None:
    model = _Net(row)
    ref_x = _x().requires_grad_()
    ref = model(ref_x)
    x = _x().requires_grad_()
    with sa.patch(model, S):
        out = model(x)
    assert torch.equal(out, ref), "the patched forward differs from the unpatched one"
    seed = random_cotangent(out.shape, torch.Generator().manual_seed(zlib.crc32(row.name.encode())))
    raw = sa.grad(out, x, seed=seed, raw=True, retain_graph=True)
    got = sa.grad(out, x, seed=seed)
    if isinstance(S, sa.Real):
        (want,) = torch.autograd.grad(ref, ref_x, seed)
        torch.testing.assert_close(raw_value(S, raw, x)[0], want, rtol=REAL_RTOL, atol=REAL_ATOL)
    expected = _oracle(row, model, S, x, seed)
    assert_value_close(raw_value(S, raw, x), expected, "raw value vs oracle", RTOL, ATOL)
    torch.testing.assert_close(got, S.readout(expected), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("S", SEMIRINGS, ids=repr)
def test_view_writes_equal_their_oracles(S: Semiring):
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


class _Attention(nn.Module):
    """``z`` of shape (batch, pos, head, d_head) as a reshape of a projection, through a
    hook point (an identity module) whose forward hook may edit it in place."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4, 6).double()
        self.hook_z = nn.Identity()
        self.out = nn.Linear(6, 2).double()

    def forward(self, x: Tensor) -> Tensor:
        z = self.hook_z(self.proj(x).reshape(2, 3, 3, 2))
        return self.out(z.flatten(2).tanh())


@pytest.mark.parametrize("S", SEMIRINGS, ids=repr)
def test_head_ablation_in_a_forward_hook(S: Semiring):
    """TransformerLens' idiom, ``z[:, :, head] = 0`` in a hook on ``hook_z``: the readout is
    the readout of the net whose head's projection rows are zeroed (the same function, no
    edge into the ablated head), and torch.autograd's under Real."""
    model = _Attention()

    def ablate(module, inputs, z):
        z[:, :, 1] = 0.0

    x = torch.linspace(-1.0, 1.0, 24, dtype=torch.float64).reshape(2, 3, 4).requires_grad_()
    handle = model.hook_z.register_forward_hook(ablate)
    try:
        ref = model(x)
        (want_real,) = torch.autograd.grad(ref.sum(), x)
        with sa.patch(model, S):
            out = model(x)
        got = sa.grad(out.sum(), x)
    finally:
        handle.remove()
    assert torch.equal(out, ref)
    zeroed = _Attention()
    with torch.no_grad():
        rows = zeroed.proj.weight.view(3, 2, 4)  # output features as (head, d_head)
        rows[1] = 0.0
        zeroed.proj.bias.view(3, 2)[1] = 0.0
    x2 = x.detach().clone().requires_grad_()
    with sa.patch(zeroed, S):
        plain = zeroed(x2)
    torch.testing.assert_close(plain, out, rtol=0, atol=0)
    torch.testing.assert_close(got, sa.grad(plain.sum(), x2), rtol=1e-12, atol=0)
    if isinstance(S, sa.Real):
        torch.testing.assert_close(got, want_real, rtol=1e-12, atol=1e-14)


class _SplitWrite(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        a, b = (x * 2).split(2, 1)
        a.mul_(3.0)
        return a * b


@pytest.mark.parametrize("S", [sa.Real(), sa.MaxProduct(), sa.Log()], ids=repr)
def test_write_into_a_split_part_is_refused_as_torch_refuses_it(S: Semiring):
    """``split``/``unbind``/``chunk`` parts take no in-place write in torch (its message:
    replace the write by an out-of-place one); the patch refuses them the same way."""
    model = _SplitWrite()
    x = _x().requires_grad_()
    with pytest.raises(RuntimeError, match="returns multiple views") as unpatched:
        model(x)
    assert "out-of-place" in str(unpatched.value)
    with pytest.raises(RuntimeError, match="returns multiple views.*out-of-place"):
        with sa.patch(model, S):
            model(x)
    assert "forward" not in model.__dict__


class _ViewOf(torch.autograd.Function):
    """A user's Function that returns a view of its input (torch forbids writes into it)."""

    @staticmethod
    def forward(ctx, x):
        return x[:, :2]

    @staticmethod
    def backward(ctx, grad):
        return F.pad(grad, (0, 2))


class _WritesIntoFunctionView(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        v = _ViewOf.apply(x * 2)
        v.mul_(3.0)
        return v


def test_write_into_a_custom_functions_view_is_refused_with_the_fix():
    """Under ``sa.Real()`` a user's ``autograd.Function`` is torch's, and torch cannot write
    into its view: the patch names the op, the module and the fix, and leaves the model as
    it was."""
    model = _WritesIntoFunctionView()
    x = _x().requires_grad_()
    with pytest.raises(sa.UnsupportedOpError, match="writes in place into a view") as info:
        with sa.patch(model, sa.Real()):
            model(x)
    message = str(info.value)
    assert "torch.Tensor.mul_" in message and ".clone()" in message and "out of place" in message
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.SignedMaxProduct()], ids=repr)
def test_top_path_crosses_a_view_write(S: Semiring):
    """The best path through ``h[:, :2].mul_(3)`` and ``h[1].fill_(0.5)`` (torch's
    ``CopySlices`` and ``AsStridedBackward0`` nodes) has the weight of the best path that
    path enumeration finds."""

    def write(h: Tensor, x: Tensor) -> Tensor:
        h[:, :2].mul_(3.0)
        h[1].fill_(0.5)
        return h

    row = Row("top_path", write)
    model = _Net(row)
    x = _x().requires_grad_()
    with sa.patch(model, S, paths=True):
        out = model(x)
    weight, bias = model.linear.weight.detach(), model.linear.bias.detach()
    p = Program(x=x)
    p.op("h", lambda x: F.linear(x, weight, bias), "x")
    p.op("t", lambda h, x: write(h.clone(), x), "h", "x")
    p.op("a", torch.tanh, "t")
    p.op("out", torch.mul, "a", "t")
    which = "abs" if isinstance(S, sa.MaxProduct) else "max"
    element = 2 * 4 + 1  # out[2, 1]
    best = best_paths(p, "out", element, "x", which)
    winner = max(best.values(), key=lambda b: abs(b[0]) if which == "abs" else b[0])[0]
    found = sa.top_path(out[2, 1], x)
    assert found.weight == pytest.approx(winner, rel=1e-10)
