"""semiring-autograd explain: which input tokens, and which paths, carry a next-token logit.

    semiring-autograd explain "The capital of France is" --target " Paris" \\
        --semiring max-product

runs the embedded SmolLM2-135M (``--model`` takes any local Hugging Face causal LM
directory), prints what the model predicts, the per-token scores and the headline paths,
and writes an HTML report. ``--file PROMPTS`` explains every line of a file instead of
TEXT (one report page); ``--semiring all`` compares every built-in semiring on one page.

The command is parsed and its cheap checks run in the top-level module
``semiring_autograd_cli`` (no torch imported: ``--help`` answers at once), which then
calls :func:`run` for the rest; this module does not import it back. The target, the position and the prompt's length against the model's
context are checked against the tokenizer and the config before the weights load; the
report and the chart are written both or neither.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile
import time
from pathlib import Path

from ..explain import report
from ..explain.attribution import attribute, read_texts
from ..explain.token_scores import check_position, target_hint, target_id
from ..explain.batched import as_record, prepare
from ..explain.dataset import read_records
from ..semirings.registry import cli_names, semiring_named, spec_of
from .huggingface import DEFAULT_MODEL, context_length, load_model, load_tokenizer

__all__ = ["run"]


class UsageError(ValueError):
    """A user error found once the tokenizer and the config are read (a target that is not
    one token, a prompt beyond the context): one line, exit status 2."""


def _error(message: str) -> int:
    """Print ``message`` as the command's one-line error; the exit status of a user error."""
    print(f"semiring-autograd: {message}", file=sys.stderr)
    return 2


