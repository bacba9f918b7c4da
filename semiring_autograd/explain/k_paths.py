"""The k strongest paths from an output to an input element, best first.

A best-first search from the input element towards the output over the graph a
:class:`~semiring_autograd.explain.paths.PathFinder` recorded. A search state is a prefix:
a path from the input element to an element e of some tensor, with the signed product p of
its local derivatives. The recorded message at e is the best weight of any path from e to
the output (MaxProduct: the largest product of |w|; SignedMaxProduct: the largest and the
smallest signed products), so the state's priority, the best completion of p,

* MaxProduct / KBest: |p| · m(e);
* SignedMaxProduct, largest: p · hi(e) if p > 0 else p · lo(e) (the smallest: the mirror),

is exact (A* with an exact heuristic). States leave the queue best first; the i-th complete
path to leave is the i-th best. Each popped state extends a prefix of one of the k best, so
the search pops about k × (path length) states. Expanding a state at a tensor element takes
each consumer op's local-Jacobian column at e (see :meth:`PathFinder.column`: read off the
other operand of a linear layer or matrix product, forward-mode AD on the recorded call
otherwise, a native node's backward differentiated for ops run on the output after the
patch; at the output elements a message reached) and keeps the k children of best priority: a child below k better siblings heads no path among
the k best. A composite op (layer norm, attention) is entered as its composition, seeded
with the op's incoming message, as :func:`top_path` does.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from ..engine.graph import node_info
from ..errors import SemiringAutogradError
from ..ops.decompositions import DECOMPOSITIONS
from .paths import WRITE_BACK_NODES, Column, Key, Path, PathFinder, Step, composition_steps

#: a path's steps as a linked list, newest first: (step, rest) or None
Cells = tuple[Step, Any] | None


@dataclass(frozen=True)
class _Frame:
    """A composition the search is inside: where it continues when the composition's output
    is reached."""

    finder: PathFinder  # the enclosing graph
    node: Any  # the composite op's node there
    cells: Cells  # the steps before entering
    entry: tuple[int, ...]  # the input element entered by


@dataclass(frozen=True)
class _State:
    finder: PathFinder
    key: Key | None  # None: a complete path
    element: int
    product: float  # signed product of the local derivatives so far
    cells: Cells
    frames: tuple[_Frame, ...]


def top_paths(
    output: Tensor,
    input: Tensor,
    k: int,
    index: int | Sequence[int] | None = None,
    *,
    which: str = "max",
) -> list[Path]:
    """The ``k`` strongest distinct paths from the scalar ``output`` to ``input[index]``
    (default: the input element with the best readout), best first, each a :class:`Path`
    as :func:`top_path` gives; fewer where fewer paths reach the element. After a forward
    under ``sa.patch(model, semiring, paths=True)`` with ``sa.MaxProduct()`` or
    ``sa.KBest(k)`` (largest products of |w|), or ``sa.SignedMaxProduct()`` (``which``:
    largest signed products, 'max', or smallest, 'min'). Exact at element level; paths
    whose weights differ by less than the messages' rounding may come in either order."""
    return top_paths_from(PathFinder(output, input, which=which), k, index)


def top_paths_from(
    finder: PathFinder, k: int, index: int | Sequence[int] | None = None
) -> list[Path]:
    """:func:`top_paths` from a :class:`PathFinder`'s recorded backward: one backward, the
    k best paths of any number of input elements."""
    return KPathSearch(finder, k).run(finder.flat_index(index))


