"""Recording operators into a program: a dispatch mode that sees every operator run on
plain tensors, and the straight-line Python function it becomes.

The recorder runs each operator and notes it with its arguments, the tensors as program
values: a slot (a tensor the program is given), the result of an earlier operator, or a
constant (a tensor from outside: scratch storage, a parameter of a compiled step). An
operator on messages runs its handler with the recorder active, so the component
operators inside are recorded. Python that reads tensor data (an operator returning a
number) and operators whose result shape depends on data become guards of the program. The
program calls each operator (through torch's generated Python binding where one takes the
same arguments), checks its guards and deletes each value after its last use. It runs in
any thread, several at once: a scratch buffer of the capturing thread it writes into is,
in another thread, that thread's own buffer of the same layout; with autocast off, since
the recorder saw the operators after autocast's casts.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ...kernels.workspace import is_scratch
from ...ops.message import Message
from .signature import AUTOCAST_DEVICES, Uncapturable

_aten = torch.ops.aten

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


class GuardFailure(Exception):
    """A replay read data that differs from what the capture read."""


@dataclass(frozen=True)
class _Ref:
    """A value of the program: ``v<index>``."""

    index: int


@dataclass(frozen=True)
class Constant:
    """A tensor the program reads that neither a slot nor a step gives: ``k<index>``."""

    index: int


@dataclass
class _Step:
    func: Callable
    args: tuple  # with tensors as _Ref or Constant
    kwargs: dict
    outputs: list  # flat: _Ref for a tensor, ("guard", number) for a number, None
    sequence: bool  # the operator returns a tuple or list
    shapes: list | None = None  # data-shaped outputs: the recorded shapes
    view: tuple | None = None  # a view operator's result: (size, stride, storage offset)


def _view_key(t: Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class Recorder(TorchDispatchMode):
    """Runs every operator and records it on plain tensors; an operator on messages runs its
    handler with this mode active, so the component operators it runs are recorded."""

    def __init__(self, slots: list[Tensor], parameters: frozenset[int] = frozenset()) -> None:
        super().__init__()
        #: ids of tensors the program may read as constants although they require grad (a
        #: compiled step's model parameters)
        self.parameters = parameters
        self.steps: list[_Step] = []
        self.constants: list[Tensor] = []
        self.count = len(slots)
        self.values: dict[int, tuple[weakref.ref, int]] = {}
        self.slot_of: dict[int, int] = {}  # value -> the slot whose storage it views
        #: a value's view (storage, offset, shape, strides, dtype), for another tensor
        #: object of the same view (autograd's wrapper of a Function's view output)
        self.by_view: dict[tuple, tuple[weakref.ref, int]] = {}
        #: values that several tensor objects stand for (identity views)
        self.aliased: set[int] = set()
        #: values that view a constant's storage -> that constant; constants written into
        self.outside: dict[int, int] = {}
        self.written: set[int] = set()
        for i, t in enumerate(slots):
            self._bind(t, i)
            self.slot_of[i] = i

    def _bind(self, t: Tensor, index: int) -> None:
        self.values[id(t)] = (weakref.ref(t), index)
        self.by_view[_view_key(t)] = (weakref.ref(t), index)

    def ref(self, t: Tensor) -> _Ref | Constant:
        found = self.values.get(id(t))
        if found is not None and found[0]() is t:
            return _Ref(found[1])
        view = self.by_view.get(_view_key(t))
        # the same view of a storage still alive (so its address was not reused)
        if view is not None and view[0]() is not None:
            self._bind(t, view[1])
            return _Ref(view[1])
        if t.requires_grad and id(t) not in self.parameters:
            raise Uncapturable(
                "the computation reads a tensor that requires grad from outside it (neither "
                "an input nor a parameter of the model: a checkpointed region recomputed in "
                "the backward reads the model's parameters)"
            )
        self.constants.append(t)
        return Constant(len(self.constants) - 1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _holds_message(args) or (kwargs and _holds_message(kwargs.values())):
            with self:
                return Message.__torch_dispatch__(func, types, args, kwargs)
        traits = _traits(func)
        if traits.seeded and _draws(func, args, kwargs):
            raise Uncapturable(
                f"{func} draws random numbers (dropout in a model in train mode?), which a "
                "replay would draw anew"
            )
        template = self._template(args), (self._template(kwargs) if kwargs else {})
        if traits.written:
            self._note_writes(func, *template)
        source = template[0][0] if template[0] else None
        if traits.inplace_view and getattr(source, "index", None) in self.aliased:
            raise Uncapturable(f"{func} changes the shape of a tensor in place")
        result = func(*args, **kwargs)
        if traits.view and self._identity_view(args, source, result):
            return result
        sequence = isinstance(result, (tuple, list))
        flat = list(result) if sequence else [result]
        view_of = root = None
        if traits.aliases and isinstance(source, (_Ref, Constant)):
            view_of = self.slot_of.get(source.index) if isinstance(source, _Ref) else None
            root = self._root(source)
        outputs: list = []
        for t in flat:
            if isinstance(t, Tensor):
                self._bind(t, self.count)
                if view_of is not None:
                    self.slot_of[self.count] = view_of
                if root is not None:
                    self.outside[self.count] = root
                outputs.append(_Ref(self.count))
                self.count += 1
            elif isinstance(t, (bool, int, float)):
                outputs.append(("guard", t))
            elif t is None:
                outputs.append(None)
            else:
                raise Uncapturable(f"{func} returns a {type(t).__name__}")
        step = _Step(func, template[0], template[1], outputs, sequence)
        if _data_shaped(traits.name, args):
            step.shapes = [tuple(t.shape) if isinstance(t, Tensor) else None for t in flat]
        if traits.view and isinstance(result, Tensor):
            step.view = (tuple(result.shape), result.stride(), result.storage_offset())
        self.steps.append(step)
        return result

    def _identity_view(self, args: tuple, source: Any, result: Any) -> bool:
        """A view operator whose result is its input's view (same storage, offset, shape,
        strides and dtype) records nothing: the result stands for the input's value
        (``source``, the first argument's template; the input's layout is the same in every
        replay, as ``_fold_views`` states)."""
        if not isinstance(result, Tensor) or not isinstance(source, _Ref):
            return False
        if _view_key(result) != _view_key(args[0]):
            return False
        self._bind(result, source.index)
        self.aliased.add(source.index)
        return True

    def _template(self, tree: Any) -> Any:
        if isinstance(tree, Tensor):
            return self.ref(tree)
        if isinstance(tree, (list, tuple)):
            return type(tree)([self._template(x) for x in tree])
        if isinstance(tree, dict):
            return {k: self._template(v) for k, v in tree.items()}
        return tree

    def _note_writes(self, func, args: tuple, kwargs: dict) -> None:
        """Refuse an operator writing into a slot's storage; note one writing into a
        constant's (``args``, ``kwargs``: the arguments' templates)."""
        for i, name in _written(func):
            written = args[i] if i < len(args) else kwargs.get(name)
            for value in written if isinstance(written, (list, tuple)) else (written,):
                if isinstance(value, _Ref) and value.index in self.slot_of:
                    raise Uncapturable(f"{func} writes into a tensor the graph saved")
                root = self._root(value)
                if root is not None:
                    self.written.add(root)

    def _root(self, value: Any) -> int | None:
        """The constant whose storage a program value is or views (its index), or None."""
        if isinstance(value, Constant):
            return value.index
        return self.outside.get(value.index) if isinstance(value, _Ref) else None


def _holds_message(values: Any) -> bool:
    """Whether ``values`` (an operator's arguments: tensors, numbers, lists and tuples of
    them) holds a Message, at any depth; a plain scan, several times faster than a pytree
    flatten on every recorded operator."""
    for value in values:
        if isinstance(value, Message):
            return True
        if isinstance(value, (list, tuple)) and _holds_message(value):
            return True
    return False


def _draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether an operator tagged as seeded draws random numbers in this call: all do but
    attention with ``dropout_p`` 0."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            p = args[i] if i < len(args) else kwargs.get("dropout_p", arg.default_value)
            return p != 0
    return True


def _data_shaped(name: str, args) -> bool:
    """Whether the operator ``name`` (its schema's name) returns a result whose shape
    depends on the data in this call."""
    if name in _DATA_SHAPED:
        return True
    if name == "aten::index" and len(args) > 1:
        return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


def _refs(tree: Any) -> list[int]:
    """The program values ``tree`` (args, kwargs or a result layout: lists, tuples and dicts
    of templates) reads."""
    found: list[int] = []
    _collect_refs(tree, found)
    return found


def _collect_refs(tree: Any, found: list[int]) -> None:
    if isinstance(tree, _Ref):
        found.append(tree.index)
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            _collect_refs(x, found)
    elif isinstance(tree, dict):
        for x in tree.values():
            _collect_refs(x, found)


@dataclass(frozen=True)
class _Traits:
    """What the recorder asks of an operator on every call, read from its schema once."""

    name: str
    seeded: bool  # tagged nondeterministic_seeded (may draw random numbers)
    inplace_view: bool  # changes a tensor's shape or strides in place
    aliases: bool  # its first output aliases its first input
    view: bool  # one of ``_views()``
    written: tuple  # ``_written(func)``


#: id(operator) -> (the operator, kept so that its id is not reused; its traits)
_TRAITS: dict[int, tuple[Any, _Traits]] = {}


def _traits(func) -> _Traits:
    """``func``'s traits, by id: an operator's own hash is a Python call."""
    found = _TRAITS.get(id(func))
    if found is not None and found[0] is func:
        return found[1]
    returns = func._schema.returns
    traits = _Traits(
        func._schema.name,
        torch.Tag.nondeterministic_seeded in func.tags,
        torch.Tag.inplace_view in func.tags,
        bool(returns) and returns[0].alias_info is not None,
        func in _views(),
        _written(func),
    )
    _TRAITS[id(func)] = (func, traits)
    return traits


@functools.cache
def _written(func) -> tuple[tuple[int, str], ...]:
    """The position and name of each argument ``func`` writes into."""
    return tuple(
        (i, a.name)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def _live_steps(steps: list[_Step], results: list) -> list[_Step]:
    """The steps a replay must run: those whose values are read later or returned, that
    write into a tensor, or that hold a guard; the others are dropped."""
    used = set(_refs(results))
    kept = []
    for step in reversed(steps):
        outputs = [o.index for o in step.outputs if isinstance(o, _Ref)]
        guarded = step.shapes is not None or any(isinstance(o, tuple) for o in step.outputs)
        if guarded or _written(step.func) or any(o in used for o in outputs):
            kept.append(step)
            used.update(_refs((step.args, step.kwargs)))
    kept.reverse()
    return kept


@functools.cache
def _views() -> frozenset:
    """Operators whose result views their first argument's storage, same dtype."""
    return frozenset(
        {
            _aten.view.default,
            _aten._unsafe_view.default,
            _aten.expand.default,
            _aten.transpose.int,
            _aten.t.default,
            _aten.permute.default,
            _aten.unsqueeze.default,
            _aten.squeeze.dim,
            _aten.squeeze.dims,
            _aten.squeeze.default,
            _aten.select.int,
            _aten.slice.Tensor,
            _aten.alias.default,
            _aten.detach.default,
            _aten.as_strided.default,
        }
    )


def _fold_views(steps: list[_Step], results: list) -> list[_Step]:
    """A view of a view read nowhere else becomes one ``as_strided`` of the first one's
    base, with the recorded size, strides and storage offset: the same view of the same
    storage in one call (the base's layout is the same in every replay: the signature fixes
    the inputs', and the operators before it are the same)."""
    uses: dict[int, int] = {}
    for index in _refs(results) + [r for st in steps for r in _refs((st.args, st.kwargs))]:
        uses[index] = uses.get(index, 0) + 1
    producer: dict[int, _Step] = {}
    folded = []
    for step in steps:
        source = step.args[0] if step.view is not None and step.args else None
        before = producer.get(source.index) if isinstance(source, _Ref) else None
        if before is not None and before.view is not None and uses[source.index] == 1:
            size, stride, offset = step.view
            step = _Step(
                _aten.as_strided.default,
                (before.args[0], size, stride, offset),
                {},
                step.outputs,
                False,
                view=step.view,
            )
        for out in step.outputs:
            if isinstance(out, _Ref):
                producer[out.index] = step
        folded.append(step)
    return folded


def _same(got: Any, recorded: Any) -> bool:
    """A guard: the number a replay read equals the recorded one (NaN equals NaN)."""
    return got == recorded or (got != got and recorded != recorded)


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
        _aten.t.default: torch.t,
        _aten.eq.Scalar: torch.eq,
        _aten.eq.Tensor: torch.eq,
        _aten.ge.Scalar: torch.ge,
        _aten.lt.Scalar: torch.lt,
        _aten.ne.Scalar_out: torch.ne,
        _aten.abs.out: torch.abs,
        _aten.full.default: torch.full,
        _aten.ones.default: torch.ones,
        _aten.zeros.default: torch.zeros,
        _aten.scalar_tensor.default: torch.scalar_tensor,
        _aten.new_full.default: torch.Tensor.new_full,
        _aten.aminmax.default: torch.aminmax,
        _aten.log_.default: torch.Tensor.log_,
        _aten.add_.Tensor: torch.Tensor.add_,
        _aten.index_copy_.default: torch.Tensor.index_copy_,
        _aten.split_with_sizes.default: torch.split_with_sizes,
        _aten.logaddexp.default: torch.logaddexp,
        _aten.logsumexp.default: torch.logsumexp,
        _aten.detach.default: torch.detach,
        _aten.bitwise_not.default: torch.bitwise_not,
        _aten.masked_fill.Scalar: torch.masked_fill,
        _aten.nonzero.default: torch.nonzero,
        _aten.mean.dim: torch.mean,
        _aten.rsqrt.default: torch.rsqrt,
        _aten.to.dtype: torch.Tensor.to,
        _aten.as_strided.default: torch.as_strided,
    }