def _texts(args: argparse.Namespace) -> str | list[str] | list[dict]:
    """The prompt, or the prompts of ``--file`` (a .jsonl file's records); UsageError for a
    file that cannot be read or holds no text."""
    if args.file is None:
        return args.text
    try:
        if args.file.endswith(".jsonl"):
            records = read_records(args.file)
            if not records:
                raise ValueError(f"{args.file} holds no record (one JSON object per line)")
            return records
        return read_texts(args.file)
    except UnicodeDecodeError as exc:
        raise UsageError(f"--file {args.file}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise UsageError(f"--file {args.file}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:  # read_texts: no text in the file
        raise UsageError(_one_line(exc)) from None


def _check_texts(
    args: argparse.Namespace, inputs: str | list[str], tokenizer, limit: int | None, name: str
) -> None:
    """UsageError for a target that is not one token, a position outside a text, or a text
    longer than the model's context (``limit`` tokens; None: no limit). Each text is
    tokenized once."""
    if args.target is not None:
        try:
            target_id(args.target, tokenizer)
        except ValueError as exc:
            raise UsageError(_one_line(exc)) from None
    if not isinstance(inputs, str) and any(isinstance(i, dict) for i in inputs):
        for i, item in enumerate(inputs):
            try:
                prepare(i, as_record(item), tokenizer, args.target, args.position, limit)
            except (ValueError, TypeError) as exc:
                raise UsageError(f"record {i + 1} of --file: {_one_line(exc)}") from None
        return
    for i, text in enumerate([inputs] if isinstance(inputs, str) else inputs):
        length = len(tokenizer(text)["input_ids"])
        try:
            check_position(args.position, length)
        except ValueError as exc:
            raise UsageError(f"--position: {_one_line(exc)} of {text!r}") from None
        if limit is not None and length > limit:
            which = "the prompt" if isinstance(inputs, str) else f"prompt {i + 1} of --file"
            raise UsageError(
                f"{which} is {length} tokens; {name} reads at most {limit} "
                "(its config's context length): shorten it"
            )


def _one_line(exc: BaseException) -> str:
    """The first line of an exception's message, with its type when the message is empty."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(exc).__name__


def _staging_path(path: str) -> Path:
    """A new file beside ``path`` with its suffix (matplotlib reads the format from it)."""
    target = Path(path)
    handle, name = tempfile.mkstemp(
        dir=target.parent, prefix=f".{target.name}.", suffix=target.suffix or ".png"
    )
    os.close(handle)
    os.chmod(name, _mode_of_new(target))
    return Path(name)


def _mode_of_new(target: Path) -> int:
    """The permissions ``open(target, "w")`` leaves: an existing file's own, else
    ``0o666`` less the umask (mkstemp's file is private, 0600, until changed)."""
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _write_outputs(
    per_text: list, html: str, plot: str | None, per_text_scales: bool = False
) -> None:
    """The HTML report, and with ``plot`` the PNG chart: both written or neither (each is
    rendered beside its target first, then both are moved in)."""
    staged: list[tuple[Path, str]] = []
    try:
        page = _staging_path(html)
        staged.append((page, html))
        page.write_text(
            report.html_page(per_text, per_text_scales=per_text_scales), encoding="utf-8"
        )
        if plot:
            chart = _staging_path(plot)
            staged.append((chart, plot))
            report.plot_scores(per_text[0], chart)
        for staging, target in staged:
            os.replace(staging, target)
    finally:
        for staging, _ in staged:
            staging.unlink(missing_ok=True)


def _load(what: str, loader, path: str | None):
    """``loader(path)``; UsageError with one line when the files cannot be loaded (missing
    or unreadable files, a malformed config or tokenizer, a model type or a library this
    transformers does not know). Any other exception is a fault and is raised."""
    try:
        return loader(path)
    except (OSError, ValueError, ImportError, KeyError) as exc:
        where = f" from {path}" if path is not None else ""
        raise UsageError(f"cannot load the {what}{where}: {_one_line(exc)}") from None


def run(args: argparse.Namespace) -> int:
    """Explain as ``args`` (parsed and checked by ``semiring_autograd_cli``) ask; the exit
    status."""
    try:
        return _explain(args)
    except UsageError as exc:
        return _error(_one_line(exc))
    except _WriteError as exc:
        _error(str(exc))
        return 1


class _WriteError(Exception):
    """The report or the chart could not be written (a full disk, a folder gone): the
    environment's problem, one line and exit status 1."""


def _explain(args: argparse.Namespace) -> int:
    """Tokenizer and config (checked), model, attribution per semiring, report."""
    if args.out is not None:
        return _explain_dataset(args)
    inputs = _texts(args)
    name = args.model or DEFAULT_MODEL
    start = time.perf_counter()
    print(f"reading the tokenizer and the config of {name} ...", flush=True)
    tokenizer = _load("tokenizer", load_tokenizer, args.model)
    _check_texts(args, inputs, tokenizer, _load("config", context_length, args.model), name)
    hint = None if args.target is None else target_hint(args.target, tokenizer)
    if hint is not None:
        print(f"semiring-autograd: note: {hint}", file=sys.stderr)
    print(f"loading {name} ...", flush=True)
    model = _load("model", load_model, args.model)
    loaded = time.perf_counter()
    names = cli_names() if args.semiring == "all" else (args.semiring,)
    per_semiring = []  # per semiring, its attribution of each text
    timings = []
    for semiring_name in names:
        begun = time.perf_counter()
        result = attribute(
            model,
            inputs,
            args.target,
            semiring_name,
            tokenizer=tokenizer,
            position=args.position,
            model_name=None,  # model_label: the Hub id or the folder's name, not its path
            paths=not args.no_paths,
            compile=args.compile,
            batch_size=args.batch_size or 1,
        )
        per_semiring.append(result if isinstance(result, list) else [result])
        spec = spec_of(semiring_named(semiring_name))
        with_paths = spec is not None and spec.top_paths in ("max", "signed") and not args.no_paths
        paths = " + paths" if with_paths else ""
        timings.append(
            f"{semiring_name}: patched forward + semiring backward{paths} "
            f"{time.perf_counter() - begun:.2f} s"
        )
    per_text = [list(group) for group in zip(*per_semiring)]
    for group in per_text:
        for r in group:
            print(r)
            print()
    try:
        _write_outputs(per_text, args.html, args.plot, args.per_text_scales)
    except OSError as exc:
        written = args.html if not args.plot else f"{args.html} and {args.plot}"
        raise _WriteError(f"cannot write {written}: {exc.strerror or _one_line(exc)}") from exc
    print(f"wrote {args.html}")
    if args.plot:
        print(f"wrote {args.plot}")
    print(f"load {loaded - start:.1f} s; " + "; ".join(timings))
    return 0


def _explain_dataset(args: argparse.Namespace) -> int:
    """``--out``: every record of ``--file`` attributed into a table (bad records as error
    rows), batched, resumable, sharded by rank under torchrun."""
    from ..explain.dataset import attribute_dataset

    try:
        records = read_records(args.file)
    except UnicodeDecodeError as exc:
        raise UsageError(f"--file {args.file}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise UsageError(f"--file {args.file}: cannot read it ({exc.strerror})") from None
    name = args.model or DEFAULT_MODEL
    rank = int(os.environ.get("RANK", "0"))  # torchrun's; the run joins its group
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"reading the tokenizer of {name} ...", flush=True)
    tokenizer = _load("tokenizer", load_tokenizer, args.model)
    if args.target is not None:
        try:
            target_id(args.target, tokenizer)
        except ValueError as exc:
            raise UsageError(_one_line(exc)) from None
    say(f"loading {name} ...", flush=True)
    model = _load("model", load_model, args.model)
    names = cli_names() if args.semiring == "all" else (args.semiring,)
    start = time.perf_counter()
    try:
        merged = attribute_dataset(
            model,
            records,
            args.out,
            tokenizer=tokenizer,
            target=args.target,
            semirings=names,
            position=args.position,
            paths=not args.no_paths,
            batch_size=args.batch_size or 8,
            part_size=args.part_size,
            format=args.format,
            resume=args.resume,
            compile=args.compile,
            flow=args.flow,
        )
    except ValueError as exc:  # a folder holding another run, flow the model cannot give
        raise UsageError(_one_line(exc)) from None
    manifest = json.loads((Path(args.out) / "manifest.json").read_text(encoding="utf-8"))
    say(
        f"wrote {merged}: {manifest['records']} records ({manifest['errors']} error rows) in "
        f"{time.perf_counter() - start:.1f} s"
    )
    return 0
