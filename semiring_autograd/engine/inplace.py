"""In-place writes under a patch: each runs as its out-of-place op, under that op's formula,
on a copy of the target, and the result is written into the target as torch writes it.

``x.add_(y)``, ``x += y`` … run as ``x.add(y)``; ``x[index] = v`` runs as
``x.index_put(indices, v)`` with ``indices`` the per-dim coordinates of the elements
``x[index]`` reads (any basic, advanced or boolean index); a functional op's
``inplace=True`` flag (``F.relu(x, inplace=True)``, ``nn.Dropout(inplace=True)``) runs the
op with ``inplace=False``; an in-place functional form (``F.relu_(x)``, ``F.elu_(x)``,
``torch.dropout_(x, p, train)``) runs as its functional op with ``inplace=False``. The copy
and the write-back are identity edges (torch's ``CloneBackward0`` and ``CopyBackwards``
nodes); what the call returns is the target, as torch returns it. ``copy_``, ``fill_`` and
``zero_`` run as they are: torch's own backward of each only moves messages or fills them
with zero. A target that is a view of a patched op's output is written through torch's own
view+inplace handling (:func:`release_views`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops.tensor_helpers import element_positions

_autograd = torch._C._autograd
_CreationMeta = _autograd.CreationMeta

#: augmented assignments and the tensor methods they run out of place
_AUGMENTED = {"__iadd__": "add", "__isub__": "sub", "__imul__": "mul", "__itruediv__": "div"}

#: in-place functional forms → the functional op each runs as (with ``inplace=False``); their
#: positional arguments are the functional op's, up to its ``inplace`` parameter
_FUNCTIONAL_FORMS: dict[Any, Any] = {
    torch.relu_: F.relu,
    torch.selu_: F.selu,
    torch.celu_: F.celu,
    torch.rrelu_: F.rrelu,
    torch.threshold_: F.threshold,
    torch.dropout_: F.dropout,
    torch.alpha_dropout_: F.alpha_dropout,
    torch.feature_alpha_dropout_: F.feature_alpha_dropout,
    torch._C._nn.elu_: F.elu,
    torch._C._nn.hardtanh_: F.hardtanh,
    torch._C._nn.leaky_relu_: F.leaky_relu,
    torch._C._nn.relu6_: F.relu6,
    torch._C._nn.hardswish_: F.hardswish,
    torch._C._nn.hardsigmoid_: F.hardsigmoid,
    torch._C._nn.silu_: F.silu,
    torch._C._nn.mish_: F.mish,
}
#: in-place methods whose own backward only moves messages or fills them with zero (torch's
#: ``CopyBackwards``: zero for the overwritten target, the message for the source, summed over
#: a broadcast; ``fill_``/``zero_``: zero for the target, a tensor value the ⊕ of the
#: messages): torch runs them and records its own nodes, whose aten ops messages take
NATIVE_WRITES = frozenset(
    {torch.Tensor.copy_, torch.Tensor.fill_, torch.Tensor.zero_, torch.fill_, torch.zero_}
)
#: keyword names of the in-place forms that their functional ops spell otherwise
_RENAMED = {"self": "input", "train": "training"}
#: functional ops whose YAML entries take ``inplace=True`` themselves and compute out of
#: place (dropout: its training mask is drawn as torch's in-place dropout draws it); the
#: flag stays on when they run on the copy
_FLAG_KEPT = frozenset({F.dropout})

Route = Callable[..., Any]
"""Calls a torch function as the patched model's code would (under its YAML entry)."""


def flagged(kwargs: dict) -> bool:
    """Whether the call carries a functional op's ``inplace=True`` flag (torch's functional
    ops pass it to ``__torch_function__`` as a keyword)."""
    return bool(kwargs.get("inplace", False))


def is_inplace(func: Any, kwargs: dict) -> bool:
    """Whether ``func`` writes into a tensor: an ``out=`` call, an ``inplace=True`` flag,
    ``x[i] = v``, an augmented assignment or a trailing-underscore method or function."""
    name = getattr(func, "__name__", "")
    if kwargs.get("out") is not None or flagged(kwargs):
        return True
    if name in ("__setitem__",) or (name.startswith("__i") and name.endswith("__")):
        return name not in ("__init__", "__iter__", "__index__", "__int__")
    return name.endswith("_") and not name.endswith("__")


def out_of_place(func: Any, kwargs: dict) -> Any:
    """The out-of-place torch function an in-place call runs as (``x.add_`` → ``x.add``,
    ``x += y`` → ``x.add``, ``x[i] = v`` → ``x.index_put``, ``F.relu(x, inplace=True)`` →
    ``F.relu``), or None (an in-place functional form: :func:`out_of_place_call`)."""
    name = getattr(func, "__name__", "")
    if kwargs.get("out") is not None:
        return None
    if flagged(kwargs):
        return func
    if func is torch.Tensor.__setitem__:
        return torch.Tensor.index_put
    base = _AUGMENTED.get(name) or (
        name[:-1] if name.endswith("_") and not name.endswith("__") else None
    )
    if base is None or getattr(torch.Tensor, name, None) is not func:
        return None
    return getattr(torch.Tensor, base, None)


