"""Reports of an attribution: a self-contained HTML page and a PNG bar chart.

Both draw a token's score on the same colour scale, anchored at zero: white at 0 and red
at the largest score for readouts that are never negative (MaxProduct, Entropy, Counting,
Boolean), diverging — blue below zero, red above — for signed ones (Real,
SignedMaxProduct, Log), with a colour-bar legend in the readout's unit. A page opens with
what the model predicted (model, text, the position read, the target's logit and
probability, the most probable tokens); several semirings on one text make one comparison.
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass
from pathlib import Path as FilePath
from typing import Any, Protocol, Sequence

import torch
from torch import Tensor

from ..semirings.registry import inherited_spec

#: the scale's colours: below zero, at zero, above zero (sRGB)
NEGATIVE = (33, 102, 172)
ZERO = (255, 255, 255)
POSITIVE = (178, 24, 43)
#: a token whose score is not a number (NaN, or ±inf: no path) is drawn in grey
NOT_FINITE = (190, 190, 190)


class Scores(Protocol):
    """What a report reads of an attribution (:class:`sa.Attribution` is one)."""

    tokens: list[str]
    semiring: Any
    target: str
    paths: list[Any]
    min_paths: list[Any]
    prediction: Any

    @property
    def meaning(self) -> str: ...

    @property
    def unit(self) -> str: ...

    def display_scores(self) -> Tensor: ...

    def min_scores(self) -> Tensor | None: ...

    def best_token(self) -> int: ...

    def headline_paths(self) -> list[tuple[str, int, list[Any]]]: ...


@dataclass(frozen=True)
class Scale:
    """A colour scale anchored at zero. Sequential: 0 → white, ``limit`` → red. Diverging:
    −``limit`` → blue, 0 → white, ``limit`` → red. Values beyond the limit are clipped."""

    diverging: bool
    limit: float
    label: str

    @classmethod
    def of(cls, result: Scores) -> "Scale":
        """The scale of an attribution's scores (SignedMaxProduct: both rows): diverging for
        a semiring whose readouts can be negative, or when a score is negative; the limit is
        the largest finite magnitude (1 when there is none or it is 0)."""
        scores = result.display_scores()
        low = result.min_scores()
        values = scores if low is None else torch.cat([scores, low])
        finite = values[torch.isfinite(values)]
        spec = inherited_spec(result.semiring)
        signed = (spec is not None and spec.signed) or bool((finite < 0).any())
        limit = float(finite.abs().max()) if finite.numel() else 0.0
        label = f"{result.meaning} [{result.unit}]"
        return cls(signed, limit if limit > 0 else 1.0, label)

    @property
    def lower(self) -> float:
        return -self.limit if self.diverging else 0.0

    def colour(self, value: float) -> tuple[int, int, int]:
        """The sRGB colour of ``value``."""
        if not math.isfinite(value):
            return NOT_FINITE
        t = max(-1.0, min(1.0, value / self.limit))
        if t < 0 and not self.diverging:
            t = 0.0
        end = POSITIVE if t >= 0 else NEGATIVE
        a = abs(t)
        return tuple(round(z + (e - z) * a) for z, e in zip(ZERO, end))  # type: ignore

    def css_gradient(self) -> str:
        stops = [NEGATIVE, ZERO, POSITIVE] if self.diverging else [ZERO, POSITIVE]
        return "linear-gradient(to right, " + ", ".join(_css(c) for c in stops) + ")"

    def ticks(self) -> list[float]:
        return [self.lower, 0.0, self.limit] if self.diverging else [0.0, self.limit]


def _css(colour: tuple[int, int, int]) -> str:
    return f"rgb({colour[0]}, {colour[1]}, {colour[2]})"


def _ink(colour: tuple[int, int, int]) -> str:
    """Black or white text, whichever reads on ``colour``."""
    luminance = (0.299 * colour[0] + 0.587 * colour[1] + 0.114 * colour[2]) / 255
    return "#000" if luminance > 0.55 else "#fff"


def _groups(result: Any) -> list[list[Scores]]:
    """One list per text: an attribution, a list of them (one per text), or a list whose
    items are lists of attributions of one text under several semirings."""
    if not isinstance(result, Sequence):
        return [[result]]
    groups = [list(r) if isinstance(r, Sequence) else [r] for r in result]
    if not groups or any(not g for g in groups):
        raise ValueError("html_page needs at least one attribution per text")
    return groups


def html_page(
    result: Scores | Sequence[Scores] | Sequence[Sequence[Scores]],
    path: str | os.PathLike | None = None,
) -> str:
    """A self-contained HTML page: per text, what the model predicted, the tokens as a heat
    map of their scores on a zero-anchored scale with its colour-bar legend, a score table
    and the headline paths (every token's path in a collapsible section). ``result``: one
    attribution, one per text, or per text a list of attributions under several semirings
    (a comparison). Written to ``path`` when given; returned either way."""
    groups = _groups(result)
    first = groups[0][0]
    names = [type(r.semiring).__name__ for r in groups[0]]
    what = f"{names[0]} attribution" if len(names) == 1 else f"{len(names)} semirings compared"
    title = f"{what} — target {first.target}"
    if len(groups) > 1:
        title = f"{what} on {len(groups)} texts — target {first.target}"
    numbered = len(groups) > 1
    body = "\n".join(
        _text_section(group, i if numbered else None) for i, group in enumerate(groups)
    )
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 0 2em 2em; color: #111; }}
header.report {{ background: #e8eef6; margin: 0 -2em 1em; padding: 0.6em 2em; }}
header.report h1 {{ font-size: 1.4em; margin: 0.3em 0; }}
dl.context {{ display: grid; grid-template-columns: max-content auto; gap: 2px 1em; margin: 0.5em 0; }}
dl.context dt {{ font-weight: bold; }} dl.context dd {{ margin: 0; }}
.tok {{ padding: 3px 4px; margin: 1px; border-radius: 3px; white-space: pre; font-size: 1.2em; }}
.legend {{ display: inline-block; margin: 0.5em 0 1em; font-size: 0.85em; }}
.legends {{ display: flex; flex-wrap: wrap; gap: 0 2em; margin-top: 1em; }}
.legend .bar {{ width: 320px; height: 16px; border: 1px solid #444; }}
.legend .ticks {{ display: flex; justify-content: space-between; width: 322px; }}
table {{ border-collapse: collapse; }} td, th {{ padding: 2px 8px; text-align: left; }}
td {{ white-space: pre; }}
td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
pre {{ background: #f6f6f6; padding: 1em; overflow-x: auto; }}
</style></head><body>
<header class="report"><h1>{html.escape(title)}</h1>
{_context(first, "shared" if numbered else "all")}</header>
{body}
</body></html>
"""
    if path is not None:
        FilePath(path).write_text(page, encoding="utf-8")
    return page


def _context(result: Scores, which: str) -> str:
    """The prediction behind an attribution, as a definition list: ``which`` = "all", or
    "shared" (model and target: a page of several texts) or "own" (the rest: one text)."""
    p = result.prediction
    rows = [("target", result.target)]
    if p is not None:
        rows.insert(0, ("model", p.model))
        if p.text is not None:
            rows.append(("text", repr(p.text)))
        if p.position is not None:
            rows.append(("logits read at", f"position {p.position}, token {p.token!r}"))
        rows.append(
            (
                "target's logit",
                f"{p.target_logit:.4g}, probability {p.target_probability:.4g} "
                f"(rank {p.target_rank})",
            )
        )
        rows.append(("most probable", ", ".join(f"{t!r} {q:.3f}" for t, q in p.top)))
    if which != "all":
        shared = {"model", "target"}
        rows = [(k, v) for k, v in rows if (k in shared) == (which == "shared")]
    items = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in rows)
    return f'<dl class="context">{items}</dl>'


