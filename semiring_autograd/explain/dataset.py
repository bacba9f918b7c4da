"""Dataset-scale attribution: records in, one table of per-record scores out.

``attribute_dataset(model, records, out, tokenizer=...)`` runs :mod:`.batched` over the
records and writes one row per record into ``out``:

* ``out/run.json``: the run's settings (a resumed run must match them);
* ``out/parts/part-RRR-KKKKK.parquet`` (or ``.jsonl``): rank RRR's K-th part, each written
  beside its name and moved in with ``os.replace`` (a killed run leaves whole parts only);
* ``out/records.parquet`` (or ``.jsonl``) and ``out/manifest.json``: the merge of every part,
  one row per record in input order, written by rank 0 once every rank is done;
* ``out/report.html``: the run's summary (:mod:`.dataset_report`), and with ``pages`` each
  record's own report page, ``out/pages/NNNNNN.html``.

Under ``torchrun --nproc_per_node N`` (or any launcher that sets ``WORLD_SIZE`` and
``RANK``) the call joins ``torch.distributed`` (gloo where the model is on the CPU, nccl
where it is on a GPU) and rank r takes its :func:`shard`: the records ranked by text
length and dealt to the ranks in turn. With ``resume=True`` the records of every part on
disk are skipped, so a run killed at any point and resumed loses no row and duplicates
none. A bad record (empty text, a target that is not one token, a position
outside the text, a text over the context length) is an error row with its reason.

Columns: ``index``, ``id``, ``text``, ``target``, ``target_id``, ``position`` (the read
position), ``tokens``, ``scores_<semiring>`` per semiring (``_min`` too for
signed-max-product), ``prediction`` (the most probable next token), ``target_logit``,
``target_probability``, ``target_rank``, ``strongest_token`` and ``strongest_offset`` (the
token with the largest score under the first semiring, and its position minus the read
position), ``top_path`` (with ``paths``: the strongest token's MaxProduct path, its weight
and steps), ``flow_<semiring>`` (with ``flow``, per semiring of
:data:`.dataset_flow.SHARES`: per module its ``module``, ``layer``, ``part``, ``flow``
and ``share``, :mod:`.dataset_flow`) and ``error``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path as FilePath
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..semirings.registry import semiring_named
from . import report
from .token_scores import Attribution, model_label
from .batched import (
    Prepared,
    as_record,
    attribute_batch,
    buckets,
    context_limit,
    logit_count,
    prepare,
)
from .dataset_flow import SHARES, batch_flows, flow_cells, flow_column, flow_modules, named_module
from .dataset_report import page_name, write_report

FORMATS = ("parquet", "jsonl")
_PART = re.compile(r"^part-(\d{3})-(\d{5})\.(parquet|jsonl)$")


def column(semiring_name: str) -> str:
    """The scores column of a semiring's command-line name: ``scores_max_product``."""
    return "scores_" + semiring_name.replace("-", "_")


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a file: a ``.jsonl`` file's JSON objects (``text``, optional
    ``target``, ``position``, ``id``), else one text per non-blank line. A line that is not
    JSON is kept as a record whose text is None (an error row names it)."""
    lines = FilePath(path).read_text(encoding="utf-8").splitlines()
    if not str(path).endswith(".jsonl"):
        return [{"text": line} for line in lines if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            item = {"text": None, "id": f"line {number}: not JSON ({exc.msg})"}
        records.append(item if isinstance(item, dict) else {"text": item})
    return records


def distributed(device: torch.device) -> tuple[int, int, bool]:
    """(rank, world size, whether this call initialised the process group): joins
    ``torch.distributed`` when a launcher set ``WORLD_SIZE`` > 1 and no group exists, over
    nccl where the model is on a CUDA ``device`` (bound to it), gloo elsewhere."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, False
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), True


def shard(records: Sequence[Any], rank: int, world: int) -> list[int]:
    """Rank ``rank``'s record indices, in order: the records ranked by the length of their
    text (ties by index) and dealt to the ``world`` ranks in turn, so each rank gets texts
    of every length and about the same work. It depends on the records alone, so every
    rank (and a resumed run) deals them alike."""
    if world == 1:
        return list(range(len(records)))
    order = sorted(range(len(records)), key=lambda i: (_text_length(records[i]), i))
    return sorted(order[rank::world])