def _fast_binding(func: Callable) -> Callable:
    """What a program calls for ``func``: its Python binding, else the operator's C++ entry
    point (skipping the OpOverload's Python ``__call__``)."""
    return _bindings().get(func) or getattr(func, "_op", func)


class Program:
    """A recorded backward as one Python function ``run(slots)`` of the slots (seed
    components, then saved tensors), returning each result's components."""

    def __init__(self, recorder: Recorder, results: list, slot_count: int) -> None:
        self.results = results  # per input: None, ("plain", ref) or ("message", refs, meta)
        steps = _live_steps(_fold_views(recorder.steps, results), results)
        self.steps = len(steps)
        scratch = {i for i in recorder.written if is_scratch(recorder.constants[i])}
        codegen = _Codegen(recorder.constants, slot_count, scratch)
        self.source, namespace = codegen.generate(steps, results)
        code = compile(self.source, "<semiring_autograd captured backward>", "exec")
        exec(code, namespace)  # noqa: S102 -- the code is generated above from the record
        self.run: Callable = namespace["program"]
        self.verified = False

    def replay(self, slots: list[Tensor]) -> tuple:
        """``run(slots)``: the recorded operators as recorded, so without grad, with no
        torch function mode (a patch) seeing them and no autocast casting them again (the
        recorder saw them after autocast's casts)."""
        with torch.no_grad(), torch._C.DisableTorchFunction(), _without_autocast():
            return self.run(slots)


