"""The dataset run's HTML summary (explain/dataset_report.py): its histogram and module
counts against the rows' own scores and paths, a working link to each record's page, and
the page as headless Chromium draws it (where Chromium is installed)."""

from __future__ import annotations

import html.parser
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from semiring_autograd.explain.dataset import attribute_dataset, read_rows
from semiring_autograd.explain.dataset_report import BAR

sys.path.insert(0, str(Path(__file__).parent))
import dataset_worker  # noqa: E402

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)


class _Page(html.parser.HTMLParser):
    """The bars, links and table cells of the summary; checks that the tags balance."""

    def __init__(self) -> None:
        super().__init__()
        self.bars: dict[int, int] = {}
        self.links: list[str] = []
        self.cells: list[str] = []
        self.open: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "rect":
            self.bars[int(attrs["data-offset"])] = int(attrs["data-count"])
        if tag == "a":
            self.links.append(attrs["href"])
        if tag not in ("meta",):
            self.open.append(tag)

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, f"unbalanced </{tag}>"
        self.open.pop()

    def handle_data(self, data):
        if self.open and self.open[-1] == "td":
            self.cells.append(data)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model, tokenizer = dataset_worker.model()
    out = tmp_path_factory.mktemp("report") / "run"
    attribute_dataset(
        model,
        dataset_worker.RECORDS[:7],
        out,
        tokenizer=tokenizer,
        semirings=("max-product",),
        paths=True,
        pages=True,
        batch_size=4,
        progress=False,
    )
    return out


def test_summary_counts_what_the_rows_hold(run):
    rows = read_rows(run / "records.parquet")
    page = _Page()
    page.feed((run / "report.html").read_text(encoding="utf-8"))
    page.close()
    assert not page.open, f"unclosed tags {page.open}"
    good = [r for r in rows if r["error"] is None]
    # the oracle: each row's own scores, argmax minus the read position
    offsets = Counter(
        int(torch.tensor(r["scores_max_product"]).argmax()) - r["position"] for r in good
    )
    assert {o: n for o, n in page.bars.items() if n} == dict(offsets)
    assert set(page.bars) == set(range(min(offsets), max(offsets) + 1))
    # each record with a page is linked, and its page shows its tokens
    assert page.links == [f"pages/{r['index']:06d}.html" for r in good]
    for link, row in zip(page.links, good):
        record_page = (run / link).read_text(encoding="utf-8")
        for token in row["tokens"]:
            assert token.replace("&", "&amp;") in record_page
    # per module, the records whose top path crosses it
    for module in ("layers.0", "lm_head"):
        crossing = sum(
            any(s["module"].endswith(module) for s in r["top_path"]["steps"]) for r in good
        )
        row = page.cells.index(module)
        assert page.cells[row + 1] == str(crossing)
    assert "error: the text is empty: give a non-empty text" in page.cells


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: install Debian's chromium package")
def test_chromium_draws_the_histogram(run, tmp_path):
    image = pytest.importorskip("matplotlib.image")
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1000,700",
            f"--screenshot={shot}",
            (run / "report.html").as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    pixels = (image.imread(shot)[..., :3] * 255).round().astype(int)
    bar = tuple(int(BAR[i : i + 2], 16) for i in (1, 3, 5))
    drawn = (pixels == bar).all(-1)
    assert drawn.sum() > 500, "no histogram bar drawn"
    rows = drawn.any(1).nonzero()[0]
    assert rows.min() > 100, "the histogram lies under the header"
