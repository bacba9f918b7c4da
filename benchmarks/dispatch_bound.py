"""The dispatch-bound case: a tiny Llama whose ops are small, so Python per op decides the time.

``llama_config(vocab_size=1000, hidden_size=64, num_hidden_layers=4, intermediate_size=172)``
of ``tests/model_zoo.py`` (4 attention heads sharing 2 key/value heads), random weights
(seed 0), sequence 16, batch 1, float32, one thread. Per semiring, in one process:

- eager: patched forward + ``sa.grad`` of one logit w.r.t. ``inputs_embeds``; compiled: the
  same with ``sa.grad(..., compile=True)``, warm (its program captured beforehand); native:
  forward + ``torch.autograd.grad``. Alternating, 15 rounds after 3 warm-up rounds; ratios
  of medians to native. "forward" is the patched forward alone, "compiled backward" the
  compiled ``sa.grad`` alone, each over native forward + backward; step:
  ``sa.compiled_step`` (patched forward and backward replayed as one program), warm;
- capture: the first ``compile=True`` call (eager backward under the recorder; the program
  is generated on the next call), and the operators in the captured backward program and
  in the compiled step's program;
- Python calls: the Python function calls (``sys.setprofile`` "call" events) of one patched
  forward (``sa.patch``'s entry and exit and the model's own Python included) and of one
  eager ``sa.grad``, each divided by the number of backward nodes the patch recorded.

Usage: ``python benchmarks/dispatch_bound.py [--repeats 15] [--semirings Log,MaxProduct]``.
Prints one markdown row per semiring. ``--operators N`` prints instead, per semiring, the N
operators a warm compiled step spends most time in (``torch.profiler`` self time).
``--floor`` prints instead the cost of one op and one backward node apart from any model:
a module applying one op 100 times to a (16, 64) tensor (``transpose``, ``x * 1.5``,
``x[:, :64]``), per op: the forward unpatched, through a bare custom
``torch.autograd.Function`` (its ``forward`` running the op and saving the input, its
``backward`` one op: the least a recorded op costs), and patched (per semiring); per node:
torch's backward, the bare Function's and the semiring backward (``sa.grad``), medians of
thread CPU time.
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
from semiring_autograd.engine.compiled import backward as compiled
from semiring_autograd.semirings.registry import SEMIRINGS as REGISTRY

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the model zoo
from model_zoo import llama_config  # noqa: E402

#: every built-in semiring (the registry's order), Real also with its formulas
SEMIRINGS = tuple(
    name
    for spec in REGISTRY
    for name in ((spec.cls.__name__, "Real-formulas") if spec.torch_graph else (spec.cls.__name__,))
)


def build():
    torch.manual_seed(0)
    config = llama_config(
        vocab_size=1000, hidden_size=64, num_hidden_layers=4, intermediate_size=172
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


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def measure(name: str, repeats: int) -> dict[str, float]:
    model, emb, target = build()
    semiring = semiring_of(name)
    compiled.clear()
    start = time.perf_counter()
    sa.grad(patched_forward(model, emb, target, semiring), emb, compile=True)
    capture_ms = (time.perf_counter() - start) * 1e3
    sa.grad(patched_forward(model, emb, target, semiring), emb, compile=True)  # verified
    steps = compiled.stats()["steps"]
    step = sa.compiled_step(model, semiring, lambda m, x: m(inputs_embeds=x).logits[0, -1, target])
    step(emb)
    step(emb)  # captured, then verified (its program built)
    step_steps = compiled.stats()["steps"] - steps
    kinds = ("native", "eager", "compiled", "fwd", "step")
    times: dict[str, list[float]] = {k: [] for k in (*kinds, "bwd")}
    for i in range(3 + repeats):
        for kind in kinds:
            start = time.perf_counter()
            if kind == "native":
                native_step(model, emb, target)
            elif kind == "eager":
                semiring_step(model, emb, target, semiring)
            elif kind == "compiled":
                out = patched_forward(model, emb, target, semiring)
                middle = time.perf_counter()
                sa.grad(out, emb, compile=True)
                if i >= 3:
                    times["bwd"].append(time.perf_counter() - middle)
            elif kind == "fwd":
                patched_forward(model, emb, target, semiring)
            else:
                step(emb)
            if i >= 3:
                times[kind].append(time.perf_counter() - start)
    if compiled.stats()["eager"]:
        raise RuntimeError(f"{name}: a compile=True call ran eagerly")
    out = patched_forward(model, emb, target, semiring)
    nodes = recorded_nodes(out)
    forward_calls = python_calls(lambda: patched_forward(model, emb, target, semiring))
    calls = python_calls(lambda: sa.grad(out, emb))
    native = median_ms(times["native"])
    return {
        "native_ms": native,
        "eager": median_ms(times["eager"]) / native,
        "compiled": median_ms(times["compiled"]) / native,
        "forward": median_ms(times["fwd"]) / native,
        "backward": median_ms(times["bwd"]) / native,
        "step": median_ms(times["step"]) / native,
        "capture_ms": capture_ms,
        "steps": steps,
        "step_steps": step_steps,
        "forward_calls": forward_calls / nodes,
        "calls": calls / nodes,
    }


def operator_table(name: str, top: int, steps: int = 20) -> list[str]:
    """Markdown rows: the ``top`` operators of a warm compiled step by self time under
    ``torch.profiler`` (which adds about a microsecond to every call), with calls per step
    and microseconds per call, and the share of the step's operator time they take."""
    from torch.profiler import ProfilerActivity, profile

    model, emb, target = build()
    compiled.clear()
    semiring = semiring_of(name)
    step = sa.compiled_step(model, semiring, lambda m, x: m(inputs_embeds=x).logits[0, -1, target])
    for _ in range(3):
        step(emb)  # captured, verified, warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(emb)
    events = [e for e in prof.key_averages() if e.key.startswith(("aten::", "semiring_autograd::"))]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    rows = []
    for e in events[:top]:
        rows.append(
            f"| {name} | `{e.key}` | {e.count / steps:.0f} | "
            f"{e.self_cpu_time_total / e.count:.1f} µs | {e.self_cpu_time_total / total:.0%} |"
        )
    return rows