def _legend(scale: Scale) -> str:
    ticks = "".join(f"<span>{v:.4g}</span>" for v in scale.ticks())
    return (
        f'<div class="legend"><div class="bar" style="background: {scale.css_gradient()}">'
        f'</div><div class="ticks">{ticks}</div><div>{html.escape(scale.label)}</div></div>'
    )


def _token_span(token: str, i: int, score: float, scale: Scale) -> str:
    colour = scale.colour(score)
    return (
        f'<span class="tok" style="background: {_css(colour)}; color: {_ink(colour)}" '
        f'title="token {i}: {score:.6g}">{html.escape(token)}</span>'
    )


def _paths(result: Scores) -> str:
    """The headline paths open, then every token's path collapsed."""
    if not result.paths:
        return ""
    tokens = result.tokens
    parts = ["<h3>Paths</h3>"]
    for title, token, paths in result.headline_paths():
        text = paths[token].format(tokens=tokens)
        parts.append(
            f"<details open><summary>{html.escape(title)}</summary>"
            f"<pre>{html.escape(text)}</pre></details>"
        )
    for label, paths in (("largest", result.paths), ("smallest", result.min_paths)):
        for i, p in enumerate(paths):
            if p is None:
                continue
            kind = f" ({label})" if result.min_paths else ""
            parts.append(
                f"<details><summary>token {i} {html.escape(repr(tokens[i]))}{kind}: weight "
                f"{p.weight:.6g}</summary><pre>{html.escape(p.format(tokens=tokens))}</pre>"
                "</details>"
            )
    return "\n".join(parts)


