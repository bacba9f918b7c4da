"""The HTML summary of a dataset run (``out/report.html``, from ``out/records.*``).

Sections: the run (model, semirings, records, error rows); where the strongest token lies
relative to the read position (a histogram of ``strongest_offset``: 0 is the token read,
-3 three tokens before it); the modules on the records' top paths (how many records' top
path crosses each module, per layer and part); with a run's ``flow``, the flow through
modules summed over records (per semiring, a layer × part table of the records' shares,
coloured by their mean, with the sums also in a JSON block, ``<script id="flow-data">``);
the most frequent top-path shapes (the modules a path crosses, in order); and one line per
record, linked to its own page (``out/pages/NNNNNN.html``) where the run wrote one.
"""

from __future__ import annotations

import html
import json
import os
import math
import re
from collections import Counter
from pathlib import Path as FilePath
from typing import Any, Sequence

#: the histogram's bar colour
BAR = "#3b6ea8"
#: the flow table's colours (r, g, b) of positive and negative mean shares
FLOW_COLOURS = ((46, 139, 87), (192, 57, 43))
#: steps that are not a module of the model
_NOT_MODULES = {"input", "(outside sa.patch)", ""}


def page_name(index: int) -> str:
    """The file name of record ``index``'s page under ``out/pages``."""
    return f"{index:06d}.html"


def path_modules(path: dict[str, Any] | None) -> list[str]:
    """The modules a top path (a ``top_path`` cell) crosses, in order, each once per
    visit: consecutive steps in one module are one visit; the model's own class (a
    read-out at its top level) and the input are left out."""
    if not path:
        return []
    visits: list[str] = []
    for step in path["steps"]:
        module = step["module"]
        if module in _NOT_MODULES or "." not in module and module[:1].isupper():
            continue
        if not visits or visits[-1] != module:
            visits.append(module)
    return visits


def _short(module: str) -> str:
    """A module's name without the model's wrapper prefix: ``layers.3.mlp``."""
    return re.sub(r"^(model|transformer|gpt_neox|base_model)\.", "", module)


def histogram_svg(counts: Counter, width: int = 640, height: int = 160) -> str:
    """An inline SVG bar chart of ``counts`` (offset → records), one bar per offset from the
    smallest to the largest seen, each bar titled with its offset and count."""
    if not counts:
        return "<p>No attributed record.</p>"
    low, high = min(counts), max(counts)
    offsets = list(range(low, high + 1))
    step = min(width / len(offsets), 40.0)
    tallest = max(counts.values())
    bars, labels = [], []
    for i, offset in enumerate(offsets):
        n = counts.get(offset, 0)
        h = (height - 20) * n / tallest
        x = i * step
        bars.append(
            f'<rect class="bar" data-offset="{offset}" data-count="{n}" x="{x + 1:.1f}" '
            f'y="{height - 20 - h:.1f}" width="{max(step - 2, 1):.1f}" height="{h:.1f}" '
            f'fill="{BAR}"><title>offset {offset}: {n} records</title></rect>'
        )
        if len(offsets) <= 40 or offset % 5 == 0:
            labels.append(
                f'<text x="{x + step / 2:.1f}" y="{height - 5}" font-size="11" '
                f'text-anchor="middle">{offset}</text>'
            )
    return (
        f'<svg class="histogram" width="{width}" height="{height}" role="img" '
        f'aria-label="records by strongest-token offset">{"".join(bars)}{"".join(labels)}</svg>'
    )


def write_report(out: str | os.PathLike, rows: list[dict[str, Any]]) -> FilePath:
    """``out/report.html`` from the merged table's ``rows`` and the manifest of the run in
    ``out``; its path."""
    out = FilePath(out)
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    page = report_page(rows, manifest, pages=out / "pages")
    target = out / "report.html"
    staging = out / ".report.html.tmp"
    staging.write_text(page, encoding="utf-8")
    os.replace(staging, target)
    return target


