"""``sa.grad(..., compile=True)``: the semiring backward as a captured program.

The first call for a graph signature runs the backward eagerly under a dispatch mode that
records every aten and ``semiring_autograd`` operator it runs on plain tensors (the
components inside messages included), and turns the record into one straight-line Python
function: the operators in order, each a direct call, with ``del`` after a value's last
use. Later calls with the same signature run that function on the new graph's saved tensors
and seeds: no autograd engine, no generated backward, no message wrapping, no per-node
Python.

**Signature.** The recorded graph, walked from the outputs in a fixed order: each node's
type, its edges, its non-tensor state (a generated Function's ctx attributes: op
arguments, shapes; a torch node's ``_saved_*`` values) and the shape, strides, dtype and
device of every tensor it saved, which become the program's inputs in walk order; the
inputs' and outputs' places in the graph; the seeds' metadata. A model run on inputs of one
shape gives one signature; another shape, another module path or a changed argument gives
another (one capture each).

**Exact or not at all.** Python in the backward that reads tensor data (``bool(t)``,
``t.item()``: an operator returning a number) or an operator whose result shape depends on
data (``nonzero``, boolean indexing) becomes a guard: replay recomputes it and compares
with the recorded value or shape; on a mismatch the call runs eagerly and is captured again
as a variant of the signature (at most ``MAX_VARIANTS``). The first replay of a program is
checked against the eager backward of the same call (every result bit-identical, NaN where
NaN); a program that disagrees is dropped and the signature runs eagerly from then on, with
one warning. A backward that mutates a saved tensor, records a graph of its own
(checkpoint recomputation), holds state the signature cannot describe, or runs with hooks
that must see messages (``trace``) is not captured: eager, with one warning saying why.
"""

from __future__ import annotations

import functools
import math
import numbers
import threading
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..ops.message import Message
from ..semirings.base import Semiring

#: captured programs kept per signature (data-dependent branches taken differently)
MAX_VARIANTS = 4
#: signatures kept (least recently used dropped)
MAX_SIGNATURES = 64

#: operators whose result shape depends on the data: replay checks the shape
_DATA_SHAPED = {
    "aten::nonzero",
    "aten::argwhere",
    "aten::masked_select",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::_unique",
    "aten::_unique2",
    "aten::repeat_interleave",
    "aten::bincount",
}


class Uncapturable(Exception):
    """The backward cannot be captured exactly; the message says why."""


class GuardFailure(Exception):
    """A replay read data that differs from what the capture read."""


# ----- the signature ------------------------------------------------------------------------
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
        return ("T", t.shape, t.stride(), t.dtype, t.device)

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


# ----- recording ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ref:
    """A value of the program: ``v<index>``."""

    index: int


@dataclass(frozen=True)
class _Const:
    """A tensor the program reads that neither a slot nor a step gives: ``K[index]``."""

    index: int


@dataclass
class _Step:
    func: Callable
    args: tuple  # with tensors as _Ref or _Const
    kwargs: dict
    outputs: list  # flat: _Ref for a tensor, ("guard", number) for a number, None
    sequence: bool  # the operator returns a tuple or list
    shapes: list | None = None  # data-shaped outputs: the recorded shapes


