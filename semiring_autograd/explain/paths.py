"""Top gradient paths: the strongest path from an output to an input element, step by step.

After a forward under ``sa.patch(model, sa.MaxProduct(), paths=True)`` (or
``SignedMaxProduct``), one semiring backward records every node's merged incoming message
m(y) and its outgoing message to each input. The path is then recovered from the input
element back to the output (Viterbi backtracking), exactly at element level:

* at a tensor consumed by several ops, the consumer whose outgoing message is largest at
  the element won the engine's ⊕ merge;
* inside that op, the output element i maximising m(y_i) ⊗ |∂y_i/∂x_j| won the op's
  hidden ⊕ (the k of a matmul, the i of a softmax); ∂y/∂x_j is one column of the op's local
  Jacobian, read off the other operand for a linear layer or a matrix product, else by
  forward-mode AD on the recorded call (for a native node, an op run on the output after
  the patch such as a read-out's scaling or mean, by differentiating the node's backward,
  which is linear in its incoming gradient), taken at the output elements a message
  reached;
* an op defined as a composition (layer norm, attention) is re-run as that composition on
  its recorded inputs, seeded with its own incoming message, and the path continues through
  its internal nodes (the attention probabilities among them).

The product of the local derivatives along the path (times the seed) is the readout at the
element: the path's weight.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from ..engine import trace as tracing
from ..ops import demand
from ..engine.grad import recorded_semiring, seed_message
from ..engine.graph import NodeInfo, native_column, node_info, reachable_nodes
from ..engine.patch import patch
from ..engine.recorded_call import RecordedCall
from ..ops.decompositions import CONSTANT_OUTPUTS, DECOMPOSITIONS
from ..errors import SemiringAutogradError
from ..ops.message import wrap
from ..semirings.base import Semiring
from ..semirings.registry import path_kind

Key = tuple[Any, int]  # a tensor of the graph: (producing node, output number)


#: ops whose weight-1 edges merge two streams (a residual connection): shown, not hidden
_MERGES = frozenset({"add.Tensor", "sub.Tensor", "sum", "sum.dim"})


@dataclass(frozen=True)
class AttentionEdge:
    """Where an edge inside attention runs: ``head``, ``query`` and ``key`` positions, and
    which part of the attention it crosses: ``"value"`` (o ← v, weight the probability
    p[query, key]), ``"probability"`` (o ← p, weight v[key]), ``"softmax"`` (p ← s) or
    ``"score"`` (s ← q or k)."""

    head: int
    query: int
    key: int
    via: str

    def describe(self, weight: float, tokens: Sequence[str] | None = None) -> str:
        q, k = _position(self.query, tokens), _position(self.key, tokens)
        if self.via == "value":
            return f"head {self.head}, query {q} ← key {k}, probability {weight:.3g}"
        if self.via == "probability":
            return f"head {self.head}, query {q} ← key {k} through its probability (× value)"
        if self.via == "softmax":
            return f"head {self.head}, query {q}: probability of key {k}"
        return f"head {self.head}: score of query {q} with key {k}"


def _position(i: int, tokens: Sequence[str] | None) -> str:
    return f"{i} {tokens[i]!r}" if tokens is not None and 0 <= i < len(tokens) else str(i)


@dataclass(frozen=True)
class Step:
    """One node of a path: an element of a tensor, reached over an edge of ``local_derivative``
    (None for the path's first node, the input element). ``note``: what the edge multiplies
    by, in words (a parameter element, a normalisation); ``attention``: the head and
    positions of an edge inside attention."""

    module: str
    op: str
    shape: tuple[int, ...]
    index: tuple[int, ...]
    local_derivative: float | None
    note: str = ""
    attention: AttentionEdge | None = None

    @property
    def is_identity(self) -> bool:
        """An edge of weight exactly 1 that merges nothing and multiplies by no parameter or
        other op's output: a view, cast, copy, selection."""
        if self.local_derivative != 1.0 or self.note:
            return False
        return self.op.split(": ")[-1] not in _MERGES

    def describe(self, tokens: Sequence[str] | None = None) -> str:
        """The step in one line; ``tokens`` name the attention's query and key positions."""
        edge = "" if self.local_derivative is None else f"× {self.local_derivative:+.4e}  "
        index = ", ".join(map(str, self.index))
        note = self.note
        if self.attention is not None and self.local_derivative is not None:
            note = self.attention.describe(self.local_derivative, tokens)
        what = f"{self.op} — {note}" if note else self.op
        return f"{edge}{self.module}  {what}  [{index}] of {tuple(self.shape)}"

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True)
class Path:
    """The strongest path from an input element to the output."""

    weight: float
    semiring: str
    steps: tuple[Step, ...]

    def format(self, *, tokens: Sequence[str] | None = None, hide_identity: bool = True) -> str:
        """The chain from the input element to the output, one step a line. With
        ``hide_identity``, edges of weight exactly 1 that merge nothing (views, casts,
        copies, the readout's indexing) are left out and a run of residual adds (weight-1
        ``add.Tensor`` edges) is one line;
        ``tokens`` name attention positions."""
        hidden = sum(s.is_identity for s in self.steps[1:]) if hide_identity else 0
        head = f"{self.semiring} path, weight {self.weight:.6e}, {len(self.steps)} nodes"
        if hidden:
            steps = "1 step" if hidden == 1 else f"{hidden} steps"
            head += f" ({steps} of weight 1 hidden: views, casts, copies)"
        lines = [head + ":", f"  {self.steps[0].describe(tokens)}"]
        steps = [s for s in self.steps[1:] if not (hide_identity and s.is_identity)]
        i = 0
        while i < len(steps):
            run = i
            while hide_identity and run < len(steps) and _is_residual(steps[run]):
                run += 1
            if run > i:
                first, last = steps[i], steps[run - 1]
                span = first.module
                if first.module != last.module:
                    span = f"{first.module} … {last.module}"
                adds = "1 residual add" if run - i == 1 else f"{run - i} residual adds"
                lines.append(
                    f"  → × 1  residual stream: {span} ({adds})  "
                    f"[{', '.join(map(str, last.index))}]"
                )
                i = run
                continue
            lines.append(f"  → {steps[i].describe(tokens)}")
            i += 1
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def shift_attention(path: Path, offset: int) -> Path:
    """``path`` with its attention edges' query and key positions less ``offset`` (a
    left-padded example's padding: its text's own positions); its steps' indices stay those
    of the tensors searched."""
    if offset == 0:
        return path
    steps = tuple(
        (
            step
            if step.attention is None
            else replace(
                step,
                attention=replace(
                    step.attention,
                    query=step.attention.query - offset,
                    key=step.attention.key - offset,
                ),
            )
        )
        for step in path.steps
    )
    return replace(path, steps=steps)


