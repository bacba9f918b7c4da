"""``sa.patch(model, semiring)``: record a model's forward for a semiring backward.

A :class:`~torch.overrides.TorchFunctionMode` is pushed (thread-locally) while the patched
model's forward runs in the thread that patched it. Every module's ``forward`` is wrapped
(an instance attribute, removed with the patch): the model's holds the mode, each names its
module while it runs. Each torch function call that touches
a grad-requiring tensor is bound to a YAML entry and routed to its generated Function;
its forward computes exactly what the unpatched call computes. For ``sa.Real()`` the call
runs as it is and torch records its own backward nodes (Real messages are torch's
gradients). A call with no entry that would produce a differentiable result raises
:class:`UnsupportedOpError` at forward, in every semiring.

Interrupts. Whatever ends a patch, a forward or a removal (an exception, a
``KeyboardInterrupt`` landing between any two lines) leaves the model, the thread and
``torch.autograd.Function.apply`` exactly as they were (a forward under a patch that stays:
the thread as it was, the patch whole). Every change is
made inside the ``try`` whose ``finally`` undoes it, and every undo reads the state it
restores (is our mode on the stack, is this ``forward`` our wrapper, is the model claimed by
this handle), so it is idempotent: it runs twice, and an interrupt landing inside the first
run leaves the second to finish. What no Python code can guard is the hand-over of the
handle itself (an interrupt at the return of ``sa.patch``, in ``__enter__`` or at the entry
of ``__exit__``): there the patch is whole and ``handle.remove()`` (the handle is also
``model.forward.__semiring_autograd_patch__``) removes it.
"""

from __future__ import annotations

import copy
import functools
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_flatten

from ..errors import PatchError, SemiringLawError, SemiringMismatchError, UnsupportedOpError
from . import complex_pairs, custom_functions, inplace
from .checkpointing import checkpoint_frame, recompute_under
from .graph import NodeInfo, node_info
from ..ops.spec import NODE_INFO_KEY, OpSpec
from .dispatch import OpTable, default_op_table
from .recorded_call import RecordedCall
from .wrapped_models import module_of
from ..semirings.base import Semiring
from ..semirings.laws import check_semiring
from ..semirings.registry import defined_by_library, records_torch_graph

_next_sequence_nr = torch._C._autograd._get_sequence_nr
#: the innermost saved-tensor hooks (None: none, so no checkpointed region is running)
_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
#: each patched model → the handle that patched it (read and written under _PATCHED_LOCK)
_PATCHED: "weakref.WeakKeyDictionary[nn.Module, PatchHandle]" = weakref.WeakKeyDictionary()
#: serializes claims and releases; re-entrant, so a finalizer or signal handler that patches
#: or removes a patch in a thread holding it goes on instead of hanging
_PATCHED_LOCK = threading.RLock()
_ABSENT = object()


def _enter_mode(mode: TorchFunctionMode) -> None:
    """Push ``mode`` on this thread's torch-function mode stack."""
    torch._C._push_on_torch_function_stack(mode)


def _leave_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off this thread's torch-function mode stack wherever it sits, the modes
    above it kept in order; nothing when it is not there (idempotent)."""
    stack = _get_current_function_mode_stack()
    if not any(m is mode for m in stack):
        return
    if stack[-1] is mode:
        torch._C._pop_torch_function_stack()
        return
    above: list[TorchFunctionMode] = []
    try:
        while (top := torch._C._pop_torch_function_stack()) is not mode:
            above.append(top)
    finally:
        for m in reversed(above):
            torch._C._push_on_torch_function_stack(m)


def _is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is torch.compile's wrapper of another (checked without importing
    torch._dynamo) or was compiled in place (``module.compile()``)."""
    cls = type(module)
    wrapper = cls.__name__ == "OptimizedModule" and cls.__module__.startswith("torch._dynamo")
    return wrapper or getattr(module, "_compiled_call_impl", None) is not None


def _name_of(func: Any) -> str:
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    module = getattr(func, "__module__", None)
    if qual is None:
        return repr(func)
    qual = qual.replace("TensorBase.", "Tensor.").replace("_VariableFunctionsClass.", "")
    if qual.startswith("Tensor."):
        return "torch." + qual
    if module and not module.startswith("torch._C"):
        return f"{module}.{qual}"
    return f"torch.{qual}"


def _requires_grad(tree: Any) -> bool:
    """Whether a tensor requiring grad sits in ``tree`` (nested tuples, lists and dicts:
    the containers torch functions take). Called on every torch call under the patch, so a
    plain loop rather than a pytree flatten, and no call per tensor."""
    if isinstance(tree, torch.Tensor):
        return tree.requires_grad
    if isinstance(tree, dict):
        tree = tree.values()
    elif not isinstance(tree, (tuple, list)):
        return False
    for x in tree:
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                return True
        elif isinstance(x, (tuple, list, dict)) and _requires_grad(x):
            return True
    return False