def _text_length(item: Any) -> int:
    """The characters of a record's text (0 where it has none)."""
    text = item.get("text") if isinstance(item, Mapping) else getattr(item, "text", item)
    return len(text) if isinstance(text, str) else 0


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


@dataclass(frozen=True)
class Settings:
    """What a run computes: a resumed run must compute the same."""

    model: str
    semirings: tuple[str, ...]
    target: int | str | None
    position: int
    paths: bool
    format: str
    flow: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "semirings": list(self.semirings),
            "target": self.target,
            "position": self.position,
            "paths": self.paths,
            "format": self.format,
            "flow": list(self.flow),
        }

    def flow_semirings(self) -> list[str]:
        """The semirings whose flow the run records (none without ``flow``)."""
        return [n for n in self.semirings if n in SHARES] if self.flow else []


def write_atomic(path: FilePath, write) -> None:
    """``write(staging)`` to a file beside ``path``, then moved to ``path`` (readers see the
    whole file or none)."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(staging)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def _write_rows(rows: list[dict[str, Any]], path: FilePath, format: str) -> None:
    """``rows`` as Parquet (pyarrow) or JSON lines, atomically."""
    if format == "jsonl":

        def write(staging: FilePath) -> None:
            with open(staging, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")

    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        def write(staging: FilePath) -> None:
            pq.write_table(pa.Table.from_pylist(rows, schema=_schema(rows)), staging)

    write_atomic(path, write)


def _schema(rows: list[dict[str, Any]]):
    """The Parquet schema of ``rows`` (every part of a run has the same columns)."""
    import pyarrow as pa

    step = pa.struct(
        [
            ("module", pa.string()),
            ("op", pa.string()),
            ("index", pa.list_(pa.int64())),
            ("local_derivative", pa.float64()),
        ]
    )
    flow = pa.list_(
        pa.struct(
            [
                ("module", pa.string()),
                ("layer", pa.int64()),
                ("part", pa.string()),
                ("flow", pa.float64()),
                ("share", pa.float64()),
            ]
        )
    )
    fixed = {
        "index": pa.int64(),
        "id": pa.string(),
        "text": pa.string(),
        "target": pa.string(),
        "target_id": pa.int64(),
        "position": pa.int64(),
        "tokens": pa.list_(pa.string()),
        "prediction": pa.string(),
        "target_logit": pa.float64(),
        "target_probability": pa.float64(),
        "target_rank": pa.int64(),
        "strongest_token": pa.int64(),
        "strongest_offset": pa.int64(),
        "top_path": pa.struct(
            [("weight", pa.float64()), ("token", pa.int64()), ("steps", pa.list_(step))]
        ),
        "error": pa.string(),
    }
    default = pa.list_(pa.float64())
    return pa.schema(
        [(n, flow if n.startswith("flow_") else fixed.get(n, default)) for n in rows[0]]
    )


def read_rows(path: FilePath) -> list[dict[str, Any]]:
    """The rows of a part or a merged file."""
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _indices(path: FilePath) -> list[int]:
    """The record indices of a part (Parquet: its ``index`` column alone)."""
    if path.suffix == ".jsonl":
        return [row["index"] for row in read_rows(path)]
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["index"]).column("index").to_pylist()


def _parts(folder: FilePath) -> list[FilePath]:
    """The finished parts in ``folder`` (staging files excluded), by name."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _PART.match(p.name))


