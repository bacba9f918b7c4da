"""Walking a recorded autograd graph."""

from __future__ import annotations

from typing import Any, Iterable


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
