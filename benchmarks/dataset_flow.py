"""The cost of a dataset run's module flow (``attribute_dataset(..., flow=True)``) on the
embedded SmolLM2-135M: records/s with and without it, in one process.

The texts of ``benchmarks/attribute_dataset.py`` (5 to 40 tokens, target " the"),
MaxProduct scores without top paths, batches of 8, one thread; with ``flow``, each of the
30 decoder layers' attention and MLP (60 modules). Each setting runs ``--repeats`` times,
alternating, into a fresh folder (model load excluded, merge and report included).

    python benchmarks/dataset_flow.py [--count 16] [--repeats 2] [--semiring max-product]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attribute_dataset import TARGET, texts  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=16, help="records (the first of the 64)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--semiring", default="max-product")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from semiring_autograd.explain.dataset import attribute_dataset
    from semiring_autograd.integrations.huggingface import load_causal_lm

    model, tokenizer = load_causal_lm()
    records = texts(tokenizer)[: args.count]
    lengths = [len(tokenizer(t)["input_ids"]) for t in records]
    print(
        f"SmolLM2-135M, {len(records)} texts of {min(lengths)}-{max(lengths)} tokens, "
        f"{args.semiring}, batch {args.batch_size}, {torch.get_num_threads()} thread, CPU"
    )
    found: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for flow in (False, True):
            with tempfile.TemporaryDirectory() as folder:
                start = time.perf_counter()
                attribute_dataset(
                    model,
                    records,
                    Path(folder) / "run",
                    tokenizer=tokenizer,
                    target=TARGET,
                    semirings=(args.semiring,),
                    paths=False,
                    batch_size=args.batch_size,
                    progress=False,
                    flow=flow,
                )
                seconds = time.perf_counter() - start
            found[flow].append(len(records) / seconds)
            label = "with flow   " if flow else "without flow"
            print(f"{label}: {found[flow][-1]:7.3f} records/s ({seconds:.1f} s)")
    best = {flow: max(rates) for flow, rates in found.items()}
    print(
        f"best: without {best[False]:.3f}, with {best[True]:.3f} records/s; flow costs "
        f"{best[False] / best[True]:.1f}x the time"
    )


if __name__ == "__main__":
    main()