def _is_residual(step: Step) -> bool:
    """A weight-1 add that merges two streams (one that adds a named thing has a note)."""
    return step.local_derivative == 1.0 and step.op == "add.Tensor" and not step.note


@dataclass(frozen=True)
class Column:
    """One output's part of a local-Jacobian column ∂y/∂x[e], flattened: ``values`` at
    y's elements ``at`` (None: at every element, in order); y's other elements carry no
    path from x[e] on (they do not depend on it, or no message reached them)."""

    values: Tensor
    at: Tensor | None = None

    def read(self, t: Tensor) -> Tensor:
        """The flattened tensor ``t`` of y's shape at the column's elements."""
        return t if self.at is None else t[self.at]

    def position(self, i: int) -> int:
        """The flat element of y of the column's i-th value."""
        return i if self.at is None else int(self.at[i])


#: ops whose output is a batch of products of two matrices (the last two dims)
_MATRIX_PRODUCTS = frozenset({"matmul", "bmm", "mm"})


def product_column(info: NodeInfo, position: int, element: int) -> Column | None:
    """The column ∂y/∂x[element] of a linear layer ``y = x Wᵀ (+ b)`` or a matrix product
    ``y = a b`` (operands of equal batch shape), read off the other operand: x[.., t, j]
    reaches y[.., t, :] by W[:, j], W[o, j] reaches y[.., :, o] by x[.., :, j]; a[.., i, l]
    reaches y[.., i, :] by b[.., l, :], b[.., l, j] reaches y[.., :, j] by a[.., :, l]. The
    values are the forward-mode column's (each a product by 1, the other terms 0), at
    O(output row) cost rather than the op's. None for other ops and shapes."""
    inputs = [t.detach() for t in info.recorded.inputs()]
    if info.op == "linear" and position in (0, 1) and inputs[1].dim() == 2:
        x, w = inputs[0], inputs[1]
        if x.dim() == 0:
            return None
        rows, n_in, n_out = x.numel() // x.shape[-1], x.shape[-1], w.shape[0]
        if position == 0:
            t, j = divmod(element, n_in)
            return Column(w[:, j], t * n_out + torch.arange(n_out, device=w.device))
        o, j = divmod(element, n_in)
        return Column(x.reshape(rows, n_in)[:, j], torch.arange(rows, device=x.device) * n_out + o)
    if info.op not in _MATRIX_PRODUCTS or len(inputs) != 2:
        return None
    a, b = inputs
    if a.dim() < 2 or a.dim() != b.dim() or a.shape[:-2] != b.shape[:-2]:
        return None
    (m, l), n = a.shape[-2:], b.shape[-1]
    batch = a.numel() // (m * l) if m * l else 0
    if batch == 0 or n == 0:
        return None
    if position == 0:
        c, rest = divmod(element, m * l)
        i, k = divmod(rest, l)
        start = (c * m + i) * n
        return Column(b.reshape(batch, l, n)[c, k], torch.arange(start, start + n, device=b.device))
    c, rest = divmod(element, l * n)
    k, j = divmod(rest, n)
    at = (c * m + torch.arange(m, device=a.device)) * n + j
    return Column(a.reshape(batch, m, l)[c, :, k], at)