def _view_key(t: Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class _Recorder(TorchDispatchMode):
    """Runs every operator and records it on plain tensors; an operator on messages runs its
    handler with this mode active, so the component operators it runs are recorded."""

    def __init__(self, slots: list[Tensor], parameters: frozenset[int] = frozenset()) -> None:
        super().__init__()
        #: ids of tensors the program may read as constants although they require grad (a
        #: compiled step's model parameters); a step records the forward too, whose
        #: operators' results require grad
        self.parameters = parameters
        self.forward = bool(parameters)
        self.steps: list[_Step] = []
        self.constants: list[Tensor] = []
        self.count = len(slots)
        self.values: dict[int, tuple[weakref.ref, int]] = {}
        self.slot_of: dict[int, int] = {}  # value -> the slot whose storage it views
        self.by_view: dict[tuple, int] = {}
        for i, t in enumerate(slots):
            self.by_view.setdefault(_view_key(t), i)
            self._bind(t, i)
            self.slot_of[i] = i

    def _bind(self, t: Tensor, index: int) -> None:
        self.values[id(t)] = (weakref.ref(t), index)

    def ref(self, t: Tensor) -> _Ref | _Const:
        found = self.values.get(id(t))
        if found is not None and found[0]() is t:
            return _Ref(found[1])
        slot = self.by_view.get(_view_key(t))
        if slot is not None:
            self._bind(t, slot)
            return _Ref(slot)
        if t.requires_grad and id(t) not in self.parameters:
            raise Uncapturable(
                "the computation reads a tensor that requires grad from outside it (neither "
                "an input nor a parameter of the model)"
            )
        self.constants.append(t)
        return _Const(len(self.constants) - 1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, Message) for a in tree_flatten((args, kwargs))[0]):
            with self:
                return Message.__torch_dispatch__(func, types, args, kwargs)
        template = self._template(args), self._template(kwargs)
        self._refuse_slot_writes(func, args, kwargs)
        result = func(*args, **kwargs)
        sequence = isinstance(result, (tuple, list))
        flat = list(result) if sequence else [result]
        view_of = self._view_of(func, args)
        outputs: list = []
        for t in flat:
            if isinstance(t, Tensor):
                if t.requires_grad and not self.forward:
                    raise Uncapturable(
                        f"{func} inside the backward records a graph (a checkpointed region "
                        "recomputed)"
                    )
                self._bind(t, self.count)
                if view_of is not None:
                    self.slot_of[self.count] = view_of
                outputs.append(_Ref(self.count))
                self.count += 1
            elif isinstance(t, (bool, int, float)):
                outputs.append(("guard", t))
            elif t is None:
                outputs.append(None)
            else:
                raise Uncapturable(f"{func} returns a {type(t).__name__}")
        step = _Step(func, template[0], template[1], outputs, sequence)
        if _data_shaped(func, args):
            step.shapes = [tuple(t.shape) if isinstance(t, Tensor) else None for t in flat]
        self.steps.append(step)
        return result

    def _template(self, tree: Any) -> Any:
        if isinstance(tree, Tensor):
            return self.ref(tree)
        if isinstance(tree, (list, tuple)):
            return type(tree)(self._template(x) for x in tree)
        if isinstance(tree, dict):
            return {k: self._template(v) for k, v in tree.items()}
        return tree

    def _slot_under(self, t: Any) -> int | None:
        if not isinstance(t, Tensor):
            return None
        r = self.ref(t)
        return self.slot_of.get(r.index) if isinstance(r, _Ref) else None

    def _refuse_slot_writes(self, func, args, kwargs) -> None:
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            written = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in tree_flatten(written)[0]:
                if self._slot_under(t) is not None:
                    raise Uncapturable(f"{func} writes into a tensor the graph saved")

    def _view_of(self, func, args) -> int | None:
        """The slot under an output of a view operator (one that aliases its first input)."""
        returns = func._schema.returns
        if not returns or returns[0].alias_info is None or not args:
            return None
        return self._slot_under(args[0])


def _data_shaped(func, args) -> bool:
    name = func._schema.name
    if name in _DATA_SHAPED:
        return True
    if name == "aten::index" and len(args) > 1:
        return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


def _refs(tree: Any) -> list[int]:
    """The program values ``tree`` (args, kwargs or a result layout) reads."""
    return [r.index for r in tree_flatten(tree)[0] if isinstance(r, _Ref)]


def _writes(step: _Step) -> bool:
    return any(
        a.alias_info is not None and a.alias_info.is_write for a in step.func._schema.arguments
    )


def _live_steps(steps: list[_Step], results: list) -> list[_Step]:
    """The steps a replay must run: those whose values are read later or returned, that
    write into a tensor, or that hold a guard; the others are dropped."""
    used = set(_refs(results))
    kept = []
    for step in reversed(steps):
        outputs = [o.index for o in step.outputs if isinstance(o, _Ref)]
        guarded = step.shapes is not None or any(isinstance(o, tuple) for o in step.outputs)
        if guarded or _writes(step) or any(o in used for o in outputs):
            kept.append(step)
            used.update(_refs((step.args, step.kwargs)))
    kept.reverse()
    return kept


def _same(got: Any, recorded: Any) -> bool:
    """A guard: the number a replay read equals the recorded one (NaN equals NaN)."""
    return got == recorded or (got != got and recorded != recorded)


_aten = torch.ops.aten


