"""Reports of an attribution: a self-contained HTML page (a heat map of the token scores and
the top paths) and a PNG bar chart."""

from __future__ import annotations

import html
import math
import os
from pathlib import Path as FilePath
from typing import Any, Protocol, Sequence

import torch
from torch import Tensor


class Scores(Protocol):
    """What a report reads of an attribution (:class:`sa.Attribution` is one)."""

    tokens: list[str]
    semiring: Any
    target: str
    paths: list[Any]

    @property
    def meaning(self) -> str: ...

    def display_scores(self) -> Tensor: ...

    def best_token(self) -> int: ...


def html_page(result: Scores | Sequence[Scores], path: str | os.PathLike | None = None) -> str:
    """A self-contained HTML page: per attribution (one, or one per text), the tokens as a
    heat map of their scores and the top path of the best token (each token's path in a
    collapsible section). Written to ``path`` when given; returned either way."""
    results = [result] if not isinstance(result, Sequence) else list(result)
    if not results:
        raise ValueError("html_page needs at least one attribution")
    first = results[0]
    title = f"{type(first.semiring).__name__} attribution — target {first.target}"
    if len(results) > 1:
        title = f"{type(first.semiring).__name__} attribution of {len(results)} texts"
    heading = len(results) > 1
    body = "\n".join(_section(r, i if heading else None) for i, r in enumerate(results))
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
.tok {{ padding: 2px 3px; margin: 1px; border-radius: 3px; white-space: pre; }}
table {{ border-collapse: collapse; }} td, th {{ padding: 2px 8px; text-align: left; }}
pre {{ background: #f6f6f6; padding: 1em; overflow-x: auto; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
{body}
</body></html>
"""
    if path is not None:
        FilePath(path).write_text(page, encoding="utf-8")
    return page


def _section(result: Scores, number: int | None) -> str:
    """One attribution's heat map, score table and top paths (headed when ``number``)."""
    scores = result.display_scores()
    finite = scores[torch.isfinite(scores)]
    lo = float(finite.min()) if finite.numel() else 0.0
    hi = float(finite.max()) if finite.numel() else 1.0
    spans = []
    for i, (tok, score) in enumerate(zip(result.tokens, scores.tolist())):
        level = 0.0 if not math.isfinite(score) or hi == lo else (score - lo) / (hi - lo)
        spans.append(
            f'<span class="tok" style="background: rgba(220, 60, 30, {level:.3f})" '
            f'title="token {i}: {score:.6g}">{html.escape(tok)}</span>'
        )
    paths = []
    for i, p in enumerate(result.paths):
        if p is None:
            continue
        opened = " open" if i == result.best_token() else ""
        paths.append(
            f"<details{opened}><summary>token {i} {html.escape(repr(result.tokens[i]))}: "
            f"weight {p.weight:.6g}</summary><pre>{html.escape(str(p))}</pre></details>"
        )
    rows = "".join(
        f"<tr><td>{i}</td><td>{html.escape(repr(t))}</td><td>{s:.6g}</td></tr>"
        for i, (t, s) in enumerate(zip(result.tokens, scores.tolist()))
    )
    head = (
        f"<h2>Text {number + 1} — target {html.escape(result.target)}</h2>\n"
        if number is not None
        else ""
    )
    return f"""{head}<p>Score per token: {html.escape(result.meaning)} (the semiring's ⊕ over
the token's embedding elements). Darker is higher; range {lo:.6g} to {hi:.6g}.</p>
<p class="tokens">{"".join(spans)}</p>
<table><tr><th>#</th><th>token</th><th>score</th></tr>
{rows}
</table>
{"<h3>Top paths</h3>" + "".join(paths) if paths else ""}"""


def plot_scores(result: Scores, path: str | os.PathLike) -> None:
    """A PNG bar chart of the token scores (needs matplotlib: the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "Attribution.plot needs matplotlib: pip install 'semiring-autograd[plot]'"
        ) from exc
    scores = result.display_scores().numpy()
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(result.tokens)), 3.5))
    ax.bar(range(len(result.tokens)), scores, color="#dc3c1e")
    ax.set_xticks(range(len(result.tokens)), [repr(t) for t in result.tokens], rotation=60)
    ax.set_ylabel(result.meaning)
    ax.set_title(f"{type(result.semiring).__name__}, target {result.target}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
