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
REQUESTED: dict[int, set[int]] = {}


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
            REQUESTED.setdefault(task, set()).update(leaves)
            tasks.append(task)

    handles = [node.register_prehook(register) for node in _root_nodes(outputs)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        with _LOCK:
            for task in tasks:
                REQUESTED.pop(task, None)


#: the node type of a leaf's gradient accumulator
LEAF = torch._C._functions.AccumulateGrad
_graph_task_id = torch._C._current_graph_task_id
_will_execute = torch._C._will_engine_execute_node


def input_demand(ctx, tensor_args: Sequence[bool]) -> tuple[bool, ...]:
    """Per argument of the Function's ``apply``: does the running backward use its gradient?

    ``tensor_args[i]`` says whether argument i was a tensor (only tensors have an edge in
    ``ctx.next_functions``). An edge to a leaf counts when the running ``sa.grad`` asked for
    that leaf (or none registered its leaves), an edge to another node when the engine will
    run that node. (``SemiringFunction.backward`` asks the same of its one input inline.)"""
    requested = REQUESTED.get(_graph_task_id()) if REQUESTED else None
    edges = ctx.next_functions
    out = []
    edge = 0
    for is_tensor, needed in zip(tensor_args, ctx.needs_input_grad):
        if not is_tensor:
            out.append(False)
            continue
        node = edges[edge][0]
        edge += 1
        if not needed or node is None:
            out.append(False)
        elif type(node) is LEAF:
            out.append(requested is None or id(node.variable) in requested)
        else:
            out.append(_will_execute(node))
    return tuple(out)