class _Sub(nn.Module):
    """A composite op's decomposition, as a module to patch."""

    def __init__(self, recorded: RecordedCall, decomposition: Callable[..., Any]):
        super().__init__()
        self.recorded, self.decomposition = recorded, decomposition

    def forward(self, *inputs: Tensor) -> Tensor:
        return self.recorded.rerun(dict(enumerate(inputs)), fn=self.decomposition)


#: native nodes an in-place op inside the patch leaves between its recorded op and the
#: tensor it wrote (the copy of its target, the write-back), and the input position each
#: passes on element by element (the write-back's other input, the overwritten tensor,
#: carries no path)
WRITE_BACK_NODES = {"CloneBackward0": 0, "torch::autograd::CopyBackwards": 1}


#: the module of a step over a native backward node: an op run outside ``sa.patch``
OUTSIDE = "(outside sa.patch)"


def flat_position(index: int | Sequence[int], shape: Sequence[int]) -> int:
    """The row-major position of element ``index`` of the input, of ``shape``: ``index`` is
    a flat int in [−numel, numel) or one int per dimension, each in [−size, size); negative
    values count from the end, as Python's."""
    shape = tuple(shape)
    if isinstance(index, Sequence) and not isinstance(index, str):
        entries = tuple(_as_int(i, index) for i in index)
        if len(entries) != len(shape):
            raise IndexError(
                f"path index {tuple(index)} has {len(entries)} entries for the input of shape "
                f"{shape}: give one per dimension ({len(shape)}) or a flat int"
            )
        flat = 0
        for d, (i, size) in enumerate(zip(entries, shape)):
            if not -size <= i < size:
                raise IndexError(
                    f"path index {entries} is out of range for the input of shape {shape}: "
                    f"entry {d} is {i}, dimension {d} has size {size} (allowed {-size}..{size - 1})"
                )
            flat = flat * size + i % size
        return flat
    i, numel = _as_int(index, index), math.prod(shape)
    if not -numel <= i < numel:
        raise IndexError(
            f"path index {i} is out of range for the input of shape {shape}: a flat index "
            f"lies in {-numel}..{numel - 1}"
        )
    return i % numel


def _as_int(i: Any, index: Any) -> int:
    if isinstance(i, bool):
        raise TypeError(f"path index {index!r}: use ints, not {type(i).__name__}")
    try:
        return operator.index(i)
    except TypeError:
        raise TypeError(
            f"path index {index!r}: use a flat int or a tuple of ints, not {type(i).__name__}"
        ) from None


def _reached(message: Tensor, signed: bool) -> Tensor:
    """Per element of ``message`` (flattened), whether a path reaches it: a MaxProduct or
    KBest weight above 0, a SignedMaxProduct pair with hi ≥ lo."""
    if signed:
        hi, lo = message.value
        return (hi >= lo).reshape(-1)
    return (message.value[0] > 0).reshape(-1)


def _recorded_of(node: Any):
    info = node_info(node)
    return None if info is None else info.recorded


def key_of(t: Tensor, nodes: Sequence[Any]) -> Key:
    """The graph tensor that stands for ``t``: its grad_fn's output, or the AccumulateGrad
    node of a leaf among ``nodes``' inputs."""
    if t.grad_fn is not None:
        return (t.grad_fn, t.output_nr)
    for node in nodes:
        for child, nr in node.next_functions:
            if child is not None and getattr(child, "variable", None) is t:
                return (child, nr)
    raise SemiringAutogradError("the input is not part of the graph behind the output")


