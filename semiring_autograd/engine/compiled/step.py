"""``sa.compiled_step``: a model's patched forward and its semiring backward as one program.

``sa.grad(..., compile=True)`` replays the backward, but the patched forward still runs one
Python ``autograd.Function`` per op. A step captures both: its first call for a signature
runs ``with sa.patch(model, semiring): out = read(model, *inputs)`` and ``sa.grad(out,
inputs)`` under the recorder of ``backward.py`` (``program.py``); later calls with the same
signature run the recorded operators, forward and backward, from the new inputs, with no
patch, no graph and no engine. Guards, variants, the check of a program's first replay
against eager and the refusals are ``backward.py``'s.

**What keys a program** (the signature; anything else differing, the call is captured
anew):

- the step: a number no other step gets (never an ``id()``, which a freed step's successor
  may take), its ``has_aux`` and its semiring;
- ``read``: its identity; for a Python function also its code, defaults, closure cells'
  contents and the module globals its code names; for a ``functools.partial`` its function,
  arguments and keywords; for a bound method its function and object. A read that changes
  what it computes (a closure's ``target = 5``, a global reassigned) gets its own program;
  a new read object, even with the same code, gets its own program too;
- the inputs and the keyword arguments: tensors by shape, strides, storage offset, dtype and
  device (their values are the program's inputs), anything else by value;
- the model, module by module: the module's identity (a submodule replaced, even one
  without parameters), ``training``, its forward and backward (pre-)hooks, its own
  attributes (a dropout's ``p``, a slope, an instance ``forward``; an object holding
  settings, as a Hugging Face config, by identity and the numbers, strings and flags in its
  ``__dict__``: ``output_attentions``, ``_attn_implementation``; the ``forward`` wrapper
  of a patch another thread holds as what it wraps), and its parameters and buffers
  (identity, shape, strides, storage offset, dtype, device, ``requires_grad``);
  and the hooks registered for every module (``register_module_forward_hook`` ...);
- torch's state: grad and inference mode, the default dtype, deterministic algorithms,
  autocast (per device type, its dtype and cache) and the active torch function and
  dispatch modes (by type; the default device with its device).

Immutable values (numbers, strings, dtypes, tuples of them) are keyed by value, any other
object by identity, held with the key so no other object takes its id. Keyed by identity,
not by content: the items of a list or dict, the attributes of an object that ``read``
reads, a settings object's lists, dicts and nested objects — changing those in place is
not seen; neither is state read through functions ``read`` calls, nor a module class's
code changed at run time (a ``forward`` replaced on the class). Pass such values as
keyword arguments or rebuild the step.

The program reads the model's parameters and buffers as they are when it runs (it holds
the tensors, not copies): a weight changed in place is seen. State the forward keeps
outside its tensors' values (a module attribute set during the forward, a cache carried
from one call to the next, what a hook stores) is not replayed.

**Threads.** A step may be called from several threads at once: the runs that patch the
model (a capture, the check of a first replay, an eager call) take turns per model, since
a model is patched by one thread at a time; replays run side by side.
"""

from __future__ import annotations

import functools
import itertools
import threading
import types
import weakref
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_hooks

from ...errors import SemiringAutogradError
from ...semirings.base import Semiring
from ..grad import grad, readouts
from ..patch import patch
from . import backward
from .signature import IMMUTABLE, Identities, ProgramKey, Signature, Uncapturable, context

_GENERATIONS = itertools.count()


class CompiledStep:
    """``step(*inputs, **kwargs)`` = the readouts of ``sa.grad(out, inputs)`` where
    ``out = read(model, *inputs, **kwargs)`` ran under ``sa.patch(model, semiring)`` (with
    ``has_aux``, ``read`` returns ``(out, aux)`` and the step ``(readouts, aux)``)."""

    def __init__(
        self,
        model: nn.Module,
        semiring: Semiring,
        read: Callable[..., Any],
        raw: bool,
        has_aux: bool = False,
    ) -> None:
        self.model = model
        self.semiring = semiring
        self.read = read
        self.raw = raw
        self.has_aux = has_aux
        self.single_aux: bool | None = None  # aux a tensor (True) or a tuple, once read ran
        #: this step's programs are its own: a number no other step gets, unlike an id()
        self.generation = next(_GENERATIONS)

    def __call__(self, *inputs: Tensor, **kwargs: Any) -> Tensor | tuple:
        if not inputs:
            raise ValueError("a compiled step takes the tensors to differentiate w.r.t.")
        for i, x in enumerate(inputs):
            if not isinstance(x, Tensor) or not x.requires_grad:
                raise ValueError(
                    f"compiled step: input {i} is not a tensor that requires grad; pass the "
                    "tensors to differentiate w.r.t. positionally (x.requires_grad_()) and "
                    "anything else as keyword arguments"
                )
        ins = list(inputs)

        def eager(retain: bool) -> tuple:
            with _running_eagerly(self.model), patch(self.model, self.semiring):
                out = self.read(self.model, *ins, **kwargs)
            aux: tuple[Tensor, ...] = ()
            if self.has_aux:
                out, aux, single = _split_aux(out)
                if self.single_aux not in (None, single):
                    raise ValueError(
                        "compiled step: read returned aux as a tensor on one call and as a "
                        "tuple on another; return the same structure every time"
                    )
                self.single_aux = single
            return (*grad(out, ins, raw=True), *(a.detach() for a in aux))

        results = self._run(ins, kwargs, eager)
        final = readouts(self.semiring, ins, results[: len(ins)], self.raw)
        found = final[0] if len(ins) == 1 else final
        if not self.has_aux:
            return found
        aux = tuple(results[len(ins) :])
        return found, (aux[0] if self.single_aux else aux)

    def _run(self, ins: list[Tensor], kwargs: dict, eager: Callable[[bool], tuple]) -> Any:
        sig = Signature()  # its slots: the inputs, then the tensors among kwargs
        ids = Identities()
        try:
            inputs = tuple(sig.tensor(x) for x in ins)
            extra = sig.describe(kwargs)
            model, held = _model_state(self.model, ids)
        except Uncapturable as exc:
            backward.refuse(str(exc))
            return eager(False)
        parts = (
            "step",
            self.generation,
            ids.callable(self.read),
            self.has_aux,
            self.semiring,
            inputs,
            extra,
            model,
            _global_module_hooks(ids),
            context(),
        )
        programs = backward.programs_for(ProgramKey(parts, ids.held))
        if programs is None:
            return eager(False)
        parameters = frozenset(id(t) for t in held)
        return programs.call(sig.slots, eager, False, parameters)


