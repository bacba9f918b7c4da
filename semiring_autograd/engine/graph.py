"""Walking a recorded autograd graph, and what ``sa.patch`` recorded on its nodes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, NamedTuple, Sequence

import torch
from torch import Tensor

from ..ops.spec import NODE_INFO_KEY as _KEY

if TYPE_CHECKING:
    from .recorded_call import RecordedCall
    from ..semirings.base import Semiring


class NodeInfo(NamedTuple):
    """What ``sa.patch`` recorded about the backward node of one op call.

    ``op``: the YAML entry; ``module``: the qualified name of the module whose forward ran
    it; ``semiring``: the semiring the graph was recorded with; ``recorded``: the call
    as recorded (``paths=True`` only). For torch's own graph of an op (``sa.Real()``), whose
    named node is its output's and whose other nodes are internal: ``sequence_nrs``, the
    range of autograd sequence numbers the call recorded, and ``input_nodes``, the nodes of
    its tensor inputs, where the internal ones end. Neither is set (None, ()) for a
    generated Function, which is the op's one node.
    """

    op: str
    module: str
    semiring: "Semiring"
    recorded: "RecordedCall | None" = None
    sequence_nrs: range | None = None
    input_nodes: tuple = ()


def node_info(node: Any) -> NodeInfo | None:
    """The :class:`NodeInfo` ``sa.patch`` recorded on a ``grad_fn`` node (None: not one)."""
    if node is None:
        return None
    return node.metadata.get(_KEY)


def reachable_nodes(roots: Iterable[Any]) -> list[Any]:
    """Every backward node reachable from ``roots`` (grad_fn nodes; None entries skipped),
    each once, roots first."""
    seen: set[Any] = set()
    order: list[Any] = []
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return order


def internal_nodes(node: Any, info: NodeInfo) -> list[Any]:
    """The other nodes torch recorded for the op named at ``node`` (``sa.Real()`` graphs):
    those reachable from it before its inputs' nodes, with sequence numbers in the op's
    range. Empty for a generated Function."""
    if info.sequence_nrs is None:
        return []
    found: list[Any] = []
    seen = {node, *info.input_nodes}
    stack = [node]
    while stack:
        for child, _ in stack.pop().next_functions:
            if (
                child is None
                or child in seen
                or child._sequence_nr() not in info.sequence_nrs
                or node_info(child) is not None
            ):
                continue
            seen.add(child)
            found.append(child)
            stack.append(child)
    return found


def native_column(node: Any, metas: Sequence[Tensor | None], position: int, element: int):
    """∂out_k/∂x[element] for every output k of a native backward ``node`` (flattened;
    None where ``metas`` has None), x its input ``position``: one column of the op's local
    Jacobian J. The node computes g = Jᵀv from its outputs' gradients v, linearly, so the
    column is ∂g[element]/∂v. ``metas``: per output, a tensor of its shape, dtype and
    device (its incoming message), or None where no gradient reaches it."""
    probes = [
        None if m is None else torch.zeros(m.shape, dtype=m.dtype, device=m.device) for m in metas
    ]
    live = [p.requires_grad_() for p in probes if p is not None]
    with torch.enable_grad():
        grads = node(*probes)
    grads = grads if isinstance(grads, tuple) else (grads,)
    g = grads[position] if position < len(grads) else None
    found: Sequence[Tensor | None] = [None] * len(live)
    if g is not None and g.requires_grad:
        found = torch.autograd.grad(g.reshape(-1)[element], live, allow_unused=True)
    columns = iter(found)
    return tuple(None if p is None else _flat_or_zeros(next(columns), p) for p in probes)


def _flat_or_zeros(column: Tensor | None, probe: Tensor) -> Tensor:
    if column is None:  # the input does not depend on this output
        return torch.zeros(probe.numel(), dtype=probe.dtype, device=probe.device)
    return column.reshape(-1)
