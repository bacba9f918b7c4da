"""Path flow: the part of a readout carried by the paths through a tensor or an edge.

For a semiring backward from ``output`` to ``input``, the readout at input element j is
the ⊕ over every path from j to the output of the ⊗ of its local derivatives. Two ways of
splitting it, both exact (semiring backwards, no sampling):

* :func:`module_flow` — through a tensor T (a module's output). A path crosses one element
  t of T at most (no element of T depends on another), so the paths through T give
  ⊕_t fwd_j(t) ⊗ m(t), with m(t) the backward's message at t (paths from t to the
  output) and fwd_j(t) the paths from j to t. That is a second backward, from T to the
  input, seeded with m itself.
* :func:`consumer_flow` — through the first edge: the ops that read ``input`` directly
  (a residual add, the key, query and value projections), each op's message to the
  input, which the engine ⊕-merges into the readout.

With MaxProduct a flow is the weight of the best path through T; with Log, the log of the
total weight through T; with Real, the gradient through T.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from ..engine import trace as tracing
from ..engine.grad import recorded_semiring, seed_message
from ..engine.graph import node_info, reachable_nodes
from ..errors import SemiringAutogradError
from ..ops import demand
from ..semirings.registry import plain_messages
from .paths import OUTSIDE, key_of


@dataclass(frozen=True)
class ConsumerFlow:
    """One op that reads the input directly: its module and op, which of its arguments the
    input is, and the readout of the paths whose first edge enters it (the input's shape;
    SignedMaxProduct (2, *input), KBest (k, *input))."""

    module: str
    op: str
    position: int
    readout: Tensor


@contextlib.contextmanager
def capture(model: nn.Module, names: Sequence[str]) -> Iterator[dict[str, Tensor]]:
    """Record the outputs of ``model``'s submodules ``names`` (as in ``named_modules``)
    during the forward inside the block: a dict name → output tensor (the last call's;
    of a tuple, its first element, as Hugging Face attention modules return (output,
    weights)), filled as the forward runs, for :func:`module_flow`."""
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise ValueError(
            f"capture: {missing} are not submodules of {type(model).__name__} (names as in "
            "model.named_modules())"
        )
    seen: dict[str, Tensor] = {}
    hooks = []
    for name in names:

        def hook(module, args, out, name=name):
            if isinstance(out, tuple) and out:
                out = out[0]
            if not isinstance(out, Tensor):
                raise SemiringAutogradError(
                    f"capture: module {name!r} returned {type(out).__name__}, not a tensor; "
                    "capture a submodule that returns a tensor (or a tuple led by one)"
                )
            seen[name] = out

        hooks.append(modules[name].register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def module_flow(
    output: Tensor, input: Tensor, through: Mapping[str, Tensor], seed: Tensor | None = None
) -> dict[str, Tensor]:
    """Per named tensor T of ``through`` (e.g. from :func:`capture`), the readout at every
    ``input`` element of the paths from ``output`` that pass through T: the semiring the
    graph was recorded with, ⊕ over those paths only. The graph is kept (retain_graph)."""
    semiring = recorded_semiring(output)
    for name, t in through.items():
        if not isinstance(t, Tensor) or t.grad_fn is None:
            raise SemiringAutogradError(
                f"module_flow: {name!r} is not a tensor of the recorded graph (it needs a "
                "grad_fn: a module output computed from the input inside sa.patch)"
            )
    messages: dict[str, Tensor] = {}
    hooks = [
        t.register_hook(lambda g, name=name: messages.__setitem__(name, g))
        for name, t in through.items()
    ]
    try:
        _backward(output, input, seed_message(semiring, output, seed), [input])
    finally:
        for h in hooks:
            h.remove()
    flows = {}
    for name, t in through.items():
        message = messages.get(name)
        result = None
        if message is not None:
            result = _backward(t, input, message, [input])
        flows[name] = _readout(semiring, result, input)
    return flows


def consumer_flow(output: Tensor, input: Tensor, seed: Tensor | None = None) -> list[ConsumerFlow]:
    """The ops that read ``input`` directly, each with the readout of the paths from
    ``output`` whose first edge enters it; their ⊕ is ``sa.grad(output, input)``. An op
    that reads the input twice (``x * x``) is listed once per argument. The graph is kept."""
    semiring = recorded_semiring(output)
    nodes = reachable_nodes([output.grad_fn])
    start = key_of(input, nodes)
    sent: dict = {}
    hooks = []
    readers = []
    for node in nodes:
        for position, (child, nr) in enumerate(node.next_functions):
            if child is start[0] and nr == start[1]:
                readers.append((node, position))
    for node in {n for n, _ in readers}:

        def hook(grad_inputs, grad_outputs, node=node):
            sent[node] = grad_inputs

        hooks.append(node.register_hook(hook))
    try:
        _backward(output, input, seed_message(semiring, output, seed), [input])
    finally:
        for h in hooks:
            h.remove()
    flows = []
    for node, position in readers:
        info = node_info(node)
        grads = sent.get(node)
        message = None if grads is None else grads[position]
        module = info.module if info is not None else OUTSIDE
        op = info.op if info is not None else node.name()
        flows.append(ConsumerFlow(module, op, position, _readout(semiring, message, input)))
    return flows


def _backward(output: Tensor, input: Tensor, seed: Tensor, inputs: list[Tensor]):
    """The semiring backward from ``output`` seeded with ``seed``; the message at ``input``
    (None where no path reaches it)."""
    tracing.attach_active([output])
    with demand.requesting([output], inputs):
        (message,) = torch.autograd.grad(output, input, seed, retain_graph=True, allow_unused=True)
    return message


def _readout(semiring, message, like: Tensor) -> Tensor:
    if message is None:
        return semiring.readout(semiring.zero(like.shape, like))
    if plain_messages(semiring):
        return message
    return semiring.readout(message.value)