#: per model, a lock held while a step runs its forward patched (a capture, the check of a
#: first replay, an eager call): a model is patched by one thread at a time
_EAGER_LOCKS: "weakref.WeakKeyDictionary[nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
_EAGER_LOCKS_LOCK = threading.Lock()


def _running_eagerly(model: nn.Module) -> threading.RLock:
    """The lock that serialises the steps' eager runs on ``model`` across threads."""
    with _EAGER_LOCKS_LOCK:
        lock = _EAGER_LOCKS.get(model)
        if lock is None:
            lock = _EAGER_LOCKS[model] = threading.RLock()
    return lock


def _split_aux(result: Any) -> tuple[Tensor, tuple[Tensor, ...], bool]:
    """``read``'s ``(out, aux)`` with ``has_aux``: out, aux's tensors, and whether aux is
    one tensor (else a tuple of tensors)."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ValueError(
            "compiled step with has_aux=True: read must return (out, aux), got "
            f"{type(result).__name__}"
        )
    out, aux = result
    parts = aux if isinstance(aux, tuple) else (aux,)
    if not all(isinstance(a, Tensor) for a in parts):
        raise ValueError(
            "compiled step with has_aux=True: aux must be a tensor or a tuple of tensors, "
            f"got {type(aux).__name__}"
        )
    return out, parts, isinstance(aux, Tensor)


#: a module's dicts of hooks (each keyed by its handle's id, never reused; a hook's
#: ``with_kwargs`` and ``always_called`` flags are set with its id)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
#: the entries of every module's ``__dict__`` (parameters, buffers, submodules, hooks, the
#: state dict's hooks, ``training``), read one by one; the others are the module's own
_STANDARD = frozenset(nn.Module().__dict__)
#: the attribute a ``forward`` wrapper of ``sa.patch`` carries (its handle)
_PATCH = "__semiring_autograd_patch__"
#: an attribute the module lacks (removed since its name was read; a ``forward`` the
#: module has only while patched)
_ABSENT = object()
#: the immutable values ``Identities.value`` keys as they are (a float is keyed by its bits)
_BY_VALUE = IMMUTABLE - {float}


def _model_state(model: nn.Module, ids: Identities) -> tuple[tuple, list[Tensor]]:
    """What the forward of ``model`` reads from Python, and its parameters and buffers:
    per module (each once, in a fixed order for a fixed module tree; its own ``__dict__``
    read directly, which costs several times less than ``named_parameters()``), its
    identity and ``training``, its hooks, its own attributes (a dropout's ``p``, an
    instance ``forward``: immutable values by value, a settings object (a config) by
    identity and its immutable values, other objects by identity; a ``forward`` wrapper of
    ``sa.patch``, which another thread's capture or eager run may have installed, as what
    it wraps), and its parameters and buffers (identity, shape, strides, storage offset,
    dtype, device, requires_grad)."""
    parts: list = []
    held: list[Tensor] = []
    seen: set[int] = set()
    described: set[int] = set()  # settings objects read (a config every layer holds)
    stack = [model]
    with torch._C.DisableTorchFunctionSubclass():  # a Parameter's metadata read directly
        while stack:
            module = stack.pop()
            if module is None or id(module) in seen:
                continue
            seen.add(id(module))
            found = module.__dict__
            parts.append((ids.of(module), module.training, _hooks(found, ids)))
            # the names read at once (one set difference, while another thread's patch may
            # add or remove a forward), in an order the dict's fixes; each value by name
            for name in found.keys() - _STANDARD:
                value = found.get(name, _ABSENT)
                kind = type(value)
                if kind in _BY_VALUE:  # ids.value's key, without the call
                    parts.append((name, value))
                    continue
                if kind is not float:
                    if value is _ABSENT:
                        continue
                    if id(value) in described:  # a config every layer holds, seen above
                        parts.append((name, ("settings", id(value))))
                        continue
                    if isinstance(value, types.FunctionType) and hasattr(value, _PATCH):
                        value = _unpatched(value, module)
                        if value is _ABSENT:
                            continue
                    elif _is_settings(value):
                        parts.append((name, _settings(value, ids, described)))
                        continue
                parts.append((name, ids.value(value)))
            for group in (module._parameters, module._buffers):
                for name, t in group.items():
                    if t is not None:
                        held.append(t)
                        parts.append((name, ids.of(t), *_tensor_layout(t)))
            stack.extend(module._modules.values())  # None (a removed submodule) skipped
    return tuple(parts), held


def _unpatched(wrapper: Any, module: nn.Module) -> Any:
    """The ``forward`` attribute ``module`` has without the patch whose ``wrapper`` it
    holds: the instance ``forward`` the wrapper wraps, or ``_ABSENT`` where it wraps the
    class's ``forward`` (a bound method made when the patch was installed)."""
    while hasattr(wrapper, _PATCH):
        wrapper = getattr(wrapper, "__wrapped__", _ABSENT)
    if (
        isinstance(wrapper, types.MethodType)
        and wrapper.__self__ is module
        and wrapper.__func__ is getattr(type(module), "forward", None)
    ):
        return _ABSENT
    return wrapper


