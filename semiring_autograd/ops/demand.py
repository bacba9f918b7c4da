"""Which inputs of a backward node the running backward pass will actually use.

A custom Function's ``ctx.needs_input_grad`` is fixed when the graph is recorded: a linear
layer's weight "needs" a gradient even in ``sa.grad(y, x)``, which only asks for ``x``.
Generated backwards ask :func:`input_demand` instead, so no message is computed for an edge
the engine will drop (no weight messages when only inputs are requested).

The engine answers for interior nodes (``torch._C._will_engine_execute_node``). For a leaf
inside ``torch.autograd.grad`` it cannot; :func:`requesting` registers, for the graph task
of one ``sa.grad`` call, which leaves were asked for. A leaf outside such a call (plain
``.backward()``, or ``torch.autograd.grad`` called directly) counts as used.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import Tensor

_LOCK = threading.Lock()
#: graph task id -> ids of the leaf tensors its sa.grad call asked for
_REQUESTED: dict[int, set[int]] = {}


def _root_nodes(outputs: Sequence[Tensor]) -> list:
    return [o.grad_fn for o in outputs if o.grad_fn is not None]


@contextmanager
def requesting(outputs: Sequence[Tensor], inputs: Sequence[Tensor]) -> Iterator[None]:
    """Within this block, a backward from ``outputs`` records that only the leaves among
    ``inputs`` are wanted (registered when its first node runs, on the engine's thread)."""
    leaves = {id(x) for x in inputs if x.grad_fn is None}
    tasks: list[int] = []

    def register(grad_outputs):
        task = torch._C._current_graph_task_id()
        with _LOCK:
            _REQUESTED.setdefault(task, set()).update(leaves)
            tasks.append(task)

    handles = [node.register_prehook(register) for node in _root_nodes(outputs)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        with _LOCK:
            for task in tasks:
                _REQUESTED.pop(task, None)


#: the node type of a leaf's gradient accumulator
_LEAF = torch._C._functions.AccumulateGrad


def _will_use(node, requested: set[int] | None) -> bool:
    if node is None:
        return False
    if type(node) is _LEAF:
        return requested is None or id(node.variable) in requested
    return torch._C._will_engine_execute_node(node)


def input_demand(ctx, tensor_args: Sequence[bool]) -> tuple[bool, ...]:
    """Per argument of the Function's ``apply``: does the running backward use its gradient?

    ``tensor_args[i]`` says whether argument i was a tensor (only tensors have an edge in
    ``ctx.next_functions``)."""
    requested = _REQUESTED.get(torch._C._current_graph_task_id()) if _REQUESTED else None
    edges = ctx.next_functions
    out = []
    edge = 0
    for is_tensor, needed in zip(tensor_args, ctx.needs_input_grad):
        if is_tensor:
            out.append(needed and _will_use(edges[edge][0], requested))
            edge += 1
        else:
            out.append(False)
    return tuple(out)


def input_used(ctx, tensor_args: Sequence[bool], position: int) -> bool:
    """Whether the running backward uses the gradient of ``apply``'s argument ``position``
    (one entry of :func:`input_demand`)."""
    if not ctx.needs_input_grad[position]:
        return False
    requested = _REQUESTED.get(torch._C._current_graph_task_id()) if _REQUESTED else None
    return _will_use(ctx.next_functions[sum(tensor_args[:position])][0], requested)
