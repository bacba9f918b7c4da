"""The record of a capture: program values, steps, and what the recorder and the program
builder read of an operator."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

_aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class _Ref:
    """A value of the program: ``v<index>``."""

    index: int


@dataclass(frozen=True, slots=True)
class Constant:
    """A tensor the program reads that neither a slot nor a step gives: ``k<index>``."""

    index: int


@dataclass(slots=True)
class _Step:
    func: Callable
    args: tuple  # with tensors as _Ref or Constant
    kwargs: dict
    outputs: list  # flat: _Ref for a tensor, ("guard", number) for a number, None
    sequence: bool  # the operator returns a tuple or list
    reads: list  # the values its arguments read (indices, in order, repeated as read)
    shapes: list | None = None  # data-shaped outputs: the recorded shapes
    view: tuple | None = None  # a view operator's result: (size, stride, storage offset)
    #: the operators of ``_LAID_OUT``: ``copy_``'s destination's and source's ``layout()``;
    #: the others' first tensor's (the tensor a number is read from, cloned or compared)
    layouts: tuple | None = None
    #: an ``out`` argument's shape, strides or storage offset changed (the operator resized
    #: it to its result's shape)
    resized: bool = False


def out_layouts(outs: tuple, kwargs: dict) -> list:
    """The shape, strides and storage offset of each tensor given as an ``out`` argument
    (``outs``: their names)."""
    found = []
    for name in outs:
        value = kwargs.get(name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                found.append((tuple(t.shape), t.stride(), t.storage_offset()))
    return found


def layout(t: torch.Tensor) -> tuple:
    """What the rewrites ask of a recorded tensor: dtype, device, shape, strides, offset."""
    return (t.dtype, t.device, tuple(t.shape), t.stride(), t.storage_offset())


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


def _argument(template: tuple, at: tuple[int, str] | None) -> Any:
    """The template of the argument at ``at`` (position, name) of a call's ``template``
    (its positional and keyword arguments' templates), or None."""
    if at is None:
        return None
    args, kwargs = template
    return args[at[0]] if at[0] < len(args) else kwargs.get(at[1])


@dataclass(frozen=True, slots=True)
class _Traits:
    """What the recorder asks of an operator on every call, read from its schema once."""

    name: str
    seeded: bool  # tagged nondeterministic_seeded (may draw random numbers)
    inplace_view: bool  # changes a tensor's shape or strides in place
    aliases: bool  # its first output aliases an input: ``alias_of``
    alias_of: tuple | None  # (position, name) of the argument the first output aliases
    view: bool  # one of ``_views()``
    written: tuple  # ``_written(func)``
    fresh: bool  # an aten operator whose results are new tensors: no view, no alias, no write
    laid_out: bool  # one of ``_LAID_OUT``: the recorder notes its tensors' layouts
    outs: tuple  # the names of its ``out`` arguments (keyword-only, written)


#: comparisons of a tensor with a number -> the same comparison with a tensor
SCALAR_COMPARISONS = {
    getattr(_aten, name).Scalar: getattr(_aten, name).Tensor
    for name in ("eq", "ne", "lt", "le", "gt", "ge")
} | {
    getattr(_aten, name).Scalar_out: getattr(_aten, name).Tensor_out
    for name in ("eq", "ne", "lt", "le", "gt", "ge")
}
#: operators whose tensors' layouts the recorder notes (``program._layouts``)
_LAID_OUT = frozenset(
    {
        _aten.copy_.default,
        _aten._local_scalar_dense.default,
        _aten.clone.default,
        *SCALAR_COMPARISONS,
    }
)

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
        _alias_of(func),
        func in _views(),
        _written(func),
        func._schema.name.startswith("aten::")
        and func not in _views()
        and all(r.alias_info is None for r in returns)
        and not _written(func),
        func in _LAID_OUT,
        tuple(name for i, name in _written(func) if func._schema.arguments[i].kwarg_only),
    )
    _TRAITS[id(func)] = (func, traits)
    return traits


def _alias_of(func) -> tuple[int, str] | None:
    """The position and name of the argument ``func``'s first output aliases (its ``out=``
    argument for an out variant, ``self`` for an in-place or view operator), or None."""
    returns = func._schema.returns
    if not returns or returns[0].alias_info is None:
        return None
    sets = returns[0].alias_info.before_set
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.before_set & sets:
            return i, a.name
    return None


@functools.cache
def _written(func) -> tuple[tuple[int, str], ...]:
    """The position and name of each argument ``func`` writes into."""
    return tuple(
        (i, a.name)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


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
