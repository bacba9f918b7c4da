"""The op table at run time: which YAML entries serve a torch function, and which generated
Function records an op under a semiring (the registry of semirings names the module)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from ..generated import MODULES, ops_table
from ..ops.message import ENTRY_RULES
from ..ops.spec import OpSpec
from ..semirings.base import Semiring
from ..semirings.registry import SEMIRINGS, spec_of

#: softmax's and log_softmax's native backward on messages run their YAML rules
ENTRY_RULES.update(
    softmax=MODULES["generic"].softmax_vjp, log_softmax=MODULES["generic"].log_softmax_vjp
)


def _resolve(path: str) -> Any:
    parts = path.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


class OpTable:
    """Torch function → candidate ops, and op name → generated dispatch per semiring."""

    def __init__(self, table: ModuleType, modules: dict[str, ModuleType], origin: str):
        self.origin = origin
        self.ops: tuple[OpSpec, ...] = table.OPS
        self.by_function: dict[Any, list[OpSpec]] = {}
        for op in self.ops:
            for path in op.torch_functions:
                self.by_function.setdefault(_resolve(path), []).append(op)
        self.modules = modules
        #: (semiring class, op name) -> what :meth:`dispatcher` answers (it reads only these)
        self._dispatch: dict[tuple[type, str], tuple[Callable[..., Any], bool]] = {}

    def candidates(self, func: Any) -> list[OpSpec]:
        try:
            return self.by_function.get(func, [])
        except TypeError:  # unhashable callables are never registered
            return []

    def dispatcher(self, semiring: Semiring, op: OpSpec) -> tuple[Callable[..., Any], bool]:
        """(the generated Function's ``record``, whether its leading arguments are (semiring,
        call) rather than (call,)): a built-in semiring's own module, else the generic one
        (user semirings, and built-ins whose registry entry says ``module="generic"``)."""
        key = (type(semiring), op.name)
        found = self._dispatch.get(key)
        if found is None:
            spec = spec_of(semiring)
            if spec is not None and spec.module == "own":
                found = self.modules[spec.name].FUNCTIONS[op.name], False
            else:
                found = self.modules["generic"].FUNCTIONS[op.name], True
            self._dispatch[key] = found
        return found

    @classmethod
    def checked(cls, table: ModuleType, modules: dict[str, ModuleType], origin: str) -> "OpTable":
        """The op table of generated ``table`` and ``modules``, which must hold a module for
        every semiring the registry of semirings names."""
        expected = {s.generated_module for s in SEMIRINGS}
        missing = sorted(expected - set(modules))
        if missing:
            raise ImportError(
                f"{origin}: no generated module for {', '.join(missing)}; run `generate`"
            )
        return cls(table, modules, origin)

    @classmethod
    def load(cls, directory: str | Path | None = None) -> "OpTable":
        """The op table of the installed generated package, or of a directory of generated
        files (as written by ``generate --out-dir``), imported as a package of its own."""
        if directory is None:
            return cls.checked(ops_table, MODULES, "generated/")
        directory = Path(directory)
        init = directory / "__init__.py"
        if not init.exists():
            raise FileNotFoundError(
                f"{init}: not a generated directory (run `generate --out-dir {directory}`)"
            )
        name = f"_semiring_autograd_extra_{abs(hash(str(directory.resolve())))}"
        spec = importlib.util.spec_from_file_location(
            name, init, submodule_search_locations=[str(directory)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        spec.loader.exec_module(package)
        return cls.checked(package.ops_table, package.MODULES, str(directory))


_DEFAULT: OpTable | None = None


def default_op_table() -> OpTable:
    """The op table of the installed generated package (loaded once)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = OpTable.load()
    return _DEFAULT
