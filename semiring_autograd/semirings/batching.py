"""Tensors batched by ``torch.vmap`` (``sa.grad(..., is_grads_batched=True)`` runs the
semiring backward once under vmap): a branch on the values of such a tensor cannot be
taken, so the rules take the path that holds for every row (computing all rows or
columns, keeping every k-best index, running the torch formulas instead of the kernels)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import Tensor

_is_batched = torch._C._functorch.is_batchedtensor


def batched(*tensors: Tensor) -> bool:
    """Whether any of ``tensors`` is batched by ``torch.vmap`` (a loop, not a generator: the
    kernels' callers ask on every call)."""
    for t in tensors:
        if _is_batched(t):
            return True
    return False


_layer: list = []  # the torch.vmap layer of the batched backward running, with its depth


@contextlib.contextmanager
def vmap_layer() -> Iterator[None]:
    """Inside a ``torch.vmap``-ed function: keep its layer for :func:`dispatch`."""
    functorch = torch._C._functorch
    layer = functorch.pop_dynamic_layer_stack()
    functorch.push_dynamic_layer_stack(layer)
    keys = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    _layer.append((layer, functorch.get_dynamic_layer_stack_depth(), keys))
    try:
        yield
    finally:
        _layer.pop()


def dispatch(handler: Callable, func, args: tuple, kwargs: dict):
    """``handler(func, *args, **kwargs)`` for a message's ``__torch_dispatch__``. torch
    dispatches a wrapper subclass below vmap's layer, which it pops first; the components
    of a message in a batched backward are batched by that layer, so it is pushed back,
    with the dispatch keys of the vmapped function, while the handler computes on them."""
    if not _layer:
        return handler(func, *args, **kwargs)
    functorch = torch._C._functorch
    layer, depth, keys = _layer[-1]
    if functorch.get_dynamic_layer_stack_depth() >= depth:
        return handler(func, *args, **kwargs)
    functorch.push_dynamic_layer_stack(layer)
    try:
        with torch._C._ForceDispatchKeyGuard(*keys):
            return handler(func, *args, **kwargs)
    finally:
        functorch.pop_dynamic_layer_stack()


def anywhere(t: Tensor) -> bool:
    """``bool(t.any())``, over all rows where ``torch.vmap`` batches ``t``: a branch needed
    by some row is then taken for every row."""
    while torch._C._functorch.is_batchedtensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return bool(t.any())


def across_rows(t: Tensor) -> Tensor:
    """A boolean ``t`` batched by ``torch.vmap`` as the unbatched tensor true where some row
    is (e.g. the rows of a message with a path in some seed row)."""
    while torch._C._functorch.is_batchedtensor(t):
        dim = torch._C._functorch.maybe_get_bdim(t)
        t = torch._C._functorch.get_unwrapped(t).any(dim)
    return t
