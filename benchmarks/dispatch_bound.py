"""The dispatch-bound case: a tiny Llama whose ops are small, so Python per op decides the time.

``LlamaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
num_key_value_heads=2, intermediate_size=172)``, random weights (seed 0), sequence 16,
batch 1, float32, one thread. Per semiring, in one process:

- time: patched forward + ``sa.grad`` of one logit w.r.t. ``inputs_embeds``, against native
  forward + ``torch.autograd.grad``, alternating, 15 pairs after 3 warm-up pairs; the ratio
  of the two medians;
- Python calls: the Python function calls (``sys.setprofile`` "call" events) of one
  ``sa.grad`` (the semiring backward alone), divided by the number of backward nodes the
  patch recorded.

Usage: ``python benchmarks/dispatch_bound.py [--repeats 15] [--semirings Log,MaxProduct]``.
Prints one markdown row per semiring.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import transformers

import semiring_autograd as sa
from semiring_autograd.semirings.registry import SEMIRINGS as REGISTRY

#: every built-in semiring (the registry's order), Real also with its formulas
SEMIRINGS = tuple(
    name
    for spec in REGISTRY
    for name in ((spec.cls.__name__, "Real-formulas") if spec.torch_graph else (spec.cls.__name__,))
)


def build():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=172,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 16))
    with torch.no_grad():
        emb = model.get_input_embeddings()(ids)
    return model, emb.requires_grad_(True), int(ids[0, -1])


def semiring_of(name: str) -> sa.Semiring:
    return sa.Real(formulas=True) if name == "Real-formulas" else getattr(sa, name)()


def native_step(model, emb, target):
    out = model(inputs_embeds=emb).logits[0, -1, target]
    return torch.autograd.grad(out, emb)[0]


def patched_forward(model, emb, target, semiring):
    with sa.patch(model, semiring):
        return model(inputs_embeds=emb).logits[0, -1, target]


def semiring_step(model, emb, target, semiring):
    return sa.grad(patched_forward(model, emb, target, semiring), emb)


def recorded_nodes(output) -> int:
    seen, stack, count = set(), [output.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += sa.node_info(node) is not None
        stack.extend(n for n, _ in node.next_functions)
    return count


def python_calls(fn) -> int:
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def measure(name: str, repeats: int) -> tuple[float, float]:
    model, emb, target = build()
    semiring = semiring_of(name)
    native, patched = [], []
    for i in range(3 + repeats):
        for kind, times in (("native", native), ("semiring", patched)):
            start = time.perf_counter()
            if kind == "native":
                native_step(model, emb, target)
            else:
                semiring_step(model, emb, target, semiring)
            if i >= 3:
                times.append(time.perf_counter() - start)
    out = patched_forward(model, emb, target, semiring)
    nodes = recorded_nodes(out)
    calls = python_calls(lambda: sa.grad(out, emb))
    return statistics.median(patched) / statistics.median(native), calls / nodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--semirings", default=",".join(SEMIRINGS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| semiring | time ratio to native | Python calls per node in sa.grad |")
    print("|---|---|---|")
    for name in args.semirings.split(","):
        ratio, per_node = measure(name, args.repeats)
        print(f"| {name} | {ratio:.2f}× | {per_node:.1f} |", flush=True)


if __name__ == "__main__":
    main()
