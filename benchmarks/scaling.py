"""How each semiring's time and memory grow, against native's: sequence length, hidden size, k.

Three sweeps, each on random-weight SmolLM2-shaped Llama layers (hidden 576, intermediate
1536, 9 query heads sharing 3 key/value heads, SDPA; no vocabulary head: the scalar read is
one element of the last layer's output at the last position, its gradient taken w.r.t. the
input embeddings):

- ``--sweep seq``: sequence length (default 32 → 2048), ``--layers`` layers;
- ``--sweep hidden``: hidden size h (default 64 → 4096; intermediate 8h/3, one head per 64,
  three query heads per key/value head where they divide), sequence ``--length``;
- ``--sweep k``: k (default 1 → 32) of ``sa.top_paths`` (on one recorded MaxProduct
  backward with paths) and of the ``sa.KBest(k)`` backward, sequence ``--length``.

seq and hidden time forward + backward (native: ``torch.autograd.grad``; a semiring:
patched forward + ``sa.grad``; a semiring named with ``+paths``, e.g. ``MaxProduct+paths``:
the forward under ``paths=True`` and the backward that records every node's messages for
path search, ``PathFinder``), the median of ``--reps`` rounds in which every mode runs
once (a shared machine's drift hits each alike), and peak memory (the process's peak
resident set over one call above the resident set before it). The k sweep times the
backward or the search alone. Each series' growth is fitted as time ∝ size^p by least
squares on log-log, over every size and over the upper half of the sizes (where fixed
per-op costs weigh least); the table states p and p − p(native).

Usage: ``python benchmarks/scaling.py --sweep seq --sizes 32 64 128 256 512 1024``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the model zoo
sys.path.insert(0, str(Path(__file__).resolve().parent))

import semiring_backward  # noqa: E402

import semiring_autograd as sa  # noqa: E402
from semiring_autograd.explain.k_paths import top_paths_from  # noqa: E402
from semiring_autograd.explain.paths import PathFinder  # noqa: E402

DEFAULT_SIZES = {
    "seq": [32, 64, 128, 256, 512, 1024, 2048],
    "hidden": [64, 128, 256, 512, 1024, 2048, 4096],
    "k": [1, 2, 4, 8, 16, 32],
}
DEFAULT_SEMIRINGS = ["MaxProduct", "Log", "Entropy", "KBest5"]


def semiring_named(name: str) -> sa.Semiring:
    """``KBest5`` → ``sa.KBest(5)``; any other name: ``getattr(sa, name)()``."""
    if name.startswith("KBest"):
        return sa.KBest(int(name[5:] or 3))
    return getattr(sa, name)()


def layers(hidden: int, n_layers: int) -> torch.nn.Module:
    """Random-weight SmolLM2-shaped Llama layers (no head) of width ``hidden``, float32."""
    import model_zoo
    import transformers

    heads = max(1, hidden // 64)
    config = model_zoo.llama_config(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=8 * hidden // 3,
        num_attention_heads=heads,
        num_key_value_heads=heads // 3 if heads % 3 == 0 else heads,
        num_hidden_layers=n_layers,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaModel(config).eval()


class Case:
    """One model and input: the forward to the read scalar, per mode a step."""

    def __init__(self, model: torch.nn.Module, length: int):
        self.model = model
        hidden = model.config.hidden_size
        self.emb = torch.randn(1, length, hidden, generator=torch.Generator().manual_seed(1))

    def forward(self, semiring: sa.Semiring | None = None, paths: bool = False):
        x = self.emb.clone().requires_grad_()
        if semiring is None:
            return x, self.model(inputs_embeds=x).last_hidden_state[0, -1, 0]
        with sa.patch(self.model, semiring, paths=paths):
            y = self.model(inputs_embeds=x).last_hidden_state[0, -1, 0]
        return x, y

    def step(self, mode: str) -> None:
        if mode == "native":
            torch.autograd.grad(*reversed(self.forward()))
            return
        paths = mode.endswith("+paths")
        x, y = self.forward(semiring_named(mode.removesuffix("+paths")), paths=paths)
        if paths:
            PathFinder(y, x)  # the backward with every node's messages kept for the search
        else:
            sa.grad(y, x)


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def peak_bytes(fn: Callable[[], object]) -> int:
    """The peak resident set over one call of ``fn`` above the resident set before it."""
    semiring_backward._release_freed_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set (VmHWM) to the current one
    base = semiring_backward._rss_bytes("VmRSS")
    fn()
    return semiring_backward._rss_bytes("VmHWM") - base


def rounds(steps: dict[str, Callable[[], float]], reps: int) -> dict[str, float]:
    """Median seconds per step over ``reps`` rounds (each step once a round) after a
    warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(reps + 1):
        for name, step in steps.items():
            t = step()
            if round_:
                times[name].append(t)
    return {name: statistics.median(t) for name, t in times.items()}


def sweep_model(sweep: str, size: int, args) -> dict[str, dict[str, float]]:
    """Per mode, the median seconds and peak bytes of forward + backward at ``size``."""
    hidden = size if sweep == "hidden" else 576
    length = size if sweep == "seq" else args.length
    case = Case(layers(hidden, args.layers), length)
    modes = ["native", *args.semirings]
    medians = rounds({m: (lambda m=m: seconds(lambda: case.step(m))) for m in modes}, args.reps)
    return {m: {"s": medians[m], "bytes": peak_bytes(lambda m=m: case.step(m))} for m in modes}