def report_page(
    rows: Sequence[dict[str, Any]], manifest: dict[str, Any], pages: FilePath | None = None
) -> str:
    """The summary page of a run's ``rows`` (see the module's docstring)."""
    good = [r for r in rows if r.get("error") is None]
    offsets = Counter(int(r["strongest_offset"]) for r in good)
    paths = [path_modules(r.get("top_path")) for r in good]
    crossed = Counter(m for visits in paths for m in set(visits))
    shapes = Counter(" → ".join(_short(m) for m in visits) for visits in paths if visits)
    semirings = ", ".join(manifest.get("semirings", []))
    title = f"Dataset attribution — {manifest.get('model', '')}"
    head = (
        f"<dl class='context'><dt>model</dt><dd>{html.escape(str(manifest.get('model')))}</dd>"
        f"<dt>semirings</dt><dd>{html.escape(semirings)}</dd>"
        f"<dt>records</dt><dd>{len(rows)} ({len(rows) - len(good)} error rows)</dd></dl>"
    )
    first = (manifest.get("semirings") or ["the first semiring"])[0]
    sections = [
        "<section id='offsets'><h2>Where the strongest token lies</h2>"
        f"<p>Per record, the token with the largest {html.escape(first)} score, minus the "
        "read position (0: the token whose logits are read; −3: three tokens before it).</p>"
        + histogram_svg(offsets)
        + "</section>",
        _modules_section(crossed, len(good), bool(paths and any(paths))),
        _flow_section(good, manifest),
        _shapes_section(shapes),
        _records_section(rows, pages),
    ]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 0; color: #111; overflow-wrap: break-word; }}
