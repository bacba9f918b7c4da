"""Backward alone over native's, paired in one process, by the thread's CPU time.

On a shared machine another process's load stretches wall time by whatever share of a
core it takes; the thread's CPU time (``time.thread_time``) leaves out the time the thread
waits, so ratios drift less (cache and memory contention still count). Each round times one
backward per mode (after an untimed forward), native and each semiring, in an order that
alternates between rounds; prints each mode's median CPU and wall ms, its ratio to native's
median, and the median over rounds of the ratio within a round. Run with one thread
(``OMP_NUM_THREADS=1``) where other processes share the machine.

    OMP_NUM_THREADS=1 python benchmarks/backward_cpu_time.py --case bert --rounds 9 \\
        --semirings Log Entropy
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

import semiring_backward as bench  # noqa: E402


def timed(work: bench.Workload, mode: str) -> tuple[float, float]:
    """(thread CPU seconds, wall seconds) of one backward alone of ``mode``."""
    import semiring_autograd as sa

    if mode == "native":
        out = work.forward()
    else:
        with sa.patch(work.model, bench.semiring_of(mode)):
            out = work.forward()
    cpu, wall = time.thread_time(), time.perf_counter()
    if mode == "native":
        torch.autograd.grad(out, work.leaf)
    else:
        sa.grad(out, work.leaf)
    return time.thread_time() - cpu, time.perf_counter() - wall


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="bert", choices=bench.CASES)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--semirings", nargs="+", default=["Entropy"])
    args = parser.parse_args(argv)
    work = bench.build(args.case, "cpu")
    modes = ["native", *args.semirings]
    for mode in modes:  # warm-up: kernels built, first-use checks done, scratch sized
        timed(work, mode)
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            times[mode].append(timed(work, mode))
    native_cpu = statistics.median(c for c, _ in times["native"])
    print(
        f"{bench.machine('cpu')}; {torch.get_num_threads()} threads; case {args.case}; "
        f"{args.rounds} rounds; load average {os.getloadavg()}"
    )
    print("| mode | CPU ms | wall ms | over native (CPU) | within a round |")
    print("|---|---:|---:|---:|---:|")
    for mode, values in times.items():
        cpu = statistics.median(c for c, _ in values)
        wall = statistics.median(w for _, w in values)
        paired = statistics.median(c / n for (c, _), (n, _) in zip(values, times["native"]))
        print(
            f"| {mode} | {1e3 * cpu:.1f} | {1e3 * wall:.1f} | {cpu / native_cpu:.3f}× "
            f"| {paired:.3f}× |"
        )


if __name__ == "__main__":
    main()