class PathFinder:
    """One recorded semiring backward from a scalar ``output`` to ``input``; ``path(index)``
    backtracks the strongest path to any element of ``input``."""

    def __init__(
        self,
        output: Tensor,
        input: Tensor,
        seed: Tensor | None = None,
        *,
        which: str = "max",
        _semiring: Semiring | None = None,
    ):
        semiring = _semiring or recorded_semiring(output)
        kind = path_kind(semiring)
        if kind is None:
            raise SemiringAutogradError(
                "top paths need a graph recorded with sa.MaxProduct(), sa.SignedMaxProduct(), "
                f"sa.KBest(k) or sa.Boolean() (a witness path), not {semiring!r}: record the "
                "forward under one of those (with paths=True) to follow paths; Log's "
                "strongest path is MaxProduct's"
            )
        if which not in ("max", "min") or (which == "min" and kind != "signed"):
            raise ValueError("which is 'max', or 'min' for SignedMaxProduct")
        if seed is None and output.numel() != 1 and _semiring is None:
            raise ValueError(
                f"top_path needs a scalar output (got shape {tuple(output.shape)}): pick an "
                "element, e.g. logits[0, -1, token_id]"
            )
        self.semiring, self.which, self.output = semiring, which, output
        self.signed = kind == "signed"
        self.witness = kind == "witness"
        nodes = reachable_nodes([output.grad_fn])
        if not any(_recorded_of(n) is not None for n in nodes):
            raise SemiringAutogradError(
                "this graph was recorded without paths: run the forward under "
                "`sa.patch(model, semiring, paths=True)` to recover top paths"
            )
        self.incoming: dict[Any, tuple] = {}
        self.outgoing: dict[Any, tuple] = {}
        self._live: dict[tuple[Any, int], Tensor | None] = {}
        self._native: dict[tuple[Any, int, int], tuple[Column | None, ...]] = {}
        hooks = []
        for node in nodes:
            hooks.append(node.register_prehook(self._store_incoming(node)))
            hooks.append(node.register_hook(self._store_outgoing(node)))
        if seed is None:
            seed = seed_message(semiring, output)
        tracing.attach_active([output])
        try:
            with demand.requesting([output], [input]):
                (message,) = torch.autograd.grad(
                    output, input, seed, retain_graph=True, allow_unused=True
                )
        finally:
            for h in hooks:
                h.remove()
        if message is None:
            raise SemiringAutogradError("no path reaches the input from the output")
        self.message = message
        self.readout = semiring.readout(message.value)
        self.root: Key = (output.grad_fn, output.output_nr)
        self.start: Key = key_of(input, nodes)
        self.input_shape = tuple(input.shape)
        self.consumers: dict[Key, list[tuple[Any, int]]] = {}
        for node in nodes:
            for position, (child, nr) in enumerate(node.next_functions):
                if child is not None:
                    self.consumers.setdefault((child, nr), []).append((node, position))

    def _store_incoming(self, node):
        def hook(grad_outputs):
            self.incoming[node] = tuple(grad_outputs)

        return hook

    def _store_outgoing(self, node):
        def hook(grad_inputs, grad_outputs):
            self.outgoing[node] = tuple(grad_inputs)

        return hook

    # ----- the path's value at an element, for the sought extreme -----------------------
    def _value(self, message: Tensor | None, which: str, at: int | None = None) -> Tensor | None:
        """Flattened values whose max (which='max') or min is sought (at element ``at``
        only, if given); no path → -inf."""
        if message is None:
            return None
        parts = [c.reshape(-1) if at is None else c.reshape(-1)[at] for c in message.value]
        if not self.signed:
            m = parts[0]  # MaxProduct's value; KBest's best path
            return torch.where(m > 0, m, -torch.inf).double()
        hi, lo = (c.double() for c in parts)
        valid = hi >= lo
        if which == "max":
            return torch.where(valid, hi, -torch.inf)
        return torch.where(valid, -lo, -torch.inf)  # the min, negated: always maximise

    def element_values(self) -> Tensor:
        """Per input element (input's shape), the sought extreme's path weight in a form to
        maximise (the min negated); -inf where no path reaches."""
        return self._value(self.message, self.which).view(self.input_shape)

    def default_index(self) -> int:
        return int(self.element_values().argmax())

    def path(self, index: int | Sequence[int] | None = None) -> Path:
        """The strongest path to ``input[index]`` (default: the element with the best readout)."""
        flat = self.flat_index(index)
        total = self._value(self.message, self.which, flat)
        if not torch.isfinite(total):
            raise SemiringAutogradError(f"no path reaches input element {self._unravel(flat)}")
        start = Step("input", "input", self.input_shape, self._unravel(flat), None)
        steps, _, _ = self._walk(self.start, flat, self.which)
        weight = float(total) if (not self.signed or self.which == "max") else -float(total)
        if self.witness:  # the readout says only that a path exists: its own product
            weight = math.prod(abs(s.local_derivative) for s in steps)
        name = type(self.semiring).__name__ + (f" ({self.which})" if self.signed else "")
        return Path(weight, name, (start, *steps))

    def flat_index(self, index: int | Sequence[int] | None) -> int:
        """The row-major position of ``input[index]`` (see :func:`flat_position`); None: the
        element with the best readout."""
        if index is None:
            return self.default_index()
        return flat_position(index, self.input_shape)

    def _unravel(self, flat: int, shape: Sequence[int] | None = None) -> tuple[int, ...]:
        shape = tuple(self.input_shape if shape is None else shape)
        out = []
        for size in reversed(shape):
            out.append(flat % size)
            flat //= size
        return tuple(reversed(out))

    # ----- backtracking ---------------------------------------------------------------
    def _walk(self, key: Key, element: int, which: str) -> tuple[list[Step], int, str]:
        """Steps from tensor ``key``'s ``element`` to the output; also the output element
        reached and the extreme sought there."""
        steps: list[Step] = []
        while key != self.root:
            node, position = self._winning_consumer(key, element, which)
            if _recorded_of(node) is None and WRITE_BACK_NODES.get(node.name()) == position:
                key = (node, 0)
                continue
            info = node_info(node)
            if info is not None and info.op in DECOMPOSITIONS:
                inner, element, which = self._through_composition(node, position, element, which)
                steps += inner
                key = (node, 0)
                continue
            step, key, element, which = self._through_op(node, position, element, which)
            steps.append(step)
        return steps, element, which

    def _winning_consumer(self, key: Key, element: int, which: str) -> tuple[Any, int]:
        """The consumer whose message to this tensor is best at ``element``: the winner of
        the engine's ⊕ merge."""
        best, best_value = None, -torch.inf
        for node, position in self.consumers.get(key, []):
            grads = self.outgoing.get(node)
            if grads is None or position >= len(grads):
                continue
            value = self._value(grads[position], which, element)
            if value is not None and value > best_value:
                best, best_value = (node, position), value
        if best is None:
            raise SemiringAutogradError("path recovery lost the path (no consumer carries it)")
        return best

    def column(self, node, position: int, element: int) -> tuple[Column | None, ...]:
        """∂y/∂x[element] for every output y of ``node`` (None where no message reached y),
        x its input ``position``, at the elements of y that can carry a path on: those
        that depend on x[element] (a linear layer's or a matrix product's row or column,
        read off the other operand) and that a message reached. Otherwise the recorded
        call is re-run by forward-mode AD, or, for a native node (ops run outside
        ``sa.patch``, such as a read-out's indexing, scaling or mean), the node's own
        backward differentiated, once per element (each path of the output ends there)."""
        info = node_info(node)
        if info is None:  # a read-out's op: every path ends through it, often at one element
            if (node, position, element) not in self._native:
                columns = native_column(node, self.incoming.get(node, ()), position, element)
                self._native[node, position, element] = tuple(
                    None if c is None else self.restricted(Column(c), node, nr)
                    for nr, c in enumerate(columns)
                )
            return self._native[node, position, element]
        if info.recorded is None:
            raise SemiringAutogradError(
                f"{info.op} in {info.module or 'the model'} was recorded without paths: run "
                "the whole forward under `sa.patch(model, semiring, paths=True)`"
            )
        product = product_column(info, position, element)
        if product is not None:
            return (product,)
        columns = info.recorded.column(position, element)
        return tuple(
            None if c is None else self.restricted(Column(c), node, nr)
            for nr, c in enumerate(columns)
        )

    def restricted(self, column: Column, node, nr: int) -> Column:
        """``column`` of output ``nr`` of ``node`` at the elements a message reached only,
        where those are fewer than a quarter of the output's."""
        if column.at is not None:
            return column
        live = self.live(node, nr)
        return column if live is None else Column(column.values[live], live)

    def live(self, node, nr: int) -> Tensor | None:
        """The flat indices of the elements of ``node``'s output ``nr`` that a message
        with a path reached, where they are fewer than a quarter of its elements (None
        else: every element is taken)."""
        if (node, nr) not in self._live:
            messages = self.incoming.get(node, ())
            message = messages[nr] if nr < len(messages) else None
            reached = None if message is None else _reached(message, self.signed)
            few = reached is not None and int(reached.sum()) * 4 < reached.numel()
            self._live[node, nr] = reached.nonzero().squeeze(1) if few else None
        return self._live[node, nr]

    def edge_step(self, node, position: int, element: int, shape, out: int, w: float) -> Step:
        """The step over the edge from element ``element`` of ``node``'s input ``position``
        to element ``out`` of its output of ``shape``, of local derivative ``w``."""
        index = self._unravel(out, shape)
        info = node_info(node)
        if info is None:
            return Step(OUTSIDE, node.name(), tuple(shape), index, w)
        entry = self._unravel(element, info.recorded.inputs()[position].shape)
        note = edge_note(info, position, entry, index)
        return Step(info.module, info.op, tuple(shape), index, w, note)

    def _through_op(self, node, position: int, element: int, which: str):
        """The output element that won inside ``node``'s op, and the edge taken to it."""
        columns = self.column(node, position, element)
        best = None
        for k, (column, message) in enumerate(zip(columns, self.incoming.get(node, ()))):
            if message is None or column is None or column.values.numel() == 0:
                continue
            w = column.values.double()
            if self.signed:
                hi, lo = (column.read(c.reshape(-1)).double() for c in message.value)
                valid = (hi >= lo) & (w != 0)
                if which == "max":
                    cand = torch.where(w > 0, hi * w, lo * w)
                else:
                    cand = -torch.where(w > 0, lo * w, hi * w)
            else:
                m = column.read(message.value[0].reshape(-1)).double()
                valid = (m > 0) & (w != 0)
                cand = m * w.abs()
            cand = torch.where(valid, cand, -torch.inf)
            i = int(cand.argmax())
            if best is None or cand[i] > best[0]:
                best = (cand[i], k, column.position(i), float(w[i]), tuple(message.shape))
        if best is None or not torch.isfinite(best[0]):
            info = node_info(node)
            raise SemiringAutogradError(
                f"path recovery lost the path inside {info.op if info else node.name()}"
            )
        _, k, i, w, shape = best
        if self.signed and w < 0:
            which = "min" if which == "max" else "max"
        step = self.edge_step(node, position, element, shape, i, w)
        return step, (node, k), i, which

    def composition(self, node, position: int, which: str) -> "PathFinder":
        """Composite op ``node`` re-run as its composition on its recorded inputs, with a
        recorded backward seeded by the op's incoming message: the finder of paths from
        the op's input ``position`` through its internal nodes."""
        info = node_info(node)
        inputs = [
            t.detach().requires_grad_(t.is_floating_point() and p == position)
            for p, t in enumerate(info.recorded.inputs())
        ]
        sub = _Sub(info.recorded, DECOMPOSITIONS[info.op])
        with patch(sub, self.semiring, paths=True):
            out = sub(*inputs)
        (seed,) = self.incoming[node][:1]
        if seed.semiring != self.semiring:
            raise SemiringAutogradError("mixed semirings in one graph")
        value = seed.value
        constant = CONSTANT_OUTPUTS.get(info.op)
        where = None if constant is None else info.recorded.rerun(fn=constant)
        if where is not None:
            value = without_paths(self.semiring, value, where, out)
        return PathFinder(
            out,
            inputs[position],
            wrap(self.semiring, value, out),
            which=which,
            _semiring=self.semiring,
        )

    def _through_composition(self, node, position: int, element: int, which: str):
        """Backtrack through a composite op's internal nodes (see :meth:`composition`)."""
        inner = self.composition(node, position, which)
        entry = self._unravel(element, inner.input_shape)
        steps, element, which = inner._walk(inner.start, element, which)
        return composition_steps(node, steps, entry), element, which


