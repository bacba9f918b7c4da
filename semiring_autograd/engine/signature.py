"""The signature of a recorded graph for ``sa.grad(..., compile=True)``: what a captured
backward program depends on, and the tensors it reads.

The graph is walked from the outputs in a fixed order: each node's type, its edges, its
non-tensor state (a generated Function's ctx attributes: op arguments, shapes; a torch
node's ``_saved_*`` values) and the shape, strides, storage offset, dtype and device of
every tensor it saved — those tensors are the program's inputs (its slots), in walk order
— then the inputs' and outputs' places in the graph and the seeds' metadata. Two graphs with one
signature run the same operators on tensors of the same metadata: a model run on inputs of
one shape gives one signature; another shape, another module path or a changed argument
gives another.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, Sequence

import torch
from torch import Tensor

from ..ops.message import Message
from ..semirings.base import Semiring


class Uncapturable(Exception):
    """The backward cannot be captured exactly; the message says why."""


#: values a key holds as they are (equal exactly when the backward sees the same value)
_PLAIN = frozenset(
    {
        type(None),
        type(Ellipsis),
        bool,
        int,
        str,
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
        torch.Size,  # a shape attribute is a Size in every call (the same code sets it)
    }
)
_SEQUENCES = frozenset({tuple, list})


class Signature:
    """Walks the graph: the hashable ``key`` and the saved tensors (``slots``) in walk order."""

    def __init__(self) -> None:
        self.slots: list[Tensor] = []

    def tensor(self, t: Tensor) -> tuple:
        self.slots.append(t)
        return ("T", t.shape, t.stride(), t.storage_offset(), t.dtype, t.device)

    def describe(self, value: Any) -> Any:
        kind = type(value)
        if kind in _PLAIN:
            return value
        if kind in _SEQUENCES:
            for v in value:
                if type(v) not in _PLAIN:
                    return (kind, tuple(self.describe(v) for v in value))
            return (list, tuple(value)) if kind is list else value
        if isinstance(value, Tensor):
            return self.tensor(value)
        if kind is float:
            return ("f", value.hex())  # -0.0 and 0.0 apart, NaN equal to NaN
        if isinstance(value, Semiring):
            return ("S", value)
        if kind is dict:
            return (dict, tuple((k, self.describe(v)) for k, v in value.items()))
        if kind is slice:
            return ("slice", self.describe((value.start, value.stop, value.step)))
        if isinstance(value, numbers.Number):
            return ("n", kind, repr(value))
        raise Uncapturable(
            f"a backward node holds a {kind.__name__}, which a captured program cannot tell "
            "apart from one call to the next"
        )


@functools.cache
def _saved_fields(node_type: type) -> tuple[str, ...]:
    return tuple(sorted(a for a in dir(node_type) if a.startswith("_saved_")))


def _node_state(node: Any, sig: Signature) -> tuple:
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        saved = tuple([sig.describe(t) for t in node.saved_tensors])
        state = vars(node)  # set in the same order by the same forward
        attrs = tuple([sig.describe(v) for v in state.values()])
        return (node._forward_cls, tuple(state), saved, attrs, node.needs_input_grad)
    if type(node).__name__ == "AccumulateGrad":
        v = node.variable
        return ("leaf", tuple(v.shape), v.dtype, v.device)
    return (node.name(), tuple(sig.describe(getattr(node, f)) for f in _saved_fields(type(node))))


def signature(
    outputs: Sequence[Tensor], inputs: Sequence[Tensor], seeds: Sequence[Any]
) -> tuple[tuple, list[Tensor]]:
    """The key of the graph behind ``outputs`` for a backward to ``inputs`` seeded with
    ``seeds`` (messages or tensors), and the tensors a program reads: the seeds'
    components, then every node's saved tensors in walk order."""
    sig = Signature()
    seed_part = tuple(_seed_meta(s, sig) for s in seeds)
    order: list[Any] = []
    index: dict[Any, int] = {}
    stack = [o.grad_fn for o in reversed(outputs)]
    while stack:
        node = stack.pop()
        if node is None or node in index:
            continue
        index[node] = len(order)
        order.append(node)
        stack.extend(n for n, _ in reversed(node.next_functions) if n is not None)
    nodes = []
    for node in order:
        edges = tuple((index.get(n), nr) for n, nr in node.next_functions)
        nodes.append((edges, _node_state(node, sig)))
    outs = tuple((index.get(o.grad_fn), o.output_nr, tuple(o.shape)) for o in outputs)
    ins = []
    for x in inputs:
        edge = torch.autograd.graph.get_gradient_edge(x)
        ins.append((index.get(edge.node), edge.output_nr, tuple(x.shape), x.dtype))
    return (tuple(nodes), outs, tuple(ins), seed_part), sig.slots


def _seed_meta(seed: Any, sig: Signature) -> tuple:
    if isinstance(seed, Message):
        return (
            "M",
            seed.semiring,
            tuple(seed.shape),
            seed.dtype,
            tuple(map(sig.tensor, seed.value)),
        )
    return sig.describe(seed)


class Key:
    """A signature with its hash computed once (a key is a deep tuple)."""

    __slots__ = ("parts", "hash")

    def __init__(self, parts: tuple) -> None:
        self.parts = parts
        self.hash = hash(parts)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and self.hash == other.hash and self.parts == other.parts
