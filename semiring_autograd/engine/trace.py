"""``sa.trace()``: see what the semiring backward does, node by node.

Every op's backward node recorded under ``sa.patch`` carries a :class:`~.graph.NodeInfo`
(``sa.node_info(grad_fn)``: the YAML entry, the qualified module name, the semiring); its
hooks receive the messages (``ops.message.Message``, components in ``.value``). ``sa.trace`` uses
exactly those hooks: each node reports, as it runs, its op, module, and a summary of the
messages it received (one per output) and sent (one per input). Under ``sa.Real()`` torch
records its own nodes, several per op for some (a linear layer's view, addmm, transpose):
each reports, named by the op that recorded it, with its own messages.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any, Sequence, TextIO

import torch
from torch import Tensor

from .graph import NodeInfo, internal_nodes, node_info, reachable_nodes
from ..ops.message import Message

_ACTIVE = threading.local()


def summarize(message: Tensor | None, semiring) -> str:
    """A one-line summary of a message: shape, and the range of its readout."""
    if message is None:
        return "zero (no path)"
    r = semiring.readout(message.value) if isinstance(message, Message) else message
    shape = tuple(message.shape)
    if r.dtype == torch.bool:
        return f"{shape}: {int(r.sum())}/{r.numel()} reached"
    finite = r[torch.isfinite(r)]
    if finite.numel() == 0:
        return f"{shape}: no finite value"
    return f"{shape}: readout in [{float(finite.min()):.4g}, {float(finite.max()):.4g}]"


@dataclass(frozen=True)
class TraceEvent:
    op: str
    module: str
    received: tuple[str, ...]  # per output of the node: the merged incoming message
    sent: tuple[str, ...]  # per input of the node: the message it passes on
    node: str  # the backward node's name (a generated Function, or torch's own under Real)

    def __str__(self) -> str:
        return (
            f"{self.module}  {self.op}  [{self.node}]\n"
            + "".join(f"    in  {s}\n" for s in self.received)
            + "".join(f"    out {s}\n" for s in self.sent)
        ).rstrip("\n")


class trace:
    """Report each semiring backward node as it runs.

    ``with sa.trace() as t: sa.grad(y, x)`` prints one entry per node (to ``file``,
    default stderr; ``file=None`` only collects) and keeps them in ``t.events``. ``sa.grad``
    and ``sa.top_path`` inside the block are traced; for ``.backward()`` or
    ``torch.autograd.grad`` call ``t.attach(output)`` first.
    """

    def __init__(self, file: TextIO | None = sys.stderr):
        self.file = file
        self.events: list[TraceEvent] = []
        self._handles: list[Any] = []
        self._hooked: set[Any] = set()

    def __enter__(self) -> "trace":
        stack = getattr(_ACTIVE, "stack", [])
        stack.append(self)
        _ACTIVE.stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.stack.remove(self)
        self.detach()

    def attach(self, outputs: Tensor | Sequence[Tensor]) -> None:
        """Hook every semiring node of the graph behind ``outputs``."""
        outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
        for node in reachable_nodes(o.grad_fn for o in outs):
            info = node_info(node)
            if info is None:
                continue
            for member in (node, *internal_nodes(node, info)):
                if member not in self._hooked:
                    self._hooked.add(member)
                    self._handles.append(member.register_hook(self._hook(member, info)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooked.clear()

    def _hook(self, node, info: NodeInfo):
        def hook(grad_inputs, grad_outputs):
            semiring = info.semiring
            event = TraceEvent(
                info.op,
                info.module,
                tuple(summarize(g, semiring) for g in grad_outputs),
                tuple(summarize(g, semiring) for g in grad_inputs),
                node.name(),
            )
            self.events.append(event)
            if self.file is not None:
                print(event, file=self.file)

        return hook


def attach_active(outputs: Sequence[Tensor]) -> list[trace]:
    """Attach every active ``sa.trace`` of this thread to ``outputs``; returns them."""
    active = list(getattr(_ACTIVE, "stack", []))
    for t in active:
        t.attach(outputs)
    return active