def without_paths(
    semiring: Semiring, value: tuple[Tensor, ...], where: Tensor, like: Tensor
) -> tuple[Tensor, ...]:
    """The message ``value`` with the semiring's zero (no path) at the elements ``where``
    (broadcast to ``like``'s shape): outputs of an op that depend on none of its inputs."""
    zero = semiring.zero(like.shape, like)
    return tuple(torch.where(where, z.to(v.dtype), v) for z, v in zip(zero, value))


def composition_steps(node, steps: Sequence[Step], entry: tuple[int, ...]) -> list[Step]:
    """Steps found inside composite op ``node``'s composition, named as steps of the op (its
    module; ``op: inner op``), attention edges marked; ``entry``: the input element the path
    enters by."""
    info = node_info(node)
    heads = _attention_edges(steps, entry) if info.op == "scaled_dot_product_attention" else {}
    label = f"{info.op}: "
    return [
        Step(info.module, label + s.op, s.shape, s.index, s.local_derivative, s.note, heads.get(n))
        for n, s in enumerate(steps)
    ]


def edge_note(
    info: NodeInfo, position: int, in_index: tuple[int, ...], out_index: tuple[int, ...]
) -> str:
    """What the edge from element ``in_index`` of input ``position`` to the output element
    ``out_index`` multiplies by, in words, where that is a parameter's element, another
    op's output or a known constant (the attention scale), or what a sum adds (a rotary
    embedding, an attention mask) ('' else: a residual stream's merge, a bare op)."""
    inputs = info.recorded.inputs()
    names = _parameter_names(info)
    if info.op == "linear" and position == 0 and len(names) > 1 and names[1] is not None:
        return f"{names[1]}[{out_index[-1]}, {in_index[-1]}]"
    if info.op in ("add.Tensor", "sub.Tensor") and len(inputs) == 2:
        return _sum_note(info, position, out_index)
    scale = _attention_scale_note(info, position)
    if scale or info.op not in ("mul.Tensor", "div.Tensor") or len(inputs) != 2:
        return scale
    if info.op == "div.Tensor" and position == 1:
        return ""
    other = 1 - position
    sign = "÷" if info.op == "div.Tensor" else "×"
    if names[other] is not None:
        return f"{sign} {names[other]}[{_broadcast_element(inputs[other].shape, out_index)}]"
    producer = node_info(inputs[other].grad_fn)
    if producer is None:
        return ""
    where = "" if producer.module == info.module else f" of {producer.module}"
    if producer.op == "rsqrt":
        return f"{sign} rsqrt(…){where}: the normalisation"
    return f"{sign} the {producer.op} output{where}"