class KPathSearch:
    """The best-first search of the module docstring over ``finder``'s recorded graph."""

    def __init__(self, finder: PathFinder, k: int):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"top_paths: k is a positive int, got {k!r}")
        if finder.witness:
            raise SemiringAutogradError(
                "top_paths ranks paths by weight: record with sa.MaxProduct(), sa.KBest(k) or "
                "sa.SignedMaxProduct(); a sa.Boolean() graph gives one witness path (top_path)"
            )
        self.root, self.k = finder, k
        self.signed, self.which = finder.signed, finder.which
        self._messages: dict[tuple[int, Key], tuple[Tensor, ...]] = {}
        self._columns: dict[tuple[Any, int, int], tuple[Column | None, ...]] = {}
        self._inner: dict[tuple[int, Any, int], PathFinder] = {}
        self._queue: list = []
        self._order = itertools.count()

    def run(self, flat: int) -> list[Path]:
        finder = self.root
        if not torch.isfinite(finder._value(finder.message, self.which, flat)):
            raise SemiringAutogradError(f"no path reaches input element {finder._unravel(flat)}")
        start = Step("input", "input", finder.input_shape, finder._unravel(flat), None)
        self._push(_State(finder, finder.start, flat, 1.0, (start, None), ()))
        found: list[Path] = []
        while self._queue and len(found) < self.k:
            _, _, state = heapq.heappop(self._queue)
            if state.key is None:
                found.append(self._path(state))
            else:
                self._expand(state)
        return found

    # ----- priorities -------------------------------------------------------------------
    def _suffix(
        self, finder: PathFinder, key: Key, at: Tensor | int | None
    ) -> tuple[Tensor, Tensor]:
        """(hi, lo) best completions from the elements ``at`` (flat; None: every element) of
        tensor ``key``: the largest and smallest signed products (MaxProduct: both the best
        |product|), float64; NaN where no path continues. Only those elements are read."""
        cache = (id(finder), key)
        if cache not in self._messages:
            if key == finder.start:
                message = finder.message
            else:
                node, nr = key
                message = finder.incoming[node][nr]
            self._messages[cache] = tuple(c.reshape(-1) for c in message.value)
        parts = self._messages[cache]
        return _bounds(parts if at is None else tuple(c[at] for c in parts), self.signed)

    def _priority(self, product: Tensor, hi: Tensor, lo: Tensor) -> Tensor:
        """The best completion of prefixes of signed ``product`` (in the form to maximise:
        the smallest negated); -inf where none completes."""
        if not self.signed:
            value = product.abs() * hi
        elif self.which == "max":
            value = torch.where(product > 0, product * hi, product * lo)
        else:
            value = -torch.where(product > 0, product * lo, product * hi)
        return torch.where(torch.isnan(value) | (product == 0), -torch.inf, value)

    def _push(self, state: _State, priority: float | None = None) -> None:
        if priority is None:
            hi, lo = self._suffix(state.finder, state.key, state.element)
            product = torch.tensor(state.product, dtype=torch.float64)
            priority = float(self._priority(product, hi, lo))
        if priority == -torch.inf:
            return
        # ties: the newest first (depth first), so tied paths complete one at a time
        heapq.heappush(self._queue, (-priority, -next(self._order), state))

    # ----- expansion --------------------------------------------------------------------
    def _expand(self, state: _State) -> None:
        finder = state.finder
        if state.key == finder.root:
            if not state.frames:
                total = self._total(state)
                done = _State(finder, None, state.element, total, state.cells, ())
                self._push(done, total if self.which == "max" else -total)
            else:
                self._leave(state)
            return
        children: list[tuple[float, _State]] = []
        for node, position in finder.consumers.get(state.key, []):
            info = node_info(node)
            if (info is None or info.recorded is None) and node.name() in WRITE_BACK_NODES:
                if WRITE_BACK_NODES[node.name()] == position:
                    children.append(self._through_write_back(state, node))
            elif info is not None and info.op in DECOMPOSITIONS:
                self._enter(state, node, position)
            else:
                children += self._through_op(state, node, position)
        children.sort(key=lambda c: -c[0])
        for priority, child in children[: self.k]:
            self._push(child, priority)

    def _through_op(self, state: _State, node, position: int) -> list[tuple[float, _State]]:
        """The best children over the edges x[e] → y[i] of one op (its local-Jacobian
        column at e, every output y of the op; a native node's too: ops outside
        ``sa.patch`` up to the output)."""
        finder = state.finder
        cache = (node, position, state.element)
        if cache not in self._columns:
            self._columns[cache] = finder.column(node, position, state.element)
        candidates = []
        for nr, column in enumerate(self._columns[cache]):
            if (
                column is None
                or column.values.numel() == 0
                or nr >= len(finder.incoming.get(node, ()))
                or finder.incoming[node][nr] is None
            ):
                continue
            w = column.values.double()
            hi, lo = self._suffix(finder, (node, nr), column.at)
            priority = self._priority(state.product * w, hi, lo)
            top = priority.topk(min(self.k, priority.numel()))
            for p, i in zip(top.values.tolist(), top.indices.tolist()):
                if p != -torch.inf:
                    candidates.append((p, nr, column.position(i), float(w[i])))
        children = []
        for p, nr, i, w in candidates:
            shape = finder.incoming[node][nr].shape
            step = finder.edge_step(node, position, state.element, shape, i, w)
            child = _State(
                finder, (node, nr), i, state.product * w, (step, state.cells), state.frames
            )
            children.append((p, child))
        return children

    def _through_write_back(self, state: _State, node) -> tuple[float, _State]:
        """An in-place op's copy or write-back: the same element, no step."""
        child = _State(
            state.finder, (node, 0), state.element, state.product, state.cells, state.frames
        )
        hi, lo = self._suffix(state.finder, child.key, state.element)
        product = torch.tensor(state.product, dtype=torch.float64)
        return float(self._priority(product, hi, lo)), child

    def _enter(self, state: _State, node, position: int) -> None:
        """Continue inside composite op ``node``'s composition."""
        finder = state.finder
        cache = (id(finder), node, position)
        if cache not in self._inner:
            self._inner[cache] = finder.composition(node, position, self.which)
        inner = self._inner[cache]
        entry = finder._unravel(state.element, inner.input_shape)
        frame = _Frame(finder, node, state.cells, entry)
        self._push(
            _State(
                inner,
                inner.start,
                state.element,
                state.product,
                state.cells,
                state.frames + (frame,),
            )
        )

    def _leave(self, state: _State) -> None:
        """A composition's output reached: its steps named as the op's, the search goes on
        at the op's output in the enclosing graph."""
        frame = state.frames[-1]
        inner = []
        cells = state.cells
        while cells is not frame.cells:
            step, cells = cells
            inner.append(step)
        for step in composition_steps(frame.node, inner[::-1], frame.entry):
            cells = (step, cells)
        self._push(
            _State(
                frame.finder,
                (frame.node, 0),
                state.element,
                state.product,
                cells,
                state.frames[:-1],
            )
        )

    def _total(self, state: _State) -> float:
        """A complete path's weight: its product times the seed at the output element."""
        hi, _ = self._suffix(state.finder, state.key, state.element)
        seed = float(hi)
        return abs(state.product) * seed if not self.signed else state.product * seed

    def _path(self, state: _State) -> Path:
        steps = []
        cells = state.cells
        while cells is not None:
            step, cells = cells
            steps.append(step)
        finder = self.root
        name = type(finder.semiring).__name__ + (f" ({self.which})" if self.signed else "")
        return Path(state.product, name, tuple(reversed(steps)))


def _bounds(parts: tuple[Tensor, ...], signed: bool) -> tuple[Tensor, Tensor]:
    """Float64 (hi, lo) of a message's components ``parts``: SignedMaxProduct's, NaN where
    hi < lo (no path); otherwise the best |product| twice (KBest's first component), NaN
    where it is 0."""
    if signed:
        hi, lo = (c.double() for c in parts)
        valid = hi >= lo
        return torch.where(valid, hi, torch.nan), torch.where(valid, lo, torch.nan)
    m = parts[0].double()
    m = torch.where(m > 0, m, torch.nan)
    return m, m
