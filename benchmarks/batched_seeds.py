"""Batched seeds against the loop: N readouts of one recorded graph.

The tiny Llama of ``benchmarks/dispatch_bound.py`` (``llama_config(vocab_size=1000,
hidden_size=64, num_hidden_layers=4, intermediate_size=172)``, random weights, seed 0),
float32, batch 1, sequence N, one thread. The readouts: every position's logit of its next
token (N one-hot seeds over the logits), with respect to ``inputs_embeds``. Per semiring
and N, on one patched forward kept with ``retain_graph=True``:

- loop: N calls ``sa.grad(logits, emb, seed_row)``;
- batched: one ``sa.grad(logits, emb, seeds, is_grads_batched=True)`` (under the built-in
  semirings but Real, one backward under ``torch.vmap``);
- batched compiled: the same with ``compile=True`` (warm: its program captured beforehand;
  one replay per row).

Medians over ``--repeats`` rounds (alternating, after one warm-up round); ratios are loop
time over batched time (above 1: batched is faster). The results of every batched form are
checked against the loop before timing.

Usage: ``python benchmarks/batched_seeds.py [--sizes 8,16,32,64] [--repeats 5]
[--semirings Real,MaxProduct,Log] [--no-compiled]``. Prints one markdown row per semiring
and N (KBest: k = 3).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import semiring_autograd as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the model zoo
from model_zoo import llama_config  # noqa: E402


def build(n: int):
    torch.manual_seed(0)
    config = llama_config(
        vocab_size=1000, hidden_size=64, num_hidden_layers=4, intermediate_size=172
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, n + 1))
    with torch.no_grad():
        emb = model.get_input_embeddings()(ids[:, :n])
    return model, emb.requires_grad_(True), ids[0, 1:]


def seeds_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Row t: one at (0, t, targets[t]), zero elsewhere."""
    n = targets.numel()
    seeds = torch.zeros(n, *logits.shape, dtype=logits.dtype)
    seeds[torch.arange(n), 0, torch.arange(n), targets] = 1
    return seeds


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def measure(name: str, n: int, repeats: int, compiled: bool) -> dict[str, float]:
    model, emb, targets = build(n)
    semiring = getattr(sa, name)()
    with sa.patch(model, semiring):
        logits = model(inputs_embeds=emb).logits
    seeds = seeds_of(logits, targets)

    def loop():
        return torch.stack([sa.grad(logits, emb, s, retain_graph=True) for s in seeds])

    def batched():
        return sa.grad(logits, emb, seeds, is_grads_batched=True, retain_graph=True)

    def batched_compiled():
        return sa.grad(logits, emb, seeds, is_grads_batched=True, retain_graph=True, compile=True)

    forms = {"loop": loop, "batched": batched}
    if compiled:
        forms["compiled"] = batched_compiled
    want = loop()
    for form in list(forms)[1:]:  # checked (and the program captured) first
        torch.testing.assert_close(forms[form](), want, rtol=1e-5, atol=1e-5)
    times: dict[str, list[float]] = {k: [] for k in forms}
    for i in range(1 + repeats):
        for form, fn in forms.items():
            start = time.perf_counter()
            fn()
            if i:
                times[form].append(time.perf_counter() - start)
    return {k: median_ms(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,16,32,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--semirings", default="Real,MaxProduct,Log")
    parser.add_argument("--no-compiled", action="store_true", help="time no compiled form")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| semiring | N | loop ms | batched ms | loop / batched | batched compiled ms "
        "| loop / batched compiled |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.semirings.split(","):
        for n in map(int, args.sizes.split(",")):
            t = measure(name, n, args.repeats, not args.no_compiled)
            compiled = (
                f"{t['compiled']:.1f} | {t['loop'] / t['compiled']:.2f}x"
                if "compiled" in t
                else "- | -"
            )
            print(
                f"| {name} | {n} | {t['loop']:.1f} | {t['batched']:.1f} | "
                f"{t['loop'] / t['batched']:.2f}x | {compiled} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