def _parameter_names(info: NodeInfo) -> list[str | None]:
    """Per input of the op, the parameter's name relative to the op's module (None: not a
    parameter)."""
    own = info.module + "."
    return [
        n[len(own) :] if n is not None and n.startswith(own) else n
        for n in info.recorded.parameter_names
    ]


def _broadcast_element(shape: Sequence[int], out_index: tuple[int, ...]) -> str:
    """The element of an operand of ``shape`` that broadcasts to output element ``out_index``."""
    lead = len(out_index) - len(shape)
    return ", ".join(str(0 if n == 1 else out_index[lead + d]) for d, n in enumerate(shape))


def _sum_note(info: NodeInfo, position: int, out_index: tuple[int, ...]) -> str:
    """What ``a + b`` (``a − b``) adds to the operand at ``position``: a rotary embedding's
    two halves, a parameter (a bias), an attention mask or another constant; '' where the
    other operand carries paths too (two streams merge: a residual connection)."""
    if info.op == "add.Tensor" and _is_rotary_add(info):
        return "rotary embedding: x·cos + rotate_half(x)·sin"
    other = 1 - position
    sign = "−" if info.op == "sub.Tensor" and other == 1 else "+"
    name = _parameter_names(info)[other]
    operand = info.recorded.inputs()[other]
    if name is not None:
        return f"{sign} {name}[{_broadcast_element(operand.shape, out_index)}]"
    if operand.requires_grad:
        return ""
    if operand.is_floating_point() and bool((operand <= torch.finfo(operand.dtype).min / 2).any()):
        return f"{sign} attention mask"
    return f"{sign} a constant"


