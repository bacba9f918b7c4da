"""In-place writes under a patch: each runs as its out-of-place op, under that op's formula,
on a copy of the target, and the result is written into the target as torch writes it.

``x.add_(y)``, ``x += y`` … run as ``x.add(y)``; ``x[index] = v`` runs as
``x.index_put(indices, v)`` with ``indices`` the per-dim coordinates of the elements
``x[index]`` reads (any basic, advanced or boolean index). The copy and the write-back are
identity edges (torch's ``CloneBackward0`` and ``CopyBackwards`` nodes).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ..ops.tensor_helpers import element_positions

#: augmented assignments and the tensor methods they run out of place
_AUGMENTED = {"__iadd__": "add", "__isub__": "sub", "__imul__": "mul", "__itruediv__": "div"}

Route = Callable[..., Any]
"""Calls a torch function as the patched model's code would (under its YAML entry)."""


def is_inplace(func: Any, kwargs: dict) -> bool:
    """Whether ``func`` writes into a tensor: an ``out=`` call, ``x[i] = v``, an augmented
    assignment or a trailing-underscore method."""
    name = getattr(func, "__name__", "")
    if kwargs.get("out") is not None:
        return True
    if name in ("__setitem__",) or (name.startswith("__i") and name.endswith("__")):
        return name not in ("__init__", "__iter__", "__index__", "__int__")
    return name.endswith("_") and not name.endswith("__")


def out_of_place(func: Any, kwargs: dict) -> Any:
    """The out-of-place torch function an in-place call runs as (``x.add_`` → ``x.add``,
    ``x += y`` → ``x.add``, ``x[i] = v`` → ``x.index_put``), or None."""
    name = getattr(func, "__name__", "")
    if kwargs.get("out") is not None:
        return None
    if func is torch.Tensor.__setitem__:
        return torch.Tensor.index_put
    base = _AUGMENTED.get(name) or (
        name[:-1] if name.endswith("_") and not name.endswith("__") else None
    )
    if base is None or getattr(torch.Tensor, name, None) is not func:
        return None
    return getattr(torch.Tensor, base, None)


def write(func: Any, args: tuple, kwargs: dict, route: Route) -> Any:
    """Run the in-place call ``func(*args, **kwargs)`` out of place through ``route`` on a
    copy of its target, write the result into the target and return what ``func`` returns."""
    target = args[0]
    if func is torch.Tensor.__setitem__:
        _, index, value = args
        indices, value = _as_index_put(target, index, value, route)
        target.copy_(route(torch.Tensor.index_put, target.clone(), indices, value))
        return None
    return target.copy_(route(out_of_place(func, kwargs), target.clone(), *args[1:], **kwargs))


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
