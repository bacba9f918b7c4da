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

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any] | None:
        """Match a torch call to this signature; None when it does not fit. Runs on every
        patched torch call, so the type checks are functions looked up once per type."""
        bound: dict[str, Any] = {}
        args = list(args)
        for p in self.params:
            if p.type in ("int...", "Tensor..."):
                if p.name in kwargs:
                    value = kwargs[p.name]
                else:
                    value, args = tuple(args), []
                    if len(value) == 1 and isinstance(value[0], (tuple, list, torch.Size)):
                        value = tuple(value[0])
                bound[p.name] = value
                continue
            if args and not p.kwonly:
                if p.name in kwargs:
                    return None
                bound[p.name] = args.pop(0)
            elif p.name in kwargs:
                bound[p.name] = kwargs[p.name]
            elif p.name == self.params[0].name and "input" in kwargs and p.name != "input":
                bound[p.name] = kwargs["input"]
            elif p.has_default:
                bound[p.name] = p.default
            else:
                return None
        if args or (kwargs and set(kwargs) - set(bound) - {"input"}):
            return None
        for p in self.params:
            if not _checker(p.type)(bound[p.name]):
                return None
        return bound

    def accepted(self, bound: dict[str, Any]) -> bool:
        return self.accepts is None or bool(self.accepts(**bound))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_tensor_list(v: object) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, Tensor) for x in v)


def _is_int_list(v: object) -> bool:
    return _is_int(v) or (isinstance(v, (list, tuple, torch.Size)) and all(_is_int(x) for x in v))


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


@functools.cache
def _checker(t: str) -> Callable[[object], bool]:
    """Whether a value fits the YAML parameter type ``t`` (``T?`` also takes None)."""
    if t.endswith("?"):
        inner = _checker(t[:-1])
        return lambda v: v is None or inner(v)
    if t not in _CHECKS:
        raise AssertionError(f"unknown parameter type {t}")
    return _CHECKS[t]