#: what a torch function returns that holds no tensor (``x.dim()``, ``x.shape``, ``x.dtype``)
_NO_TENSORS = (int, float, bool, str, type(None), torch.Size, torch.dtype, torch.device)


def _differentiable_output(out: Any) -> bool:
    if isinstance(out, torch.Tensor):
        return out.requires_grad and (out.is_floating_point() or out.is_complex())
    if type(out) in _NO_TENSORS:
        return False
    leaves, _ = tree_flatten(out)
    return any(
        isinstance(x, torch.Tensor)
        and x.requires_grad
        and (x.is_floating_point() or x.is_complex())
        for x in leaves
    )


#: ``NodeInfo(op, module, semiring, recorded)`` is ``_tuple_new(NodeInfo, (op, module,
#: semiring, recorded, *_INFO_DEFAULTS))``, made without the namedtuple's Python ``__new__``
_INFO_DEFAULTS = tuple(NodeInfo._field_defaults.values())[1:]
_tuple_new = tuple.__new__
#: this thread's patches whose model's forward is running, innermost last
_running = custom_functions.running


def _tensors(values: Any) -> list[torch.Tensor]:
    """The tensors among bound argument values (a ``Tensor[]`` argument's too)."""
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif type(v) in (tuple, list):
            found += [t for t in v if isinstance(t, torch.Tensor)]
    return found


def _inputs(values: Any) -> list[torch.Tensor] | None:
    """:func:`_tensors` of ``values``, or None when one of them is complex (one loop: it
    runs on every recorded call)."""
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.is_complex():
                return None
            found.append(v)
        elif type(v) in (tuple, list):
            for t in v:
                if isinstance(t, torch.Tensor):
                    if t.is_complex():
                        return None
                    found.append(t)
    return found


def _is_complex(tree: Any) -> bool:
    """Whether a complex tensor sits in ``tree`` (nested tuples, lists and dicts)."""
    if isinstance(tree, torch.Tensor):  # most ops' output: no flatten
        return tree.is_complex()
    leaves, _ = tree_flatten(tree)
    return any(isinstance(x, torch.Tensor) and x.is_complex() for x in leaves)


def _output_node(out: Any) -> Any:
    """The backward node of an op's output (its first differentiable tensor's)."""
    if isinstance(out, torch.Tensor):
        return out.grad_fn
    leaves, _ = tree_flatten(out)
    return next(
        (t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None),
        None,
    )


def _substitute(value: Any, replace: dict[int, torch.Tensor]) -> Any:
    """``value`` with the tensors whose ids are keys of ``replace`` swapped in (inside
    plain tuples and lists too)."""
    if isinstance(value, torch.Tensor):
        return replace.get(id(value), value)
    if type(value) in (tuple, list):
        return type(value)(_substitute(x, replace) for x in value)
    return value


class UnpatchedCall(functools.partial):
    """The torch call an op entry serves, as the generated Function receives it:
    ``UnpatchedCall(func, *args, **kwargs)``; ``call()`` computes it unpatched (a
    ``functools.partial``: made and called without a Python call of its own, once per
    recorded op); ``call.substituted({id(t): u})`` with tensors swapped."""

    __slots__ = ()

    def substituted(self, replace: dict[int, torch.Tensor]) -> Any:
        return self.func(
            *(_substitute(a, replace) for a in self.args),
            **{k: _substitute(v, replace) for k, v in self.keywords.items()},
        )


def _recorded_node(t: torch.Tensor, semiring: Semiring) -> bool:
    """Whether ``t``'s node was recorded under a patch of ``semiring`` (a leaf, a tensor
    made outside the patch or under another semiring's is not: a call handing it back is
    recorded, so that a graph reached from it holds a node that names the semiring)."""
    info = node_info(t.grad_fn)
    return info is not None and info.semiring == semiring


def _computed(out: Any) -> Any:
    """The call of an op whose output was computed beforehand (``UnpatchedCall(_computed,
    out)``): ``out``."""
    return out


def _route(handler: Callable, types: tuple, func: Any, *args: Any, **kwargs: Any) -> Any:
    return handler(func, types, args, kwargs)


