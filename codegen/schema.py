"""Parse op signatures such as ``add.Tensor(Tensor input, Tensor other, *, Scalar alpha=1) -> Tensor``."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

#: parameter types a signature may use, and what the runtime binder accepts for each
PARAM_TYPES = (
    "Tensor",
    "Tensor?",
    "Tensor[]",
    "Tensor...",
    "Scalar",
    "Scalar?",
    "int",
    "int?",
    "int[]",
    "int[]?",
    "int...",
    "float",
    "float?",
    "bool",
    "str",
    "str?",
    "ScalarType?",
    "MemoryFormat",
    "MemoryFormat?",
    "Any",
)
RETURN_TYPES = ("Tensor", "Tensor[]")

_NO_DEFAULT = object()


class SchemaError(ValueError):
    """A signature string that cannot be parsed."""


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    default: object = _NO_DEFAULT
    kwonly: bool = False

    @property
    def has_default(self) -> bool:
        return self.default is not _NO_DEFAULT

    @property
    def is_tensor(self) -> bool:
        return self.type in ("Tensor", "Tensor?")

    @property
    def is_tensor_list(self) -> bool:
        """A list of tensors: ``Tensor[]`` (one argument) or ``Tensor...`` (the remaining
        positional arguments, or one list of them)."""
        return self.type in ("Tensor[]", "Tensor...")


@dataclass(frozen=True)
class Schema:
    name: str
    overload: str
    params: tuple[Param, ...]
    returns: str
    text: str = field(compare=False)

    @property
    def full_name(self) -> str:
        return f"{self.name}.{self.overload}" if self.overload else self.name

    @property
    def func_name(self) -> str:
        return self.full_name.replace(".", "_")

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def differentiable_candidates(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params if p.is_tensor or p.is_tensor_list)


_SIG = re.compile(r"^\s*([A-Za-z_][\w]*)(?:\.(\w+))?\s*\((.*)\)\s*->\s*(\S+)\s*$")
_PARAM = re.compile(r"^([A-Za-z]+(?:\[\]|\?|\.\.\.|\[\]\?)?)\s+([A-Za-z_]\w*)(?:\s*=\s*(.+))?$")


def parse_schema(text: str) -> Schema:
    """Parse a signature; raise SchemaError naming what is wrong."""
    m = _SIG.match(text)
    if not m:
        raise SchemaError(f"cannot parse signature {text!r}: expected 'name(params) -> Tensor'")
    name, overload, body, returns = m.groups()
    if returns not in RETURN_TYPES:
        raise SchemaError(f"{text!r}: return type {returns!r} is not one of {RETURN_TYPES}")
    params: list[Param] = []
    kwonly = False
    for raw in [p.strip() for p in body.split(",")] if body.strip() else []:
        if raw == "*":
            kwonly = True
            continue
        pm = _PARAM.match(raw)
        if not pm:
            raise SchemaError(f"{text!r}: cannot parse parameter {raw!r}")
        ptype, pname, default = pm.groups()
        if ptype not in PARAM_TYPES:
            raise SchemaError(f"{text!r}: parameter {pname!r} has unknown type {ptype!r}")
        if any(p.name == pname for p in params):
            raise SchemaError(f"{text!r}: parameter {pname!r} appears twice")
        value: object = _NO_DEFAULT
        if default is not None:
            value = _parse_default(text, pname, default)
        params.append(Param(pname, ptype, value, kwonly))
    if not params or not (
        params[0].is_tensor or params[0].is_tensor_list or params[0].type == "str"
    ):
        raise SchemaError(f"{text!r}: the first parameter must be a Tensor, a Tensor list or a str")
    if not any(p.is_tensor or p.is_tensor_list for p in params):
        raise SchemaError(f"{text!r}: no Tensor parameter")
    if sum(p.is_tensor_list for p in params) > 1:
        raise SchemaError(f"{text!r}: at most one Tensor[] or Tensor... parameter is supported")
    if any(p.type == "Tensor..." for p in params[:-1]):
        raise SchemaError(f"{text!r}: a Tensor... parameter must be the last")
    return Schema(name, overload or "", tuple(params), returns, text)


def _parse_default(text: str, pname: str, default: str) -> object:
    if default.startswith("torch."):
        return ("torch_attr", default)
    try:
        return ast.literal_eval(default)
    except (ValueError, SyntaxError) as exc:
        raise SchemaError(f"{text!r}: default of {pname!r} is not a literal: {default!r}") from exc