def attribute_dataset(
    model: nn.Module,
    records: Iterable[Any] | str | os.PathLike,
    out: str | os.PathLike,
    *,
    tokenizer,
    target: int | str | None = None,
    semirings: Iterable[str] = ("max-product",),
    position: int = -1,
    paths: bool = False,
    batch_size: int = 8,
    part_size: int = 256,
    format: str = "parquet",
    resume: bool = False,
    compile: bool = False,
    progress: bool = True,
    model_name: str | None = None,
    pages: bool = False,
    flow: bool | Sequence[str] = False,
) -> FilePath:
    """Attribute every record and write the table (see the module's docstring); the path of
    the merged file. ``records``: texts or mappings (``text``, optional ``target``,
    ``position``, ``id``), or a file (:func:`read_records`). Per batch of ``batch_size``
    records, one forward and one backward per semiring; rows go to disk ``part_size`` at
    a time. Rank 0 merges once every rank is done and writes ``out/report.html``
    (:mod:`.dataset_report`); with ``pages``, each record also gets its own report page,
    ``out/pages/NNNNNN.html``. ``flow``: True records each decoder layer's attention and
    MLP flow per record (a list of module names: those modules'), under every semiring of
    the run that :data:`.dataset_flow.SHARES` names: one more patched forward and one
    backward per module and batch (:mod:`.dataset_flow`)."""
    if format not in FORMATS:
        raise ValueError(f"format is one of {FORMATS}, got {format!r}")
    if batch_size < 1 or part_size < 1:
        raise ValueError("batch_size and part_size are positive numbers of records")
    names = tuple(semirings)
    for name in names:
        semiring_named(name)  # ValueError for an unknown name
    if isinstance(records, (str, os.PathLike)):
        records = read_records(records)
    records = list(records)
    out = FilePath(out)
    through = tuple(m.name for m in flow_modules(model, flow))
    if through and not any(n in SHARES for n in names):
        raise ValueError(
            f"flow is recorded under {', '.join(SHARES)}; the run's semirings are "
            f"{', '.join(names)}: add one of them"
        )
    settings = Settings(
        model_name or model_label(model),
        names,
        target,
        position,
        paths and _has_paths(names),
        format,
        through,
    )
    rank, world, joined = distributed(next(model.parameters()).device)
    try:
        _check_run(out, settings, resume, rank, world)
        parts = out / "parts"
        done = {i for p in _parts(parts) for i in _indices(p)}
        mine = [i for i in shard(records, rank, world) if i not in done]
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            _run_shard(
                model,
                records,
                mine,
                parts,
                settings,
                tokenizer,
                rank,
                world,
                batch_size,
                part_size,
                compile,
                progress and rank == 0,
                total=len(records) - len(done),
                pages=out / "pages" if pages else None,
            )
        finally:
            for m, training in modes:
                m.training = training
        _barrier(world)
        merged = out / f"records.{format}"
        if rank == 0:
            merge(out)
            write_report(out, read_rows(merged) if merged.exists() else [])
        _barrier(world)
        return merged
    finally:
        if joined:
            import torch.distributed as dist

            dist.destroy_process_group()


def _has_paths(names: tuple[str, ...]) -> bool:
    return "max-product" in names or "signed-max-product" in names


def _check_run(out: FilePath, settings: Settings, resume: bool, rank: int, world: int) -> None:
    """ValueError for a folder holding another run's parts (or any, without ``resume``);
    rank 0 then records the settings in ``run.json``."""
    _barrier(world)
    config = out / "run.json"
    if config.exists():
        recorded = json.loads(config.read_text(encoding="utf-8"))
        if not resume:
            raise ValueError(
                f"{out} holds a run already: pass resume=True (--resume) to finish it, or "
                "give another output folder"
            )
        if recorded != settings.as_dict():
            raise ValueError(
                f"{out} holds a run with other settings {recorded}; resume it with the same "
                "model, semirings, target, position, paths, format and flow, or give another "
                "folder"
            )
    _barrier(world)
    if rank == 0:
        (out / "parts").mkdir(parents=True, exist_ok=True)
        write_atomic(
            config,
            lambda s: s.write_text(json.dumps(settings.as_dict(), indent=1), encoding="utf-8"),
        )
    _barrier(world)


