"""Dataset runs (explain/dataset.py): the table's rows against one-at-a-time attribution, two
ranks under torchrun against one process, a run killed with SIGKILL and resumed, bad
records as error rows, the files pandas and ``datasets`` read, and each record's module
flow against ``sa.module_flow`` of the record alone."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import semiring_autograd as sa
import semiring_autograd_cli
from semiring_autograd.explain.dataset import attribute_dataset, column, read_rows, shard
from semiring_autograd.explain.flow import capture
from semiring_autograd.integrations.huggingface import load_causal_lm
from semiring_autograd.semirings.registry import semiring_named

sys.path.insert(0, str(Path(__file__).parent))
import dataset_worker  # noqa: E402

WORKER = Path(__file__).parent / "dataset_worker.py"
ROOT = Path(__file__).parent.parent
#: float64 model; rows from batches of other groupings round differently
TOLERANCE = dict(rtol=1e-7, atol=1e-9)
REASONS = {
    4: "the text is empty",
    9: "'tablecloths' is 3 tokens",
    13: "position 7 is outside the sequence of 4 tokens",
}


@pytest.fixture(scope="module")
def lm():
    return dataset_worker.model()


@pytest.fixture(scope="module")
def reference(lm, tmp_path_factory):
    """One process's rows of the worker's records."""
    model, tokenizer = lm
    out = tmp_path_factory.mktemp("one") / "run"
    merged = attribute_dataset(
        model,
        dataset_worker.RECORDS,
        out,
        tokenizer=tokenizer,
        semirings=dataset_worker.SEMIRINGS,
        batch_size=4,
        part_size=4,
        progress=False,
    )
    return read_rows(merged)


def _same_rows(rows, want):
    assert [r["index"] for r in rows] == list(range(len(dataset_worker.RECORDS)))
    assert len(rows) == len(want)
    for row, expected in zip(rows, want):
        for key, value in expected.items():
            if key.startswith("scores_") and value is not None:
                torch.testing.assert_close(
                    torch.tensor(row[key], dtype=torch.float64),
                    torch.tensor(value, dtype=torch.float64),
                    **TOLERANCE,
                )
            elif isinstance(value, float):
                assert row[key] == pytest.approx(value, rel=1e-9), key
            else:
                assert row[key] == value, key


def test_rows_are_one_at_a_time_attribution(reference, lm):
    model, tokenizer = lm
    for row, record in zip(reference, dataset_worker.RECORDS):
        if row["index"] not in (0, 1, 2, 4, 9, 13, 17, 23):  # the oracle's runs take time
            continue
        if row["index"] in REASONS:
            assert REASONS[row["index"]] in row["error"]
            assert row["tokens"] is None and row[column("log")] is None
            continue
        assert row["error"] is None and row["id"] == record["id"]
        for name in dataset_worker.SEMIRINGS:
            alone = sa.attribute(
                model,
                record["text"],
                record["target"],
                name,
                tokenizer=tokenizer,
                position=record.get("position", -1),
                paths=False,
            )
            assert row["tokens"] == alone.tokens
            torch.testing.assert_close(
                torch.tensor(row[column(name)], dtype=torch.float64), alone.scores, **TOLERANCE
            )
        assert row["target_logit"] == pytest.approx(alone.prediction.target_logit, rel=1e-9)
        assert row["position"] == alone.prediction.position
        best = int(torch.tensor(row[column("max-product")]).argmax())
        assert row["strongest_offset"] == best - row["position"]


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_two_ranks_under_torchrun_merge_to_one_process_rows(reference, tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    out = tmp_path / "run"
    command = [str(torchrun), "--standalone", "--nproc_per_node", "2", str(WORKER), str(out)]
    subprocess.run(command, check=True, env=_env(), timeout=240, capture_output=True)
    parts = sorted(p.name for p in (out / "parts").iterdir())
    assert {name[:8] for name in parts} == {"part-000", "part-001"}  # each rank wrote its own
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["records"] == len(dataset_worker.RECORDS) and manifest["errors"] == 3
    _same_rows(read_rows(out / "records.parquet"), reference)


@pytest.mark.slow
def test_sigkill_then_resume_loses_and_duplicates_no_row(reference, lm, tmp_path):
    out = tmp_path / "run"
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), str(out), "--slow"],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    parts = out / "parts"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and worker.poll() is None:
        if parts.is_dir() and len([p for p in parts.iterdir() if p.suffix == ".parquet"]) >= 2:
            break
        time.sleep(0.05)
    assert worker.poll() is None, worker.stderr.read().decode()[-2000:]
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    worker.stderr.close()
    assert not (out / "records.parquet").exists()
    done = [row["index"] for p in parts.glob("part-*") for row in read_rows(p)]
    assert 0 < len(done) < len(dataset_worker.RECORDS)
    model, tokenizer = lm
    settings = dict(tokenizer=tokenizer, semirings=dataset_worker.SEMIRINGS, progress=False)
    with pytest.raises(ValueError, match="holds a run already: pass resume=True"):
        attribute_dataset(model, dataset_worker.RECORDS, out, **settings)
    with pytest.raises(ValueError, match="holds a run with other settings"):
        attribute_dataset(model, dataset_worker.RECORDS, out, resume=True, position=-2, **settings)
    merged = attribute_dataset(
        model, dataset_worker.RECORDS, out, resume=True, batch_size=4, part_size=4, **settings
    )
    _same_rows(read_rows(merged), reference)
    again = [row["index"] for p in parts.glob("part-*") for row in read_rows(p)]
    assert sorted(again) == list(range(len(dataset_worker.RECORDS)))  # none written twice


@pytest.mark.parametrize(
    "format, semiring, paths",
    [("parquet", "max-product", True), ("jsonl", "signed-max-product", False)],
)
def test_pandas_and_datasets_read_the_table(lm, tmp_path, format, semiring, paths, monkeypatch):
    pandas = pytest.importorskip("pandas")
    datasets = pytest.importorskip("datasets")
    model, tokenizer = lm
    # a left-padding tokenizer: a row's path still names its text's own positions
    monkeypatch.setattr(tokenizer, "padding_side", "left")
    records = dataset_worker.RECORDS[:6]
    merged = attribute_dataset(
        model,
        records,
        tmp_path / "run",
        tokenizer=tokenizer,
        semirings=(semiring,),
        paths=paths,
        batch_size=3,
        format=format,
        progress=False,
    )
    assert merged.name == f"records.{format}"
    if format == "parquet":
        frame = pandas.read_parquet(merged)
    else:
        frame = pandas.read_json(merged, lines=True)
    table = datasets.load_dataset(
        "parquet" if format == "parquet" else "json", data_files=str(merged), split="train"
    )
    assert list(frame["index"]) == table["index"] == list(range(6))
    assert table[4]["error"] == "the text is empty: give a non-empty text"
    row, record = table[0], records[0]
    alone = sa.attribute(
        model, record["text"], record["target"], semiring, tokenizer=tokenizer, paths=paths
    )
    torch.testing.assert_close(
        torch.tensor(row[column(semiring)], dtype=torch.float64),
        alone.display_scores(),
        **TOLERANCE,
    )
    if not paths:
        assert "top_path" not in row
        torch.testing.assert_close(
            torch.tensor(row["scores_signed_max_product_min"], dtype=torch.float64),
            alone.min_scores(),
            **TOLERANCE,
        )
        return
    best = alone.best_token()
    assert row["top_path"]["token"] == best
    assert row["top_path"]["weight"] == pytest.approx(alone.paths[best].weight, rel=1e-7)
    steps = row["top_path"]["steps"]
    inside = [s.module for s in alone.paths[best].steps if s.module != "(outside sa.patch)"]
    assert [s["module"] for s in steps if s["module"] != "(outside sa.patch)"] == inside
    assert steps[0]["index"][1:] == list(alone.paths[best].steps[0].index[1:])


#: per semiring: ⊕ of readouts over all elements, by the semiring's definition, and the
#: share of a flow in the total
FLOW = {
    "max-product": (torch.amax, lambda flow, total: flow / total),
    "log": (torch.logsumexp, lambda flow, total: math.exp(flow - total)),
    "real": (torch.sum, lambda flow, total: flow / total),
}


def _decoder_parts(model) -> list[tuple[str, int, str]]:
    layers = model.config.num_hidden_layers
    return [
        (f"model.layers.{i}.{child}", i, part)
        for i in range(layers)
        for child, part in (("self_attn", "attention"), ("mlp", "mlp"))
    ]


def _alone_flow(model, tokenizer, row, name: str, modules: list[str]):
    """(per module the record's flow, the readout over all paths): the record alone, no
    padding, under ``name``, ⊕ over every element of its embeddings."""
    reduce = lambda t: float(FLOW[name][0](t.reshape(-1), 0))  # noqa: E731
    ids = torch.tensor([tokenizer(row["text"])["input_ids"]])
    x = model.get_input_embeddings()(ids).detach().requires_grad_()
    with sa.patch(model, semiring_named(name)), capture(model, modules) as seen:
        y = model(inputs_embeds=x).logits[0, row["position"], row["target_id"]]
    flows = sa.module_flow(y, x, seen)
    return {m: reduce(flows[m]) for m in modules}, reduce(sa.grad(y, x))


@pytest.mark.parametrize("format, side", [("parquet", "right"), ("jsonl", "left")])
def test_flow_cells_are_each_records_own_module_flow(lm, tmp_path, format, side):
    model, tokenizer = lm
    records = dataset_worker.RECORDS[:7]  # record 4 is an error row
    was = tokenizer.padding_side
    tokenizer.padding_side = side
    try:
        merged = attribute_dataset(
            model,
            records,
            tmp_path / "run",
            tokenizer=tokenizer,
            semirings=("max-product", "log", "real", "entropy"),
            batch_size=3,
            format=format,
            progress=False,
            flow=True,
        )
    finally:
        tokenizer.padding_side = was
    rows = read_rows(merged)
    assert "flow_entropy" not in rows[0]  # entropy has no flow column
    parts = _decoder_parts(model)
    modules = [m for m, _, _ in parts]
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["flow"] == modules
    for row in rows:
        if row["error"] is not None:
            assert row["flow_max_product"] is None and row["flow_log"] is None
            continue
        for name in FLOW:
            cells = row["flow_" + name.replace("-", "_")]
            assert [(c["module"], c["layer"], c["part"]) for c in cells] == parts
            want, total = _alone_flow(model, tokenizer, row, name, modules)
            for cell in cells:
                flow = want[cell["module"]]
                assert cell["flow"] == pytest.approx(flow, rel=1e-7, abs=1e-9), (name, cell)
                share = FLOW[name][1](flow, total)
                assert cell["share"] == pytest.approx(share, rel=1e-7, abs=1e-9), (name, cell)


def test_flow_refusals(lm, tmp_path):
    model, tokenizer = lm
    common = dict(tokenizer=tokenizer, progress=False)
    with pytest.raises(ValueError, match="flow is recorded under max-product, log"):
        attribute_dataset(model, ["a"], tmp_path / "a", semirings=("entropy",), flow=True, **common)
    with pytest.raises(ValueError, match=r"\['model.layers.9.mlp'\] names no submodule"):
        attribute_dataset(model, ["a"], tmp_path / "b", flow=["model.layers.9.mlp"], **common)
    with pytest.raises(ValueError, match="has no list of layers with an attention child"):
        attribute_dataset(torch.nn.Linear(2, 2), ["a"], tmp_path / "c", flow=True, **common)


def test_explain_flow_option_writes_the_flow_columns(lm, tmp_path, capsys):
    model, tokenizer = lm
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in dataset_worker.RECORDS[:3]))
    argv = ["explain", "--file", str(prompts), "--out", str(tmp_path / "run"), "--no-paths"]
    argv += ["--model", str(folder), "--semiring", "log", "--flow", "--format", "jsonl"]
    assert semiring_autograd_cli.main(argv) == 0, capsys.readouterr().err
    rows = read_rows(tmp_path / "run" / "records.jsonl")
    modules = [m for m, _, _ in _decoder_parts(model)]
    loaded, _ = load_causal_lm(str(folder))  # the model as the command loads it
    want, _ = _alone_flow(loaded, tokenizer, rows[1], "log", modules)
    got = {c["module"]: c["flow"] for c in rows[1]["flow_log"]}
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    flow_off = ["explain", "--file", str(prompts), "--flow", "--target", " x"]
    assert semiring_autograd_cli.main(flow_off) == 2
    assert "--flow records module flow in --out's table: give --out DIR" in capsys.readouterr().err


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shards_cover_every_record_once_with_balanced_text(world):
    """Every record in exactly one rank's shard, each shard in index order; the texts'
    lengths dealt so that two shards differ by at most the longest text."""
    records = [{"text": "w" * ((7 * i) % 23)} for i in range(40)] + ["abc", {"text": None}]
    shards = [shard(records, rank, world) for rank in range(world)]
    assert sorted(i for s in shards for i in s) == list(range(len(records)))
    assert all(s == sorted(s) for s in shards)
    sizes = [
        sum(len(records[i]["text"] or "") if isinstance(records[i], dict) else 3 for i in s)
        for s in shards
    ]
    assert max(sizes) - min(sizes) <= 22
    assert shards == [shard(records, rank, world) for rank in range(world)]