class _SemiringMode(TorchFunctionMode):
    def __init__(self, handle: "PatchHandle"):
        super().__init__()
        self.handle = handle

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not kwargs:  # most calls: no keywords to look at
            if torch.is_grad_enabled():
                for x in args:  # _requires_grad(args), its top level inline
                    if isinstance(x, torch.Tensor):
                        if x.requires_grad:
                            return self._record(func, types, args, {})
                    elif isinstance(x, (tuple, list, dict)) and _requires_grad(x):
                        return self._record(func, types, args, {})
            return func(*args)
        if not torch.is_grad_enabled() or not (_requires_grad(args) or _requires_grad(kwargs)):
            return func(*args, **kwargs)
        if "out" in kwargs and kwargs["out"] is None:  # the default, spelled out
            kwargs = {k: v for k, v in kwargs.items() if k != "out"}
        if inplace.flagged(kwargs):  # F.relu(x, inplace=True): before any entry binds it
            return self._write(func, types, args, kwargs)
        return self._record(func, types, args, kwargs)

    def _record(self, func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
        """The call under its entry's generated Function (torch's graph under sa.Real()),
        an in-place one written back; refused where no entry takes it."""
        handle = self.handle
        try:  # the entries registered for func; whether complex_pairs.FUNCTIONS holds it
            candidates = handle.op_table.by_function.get(func, ())
            pairs = func in complex_pairs.FUNCTIONS and not handle.torch_graph
        except TypeError:  # an unhashable callable is registered nowhere
            candidates, pairs = (), False
        if pairs:
            out = handle.complex_pairs.call(func, args, kwargs, self._einsum)
            if out is not complex_pairs.NOT_BOUND:
                return out
        for op in candidates:  # _entry's search, inline: it runs on every recorded call
            bound = op.bind(args, kwargs)
            if bound is not None and (op.accepts is None or op.accepts(**bound)):
                if handle.torch_graph:
                    return handle.record_torch_graph(func, args, kwargs, op, bound)
                if op.may_return_input and not torch._C._are_functorch_transforms_active():
                    with torch.no_grad():
                        out = func(*args, **kwargs)
                    first = bound[op.params[0].name]
                    if out is first and _recorded_node(first, handle.semiring):
                        return first  # nothing recorded: first's own node takes its messages
                    call = UnpatchedCall(_computed, out)
                else:
                    call = UnpatchedCall(func, *args, **kwargs)
                return self._run(func, args, kwargs, op, bound, call)
        if inplace.is_inplace(func, kwargs):
            return self._write(func, types, args, kwargs)
        out = func(*args, **kwargs)
        if not _differentiable_output(out):
            return out  # e.g. x.type() returning a string: nothing enters the gradient graph
        if _is_complex(out) or _is_complex(args) or _is_complex(kwargs):
            if handle.torch_graph:
                return out  # view_as_complex, view_as_real …: torch's complex autograd
            raise handle.complex_refusal(func)
        _, _, rejected = _entry(candidates, args, kwargs)
        raise handle.unsupported(func, _refusal(candidates, rejected))

    def _run(self, func: Any, args: tuple, kwargs: dict, op: OpSpec, bound: dict, call: Any) -> Any:
        """The call ``func(*args, **kwargs)`` under the generated Function of its entry
        ``op`` (``bound``: its arguments bound), whose forward is ``call()``."""
        handle = self.handle
        inputs = _inputs(bound.values())
        if inputs is None:
            raise handle.complex_refusal(func)
        if _top_saved_tensors_hooks(False) is not None:
            frame = checkpoint_frame()
            if frame is not None:  # a checkpointed region: recompute it under the semiring
                recompute_under(frame, handle.run_in_mode)
        recorded = (
            RecordedCall.record(func, args, kwargs, op, bound, handle.parameter_name)
            if handle.paths
            else None
        )
        found = handle.functions.get(op.name)
        if found is None:
            found = handle.functions[op.name] = handle.op_table.dispatcher(handle.semiring, op)
        record, takes_semiring = found
        out = record((handle.semiring, call) if takes_semiring else (call,), bound)
        if isinstance(out, torch.Tensor):  # most ops: one tensor, no flatten
            if out.is_complex():  # a cast to a complex dtype
                raise handle.complex_refusal(func)
            if out.requires_grad and out._is_view():
                inplace.release_views(out, inputs, op.multi_output)
            node = out.grad_fn
        else:
            if _is_complex(out):
                raise handle.complex_refusal(func)
            inplace.release_views(out, inputs, op.multi_output)
            node = _output_node(out)
        if node is not None:
            stack = handle._stack  # handle.current_module, without the property's call
            module = stack[-1][0] if stack else type(handle.model).__name__
            # the node's NodeInfo(op.name, module, handle.semiring, recorded), made without the
            # namedtuple's __new__ (a Python call)
            info = (op.name, module, handle.semiring, recorded, *_INFO_DEFAULTS)
            node.metadata[NODE_INFO_KEY] = _tuple_new(NodeInfo, info)
        return out

    def _einsum(
        self, matrices: torch.Tensor, pairs: torch.Tensor, forward: Callable, rest: tuple
    ) -> torch.Tensor:
        """``torch.einsum(EQUATION, matrices, pairs)`` under the einsum entry, its forward
        ``forward(rest[0], pairs, *rest[1:])`` (a complex product on real pairs:
        engine/complex_pairs.py)."""
        args = (complex_pairs.EQUATION, matrices, pairs)
        op, bound, _ = _entry(self.handle.op_table.candidates(torch.einsum), args, {})
        call = UnpatchedCall(forward, rest[0], pairs, *rest[1:])
        return self._run(torch.einsum, args, {}, op, bound, call)

    def _write(self, func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
        """The in-place call ``func(*args, **kwargs)`` run out of place on a copy of its
        target and written back (engine/inplace.py); refused, with nothing written, where
        the out-of-place call has no entry that takes it."""
        handle = self.handle
        if inplace.is_native_write(func) and not inplace.flagged(kwargs):
            return self._written(func, False, lambda: func(*args, **kwargs))
        call = inplace.out_of_place_call(func, args, kwargs)
        flag = inplace.flagged(kwargs) or call is not None
        if call is not None:
            counterpart, call_args, call_kwargs = call
            why = _out_of_place_refusal(handle.op_table, counterpart, call_args, call_kwargs)
            if why is not None:
                raise handle.unsupported(
                    func,
                    f"it writes in place: it runs as {_name_of(counterpart)}(…, inplace="
                    f"{call_kwargs['inplace']}) on a copy of its input, written back, and {why}",
                )
        elif (form := inplace.functional_form(func)) is not None:
            raise handle.unsupported(
                func,
                f"it writes in place, and only with the arguments {_name_of(form)} takes "
                f"(no inplace) does it run as {_name_of(form)} on a copy of its input",
            )
        else:
            counterpart = None if flag else inplace.out_of_place(func, kwargs)
            if counterpart is None or not handle.op_table.candidates(counterpart):
                raise handle.unsupported(func, "it writes into a tensor in place")
        # the out-of-place call of a flag straight to its entry: one that keeps the flag
        # (dropout) takes it itself
        route = functools.partial(
            _route, self._record if call is not None else self.__torch_function__, types
        )
        return self._written(func, flag, lambda: inplace.write(func, args, kwargs, route))

    def _written(self, func: Any, flag: bool, write: Callable[[], Any]) -> Any:
        """``write()``, the in-place call ``func``'s write; where torch refuses it because
        its target is a view whose history it cannot rewrite, refused naming the fix
        (``flag``: the call is an ``inplace=True`` flag or an in-place functional form)."""
        handle = self.handle
        try:
            return write()
        except RuntimeError as exc:  # torch refuses the write before making it
            if not inplace.is_view_write_refusal(exc):
                raise
            fix = (
                "Call it out of place (inplace=False: nn.ReLU() for nn.ReLU(inplace=True), "
                "F.relu(x) for F.relu_(x)) or on a copy of the view (.clone())."
                if flag
                else "Write out of place (torch.cat, index_put, where) or write into a copy of "
                "the view (.clone()) and use that copy."
            )
            raise UnsupportedOpError(
                f"{_name_of(func)} (in module '{handle.current_module}') writes in place "
                f"into a view that a custom autograd.Function returned under "
                f"sa.patch(..., {handle.semiring!r}): torch cannot rewrite the view's "
                f"history around the write without dropping the Function's backward. {fix}"
            ) from exc


def _refusal(candidates: list[OpSpec], rejected: list[OpSpec]) -> str:
    """Why no entry among ``candidates`` takes a call (``rejected``: those that bound it and
    refused its arguments)."""
    if not candidates:
        return "it has no semiring formula"
    if rejected:
        return "its arguments are not supported: " + "; ".join(
            f"{op.name} requires `{op.accepts_text}`" for op in rejected
        )
    signatures = ", ".join(op.signature for op in candidates)
    return f"no entry's signature matches these arguments ({signatures})"


def _entry(
    candidates: list[OpSpec], args: tuple, kwargs: dict
) -> tuple[OpSpec | None, dict | None, list[OpSpec]]:
    """The first of ``candidates`` that binds the call and accepts its arguments, with the
    bound arguments (None, None when none does), and the ones before it that bound the call
    and refused its arguments."""
    rejected = []
    for op in candidates:
        bound = op.bind(args, kwargs)
        if bound is None:
            continue
        if op.accepted(bound):
            return op, bound, rejected
        rejected.append(op)
    return None, None, rejected


def _out_of_place_refusal(op_table: OpTable, func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why no entry takes the call ``func(*args, **kwargs)``, or None when one does."""
    candidates = op_table.candidates(func)
    op, _, rejected = _entry(candidates, args, kwargs)
    return None if op is not None else _refusal(candidates, rejected)


class PatchHandle:
    """Active patch of one model; a context manager, or call :meth:`remove`."""

    def __init__(
        self, model: nn.Module, semiring: Semiring, op_table: OpTable, paths: bool = False
    ):
        self.model = model
        self.semiring = semiring
        self.op_table = op_table
        self.paths = paths
        #: id of each parameter → (the parameter, its qualified name), for path steps to name
        #: the parameters they cross; holding the parameter keeps its id from being reused
        self._parameters: dict[int, tuple[torch.Tensor, str]] = (
            {id(p): (p, name) for name, p in model.named_parameters()} if paths else {}
        )
        #: torch records its own graph of each op (sa.Real(); see the semiring registry)
        self.torch_graph = records_torch_graph(semiring)
        #: op name → the ``record`` of the generated Function of it under this semiring, and
        #: whether it takes the semiring first (the op table's dispatcher, read once per op)
        self.functions: dict[str, tuple[Callable[..., Any], bool]] = {}
        #: complex tensors made from real pairs requiring grad, with those pairs
        self.complex_pairs = complex_pairs.ComplexPairs()
        #: the thread whose forwards record (the patching thread)
        self.thread = threading.get_ident()
        self._mode = _SemiringMode(self)
        self._active = False
        self._removed = False
        #: (qualified name, module) of the model's modules whose forward is running, innermost
        #: last; the model is named by its class
        self._stack: list[tuple[str, nn.Module]] = []
        #: (module, its own ``forward`` instance attribute before the patch, or _ABSENT)
        self._wrapped: list[tuple[nn.Module, Any]] = []

    def _install(self, named: list[tuple[str, nn.Module]]) -> None:
        """Claim the model and wrap every module's ``forward`` (an instance attribute): the
        wrappers name the running module and, on the model, hold the semiring mode.
        ``named``: the model's ``named_modules()`` (each module once, first name). Each
        module is recorded before its wrapper is set, so :meth:`_uninstall` undoes any
        prefix of this."""
        self._claim({module for _, module in named})
        model = self.model
        for name, module in named:
            before = module.__dict__.get("forward", _ABSENT)
            forward = module.forward
            if module is model:
                wrapper = self._model_forward(forward, name or type(module).__name__, module)
            else:
                wrapper = self._named_forward(forward, name, module)
            wrapper.__semiring_autograd_patch__ = self  # type: ignore[attr-defined]
            self._wrapped.append((module, before))
            module.__dict__["forward"] = wrapper

    def _claim(self, mine: set[nn.Module]) -> None:
        """Record the model as patched by this handle; refuse a model that shares a module
        with a patched one. Under :data:`_PATCHED_LOCK` the overlap is checked and then the
        claim published, so of two threads claiming overlapping models one is refused, and
        a refused patch publishes nothing. The claim is one assignment, which
        :meth:`_release` undoes whenever it took place. ``mine``: the model's modules."""
        with _PATCHED_LOCK:
            if self._overlaps(mine):
                raise PatchError(
                    f"{type(self.model).__name__} is already patched (or shares modules with "
                    "a patched model); remove the existing patch first (handle.remove())"
                )
            _PATCHED[self.model] = self

    def _overlaps(self, mine: set[nn.Module]) -> bool:
        """Whether another patch holds a module of this model (``mine``: its modules) or one
        of its models holds this model (called under :data:`_PATCHED_LOCK`)."""
        while True:
            try:
                others = [m for m, handle in list(_PATCHED.items()) if handle is not self]
                break
            except RuntimeError:  # changed by a finalizer of this thread while copied
                continue
        model = self.model
        return any(m in mine or model in set(m.modules()) for m in others)

    def _release(self) -> None:
        """Forget the model's claim if it is this handle's (idempotent)."""
        with _PATCHED_LOCK:
            if _PATCHED.get(self.model) is self:
                _PATCHED.pop(self.model, None)

    def _uninstall(self) -> None:
        """Undo whatever part of :meth:`_install` and of a running forward's entry took
        place; idempotent."""
        self._removed = True
        self._unwrap()
        if threading.get_ident() == self.thread:
            self._deactivate()
        self._release()

    def _named_forward(self, forward: Callable, name: str, module: nn.Module) -> Callable:
        """``forward`` of ``module`` that puts it on the stack of running modules, named
        ``name``, while it runs (in the patching thread)."""
        stack = self._stack
        entry = (name, module)

        @functools.wraps(forward)
        def named_forward(*args: Any, **kwargs: Any) -> Any:
            if self._removed or threading.get_ident() != self.thread:
                return forward(*args, **kwargs)
            depth = len(stack)
            try:  # the undo runs twice: an interrupt inside the first leaves the second
                try:
                    stack.append(entry)
                    return forward(*args, **kwargs)
                finally:
                    del stack[depth:]
            finally:
                del stack[depth:]

        return named_forward

    def _model_forward(self, forward: Callable, name: str, module: nn.Module) -> Callable:
        """The model's ``forward``, run with the semiring mode on (in the patching thread)."""
        named = self._named_forward(forward, name, module)

        @functools.wraps(forward)
        def patched_forward(*args: Any, **kwargs: Any) -> Any:
            if self._removed or threading.get_ident() != self.thread:
                return forward(*args, **kwargs)
            if torch.compiler.is_compiling():
                raise PatchError(
                    f"{type(self.model).__name__} is patched and is being compiled by "
                    "torch.compile: a compiled graph bypasses the per-op routing sa.patch "
                    "needs. Run the patched model eagerly (compile it outside sa.patch)."
                )
            if self._active:  # the model's forward called inside itself: all is on
                return named(*args, **kwargs)
            self._check_outer_patches()
            try:  # the undo runs twice: an interrupt inside the first leaves the second
                try:
                    self._activate()
                    return named(*args, **kwargs)
                finally:
                    self._deactivate()
            finally:
                self._deactivate()

        return patched_forward

    def _activate(self) -> None:
        """Turn the patch on in this thread: the semiring mode, custom Functions traced,
        this patch running. Each step is one that :meth:`_deactivate` finds and undoes."""
        self._active = True
        _running().append(self)
        custom_functions.install(self)
        _enter_mode(self._mode)

    def _deactivate(self) -> None:
        """Undo whatever part of :meth:`_activate` took place (idempotent)."""
        _leave_mode(self._mode)
        custom_functions.uninstall(self)
        running = _running()
        while self in running:
            running.remove(self)
        self._stack.clear()
        self._active = False

    def run_in_mode(self, fn: Callable[..., Any], args: tuple) -> Any:
        """``fn(*args)`` under a fresh semiring mode of this patch (a checkpointed region's
        recompute, during backward), the mode left whatever ends it."""
        mode = _SemiringMode(self)
        try:  # the undo runs twice: an interrupt inside the first leaves the second
            try:
                _enter_mode(mode)
                return fn(*args)
            finally:
                _leave_mode(mode)
        finally:
            _leave_mode(mode)

    def _unwrap(self) -> None:
        """Give every wrapped module its own ``forward`` attribute back (or none)."""
        for module, before in self._wrapped:
            current = module.__dict__.get("forward")
            if getattr(current, "__semiring_autograd_patch__", None) is not self:
                continue  # replaced since: theirs now, and ours passes calls through
            if before is _ABSENT:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = before
        self._wrapped.clear()

    def _check_outer_patches(self) -> None:
        """One graph takes one semiring: refuse to run inside the forward of a model patched
        with another (a model that is not its submodule, so the two patches coexist). Raised
        before the forward changes anything."""
        for other in _running():
            if other is not self and other.semiring != self.semiring:
                raise SemiringMismatchError(
                    f"{type(self.model).__name__}, patched with {self.semiring!r}, runs inside "
                    f"the forward of {type(other.model).__name__}, patched with "
                    f"{other.semiring!r}: one graph takes one semiring. Patch the outer model "
                    "only, or both with the same semiring."
                )

    def record_torch_graph(
        self, func: Any, args: tuple, kwargs: dict, op: OpSpec, bound: dict[str, Any]
    ) -> Any:
        """Run the call as it is, with grad on (``sa.Real()``): torch records its own nodes,
        and the output's is named. No recorded call: top paths need (Signed)MaxProduct."""
        # the nodes the op's edges lead to (only its differentiable inputs have edges), read
        # before the call: a view's node is (re)built on first read
        input_nodes = []
        for t in _tensors([bound[p] for p in op.differentiable]):
            node = t.grad_fn
            if node is not None:
                input_nodes.append(node)
        first = _next_sequence_nr()
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):  # most ops: one tensor, no flatten
            if out.requires_grad:
                for t in _tensors(bound.values()):
                    if out is t:  # handed back its input: its own node, as Functions make
                        out = out.view_as(out)
                        break
            node = out.grad_fn
        else:
            node = _output_node(out)
        if node is None or node._sequence_nr() < first:
            return out  # nothing recorded (a tensor handed back inside a tuple)
        stack = self._stack  # self.current_module, without the property's call
        module = stack[-1][0] if stack else type(self.model).__name__
        sequence_nrs = range(first, _next_sequence_nr())
        info = NodeInfo(op.name, module, self.semiring, None, sequence_nrs, tuple(input_nodes))
        node.metadata[NODE_INFO_KEY] = info  # what graph.node_info reads
        return out

    @property
    def mode(self) -> TorchFunctionMode:
        """The semiring mode the model's forward holds while it runs."""
        return self._mode

    @property
    def current_module(self) -> str:
        return self._stack[-1][0] if self._stack else type(self.model).__name__

    def parameter_name(self, tensor: torch.Tensor) -> str | None:
        """The qualified name of ``tensor`` as a parameter of the model: one the model held
        when patched, else one that a running module holds now (an offloading hook, such as
        accelerate's, puts freshly loaded parameters into its module for each forward),
        innermost module first; ``None`` for a tensor that is neither."""
        known = self._parameters.get(id(tensor))
        if known is not None:
            return known[1]
        for name, module in reversed(self._stack):
            for own, p in module._parameters.items():
                if p is tensor:
                    return own if module is self.model else f"{name}.{own}"
        return None

    def unsupported(self, func: Any, why: str) -> UnsupportedOpError:
        name = _name_of(func)
        return UnsupportedOpError(
            f"{name} (in module '{self.current_module}') touched a tensor that requires grad "
            f"under sa.patch(..., {self.semiring!r}), but {why}. Add an entry for it to "
            "derivatives/*.yaml (its signature, the torch functions it serves and one "
            "formula per differentiable input), run `generate`, or run this op outside the "
            "patched model / under torch.no_grad()."
        )

    def complex_refusal(self, func: Any) -> UnsupportedOpError:
        """The error for a complex tensor in the gradient graph under semiring formulas."""
        return UnsupportedOpError(
            f"{_name_of(func)} (in module '{self.current_module}') computes with complex "
            f"numbers on tensors that require grad under sa.patch(..., {self.semiring!r}). "
            "A complex element is two nodes of the gradient graph (its real and imaginary "
            "parts); under semiring formulas only view_as_complex of real pairs, its product "
            "by a tensor or number that requires no grad, and view_as_real take them "
            "(engine/complex_pairs.py). Write this part in real arithmetic (a rotary "
            "embedding as x·cos + rotate_half(x)·sin), or patch with sa.Real(), which "
            "records torch's own complex autograd."
        )

    # ----- lifetime
    def remove(self) -> None:
        """Restore the model: every module's own ``forward`` back, the patch forgotten. A
        forward running in this thread leaves the semiring mode now."""
        try:  # the undo runs twice: an interrupt inside the first leaves the second
            self._uninstall()
        finally:
            self._uninstall()

    @property
    def removed(self) -> bool:
        """Whether :meth:`remove` ran (the handle records nothing more)."""
        return self._removed

    def __enter__(self) -> "PatchHandle":
        if self._removed:
            raise PatchError(
                f"this patch of {type(self.model).__name__} was removed (a `with` block over "
                "it ended, or .remove() ran) and records nothing: patch again with "
                "sa.patch(model, semiring)"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        # remove()'s body, not a call to it: one function entry less between the `with`
        # and the first undo, where an interrupt would leave the patch whole
        try:
            self._uninstall()
        finally:
            self._uninstall()


def patch(
    model: nn.Module,
    semiring: Semiring,
    *,
    paths: bool = False,
    op_table: OpTable | None = None,
    check: bool = True,
) -> PatchHandle:
    """Record ``model``'s forward for a ``semiring`` backward (this thread only): each
    call runs as its generated Function, or under ``sa.Real()`` as it is (torch's graph).

    Use as ``with sa.patch(model, sa.MaxProduct()): y = model(x)`` or keep the handle and
    call ``handle.remove()``. The forward computes exactly what the unpatched model computes;
    the recorded graph propagates ``semiring`` messages in backward (see :func:`sa.grad`).
    Every op's backward node is named: :func:`sa.node_info` gives its op, module and
    semiring. With ``paths=True`` each node also keeps a record of its call (its inputs stay
    alive until the graph is freed), which :func:`sa.top_path` needs to name a path element
    by element.

    A user semiring (one not defined by this library) is checked once per class and
    parameters (an unhashable one once per instance and parameters) with :func:`sa.check_semiring` on a small sample; one that violates a law is
    refused with :class:`SemiringLawError` naming each law and a counterexample, the model
    untouched. ``check=False`` skips the check (a semiring that is exact only up to a
    tolerance the check does not allow, say).
    """
    model = module_of(model)
    if not isinstance(model, nn.Module):
        raise PatchError(f"sa.patch expects an nn.Module, got {type(model).__name__}")
    if isinstance(semiring, type) and issubclass(semiring, Semiring):
        raise PatchError(
            f"sa.patch got the class {semiring.__name__}; pass an instance: {semiring.__name__}()"
        )
    if not isinstance(semiring, Semiring):
        raise PatchError(
            f"sa.patch expects a semiring instance (e.g. sa.MaxProduct()), got {semiring!r}"
        )
    named = list(model.named_modules())  # walked once: the checks and the install read it
    compiled = [(name, m) for name, m in named if _is_compiled(m)]
    if compiled:
        name, module = compiled[0]
        where = "the model" if name == "" else f"submodule '{name}'"
        if getattr(module, "_compiled_call_impl", None) is not None:
            raise PatchError(
                f"{where} is a torch.compile'd module (compiled in place by `.compile()`): "
                "its compiled call bypasses the per-op routing sa.patch needs. Patch a "
                "module that was not compiled: call `.compile()` after the semiring work, "
                "or patch a copy made before it (`copy.deepcopy(model)`)."
            )
        raise PatchError(
            f"{where} is a torch.compile'd module (OptimizedModule): its compiled graph "
            "bypasses the per-op routing sa.patch needs. Patch the eager module instead "
            "(`compiled._orig_mod`); compile outside sa.patch."
        )
    if check:
        _check_laws(semiring)
    handle = PatchHandle(model, semiring, op_table or default_op_table(), paths)
    try:  # the undo runs twice: an interrupt inside the first leaves the second
        try:
            handle._install(named)
        except BaseException:
            handle._uninstall()
            raise
    except BaseException:
        handle._uninstall()
        raise
    return handle


#: samples of each law check of a user semiring (sa.check_semiring's minimum is 8)
_LAW_SAMPLES = 16
#: the refusal a law check gave: message and (law, counterexample) pairs; an empty message
#: when it passed
_Verdict = tuple[str, list[tuple[str, str]]]
#: user semiring → its verdict, the _LAWS_CHECKED_LIMIT most recently used
_LAWS_CHECKED: "OrderedDict[Semiring, _Verdict]" = OrderedDict()
_LAWS_CHECKED_LIMIT = 256
#: id of an unhashable user semiring (a parameter in a list, say) → a weak reference to it,
#: a copy of it as checked and its verdict; the entry goes with the semiring, and counts
#: while the semiring equals the copy
_LAWS_CHECKED_BY_ID: dict[int, tuple[weakref.ref, Semiring, _Verdict]] = {}


def _check_laws(semiring: Semiring) -> None:
    """Refuse a user semiring that violates a semiring law or the lift homomorphism (checked
    once per class and parameters, an unhashable one once per instance and parameters: the
    verdict is kept)."""
    if defined_by_library(semiring):
        return
    verdict = _remembered(semiring)
    if verdict is None:
        verdict = _law_verdict(semiring)
        _remember(semiring, verdict)
    message, failures = verdict
    if message:
        err = SemiringLawError(message)
        err.failures = list(failures)  # type: ignore[attr-defined]
        raise err


def _remembered(semiring: Semiring) -> _Verdict | None:
    """The verdict kept for ``semiring``, or None."""
    try:
        verdict = _LAWS_CHECKED.get(semiring)
    except TypeError:  # an unhashable parameter: kept by identity
        entry = _LAWS_CHECKED_BY_ID.get(id(semiring))
        if entry is None or entry[0]() is not semiring:
            return None
        try:
            same = bool(semiring == entry[1])
        except Exception:  # parameters that do not compare (tensors): checked again
            same = False
        return entry[2] if same else None
    if verdict is not None:
        try:
            _LAWS_CHECKED.move_to_end(semiring)
        except KeyError:  # dropped by another thread meanwhile
            pass
    return verdict


def _remember(semiring: Semiring, verdict: _Verdict) -> None:
    """Keep ``verdict`` for ``semiring``: by value, or by identity where it is unhashable
    (not at all where its class takes no weak references or it cannot be copied)."""
    try:
        _LAWS_CHECKED[semiring] = verdict
    except TypeError:
        key = id(semiring)
        try:
            ref = weakref.ref(semiring, functools.partial(_forget_verdict, key))
            copied = copy.deepcopy(semiring)
        except Exception:
            return
        _LAWS_CHECKED_BY_ID[key] = (ref, copied, verdict)
        return
    while len(_LAWS_CHECKED) > _LAWS_CHECKED_LIMIT:
        try:
            _LAWS_CHECKED.popitem(last=False)
        except KeyError:  # emptied by another thread meanwhile
            break


def _forget_verdict(key: int, ref: weakref.ref) -> None:
    """Drop the verdict kept under ``key`` for the semiring ``ref`` referred to."""
    entry = _LAWS_CHECKED_BY_ID.get(key)
    if entry is not None and entry[0] is ref:
        _LAWS_CHECKED_BY_ID.pop(key, None)


def _law_verdict(semiring: Semiring) -> _Verdict:
    """Why :func:`sa.check_semiring` refuses ``semiring``, with its failures ("" and none
    when it passes)."""
    try:
        check_semiring(semiring, samples=_LAW_SAMPLES)
    except SemiringLawError as exc:
        message = (
            f"sa.patch refuses {semiring!r}: the semiring backward is exact only when ⊕ and "
            f"⊗ obey the semiring laws and lift is a homomorphism, and {exc}\nFix the "
            "semiring (sa.check_semiring(semiring) runs these checks), or, if it is right "
            "up to a tolerance the check does not allow, patch with "
            "sa.patch(model, semiring, check=False)."
        )
        return message, list(getattr(exc, "failures", []))
    return "", []