#: the ops of ``--floor``: (name, the op, its backward on a gradient)
FLOOR_OPS = (
    ("transpose", lambda x: x.transpose(0, 1), lambda g: g.transpose(0, 1)),
    ("x * 1.5", lambda x: x * 1.5, lambda g: g * 1.5),
    ("x[:, :64]", lambda x: x[:, :64], lambda g: g),
)


class _Chain(torch.nn.Module):
    """``op`` applied ``length`` times."""

    def __init__(self, op, length: int):
        super().__init__()
        self.op, self.length = op, length

    def forward(self, x):
        for _ in range(self.length):
            x = self.op(x)
        return x


def _bare_function(op, backward):
    """A bare custom Function running ``op``: the least one recorded op costs."""

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return op(x)

        @staticmethod
        def backward(ctx, g):
            return backward(g)

    return Bare.apply


def _per_call_us(fn, calls: int, repeats: int) -> float:
    times = []
    for _ in range(3 + repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times[3:]) / calls * 1e6


def floor_table(semirings: list[str], repeats: int, length: int = 100) -> list[str]:
    """The ``--floor`` table: µs per op (forward) and per node (backward)."""
    x = torch.randn(16, 64, requires_grad=True)
    rows = []
    for name, op, backward in FLOOR_OPS:
        chain = _Chain(op, length)
        bare = _Chain(_bare_function(op, backward), length)
        with torch.no_grad():
            plain = _per_call_us(lambda: chain(x), length, repeats)
        function = _per_call_us(lambda: bare(x), length, repeats)
        out = chain(x).sum()
        native = _per_call_us(
            lambda: torch.autograd.grad(out, x, retain_graph=True), length, repeats
        )
        through = bare(x).sum()
        bare_node = _per_call_us(
            lambda: torch.autograd.grad(through, x, retain_graph=True), length, repeats
        )
        cells = [f"{plain:.1f}", f"{function:.1f}"]
        nodes = [f"{native:.1f}", f"{bare_node:.1f}"]
        for semiring in map(semiring_of, semirings):

            def forward():
                with sa.patch(chain, semiring):
                    return chain(x)

            cells.append(f"{_per_call_us(forward, length, repeats):.1f}")
            recorded = forward().sum()
            nodes.append(
                f"{_per_call_us(lambda: sa.grad(recorded, x, retain_graph=True), length, repeats):.1f}"
            )
        rows.append(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(nodes) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--semirings", default=",".join(SEMIRINGS))
    parser.add_argument(
        "--operators",
        type=int,
        metavar="N",
        help="instead: the N operators a compiled step spends most in, per semiring",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="instead: µs per op and per backward node of one-op chains (see the docstring)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.floor:
        names = args.semirings.split(",")
        print(
            "| op | forward: no grad | bare Function | "
            + " | ".join(f"patched {n}" for n in names)
            + " | backward: torch | bare Function | "
            + " | ".join(f"{n} node" for n in names)
            + " |"
        )
        print("|---|" + "---:|" * (4 + 2 * len(names)))
        print("\n".join(floor_table(names, args.repeats)), flush=True)
        return
    if args.operators:
        print("| semiring | operator | calls per step | self time per call | of operator time |")
        print("|---|---|---:|---:|---:|")
        for name in args.semirings.split(","):
            print("\n".join(operator_table(name, args.operators)), flush=True)
        return
    print(
        "| semiring | native fwd+bwd | eager | compile=True | of which forward | of which "
        "compiled backward | compiled step | first call (capture) | backward program "
        "operators | step program operators | Python calls per op (patched forward) | "
        "Python calls per node (eager sa.grad) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.semirings.split(","):
        m = measure(name, args.repeats)
        print(
            f"| {name} | {m['native_ms']:.2f} ms | {m['eager']:.2f}× | {m['compiled']:.2f}× "
            f"| {m['forward']:.2f}× | {m['backward']:.2f}× | {m['step']:.2f}× "
            f"| {m['capture_ms']:.0f} ms "
            f"| {m['steps']} | {m['step_steps']} | {m['forward_calls']:.1f} | {m['calls']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
