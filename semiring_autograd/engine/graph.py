"""Walking a recorded autograd graph, and what ``sa.patch`` recorded on its nodes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

if TYPE_CHECKING:
    from .replay import Replay
    from ..semirings.base import Semiring

#: the key of a node's ``metadata`` dict under which sa.patch stores its NodeInfo
_KEY = "semiring_autograd"


class NodeInfo(NamedTuple):
    """What ``sa.patch`` recorded about the backward node of one op call.

    ``op``: the YAML entry; ``module``: the qualified name of the module whose forward ran
    it; ``semiring``: the semiring the graph was recorded with; ``replay``: the call's
    replay (``paths=True`` only). For torch's own graph of an op (``sa.Real()``), whose
    named node is its output's and whose other nodes are internal: ``sequence_nrs``, the
    range of autograd sequence numbers the call recorded, and ``input_nodes``, the nodes of
    its tensor inputs, where the internal ones end. Neither is set (None, ()) for a
    generated Function, which is the op's one node.
    """

    op: str
    module: str
    semiring: "Semiring"
    replay: "Replay | None" = None
    sequence_nrs: range | None = None
    input_nodes: tuple = ()


def node_info(node: Any) -> NodeInfo | None:
    """The :class:`NodeInfo` ``sa.patch`` recorded on a ``grad_fn`` node (None: not one)."""
    if node is None:
        return None
    return node.metadata.get(_KEY)


def set_node_info(node: Any, info: NodeInfo) -> None:
    node.metadata[_KEY] = info


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