def sweep_k(k: int, case: Case, args) -> dict[str, dict[str, float]]:
    """top_paths(k) on one recorded backward and the KBest(k) backward, with the MaxProduct
    backward and the backward with paths they are compared to."""

    def backward(semiring: sa.Semiring) -> float:
        x, y = case.forward(semiring)
        return seconds(lambda: sa.grad(y, x))

    def with_paths() -> float:
        x, y = case.forward(sa.MaxProduct(), paths=True)
        start = time.perf_counter()
        finder = PathFinder(y, x)
        elapsed = time.perf_counter() - start
        found["finder"] = finder
        return elapsed

    found: dict[str, PathFinder] = {}
    steps = {
        "MaxProduct backward": lambda: backward(sa.MaxProduct()),
        "backward with paths": with_paths,
        "top_paths": lambda: seconds(lambda: top_paths_from(found["finder"], k)),
        "KBest backward": lambda: backward(sa.KBest(k)),
    }
    medians = rounds(steps, args.reps)
    return {name: {"s": s} for name, s in medians.items()}


def exponent(sizes: list[int], values: list[float]) -> float:
    """The least-squares slope p of log(value) against log(size): value ∝ size^p."""
    xs, ys = [math.log(s) for s in sizes], [math.log(max(v, 1e-12)) for v in values]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def fits(sizes: list[int], series: list[float]) -> tuple[float, float]:
    """The exponent over every size and over the upper half (at least three sizes)."""
    upper = max(0, min(len(sizes) // 2, len(sizes) - 3))
    return exponent(sizes, series), exponent(sizes[upper:], series[upper:])


def table(sweep: str, sizes: list[int], results: list[dict], args) -> str:
    modes = list(results[0])
    label = {"seq": "sequence", "hidden": "hidden", "k": "k"}[sweep]
    lines = []
    if sweep == "k":
        lines += [
            f"| {label} | " + " | ".join(f"{m} ms" for m in modes) + " | top_paths / with paths "
            "| KBest / MaxProduct |",
            "|---:|" + "---:|" * (len(modes) + 2),
        ]
        for size, row in zip(sizes, results):
            cells = [f"{row[m]['s'] * 1e3:.1f}" for m in modes]
            tp = row["top_paths"]["s"] / row["backward with paths"]["s"]
            kb = row["KBest backward"]["s"] / row["MaxProduct backward"]["s"]
            lines.append(f"| {size} | " + " | ".join(cells) + f" | {tp:.2f}× | {kb:.2f}× |")
    else:
        lines += [
            f"| {label} | native ms | native MiB | "
            + " | ".join(f"{m} ms (× native) | {m} MiB (× native)" for m in modes[1:])
            + " |",
            "|---:|---:|---:|" + "---:|---:|" * (len(modes) - 1),
        ]
        for size, row in zip(sizes, results):
            nat = row["native"]
            cells = [f"{nat['s'] * 1e3:.1f}", f"{nat['bytes'] / 2**20:.1f}"]
            for m in modes[1:]:
                r = row[m]
                cells.append(f"{r['s'] * 1e3:.1f} ({r['s'] / nat['s']:.2f}×)")
                ratio = r["bytes"] / nat["bytes"] if nat["bytes"] > 0 else float("nan")
                cells.append(f"{r['bytes'] / 2**20:.1f} ({ratio:.2f}×)")
            lines.append(f"| {size} | " + " | ".join(cells) + " |")
    lines += ["", f"Exponent p of time ∝ {label}^p (all sizes; upper half):", ""]
    base = None
    for m in modes:
        p_all, p_up = fits(sizes, [row[m]["s"] for row in results])
        line = f"- {m}: time p = {p_all:.2f}; {p_up:.2f}"
        if sweep != "k":
            m_all, m_up = fits(sizes, [max(row[m]["bytes"], 1.0) for row in results])
            line += f"; memory p = {m_all:.2f}; {m_up:.2f}"
        if base is None:
            base = (p_all, p_up)
        elif sweep != "k":
            line += f" (time p − native's: {p_all - base[0]:+.2f}; {p_up - base[1]:+.2f})"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", choices=list(DEFAULT_SIZES), required=True)
    parser.add_argument("--sizes", type=int, nargs="+", help="default: the full range")
    parser.add_argument("--semirings", nargs="+", default=DEFAULT_SEMIRINGS)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--length", type=int, default=128, help="sequence (hidden, k sweeps)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = args.sizes or DEFAULT_SIZES[args.sweep]
    results = []
    case = Case(layers(576, args.layers), args.length) if args.sweep == "k" else None
    for size in sizes:
        if args.sweep == "k":
            row = sweep_k(size, case, args)
        else:
            row = sweep_model(args.sweep, size, args)
        results.append(row)
        print(
            f"{args.sweep} {size}: " + ", ".join(f"{m} {r['s']:.3f} s" for m, r in row.items()),
            file=sys.stderr,
            flush=True,
        )
    load = os.getloadavg()
    shape = f"{args.layers} SmolLM2-shaped layers"
    if args.sweep != "seq":
        shape += f", sequence {args.length}"
    head = (
        f"`--sweep {args.sweep} --sizes {' '.join(map(str, sizes))}`: {shape}; "
        f"{semiring_backward.machine('cpu')}; load average {load[0]:.1f} / {load[1]:.1f} / "
        f"{load[2]:.1f}; medians of {args.reps} rounds."
    )
    text = head + "\n\n" + table(args.sweep, sizes, results, args)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