def _is_settings(value: Any) -> bool:
    """Whether a module's attribute is an object holding settings in its ``__dict__`` (a
    Hugging Face config): not a module, tensor, function, class or Python module."""
    return hasattr(value, "__dict__") and not isinstance(value, _NOT_SETTINGS)


_NOT_SETTINGS = (
    nn.Module,
    Tensor,
    type,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
    functools.partial,
)


def _settings(value: Any, ids: Identities, described: set[int]) -> tuple:
    """An object's identity and the immutable values in its ``__dict__`` (a config's
    ``output_attentions``, ``_attn_implementation``); an object already ``described`` in
    this key (a config every layer holds) by its identity alone."""
    if id(value) in described:
        return ("settings", id(value))
    described.add(id(value))
    plain = [(k, ids.value(v)) for k, v in vars(value).items() if type(v) in IMMUTABLE]
    return ("settings", ids.of(value), tuple(plain))


def _hooks(found: dict, ids: Identities) -> tuple:
    """The hooks in a module's ``__dict__`` (``found``): each dict's handle ids and hooks."""
    get = found.get  # (a module with no hook, the common case, read in one expression)
    if not (
        get("_forward_hooks")
        or get("_forward_pre_hooks")
        or get("_backward_hooks")
        or get("_backward_pre_hooks")
    ):
        return ()
    hooks = [get(name) or {} for name in _HOOKS]
    keyed = tuple([tuple([(k, ids.of(h)) for k, h in d.items()]) for d in hooks])
    return keyed + (found.get("_is_full_backward_hook"),)


def _tensor_layout(t: Tensor) -> tuple:
    return (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)


def _global_module_hooks(ids: Identities) -> tuple:
    """The hooks registered for every module (``register_module_forward_hook`` …)."""
    found: list = [ids.value(module_hooks._global_is_full_backward_hook)]
    for name in _GLOBAL_HOOKS:
        hooks = getattr(module_hooks, name)
        if hooks:
            found.append((name, tuple([(k, ids.of(h)) for k, h in hooks.items()])))
    return tuple(found)


_GLOBAL_HOOKS = tuple(f"_global{name}" for name in _HOOKS)


def compiled_step(
    model: nn.Module,
    semiring: Semiring,
    read: Callable[..., Any],
    *,
    raw: bool = False,
    has_aux: bool = False,
) -> CompiledStep:
    """A function ``step(*inputs, **kwargs)`` giving, per input, the readout of the semiring
    backward from ``read(model, *inputs, **kwargs)`` (the model's forward under
    ``sa.patch(model, semiring)`` and what is read from it) — ``sa.grad``'s result, or with
    ``raw=True`` the messages — as one program captured per signature: see the module
    docstring. Inputs are tensors that require grad; tensors among the keyword arguments
    (an attention mask) are inputs of the program too. With ``has_aux=True`` (as in
    ``torch.func.grad``), ``read`` returns ``(out, aux)``, aux a tensor or a tuple of
    tensors of the forward (the logits a prediction is read from), and the step returns
    ``(readouts, aux)`` with aux detached, replayed with the rest."""
    if not isinstance(model, nn.Module):
        raise SemiringAutogradError(f"compiled_step takes an nn.Module, got {type(model)}")
    if not isinstance(semiring, Semiring):
        raise SemiringAutogradError(
            f"compiled_step takes a semiring instance (e.g. sa.MaxProduct()), got {semiring!r}"
        )
    return CompiledStep(model, semiring, read, raw, has_aux)
