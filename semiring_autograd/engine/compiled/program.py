"""Recording operators into a program: a dispatch mode that sees every operator run on
plain tensors, and the straight-line Python function it becomes.

The recorder runs each operator and notes it with its arguments, the tensors as program
values: a slot (a tensor the program is given), the result of an earlier operator, or a
constant (a tensor from outside: scratch storage, a parameter of a compiled step); an
operator returning its argument itself (``to`` the dtype it has) is no step. An
operator on messages runs its handler with the recorder active, so the component
operators inside are recorded. Python that reads tensor data (an operator returning a
number) and operators whose result shape depends on data become guards of the program.
Built on its first replay, after the rewrites of ``rewrite.py``, the program calls each
operator (through torch's generated Python binding where one takes the same arguments),
checks its guards (a bool read from a CPU tensor in batches, ``_hold``) and deletes each
value after its last use. It runs in
any thread, several at once: a scratch buffer of the capturing thread it writes into is,
in another thread, that thread's own buffer of the same layout; with autocast off, since
the recorder saw the operators after autocast's casts.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import threading
import weakref
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ...kernels.workspace import is_scratch
from ...ops.message import Message
from .rewrite import ConstantView, rewrite
from .signature import AUTOCAST_DEVICES, Uncapturable
from .steps import (
    Constant,
    _aten,
    _argument,
    _Ref,
    _Step,
    _traits,
    _written,
    layout,
    out_layouts,
)

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


def _view_key(t: Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class Recorder(TorchDispatchMode):
    """Runs every operator and records it on plain tensors; an operator on messages runs its
    handler with this mode active, so the component operators it runs are recorded."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """``__torch_dispatch__`` as written, without torch's wrapper that keeps Dynamo out
        of it (a capture runs no ``torch.compile``; the wrapper costs a call per operator)."""
        return False

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
        key = _view_key(t)
        if key[0]:  # storage without bytes has no address: every empty tensor has 0
            self.by_view[key] = (weakref.ref(t), index)

    def ref(self, t: Tensor) -> _Ref | Constant:
        found = self.values.get(id(t))
        if found is not None and found[0]() is t:
            return _Ref(found[1])
        view = self.by_view.get(_view_key(t))
        # the same view of a storage still alive (so its address was not reused); two
        # tensors on storage without bytes are never taken for one (no key has address 0)
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
        reads: list[int] = []
        template = self._items(args, reads), (self._template(kwargs, reads) if kwargs else {})
        if traits.written:
            self._note_writes(func, *template)
        source = template[0][0] if template[0] else None
        if traits.inplace_view and getattr(source, "index", None) in self.aliased:
            raise Uncapturable(f"{func} changes the shape of a tensor in place")
        layouts = _layouts(func, args) if traits.laid_out else None
        outs = out_layouts(traits.outs, kwargs) if traits.outs else None
        result = func(*args, **kwargs)
        if args and result is args[0] and not traits.written:
            return result  # its argument itself (``to`` its own dtype): no step
        if traits.view and self._identity_view(args, source, result):
            return result
        sequence = isinstance(result, (tuple, list))
        flat = list(result) if sequence else [result]
        view_of = root = None
        aliased = _argument(template, traits.alias_of) if traits.aliases else None
        if isinstance(aliased, (_Ref, Constant)):
            view_of = self.slot_of.get(aliased.index) if isinstance(aliased, _Ref) else None
            root = self._root(aliased)
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
        step = _Step(func, template[0], template[1], outputs, sequence, reads, layouts=layouts)
        step.resized = outs is not None and outs != out_layouts(traits.outs, kwargs)
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

    def _template(self, tree: Any, reads: list[int]) -> Any:
        """``tree`` with its tensors as program values; the values read appended to
        ``reads``."""
        if isinstance(tree, Tensor):
            found = self.ref(tree)
            if type(found) is _Ref:
                reads.append(found.index)
            return found
        if isinstance(tree, (list, tuple)):
            return self._items(tree, reads)
        if isinstance(tree, dict):
            return {k: self._template(v, reads) for k, v in tree.items()}
        return tree

    def _items(self, tree: list | tuple, reads: list[int]) -> list | tuple:
        """``_template`` of a list or tuple: numbers kept without a call each."""
        items = [x if type(x) in _PLAIN or x is None else self._template(x, reads) for x in tree]
        return items if type(tree) is list else type(tree)(items)

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


#: argument types a template keeps as they are
_PLAIN = frozenset({int, float, bool, str, torch.dtype, torch.device})


def _layouts(func, args: tuple) -> tuple | None:
    """What the rewrites of ``rewrite.py`` read of an operator's tensors: a ``copy_``'s
    destination and source, the tensor a number is read from or compared with."""
    if func is _aten.copy_.default:
        if len(args) > 1 and isinstance(args[1], Tensor):
            return layout(args[0]), layout(args[1])
        return None
    if args and isinstance(args[0], Tensor):
        return (layout(args[0]),)
    return None


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


def _deferrable(step: _Step) -> bool:
    """Whether ``step`` reads a bool from a CPU tensor of one element as a guard (a test:
    finiteness, rows alive): such guards are checked in batches (``_hold``), before any
    write into state the program does not own and at the end, instead of one read each."""
    if step.func is not _aten._local_scalar_dense.default or step.layouts is None:
        return False
    dtype, device, shape = step.layouts[0][:3]
    return dtype is torch.bool and device.type == "cpu" and shape == () and len(step.outputs) == 1


def _hold(found: list[Tensor], expected: Tensor, start: int, stop: int) -> bool:
    """Whether the deferred guards ``found[start:stop]`` (bool tensors of no dimension) hold
    the recorded ``expected[start:stop]``."""
    if start >= stop:
        return True
    return torch.equal(torch.stack(found[start:stop]), expected[start:stop])


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
        _aten.ne.Tensor: torch.ne,
        _aten.lt.Tensor: torch.lt,
        _aten.le.Tensor: torch.le,
        _aten.gt.Tensor: torch.gt,
        _aten.ge.Tensor: torch.ge,
        _aten.eq.Tensor_out: torch.eq,
        _aten.ne.Tensor_out: torch.ne,
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
    components, then saved tensors), returning each result's components. It is built
    (``rewrite.py``, source generation, ``compile``) on its first replay, so a signature
    called once costs no build."""

    def __init__(self, recorder: Recorder, results: list, slot_count: int) -> None:
        self.results = results  # per input: None, ("plain", ref) or ("message", refs, meta)
        self.record: tuple | None = (
            recorder.steps,
            recorder.constants,
            # the capturing thread's scratch buffers written (``is_scratch`` is per thread)
            {i for i in recorder.written if is_scratch(recorder.constants[i])},
            set(recorder.outside),
            slot_count,
            threading.get_ident(),  # the capturing thread, whose scratch buffers it recorded
        )
        #: the program's function, its source and its number of steps, once built
        self.built: list | None = None
        self.building = threading.Lock()
        self.verified = False

    def build(self) -> list:
        """``[run, source, steps]``, built on the first call."""
        with self.building:
            if self.built is None:
                with gc_paused():
                    self.built = list(self._generate(*self.record))
                self.record = None  # the record is no longer needed
        return self.built

    def _generate(self, steps, constants, scratch, outside, slot_count, thread) -> tuple:
        steps, results, constants = rewrite(steps, self.results, constants)
        codegen = _Codegen(constants, slot_count, scratch, outside, thread)
        source, namespace = codegen.generate(steps, results)
        code = compile(source, "<semiring_autograd captured backward>", "exec")
        exec(code, namespace)  # noqa: S102 -- the code is generated above from the record
        return namespace["program"], source, len(steps)

    @property
    def run(self) -> Callable:
        return self.build()[0]

    @run.setter
    def run(self, function: Callable) -> None:
        self.build()[0] = function

    @property
    def source(self) -> str:
        return self.build()[1]

    @property
    def steps(self) -> int:
        return self.build()[2]

    def replay(self, slots: list[Tensor]) -> tuple:
        """``run(slots)``: the recorded operators as recorded, so in inference mode (no
        autograd state on the tensors it makes: an operator, a view above all, costs less
        than under ``no_grad``), with no torch function mode (a patch) seeing them and no
        autocast casting them again (the recorder saw them after autocast's casts). A
        result made there is cloned outside it: the caller gets ordinary tensors."""
        run = self.built[0] if self.built is not None else self.build()[0]
        with torch.inference_mode(), torch._C.DisableTorchFunction(), _without_autocast():
            values = run(slots)
        return tuple([_ordinary(v) for v in values])


