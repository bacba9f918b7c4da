"""``semiring-autograd explain``: which input tokens, and which path, carry a logit.

    semiring-autograd explain "The capital of France is" --target " Paris" \\
        --semiring max-product

runs the embedded SmolLM2-135M (``--model`` takes any local Hugging Face causal LM
directory), prints the per-token scores and the top path, and writes an HTML report.
``--file PROMPTS`` explains every line of a file instead of TEXT (one report page).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..explain import report
from ..explain.attribution import attribute, read_texts
from ..semirings.registry import cli_names
from .huggingface import DEFAULT_MODEL, load_causal_lm


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="semiring-autograd", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser(
        "explain", help="attribute the next-token logit of a causal LM to the prompt's tokens"
    )
    explain.add_argument("text", nargs="?", help="the prompt (or give --file)")
    explain.add_argument(
        "--file", default=None, help="a UTF-8 file of prompts, one per line, instead of TEXT"
    )
    explain.add_argument("--target", required=True, help="the next token, e.g. ' Paris'")
    explain.add_argument(
        "--semiring",
        default="max-product",
        choices=list(cli_names()),
        help="default: max-product",
    )
    explain.add_argument(
        "--model",
        default=None,
        help=f"a local Hugging Face model directory (default: {DEFAULT_MODEL})",
    )
    explain.add_argument(
        "--html", default="explain.html", help="report file (default: explain.html)"
    )
    explain.add_argument("--plot", default=None, help="also write a PNG bar chart here")
    return parser


def _error(message: str) -> int:
    print(f"semiring-autograd: {message}", file=sys.stderr)
    return 2


def _inputs(args: argparse.Namespace) -> str | list[str]:
    """The prompt, or the prompts of ``--file``; ValueError when neither or both."""
    if (args.text is None) == (args.file is None):
        raise ValueError("give the prompt as TEXT or a file of prompts with --file, not both")
    if args.file is not None:
        if args.plot:
            raise ValueError("--plot draws one prompt's scores: give TEXT, not --file")
        if not Path(args.file).is_file():
            raise ValueError(f"--file {args.file}: no such file")
        return read_texts(args.file)
    if not args.text.strip():
        raise ValueError("the prompt is empty: give a text to explain")
    return args.text


def _check_model_directory(path: str) -> None:
    """A clear error for a ``--model`` that is not a Hugging Face model directory."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"--model {path}: no such directory (give a local model directory)")
    if not (directory / "config.json").is_file():
        raise ValueError(
            f"--model {path}: not a Hugging Face model directory (it has no config.json); "
            "save one with model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR)"
        )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        inputs = _inputs(args)
        if args.model is not None:
            _check_model_directory(args.model)
    except (ValueError, OSError) as exc:
        return _error(str(exc))
    start = time.perf_counter()
    print(f"loading {args.model or DEFAULT_MODEL} ...", flush=True)
    try:
        model, tokenizer = load_causal_lm(args.model)
    except (OSError, ModuleNotFoundError, ValueError) as exc:
        return _error(f"cannot load the model: {exc}")
    loaded = time.perf_counter()
    try:
        result = attribute(model, inputs, args.target, args.semiring, tokenizer=tokenizer)
    except ValueError as exc:
        return _error(str(exc))
    done = time.perf_counter()
    results = result if isinstance(result, list) else [result]
    for r in results:
        print(r)
    report.html_page(results, args.html)
    print(f"wrote {args.html}")
    if args.plot:
        results[0].plot(args.plot)
        print(f"wrote {args.plot}")
    print(
        f"load {loaded - start:.1f} s; patched forward + semiring backward + paths {done - loaded:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
