"""Brute-force oracles for semiring backprop, independent of the library's formulas.

Two oracles, both built only from a semiring's own ``zero``/``one``/``lift``/``add``/``mul``
applied elementwise, with explicit Python loops where terms are combined:

* :func:`op_oracle` — one op: the dense Jacobian of ``out = fn(*args)`` (torch.autograd,
  float64) gives an edge out_i → arg_j for every non-zero entry; the result at arg_j is
  ⊕_i lift(seed_i) ⊗ lift(J[i, j]) (⊗ and lift elementwise over the edges, the ⊕ folded
  term by term).
* :class:`Program` + :func:`path_enumeration` — a composition: each elementary op's Jacobian
  gives the edges of an explicit scalar DAG, and every path from the seeded output elements
  to the input elements is enumerated by depth-first search (⊗ along a path, ⊕ across paths).

A derivative that is exactly 0 is no edge (lift(0) is the semiring's zero, which ⊗
annihilates and ⊕ ignores), so zero Jacobian entries are skipped; so are zero seeds.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor
from torch.autograd.functional import jacobian

from semiring_autograd.semirings import Semiring, Value

Node = tuple[str, int]
"""A scalar node of the gradient graph: (tensor name, flat element index)."""


def _as_tuple(x: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def dense_jacobians(fn: Callable[..., Tensor], args: Sequence[Tensor]) -> list[Tensor]:
    """Per argument, the Jacobian of ``fn(*args)`` as a (out.numel(), arg.numel()) matrix.

    Jacobian rows are vector-Jacobian products, so a NaN local derivative spreads along its
    row (0 · NaN) to entries that are no edge. Where a row holds NaN, which of its entries
    are edges is read from the Jacobian at a point where the derivatives are finite (every
    floating argument x moved to |x| + 0.5): a NaN there where that Jacobian is 0 is no
    edge."""
    inputs = tuple(a.detach() for a in args)
    jacs = _raw_jacobians(fn, inputs)
    if not any(torch.isnan(j).any() for j in jacs):
        return jacs
    moved = tuple(a.abs() + 0.5 if a.dtype.is_floating_point else a for a in inputs)
    pattern = _raw_jacobians(fn, moved)
    return [torch.where(torch.isnan(j) & (p == 0), 0.0, j) for j, p in zip(jacs, pattern)]


def _raw_jacobians(fn: Callable[..., Tensor], inputs: tuple[Tensor, ...]) -> list[Tensor]:
    out_numel = fn(*inputs).numel()
    jacs = _as_tuple(jacobian(fn, inputs))
    return [j.reshape(out_numel, a.numel()) for j, a in zip(jacs, inputs)]


def _start_value(semiring: Semiring, seed: Tensor | None, index: int, like: Tensor) -> Value:
    """lift(seed_i), or the semiring's one where no seed is given."""
    if seed is None:
        return semiring.one((), like)
    return semiring.lift(seed.reshape(-1)[index])


def _assemble(semiring: Semiring, scalars: list[Value], like: Tensor) -> Value:
    """Stack per-element scalar values into one value shaped like ``like``."""
    if not scalars:
        return semiring.zero(like.shape, like)
    return tuple(
        torch.stack([s[c].reshape(()) for s in scalars]).reshape(like.shape)
        for c in range(len(scalars[0]))
    )


def op_oracle(
    semiring: Semiring, fn: Callable[..., Tensor], args: Sequence[Tensor], seed: Tensor | None
) -> list[Value]:
    """Per argument of ``out = fn(*args)``: ⊕_i lift(seed_i) ⊗ lift(J[i, j]) for every j.

    ``seed`` has the output's shape (None: the semiring's one for every output element).
    Each argument is treated as its own graph node set, even when the same tensor is passed
    twice; use :func:`merge_positions` to combine those. One term per non-zero Jacobian
    entry (and non-zero seed): ⊗ elementwise over the terms, then each input element's
    terms ⊕-folded one after another.
    """
    jacs = dense_jacobians(fn, args)
    like = args[0].detach()
    flat_seed = None if seed is None else seed.detach().reshape(-1).to(like.dtype)
    results = []
    for arg, jac in zip(args, jacs):
        rows, cols = torch.nonzero(jac, as_tuple=True)
        if flat_seed is not None:
            kept = flat_seed[rows] != 0
            rows, cols = rows[kept], cols[kept]
        if flat_seed is None:
            starts = semiring.one(rows.shape, like)
        else:
            starts = semiring.lift(flat_seed[rows])
        terms = semiring.mul(starts, semiring.lift(jac[rows, cols]))
        results.append(_fold_by_target(semiring, terms, cols, arg))
    return results