def _ordinary(value: Any) -> Any:
    """A replay's result (a tensor, a tuple of components, None) with each tensor made in
    inference mode, or a view taken there, cloned (outside it: an ordinary tensor)."""
    if isinstance(value, Tensor):
        return value.clone() if value.is_inference() or value._is_view() else value
    if isinstance(value, tuple):
        return tuple([_ordinary(v) for v in value])
    return value


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the block (where it was on): a capture
    or a build allocates tens of thousands of records, each allocation counting towards a
    collection that walks every object the process holds (the model's included), and
    frees nearly all of them by reference counting. Objects in cycles wait for the next
    collection."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


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
    With it, the program's views of it (``ConstantView``), taken once per thread. The
    copies are the program's: they go with it (a program evicted, ``backward.clear()``)
    or with their thread, whichever goes first."""

    def __init__(self, thread: int) -> None:
        self.thread = thread
        self.local = threading.local()

    def __call__(self, index: int, shared: Tensor, views: tuple) -> tuple:
        """``(own, *views of own)`` for this thread: constant ``index`` of the program,
        ``shared``, and its ``views`` ((size, stride, offset)s); one own tensor per tensor
        ``shared`` (several constants may be one tensor)."""
        held = self.local.__dict__.setdefault("held", {})
        found = held.get(index)
        if found is None:
            copies = self.local.__dict__.setdefault("copies", {})
            own = copies.get(id(shared))  # (the tensors are the program's: ids their own)
            if own is None:
                mine = threading.get_ident() == self.thread
                own = copies[id(shared)] = shared if mine else _same_layout(shared)
            found = held[index] = (own, *_views_of(own, views))
        return found


def _views_of(t: Tensor, views) -> list[Tensor]:
    """``as_strided(t, size, stride, offset)`` for each ``(size, stride, offset)``."""
    with torch.no_grad(), torch._C.DisableTorchFunction(), _disable_current_modes():
        return [torch.as_strided(t, *view) for view in views]


class _ConstantViews:
    """The views a program holds of its constants (``ConstantView``; those of a scratch
    buffer it writes into are ``_ThreadOwn``'s), as its globals ``k<index>``, with each
    constant's storage address as ``p<base>``; called where a constant's storage differs
    from that address (a parameter's ``.data`` set), it takes them anew. (The views keep
    the storage alive, so another storage never has its address.)"""

    def __init__(self, namespace: dict, views: dict[int, list[tuple[int, tuple]]]) -> None:
        self.namespace = namespace
        self.views = views  # constant -> (index, view) of each of its views
        self()

    def __call__(self) -> None:
        namespace = self.namespace
        for base, found in self.views.items():
            t = namespace[f"k{base}"]
            address = t.untyped_storage().data_ptr()
            for (index, _), view in zip(found, _views_of(t, [v for _, v in found])):
                namespace[f"k{index}"] = view
            namespace[f"p{base}"] = address  # (after the views: another thread may check)

    def check(self) -> str:
        """The program's first line: the views taken anew where a storage changed."""
        changed = " or ".join(f"k{b}.untyped_storage().data_ptr() != p{b}" for b in self.views)
        return f"if {changed}: _views()"


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
    def __init__(
        self,
        constants: list[Tensor],
        slot_count: int,
        scratch: set[int],
        outside: set[int],
        thread: int,
    ) -> None:
        self.slot_count = slot_count
        #: values viewing a constant's storage: a step writing into one (or into a
        #: constant) runs after the deferred guards are checked
        self.outside = outside
        #: the recorded bools of the guards checked in batches (``_deferrable``)
        self.expected: list[bool] = []
        self.checked = 0  # how many of them the code so far checks
        # constants are globals of the program, k<index> (a global read is cheaper than an
        # index into a list); the recorder's come first, as Constant(index) names them; a
        # scratch buffer the program writes into is a local k<index> = _own(shared<index>):
        # the running thread's own (_ThreadOwn)
        self.namespace: dict[str, Any] = {
            "GuardFailure": GuardFailure,
            "_same": _same,
            "_hold": _hold,
        }
        self.written = sorted(scratch)
        views: dict[int, list[tuple[int, tuple]]] = {}  # constant -> (index, view)s
        for index, c in enumerate(constants):
            if isinstance(c, ConstantView):
                views.setdefault(c.base, []).append((index, c.view))
        self.own_views = {b: views.pop(b, []) for b in self.written}
        for index in self.written:
            self.namespace[f"shared{index}"] = constants[index]
            self.namespace[f"views{index}"] = tuple(v for _, v in self.own_views[index])
        if self.written:
            self.namespace["_own"] = _ThreadOwn(thread)
        self.constant_count = 0
        for t in constants:
            self.constant(None if isinstance(t, ConstantView) else t)
        self.views = _ConstantViews(self.namespace, views) if views else None
        if self.views is not None:
            self.namespace["_views"] = self.views
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
        if _deferrable(step):
            self.expected.append(step.outputs[0][1])
            return [f"A({self.expr(step.args[0])})"]
        lines = self.check() if self._writes_outside(step) else []
        return lines + self.call(step)

    def check(self) -> list[str]:
        """The line checking the deferred guards not yet checked (none if none)."""
        start, self.checked = self.checked, len(self.expected)
        if start == self.checked:
            return []
        return [f"if not _hold(T, E, {start}, {self.checked}): raise GuardFailure"]

    def _writes_outside(self, step: _Step) -> bool:
        """Whether ``step`` writes into a constant or a value viewing one (state the
        program does not own: it must not change where a deferred guard fails)."""
        for i, name in _written(step.func):
            value = step.args[i] if i < len(step.args) else step.kwargs.get(name)
            for v in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(v, Constant) or (isinstance(v, _Ref) and v.index in self.outside):
                    return True
        return False

    def call(self, step: _Step) -> list[str]:
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
        last = self.check()
        deferred = bool(self.expected)
        indent = "        " if deferred else "    "
        lines = ["def program(S):"]
        if self.slot_count:
            lines.append("    (" + "".join(f"v{i}, " for i in range(self.slot_count)) + ") = S")
        for i in self.written:
            names = "".join(f"k{j}, " for j in (i, *(j for j, _ in self.own_views[i])))
            lines.append(f"    ({names}) = _own({i}, shared{i}, views{i})")
        if self.views is not None:
            lines.append("    " + self.views.check())
        if deferred:  # an operator failing where a deferred guard fails: that guard's failure
            self.namespace["E"] = torch.tensor(self.expected, dtype=torch.bool)
            lines += ["    T = []", "    A = T.append", "    try:"]
        for line, body in enumerate(bodies):
            lines.extend(indent + code for code in body)
            if line in frees:
                lines.append(indent + "del " + ", ".join(f"v{v}" for v in sorted(frees[line])))
        if deferred:
            lines += [
                "    except Exception:",
                "        if not _hold(T, E, 0, len(T)): raise GuardFailure from None",
                "        raise",
            ]
        lines += ["    " + code for code in last]
        lines.append("    return (" + "".join(r + ", " for r in returned) + ")")
        return "\n".join(lines) + "\n", self.namespace
