"""``generate``: render derivatives/*.yaml into generated/ (``--check``: fail if stale).

For every built-in semiring one module with one ``torch.autograd.Function`` per op, a
``generic`` module whose Functions take the semiring as an argument (serving user-defined
semirings at run time), ``ops_table.py`` (signatures, torch functions, granularity) and
``SUPPORTED_OPS.md`` (the docs page listing every supported torch function).
Output is black-formatted, deterministic, and only changed files are rewritten.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import black
import jinja2

from .formulas import rewrite
from .loader import DerivativesError, OpEntry, load_entries

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = Path(__file__).resolve().parent / "templates"

from semiring_autograd.semirings.registry import SEMIRINGS

#: (module name, class in semiring_autograd.semirings); None: the generic module
SEMIRING_MODULES = tuple((s.name, s.cls.__name__) for s in SEMIRINGS if s.module == "own") + (
    ("generic", None),
)


class CodegenError(ValueError):
    """An entry that loads but cannot be generated."""


def _or(conds: list[str]) -> str:
    return " or ".join(sorted(set(conds))) if conds else "False"


def _ctx_header(name: str, args: str) -> list[str]:
    """The context every generated forward records (``args``: its arguments after ctx)."""
    return [
        "ctx.set_materialize_grads(False)",
        "ctx.semiring = S",
        f"ctx.op_name = {name!r}",
        f"ctx._tensor_args = tuple(isinstance(x, torch.Tensor) for x in ({args}))",
    ]


def _op_context(entry: OpEntry, real: bool, generic: bool) -> dict:
    schema = entry.schema
    name = schema.full_name
    nonlist = [p for p in schema.params if not p.is_tensor_list]
    lst = next((p for p in schema.params if p.is_tensor_list), None)
    prefix = ["S"] if generic else []
    base = len(prefix) + 1
    index = {p.name: base + i for i, p in enumerate(nonlist)}
    list_offset = base + len(nonlist)
    tensor_params = {p.name for p in schema.params if p.is_tensor}
    multi = schema.returns == "Tensor[]"

    def need_expr(target: str, needs: str = "ctx.needs_input_grad") -> str:
        if lst is not None and target == lst.name:
            return f"any({needs}[{list_offset}:])"
        return f"{needs}[{index[target]}]"

    formulas = entry.formulas
    inter = {f.target: f for f in entry.intermediates}
    # which formulas read a name, directly or through intermediates
    readers: dict[str, list[str]] = {}
    metas: set[tuple[str, str]] = set()
    shapes: set[str] = set()
    for target, f in formulas.items():
        for source in [f, *(inter[i] for i in f.needs)]:
            for n in source.reads.full:
                readers.setdefault(n, []).append(target)
            metas |= source.reads.meta
            shapes |= source.reads.shapes
    for i in entry.intermediates:
        if not any(i.target in f.needs for f in formulas.values()):
            raise CodegenError(f"{name}: intermediate {i.target!r} is not used by any formula")
    saved = [
        n
        for n in (*(p.name for p in schema.params), "result", "aux")
        if n in readers and (n in tensor_params or n in ("result", "aux"))
    ]
    if multi and "result" in saved:
        raise CodegenError(f"{name}: multi-output ops may read the result only via shapes(result)")
    ctx_params = [
        p.name
        for p in schema.params
        if p.name in readers and p.name not in tensor_params and not p.is_tensor_list
    ]

    # ---- forward (``unpack``: the Function's arguments after ctx, as apply receives them)
    unpack = ", ".join(
        prefix + ["call"] + [p.name for p in nonlist] + ([f"*{lst.name}"] if lst else [])
    )
    if entry.forward:
        args = ", ".join(f"list({p.name})" if p.is_tensor_list else p.name for p in schema.params)
        compute = f"FH.{entry.forward}({args})"
    elif multi:
        compute = "tuple(call())"
    else:
        tensors = ", ".join(sorted(tensor_params)) or ""
        compute = f"_fresh(call(){', ' + tensors if tensors else ''})"

    # ---- forward and context set-up in one method: a Function with a separate
    # setup_context pays for an inspect.signature bind on every apply
    setup = [f"outputs = {compute}", *_ctx_header(name, unpack)]
    if entry.has_aux:
        setup.append("output, aux = outputs")
        setup.append("ctx.mark_non_differentiable(aux)")
    else:
        setup.append("output = outputs")
    first = "output[0]" if multi else "output"
    setup.append(f"ctx._ref = ({first}.dtype, {first}.device)")
    for t in formulas:
        setup.append(f"need_{t} = {need_expr(t)}")
    if saved:
        items = []
        for n in saved:
            src = "output" if n == "result" else n
            items.append(f"{src} if ({_or([f'need_{t}' for t in readers[n]])}) else None")
        setup.append(f"ctx.save_for_backward({', '.join(items)})")
    for n, attr in sorted(metas):
        setup.append(f"ctx.{n}__{attr} = None if {n} is None else {n}.{attr}")
    for n in sorted(shapes):
        src = "output" if n == "result" else n
        setup.append(f"ctx.{n}__shapes = [t.shape for t in {src}]")
    for n in ctx_params:
        setup.append(f"ctx.{n} = {n}")
    if not real:
        for t in formulas:
            if lst is not None and t == lst.name:
                setup.append(f"ctx.{t}__meta = [(t.shape, t.dtype, t.device) for t in {t}]")
            else:
                setup.append(
                    f"ctx.{t}__meta = None if {t} is None else ({t}.shape, {t}.dtype, {t}.device)"
                )

    setup.append("return outputs")

    # ---- backward
    back: list[str] = []
    if generic:
        back.append("S = ctx.semiring")
    if multi:
        if real:
            back.append(f"for g in grads:\n    check_plain(g, {name!r})")
            back.append("grads = list(grads)")
        else:
            back.append(f"grads = [unwrap(S, g, {name!r}) for g in grads]")
        back.append(
            "if all(g is None for g in grads):\n    return (None,) * len(ctx.needs_input_grad)"
        )
    else:
        back.append(
            f"check_plain(grads[0], {name!r})\ngrad = grads[0]"
            if real
            else f"grad = unwrap(S, grads[0], {name!r})"
        )
        back.append("if grad is None:\n    return (None,) * len(ctx.needs_input_grad)")
    back.append("_ref = ctx._ref")
    if saved:
        back.append(f"{', '.join(saved)}, = ctx.saved_tensors")
    for n, attr in sorted(metas):
        back.append(f"{n}__{attr} = ctx.{n}__{attr}")
    for n in sorted(shapes):
        back.append(f"{n}__shapes = ctx.{n}__shapes")
    for n in ctx_params:
        back.append(f"{n} = ctx.{n}")
    back.append("needs = input_demand(ctx, ctx._tensor_args)")
    for t in formulas:
        back.append(f"need_{t} = {need_expr(t, 'needs')}")
    for i in entry.intermediates:
        users = [t for t, f in formulas.items() if i.target in f.needs]
        code = rewrite(i.tree, real, tensor_params)
        back.append(f"if {_or([f'need_{t}' for t in users])}:\n    {i.target} = {code}")
    for t, f in formulas.items():
        code = rewrite(f.tree, real, tensor_params)
        if lst is not None and t == lst.name:
            needs = f"needs[{list_offset}:]"
            wrap = "v" if real else "wrap_meta(S, v, m)"
            metas_src = f"ctx.{t}__meta" if not real else needs
            back.append(
                f"grad_{t} = [None] * len({needs})\n"
                f"if need_{t}:\n"
                f"    grad_{t} = [{wrap} if n else None for v, m, n in zip({code}, {metas_src}, {needs})]"
            )
        elif real:
            back.append(f"grad_{t} = ({code}) if need_{t} else None")
        else:
            back.append(f"grad_{t} = wrap_meta(S, {code}, ctx.{t}__meta) if need_{t} else None")
    returns = ["None"] * (len(prefix) + 1)
    returns += [f"grad_{p.name}" if p.name in formulas else "None" for p in nonlist]
    if lst is not None:
        returns.append(
            f"*grad_{lst.name}"
            if lst.name in formulas
            else f"*([None] * len(ctx.needs_input_grad[{list_offset}:]))"
        )
    back.append(f"return ({', '.join(returns)},)")

    # ---- dispatch function
    dispatch_params = ", ".join(prefix + ["call"] + [p.name for p in schema.params])
    dispatch_body = f"out = {schema.class_name}.apply({unpack})\n"
    dispatch_body += "return out[0]" if entry.has_aux else "return out"
    return {
        "class_name": schema.class_name,
        "full_name": name,
        "func_name": schema.func_name,
        "granularity_short": entry.granularity.splitlines()[0],
        "forward_params": f"ctx, {unpack}",
        "forward_body": "\n".join(setup),
        "backward_body": "\n".join(back),
        "dispatch_params": dispatch_params,
        "dispatch_body": dispatch_body,
    }


def _table_context(entry: OpEntry) -> dict:
    schema = entry.schema
    params = []
    for p in schema.params:
        if not p.has_default:
            default_src = "None"
        elif isinstance(p.default, tuple) and p.default[:1] == ("torch_attr",):
            default_src = p.default[1]
        else:
            default_src = repr(p.default)
        params.append(
            {
                "name": p.name,
                "type": p.type,
                "has_default": p.has_default,
                "default_src": default_src,
                "kwonly": p.kwonly,
            }
        )
    if entry.accepts:
        import ast

        tree = ast.parse(entry.accepts, mode="eval")
        body = rewrite(tree, True, set())
        accepts_src = f"lambda {', '.join(p.name for p in schema.params)}: {body}"
    else:
        accepts_src = "None"
    return {
        "full_name": schema.full_name,
        "signature": schema.text,
        "params": params,
        "torch_functions": entry.torch_functions,
        "accepts_src": accepts_src,
        "accepts_text": entry.accepts or "",
        "granularity": entry.granularity,
        "source_file": entry.source_file,
        "multi_output": schema.returns == "Tensor[]",
        "forward_helper": entry.forward,
        "differentiable": [p.name for p in schema.params if p.name in entry.formulas],
    }


def _md_cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _docs_context(entries: list[OpEntry]) -> list[tuple[str, list[dict]]]:
    """Per YAML file, the rows of the supported-ops page."""
    by_file: dict[str, list[dict]] = {}
    for e in entries:
        functions = ", ".join(f"`{t.replace('.__get__', '')}`" for t in e.torch_functions)
        by_file.setdefault(e.source_file, []).append(
            {
                "full_name": e.schema.full_name,
                "functions_md": functions,
                "granularity_md": _md_cell(e.granularity),
                "accepts_md": f"`{_md_cell(e.accepts)}`" if e.accepts else "any",
            }
        )
    return sorted(by_file.items())


def source_hash(yaml_dir: Path) -> str:
    """sha256 over the YAML, the templates and the generator's own code."""
    h = hashlib.sha256()
    files = sorted(Path(yaml_dir).glob("*.yaml"))
    files += sorted(TEMPLATES.glob("*.j2")) + sorted(Path(__file__).resolve().parent.glob("*.py"))
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