@functools.cache
def _bindings() -> dict:
    """Operators and torch's generated Python bindings for them, which take the same
    arguments and run the same kernel with less argument handling than an operator call
    (about 30 % per call on small tensors)."""
    return {
        _aten.view.default: torch.Tensor.view,
        _aten.expand.default: torch.Tensor.expand,
        _aten.copy_.default: torch.Tensor.copy_,
        _aten._local_scalar_dense.default: torch.Tensor.item,
        _aten.mul.Tensor: torch.mul,
        _aten.add.Tensor: torch.add,
        _aten.sub.Tensor: torch.sub,
        _aten.div.Tensor: torch.div,
        _aten.neg.default: torch.neg,
        _aten.abs.default: torch.abs,
        _aten.log.default: torch.log,
        _aten.exp.default: torch.exp,
        _aten.pow.Tensor_Scalar: torch.pow,
        _aten.maximum.default: torch.maximum,
        _aten.minimum.default: torch.minimum,
        _aten.where.self: torch.where,
        _aten.ne.Scalar: torch.ne,
        _aten.isnan.default: torch.isnan,
        _aten.all.default: torch.all,
        _aten.sum.default: torch.sum,
        _aten.sum.dim_IntList: torch.sum,
        _aten.amax.default: torch.amax,
        _aten.clone.default: torch.clone,
        _aten.transpose.int: torch.transpose,
        _aten.permute.default: torch.permute,
        _aten.unsqueeze.default: torch.unsqueeze,
        _aten.squeeze.dim: torch.squeeze,
        _aten.select.int: torch.select,
        _aten.cat.default: torch.cat,
        _aten.bmm.default: torch.bmm,
        _aten.mm.default: torch.mm,
    }


def _fast_binding(func: Callable) -> Callable:
    """What a program calls for ``func``: its Python binding, else the operator's C++ entry
    point (skipping the OpOverload's Python ``__call__``)."""
    return _bindings().get(func) or getattr(func, "_op", func)


# ----- the program ----------------------------------------------------------------------------
class Program:
    """A recorded backward as one Python function ``run(slots)`` of the slots (seed
    components, then saved tensors), returning each result's components."""

    def __init__(self, recorder: _Recorder, results: list, slot_count: int) -> None:
        self.results = results  # per input: None, ("plain", ref) or ("message", refs, meta)
        self.source, namespace = _Codegen(recorder, slot_count).generate(results)
        self.steps = len(recorder.steps)
        code = compile(self.source, "<semiring_autograd captured backward>", "exec")
        exec(code, namespace)  # noqa: S102 -- the code is generated above from the record
        self.run: Callable = namespace["program"]
        self.verified = False


