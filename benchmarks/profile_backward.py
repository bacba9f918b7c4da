"""Where one eager semiring backward spends its time: by operator and by Python frame.

For a case of ``semiring_backward.py`` (``bert``: BERT-base, random weights, sequence 128;
``smollm2``: the pretrained SmolLM2-135M the tests load, a 5-token prompt read at the
logit of its last token) and each semiring asked for, the patched forward runs untimed,
then ``sa.grad`` runs (after one warm-up call) under

- ``torch.profiler``: the operators' self time, the top ``--ops`` rows (``aten::`` and
  ``semiring_autograd::`` operators), with calls per backward and the share of the call's
  wall time; and the sum of the operators' self time over the wall time (the rest is
  Python and the autograd engine);
- ``cProfile``: the Python functions by their own time (``tottime``), the top ``--frames``
  rows (a built-in such as ``torch.bmm`` is listed under its own name: its time is the
  operator's), and the op rules (``<op>_vjp`` of the generated modules) by cumulative time:
  which ops' backwards cost what.

Usage: ``python benchmarks/profile_backward.py --case bert --semirings Real MaxProduct``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import semiring_backward as sb  # noqa: E402 -- the benchmark's cases


def smollm2() -> sb.Workload:
    """The pretrained SmolLM2-135M (tests/model_zoo.py), "The capital of France is"."""
    import model_zoo

    model, tokenizer = model_zoo.smollm2()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        leaf = model.get_input_embeddings()(ids)
    leaf.requires_grad_(True)
    target = int(ids[0, -1])
    return sb.Workload(model, leaf, lambda: model(inputs_embeds=leaf).logits[0, -1, target])


def build(case: str) -> sb.Workload:
    return smollm2() if case == "smollm2" else sb.build(case, "cpu")


def forward(work: sb.Workload, mode: str) -> torch.Tensor:
    if mode == "native":
        return work.forward()
    import semiring_autograd as sa

    with sa.patch(work.model, sb.semiring_of(mode)):
        return work.forward()


def backward(work: sb.Workload, mode: str, out: torch.Tensor) -> None:
    if mode == "native":
        torch.autograd.grad(out, work.leaf)
    else:
        import semiring_autograd as sa

        sa.grad(out, work.leaf, compile=sb.COMPILE)


def operator_table(work: sb.Workload, mode: str, rows: int) -> str:
    """The top operators of one backward by self time."""
    from torch.profiler import ProfilerActivity, profile

    out = forward(work, mode)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        backward(work, mode, out)
        wall = time.perf_counter() - start
    events = [
        e
        for e in prof.key_averages()
        if e.key.startswith(("aten::", "semiring_autograd::")) and e.self_cpu_time_total > 0
    ]
    events.sort(key=lambda e: -e.self_cpu_time_total)
    inside = sum(e.self_cpu_time_total for e in events) / 1e6
    lines = [
        f"{mode}: backward {wall * 1e3:.1f} ms under the profiler, "
        f"operators' self time {inside * 1e3:.1f} ms ({inside / wall:.0%}), "
        f"{sum(e.count for e in events)} operator calls",
        "",
        "| operator | calls | self ms | of wall |",
        "|---|---:|---:|---:|",
    ]
    for e in events[:rows]:
        spent = e.self_cpu_time_total / 1e6
        lines.append(f"| `{e.key}` | {e.count} | {spent * 1e3:.1f} | {spent / wall:.1%} |")
    return "\n".join(lines)


def frame_table(work: sb.Workload, mode: str, rows: int) -> str:
    """The top Python functions of one backward by own time (cProfile)."""
    out = forward(work, mode)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    backward(work, mode, out)
    profiler.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # tottime
    calls = sum(v[1] for v in stats.stats.values())
    lines = [
        f"{mode}: backward {wall * 1e3:.1f} ms under cProfile, {calls} Python calls",
        "",
        "| function | calls | own ms | cumulative ms |",
        "|---|---:|---:|---:|",
    ]
    root = str(Path(__file__).resolve().parents[1])
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in entries[:rows]:
        where = file.replace(root + "/", "") if file != "~" else ""
        label = f"{where}:{line} {name}" if where else name
        lines.append(f"| `{label}` | {ncalls} | {tottime * 1e3:.1f} | {cumtime * 1e3:.1f} |")
    rules = [kv for kv in entries if kv[0][2].endswith("_vjp")]
    rules.sort(key=lambda kv: -kv[1][3])
    lines += ["", "| op rule | calls | cumulative ms | of wall |", "|---|---:|---:|---:|"]
    for (_, _, name), (_, ncalls, _, cumtime, _) in rules[:rows]:
        lines.append(f"| `{name}` | {ncalls} | {cumtime * 1e3:.1f} | {cumtime / wall:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="bert", choices=("bert", "smollm2", *sb.CASES))
    parser.add_argument("--semirings", nargs="+", default=["Real", "MaxProduct", "Log", "Entropy"])
    parser.add_argument("--ops", type=int, default=12, help="operator rows per semiring")
    parser.add_argument("--frames", type=int, default=15, help="Python rows per semiring")
    parser.add_argument("--compile", action="store_true", help="sa.grad(..., compile=True)")
    args = parser.parse_args()
    sb.COMPILE = args.compile
    work = build(args.case)
    print(f"Machine: {sb.machine('cpu')}; case {args.case}\n")
    for mode in args.semirings:
        backward(work, mode, forward(work, mode))  # warm-up: kernels built, caches filled
        print(operator_table(work, mode, args.ops), end="\n\n")
        print(frame_table(work, mode, args.frames), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