def _is_rotary_add(info: NodeInfo) -> bool:
    """Whether the sum is x·c + r·s with c, s constants (no gradient) whose c² + s² is the
    same everywhere, and r read from a negation (``rotate_half``: (−x₂, x₁)): each pair of
    x rotated by angles θ (c = ρ·cos θ, s = ρ·sin θ), a rotary position embedding."""
    factors, rotated = [], False
    for term in info.recorded.inputs():
        product = node_info(term.grad_fn)
        if product is None or product.op != "mul.Tensor" or product.recorded is None:
            return False
        operands = product.recorded.inputs()
        constants = [t for t in operands if not t.requires_grad]
        if len(operands) != 2 or len(constants) != 1:
            return False
        factors.append(constants[0])
        rotated = rotated or any(_reads_negation(t) for t in operands if t.requires_grad)
    c, s = (f.double() for f in factors)
    try:
        radius = c * c + s * s
    except RuntimeError:  # shapes that do not broadcast: no pair of cos, sin
        return False
    if not rotated or radius.numel() == 0:
        return False
    first = radius.reshape(-1)[:1]
    return bool(first > 0) and bool(torch.allclose(radius, first.expand_as(radius)))


def _reads_negation(t: Tensor, depth: int = 3) -> bool:
    """Whether ``t`` is computed from a ``neg`` within ``depth`` recorded ops."""
    info = node_info(t.grad_fn)
    if info is None or info.recorded is None:
        return False
    if info.op == "neg":
        return True
    return depth > 1 and any(_reads_negation(u, depth - 1) for u in info.recorded.inputs())