class _Codegen:
    def __init__(self, recorder: _Recorder, slot_count: int) -> None:
        self.recorder = recorder
        self.slot_count = slot_count
        self.constants: list[Any] = list(recorder.constants)
        self.namespace: dict[str, Any] = {
            "K": self.constants,
            "GuardFailure": GuardFailure,
            "_same": _same,
        }
        self.funcs: dict[Any, str] = {}
        self.last_use: dict[int, int] = {}
        self.line = 0

    def constant(self, value: Any) -> str:
        self.constants.append(value)
        return f"K[{len(self.constants) - 1}]"

    def expr(self, x: Any) -> str:
        if isinstance(x, _Ref):
            self.last_use[x.index] = self.line
            return f"v{x.index}"
        if isinstance(x, _Const):
            return f"K[{x.index}]"
        if isinstance(x, list):
            return "[" + ", ".join(self.expr(v) for v in x) + "]"
        if isinstance(x, tuple):
            return "(" + "".join(self.expr(v) + ", " for v in x) + ")"
        if x is None or type(x) in (bool, int, str):
            return repr(x)
        if type(x) is float and math.isfinite(x):
            return repr(x)
        return self.constant(x)

    def function(self, func: Callable) -> str:
        name = self.funcs.get(func)
        if name is None:
            name = self.funcs[func] = f"f{len(self.funcs)}"
            self.namespace[name] = _fast_binding(func)
        return name

    def step(self, step: _Step) -> list[str]:
        parts = [self.expr(a) for a in step.args]
        parts += [f"{k}={self.expr(v)}" for k, v in step.kwargs.items()]
        call = f"{self.function(step.func)}({', '.join(parts)})"
        targets, checks = [], []
        for j, out in enumerate(step.outputs):
            if isinstance(out, _Ref):
                targets.append(f"v{out.index}")
            elif out is None:
                targets.append("_")
            else:
                targets.append(f"g{j}")
                checks.append(f"if not _same(g{j}, {self.constant(out[1])}): raise GuardFailure")
        if step.shapes is not None:
            for out, shape in zip(step.outputs, step.shapes):
                if isinstance(out, _Ref):
                    shape_ref = self.constant(torch.Size(shape))
                    checks.append(f"if v{out.index}.shape != {shape_ref}: raise GuardFailure")
        if step.sequence:
            head = "(" + "".join(t + ", " for t in targets) + ")"
        else:
            head = targets[0]
        return [f"{head} = {call}", *checks]

    def generate(self, results: list) -> tuple[str, dict]:
        self.recorder.steps = _live_steps(self.recorder.steps, results)
        bodies = []
        for self.line, step in enumerate(self.recorder.steps):
            bodies.append(self.step(step))
        self.line = len(bodies)
        returned = []
        for result in results:
            if result is None:
                returned.append("None")
            elif result[0] == "plain":
                returned.append(self.expr(result[1]))
            else:
                returned.append("(" + "".join(self.expr(r) + ", " for r in result[1]) + ")")
        frees: dict[int, list[int]] = {}
        for line, step in enumerate(self.recorder.steps):  # values never read: freed at once
            for out in step.outputs:
                if isinstance(out, _Ref) and out.index not in self.last_use:
                    self.last_use[out.index] = line
        for index, line in self.last_use.items():
            if line < len(bodies) and index >= self.slot_count:
                frees.setdefault(line, []).append(index)
        lines = ["def program(S):"]
        if self.slot_count:
            lines.append("    (" + "".join(f"v{i}, " for i in range(self.slot_count)) + ") = S")
        for line, body in enumerate(bodies):
            lines.extend("    " + code for code in body)
            if line in frees:
                lines.append("    del " + ", ".join(f"v{v}" for v in sorted(frees[line])))
        lines.append("    return (" + "".join(r + ", " for r in returned) + ")")
        return "\n".join(lines) + "\n", self.namespace


# ----- running: capture, verify, replay -------------------------------------------------------
@dataclass
class _Captured:
    programs: list[Program] = field(default_factory=list)
    refused: str | None = None


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


_CACHE: OrderedDict[Key, _Captured] = OrderedDict()
#: guards the cache and the program lists (sa.grad may run in several threads)
_LOCK = threading.Lock()
_COUNTS = {"captures": 0, "replays": 0, "eager": 0}
#: this many calls in a row, each with a signature never seen, stop capturing new ones
NEW_SIGNATURE_LIMIT = 8
_new_in_a_row = 0
_WARNED: set[str] = set()


def _warn(reason: str) -> None:
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(
        f"sa.grad(compile=True): running the eager backward ({reason})",
        RuntimeWarning,
        stacklevel=4,
    )


def refuse(reason: str) -> None:
    """Warn (once per reason) that a compile=True call runs eagerly, and why."""
    _COUNTS["eager"] += 1
    _warn(reason)


def clear() -> None:
    """Forget every captured program, the counts and the warnings given."""
    global _new_in_a_row
    with _LOCK:
        _CACHE.clear()
    _COUNTS.update(dict.fromkeys(_COUNTS, 0))
    _WARNED.clear()
    _new_in_a_row = 0


def stats() -> dict[str, int]:
    """Signatures and programs held (``steps``: operators in all programs), and how many
    compile=True calls captured a program, replayed one, or ran eagerly."""
    return {
        "signatures": len(_CACHE),
        "programs": sum(len(c.programs) for c in _CACHE.values()),
        "steps": sum(p.steps for c in _CACHE.values() for p in c.programs),
        **_COUNTS,
    }


