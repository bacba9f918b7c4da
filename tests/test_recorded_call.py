"""A recorded call's local-Jacobian columns against reverse-mode autograd's Jacobian.

``RecordedCall.column`` takes one column by forward-mode AD, the op's other inputs carrying
zero tangents where that is exact. The oracle is ``torch.autograd.functional.jacobian``
(reverse mode) of the same call in float64, one column of it."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from op_checks import Apply

import semiring_autograd as sa
from semiring_autograd.engine import recorded_call
from semiring_autograd.engine.recorded_call import RecordedCall

INF = float("inf")


def _inputs(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(s, generator=g, dtype=torch.float64) + 0.5 for s in shapes]


def _with(t: torch.Tensor, index: tuple[int, ...], value: float) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


# (name, op, inputs, positions): the node's inputs are the op's tensor arguments in order;
# the columns of the inputs at ``positions`` (None: every floating-point input) are checked.
# With an infinity in one operand of x · y only the columns of that operand are: forward
# mode gives the other's 0 · ∞ = NaN where the Jacobian has 0.
CASES: list[tuple[str, Callable, list[torch.Tensor], tuple[int, ...] | None]] = [
    ("mul", torch.mul, _inputs((3, 4), (3, 4)), None),
    ("mul, broadcast", torch.mul, _inputs((3, 4), (4,)), None),
    (
        "mul, an infinity in the other operand",
        torch.mul,
        [*_inputs((3, 4)), _with(_inputs((3, 4), seed=1)[0], (2, 1), INF)],
        (1,),
    ),
    (
        "mul, an infinity in the differentiated operand",
        torch.mul,
        [_with(_inputs((3, 4))[0], (2, 3), INF), *_inputs((3, 4), seed=1)],
        (0,),
    ),
    (
        "mul, an expanded operand",
        torch.mul,
        [_inputs((3, 4))[0], _inputs((1, 4), seed=1)[0].expand(3, 4)],
        None,
    ),
    ("x * x", lambda x: x * x, _inputs((3, 4)), None),
    ("add, alpha", lambda x, y: torch.add(x, y, alpha=2.5), _inputs((3, 4), (3, 4)), None),
    ("div", torch.div, _inputs((3, 4), (3, 4)), None),
    ("pow", lambda x: x.pow(3), _inputs((3, 4)), None),
    (
        "rsqrt of a mean",
        lambda x: torch.rsqrt(x.pow(2).mean(-1, keepdim=True)),
        _inputs((3, 4)),
        None,
    ),
    ("silu", F.silu, _inputs((3, 4)), None),
    ("softmax", lambda x: torch.softmax(x, -1), _inputs((3, 4)), None),
    ("where", lambda c, x, y: torch.where(c > 1, x, y), _inputs((3, 4), (3, 4), (3, 4)), (1, 2)),
    ("matmul", torch.matmul, _inputs((3, 4), (4, 5)), None),
]


def _record(op: Callable, inputs: list[torch.Tensor]) -> tuple[RecordedCall, torch.Tensor]:
    leaves = [t.detach().requires_grad_() for t in inputs]
    model = Apply(op)
    with sa.patch(model, sa.MaxProduct(), paths=True):
        out = model(*leaves)
    node = out.grad_fn
    while sa.node_info(node) is None or sa.node_info(node).recorded is None:
        node = node.next_functions[0][0]  # past the ops the call records as views
    return sa.node_info(node).recorded, out


def _oracle(call: RecordedCall, position: int, element: int) -> torch.Tensor:
    """Column ``element`` of ∂out/∂(input ``position``), by reverse mode."""
    inputs = [t.detach() for t in call.inputs()]

    def f(x: torch.Tensor) -> torch.Tensor:
        return call.rerun({**dict(enumerate(inputs)), position: x})

    x = inputs[position].contiguous()
    jacobian = torch.autograd.functional.jacobian(f, x)
    return jacobian.reshape(-1, x.numel())[:, element]


@pytest.mark.parametrize("name, op, inputs, positions", CASES, ids=[c[0] for c in CASES])
def test_columns_equal_reverse_mode_jacobian(
    name: str, op: Callable, inputs: list[torch.Tensor], positions: tuple[int, ...] | None
):
    call, _ = _record(op, inputs)
    for position, x in enumerate(call.inputs()):
        if positions is not None and position not in positions:
            continue
        for element in range(0, x.numel(), max(1, x.numel() // 5)):
            (column,) = call.column(position, element)
            expected = _oracle(call, position, element)
            torch.testing.assert_close(column, expected, rtol=1e-12, atol=1e-12)


def test_a_nan_from_a_zero_tangent_takes_the_column_again(monkeypatch):
    """x · y with x = ∞ elsewhere: the zero tangent on y gives 0 · ∞ = NaN there, and the
    column is taken again without it (0, as the Jacobian has)."""
    x = _with(_inputs((3, 4))[0], (2, 3), INF)
    call, _ = _record(torch.mul, [x, *_inputs((3, 4), seed=1)])
    passes = []
    take = RecordedCall._forward_column

    def counted(self, *args, zero_tangents: bool):
        passes.append(zero_tangents)
        return take(self, *args, zero_tangents=zero_tangents)

    monkeypatch.setattr(RecordedCall, "_forward_column", counted)
    (column,) = call.column(0, 0)
    assert passes == [True, False]
    assert not column.isnan().any()
    torch.testing.assert_close(column, _oracle(call, 0, 0), rtol=0, atol=0)


def test_large_other_inputs_carry_no_zero_tangent(monkeypatch):
    """An input larger than the differentiated one and the bound stays a plain tensor."""
    made = []
    make = recorded_call.forward_ad.make_dual

    def spy(t, tangent, **kwargs):
        made.append(t.shape)
        return make(t, tangent, **kwargs)

    monkeypatch.setattr(recorded_call.forward_ad, "make_dual", spy)
    monkeypatch.setattr(recorded_call, "ZERO_TANGENT_ELEMENTS", 4)
    call, _ = _record(torch.mul, _inputs((2,), (3, 2)))
    (column,) = call.column(0, 1)
    assert made == [torch.Size([2])]  # y (6 elements) keeps none
    torch.testing.assert_close(column, _oracle(call, 0, 1), rtol=1e-12, atol=1e-12)
    made.clear()
    call.column(1, 1)  # x (2 elements) is under the bound
    assert made == [torch.Size([3, 2]), torch.Size([2])]
