"""``sa.attribute`` over many texts of one length on the embedded SmolLM2-135M.

The interpretability workload: one model, one target, many prompts. Per semiring, per text:
native forward + ``torch.autograd.grad`` of the target logit w.r.t. the input embeddings,
``sa.attribute(..., paths=False)`` eager, and ``sa.attribute(..., paths=False,
compile=True)`` (forward and backward replayed as one ``sa.compiled_step``), in alternating
rounds after warm-up; ratios of medians to native in the same process. "first call" is
the compile=True call that captures the program; "second call" the next one, which builds
the program from the capture and replays it.

    python benchmarks/attribute_texts.py [--semirings MaxProduct Entropy] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import semiring_autograd as sa
from semiring_autograd.engine.compiled import backward as compiled
from semiring_autograd.integrations.huggingface import load_causal_lm

TEXTS = [f"The capital of {country} is" for country in ("France", "Spain", "Italy", "Japan")]
TARGET = " Paris"


def per_text(run, texts: list[str]) -> float:
    """Seconds per text of ``run(text)`` over ``texts``."""
    start = time.perf_counter()
    for text in texts:
        run(text)
    return (time.perf_counter() - start) / len(texts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--semirings", nargs="+", default=["MaxProduct", "Log", "Entropy"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_causal_lm()
    model.eval()
    lengths = {len(tokenizer(t)["input_ids"]) for t in TEXTS}
    assert len(lengths) == 1, f"the texts should have one token length, got {lengths}"
    (target,) = tokenizer(TARGET, add_special_tokens=False)["input_ids"]

    def native(text: str) -> None:
        encoding = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            emb = model.get_input_embeddings()(encoding["input_ids"])
        x = emb.requires_grad_()
        out = model(inputs_embeds=x, attention_mask=encoding["attention_mask"])
        torch.autograd.grad(out.logits[0, -1, target], x)

    print(
        f"SmolLM2-135M, {len(TEXTS)} texts of {lengths.pop()} tokens, target {TARGET!r}, "
        f"{args.threads} threads, torch {torch.__version__}\n"
    )
    print("| semiring | native ms/text | eager | compile=True | first call ms | second call ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.semirings:
        semiring = getattr(sa, name)()

        def attribute(text: str, compile: bool) -> None:
            sa.attribute(
                model, text, TARGET, semiring, tokenizer=tokenizer, paths=False, compile=compile
            )

        compiled.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an eager fallback would not measure compile
            start = time.perf_counter()
            attribute(TEXTS[0], True)
            first = time.perf_counter() - start
            start = time.perf_counter()
            attribute(TEXTS[1], True)
            second = time.perf_counter() - start
            runs = {
                "native": native,
                "eager": lambda text: attribute(text, False),
                "compile": lambda text: attribute(text, True),
            }
            for run in runs.values():
                per_text(run, TEXTS)  # warm-up
            times: dict[str, list[float]] = {key: [] for key in runs}
            for _ in range(args.rounds):
                for key, run in runs.items():
                    times[key].append(per_text(run, TEXTS))
        base = statistics.median(times["native"])
        ratio = {key: statistics.median(v) / base for key, v in times.items()}
        print(
            f"| {name} | {base * 1e3:.1f} | {ratio['eager']:.2f}× | {ratio['compile']:.2f}× "
            f"| {first * 1e3:.0f} | {second * 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
