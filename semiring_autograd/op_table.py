"""Op specifications (from generated/ops_table.py) and binding of torch calls to them."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from numbers import Number
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from torch import Tensor

from .builtin_semirings import BUILTIN_SEMIRINGS
from .semiring import Semiring


@dataclass(frozen=True)
class ParamSpec:
    name: str
    type: str
    has_default: bool
    default: Any
    kwonly: bool


@dataclass(frozen=True)
class OpSpec:
    name: str
    signature: str
    params: tuple[ParamSpec, ...]
    torch_functions: tuple[str, ...]
    accepts: Callable[..., bool] | None
    accepts_text: str
    granularity: str
    source_file: str
    multi_output: bool
    forward_helper: str | None = None  # a forward_helpers function computing (output, aux)

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any] | None:
        """Match a torch call to this signature; None when it does not fit."""
        bound: dict[str, Any] = {}
        args = list(args)
        for p in self.params:
            if p.type == "int...":
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
        extra = set(kwargs) - set(bound) - {"input"}
        if args or extra:
            return None
        if not all(_type_ok(p.type, bound[p.name]) for p in self.params):
            return None
        return bound

    def accepted(self, bound: dict[str, Any]) -> bool:
        return self.accepts is None or bool(self.accepts(**bound))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _type_ok(t: str, v: object) -> bool:
    if t == "Any":
        return True
    if t.endswith("?") and v is None:
        return True
    t = t.rstrip("?")
    if t == "Tensor":
        return isinstance(v, Tensor)
    if t == "Tensor[]":
        return isinstance(v, (list, tuple)) and all(isinstance(x, Tensor) for x in v)
    if t == "Scalar":
        return isinstance(v, Number) and not isinstance(v, Tensor)
    if t == "int":
        return _is_int(v)
    if t in ("int[]", "int..."):
        return _is_int(v) or (
            isinstance(v, (list, tuple, torch.Size)) and all(_is_int(x) for x in v)
        )
    if t == "float":
        return isinstance(v, Number) and not isinstance(v, (bool, Tensor))
    if t == "bool":
        return isinstance(v, bool)
    if t == "str":
        return isinstance(v, str)
    if t == "ScalarType":
        return isinstance(v, torch.dtype)
    if t == "MemoryFormat":
        return isinstance(v, torch.memory_format)
    raise AssertionError(f"unknown parameter type {t}")


def _resolve(path: str) -> Any:
    parts = path.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


class Registry:
    """Torch function → candidate ops, and op name → generated dispatch per semiring."""

    def __init__(self, table: ModuleType, modules: dict[str, ModuleType], origin: str):
        self.origin = origin
        self.ops: tuple[OpSpec, ...] = table.OPS
        self.by_function: dict[Any, list[OpSpec]] = {}
        for op in self.ops:
            for path in op.torch_functions:
                self.by_function.setdefault(_resolve(path), []).append(op)
        self.modules = modules

    def candidates(self, func: Any) -> list[OpSpec]:
        try:
            return self.by_function.get(func, [])
        except TypeError:  # unhashable callables are never registered
            return []

    def dispatcher(self, semiring: Semiring, op: OpSpec) -> tuple[Callable[..., Any], bool]:
        """(generated function, whether it takes the semiring as first argument)."""
        if type(semiring) in BUILTIN_SEMIRINGS:
            module = self.modules[type(semiring).name]
            return module.FUNCTIONS[op.name], False
        return self.modules["generic"].FUNCTIONS[op.name], True

    @classmethod
    def load(cls, directory: str | Path | None = None) -> "Registry":
        """The registry of the installed generated package, or of a directory of generated
        files (as written by ``generate --out-dir``)."""
        names = [c.name for c in BUILTIN_SEMIRINGS] + ["generic"]
        if directory is None:
            package = "semiring_autograd.generated"
            table = importlib.import_module(f"{package}.ops_table")
            modules = {n: importlib.import_module(f"{package}.{n}") for n in names}
            return cls(table, modules, "generated/")
        directory = Path(directory)
        prefix = f"_semiring_autograd_extra_{abs(hash(str(directory.resolve())))}"
        loaded = {}
        for n in ["ops_table", *names]:
            path = directory / f"{n}.py"
            if not path.exists():
                raise FileNotFoundError(
                    f"{path}: not a generated directory (run `generate --out-dir`)"
                )
            spec = importlib.util.spec_from_file_location(f"{prefix}.{n}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            loaded[n] = module
        table = loaded.pop("ops_table")
        return cls(table, loaded, str(directory))


_DEFAULT: Registry | None = None


def default_registry() -> Registry:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Registry.load()
    return _DEFAULT