def _text_section(group: list[Scores], number: int | None) -> str:
    """One text: one semiring's heat map, table and paths, or a comparison of several."""
    first = group[0]
    head = ""
    if number is not None:
        text = first.prediction.text if first.prediction is not None else None
        about = f": {text!r}" if text is not None else ""
        head = f"<h2>Text {number + 1}{html.escape(about)}</h2>\n{_context(first, 'own')}\n"
    if len(group) == 1:
        return head + _single(first)
    return head + _comparison(group)


def _single(result: Scores) -> str:
    scale = Scale.of(result)
    scores = result.display_scores().tolist()
    low = result.min_scores()
    spans = "".join(
        _token_span(t, i, s, scale) for i, (t, s) in enumerate(zip(result.tokens, scores))
    )
    heading = "<th>score</th>" if low is None else "<th>largest</th><th>smallest</th>"
    rows = []
    for i, (t, s) in enumerate(zip(result.tokens, scores)):
        cells = _cell(s, scale)
        if low is not None:
            cells += _cell(float(low[i]), scale)
        rows.append(f"<tr><td>{i}</td><td>{html.escape(repr(t))}</td>{cells}</tr>")
    shown = "" if low is None else " Heat map: the largest signed product."
    return f"""<h2>{html.escape(type(result.semiring).__name__)}: {html.escape(result.meaning)}</h2>
<p>Score per token: the semiring's ⊕ over the token's embedding elements.{shown}</p>
<p class="tokens">{spans}</p>
{_legend(scale)}
<table><tr><th>#</th><th>token</th>{heading}</tr>
{"".join(rows)}
</table>
{_paths(result)}"""


def _cell(value: float, scale: Scale) -> str:
    colour = scale.colour(value)
    return (
        f'<td class="num" style="background: {_css(colour)}; color: {_ink(colour)}">'
        f"{value:.6g}</td>"
    )