def out_of_place_call(func: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict] | None:
    """The out-of-place call ``(function, args, kwargs)`` an ``inplace=True`` call or an
    in-place functional form runs as, its target first (``args[0]``); None for other calls
    and for a form called with arguments its functional op does not take."""
    if flagged(kwargs):
        counterpart = func
    else:
        counterpart = functional_form(func)
        if counterpart is None:
            return None
        kwargs = {_RENAMED.get(k, k): v for k, v in kwargs.items()}
        if "input" in kwargs and not args:
            args = (kwargs.pop("input"),)
        if len(args) > _positional_limit(counterpart) or "inplace" in kwargs:
            return None
    if not args or not isinstance(args[0], Tensor):
        return None
    return counterpart, args, {**kwargs, "inplace": counterpart in _FLAG_KEPT}


def write(func: Any, args: tuple, kwargs: dict, route: Route) -> Any:
    """Run the in-place call ``func(*args, **kwargs)`` out of place through ``route`` on a
    copy of its target, write the result into the target and return what ``func`` returns."""
    call = out_of_place_call(func, args, kwargs)
    if call is not None:
        counterpart, args, kwargs = call
        target = args[0]
        return target.copy_(route(counterpart, target.clone(), *args[1:], **kwargs))
    target = args[0]
    if func is torch.Tensor.__setitem__:
        _, index, value = args
        indices, value = _as_index_put(target, index, value, route)
        target.copy_(route(torch.Tensor.index_put, target.clone(), indices, value))
        return None
    return target.copy_(route(out_of_place(func, kwargs), target.clone(), *args[1:], **kwargs))


def functional_form(func: Any) -> Any:
    """The functional op the in-place functional form ``func`` runs as, or None."""
    try:
        return _FUNCTIONAL_FORMS.get(func)
    except TypeError:  # an unhashable callable
        return None


def _positional_limit(functional: Any) -> int:
    """How many positional arguments ``functional`` takes before its ``inplace``."""
    names = functional.__code__.co_varnames[: functional.__code__.co_argcount]
    return names.index("inplace") if "inplace" in names else len(names)


def release_views(out: Any, inputs: list[Tensor], multi_output: bool) -> None:
    """Give each output of a generated Function that is a view of one of its ``inputs`` (a
    slice, a reshape, a transpose, a split part …) the view+inplace handling torch gives the
    output of its own op.

    torch marks a custom Function's view outputs so that an in-place write into one (or
    into its base) is refused: its rewrite of the view's history would replace the
    Function's backward. A patched op whose output aliases its input has identity edges
    (each output element is the input element at its memory location), so the rewrite
    keeps the view's edges: written into, torch records ``CopySlices`` on the base (the
    written elements read the new value, the others keep their edges) and the view's
    backward becomes ``AsStridedBackward0`` of the base, both run on messages
    (ops/message.py). The views of a ``multi_output`` op (``split``, ``unbind``, ``chunk``)
    take no write, as torch's own do not."""
    if isinstance(out, Tensor):
        outputs: Any = (out,)
    elif type(out) in (tuple, list):
        outputs = out
    else:
        return
    meta = _CreationMeta.MULTI_OUTPUT_NODE if multi_output else _CreationMeta.DEFAULT
    for t in outputs:
        if not isinstance(t, Tensor) or not t.requires_grad or not t._is_view():
            continue
        base = t._base
        if not any(base is i or base is i._base for i in inputs):
            continue
        if _autograd._get_creation_meta(t) == _CreationMeta.IN_CUSTOM_FUNCTION:
            _autograd._set_creation_meta(t, meta)


def is_native_write(func: Any) -> bool:
    """Whether ``func`` is one of :data:`NATIVE_WRITES`."""
    try:
        return func in NATIVE_WRITES
    except TypeError:  # an unhashable callable
        return False


def is_view_write_refusal(exc: RuntimeError) -> bool:
    """Whether torch refused an in-place write because its target is a view returned by a
    custom Function (a generated one: the output of a patched view op)."""
    return "is a view and is being modified inplace" in str(exc) and "custom Function" in str(exc)


def _as_index_put(
    target: Tensor, index: Any, value: Any, route: Route
) -> tuple[tuple[Tensor, ...], Tensor]:
    """``target[index] = value`` as ``target.index_put(indices, value)``: the coordinates of
    the elements ``target[index]`` reads, one index tensor per dim, and the value as
    ``__setitem__`` writes it (in the target's dtype; a Python number as a constant;
    leading dims of size 1 beyond the indexed shape dropped)."""
    read = element_positions(target.shape, target.device)[index]
    indices = tuple(torch.unravel_index(read, target.shape))
    if not isinstance(value, Tensor):
        value = torch.tensor(value, dtype=target.dtype, device=target.device)
    if value.dtype != target.dtype:
        value = route(torch.Tensor.to, value, target.dtype)
    extra = value.dim() - read.dim()
    if extra > 0:
        if any(n != 1 for n in value.shape[:extra]):
            raise RuntimeError(
                f"x[index] = v: v of shape {tuple(value.shape)} cannot be broadcast to the "
                f"indexed shape {tuple(read.shape)}"
            )
        value = route(torch.Tensor.reshape, value, value.shape[extra:])
    return indices, value
