"""Reports of an attribution: a self-contained HTML page and a PNG bar chart.

Both colour a token's score on its semiring's scale (the registry's ``scale``): anchored at
zero — white at 0 and red at the largest score for readouts that are never negative
(MaxProduct), diverging — blue below zero, red above — for signed ones (Real,
SignedMaxProduct); for log-domain readouts (Log, Entropy, Counting) by the difference from
the largest score, which is red, down to the smallest, which is white (a token no path
reaches is grey, outside the scale); for Boolean two colours, path and no path. Each scale
has a legend saying what its colours mean. A page
opens with what the model predicted (model, text, the position read, the target's logit
and probability, the most probable tokens); several semirings on one text make one
comparison; several texts share one scale per semiring unless asked otherwise.
"""

from __future__ import annotations

import html
import math
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path as FilePath
from typing import Any, Literal, Protocol, Sequence

import torch
from torch import Tensor

from ..semirings.registry import inherited_spec

#: the scale's colours: below zero, at zero (or the smallest), at the top (sRGB)
NEGATIVE = (33, 102, 172)
ZERO = (255, 255, 255)
POSITIVE = (178, 24, 43)
#: a token whose score is not a number (NaN, or ±inf: no path) is drawn in grey
NOT_FINITE = (190, 190, 190)

ScaleKind = Literal["sequential", "diverging", "from_best", "presence"]


class Scores(Protocol):
    """What a report reads of an attribution (:class:`~.attribution.Attribution` is one)."""

    tokens: list[str]
    semiring: Any
    target: str
    paths: list[Any]
    min_paths: list[Any]
    prediction: Any
    reached: Tensor | None

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
    """A colour scale of one semiring's scores. ``sequential``: ``lower`` (0) → white,
    ``upper`` → red. ``diverging``: −``upper`` → blue, 0 → white, ``upper`` → red.
    ``from_best``: the largest score ``upper`` → red, the smallest ``lower`` → white (a
    token's colour is its difference from the largest). ``presence``: red where a path
    exists (score > 0), white where none. Values beyond the ends are clipped; a value that
    is not a number is grey."""

    kind: ScaleKind
    lower: float
    upper: float
    label: str

    @classmethod
    def of(cls, result: Scores) -> "Scale":
        """The scale of one attribution's scores."""
        return cls.over([result])

    @classmethod
    def over(cls, results: Sequence[Scores]) -> "Scale":
        """One scale for the scores of ``results`` (attributions under one semiring, e.g.
        of several texts; SignedMaxProduct: both rows), of the kind the semiring's registry
        entry names. Zero-anchored: diverging for a semiring whose readouts can be negative
        or when a score is negative, up to the largest finite magnitude (1 when there is
        none or it is 0). From the best: from the smallest finite score to the largest
        (the largest − 1 when they are equal)."""
        first = results[0]
        spec = inherited_spec(first.semiring)
        kind = "zero" if spec is None else spec.scale
        finite = _finite_scores(results)
        label = f"{first.meaning} [{first.unit}]"
        if kind == "presence":
            return cls("presence", 0.0, 1.0, label)
        if kind == "from_best" and finite.numel():
            best, worst = float(finite.max()), float(finite.min())
            return cls("from_best", worst if worst < best else best - 1.0, best, label)
        signed = (spec is not None and spec.signed) or bool((finite < 0).any())
        limit = float(finite.abs().max()) if finite.numel() else 0.0
        limit = limit if limit > 0 else 1.0
        return (
            cls("diverging", -limit, limit, label)
            if signed
            else cls("sequential", 0.0, limit, label)
        )

    def colour(self, value: float) -> tuple[int, int, int]:
        """The sRGB colour of ``value``."""
        if not math.isfinite(value):
            return NOT_FINITE
        if self.kind == "presence":
            return POSITIVE if value > 0 else ZERO
        if self.kind == "diverging":
            t = max(-1.0, min(1.0, value / self.upper))
        else:
            t = max(0.0, min(1.0, (value - self.lower) / (self.upper - self.lower)))
        end = POSITIVE if t >= 0 else NEGATIVE
        return tuple(round(z + (e - z) * abs(t)) for z, e in zip(ZERO, end))  # type: ignore

    def css_gradient(self) -> str:
        """The legend bar's background: the scale from ``lower`` to ``upper``."""
        if self.kind == "presence":
            return f"linear-gradient(to right, {_css(ZERO)} 50%, {_css(POSITIVE)} 50%)"
        stops = [NEGATIVE, ZERO, POSITIVE] if self.kind == "diverging" else [ZERO, POSITIVE]
        return "linear-gradient(to right, " + ", ".join(_css(c) for c in stops) + ")"

    def ticks(self) -> list[str]:
        """The labels under the legend bar, left to right: from the best, differences from
        the largest score."""
        if self.kind == "presence":
            return ["no path", "path"]
        if self.kind == "from_best":
            return [f"{self.lower - self.upper:.4g}", "0"]
        ends = [self.lower, 0.0, self.upper] if self.kind == "diverging" else [0.0, self.upper]
        return [f"{v:.4g}" for v in ends]

    @property
    def axis_label(self) -> str:
        """What a tick's number is."""
        if self.kind == "from_best":
            return f"difference from the largest score, {self.upper:.6g}: {self.label}"
        return self.label

    def explanation(self) -> str:
        """What the colours mean, in a sentence."""
        grey = " Grey: not a number (NaN or ±inf)."
        if self.kind == "presence":
            return "Red: a path from the token reaches the output; white: no path."
        if self.kind == "from_best":
            return (
                f"Colour: the score's difference from the largest score, {self.upper:.6g} "
                f"(red), down to the smallest, {self.upper - self.lower:.4g} below it "
                "(white); a log-domain readout carries its meaning in differences. Grey: "
                "−inf (no path) or NaN."
            )
        if self.kind == "diverging":
            return (
                f"Colour: blue below zero, white at 0, red above; full colour at "
                f"±{self.upper:.4g}." + grey
            )
        return f"Colour: white at 0, red at the largest score, {self.upper:.4g}." + grey

    def sample(self, k: int) -> float:
        """The score ``k``/255 of the way from ``lower`` to ``upper``."""
        return self.lower + (self.upper - self.lower) * k / 255