def _run_shard(
    model: nn.Module,
    records: list[Any],
    mine: list[int],
    parts: FilePath,
    settings: Settings,
    tokenizer,
    rank: int,
    world: int,
    batch_size: int,
    part_size: int,
    compile: bool,
    progress: bool,
    total: int,
    pages: FilePath | None = None,
) -> None:
    """Attribute the records ``mine`` of this rank, ``part_size`` rows a part."""
    matches = [_PART.match(p.name) for p in _parts(parts)]
    number = max((int(m.group(2)) for m in matches if int(m.group(1)) == rank), default=-1)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        label = "attribute dataset" + (
            f" (rank 0 of {world}, counting all ranks)" if world > 1 else ""
        )
        bar = tqdm(total=total, desc=label, unit="record", file=sys.stderr)
    pending: list[dict[str, Any]] = []

    def flush() -> None:
        nonlocal number, pending
        if pending:
            number += 1
            name = f"part-{rank:03d}-{number:05d}.{settings.format}"
            _write_rows(sorted(pending, key=lambda r: r["index"]), parts / name, settings.format)
            pending = []

    try:
        for rows in _rows(model, records, mine, settings, tokenizer, batch_size, compile, pages):
            pending.extend(rows)
            if bar is not None:
                bar.update(min(len(rows) * world, bar.total - bar.n))
            if len(pending) >= part_size:
                flush()
        flush()
    finally:
        if bar is not None:
            bar.close()


def _rows(
    model: nn.Module,
    records: list[Any],
    mine: list[int],
    settings: Settings,
    tokenizer,
    batch_size: int,
    compile: bool,
    pages: FilePath | None = None,
) -> Iterator[list[dict[str, Any]]]:
    """Rows of the records ``mine``, a batch at a time (bad records' error rows come out
    with the next batch)."""
    limit, logits = context_limit(model), logit_count(model)
    bad: list[dict[str, Any]] = []

    def checked() -> Iterator[Prepared]:
        for i in mine:
            try:
                record = as_record(records[i])
                yield prepare(
                    i, record, tokenizer, settings.target, settings.position, limit, logits
                )
            except (ValueError, TypeError) as exc:
                bad.append(_error(i, records[i], str(exc), settings))

    for batch in buckets(checked(), batch_size, window=16 * batch_size):
        errors, bad[:] = list(bad), []
        try:
            rows = _batch_rows(model, batch, settings, tokenizer, batch_size, compile, pages)
        except Exception:  # noqa: BLE001 - a record that fails the batch is found alone
            rows = [_alone(model, p, records, settings, tokenizer, compile, pages) for p in batch]
        yield errors + rows
    if bad:
        yield bad


def _alone(
    model: nn.Module,
    p: Prepared,
    records: list[Any],
    settings: Settings,
    tokenizer,
    compile: bool,
    pages: FilePath | None,
) -> dict[str, Any]:
    """Record ``p``'s row from a batch of its own, or its error row with the exception."""
    try:
        (row,) = _batch_rows(model, [p], settings, tokenizer, 1, compile, pages)
    except Exception as exc:  # noqa: BLE001 - written as the record's error row
        return _error(p.index, records[p.index], f"{type(exc).__name__}: {exc}", settings)
    return row


def _batch_rows(
    model: nn.Module,
    batch: list[Prepared],
    settings: Settings,
    tokenizer,
    batch_size: int,
    compile: bool,
    pages: FilePath | None = None,
) -> list[dict[str, Any]]:
    """One row per record of ``batch``: one forward and one backward per semiring (and
    with ``pages``, each record's report page written there)."""
    per_semiring = []
    for name in settings.semirings:
        per_semiring.append(
            attribute_batch(
                model,
                batch,
                semiring_named(name),
                tokenizer,
                paths=settings.paths and name in ("max-product", "signed-max-product"),
                model_name=settings.model,
                compile=compile,
                batch_size=batch_size,
                best_path_only=True,
                side="right" if settings.paths else None,  # paths in the text's positions
            )
        )
    modules = [named_module(n) for n in settings.flow]
    flows = {
        name: batch_flows(model, batch, semiring_named(name), tokenizer, modules)
        for name in settings.flow_semirings()
    }
    rows = []
    for b, p in enumerate(batch):
        found = [attributions[b] for attributions in per_semiring]
        if pages is not None:
            pages.mkdir(exist_ok=True)
            page = report.html_page([found])
            write_atomic(pages / page_name(p.index), lambda s: s.write_text(page, encoding="utf-8"))
        row = _row(p, settings, found)
        for name, per_record in flows.items():
            attribution = found[settings.semirings.index(name)]
            row[flow_column(name)] = flow_cells(
                name, semiring_named(name), modules, per_record[b], attribution
            )
        rows.append(row)
    return rows