_PLACEHOLDER = "SEMIRINGCLASSPLACEHOLDER"
_CACHE: dict[tuple[str, str], dict[str, str]] = {}


def render(yaml_dir: Path) -> dict[str, str]:
    """File name → black-formatted content of every generated file (memoised per source hash)."""
    key = (str(Path(yaml_dir).resolve()), source_hash(yaml_dir))
    if key not in _CACHE:
        _CACHE[key] = render_uncached(yaml_dir)
    return dict(_CACHE[key])


def render_uncached(yaml_dir: Path) -> dict[str, str]:
    """Render and format every generated file.

    The built-in semiring modules other than Real differ only in the semiring's class name,
    which never decides black's line breaks (imports and docstrings stay short), so one
    formatted text serves all of them with the name substituted afterwards."""
    entries = load_entries(yaml_dir)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    common = {
        "sources": ", ".join(sorted({f"derivatives/{e.source_file}" for e in entries})),
        "source_hash": source_hash(yaml_dir),
    }
    mode = black.Mode(line_length=100)
    module = env.get_template("semiring_module.py.j2")

    def module_text(cls: str | None, real: bool) -> str:
        ops = [_op_context(e, real=real, generic=cls is None) for e in entries]
        title = f"{cls} semiring" if cls else "generic path (any user-defined semiring)"
        text = module.render(ops=ops, semiring_class=cls, real=real, title=title, **common)
        return black.format_str(text, mode=mode)

    shared = module_text(_PLACEHOLDER, real=False)
    out: dict[str, str] = {}
    for mod_name, cls in SEMIRING_MODULES:
        if cls == "Real":
            out[f"{mod_name}.py"] = module_text(cls, real=True)
        elif cls is None:
            out[f"{mod_name}.py"] = module_text(None, real=False)
        else:
            out[f"{mod_name}.py"] = shared.replace(_PLACEHOLDER, cls)
    table = env.get_template("ops_table.py.j2").render(
        ops=[_table_context(e) for e in entries], **common
    )
    out["ops_table.py"] = black.format_str(table, mode=mode)
    out["SUPPORTED_OPS.md"] = env.get_template("supported_ops.md.j2").render(
        by_file=_docs_context(entries), **common
    )
    names = sorted(m for m, _ in SEMIRING_MODULES)
    out["__init__.py"] = black.format_str(
        f"# @generated by codegen/generate.py -- DO NOT EDIT.\n"
        f"# source-hash: {common['source_hash']}\n"
        '"""Generated semiring backward Functions (see derivatives/*.yaml)."""\n'
        f"from . import ops_table, {', '.join(names)}\n"
        f"MODULES = {{{', '.join(f'{n!r}: {n}' for n in names)}}}\n",
        mode=mode,
    )
    return out


