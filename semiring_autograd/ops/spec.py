"""Op specifications (the entries of generated/ops_table.py) and binding a torch call to one."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from numbers import Number
from typing import Any, Callable

import torch
from torch import Tensor

#: the key of a backward node's ``metadata`` under which ``sa.patch`` stores what it recorded
#: about the op call (``engine.graph.NodeInfo``)
NODE_INFO_KEY = "semiring_autograd"

#: where a parameter's value comes from in a call (:meth:`OpSpec._layout`): a positional
#: argument, a keyword, its default, the positional arguments from one on
_POSITIONAL, _KEYWORD, _DEFAULT, _REST = 0, 1, 2, 3
#: the layout of call shapes that no call fits
_NO_FIT = object()


@dataclass(frozen=True)
class ParamSpec:
    name: str
    type: str
    has_default: bool
    default: Any
    kwonly: bool

    @property
    def is_tensor_list(self) -> bool:
        """``Tensor[]`` or ``Tensor...``: its bound value is a list of tensors."""
        return self.type in ("Tensor[]", "Tensor...")


@dataclass(frozen=True)
class OpSpec:
    name: str
    signature: str
    params: tuple[ParamSpec, ...]
    torch_functions: tuple[str, ...]
    granularity: str
    source_file: str
    #: a condition on the arguments the op's formulas need (None: any), and its source
    accepts: Callable[..., bool] | None = None
    accepts_text: str = ""
    multi_output: bool = False
    forward_helper: str | None = None  # a forward_helpers function computing (output, aux)
    differentiable: tuple[str, ...] = ()  # the parameters with a formula
    #: whether torch hands back the first argument itself for some arguments (a cast to its
    #: own dtype, ``contiguous`` of a contiguous tensor); ``sa.patch`` records no node then
    may_return_input: bool = False

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any] | None:
        """Match a torch call to this signature; None when it does not fit. Runs on every
        patched torch call: where each parameter's value comes from depends only on how many
        positional arguments and which keywords the call passes, so that is worked out once
        per such shape (:meth:`_layout`) and only the values' types are checked per call."""
        key = (len(args), tuple(kwargs)) if kwargs else len(args)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = self._layout(len(args), tuple(kwargs))
        if layout is _NO_FIT:
            return None
        bound: dict[str, Any] = {}
        for name, source, at, types, plain, check in layout:
            if source == _POSITIONAL:
                value = args[at]
            elif source == _KEYWORD:
                value = kwargs[at]
            elif source == _REST:
                value = tuple(args[at:])
                if len(value) == 1 and isinstance(value[0], (tuple, list, torch.Size)):
                    value = tuple(value[0])
            else:
                value = at
            if types is not None:
                if not isinstance(value, types):
                    return None
            elif check is not None and type(value) not in plain and not check(value):
                return None
            bound[name] = value
        return bound

    @functools.cached_property
    def _layouts(self) -> dict[Any, Any]:
        """Call shape (positional count, keywords) → its :meth:`_layout`."""
        return {}

    def _layout(self, positional: int, keywords: tuple[str, ...]) -> Any:
        """Where each parameter's value comes from in a call with ``positional`` arguments
        and ``keywords``: (name, source, position or keyword or default, the classes its
        value must be an instance of or None, the classes of values that pass without a
        call, its type check or None) per parameter;
        :data:`_NO_FIT` when no call of that shape fits the signature (a default that fails
        its own type counts so). An ``int...`` or ``Tensor...`` parameter not passed by
        keyword takes the remaining positional arguments (or the one sequence among them)."""
        params = self.params
        names = set(keywords)
        layout = []
        taken = 0
        for p in params:
            types = _INSTANCE_OF.get(p.type)
            check = None if types is not None or p.type == "Any" else _checker(p.type)
            checks = (types, _PLAIN.get(p.type, ()), check)
            if p.type in ("int...", "Tensor..."):
                if p.name in names:
                    layout.append((p.name, _KEYWORD, p.name, *checks))
                else:
                    layout.append((p.name, _REST, taken, *checks))
                    taken = positional
            elif taken < positional and not p.kwonly:
                if p.name in names:
                    return _NO_FIT
                layout.append((p.name, _POSITIONAL, taken, *checks))
                taken += 1
            elif p.name in names:
                layout.append((p.name, _KEYWORD, p.name, *checks))
            elif p.name == params[0].name and "input" in names and p.name != "input":
                layout.append((p.name, _KEYWORD, "input", *checks))
            elif p.has_default:
                if not _checker(p.type)(p.default):
                    return _NO_FIT
                layout.append((p.name, _DEFAULT, p.default, None, (), None))
            else:
                return _NO_FIT
        if taken < positional or names - {p.name for p in params} - {"input"}:
            return _NO_FIT
        return tuple(layout)

    def accepted(self, bound: dict[str, Any]) -> bool:
        return self.accepts is None or bool(self.accepts(**bound))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_tensor_list(v: object) -> bool:
    if not isinstance(v, (list, tuple)):
        return False
    for x in v:  # loops, not generators: these run on every call binding a list
        if not isinstance(x, Tensor):
            return False
    return True


def _is_int_list(v: object) -> bool:
    if not isinstance(v, (list, tuple, torch.Size)):
        return _is_int(v)
    for x in v:
        if type(x) is not int and not _is_int(x):
            return False
    return True


_CHECKS: dict[str, Callable[[object], bool]] = {
    "Any": lambda v: True,
    "Tensor": lambda v: isinstance(v, Tensor),
    "Tensor[]": _is_tensor_list,
    "Tensor...": _is_tensor_list,
    "Scalar": lambda v: isinstance(v, Number) and not isinstance(v, Tensor),
    "int": _is_int,
    "int[]": _is_int_list,
    "int...": _is_int_list,
    "float": lambda v: isinstance(v, Number) and not isinstance(v, (bool, Tensor)),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "ScalarType": lambda v: isinstance(v, torch.dtype),
    "MemoryFormat": lambda v: isinstance(v, torch.memory_format),
}


#: the parameter types whose check is an ``isinstance`` (bound without a call per value)
_INSTANCE_OF: dict[str, tuple[type, ...]] = {
    "Tensor": (Tensor,),
    "Tensor?": (Tensor, type(None)),
    "bool": (bool,),
    "bool?": (bool, type(None)),
    "str": (str,),
    "str?": (str, type(None)),
    "ScalarType": (torch.dtype,),
    "ScalarType?": (torch.dtype, type(None)),
    "MemoryFormat": (torch.memory_format,),
    "MemoryFormat?": (torch.memory_format, type(None)),
}


#: per parameter type, the exact classes of values that pass its check, which ``bind``
#: takes without calling it (``isinstance(v, Number)`` is an ABC's test: two Python calls)
_PLAIN: dict[str, tuple[type, ...]] = {
    "Scalar": (int, float, bool),
    "Scalar?": (int, float, bool, type(None)),
    "float": (float, int),
    "float?": (float, int, type(None)),
    "int": (int,),
    "int?": (int, type(None)),
}


@functools.cache
def _checker(t: str) -> Callable[[object], bool]:
    """Whether a value fits the YAML parameter type ``t`` (``T?`` also takes None)."""
    if t.endswith("?"):
        inner = _checker(t[:-1])
        return lambda v: v is None or inner(v)
    if t not in _CHECKS:
        raise AssertionError(f"unknown parameter type {t}")
    return _CHECKS[t]