def columns(settings: Settings) -> list[str]:
    """The columns of a run's rows, in order."""
    names = ["index", "id", "text", "target", "target_id", "position", "tokens"]
    for name in settings.semirings:
        names.append(column(name))
        if name == "signed-max-product":
            names.append(column(name) + "_min")
    names += ["prediction", "target_logit", "target_probability", "target_rank"]
    names += ["strongest_token", "strongest_offset"]
    names += ["top_path"] if settings.paths else []
    return names + [flow_column(n) for n in settings.flow_semirings()] + ["error"]


def _row(p: Prepared, settings: Settings, found: list[Attribution]) -> dict[str, Any]:
    first = found[0]
    prediction = first.prediction
    strongest = first.best_token()
    row: dict[str, Any] = dict.fromkeys(columns(settings))
    row.update(
        {
            "index": p.index,
            "id": p.record.id,
            "text": p.record.text,
            "target": p.label,
            "target_id": p.target,
            "position": p.position,
            "tokens": first.tokens,
            "prediction": prediction.top[0][0],
            "target_logit": prediction.target_logit,
            "target_probability": prediction.target_probability,
            "target_rank": prediction.target_rank,
            "strongest_token": strongest,
            "strongest_offset": strongest - p.position,
        }
    )
    for name, attribution in zip(settings.semirings, found):
        row[column(name)] = attribution.display_scores().tolist()
        if name == "signed-max-product":
            row[column(name) + "_min"] = attribution.min_scores().tolist()
    if settings.paths:
        row["top_path"] = _path_row(found, settings)
    return row


def _path_row(found: list[Attribution], settings: Settings) -> dict[str, Any] | None:
    """The strongest token's path under the first max semiring, as plain data."""
    for name, attribution in zip(settings.semirings, found):
        if name in ("max-product", "signed-max-product"):
            token = attribution.best_token()
            path = attribution.paths[token]
            if path is None:
                return None
            steps = [
                {
                    "module": s.module,
                    "op": s.op,
                    "index": list(s.index),
                    "local_derivative": s.local_derivative,
                }
                for s in path.steps
            ]
            return {"weight": path.weight, "token": token, "steps": steps}
    return None


def _error(index: int, item: Any, reason: str, settings: Settings) -> dict[str, Any]:
    """The row of a bad record: its index, id and text where known, and the reason (every
    other column None)."""
    text = item.get("text") if isinstance(item, dict) else item if isinstance(item, str) else None
    ident = item.get("id") if isinstance(item, dict) else None
    row = dict.fromkeys(columns(settings))
    row.update(
        index=index,
        id=None if ident is None else str(ident),
        text=text if isinstance(text, str) else None,
        error=reason,
    )
    return row


def merge(out: str | os.PathLike) -> FilePath:
    """Every part of the run in ``out`` as one file in input order, ``records.<format>``,
    and ``manifest.json`` (records, errors, parts, columns); ValueError where a record
    appears twice."""
    out = FilePath(out)
    settings = json.loads((out / "run.json").read_text(encoding="utf-8"))
    format = settings["format"]
    parts = _parts(out / "parts")
    rows = [row for p in parts for row in read_rows(p)]
    rows.sort(key=lambda r: r["index"])
    indices = [r["index"] for r in rows]
    if len(set(indices)) != len(indices):
        raise ValueError(f"{out}: a record appears in two parts; the parts are not one run's")
    merged = out / f"records.{format}"
    if rows:
        _write_rows(rows, merged, format)
    manifest = {
        **settings,
        "records": len(rows),
        "errors": sum(r["error"] is not None for r in rows),
        "file": merged.name,
        "parts": [p.name for p in parts],
        "columns": list(rows[0]) if rows else [],
    }
    write_atomic(
        out / "manifest.json",
        lambda s: s.write_text(json.dumps(manifest, indent=1), encoding="utf-8"),
    )
    return merged
