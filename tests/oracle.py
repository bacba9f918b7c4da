"""Brute-force oracles for semiring backprop, independent of the library's formulas.

Two oracles, both built only from a semiring's own ``zero``/``one``/``lift``/``add``/``mul``
applied elementwise, with explicit Python loops where terms are combined:

* :func:`op_oracle` — one op: the Jacobian of ``out = fn(*args)`` (torch.autograd,
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
import torch.autograd.forward_ad as fwAD
from torch import Tensor

from semiring_autograd.semirings import Semiring, Value

Node = tuple[str, int]
"""A scalar node of the gradient graph: (tensor name, flat element index)."""


#: rows (vector-Jacobian products) or columns (Jacobian-vector products) per block: bounds
#: the oracle's memory to a block of the Jacobian at a time
BLOCK = 256
#: columns (forward mode) are used where the output has this many times more elements than
#: the arguments: one forward-mode product per argument element instead of one backward per
#: output element
TALL = 8

Entries = tuple[Tensor, Tensor, Tensor]
"""Non-zero Jacobian entries of one argument: (rows, cols, values), rows indexing the flat
output, cols the flat argument."""


def jacobian_entries(fn: Callable[..., Tensor], args: Sequence[Tensor]) -> list[Entries]:
    """Per argument, the non-zero entries of the Jacobian of ``fn(*args)`` (torch.autograd).

    Computed block by block: by rows (batched vector-Jacobian products) or, where the
    output is more than ``TALL`` times larger than the arguments and every op has a
    forward-mode derivative, by columns (Jacobian-vector products). A NaN local derivative
    spreads along its row or column (0 · NaN) to entries that are no edge; where a block
    holds NaN, which of its entries are edges is read from the Jacobian at a point where
    the derivatives are finite (every floating argument x moved to |x| + 0.5): a NaN there
    where that Jacobian is 0 is no edge."""
    inputs = tuple(a.detach() for a in args)
    rows = _Rows(fn, inputs)
    if rows.out_numel > TALL * sum(inputs[k].numel() for k in rows.wrt):
        try:
            return _entries(_Columns, fn, inputs)
        except NotImplementedError as exc:  # an op without a forward-mode derivative
            if "forward AD" not in str(exc):
                raise
    return _entries(_Rows, fn, inputs, rows)


def dense_jacobians(fn: Callable[..., Tensor], args: Sequence[Tensor]) -> list[Tensor]:
    """Per argument, the Jacobian of ``fn(*args)`` as a (out.numel(), arg.numel()) matrix
    (NaN entries that are no edge set to 0, as :func:`jacobian_entries`)."""
    out_numel = fn(*(a.detach() for a in args)).numel()
    dense = []
    for a, (rows, cols, values) in zip(args, jacobian_entries(fn, args)):
        jac = torch.zeros(out_numel, a.numel(), dtype=values.dtype)
        jac[rows, cols] = values
        dense.append(jac)
    return dense


def _entries(
    source: type[_Blocks], fn: Callable[..., Tensor], inputs: tuple[Tensor, ...], blocks=None
) -> list[Entries]:
    blocks = blocks or source(fn, inputs)
    pattern = None
    found: list[list[Entries]] = [[] for _ in inputs]
    for key in blocks.keys():
        part = blocks(key)
        if any(torch.isnan(block).any() for *_, block in part):
            if pattern is None:
                moved = tuple(a.abs() + 0.5 if a.dtype.is_floating_point else a for a in inputs)
                pattern = source(fn, moved)
            part = [
                (k, row, col, torch.where(torch.isnan(block) & (edges == 0), 0.0, block))
                for (k, row, col, block), (*_, edges) in zip(part, pattern(key))
            ]
        for k, first_row, first_col, block in part:
            rows, cols = torch.nonzero(block, as_tuple=True)
            found[k].append((rows + first_row, cols + first_col, block[rows, cols]))
    empty = torch.zeros(0, dtype=torch.long)
    none = (empty, empty, torch.zeros(0, dtype=blocks.out.dtype))
    return [tuple(torch.cat(p) for p in zip(*parts)) if parts else none for parts in found]


Block = tuple[int, int, int, Tensor]
"""(argument index, first row, first column, dense block of its Jacobian)."""


class _Blocks:
    """Blocks of the Jacobian of ``fn(*inputs)`` at fixed inputs; floating inputs are the
    differentiable ones."""

    def __init__(self, fn: Callable[..., Tensor], inputs: tuple[Tensor, ...]) -> None:
        self.fn = fn
        self.inputs = tuple(a.clone().requires_grad_(a.dtype.is_floating_point) for a in inputs)
        self.wrt = [k for k, a in enumerate(self.inputs) if a.requires_grad]
        self.out = fn(*self.inputs)
        self.out_numel = self.out.numel()

    def keys(self) -> list:
        raise NotImplementedError

    def __call__(self, key) -> list[Block]:
        raise NotImplementedError


class _Rows(_Blocks):
    """Blocks of ``BLOCK`` rows: batched vector-Jacobian products of unit cotangents on one
    recorded graph (row by row where some op's backward has no batching rule)."""

    batched = True

    def keys(self) -> list[int]:
        return list(range(0, self.out_numel, BLOCK)) if self.out.requires_grad else []

    def __call__(self, first: int) -> list[Block]:
        n = min(BLOCK, self.out_numel - first)
        unit = torch.zeros(n, self.out_numel, dtype=self.out.dtype)
        unit[torch.arange(n), torch.arange(first, first + n)] = 1
        grads = self._vjp(unit.reshape(n, *self.out.shape))
        return [(k, first, 0, self._block(g, n, self.inputs[k])) for k, g in zip(self.wrt, grads)]

    def _block(self, g: Tensor | None, n: int, a: Tensor) -> Tensor:
        if g is None:
            return torch.zeros(n, a.numel(), dtype=self.out.dtype)
        return g.reshape(n, a.numel()).to(self.out.dtype)

    def _vjp(self, cotangents: Tensor) -> tuple[Tensor | None, ...]:
        wrt = [self.inputs[k] for k in self.wrt]
        if self.batched:
            try:
                return torch.autograd.grad(
                    self.out,
                    wrt,
                    cotangents,
                    retain_graph=True,
                    allow_unused=True,
                    is_grads_batched=True,
                )
            except RuntimeError as exc:  # an op's backward without a batching rule
                if "vmap" not in str(exc) and "batch" not in str(exc).lower():
                    raise
                self.batched = False
        rows = [
            torch.autograd.grad(self.out, wrt, c, retain_graph=True, allow_unused=True)
            for c in cotangents
        ]
        return tuple(
            None if rows[0][k] is None else torch.stack([r[k] for r in rows])
            for k in range(len(wrt))
        )


class _Columns(_Blocks):
    """Blocks of up to ``BLOCK`` columns of one argument: one forward-mode Jacobian-vector
    product of a unit tangent per column."""

    def keys(self) -> list[tuple[int, int]]:
        return [(k, first) for k in self.wrt for first in range(0, self.inputs[k].numel(), BLOCK)]

    def __call__(self, key: tuple[int, int]) -> list[Block]:
        k, first = key
        n = min(BLOCK, self.inputs[k].numel() - first)
        primals = [a.detach() for a in self.inputs]
        columns = []
        for j in range(first, first + n):
            tangent = torch.zeros(primals[k].numel(), dtype=primals[k].dtype)
            tangent[j] = 1
            with fwAD.dual_level():
                duals = [a.clone() for a in primals]  # fn may write to its arguments
                duals[k] = fwAD.make_dual(primals[k], tangent.reshape(primals[k].shape))
                column = fwAD.unpack_dual(self.fn(*duals)).tangent
                columns.append(
                    torch.zeros(self.out_numel, dtype=self.out.dtype)
                    if column is None
                    else column.reshape(-1).to(self.out.dtype)
                )
        return [(k, 0, first, torch.stack(columns, dim=1))]


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
    like = args[0].detach()
    flat_seed = None if seed is None else seed.detach().reshape(-1).to(like.dtype)
    results = []
    for arg, (rows, cols, values) in zip(args, jacobian_entries(fn, args)):
        if flat_seed is not None:
            kept = flat_seed[rows] != 0
            rows, cols, values = rows[kept], cols[kept], values[kept]
        if flat_seed is None:
            starts = semiring.one(rows.shape, like)
        else:
            starts = semiring.lift(flat_seed[rows])
        terms = semiring.mul(starts, semiring.lift(values))
        results.append(_fold_by_target(semiring, terms, cols, arg))
    return results


def _fold_by_target(semiring: Semiring, terms: Value, targets: Tensor, like: Tensor) -> Value:
    """⊕ of the terms of each element of ``like`` (``targets[t]``: the flat element term t
    goes to), folded pairwise: the i-th term of every element with its (i + half)-th, until
    one is left; the zero where an element has none (⊕ is associative and commutative)."""
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
    while table[0].shape[0] > 1:
        half = (table[0].shape[0] + 1) // 2
        rest = table[0].shape[0] - half
        merged = semiring.add(
            tuple(t[:rest] for t in table), tuple(t[half : half + rest] for t in table)
        )
        table = tuple(torch.cat([m, t[rest:half]]) for m, t in zip(merged, table))
    return tuple(t[0].reshape(like.shape) for t in table)


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
