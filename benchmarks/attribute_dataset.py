"""Dataset-scale attribution on the embedded SmolLM2-135M: batched vs one at a time, two
ranks vs one, and memory over a long run.

64 texts of 5 to 40 tokens, target " the", MaxProduct scores (no top paths), one thread:

* ``loop``: ``sa.attribute`` one text at a time (``batch_size=1``);
* ``batched``: ``sa.attribute(..., batch_size=B)`` (one forward and one backward per batch);
* ``compiled``: the same with ``compile=True``: a first pass captures one program per
  (batch, length) shape, a second checks each program's first replay against eager, later
  passes replay (each pass is printed);
* ``native``: torch.autograd's own forward and backward to the embeddings over the same
  batches (padded, ``logits_to_keep``, the gradient of the target logits' sum), one text at a
  time and ``--batch-size`` at a time: the throughput that no semiring can exceed on the same
  GEMMs;
* ``ranks``: ``attribute_dataset`` under ``torchrun --nproc_per_node 1`` and ``2``, one
  thread per rank, records/s of the whole run (model load excluded);
* ``memory``: the resident set of one rank sampled during ``attribute_dataset`` over
  ``--memory-records`` records, per part written.

    python benchmarks/attribute_dataset.py [--batch-size 8] [--skip ranks memory]
        [--device cuda] [--model DIR]

``--device`` runs the single-process rows there; ``--model DIR`` takes a model of the
config in DIR with random weights and DIR's tokenizer (where the embedded SmolLM2 is not
installed: throughput does not depend on the weights' values).

Ratios are of records/s measured in the same process (ranks: the same invocation).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

WORDS = (
    "the river runs past an old mill where children play in summer and farmers bring grain "
    "to town while the bells ring over quiet streets full of shops bakers sell bread early"
).split()
TARGET = " the"


def texts(tokenizer, count: int = 64, low: int = 5, high: int = 40, seed: int = 0) -> list[str]:
    """``count`` texts of ``low`` to ``high`` tokens (each length drawn uniformly)."""
    rng = random.Random(seed)
    found = []
    while len(found) < count:
        want = rng.randint(low, high)
        words = [rng.choice(WORDS) for _ in range(want)]
        while len(tokenizer(" ".join(words))["input_ids"]) > want:
            words.pop()
        if len(tokenizer(" ".join(words))["input_ids"]) >= low:
            found.append(" ".join(words))
    return found


def rate(run, count: int) -> tuple[float, float]:
    """(records/s, seconds) of ``run()`` over ``count`` records."""
    start = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return count / seconds, seconds


def rss_mib() -> float:
    """This process's resident set, MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def native_rate(model, tokenizer, batch: list[str], batch_size: int) -> float:
    """Records/s of torch.autograd's forward and backward to the embeddings over the batches
    ``sa.attribute`` forms (the same padding, read positions and projected positions)."""
    from semiring_autograd.explain import batched as B
    from semiring_autograd.explain.token_scores import input_leaf

    prepared = [B.prepare(i, B.Record(t), tokenizer, TARGET, -1) for i, t in enumerate(batch)]
    device = next(model.parameters()).device
    start = time.perf_counter()
    for chunk in B.buckets(prepared, batch_size, len(prepared)):
        padded = B.pad(chunk, tokenizer, B.takes_position_ids(model)).to(device)
        x = input_leaf(model, padded.ids)
        y, _ = B.read_batch(
            model,
            x,
            padded.mask,
            padded.position_ids,
            targets=padded.targets,
            **B.kept_positions(padded, model, every=False),
        )
        torch.autograd.grad(y.sum(), x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return len(prepared) / (time.perf_counter() - start)


def load(args: argparse.Namespace):
    """(model, tokenizer, name): the embedded SmolLM2-135M, or with ``--model DIR`` a model
    of DIR's config with random weights and DIR's tokenizer; on ``--device``."""
    if args.model:
        import transformers

        config = transformers.AutoConfig.from_pretrained(args.model)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        name = f"{config.model_type} of {args.model} (random weights)"
    else:
        from semiring_autograd.integrations.huggingface import load_causal_lm

        model, tokenizer = load_causal_lm()
        name = "SmolLM2-135M"
    return model.to(args.device), tokenizer, name


def single_process(args: argparse.Namespace) -> None:
    import semiring_autograd as sa

    model, tokenizer, name = load(args)
    batch = texts(tokenizer)
    lengths = [len(tokenizer(t)["input_ids"]) for t in batch]
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"{name}, {len(batch)} texts of {min(lengths)}-{max(lengths)} tokens, target "
        f"{TARGET!r}, MaxProduct scores, {torch.get_num_threads()} thread(s), {where}"
    )

    def run(**options):
        return lambda: sa.attribute(
            model,
            batch,
            TARGET,
            "max-product",
            tokenizer=tokenizer,
            paths=False,
            progress=False,
            **options,
        )

    loop, s_loop = rate(run(batch_size=1), len(batch))
    print(f"loop (one at a time):      {loop:7.2f} records/s ({s_loop:.1f} s)")
    batched, s_b = rate(run(batch_size=args.batch_size), len(batch))
    print(
        f"batched (batch {args.batch_size}):        {batched:7.2f} records/s ({s_b:.1f} s)  "
        f"{batched / loop:.2f}x the loop"
    )
    for size in (1, args.batch_size):
        native = native_rate(model, tokenizer, batch, size)
        print(
            f"native torch.autograd, batch {size}: {native:7.2f} records/s  "
            f"{native / loop:.2f}x the loop; MaxProduct batched {batched / native:.2f}x it"
        )
    # pass 1 captures a program per (batch, length) shape, pass 2 checks a shape's first
    # replay against eager (both run), later passes replay
    if "compiled" in args.skip:
        return
    for label in ("capture", "check", "replay", "replay"):
        found, seconds = rate(run(batch_size=args.batch_size, compile=True), len(batch))
        print(
            f"compiled batched, {label + ':':8} {found:7.2f} records/s ({seconds:.1f} s)  "
            f"{found / loop:.2f}x the loop"
        )


