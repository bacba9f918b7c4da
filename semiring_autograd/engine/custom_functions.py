"""Custom ``torch.autograd.Function``\\ s inside a patched model run as the ops of their forward.

A custom Function's backward is Python code on real gradients, not a semiring formula (BLOOM's
``GeLUFunction``, memory-saving activations). While a patched model's forward runs in this
thread, ``Function.apply`` of such a Function calls its ``forward`` with grad enabled, so the
semiring mode records the ops it runs and the semiring backward differentiates them; the
Function's own backward is not used (a warning names each such Function once). Under
``sa.Real()``, which records torch's own graph, and outside a running patch, ``apply`` is
torch's. The hook is installed while any patched forward runs: each running forward's patch
is an owner (and on :func:`running` of its thread), and ``Function.apply`` is ours exactly
while the set of owners is not empty. Install and uninstall are idempotent per owner, so an
interrupt landing inside either leaves a state that one more :func:`uninstall` makes
exactly torch's.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
from torch.autograd.function import _is_setup_context_defined
from torch.overrides import _get_current_function_mode_stack
from torch.utils._pytree import tree_flatten, tree_map

_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
#: the running patched forwards that need ``Function.apply`` routed through :func:`_apply`
_owners: set[object] = set()
_warned: set[type] = set()
_THREAD = threading.local()


def running() -> list[Any]:
    """This thread's patches whose model's forward is running, innermost last (kept by the
    patch: each has ``torch_graph``, whether torch records its own graph, and ``mode``, its
    semiring mode)."""
    stack = getattr(_THREAD, "running", None)
    if stack is None:
        stack = _THREAD.running = []
    return stack


def _should_trace(cls: type) -> bool:
    """Whether ``Function.apply`` of ``cls`` runs as the ops of its forward now: called by
    the model's code (the semiring mode on the stack: the generated Functions are applied
    from the mode's handler, where it is off) in a patched forward of this thread that
    records semiring formulas, for a Function that is not torch's."""
    stack = getattr(_THREAD, "running", None)
    if not stack or stack[-1].torch_graph:
        return False
    if stack[-1].mode not in _get_current_function_mode_stack():
        return False
    return not (getattr(cls, "__module__", "") or "").startswith("torch.")


class _ForwardContext:
    """The ``ctx`` a Function's forward receives when it runs as plain ops: what it saves
    is kept for nobody; outputs it marks non-differentiable are detached."""

    def __init__(self, args: tuple) -> None:
        self.needs_input_grad = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        self.saved_tensors: tuple = ()
        self.non_differentiable: set[int] = set()

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors: Any) -> None:
        pass

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        self.non_differentiable.update(id(t) for t in tensors)

    def mark_dirty(self, *tensors: torch.Tensor) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _traced_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """Run ``cls.forward`` as ops (see the module docstring)."""
    if cls not in _warned:
        _warned.add(cls)
        warnings.warn(
            f"sa.patch: the custom autograd.Function {cls.__qualname__} runs as the ops of its "
            "forward, each under its semiring formula; its own backward is not used",
            stacklevel=3,
        )
    ctx = _ForwardContext(args)
    if _is_setup_context_defined(cls.setup_context):
        out = cls.forward(*args, **kwargs)
    else:
        out = cls.forward(ctx, *args, **kwargs)
    if ctx.non_differentiable:
        out = tree_map(lambda t: t.detach() if id(t) in ctx.non_differentiable else t, out)
    return out


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    if torch.is_grad_enabled() and _should_trace(cls):
        leaves, _ = tree_flatten((args, kwargs))
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
            return _traced_apply(cls, *args, **kwargs)
    return _ORIGINAL_APPLY.__func__(cls, *args, **kwargs)


_TRACING_APPLY = classmethod(_apply)


def _publish() -> None:
    """Make ``Function.apply`` ours while there are owners, torch's otherwise; an ``apply``
    someone else set is left alone. Lock-free (each read and the class attribute assignment
    are atomic): a writer reads again after writing, so concurrent calls settle on the
    state the final set of owners asks for."""
    while True:
        want = _TRACING_APPLY if _owners else _ORIGINAL_APPLY
        current = torch.autograd.Function.__dict__["apply"]
        if current is want or current not in (_TRACING_APPLY, _ORIGINAL_APPLY):
            return
        torch.autograd.Function.apply = want


def install(owner: object) -> None:
    """Route ``Function.apply`` through :func:`_apply` while ``owner`` runs (idempotent per
    owner)."""
    _owners.add(owner)
    _publish()


def uninstall(owner: object) -> None:
    """``owner`` no longer needs the route; torch's ``apply`` is back once no owner does
    (idempotent: any number of calls, also after a partial :func:`install`)."""
    _owners.discard(owner)
    _publish()
