"""``generate``: render derivatives/*.yaml into generated/ (``--check``: fail if stale).

The loader builds the typed model of the YAML (:mod:`.model`); named Jinja templates
render it: ``functions.py.j2`` once per target (:mod:`.targets`: a module specialised to
each built-in semiring the registry gives its own module, and the generic module),
``ops_table.py.j2`` (signatures, torch functions, granularity), ``package_init.py.j2`` and
``supported_ops.md.j2`` (the docs page of every supported torch function). Formulas are
translated per target by :func:`.formulas.rewrite`. Output is black-formatted,
deterministic, and only changed files are rewritten.

From a source checkout the defaults are the checkout's ``derivatives/`` and
``generated/``; from an installed copy, the YAML shipped in the package and
``./generated``.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import hashlib
import multiprocessing
import os
import sys
from importlib import resources
from pathlib import Path

import black
import jinja2

from .formulas import Flavour, rewrite
from .loader import DerivativesError, load_entries
from .model import OpEntry
from .schema import Param
from .targets import CodegenError, targets

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"
#: the source checkout this file sits in, when it does (codegen/ beside pyproject.toml)
CHECKOUT = HERE.parent if (HERE.parent / "pyproject.toml").is_file() else None
_CONDITION = Flavour("generic")


def default_yaml_dir() -> Path:
    """The checkout's derivatives/, or the YAML installed with the package."""
    if CHECKOUT is not None:
        return CHECKOUT / "derivatives"
    return Path(str(resources.files("semiring_autograd.derivatives")))


def default_out_dir() -> Path:
    """The checkout's generated/, or ./generated from an installed copy."""
    return CHECKOUT / "generated" if CHECKOUT is not None else Path("generated")


def _default_source(p: Param) -> str:
    """A parameter's default as Python source for the op table."""
    if not p.has_default:
        return "None"
    if isinstance(p.default, tuple) and p.default[:1] == ("torch_attr",):
        return p.default[1]
    return repr(p.default)


def _md_cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _format(source: str) -> str:
    """``source`` formatted by black (line length 100). Without black's check that the
    AST is unchanged (``fast``): the tests import and run every generated module."""
    try:
        return black.format_file_contents(source, fast=True, mode=black.Mode(line_length=100))
    except black.NothingChanged:
        return source


def _format_all(sources: list[str]) -> list[str]:
    """:func:`_format` of each source, in worker processes where the machine has several
    cores (black formats one file on one core; the generic module alone takes seconds)."""
    workers = min(len(sources), os.cpu_count() or 1)
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return [_format(s) for s in sources]
    # the largest files first, so that no worker is left with a large one at the end
    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        formatted = dict(zip(order, pool.map(_format, [sources[i] for i in order])))
    return [formatted[i] for i in range(len(sources))]


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["default_source"] = _default_source
    env.filters["md_cell"] = _md_cell
    return env


def source_hash(yaml_dir: Path) -> str:
    """sha256 over the YAML, the templates, the generator's own code and the targets the
    semiring registry asks for (their inline forms included)."""
    h = hashlib.sha256()
    files = sorted(Path(yaml_dir).glob("*.yaml"))
    files += sorted(TEMPLATES.glob("*.j2")) + sorted(HERE.glob("*.py"))
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(repr(targets()).encode())
    return h.hexdigest()[:16]


_CACHE: dict[tuple[str, str], dict[str, str]] = {}


def render(yaml_dir: Path) -> dict[str, str]:
    """File name → black-formatted content of every generated file (memoised per source hash)."""
    key = (str(Path(yaml_dir).resolve()), source_hash(yaml_dir))
    if key not in _CACHE:
        _CACHE[key] = render_uncached(yaml_dir)
    return dict(_CACHE[key])


def render_uncached(yaml_dir: Path) -> dict[str, str]:
    """Render and format every generated file."""
    entries = load_entries(yaml_dir)
    env = _environment()
    common = {
        "sources": ", ".join(sorted({f"derivatives/{e.source_file}" for e in entries})),
        "source_hash": source_hash(yaml_dir),
    }
    out: dict[str, str] = {}
    functions = env.get_template("functions.py.j2")
    all_targets = targets()

    def condition(source: str) -> str:
        return rewrite(ast.parse(source, mode="eval"), _CONDITION, set())

    for target in all_targets:

        def code(op: OpEntry, formula, flavour: Flavour = target.flavour) -> str:
            return rewrite(formula.tree, flavour, op.tensor_params)

        out[f"{target.module}.py"] = functions.render(
            ops=entries, target=target, code=code, condition=condition, **common
        )
    out["ops_table.py"] = env.get_template("ops_table.py.j2").render(
        ops=entries, condition=condition, **common
    )
    out["__init__.py"] = env.get_template("package_init.py.j2").render(
        targets=all_targets, **common
    )
    out = dict(zip(out, _format_all(list(out.values()))))
    by_file: dict[str, list[OpEntry]] = {}
    for e in entries:
        by_file.setdefault(e.source_file, []).append(e)
    out["SUPPORTED_OPS.md"] = env.get_template("supported_ops.md.j2").render(
        by_file=sorted(by_file.items()), **common
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
    parser.add_argument(
        "--yaml-dir", type=Path, default=None, help="default: " + str(default_yaml_dir())
    )
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="default: " + str(default_out_dir())
    )
    parser.add_argument("--check", action="store_true", help="fail if generated/ is stale")
    args = parser.parse_args(argv)
    args.yaml_dir = args.yaml_dir or default_yaml_dir()
    args.out_dir = args.out_dir or default_out_dir()
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
