"""The HTML report as a browser draws it: headless Chromium takes a screenshot, and the test
finds the header band, each token's colour and the legend's colour bar in its pixels.

Runs where Chromium is installed (``.ci/run`` installs Debian's ``chromium`` where it can);
skipped otherwise."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import tiny_model

import semiring_autograd as sa
from semiring_autograd.explain.report import Scale

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


def _screenshot(page: Path, tmp_path: Path) -> np.ndarray:
    """The page drawn by headless Chromium at WIDTH × HEIGHT, as an (h, w, 3) uint8 array."""
    shot = tmp_path / "shot.png"
    subprocess.run(
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
            f"--window-size={WIDTH},{HEIGHT}",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return (image.imread(shot)[..., :3] * 255).round().astype(np.int64)


def _near(pixels: np.ndarray, colour, tolerance: int = 3) -> np.ndarray:
    return (np.abs(pixels - np.array(colour)) <= tolerance).all(-1)


def _legend_rows(pixels: np.ndarray, scale: Scale) -> list[int]:
    """Rows holding the legend's bar: a run of BAR pixels between two border pixels that
    starts at the scale's lowest colour, passes its middle colour and ends at its top one."""
    rows = []
    low, top = scale.colour(scale.lower), scale.colour(scale.limit)
    middle = scale.colour((scale.lower + scale.limit) / 2)
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
    ids = torch.tensor([[3, 17, 5, 29, 11, 8]])
    result = sa.attribute(model, {"input_ids": ids}, 7, semiring, model_name="tiny")
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