def _fold_by_target(semiring: Semiring, terms: Value, targets: Tensor, like: Tensor) -> Value:
    """⊕ of the terms of each element of ``like`` (``targets[t]``: the flat element term t
    goes to), folded one term after another; the zero where an element has none."""
    n = like.numel()
    counts = (
        torch.bincount(targets, minlength=n)
        if targets.numel()
        else torch.zeros(n, dtype=torch.long)
    )
    depth = int(counts.max()) if n else 0
    order = torch.argsort(targets, stable=True)
    targets = targets[order]
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(targets.numel()) - starts[targets]
    table = semiring.zero((max(depth, 1), n), like.detach())
    table = tuple(t.clone() for t in table)
    for t, c in zip(table, terms):
        t[rank, targets] = c[order].to(t.dtype)
    acc = tuple(t[0] for t in table)
    for r in range(1, depth):
        acc = semiring.add(acc, tuple(t[r] for t in table))
    return tuple(c.reshape(like.shape) for c in acc)


def merge_positions(
    semiring: Semiring, values: Sequence[Value], positions: Sequence[int]
) -> list[Value]:
    """⊕-merge per-argument results that belong to the same tensor.

    ``positions[k]`` is the index of the distinct input that argument ``k`` is; the result
    has one value per distinct input, in index order."""
    merged: dict[int, Value] = {}
    for value, pos in zip(values, positions):
        merged[pos] = value if pos not in merged else semiring.add(merged[pos], value)
    return [merged[p] for p in range(len(merged))]


class Program:
    """A straight-line program of elementary ops on named float64 tensors.

    ``Program(x=x, w=w)`` declares the inputs; ``p.op("h", fn, "x", "w")`` evaluates
    ``h = fn(x, w)`` and records the Jacobian of that op with respect to each of its
    arguments. The Jacobians define the scalar graph of :func:`path_enumeration`: one node
    per element of every named tensor, one edge per non-zero Jacobian entry (a tensor passed
    twice to one op gives two parallel edges).
    """

    def __init__(self, **inputs: Tensor) -> None:
        self.inputs: dict[str, Tensor] = {k: v.detach() for k, v in inputs.items()}
        self.values: dict[str, Tensor] = dict(self.inputs)
        # consumer node -> [(producer node, local derivative)]
        self.edges: dict[Node, list[tuple[Node, Tensor]]] = {}
        # in forward order: (output name, argument names, dense Jacobian per argument)
        self.ops: list[tuple[str, tuple[str, ...], list[Tensor]]] = []

    def op(self, out: str, fn: Callable[..., Tensor], *args: str) -> Tensor:
        """Record ``out = fn(*args)`` (``args`` name earlier tensors) and return its value."""
        if out in self.values:
            raise ValueError(f"{out!r} is already defined")
        tensors = [self.values[a] for a in args]
        value = fn(*tensors).detach()
        self.values[out] = value
        jacobians = dense_jacobians(fn, tensors)
        self.ops.append((out, args, jacobians))
        for name, jac in zip(args, jacobians):
            rows, cols = torch.nonzero(jac, as_tuple=True)
            for i, j in zip(rows.tolist(), cols.tolist()):
                self.edges.setdefault((out, i), []).append(((name, j), jac[i, j]))
        return value

    def path_sum(
        self, semiring: Semiring, output: str, seed: Tensor | None, targets: Sequence[str]
    ) -> list[Value]:
        """Explicit path enumeration from ``output`` (seeded) to each tensor in ``targets``."""
        like = self.values[output]
        starts = [
            ((output, i), _start_value(semiring, seed, i, like))
            for i in range(like.numel())
            if seed is None or seed.reshape(-1)[i] != 0
        ]
        totals = path_enumeration(semiring, self.edges, starts, set(self.inputs))
        results = []
        for name in targets:
            target = self.values[name]
            scalars = [
                totals.get((name, j), semiring.zero((), like)) for j in range(target.numel())
            ]
            results.append(_assemble(semiring, scalars, target))
        return results

    def count_paths(self, output: str, index: int, target: str) -> list[int]:
        """Number of paths from ``output``'s element ``index`` to each element of ``target``
        (plain integers, for checking the Counting semiring and the enumeration itself)."""
        counts = [0] * self.values[target].numel()

        def walk(node: Node) -> None:
            if node[0] == target:
                counts[node[1]] += 1
            for child, _ in self.edges.get(node, []):
                walk(child)

        walk((output, index))
        return counts