def _without_autocast() -> contextlib.AbstractContextManager:
    """Autocast off on every device type where it is on."""
    if not torch._C._is_any_autocast_enabled():
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for device in AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


class _ThreadOwn:
    """A scratch buffer of the capturing thread that a program writes into (its contents
    not read across calls), as each thread's own: the buffer itself in the capturing
    thread, which uses it one call at a time; in any other thread, that thread's tensor of
    the same layout over storage of the same size (kept per thread, so replays in several
    threads and the capturing thread's eager runs never write into one storage at once).
    The copies are the program's: they go with it (a program evicted, ``backward.clear()``)
    or with their thread, whichever goes first."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.local = threading.local()

    def __call__(self, shared: Tensor) -> Tensor:
        if threading.get_ident() == self.thread:
            return shared
        copies = self.local.__dict__.setdefault("copies", {})
        found = copies.get(id(shared))
        if found is None or found[0] is not shared:  # (the tensor, held: its id is its own)
            found = copies[id(shared)] = (shared, _same_layout(shared))
        return found[1]


def _same_layout(t: Tensor) -> Tensor:
    """An uninitialised tensor with the shape, strides and storage offset of ``t`` over new
    storage of the same size."""
    storage = torch.empty(
        t.untyped_storage().nbytes(), dtype=torch.uint8, device=t.device
    ).untyped_storage()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        storage, t.storage_offset(), t.shape, t.stride()
    )


class _Codegen:
    def __init__(self, constants: list[Tensor], slot_count: int, scratch: set[int]) -> None:
        self.slot_count = slot_count
        # constants are globals of the program, k<index> (a global read is cheaper than an
        # index into a list); the recorder's come first, as Constant(index) names them; a
        # scratch buffer the program writes into is a local k<index> = _own(shared<index>):
        # the running thread's own (_ThreadOwn)
        self.namespace: dict[str, Any] = {"GuardFailure": GuardFailure, "_same": _same}
        self.written = sorted(scratch)
        for index in self.written:
            self.namespace[f"shared{index}"] = constants[index]
        if self.written:
            self.namespace["_own"] = _ThreadOwn()
        self.constant_count = 0
        for t in constants:
            self.constant(t)
        self.funcs: dict[Any, str] = {}
        self.last_use: dict[int, int] = {}
        self.line = 0

    def constant(self, value: Any) -> str:
        name = f"k{self.constant_count}"
        self.constant_count += 1
        self.namespace[name] = value
        return name

    def expr(self, x: Any) -> str:
        if isinstance(x, _Ref):
            self.last_use[x.index] = self.line
            return f"v{x.index}"
        if isinstance(x, Constant):
            return f"k{x.index}"
        if isinstance(x, (list, tuple)):  # a tuple literal of numbers is built once
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
                recorded = out[1]
                if type(recorded) in (bool, int):
                    checks.append(f"if g{j} != {recorded!r}: raise GuardFailure")
                else:
                    checks.append(
                        f"if not _same(g{j}, {self.constant(recorded)}): raise GuardFailure"
                    )
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

    def generate(self, steps: list[_Step], results: list) -> tuple[str, dict]:
        bodies = []
        for self.line, step in enumerate(steps):
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
        for line, step in enumerate(steps):  # values never read: freed at once
            for out in step.outputs:
                if isinstance(out, _Ref) and out.index not in self.last_use:
                    self.last_use[out.index] = line
        for index, line in self.last_use.items():
            if line < len(bodies) and index >= self.slot_count:
                frees.setdefault(line, []).append(index)
        lines = ["def program(S):"]
        if self.slot_count:
            lines.append("    (" + "".join(f"v{i}, " for i in range(self.slot_count)) + ") = S")
        lines += [f"    k{i} = _own(shared{i})" for i in self.written]
        for line, body in enumerate(bodies):
            lines.extend("    " + code for code in body)
            if line in frees:
                lines.append("    del " + ", ".join(f"v{v}" for v in sorted(frees[line])))
        lines.append("    return (" + "".join(r + ", " for r in returned) + ")")
        return "\n".join(lines) + "\n", self.namespace