def rank_worker(args: argparse.Namespace) -> None:
    """One rank of ``attribute_dataset`` (under torchrun): rank 0 prints records/s."""
    import torch.distributed as dist

    from semiring_autograd.explain.dataset import attribute_dataset
    from semiring_autograd.integrations.huggingface import load_causal_lm

    torch.set_num_threads(1)
    model, tokenizer = load_causal_lm()
    records = texts(tokenizer)
    dist.init_process_group("gloo")
    dist.barrier()
    start = time.perf_counter()
    attribute_dataset(
        model,
        records,
        args.out,
        tokenizer=tokenizer,
        target=TARGET,
        batch_size=args.batch_size,
        progress=False,
    )
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        print(f"RESULT {len(records) / seconds:.3f} {seconds:.2f}")
    dist.destroy_process_group()


def ranks(args: argparse.Namespace) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    found = {}
    for n in (1, 2):
        with tempfile.TemporaryDirectory() as folder:
            command = [
                str(torchrun),
                "--standalone",
                "--nproc_per_node",
                str(n),
                __file__,
                "--rank-worker",
                "--out",
                str(Path(folder) / "run"),
                "--batch-size",
                str(args.batch_size),
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
            found[n] = float(line.split()[1])
            print(f"{n} rank(s) x 1 thread:      {found[n]:7.2f} records/s ({line.split()[2]} s)")
    print(f"2 ranks vs 1: {found[2] / found[1]:.2f}x")


def memory(args: argparse.Namespace) -> None:
    from semiring_autograd.explain.dataset import attribute_dataset
    from semiring_autograd.integrations.huggingface import load_causal_lm

    torch.set_num_threads(1)
    model, tokenizer = load_causal_lm()
    pool = texts(tokenizer, count=64)
    records = [pool[i % len(pool)] for i in range(args.memory_records)]
    samples: list[tuple[int, float]] = []
    stop = threading.Event()

    def sample(parts: Path) -> None:
        while not stop.is_set():
            written = len(list(parts.glob("part-*"))) if parts.is_dir() else 0
            samples.append((written, rss_mib()))
            time.sleep(0.5)

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run"
        watcher = threading.Thread(target=sample, args=(out / "parts",), daemon=True)
        watcher.start()
        start = time.perf_counter()
        attribute_dataset(
            model,
            records,
            out,
            tokenizer=tokenizer,
            target=TARGET,
            batch_size=args.batch_size,
            part_size=100,
            progress=False,
        )
        seconds = time.perf_counter() - start
        stop.set()
        watcher.join()
    print(f"memory: {len(records)} records in {seconds:.0f} s, resident set by parts written:")
    for part in range(0, len(records) // 100 + 1, 2):
        seen = [m for p, m in samples if p == part]
        if seen:
            print(f"  after {part * 100:5d} records: peak {max(seen):7.0f} MiB")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["single", "compiled", "ranks", "memory"]
    )
    parser.add_argument("--memory-records", type=int, default=1000)
    parser.add_argument("--device", default="cpu", help="where the single-process rows run")
    parser.add_argument("--model", help="a folder with a config and a tokenizer")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        rank_worker(args)
        return
    torch.set_num_threads(1)
    if "single" not in args.skip:
        single_process(args)
    if "ranks" not in args.skip:
        ranks(args)
    if "memory" not in args.skip:
        memory(args)


if __name__ == "__main__":
    main()