def _coloured_scores(result: Scores) -> Tensor:
    """The scores the colours show: the display scores, with the tokens no path reaches at
    −inf (grey, outside the scale) where the readout is log-domain (Entropy reads 0
    there)."""
    scores = result.display_scores()
    spec = inherited_spec(result.semiring)
    if spec is None or spec.scale != "from_best" or result.reached is None:
        return scores
    return scores.masked_fill(~result.reached, -math.inf)


def _finite_scores(results: Sequence[Scores]) -> Tensor:
    """Every finite score of ``results`` the colours show (SignedMaxProduct: both rows),
    flattened."""
    parts = []
    for r in results:
        parts.append(_coloured_scores(r).reshape(-1))
        low = r.min_scores()
        if low is not None:
            parts.append(low.reshape(-1))
    values = torch.cat(parts)
    return values[torch.isfinite(values)]


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


def _scales(groups: list[list[Scores]], per_text: bool) -> list[list[Scale]]:
    """Per text, per attribution, its scale: one per semiring over every text, or with
    ``per_text`` one per attribution."""
    if per_text:
        return [[Scale.of(r) for r in group] for group in groups]
    by_semiring: dict[type, list[Scores]] = {}
    for group in groups:
        for r in group:
            by_semiring.setdefault(type(r.semiring), []).append(r)
    shared = {kind: Scale.over(results) for kind, results in by_semiring.items()}
    return [[shared[type(r.semiring)] for r in group] for group in groups]


def _scales_note(texts: int, per_text: bool) -> str:
    """What the colours of a page of several texts compare."""
    if per_text:
        return (
            "Colours: each text on its own scale per semiring; the same colour can mean "
            "different scores in different texts."
        )
    return f"Colours: one scale per semiring, shared by the {texts} texts."


