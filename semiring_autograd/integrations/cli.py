"""``semiring-autograd explain``: which input tokens, and which path, carry a logit.

    semiring-autograd explain "The capital of France is" --target " Paris" \\
        --semiring max-product

runs the embedded SmolLM2-135M (``--model`` takes any local Hugging Face causal LM
directory), prints the per-token scores and the top path, and writes an HTML report.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..explain.attribution import attribute
from ..semirings.registry import cli_names
from .huggingface import DEFAULT_MODEL, load_causal_lm


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="semiring-autograd", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser(
        "explain", help="attribute the next-token logit of a causal LM to the prompt's tokens"
    )
    explain.add_argument("text", help="the prompt")
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    print(f"loading {args.model or DEFAULT_MODEL} ...", flush=True)
    try:
        model, tokenizer = load_causal_lm(args.model)
    except (OSError, ModuleNotFoundError, ValueError) as exc:
        print(f"semiring-autograd: cannot load the model: {exc}", file=sys.stderr)
        return 2
    loaded = time.perf_counter()
    try:
        result = attribute(model, args.text, args.target, args.semiring, tokenizer=tokenizer)
    except ValueError as exc:
        print(f"semiring-autograd: {exc}", file=sys.stderr)
        return 2
    done = time.perf_counter()
    print(result)
    result.to_html(args.html)
    print(f"wrote {args.html}")
    if args.plot:
        result.plot(args.plot)
        print(f"wrote {args.plot}")
    print(
        f"load {loaded - start:.1f} s; patched forward + semiring backward + paths {done - loaded:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
