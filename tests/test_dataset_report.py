"""The dataset run's HTML summary (explain/dataset_report.py): its histogram and module
counts against the rows' own scores and paths, its flow table against the sums of the
rows' flow cells, a working link to each record's page, and the page as headless Chromium
draws it (where Chromium is installed)."""

from __future__ import annotations

import html.parser
import json
import math
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
        self.flow: dict[str, list[dict[str, str]]] = {}
        self.flow_data = ""
        self.open: list[str] = []
        self.table: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "rect":
            self.bars[int(attrs["data-offset"])] = int(attrs["data-count"])
        if tag == "a":
            self.links.append(attrs["href"])
        if tag == "table":
            self.table = attrs.get("data-semiring")
        if tag == "td" and "data-module" in attrs:
            self.flow.setdefault(self.table, []).append(attrs)
        if tag not in ("meta",):
            self.open.append(tag)

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, f"unbalanced </{tag}>"
        self.open.pop()

    def handle_data(self, data):
        if self.open and self.open[-1] == "td":
            self.cells.append(data)
        if self.open and self.open[-1] == "script":
            self.flow_data += data


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model, tokenizer = dataset_worker.model()
    out = tmp_path_factory.mktemp("report") / "run"
    attribute_dataset(
        model,
        dataset_worker.RECORDS[:7],
        out,
        tokenizer=tokenizer,
        semirings=("max-product", "log"),
        paths=True,
        pages=True,
        batch_size=4,
        progress=False,
        flow=True,
    )
    return out


def _page(run) -> _Page:
    page = _Page()
    page.feed((run / "report.html").read_text(encoding="utf-8"))
    page.close()
    assert not page.open, f"unclosed tags {page.open}"
    return page


def test_summary_counts_what_the_rows_hold(run):
    rows = read_rows(run / "records.parquet")
    page = _page(run)
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


def test_flow_table_sums_the_rows_flow_cells(run):
    rows = [r for r in read_rows(run / "records.parquet") if r["error"] is None]
    page = _page(run)
    embedded = json.loads(page.flow_data)
    assert set(embedded) == set(page.flow) == {"max-product", "log"}
    for name, column in (("max-product", "flow_max_product"), ("log", "flow_log")):
        # the oracle: the rows' own cells, summed here per module
        modules = [c["module"] for c in rows[0][column]]
        assert modules == [f"model.layers.{i}.{p}" for i in (0, 1) for p in ("self_attn", "mlp")]
        for module, cell, shown in zip(modules, embedded[name], page.flow[name]):
            own = [next(c for c in r[column] if c["module"] == module) for r in rows]
            flow_sum = math.fsum(c["flow"] for c in own)
            share_sum = math.fsum(c["share"] for c in own)
            assert cell["module"] == shown["data-module"] == module
            assert cell["records"] == cell["shares"] == int(shown["data-records"]) == len(rows)
            for figure in (cell["flow_sum"], float(shown["data-flow-sum"])):
                assert figure == pytest.approx(flow_sum, rel=1e-12)
            for figure in (cell["share_sum"], float(shown["data-share-sum"])):
                assert figure == pytest.approx(share_sum, rel=1e-12)
    # max-product: a share of 1 where the record's strongest path crosses the module
    for r in rows:
        steps = {s["module"] for s in r["top_path"]["steps"]}
        for cell in r["flow_max_product"]:
            crossing = any(m == cell["module"] or m.startswith(cell["module"] + ".") for m in steps)
            assert (cell["share"] == pytest.approx(1.0, rel=1e-9)) == crossing, cell


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