#: ops whose output is a batch of dot products over the last dim of their second-to-last
#: input (q of q·kᵀ; batch1 of baddbmm)
_DOT_PRODUCTS = frozenset({"matmul", "bmm", "mm", "baddbmm"})


def _attention_scale_note(info: NodeInfo, position: int) -> str:
    """'× attention scale 1/√d' where the op multiplies by 1/√d (or divides by √d), d the
    dim of the dot products it scales (q·kᵀ's, the op before), or the last dim of the
    scaled operand inside an attention module (q or k scaled first); '' else."""
    factor = _scalar_factor(info, position)
    if factor is None:
        return ""
    operand = info.recorded.inputs()[position]
    producer = node_info(operand.grad_fn)
    if producer is not None and producer.op in _DOT_PRODUCTS and producer.recorded is not None:
        dims = producer.recorded.inputs()[-2].shape[-1:]
    elif any(word in info.module.lower() for word in ("attn", "attention")):
        dims = operand.shape[-1:]
    else:
        return ""
    if not dims or not math.isclose(factor * math.sqrt(dims[0]), 1.0, rel_tol=1e-6):
        return ""
    if info.op.startswith("div"):
        return f"÷ attention scale √d (d = {dims[0]})"
    return f"× attention scale 1/√d (d = {dims[0]})"


def _scalar_factor(info: NodeInfo, position: int) -> float | None:
    """The number the op multiplies its input ``position`` by, where that is one number (a
    Python scalar, or a one-element tensor without gradient): ``x * s``, ``x / s`` (1/s)."""
    if not info.op.startswith(("mul.", "div.")) or info.op == "div.Scalar_mode":
        return None
    inputs = info.recorded.inputs()
    if info.op.endswith(".Scalar"):
        numbers = [v for v in info.recorded.leaves if isinstance(v, (int, float))]
        value = numbers[0] if len(inputs) == 1 and numbers else None
    elif len(inputs) == 2 and not inputs[1 - position].requires_grad:
        other = inputs[1 - position]
        value = float(other) if other.numel() == 1 and other.is_floating_point() else None
    else:
        return None
    if value is None or isinstance(value, bool) or value == 0:
        return None
    if info.op.startswith("div"):
        return None if position != 0 else 1.0 / value
    return float(value)


def _attention_edges(steps: Sequence[Step], entry: tuple[int, ...]) -> dict[int, AttentionEdge]:
    """The head and positions of each step through attention's composition (numbered as
    ``steps``): the scores q·kᵀ, the probabilities, the output p·v; ``entry`` is the index
    of the element the path enters by."""
    edges: dict[int, AttentionEdge] = {}
    last = len(steps) - 1
    for n, step in enumerate(steps):
        index = step.index
        head = index[-3] if len(index) >= 3 else 0
        if n == last and step.op == "matmul":
            before = steps[n - 1] if n else None
            if before is not None and before.op.startswith("softmax"):
                edges[n] = AttentionEdge(head, index[-2], before.index[-1], "probability")
            else:
                came = before.index if before is not None else entry
                edges[n] = AttentionEdge(head, index[-2], came[-2], "value")
        elif step.op.startswith("softmax"):
            edges[n] = AttentionEdge(head, index[-2], index[-1], "softmax")
        elif step.op == "matmul":
            edges[n] = AttentionEdge(head, index[-2], index[-1], "score")
    return edges


def top_path(
    output: Tensor,
    input: Tensor,
    index: int | Sequence[int] | None = None,
    *,
    which: str = "max",
) -> Path:
    """The strongest path from the scalar ``output`` to ``input[index]`` (default: the input
    element with the largest readout), after a forward under
    ``sa.patch(model, sa.MaxProduct(), paths=True)``; with ``SignedMaxProduct``, ``which``
    picks the path of the largest ('max') or smallest ('min') signed product."""
    return PathFinder(output, input, which=which).path(index)