def _comparison(group: list[Scores]) -> str:
    """Several semirings on one text: a table of tokens × semirings, each column on its own
    scale, the legends, and the paths of the semirings that have them."""
    tokens = group[0].tokens
    if any(r.tokens != tokens for r in group):
        raise ValueError("a comparison needs attributions of the same tokens")
    scales = [Scale.of(r) for r in group]
    heads = "".join(
        f"<th>{html.escape(type(r.semiring).__name__)}<br><small>{html.escape(r.meaning)}"
        "</small></th>"
        for r in group
    )
    columns = [r.display_scores().tolist() for r in group]
    rows = []
    for i, t in enumerate(tokens):
        cells = "".join(_cell(c[i], s) for c, s in zip(columns, scales))
        rows.append(f"<tr><td>{i}</td><td>{html.escape(repr(t))}</td>{cells}</tr>")
    legends = "".join(
        f"<div><b>{html.escape(type(r.semiring).__name__)}</b><br>{_legend(s)}</div>"
        for r, s in zip(group, scales)
    )
    paths = "".join(
        f"<h2>{html.escape(type(r.semiring).__name__)}</h2>{_paths(r)}" for r in group if r.paths
    )
    return f"""<h2>Semirings compared</h2>
<p>Score per token: each semiring's ⊕ over the token's embedding elements; each column is
coloured on its own zero-anchored scale (legends below). SignedMaxProduct: the largest
signed product.</p>
<table><tr><th>#</th><th>token</th>{heads}</tr>
{"".join(rows)}
</table>
<div class="legends">{legends}</div>
{paths}"""


def plot_scores(result: Scores | Sequence[Scores], path: str | os.PathLike) -> None:
    """A PNG bar chart of the token scores, one panel per attribution (several: semirings
    compared on one text), each bar coloured on the report's scale, with its colour bar
    (needs matplotlib: the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import ListedColormap, Normalize
    except ImportError as exc:
        raise ImportError(
            "Attribution.plot needs matplotlib: pip install 'semiring-autograd[plot]'"
        ) from exc
    results = list(result) if isinstance(result, Sequence) else [result]
    tokens = results[0].tokens
    fig, axes = plt.subplots(
        len(results),
        1,
        figsize=(max(7, 0.8 * len(tokens) + 2), 1.2 + 2.6 * len(results)),
        squeeze=False,
        layout="constrained",
    )
    for ax, r in zip(axes[:, 0], results):
        scale = Scale.of(r)
        scores = r.display_scores().tolist()
        shown = [s if math.isfinite(s) else 0.0 for s in scores]
        colours = [tuple(c / 255 for c in scale.colour(s)) for s in scores]
        ax.bar(range(len(tokens)), shown, color=colours, edgecolor="#444", linewidth=0.6)
        ax.axhline(0.0, color="#444", linewidth=0.8)
        ax.set_xticks(range(len(tokens)), [repr(t) for t in tokens], rotation=60, fontsize=8)
        ax.set_ylabel("score", fontsize=8)
        ax.set_title(f"{type(r.semiring).__name__}: {r.meaning}", fontsize=9)
        ax.set_ylim(*_limits(scale, shown))
        samples = [
            scale.colour(scale.lower + (scale.limit - scale.lower) * k / 255) for k in range(256)
        ]
        cmap = ListedColormap([tuple(c / 255 for c in rgb) for rgb in samples])
        bar = fig.colorbar(
            ScalarMappable(Normalize(scale.lower, scale.limit), cmap), ax=ax, pad=0.02
        )
        bar.set_label(r.unit, fontsize=8)
    first = results[0]
    title = f"target {first.target}"
    if first.prediction is not None:
        p = first.prediction
        text = "" if p.text is None else f" — {p.text!r}"
        title = f"{p.model}{text}; {title}, probability {p.target_probability:.3g}"
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, format="png")
    plt.close(fig)


def _limits(scale: Scale, values: list[float]) -> tuple[float, float]:
    """y limits that include zero and every bar, with a margin."""
    lo = min([0.0, *values])
    hi = max([0.0, *values])
    span = (hi - lo) or scale.limit
    return lo - 0.05 * span * (lo < 0), hi + 0.05 * span