class Programs:
    """The programs of one signature: replayed when their guards hold, the first replay of
    each checked against eager; a new variant captured when none holds."""

    def __init__(self, captured: _Captured) -> None:
        self.captured = captured

    def call(
        self,
        slots: list[Tensor],
        eager: Callable[[bool], Sequence[Any]],
        retain_graph: bool,
        parameters: frozenset[int] = frozenset(),
    ) -> Sequence[Any]:
        captured = self.captured
        if captured.refused is not None:
            _COUNTS["eager"] += 1
            return eager(retain_graph)
        for program in list(captured.programs):
            try:
                # as the engine runs a backward; no torch function modes (a patch) see it
                with torch.no_grad(), torch._C.DisableTorchFunction():
                    values = program.run(slots)
            except GuardFailure:
                continue
            results = _assemble(program.results, values)
            if program.verified:
                _COUNTS["replays"] += 1
                return results
            expected = eager(retain_graph)
            if all(_identical(r, e) for r, e in zip(results, expected)):
                program.verified = True
                _COUNTS["replays"] += 1
            else:
                with _LOCK:
                    captured.programs.clear()
                    captured.refused = "its captured program disagreed with the eager run"
                refuse(captured.refused)
            return expected
        if len(captured.programs) >= MAX_VARIANTS:
            refuse(
                f"the data read in the computation took more than {MAX_VARIANTS} branches for "
                "one signature"
            )
            return eager(retain_graph)
        recorder = _Recorder(slots, parameters)
        try:
            with recorder:
                results = eager(True)  # a failed capture must be able to run again
            layout = [_result_refs(recorder, r) for r in results]
            program = Program(recorder, layout, len(slots))
        except Uncapturable as exc:
            captured.refused = str(exc)
            refuse(captured.refused)
            return eager(retain_graph)
        with _LOCK:
            captured.programs.append(program)
        _COUNTS["captures"] += 1
        return results


def programs_for(key: Key) -> Programs | None:
    """The programs of ``key`` (new when unseen), or None when new signatures are no longer
    captured (``NEW_SIGNATURE_LIMIT`` new ones in a row)."""
    global _new_in_a_row
    with _LOCK:
        captured = _CACHE.get(key)
        if captured is None and _new_in_a_row < NEW_SIGNATURE_LIMIT:
            _new_in_a_row += 1
            captured = _CACHE[key] = _Captured()
            while len(_CACHE) > MAX_SIGNATURES:
                _CACHE.popitem(last=False)
        elif captured is not None:
            _new_in_a_row = 0
            _CACHE.move_to_end(key)
    if captured is None:
        refuse(
            f"the signature changed on each of {NEW_SIGNATURE_LIMIT} calls in a row (shapes "
            "that change every call?): new signatures are not captured"
        )
        return None
    return Programs(captured)


def run(
    outputs: Sequence[Tensor],
    inputs: Sequence[Tensor],
    grad_outputs: Sequence[Any],
    eager: Callable[[bool], Sequence[Any]],
    retain_graph: bool,
) -> Sequence[Any]:
    """The results of ``eager(retain_graph)`` (a backward through PyTorch's engine), from
    a captured program where one exists for this graph's signature."""
    try:
        parts, slots = signature(outputs, inputs, grad_outputs)
    except Uncapturable as exc:
        refuse(str(exc))
        return eager(retain_graph)
    programs = programs_for(Key(("backward", parts)))
    if programs is None:
        return eager(retain_graph)
    return programs.call(slots, eager, retain_graph)


def _result_refs(recorder: _Recorder, result: Any) -> Any:
    if result is None:
        return None
    if isinstance(result, Message):
        refs = [recorder.ref(c) for c in result.value]
        meta = (result.semiring, result.shape, result.dtype, result.device)
        found = ("message", refs, meta)
    else:
        refs = [recorder.ref(result)]
        found = ("plain", refs[0])
    if any(isinstance(r, _Const) for r in refs):
        raise Uncapturable("a result of the backward is a tensor from outside it")
    return found


def _assemble(layout: list, values: tuple) -> list:
    results = []
    for spec, value in zip(layout, values):
        if spec is None:
            results.append(None)
        elif spec[0] == "plain":
            results.append(value)
        else:
            semiring, shape, dtype, device = spec[2]
            message = Message.__new__(Message, semiring, value, shape, dtype, device)
            results.append(message)
    return results


def _identical(got: Any, expected: Any) -> bool:
    if got is None or expected is None:
        return got is None and expected is None
    a = got.value if isinstance(got, Message) else (got,)
    b = expected.value if isinstance(expected, Message) else (expected,)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


def _equal(x: Tensor, y: Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.is_floating_point():
        return bool(((x == y) | (torch.isnan(x) & torch.isnan(y))).all())
    return torch.equal(x, y)
