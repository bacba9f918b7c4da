"""The HTML report as a browser draws it: headless Chromium takes a screenshot, and the test
finds the header band, each token's colour and the legend's colour bar in its pixels; and
Chromium lays the page out, every collapsed path open, and no element's content is wider
than its box.

Runs where Chromium is installed (``.ci/run`` installs Debian's ``chromium`` where it can);
skipped otherwise."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from model_zoo import tiny_model

import semiring_autograd as sa
from semiring_autograd.explain import report
from semiring_autograd.explain.report import Scale
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium: install Debian's chromium package to run"
)
image = pytest.importorskip("matplotlib.image")

HEADER = (232, 238, 246)  # header.report's background, #e8eef6
BORDER = (68, 68, 68)  # the legend bar's border, #444
BAR = 320  # the legend bar's width in CSS pixels
WIDTH, HEIGHT = 1000, 900
IDS = torch.tensor([[3, 17, 5, 29, 11, 8]])


def _chromium(tmp_path: Path, width: int, *arguments: str) -> str:
    """Headless Chromium's standard output for ``arguments`` at a window ``width`` × HEIGHT."""
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--window-size={width},{HEIGHT}",
            *arguments,
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.stdout


def _screenshot(page: Path, tmp_path: Path) -> np.ndarray:
    """The page drawn by headless Chromium at WIDTH × HEIGHT, as an (h, w, 3) uint8 array."""
    shot = tmp_path / "shot.png"
    _chromium(tmp_path, WIDTH, f"--screenshot={shot}", page.as_uri())
    return (image.imread(shot)[..., :3] * 255).round().astype(np.int64)


#: opens every collapsed section, then lists each element whose content is wider than its
#: box (scrollWidth > clientWidth), in an attribute of the root element
MEASURE = """<script>
document.querySelectorAll("details").forEach((d) => { d.open = true; });
const wide = [];
for (const e of document.querySelectorAll("*")) {
  if (e.clientWidth > 0 && e.scrollWidth > e.clientWidth) {
    wide.push(`${e.tagName.toLowerCase()}.${e.className}: ${e.scrollWidth} > ${e.clientWidth}`);
  }
}
document.documentElement.setAttribute("data-overflow", JSON.stringify(wide));
</script>"""


def _overflowing(page: str, tmp_path: Path, width: int) -> list[str]:
    """The elements whose content overflows their box when Chromium lays ``page`` out in a
    window ``width`` wide with every path open."""
    measured = tmp_path / "measured.html"
    measured.write_text(page.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    dom = _chromium(tmp_path, width, "--dump-dom", measured.as_uri())
    found = re.search(r'data-overflow="([^"]*)"', dom)
    assert found, "the measuring script did not run"
    return json.loads(html.unescape(found.group(1)))


def _near(pixels: np.ndarray, colour, tolerance: int = 3) -> np.ndarray:
    return (np.abs(pixels - np.array(colour)) <= tolerance).all(-1)


def _legend_rows(pixels: np.ndarray, scale: Scale) -> list[int]:
    """Rows holding the legend's bar: a run of BAR pixels between two border pixels that
    starts at the scale's lowest colour, passes its middle colour and ends at its top one."""
    rows = []
    low, top = scale.colour(scale.lower), scale.colour(scale.upper)
    middle = scale.colour((scale.lower + scale.upper) / 2)
    for y in range(pixels.shape[0]):
        borders = np.flatnonzero(_near(pixels[y], BORDER, 8))
        for left, right in zip(borders, borders[1:]):
            if not BAR - 2 <= right - left - 1 <= BAR + 2:
                continue
            run = pixels[y, left + 1 : right]
            ends = _near(run[0], low, 4) and _near(run[-1], top, 4)
            if ends and _near(run[len(run) // 2], middle, 6):
                rows.append(y)
    return rows


@pytest.mark.parametrize("semiring", [sa.Real(), sa.MaxProduct()], ids=["Real", "MaxProduct"])
def test_screenshot_shows_header_tokens_and_legend(semiring, tmp_path):
    model = tiny_model("LlamaForCausalLM")
    result = sa.attribute(model, {"input_ids": IDS}, 7, semiring, model_name="tiny")
    page = tmp_path / "report.html"
    result.to_html(page)
    pixels = _screenshot(page, tmp_path)

    # the header: a band of its colour across the page at the top, with text in it
    band = _near(pixels, HEADER, 2).mean(1) > 0.5
    rows = np.flatnonzero(band)
    assert rows.size >= 60 and rows[0] < 5, "no header band at the top"
    header = pixels[rows[0] : rows[-1] + 1]
    assert (header.sum(-1) < 200).sum() > 500, "no text in the header"

    # every token drawn in its score's colour
    scale = Scale.of(result)
    below = pixels[rows[-1] + 1 :]
    for token, score in zip(result.tokens, result.display_scores().tolist()):
        colour = scale.colour(score)
        assert _near(below, colour, 1).sum() >= 30, f"token {token!r} not drawn in {colour}"

    # the legend's colour bar, 16 px high
    legend = _legend_rows(pixels, scale)
    assert 12 <= len(legend) <= 18, f"legend bar rows {legend}"


@pytest.fixture(scope="module")
def long_text_attributions():
    """Every built-in semiring's attribution of two token sequences of the tiny Llama, the
    first's text one unbroken 300-character word."""
    model = tiny_model("LlamaForCausalLM")
    groups = []
    for ids, text in ((IDS, "x" * 300), (IDS[:, :4], "a short text")):
        group = []
        for semiring in (cls() for cls in BUILTIN_SEMIRINGS):
            r = sa.attribute(model, {"input_ids": ids}, 7, semiring, model_name="tiny")
            group.append(replace(r, prediction=replace(r.prediction, text=text)))
        groups.append(group)
    return groups


@pytest.mark.parametrize("width", [1000, 800])
def test_no_element_overflows_its_box(long_text_attributions, tmp_path, width):
    """Path lines, the text and the tables stay inside their boxes: a page of one semiring
    and the comparison of every semiring on two texts, every path open."""
    single = report.html_page(long_text_attributions[0][1])  # MaxProduct: paths
    assert _overflowing(single, tmp_path, width) == []
    compared = report.html_page(long_text_attributions)
    assert _overflowing(compared, tmp_path, width) == []
