"""Backward alone with and without ``sa.frozen_weights``, paired against native.

Each round times one backward (after an untimed forward) per mode, in turn, in one
process: native, then each semiring plain and inside ``sa.frozen_weights(model)`` (the
scope opened for the round, its first backward untimed: the timed one reuses the lifted
weight operands, as every call after the first in a long run does). Prints each mode's
median and its ratio to native's median.

    python benchmarks/frozen_weights.py --case bert --rounds 7 --semirings Log Entropy
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import semiring_backward as bench  # noqa: E402

import semiring_autograd as sa  # noqa: E402


def timed(work: bench.Workload, mode: str, frozen: bool) -> float:
    """Seconds of one backward alone of ``mode``; inside a fresh frozen scope after one
    untimed backward when ``frozen``."""
    if not frozen:
        return bench.backward_alone(work, mode, "cpu")
    with sa.frozen_weights(work.model):
        bench.backward_alone(work, mode, "cpu")
        return bench.backward_alone(work, mode, "cpu")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="bert", choices=bench.CASES)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--semirings", nargs="+", default=["Log", "Entropy"])
    args = parser.parse_args(argv)
    work = bench.build(args.case, "cpu")
    modes = [("native", False)]
    modes += [(m, f) for m in args.semirings for f in (False, True) if m != "Real" or not f]
    for mode, frozen in modes:  # warm-up: kernels built, first-use checks done
        timed(work, mode, frozen)
    times: dict = {key: [] for key in modes}
    for _ in range(args.rounds):
        for key in modes:
            times[key].append(timed(work, *key))
    base = statistics.median(times["native", False])
    print(
        f"{bench.machine('cpu')}; {torch.get_num_threads()} threads; case {args.case}; "
        f"{args.rounds} rounds; load average {os.getloadavg()}"
    )
    print("| mode | median ms | over native |\n|---|---:|---:|")
    for (mode, frozen), values in times.items():
        median = statistics.median(values)
        name = f"{mode} (frozen)" if frozen else mode
        print(f"| {name} | {1e3 * median:.1f} | {median / base:.3f}× |")


if __name__ == "__main__":
    main()
