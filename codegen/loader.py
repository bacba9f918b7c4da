"""Load and validate ``derivatives/*.yaml`` into the typed model of :mod:`.model`.

Every problem is reported with the file, the op and what to change.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml

from .formulas import SPECIAL, FormulaError, analyse, parse
from .model import Formula, Intermediate, OpEntry, SavedMeta, SavedValue
from .schema import SchemaError, parse_schema

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
    identifiers: dict[str, str] = {}  # generated class / function name -> op
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
            for ident in {entry.schema.class_name, entry.schema.func_name}:
                other = identifiers.setdefault(ident, name)
                if other != name:
                    raise _fail(
                        f"{path.name}",
                        f"ops {other!r} and {name!r} both generate the Python name {ident!r}; "
                        "rename one of them",
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
    torch_functions = raw.get("torch")
    if not isinstance(torch_functions, list) or not torch_functions:
        raise _fail(where, "'torch:' must list the torch functions this entry serves")
    for path in torch_functions:
        _check_torch_path(where, path)
    granularity = raw.get("granularity")
    if not isinstance(granularity, str) or not granularity.strip():
        raise _fail(where, "'granularity:' must say 'op' or describe the composition")
    out_diff = raw.get("output_differentiability", [True])
    if not isinstance(out_diff, list) or not out_diff or not out_diff[0]:
        raise _fail(where, "output_differentiability must be a list whose first item is true")
    forward = raw.get("forward")
    if out_diff != [True] and not forward:
        raise _fail(where, "non-differentiable extra outputs need a 'forward:' helper")
    if forward is not None:
        import semiring_autograd.ops.forward_helpers as fh

        if not hasattr(fh, str(forward)):
            raise _fail(
                where, f"forward helper {forward!r} not in semiring_autograd.forward_helpers"
            )
    opinfo = raw.get("opinfo", [])
    if not isinstance(opinfo, list) or not all(isinstance(n, str) and n for n in opinfo):
        raise _fail(
            where,
            "'opinfo:' must list the names of the PyTorch OpInfo entries (op_db) whose samples "
            "call this entry, e.g. [add, __radd__] or [div.no_rounding_mode]",
        )
    accepts = raw.get("accepts")
    tensor_params = {p.name for p in schema.params if p.is_tensor}
    known = set(params) | SPECIAL
    if schema.returns != "Tensor[]":
        known.discard("grads")
    else:
        known.discard("grad")
    if len(out_diff) < 2:
        known.discard("aux")
    if accepts is not None:
        tree = parse(str(accepts), f"{where} accepts")
        analyse(tree, f"{where} accepts", set(), set(params))
    returns_aux = raw.get("returns_aux")
    if returns_aux is not None:
        if len(out_diff) < 2:
            raise _fail(where, "'returns_aux:' needs a forward helper's extra output")
        tree = parse(str(returns_aux), f"{where} returns_aux")
        analyse(tree, f"{where} returns_aux", set(), set(params))
    aux_type = raw.get("aux_type")
    if aux_type is not None:
        if returns_aux is None:
            raise _fail(where, "'aux_type:' types the (output, aux) pair 'returns_aux:' returns")
        _check_torch_path(where, aux_type)
    intermediates: list[Intermediate] = []
    inter_raw = raw.get("intermediates") or {}
    if not isinstance(inter_raw, dict):
        raise _fail(where, "'intermediates:' must be a mapping of name: expression")
    try:
        for iname, expr in inter_raw.items():
            if iname in known:
                raise _fail(where, f"intermediate {iname!r} shadows a parameter or special name")
            f = _formula(
                iname,
                str(expr),
                f"{where} intermediate {iname!r}",
                tensor_params,
                known,
                Intermediate,
            )
            intermediates.append(f)
            known.add(iname)
        formulas = {
            key: _formula(key, str(raw[key]), f"{where} formula for {key!r}", tensor_params, known)
            for key in formula_keys
        }
    except FormulaError as exc:
        raise DerivativesError(str(exc)) from exc
    by_name = {f.target: f for f in intermediates}
    for f in [*intermediates, *formulas.values()]:
        for name in f.names_read:
            if name in by_name:
                f.needs |= {name} | by_name[name].needs
    for i in intermediates:
        i.users = tuple(t for t, f in formulas.items() if i.target in f.needs)
        if not i.users:
            raise _fail(where, f"intermediate {i.target!r} is not used by any formula")
    entry = OpEntry(
        schema=schema,
        torch_functions=[str(t) for t in torch_functions],
        granularity=granularity.strip(),
        formulas=formulas,
        intermediates=intermediates,
        non_differentiable=non_diff,
        accepts=None if accepts is None else str(accepts),
        forward=None if forward is None else str(forward),
        output_differentiability=[bool(x) for x in out_diff],
        returns_aux=None if returns_aux is None else str(returns_aux),
        aux_type=aux_type,
        source_file=source_file,
        opinfo=list(opinfo),
    )
    _plan_saves(entry, where)
    return entry


def _plan_saves(entry: OpEntry, where: str) -> None:
    """What the forward keeps for backward: each tensor a formula reads as a value (saved
    only when one of its readers will run), the metadata read instead of tensors, the
    shapes read through ``shapes(...)`` and the non-tensor parameters formulas read."""
    readers: dict[str, list[str]] = {}
    metas: set[tuple[str, str]] = set()
    shapes: set[str] = set()
    inter = {i.target: i for i in entry.intermediates}
    for target, f in entry.formulas.items():
        for source in [f, *(inter[i] for i in sorted(f.needs))]:
            for n in source.reads.full:
                if target not in readers.setdefault(n, []):
                    readers[n].append(target)
            metas |= source.reads.meta
            shapes |= source.reads.shapes
    tensors = entry.tensor_params
    lists = {p.name for p in entry.schema.params if p.is_tensor_list}
    order = [p.name for p in entry.schema.params] + ["result", "aux"]
    saved = [n for n in order if n in readers and (n in tensors | lists or n in ("result", "aux"))]
    if entry.multi_output and "result" in saved:
        raise _fail(where, "a multi-output op may read its result only through shapes(result)")
    entry.saved = [
        SavedValue(n, "output" if n == "result" else n, tuple(sorted(readers[n])), n in lists)
        for n in saved
    ]
    entry.metas = [SavedMeta(n, attr) for n, attr in sorted(metas)]
    entry.shapes = sorted(shapes)
    entry.ctx_params = [
        p.name
        for p in entry.schema.params
        if p.name in readers and p.name not in tensors and not p.is_tensor_list
    ]


def _formula(
    target: str,
    source: str,
    where: str,
    tensor_params: set[str],
    known: set[str],
    kind: type[Formula] = Formula,
) -> Formula:
    tree = parse(source, where)
    return kind(target, source, tree, analyse(tree, where, tensor_params, known))


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