header.report {{ background: #e8eef6; margin: 0 0 1em; padding: 0.6em 2em; }}
header.report h1 {{ font-size: 1.4em; margin: 0.3em 0; }}
main {{ display: block; margin: 0 2em 2em; }}
dl.context {{ display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: 2px 1em; }}
dl.context dt {{ font-weight: bold; }} dl.context dd {{ margin: 0; }}
table {{ border-collapse: collapse; max-width: 100%; }} td, th {{ padding: 2px 6px; text-align: left; vertical-align: top; }}
td {{ overflow-wrap: anywhere; }}
td.num {{ text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }}
svg.histogram {{ max-width: 100%; height: auto; }}
</style></head><body>
<header class="report"><h1>{html.escape(title)}</h1>{head}</header>
<main>
{"".join(sections)}
</main>
</body></html>
"""


def _modules_section(crossed: Counter, records: int, any_paths: bool) -> str:
    if not any_paths:
        return (
            "<section id='modules'><h2>Modules on the top paths</h2><p>The run kept no top "
            "path (no max semiring, or paths off).</p></section>"
        )
    rows = "".join(
        f"<tr><td>{html.escape(_short(m))}</td><td class='num'>{n}</td>"
        f"<td class='num'>{n / records:.0%}</td></tr>"
        for m, n in sorted(crossed.items(), key=lambda item: _module_order(item[0]))
    )
    return (
        "<section id='modules'><h2>Modules on the top paths</h2>"
        "<p>Per module, the records whose strongest path crosses it.</p>"
        f"<table><tr><th>module</th><th>records</th><th>share</th></tr>{rows}</table></section>"
    )


def flow_sums(rows: Sequence[dict[str, Any]], column: str) -> list[dict[str, Any]]:
    """Per module of the rows' ``column`` cells (in the cells' order): its ``module``,
    ``layer``, ``part``, ``records`` (rows with a cell), ``flow_sum`` (Σ of their flows),
    ``shares`` (rows with a share) and ``share_sum`` (Σ of their shares)."""
    sums: dict[str, dict[str, Any]] = {}
    for row in rows:
        for cell in row.get(column) or []:
            entry = sums.setdefault(
                cell["module"],
                {
                    "module": cell["module"],
                    "layer": cell["layer"],
                    "part": cell["part"],
                    "records": 0,
                    "flow_sum": 0.0,
                    "shares": 0,
                    "share_sum": 0.0,
                },
            )
            entry["records"] += 1
            entry["flow_sum"] += cell["flow"]
            if cell["share"] is not None:
                entry["shares"] += 1
                entry["share_sum"] += cell["share"]
    return list(sums.values())


def _flow_section(good: Sequence[dict[str, Any]], manifest: dict[str, Any]) -> str:
    head = "<section id='flow'><h2>Flow through modules</h2>"
    tables, data = [], {}
    for name in manifest.get("semirings", []):
        column = "flow_" + name.replace("-", "_")
        sums = flow_sums(good, column)
        if sums:
            data[name] = sums
            tables.append(f"<h3>{html.escape(name)}</h3>" + _flow_table(name, sums))
    if not tables:
        return head + "<p>The run recorded no flow (flow off).</p></section>"
    blob = json.dumps({n: [_json_safe(e) for e in s] for n, s in data.items()})
    return (
        head + "<p>Per record and module (a decoder layer's attention or MLP output), the "
        "readout over the paths from the record's tokens to its target that cross the "
        "module (<code>sa.module_flow</code>, ⊕ over the record's embeddings), and its "
        "share of the readout over all paths: the strongest path through the module over "
        "the strongest path (max-product; 1: the record's strongest path crosses it), the "
        "part of the total path weight through it (log, counting), the gradient through it "
        "over the summed gradient (real). Each cell shows the mean share over the records; "
        "its tooltip and data attributes hold the sums of the records' shares and flows."
        "</p>"
        + "".join(tables)
        + "<script type='application/json' id='flow-data'>"
        + blob.replace("</", "<\\/")
        + "</script></section>"
    )


def _flow_table(name: str, sums: list[dict[str, Any]]) -> str:
    """A layer × part table of ``sums``, each cell coloured by its mean share."""
    parts = list(dict.fromkeys(e["part"] for e in sums))
    layers = sorted({e["layer"] for e in sums}, key=lambda n: (n is None, n or 0))
    cells = {(e["layer"], e["part"]): e for e in sums}
    means = [e["share_sum"] / e["shares"] for e in sums if e["shares"]]
    top = max((abs(m) for m in means if math.isfinite(m)), default=0.0) or 1.0
    lines = []
    for layer in layers:
        tds = "".join(_flow_cell(cells.get((layer, part)), top) for part in parts)
        label = "—" if layer is None else str(layer)
        lines.append(f"<tr><th>{label}</th>{tds}</tr>")
    header = "".join(f"<th>{html.escape(p)}</th>" for p in parts)
    return (
        f"<table class='flow' data-semiring='{html.escape(name)}'><tr><th>layer</th>"
        f"{header}</tr>{''.join(lines)}</table>"
    )


def _flow_cell(entry: dict[str, Any] | None, top: float) -> str:
    if entry is None:
        return "<td></td>"
    shares = entry["shares"]
    mean = entry["share_sum"] / shares if shares else math.nan
    style = ""
    if math.isfinite(mean):
        r, g, b = FLOW_COLOURS[mean < 0]
        style = f" style='background: rgba({r}, {g}, {b}, {min(abs(mean) / top, 1.0):.3f})'"
    title = (
        f"{entry['module']}: Σ share {entry['share_sum']:.6g} over {shares} records, "
        f"Σ flow {entry['flow_sum']:.6g} over {entry['records']} records"
    )
    return (
        f"<td class='num flow' data-module='{html.escape(entry['module'])}' "
        f"data-records='{entry['records']}' data-flow-sum='{entry['flow_sum']!r}' "
        f"data-shares='{shares}' data-share-sum='{entry['share_sum']!r}'{style} "
        f"title='{html.escape(title)}'>{mean:.3f}</td>"
    )


def _json_safe(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` with each float that JSON cannot hold (inf, nan) as its name, a string."""
    return {
        k: repr(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in entry.items()
    }


def _module_order(module: str) -> tuple:
    """Layers in numeric order, parts by name."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", module))


def _shapes_section(shapes: Counter) -> str:
    if not shapes:
        return ""
    rows = "".join(
        f"<tr><td class='num'>{n}</td><td>{html.escape(shape)}</td></tr>"
        for shape, n in shapes.most_common(10)
    )
    return (
        "<section id='shapes'><h2>Most frequent top-path shapes</h2>"
        "<p>The modules a strongest path crosses, in order.</p>"
        f"<table><tr><th>records</th><th>shape</th></tr>{rows}</table></section>"
    )


def _records_section(rows: Sequence[dict[str, Any]], pages: FilePath | None) -> str:
    lines = []
    for r in rows:
        name = page_name(r["index"])
        text = html.escape(str(r.get("text") or ""))
        if pages is not None and (pages / name).exists():
            text = f"<a href='pages/{name}'>{text or '(empty)'}</a>"
        if r.get("error") is not None:
            rest = f"<td colspan='3'>error: {html.escape(r['error'])}</td>"
        else:
            token = r["tokens"][r["strongest_token"]]
            rest = (
                f"<td>{html.escape(str(r['target']))}</td>"
                f"<td>{html.escape(repr(r['prediction']))}</td>"
                f"<td>{html.escape(repr(token))} ({r['strongest_offset']:+d})</td>"
            )
        lines.append(f"<tr><td class='num'>{r['index']}</td><td>{text}</td>{rest}</tr>")
    return (
        "<section id='records'><h2>Records</h2><table><tr><th>#</th><th>text</th>"
        "<th>target</th><th>prediction</th><th>strongest token (offset)</th></tr>"
        + "".join(lines)
        + "</table></section>"
    )