def html_page(
    result: Scores | Sequence[Scores] | Sequence[Sequence[Scores]],
    path: str | os.PathLike | None = None,
    *,
    per_text_scales: bool = False,
) -> str:
    """A self-contained HTML page: per text, what the model predicted, the tokens as a heat
    map of their scores on the semiring's scale with its legend, a score table and the
    headline paths (every token's path in a collapsible section). ``result``: one
    attribution, one per text, or per text a list of attributions under several semirings
    (a comparison). Several texts share one scale per semiring; ``per_text_scales`` gives
    each text its own (the page says which). Written to ``path`` when given; returned
    either way."""
    groups = _groups(result)
    scales = _scales(groups, per_text_scales)
    first = groups[0][0]
    names = [type(r.semiring).__name__ for r in groups[0]]
    what = f"{names[0]} attribution" if len(names) == 1 else f"{len(names)} semirings compared"
    title = f"{what} — target {first.target}"
    if len(groups) > 1:
        title = f"{what} on {len(groups)} texts — target {first.target}"
    numbered = len(groups) > 1
    note = f"<p>{_scales_note(len(groups), per_text_scales)}</p>" if numbered else ""
    body = "\n".join(
        _text_section(group, group_scales, i if numbered else None)
        for i, (group, group_scales) in enumerate(zip(groups, scales))
    )
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 0; color: #111; overflow-wrap: break-word; }}
header.report {{ background: #e8eef6; margin: 0 0 1em; padding: 0.6em 2em; }}
main {{ display: block; margin: 0 2em 2em; }}
header.report h1 {{ font-size: 1.4em; margin: 0.3em 0; }}
dl.context {{ display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: 2px 1em; margin: 0.5em 0; }}
dl.context dt {{ font-weight: bold; }} dl.context dd {{ margin: 0; }}
.tok {{ display: inline-block; padding: 3px 4px; margin: 1px; border-radius: 3px; white-space: pre; font-size: 1.2em; }}
.legend {{ display: inline-block; width: 322px; margin: 0.5em 0 1em; font-size: 0.85em; }}
.legends {{ display: flex; flex-wrap: wrap; gap: 0 2em; margin-top: 1em; }}
.legend .bar {{ width: 320px; height: 16px; border: 1px solid #444; }}
.legend .ticks {{ display: flex; justify-content: space-between; width: 322px; }}
.legend .meaning {{ color: #444; margin-top: 0.3em; }}
table {{ border-collapse: collapse; }} td, th {{ padding: 2px 6px; text-align: left; }}
td {{ white-space: pre-wrap; }}
th {{ overflow-wrap: anywhere; }}
td.num {{ text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }}
pre {{ background: #f6f6f6; padding: 1em; white-space: pre-wrap; overflow-wrap: anywhere; }}
</style></head><body>
<header class="report"><h1>{html.escape(title)}</h1>
{_context(first, "shared" if numbered else "all")}{note}</header>
<main>
{body}
</main>
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
    """The colour bar, its tick labels, what the numbers are and what the colours mean."""
    ticks = "".join(f"<span>{html.escape(label)}</span>" for label in scale.ticks())
    return (
        f'<div class="legend"><div class="bar" style="background: {scale.css_gradient()}">'
        f'</div><div class="ticks">{ticks}</div><div>{html.escape(scale.axis_label)}</div>'
        f'<div class="meaning">{html.escape(scale.explanation())}</div></div>'
    )


def _token_span(token: str, i: int, score: float, colour: tuple[int, int, int]) -> str:
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


def _text_section(group: list[Scores], scales: list[Scale], number: int | None) -> str:
    """One text: one semiring's heat map, table and paths, or a comparison of several."""
    first = group[0]
    head = ""
    if number is not None:
        text = first.prediction.text if first.prediction is not None else None
        about = f": {text!r}" if text is not None else ""
        head = f"<h2>Text {number + 1}{html.escape(about)}</h2>\n{_context(first, 'own')}\n"
    if len(group) == 1:
        return head + _single(first, scales[0])
    return head + _comparison(group, scales)


def _single(result: Scores, scale: Scale) -> str:
    scores = result.display_scores().tolist()
    colours = [scale.colour(s) for s in _coloured_scores(result).tolist()]
    low = result.min_scores()
    spans = "".join(
        _token_span(t, i, s, c) for i, (t, s, c) in enumerate(zip(result.tokens, scores, colours))
    )
    heading = "<th>score</th>" if low is None else "<th>largest</th><th>smallest</th>"
    rows = []
    for i, (t, s, c) in enumerate(zip(result.tokens, scores, colours)):
        cells = _cell(s, c)
        if low is not None:
            cells += _cell(float(low[i]), scale.colour(float(low[i])))
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


def _cell(value: float, colour: tuple[int, int, int]) -> str:
    return (
        f'<td class="num" style="background: {_css(colour)}; color: {_ink(colour)}">'
        f"{value:.6g}</td>"
    )


def _comparison(group: list[Scores], scales: list[Scale]) -> str:
    """Several semirings on one text: a table of tokens × semirings, each column on its
    semiring's scale, the legends, and the paths of the semirings that have them."""
    tokens = group[0].tokens
    if any(r.tokens != tokens for r in group):
        raise ValueError("a comparison needs attributions of the same tokens")
    heads = "".join(
        f'<th title="{html.escape(r.meaning)}">{html.escape(type(r.semiring).__name__)}</th>'
        for r in group
    )
    columns = [r.display_scores().tolist() for r in group]
    colours = [[s.colour(v) for v in _coloured_scores(r).tolist()] for r, s in zip(group, scales)]
    rows = []
    for i, t in enumerate(tokens):
        cells = "".join(_cell(values[i], c[i]) for values, c in zip(columns, colours))
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
coloured on its semiring's scale (legends below, with what each score means): zero-anchored for Real, MaxProduct and
SignedMaxProduct (the largest signed product), the difference from the largest score for
the log-domain readouts (Log, Entropy, Counting), path or no path for Boolean.</p>
<table><tr><th>#</th><th>token</th>{heads}</tr>
{"".join(rows)}
</table>
<div class="legends">{legends}</div>
{paths}"""


def plot_scores(result: Scores | Sequence[Scores], path: str | os.PathLike) -> None:
    """A PNG bar chart of the token scores, one panel per attribution (several: semirings
    compared on one text), each bar coloured on the report's scale, with its colour bar;
    log-domain readouts are drawn as the difference from the largest score (needs
    matplotlib: the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
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
        _panel(fig, ax, r, Scale.of(r))
    characters = int(fig.get_figwidth() * 14)  # about 14 characters an inch at 9 points
    fig.suptitle("\n".join(textwrap.wrap(_plot_title(results[0]), characters)), fontsize=9)
    fig.savefig(path, format="png")
    plt.close(fig)


def _plot_title(result: Scores) -> str:
    """The chart's title: the model, the text, the position read, the target."""
    title = f"target {result.target}"
    p = result.prediction
    if p is None:
        return title
    text = "" if p.text is None else f" — {p.text!r}"
    read = "" if p.position is None else f"; logits read at position {p.position} ({p.token!r})"
    return f"{p.model}{text}{read}; {title}, probability {p.target_probability:.3g}"


def _panel(fig: Any, ax: Any, result: Scores, scale: Scale) -> None:
    """One attribution's bars, coloured on ``scale``, with its colour bar. From the best:
    each bar rises from below the smallest score to the score's difference from the
    largest, so every token's bar shows."""
    scores = _coloured_scores(result).tolist()
    colours = [tuple(c / 255 for c in scale.colour(s)) for s in scores]
    offset = scale.upper if scale.kind == "from_best" else 0.0
    span = scale.upper - scale.lower
    base = scale.lower - offset - 0.1 * span if scale.kind == "from_best" else 0.0
    heights = [s - offset - base if math.isfinite(s) else 0.0 for s in scores]
    ax.bar(range(len(scores)), heights, bottom=base, color=colours, edgecolor="#444", linewidth=0.6)
    ax.axhline(0.0, color="#444", linewidth=0.8)
    ax.set_xticks(range(len(scores)), [repr(t) for t in result.tokens], rotation=60, fontsize=8)
    ax.set_ylabel("Δ from the largest" if scale.kind == "from_best" else "score", fontsize=8)
    ax.set_title(f"{type(result.semiring).__name__}: {result.meaning}", fontsize=9)
    ax.set_ylim(*_limits([base + h for h in heights], base, span))
    _colour_bar(fig, ax, scale, offset, result.unit)


def _colour_bar(fig: Any, ax: Any, scale: Scale, offset: float, unit: str) -> None:
    """The scale's colours beside ``ax``, its numbers shifted by ``offset``."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import ListedColormap, Normalize

    samples = [scale.colour(scale.sample(k)) for k in range(256)]
    if scale.kind == "presence":
        samples = [ZERO, POSITIVE]
    cmap = ListedColormap([tuple(c / 255 for c in rgb) for rgb in samples])
    norm = Normalize(scale.lower - offset, scale.upper - offset)
    bar = fig.colorbar(ScalarMappable(norm, cmap), ax=ax, pad=0.02)
    if scale.kind == "presence":
        bar.set_ticks([0.25, 0.75], labels=["no path", "path"])
    bar.set_label(f"Δ from the largest [{unit}]" if scale.kind == "from_best" else unit, fontsize=8)


def _limits(tops: list[float], base: float, span: float) -> tuple[float, float]:
    """y limits that include the bars' base, zero and every bar's top, with a margin."""
    lo = min([0.0, base, *tops])
    hi = max([0.0, *tops])
    margin = 0.05 * ((hi - lo) or span or 1.0)
    return lo - margin * (lo < 0), hi + margin
