"""Entropy's log-space GEMM by a weight: its two layouts on BERT-base's linear shapes.

Per linear backward Entropy needs three GEMM products of the layer's size (dual numbers
have bilinear rank 3): z = e @ |W| and r's numerators (e·r) @ |W| + e @ (−|W| log|W|).
Two layouts run them (``semirings/log_space.py``):

- ``weight``: by a 2-D weight, [e; e·r] (2m rows) @ |W| in one GEMM, then ``addmm_`` of
  e @ (−|W| log|W|) into r's half (``gemm_by_weight``);
- ``general``: e @ |W| and [e·r | e] @ [|W|; −|W| log|W|] (k doubled), the path of batched
  operands (a weight given with a batch dim of 1 takes it here).

For each shape (message m × k, weight k × n) the script times, alternating in one process
(medians over ``--rounds``, thread CPU time, so that other processes' load counts less),
``LogSpaceGemm.run`` on each layout and native's one GEMM (m × k) @ (k × n), and prints the
times and their ratios. Usage: ``python benchmarks/entropy_gemm_layout.py --rounds 15``
(one thread unless ``--threads``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from semiring_autograd.semirings.entropy import _fresh_entropy_weights
from semiring_autograd.semirings.log_space import LogSpaceGemm

#: BERT-base's linear backwards: (m, k, n, how many per layer)
SHAPES = {
    "768x768 (q, k, v, out)": (128, 768, 768, 4),
    "768x3072 (ffn in)": (128, 768, 3072, 1),
    "3072x768 (ffn out)": (128, 3072, 768, 1),
}


def _timed(fn) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), load average "
        f"{os.getloadavg()[0]:.2f}; medians of {args.rounds} rounds (thread CPU time)\n"
    )
    print("| shape | native ms | weight ms | general ms | weight / general | weight / native |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (m, k, n, _) in SHAPES.items():
        la = torch.randn(m, k, generator=gen) * 3
        ra = torch.randn(m, k, generator=gen)
        w = torch.randn(k, n, generator=gen) * 0.05
        operands = _fresh_entropy_weights(w)  # [|w|; −|w| log|w|] (2k, n)
        message = la.exp()
        modes = {
            "native": lambda: torch.mm(message, w),
            "weight": lambda: LogSpaceGemm.run(la, None, ra, None, b_linear=operands),
            "general": lambda: LogSpaceGemm.run(
                la[None], None, ra[None], None, b_linear=operands[None]
            ),
        }
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        for fn in modes.values():  # warm-up: scratch sized, kernels loaded
            fn()
        for r in range(args.rounds):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for mode in order:
                times[mode].append(_timed(modes[mode]))
        med = {mode: statistics.median(t) * 1e3 for mode, t in times.items()}
        print(
            f"| {name} | {med['native']:.2f} | {med['weight']:.2f} | {med['general']:.2f} | "
            f"{med['weight'] / med['general']:.3f} | {med['weight'] / med['native']:.2f} |"
        )


if __name__ == "__main__":
    main()
