"""Paired: the tiny Llama's compiled step with and without two rewrites of its program.

The model, inputs and read of ``dispatch_bound.py`` (one thread). Per semiring, in one
process, two compiled steps of the same model are captured after one eager backward (so
the kernels' scratch buffers exist, as in ``dispatch_bound.py``): "off" generated with the
rewrites ``_constant_views`` (views of constants held by the program) and ``_fill_in_part``
(a filled buffer copied into in part as one ``cat``) of ``engine/compiled/rewrite.py`` left
out, "on" with every rewrite. Both are checked equal, then timed alternating with
native forward + backward, ``--rounds`` rounds after 3 warm-up rounds. Prints per semiring
the medians over native, the median of the per-round on/off ratios, and each program's
operators.

Usage: ``python benchmarks/compiled_rewrites.py [--rounds 41] [--semirings Log,Entropy]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from dispatch_bound import build, native_step, patched_forward, semiring_of

import semiring_autograd as sa
from semiring_autograd.engine.compiled import backward as compiled
from semiring_autograd.engine.compiled import rewrite

SEMIRINGS = "MaxProduct,SignedMaxProduct,Log,Entropy,Boolean,Counting"
#: the rewrites left out of "off", and what each does instead
LEFT_OUT = {
    "_constant_views": lambda steps, results, constants: (steps, results, constants),
    "_fill_in_part": lambda steps, results, constants: (steps, constants),
}


def captured(model, emb, target, semiring, rewrites: bool):
    """A compiled step, captured and its program built with or without the rewrites."""
    kept = {name: getattr(rewrite, name) for name in LEFT_OUT}
    if not rewrites:
        for name, instead in LEFT_OUT.items():
            setattr(rewrite, name, instead)
    try:
        step = sa.compiled_step(
            model, semiring, lambda m, x: m(inputs_embeds=x).logits[0, -1, target]
        )
        for _ in range(3):
            step(emb)  # captured, checked, warm
    finally:
        for name, function in kept.items():
            setattr(rewrite, name, function)
    return step


def measure(name: str, rounds: int) -> str:
    model, emb, target = build()
    compiled.clear()
    semiring = semiring_of(name)
    sa.grad(patched_forward(model, emb, target, semiring), emb)
    steps = {kind: captured(model, emb, target, semiring, kind == "on") for kind in ("off", "on")}
    operators = [p.steps for c in compiled._CACHE.values() for p in c.programs]
    if not torch.equal(steps["off"](emb), steps["on"](emb)):
        raise RuntimeError(f"{name}: the two programs disagree")
    times: dict[str, list[float]] = {"native": [], "off": [], "on": []}
    for i in range(3 + rounds):
        for kind in times:
            start = time.perf_counter()
            if kind == "native":
                native_step(model, emb, target)
            else:
                steps[kind](emb)
            if i >= 3:
                times[kind].append(time.perf_counter() - start)
    if compiled.stats()["eager"]:
        raise RuntimeError(f"{name}: a step ran eagerly")
    native = statistics.median(times["native"])
    ratio = statistics.median(on / off for on, off in zip(times["on"], times["off"]))
    return (
        f"| {name} | {native * 1e3:.2f} ms | {statistics.median(times['off']) / native:.2f}× "
        f"| {statistics.median(times['on']) / native:.2f}× | {ratio:.3f} "
        f"| {operators[0]} | {operators[1]} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--semirings", default=SEMIRINGS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| semiring | native fwd+bwd | step, rewrites off | step, rewrites on | on / off "
        "(per round) | operators off | operators on |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.semirings.split(","):
        print(measure(name, args.rounds), flush=True)


if __name__ == "__main__":
    main()
