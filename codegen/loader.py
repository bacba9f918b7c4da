"""Load and validate ``derivatives/*.yaml`` into the typed model of :mod:`.model`.

Every problem is reported with the file, the op and what to change.
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import replace
from pathlib import Path

import yaml

from semiring_autograd.ops import forward_helpers
from semiring_autograd.ops.primitives import PRIMITIVES

from .formulas import SPECIAL, STRUCTURAL, FormulaError, analyse, parse
from .model import Formula, Intermediate, Kept, OpEntry, SavedValue
from .schema import Schema, SchemaError, parse_schema

ENTRY_KEYS = frozenset(
    {
        "name",
        "torch",
        "granularity",
        "non_differentiable",
        "intermediates",
        "accepts",
        "forward",
        "output_differentiability",
        "returns_aux",
        "aux_type",
        "opinfo",
        "may_return_input",
    }
)


class DerivativesError(ValueError):
    """A derivatives YAML file that does not validate."""


def _fail(where: str, message: str) -> DerivativesError:
    return DerivativesError(f"{where}: {message}")


def load_entries(yaml_dir: Path) -> list[OpEntry]:
    """Every entry of every ``*.yaml`` under ``yaml_dir``, sorted by file then order."""
    files = sorted(Path(yaml_dir).glob("*.yaml"))
    if not files:
        raise DerivativesError(f"{yaml_dir}: no *.yaml files")
    entries: list[OpEntry] = []
    seen: dict[str, str] = {}
    identifiers: dict[str, str] = {}  # generated rule name -> op
    for path in files:
        with open(path, encoding="utf-8") as fh:
            try:
                data = yaml.safe_load(fh)
            except yaml.YAMLError as exc:
                raise DerivativesError(f"{path.name}: not valid YAML: {exc}") from exc
        if not isinstance(data, list):
            raise DerivativesError(f"{path.name}: the top level must be a list of op entries")
        for i, raw in enumerate(data):
            entry = load_entry(raw, f"{path.name} entry {i + 1}", path.name)
            name = entry.schema.full_name
            if name in seen:
                raise _fail(f"{path.name}", f"op {name!r} is defined twice (also in {seen[name]})")
            seen[name] = path.name
            other = identifiers.setdefault(entry.schema.func_name, name)
            if other != name:
                raise _fail(
                    f"{path.name}",
                    f"ops {other!r} and {name!r} both generate the Python name "
                    f"{entry.schema.func_name!r}; rename one of them",
                )
            entries.append(entry)
    return entries


def load_entry(raw: object, where: str, source_file: str = "<memory>") -> OpEntry:
    """Validate one YAML mapping into an OpEntry."""
    if not isinstance(raw, dict) or "name" not in raw:
        raise _fail(where, "an entry must be a mapping with a 'name:' signature")
    try:
        schema = parse_schema(str(raw["name"]))
    except SchemaError as exc:
        raise _fail(where, str(exc)) from exc
    where = f"{where} ({schema.full_name})"
    formula_keys = _formula_keys(raw, schema, where)
    out_diff = _output_differentiability(raw, where)
    known = _known_names(schema, out_diff)
    conditions = {key: _condition(raw, key, schema, where) for key in ("accepts", "returns_aux")}
    if conditions["returns_aux"] is not None and len(out_diff) < 2:
        raise _fail(where, "'returns_aux:' needs a forward helper's extra output")
    intermediates, formulas = _formulas(raw, formula_keys, schema, known, where)
    saved, kept = _plan_saves(schema, formulas, intermediates, where)
    return OpEntry(
        schema=schema,
        torch_functions=_torch_functions(raw, where),
        granularity=_granularity(raw, where),
        formulas=formulas,
        intermediates=intermediates,
        non_differentiable=tuple(raw.get("non_differentiable") or ()),
        accepts=conditions["accepts"],
        forward=_forward_helper(raw, out_diff, where),
        output_differentiability=out_diff,
        returns_aux=conditions["returns_aux"],
        aux_type=_aux_type(raw, conditions["returns_aux"], where),
        source_file=source_file,
        opinfo=_opinfo(raw, where),
        may_return_input=_may_return_input(raw, schema, out_diff, where),
        saved=saved,
        kept=kept,
        structural=_is_structural([*intermediates, *formulas.values()], schema),
    )


def _may_return_input(raw: dict, schema: Schema, out_diff: tuple[bool, ...], where: str) -> bool:
    """``may_return_input: true``: for some arguments torch hands back the op's first
    argument itself (a cast to its own dtype, ``contiguous`` of a contiguous tensor). Only
    a one-output op whose first parameter is a tensor has it."""
    value = raw.get("may_return_input", False)
    if not isinstance(value, bool):
        raise _fail(where, f"'may_return_input:' is true or false, got {value!r}")
    if value:
        first = schema.params[0] if schema.params else None
        if first is None or first.type != "Tensor":
            raise _fail(where, "'may_return_input:' needs a first parameter of type Tensor")
        if schema.returns != "Tensor" or len(out_diff) > 1:
            raise _fail(where, "'may_return_input:' needs an op returning one tensor")
    return value


def _formula_keys(raw: dict, schema: Schema, where: str) -> list[str]:
    """The entry's formula keys, each a tensor parameter; every tensor parameter has a
    formula or is listed under ``non_differentiable``."""
    params = {p.name: p for p in schema.params}
    formula_keys = [k for k in raw if k not in ENTRY_KEYS]
    for key in formula_keys:
        if key not in params:
            raise _fail(
                where,
                f"formula for unknown input name {key!r}; the signature's parameters are "
                f"{', '.join(params)}",
            )
        if not (params[key].is_tensor or params[key].is_tensor_list):
            raise _fail(where, f"{key!r} is a {params[key].type}, not a tensor: no formula allowed")
    non_diff = list(raw.get("non_differentiable") or [])
    for name in non_diff:
        if name not in params:
            raise _fail(where, f"non_differentiable names unknown input {name!r}")
        if name in formula_keys:
            raise _fail(where, f"formula given for non-differentiable input {name!r}")
    for name in schema.differentiable_candidates:
        if name not in formula_keys and name not in non_diff:
            raise _fail(
                where,
                f"missing formula for tensor input {name!r} (add '{name}: <formula>' or list it "
                "under non_differentiable)",
            )
    return formula_keys


def _torch_functions(raw: dict, where: str) -> tuple[str, ...]:
    torch_functions = raw.get("torch")
    if not isinstance(torch_functions, list) or not torch_functions:
        raise _fail(where, "'torch:' must list the torch functions this entry serves")
    for path in torch_functions:
        _check_torch_path(where, path)
    return tuple(str(t) for t in torch_functions)


def _granularity(raw: dict, where: str) -> str:
    granularity = raw.get("granularity")
    if not isinstance(granularity, str) or not granularity.strip():
        raise _fail(where, "'granularity:' must say 'op' or describe the composition")
    return granularity.strip()


def _output_differentiability(raw: dict, where: str) -> tuple[bool, ...]:
    out_diff = raw.get("output_differentiability", [True])
    if not isinstance(out_diff, list) or not out_diff or not out_diff[0]:
        raise _fail(where, "output_differentiability must be a list whose first item is true")
    return tuple(bool(x) for x in out_diff)


def _forward_helper(raw: dict, out_diff: tuple[bool, ...], where: str) -> str | None:
    forward = raw.get("forward")
    if out_diff != (True,) and not forward:
        raise _fail(where, "non-differentiable extra outputs need a 'forward:' helper")
    if forward is None:
        return None
    if not hasattr(forward_helpers, str(forward)):
        raise _fail(
            where, f"forward helper {forward!r} not in semiring_autograd.ops.forward_helpers"
        )
    return str(forward)


def _opinfo(raw: dict, where: str) -> tuple[str, ...]:
    opinfo = raw.get("opinfo", [])
    if not isinstance(opinfo, list) or not all(isinstance(n, str) and n for n in opinfo):
        raise _fail(
            where,
            "'opinfo:' must list the names of the PyTorch OpInfo entries (op_db) whose samples "
            "call this entry, e.g. [add, __radd__] or [div.no_rounding_mode]",
        )
    return tuple(opinfo)


def _aux_type(raw: dict, returns_aux: str | None, where: str) -> str | None:
    aux_type = raw.get("aux_type")
    if aux_type is None:
        return None
    if returns_aux is None:
        raise _fail(where, "'aux_type:' types the (output, aux) pair 'returns_aux:' returns")
    _check_torch_path(where, aux_type)
    return str(aux_type)


def _condition(raw: dict, key: str, schema: Schema, where: str) -> str | None:
    """A condition on the arguments (``accepts``, ``returns_aux``), validated."""
    if raw.get(key) is None:
        return None
    source = str(raw[key])
    analyse(parse(source, f"{where} {key}"), f"{where} {key}", set(), set(schema.param_names))
    return source


def _known_names(schema: Schema, out_diff: tuple[bool, ...]) -> set[str]:
    """The names a formula may read: parameters and the special names that apply."""
    known = set(schema.param_names) | SPECIAL
    known.discard("grad" if schema.returns == "Tensor[]" else "grads")
    if len(out_diff) < 2:
        known.discard("aux")
    return known


def _formulas(
    raw: dict, keys: list[str], schema: Schema, known: set[str], where: str
) -> tuple[tuple[Intermediate, ...], dict[str, Formula]]:
    """The intermediates and formulas, parsed and analysed, with what each needs."""
    tensor_params = {p.name for p in schema.params if p.is_tensor}
    inter_raw = raw.get("intermediates") or {}
    if not isinstance(inter_raw, dict):
        raise _fail(where, "'intermediates:' must be a mapping of name: expression")
    known = set(known)
    parsed: list[Formula] = []
    try:
        for iname, expr in inter_raw.items():
            if iname in known:
                raise _fail(where, f"intermediate {iname!r} shadows a parameter or special name")
            parsed.append(
                _formula(iname, str(expr), f"{where} intermediate {iname!r}", tensor_params, known)
            )
            known.add(iname)
        formulas = [
            _formula(key, str(raw[key]), f"{where} formula for {key!r}", tensor_params, known)
            for key in keys
        ]
    except FormulaError as exc:
        raise DerivativesError(str(exc)) from exc
    inter_names = {f.target for f in parsed}
    needs: dict[str, frozenset[str]] = {}  # name → the intermediates it needs, transitively
    for f in [*parsed, *formulas]:  # an intermediate reads only earlier ones
        direct = f.names_read & inter_names
        needs[f.target] = frozenset(direct.union(*(needs[n] for n in direct)))
    intermediates = []
    for f in parsed:
        users = tuple(k.target for k in formulas if f.target in needs[k.target])
        if not users:
            raise _fail(where, f"intermediate {f.target!r} is not used by any formula")
        intermediates.append(
            Intermediate(f.target, f.source, f.tree, f.reads, needs[f.target], users)
        )
    by_key = {f.target: replace(f, needs=needs[f.target]) for f in formulas}
    return tuple(intermediates), by_key


def _plan_saves(
    schema: Schema,
    formulas: dict[str, Formula],
    intermediates: tuple[Intermediate, ...],
    where: str,
) -> tuple[tuple[SavedValue, ...], tuple[Kept, ...]]:
    """What the forward keeps for backward: each tensor a formula reads as a value (saved
    only when one of its readers will run), then the metadata read instead of tensors, the
    shapes read through ``shapes(...)`` and the non-tensor parameters formulas read."""
    readers: dict[str, list[str]] = {}
    metas: set[tuple[str, str]] = set()
    shapes: set[str] = set()
    inter = {i.target: i for i in intermediates}
    for target, f in formulas.items():
        for source in [f, *(inter[i] for i in sorted(f.needs))]:
            for n in source.reads.full:
                if target not in readers.setdefault(n, []):
                    readers[n].append(target)
            metas |= source.reads.meta
            shapes |= source.reads.shapes
    tensors = {p.name for p in schema.params if p.is_tensor or p.is_tensor_list}
    order = [*schema.param_names, "result", "aux"]
    saved = [n for n in order if n in readers and (n in tensors or n in ("result", "aux"))]
    if schema.returns == "Tensor[]" and "result" in saved:
        raise _fail(where, "a multi-output op may read its result only through shapes(result)")
    kept = [Kept("meta", n, attr) for n, attr in sorted(metas)]
    kept += [Kept("shapes", n) for n in sorted(shapes)]
    kept += [Kept("param", n) for n in schema.param_names if n in readers and n not in tensors]
    return tuple(SavedValue(n, tuple(sorted(readers[n]))) for n in saved), tuple(kept)


def _is_structural(formulas: list[Formula], schema: Schema) -> bool:
    """Whether every formula only moves, copies or reshapes messages (structural
    primitives and helpers): the entry's rule is the same in every semiring."""
    if schema.returns == "Tensor[]":
        return False
    called = {
        node.func.id
        for f in formulas
        for node in ast.walk(f.tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    return not (called & set(PRIMITIVES)) - set(STRUCTURAL)


def _formula(
    target: str, source: str, where: str, tensor_params: set[str], known: set[str]
) -> Formula:
    tree = parse(source, where)
    return Formula(target, source, tree, analyse(tree, where, tensor_params, known))


def _check_torch_path(where: str, path: object) -> None:
    if not isinstance(path, str) or not path.startswith("torch."):
        raise _fail(where, f"torch function {path!r} must be a dotted path starting with 'torch.'")
    parts = path.split(".")
    obj: object = importlib.import_module("torch")
    for i, part in enumerate(parts[1:], start=1):
        if not hasattr(obj, part):
            try:
                obj = importlib.import_module(".".join(parts[: i + 1]))
                continue
            except ImportError:
                raise _fail(
                    where, f"torch function {path!r} does not exist in this torch"
                ) from None
        obj = getattr(obj, part)