def path_enumeration(
    semiring: Semiring,
    edges: dict[Node, list[tuple[Node, Tensor]]],
    starts: Sequence[tuple[Node, Value]],
    leaves: set[str],
) -> dict[Node, Value]:
    """⊕ over every path from a start node to a leaf node of ⊗ over the path.

    ``edges`` maps a node to its (producer node, local derivative) edges; ``starts`` pairs
    each start node with its initial value (lift(seed) or one); a path ends at a node whose
    tensor name is in ``leaves``. Depth-first: every path is walked on its own, the running
    product is ``start ⊗ lift(w_1) ⊗ … ⊗ lift(w_k)`` in path order.
    """
    lifted = {
        node: [(child, semiring.lift(w)) for child, w in out_edges]
        for node, out_edges in edges.items()
    }
    totals: dict[Node, Value] = {}

    def walk(node: Node, product: Value) -> None:
        if node[0] in leaves:
            totals[node] = product if node not in totals else semiring.add(totals[node], product)
            return
        for child, w in lifted.get(node, []):
            walk(child, semiring.mul(product, w))

    for node, value in starts:
        walk(node, value)
    return totals


def every_path(
    program: Program, output: str, index: int, target: str
) -> dict[int, list[tuple[float, list[tuple[Node, float]]]]]:
    """For every element of ``target``, every path from ``(output, index)`` to it, in
    depth-first order: element → [(signed product, [(node, local derivative of the edge
    into it)] listed from the target element up to the output)]. Parallel edges (a tensor
    passed twice to one op) give separate paths."""
    paths: dict[int, list[tuple[float, list[tuple[Node, float]]]]] = {}

    def walk(node: Node, product: float, trail: list[tuple[Node, float]]) -> None:
        if node[0] == target:
            paths.setdefault(node[1], []).append((product, list(reversed(trail))))
            return
        for child, w in program.edges.get(node, []):
            walk(child, product * float(w), trail + [(node, float(w))])

    walk((output, index), 1.0, [])
    return paths


def best_paths(
    program: Program, output: str, index: int, target: str, which: str = "abs"
) -> dict[int, tuple[float, list[tuple[Node, float]]]]:
    """For every element of ``target``, the path from ``(output, index)`` with the largest
    |product| (``which='abs'``), largest signed product ('max') or smallest ('min'), by
    enumerating every path (the first in depth-first order among equals)."""

    def better(a: float, b: float) -> bool:
        return {"abs": abs(a) > abs(b), "max": a > b, "min": a < b}[which]

    best: dict[int, tuple[float, list[tuple[Node, float]]]] = {}
    for element, paths in every_path(program, output, index, target).items():
        for product, trail in paths:
            if element not in best or better(product, best[element][0]):
                best[element] = (product, trail)
    return best


def tensor_level(
    program: Program, output: str, seed: Tensor, target: str, signed: bool
) -> tuple[Tensor, Tensor]:
    """The paper's tensor-level max-gradient, op by op in reverse over the recorded ops: an
    op's message to each argument is the real vector-Jacobian product (Jᵀm with the signed
    Jacobian for both ends of the pair, each product then put in (max, min) order; |J|ᵀm
    unsigned), and an argument read by several ops (or twice by one) takes the elementwise
    max (and min) of those messages. Returns ``target``'s (largest, smallest) flattened;
    unsigned, the message twice."""
    seed = seed.reshape(-1).double()
    messages: dict[str, tuple[Tensor, Tensor]] = {
        output: (seed, seed) if signed else (seed.abs(), seed.abs())
    }
    for out, args, jacobians in reversed(program.ops):
        if out not in messages:
            continue
        hi, lo = messages[out]
        for arg, jac in zip(args, jacobians):
            if signed:
                a, b = jac.T @ hi, jac.T @ lo
                pair = (torch.maximum(a, b), torch.minimum(a, b))
            else:
                m = jac.abs().T @ hi
                pair = (m, m)
            if arg in messages:
                old = messages[arg]
                pair = (torch.maximum(old[0], pair[0]), torch.minimum(old[1], pair[1]))
            messages[arg] = pair
    return messages[target]
