"""Semiring backward vs native backward: time and peak-memory ratios, as a markdown table.

For every case (BERT-base, GPT-2-small, MLP 784-500-10, ResNet-18 and ViT-B/16 shapes, the
dispatch-bound tiny Llama of ``dispatch_bound.py``, and a Llama-2-7B-shaped stack in
bfloat16: 4 of its layers, or all 32 as ``llama7b-32``) and every built-in semiring (Real
twice: ``sa.Real()``, torch's own graph, and ``Real-formulas``, the generated formulas),
one run measures, on the same inputs (same seed):

- native: forward + ``torch.autograd.grad`` of one output scalar w.r.t. the input
  embeddings (the MLP: w.r.t. its input batch; the vision models: w.r.t. the pixels);
- semiring: patched forward + ``sa.grad`` of the same scalar w.r.t. the same tensor.

Each (case, mode) runs in its own subprocess, twice: once for time (first call reported
apart, as it includes any kernel compilation; then the median of the repetitions after a
warm-up) and once for peak memory (on CPU the process's peak resident set over one call,
minus the resident set just before it; on CUDA ``torch.cuda.max_memory_allocated``).
A semiring's timing subprocess also times native calls, alternating with its own, and its
time ratio divides the two medians of that process: a shared machine's speed drifts
between subprocesses (10% and more on a 2-core VM), and pairing cancels the drift. Memory
ratios divide by the native subprocess's figure. "Backward alone" pairs ``sa.grad`` with
``torch.autograd.grad`` after untimed forwards; "its GEMMs alone" is the time the semiring
backward spends in GEMM operators (``torch.profiler`` self time) over that native backward:
the floor of "backward alone" while the semiring's matmuls run as GEMMs.

``--in-process`` measures each case's modes in one process instead (the model built once;
peak memory from ``torch.cuda.max_memory_allocated`` after a reset on CUDA, from the reset
peak resident set on CPU) and appends one JSON line per (case, mode) to ``--jsonl`` as it
is measured: ``scripts/gpu-check`` runs it so, where a bare machine's minutes are counted.

Usage: ``python benchmarks/semiring_backward.py [--device cuda] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the model zoo

CASES = ("bert", "gpt2", "mlp", "resnet18", "vit", "tinyllama", "llama7b", "llama7b-32")
MODES = (
    "native",
    "Real",
    "Real-formulas",
    "MaxProduct",
    "SignedMaxProduct",
    "Log",
    "Entropy",
    "Boolean",
    "Counting",
)
CASE_TITLES = {
    "bert": "BERT-base (random weights), sequence 128, batch 1",
    "gpt2": "GPT-2-small (random weights), sequence 128, batch 1",
    "mlp": "MLP 784-500-10, batch 32",
    "resnet18": "ResNet-18 shape (random weights), 224×224 image, batch 1",
    "vit": "ViT-B/16 shape (random weights), 224×224 image, batch 1",
    "tinyllama": "tiny Llama (dispatch_bound.py: hidden 64, 4 layers), sequence 16, batch 1",
    "llama7b": "Llama-2-7B shape (random weights, bfloat16), 4 of its 32 layers, "
    "sequence 512, batch 1",
    "llama7b-32": "Llama-2-7B shape (random weights, bfloat16), all 32 layers, "
    "sequence 512, batch 1",
}

#: the encoder sizes of BERT-base and ViT-B/16
ENCODER_BASE = dict(
    hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
)


@dataclass
class Workload:
    """A model, the leaf to differentiate w.r.t., and the scalar to seed."""

    model: torch.nn.Module
    leaf: torch.Tensor
    forward: Callable[[], torch.Tensor]


def build(case: str, device: str) -> Workload:
    """The model and inputs of ``case``, deterministic (seed 0), in float32 eval mode."""
    torch.manual_seed(0)
    if case == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(784, 500), torch.nn.Tanh(), torch.nn.Linear(500, 10)
        )
        leaf = torch.randn(32, 784, device=device)
        model = model.to(device).eval()
        leaf.requires_grad_(True)
        return Workload(model, leaf, lambda: model(leaf)[:, 3].sum())
    import model_zoo
    import transformers

    if case in ("resnet18", "vit"):
        if case == "resnet18":
            config = model_zoo.resnet_config(
                embedding_size=64,
                layer_type="basic",
                depths=[2, 2, 2, 2],
                hidden_sizes=[64, 128, 256, 512],
            )
            model = transformers.ResNetForImageClassification(config)
        else:
            config = model_zoo.vit_config(
                image_size=224, patch_size=16, **ENCODER_BASE, attn_implementation="sdpa"
            )
            model = transformers.ViTForImageClassification(config)
        model = model.to(device).eval()
        leaf = torch.randn(1, 3, 224, 224, device=device, requires_grad=True)
        return Workload(model, leaf, lambda: model(pixel_values=leaf).logits[0, 1])
    if case in ("llama7b", "llama7b-32"):
        return _llama7b(transformers, model_zoo, device, 32 if case == "llama7b-32" else 4)
    if case == "tinyllama":
        config = model_zoo.llama_config(
            vocab_size=1000, hidden_size=64, num_hidden_layers=4, intermediate_size=172
        )
        model = transformers.LlamaForCausalLM(config)
        return _text_workload(model.to(device).eval(), config.vocab_size, 16, device)
    if case == "bert":
        config = model_zoo.bert_config(vocab_size=30522, **ENCODER_BASE, attn_implementation="sdpa")
        model = transformers.BertForSequenceClassification(config)
    elif case == "gpt2":
        config = model_zoo.gpt2_config(
            vocab_size=50257, n_embd=768, n_layer=12, n_head=12, attn_implementation="sdpa"
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        raise ValueError(f"unknown case {case!r}; choose from {CASES}")
    return _text_workload(model.to(device).eval(), config.vocab_size, 128, device)


def _text_workload(model, vocab_size: int, length: int, device: str) -> Workload:
    """Random token ids' embeddings as the leaf; the output read is the last position's
    logit of the last token (a classifier: class 1)."""
    ids = torch.randint(0, vocab_size, (1, length), device=device)
    with torch.no_grad():
        leaf = model.get_input_embeddings()(ids)
    leaf.requires_grad_(True)
    if not hasattr(model, "lm_head"):
        return Workload(model, leaf, lambda: model(inputs_embeds=leaf).logits[0, 1])
    target = int(ids[0, -1])
    return Workload(model, leaf, lambda: model(inputs_embeds=leaf).logits[0, -1, target])


def _llama7b(transformers, model_zoo, device: str, layers: int) -> Workload:
    """Llama-2-7B's dimensions (hidden 4096, 32 heads, intermediate 11008, vocabulary
    32000), bfloat16, ``layers`` of its 32 layers; sequence 512."""
    config = model_zoo.llama_config(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_attention_heads=32,
        num_key_value_heads=32,
        num_hidden_layers=layers,
        attn_implementation="sdpa",
    )
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return _text_workload(model, config.vocab_size, 512, device)


#: sa.grad(..., compile=True) for the semiring modes (set by --compile)
COMPILE = False


def semiring_of(mode: str):
    import semiring_autograd as sa

    # Real-formulas: the generated Real Functions instead of torch's own graph
    return sa.Real(formulas=True) if mode == "Real-formulas" else getattr(sa, mode)()


def step(work: Workload, mode: str) -> torch.Tensor:
    """One forward + backward of ``mode``; returns the result at the leaf."""
    if mode == "native":
        return torch.autograd.grad(work.forward(), work.leaf)[0]
    import semiring_autograd as sa

    with sa.patch(work.model, semiring_of(mode)):
        out = work.forward()
    return sa.grad(out, work.leaf, compile=COMPILE)


def backward_alone(work: Workload, mode: str, device: str) -> float:
    """Seconds of the backward alone (``torch.autograd.grad`` or ``sa.grad``) after an
    untimed forward."""
    import semiring_autograd as sa

    if mode == "native":
        out = work.forward()
    else:
        with sa.patch(work.model, semiring_of(mode)):
            out = work.forward()
    _sync(device)
    start = time.perf_counter()
    if mode == "native":
        torch.autograd.grad(out, work.leaf)
    else:
        sa.grad(out, work.leaf, compile=COMPILE)
    _sync(device)
    return time.perf_counter() - start


#: the GEMM operators (BLAS on the CPU, cuBLAS on CUDA) a backward's matmuls run as
GEMMS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::mv")


def kernel_share(work: Workload, mode: str, device: str) -> tuple[float, float]:
    """The share of one semiring backward (sa.grad alone) spent inside operators, and the
    seconds of it spent in GEMM operators."""
    import semiring_autograd as sa
    from torch.profiler import ProfilerActivity, profile

    with sa.patch(work.model, semiring_of(mode)):
        out = work.forward()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        sa.grad(out, work.leaf, compile=COMPILE)
        _sync(device)
        wall = time.perf_counter() - start
    inside = gemm = 0.0
    for event in prof.key_averages():
        if not event.key.startswith(("aten::", "semiring_autograd::")):
            continue
        spent = event.self_device_time_total if device == "cuda" else event.self_cpu_time_total
        inside += spent
        if event.key in GEMMS:
            gemm += spent
    return inside / 1e6 / wall, gemm / 1e6


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _release_freed_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _timed(work: Workload, mode: str, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    step(work, mode)
    _sync(device)
    return time.perf_counter() - start


def worker_time(case: str, mode: str, device: str, reps: int, budget_s: float) -> dict:
    return time_on(build(case, device), mode, device, reps, budget_s)


def time_on(work: Workload, mode: str, device: str, reps: int, budget_s: float) -> dict:
    """First call, then the median of timed calls after a warm-up; for a semiring also the
    median of native calls alternating with them (the pair's ratio cancels drift)."""
    first = _timed(work, mode, device)
    paired = ["native"] if mode != "native" else []
    for m in (mode, *paired):
        step(work, m)  # warm-up
    times: dict[str, list[float]] = {m: [] for m in (mode, *paired)}
    spent = 0.0
    while len(times[mode]) < reps or (spent < budget_s and len(times[mode]) < 5 * reps):
        for m in times:
            times[m].append(_timed(work, m, device))
            spent += times[m][-1]
        if spent > budget_s and len(times[mode]) >= 3:
            break
    result = {"first_s": first, "median_s": statistics.median(times[mode])}
    if paired:
        result["native_median_s"] = statistics.median(times["native"])
        result["kernel_share"], gemm_s = kernel_share(work, mode, device)
        alone: dict[str, list[float]] = {m: [] for m in (mode, "native")}
        for _ in range(len(times[mode])):
            for m in alone:
                alone[m].append(backward_alone(work, m, device))
        native_alone = statistics.median(alone["native"])
        result["backward_ratio"] = statistics.median(alone[mode]) / native_alone
        result["gemm_ratio"] = gemm_s / native_alone
    return {**result, "reps": len(times[mode])}


def worker_memory(case: str, mode: str, device: str) -> dict:
    return memory_on(build(case, device), mode, device)


def memory_on(work: Workload, mode: str, device: str) -> dict:
    """Peak memory of one call above what is held before it, after an unmeasured call."""
    step(work, mode)  # compile and allocate caches outside the measured call
    if device == "cuda":
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(work, mode)
        torch.cuda.synchronize()
        return {"peak_bytes": torch.cuda.max_memory_allocated() - base}
    _release_freed_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set (VmHWM) to the current one
    base = _rss_bytes("VmRSS")
    step(work, mode)
    return {"peak_bytes": _rss_bytes("VmHWM") - base}


def measure_in_process(
    case: str, device: str, modes: list[str], reps: int, budget_s: float, jsonl: str | None
) -> dict:
    """Every mode of ``case`` on one model in this process; each (case, mode) row is
    appended to ``jsonl`` (one JSON object a line) as soon as it is measured. A mode that
    raises gives a row with its ``error`` and the next mode runs."""
    work = build(case, device)
    results: dict = {}
    for mode in ["native", *modes]:
        try:
            row = {**time_on(work, mode, device, reps, budget_s), **memory_on(work, mode, device)}
        except Exception as error:  # noqa: BLE001 -- recorded in the row, the next mode runs
            row = {"error": f"{type(error).__name__}: {str(error)[:2000]}"}
        results[mode] = row
        if jsonl:
            with open(jsonl, "a") as f:
                f.write(json.dumps({"case": case, "mode": mode, "device": device, **row}) + "\n")
        _progress(case, mode, row)
    return results


def _progress(case: str, mode: str, row: dict) -> None:
    if "error" in row:
        print(f"{case:>5} {mode:<17} FAILED {row['error'][:300]}", file=sys.stderr, flush=True)
        return
    native_s = row.get("native_median_s", row["median_s"])
    print(
        f"{case:>5} {mode:<17} median {row['median_s'] * 1e3:9.1f} ms  "
        f"paired native {native_s * 1e3:7.1f} ms  "
        f"first {row['first_s'] * 1e3:7.0f} ms  "
        f"peak {row['peak_bytes'] / 2**20:8.1f} MiB",
        file=sys.stderr,
        flush=True,
    )


def run_worker(args: list[str], env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", *args],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()})"
    )


def table(results: dict, device: str, cases: list[str], modes: list[str]) -> str:
    backward = "sa.grad(..., compile=True), warm" if COMPILE else "sa.grad (eager)"
    lines = [f"Machine: {machine(device)}, device {device}; semiring backward: {backward}.", ""]
    for case in cases:
        native = results[case]["native"]
        lines += [
            f"**{CASE_TITLES[case]}** — native forward + backward "
            f"{native['median_s'] * 1e3:.1f} ms, peak memory "
            f"{native['peak_bytes'] / 2**20:.1f} MiB",
            "",
            "| semiring | median ms | paired native ms | time ratio | backward alone ratio "
            "| its GEMMs alone | first call ms | peak MiB | memory ratio | in kernels |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for mode in modes:
            r = results[case][mode]
            paired = r.get("native_median_s", native["median_s"])
            lines.append(
                f"| {mode} | {r['median_s'] * 1e3:.1f} | {paired * 1e3:.1f} | "
                f"{r['median_s'] / paired:.2f}× | "
                + (f"{r['backward_ratio']:.2f}× | " if "backward_ratio" in r else "– | ")
                + (f"{r['gemm_ratio']:.2f}× | " if "gemm_ratio" in r else "– | ")
                + f"{r['first_s'] * 1e3:.0f} | "
                f"{r['peak_bytes'] / 2**20:.1f} | "
                f"{r['peak_bytes'] / max(native['peak_bytes'], 1):.2f}× | "
                + (f"{r['kernel_share']:.0%} |" if "kernel_share" in r else "– |")
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--semirings", nargs="+", default=list(MODES[1:]), choices=MODES[1:])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--reps", type=int, default=5, help="at least this many timed calls")
    parser.add_argument("--budget", type=float, default=10.0, help="seconds of timed calls")
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--compile", action="store_true", help="sa.grad(..., compile=True), warm")
    parser.add_argument(
        "--in-process", action="store_true", help="each case's modes in one process"
    )
    parser.add_argument("--jsonl", help="with --in-process: append each row to this file")
    args = parser.parse_args(argv)
    global COMPILE
    COMPILE = args.compile
    if args.in_process:
        results = {
            case: measure_in_process(
                case, args.device, args.semirings, args.reps, args.budget, args.jsonl
            )
            for case in args.cases
        }
        failed = [f"{c}/{m}" for c in results for m in results[c] if "error" in results[c][m]]
        if not failed:
            print(table(results, args.device, args.cases, ["native", *args.semirings]))
        sys.exit(f"failed: {', '.join(failed)}" if failed else 0)
    if args.worker:
        kind, case, mode = args.worker
        if kind == "time":
            result = worker_time(case, mode, args.device, args.reps, args.budget)
        else:
            result = worker_memory(case, mode, args.device)
        print(json.dumps(result))
        return
    modes = ["native", *args.semirings]
    results: dict = {}
    with tempfile.TemporaryDirectory() as cache:
        for case in args.cases:
            results[case] = {}
            for mode in modes:
                # a fresh compile cache per case and mode: "first call" includes compilation
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, case, mode))
                common = ["--device", args.device, "--reps", str(args.reps)]
                common += ["--budget", str(args.budget)] + (["--compile"] if COMPILE else [])
                timing = run_worker(["time", case, mode, *common], env)
                memory = run_worker(["memory", case, mode, *common], env)
                results[case][mode] = {**timing, **memory}
                _progress(case, mode, results[case][mode])
    text = table(results, args.device, args.cases, modes)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