def write(yaml_dir: Path, out_dir: Path, check: bool) -> list[str]:
    """Write (or with ``check`` only compare) generated files; return the stale ones."""
    files = render(yaml_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = []
    for name, text in files.items():
        path = out_dir / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            stale.append(name)
            if not check:
                path.write_text(text, encoding="utf-8")
    for extra in sorted(p.name for p in out_dir.glob("*.py") if p.name not in files):
        stale.append(extra)
        if not check:
            (out_dir / extra).unlink()
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="generate", description=__doc__.splitlines()[0])
    parser.add_argument("--yaml-dir", type=Path, default=ROOT / "derivatives")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "generated")
    parser.add_argument("--check", action="store_true", help="fail if generated/ is stale")
    args = parser.parse_args(argv)
    try:
        stale = write(args.yaml_dir, args.out_dir, args.check)
    except (DerivativesError, CodegenError) as exc:
        print(f"generate: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if stale:
            print(
                f"generate --check: stale files in {args.out_dir}: {', '.join(stale)}; "
                "run `generate` and commit the result",
                file=sys.stderr,
            )
            return 1
        print(f"generate --check: {args.out_dir} is up to date")
        return 0
    print(
        f"generate: wrote {len(stale)} changed file(s) to {args.out_dir}"
        + (f": {', '.join(stale)}" if stale else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
