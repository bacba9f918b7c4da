"""Semiring backprop through a small MLP: what each semiring says about one output logit.

Runs the same patched forward under every built-in semiring, seeds one logit, and prints
per semiring what the readout at the input means, plus the time of patched forward +
semiring backward relative to native forward + backward in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import semiring_autograd as sa
from semiring_autograd.semirings import BUILTIN_SEMIRINGS


class MLP(nn.Module):
    """784-500-10 with a residual-free tanh hidden layer, as in Du et al.'s benchmark."""

    def __init__(self, sizes: tuple[int, ...] = (784, 500, 10)):
        super().__init__()
        self.hidden = nn.Linear(sizes[0], sizes[1])
        self.out = nn.Linear(sizes[1], sizes[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def _median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--target", type=int, default=3, help="output logit to explain")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(args.batch, 784, requires_grad=True)

    def native():
        y = model(x)
        torch.autograd.grad(y[:, args.target].sum(), x)

    t_native = _median_time(native, args.repeats)
    print(f"MLP 784-500-10, batch {args.batch}, seed: logit {args.target} of every example")
    print(f"native forward + backward: {t_native * 1e3:.2f} ms\n")
    print(f"{'semiring':<18} {'time':>9} {'ratio':>6}  readout for example 0")
    for semiring in [cls() for cls in BUILTIN_SEMIRINGS]:

        def run():
            with sa.patch(model, semiring):
                y = model(x)
            return sa.grad(y[:, args.target].sum(), x)

        t = _median_time(run, args.repeats)
        r = run()
        name = type(semiring).__name__
        if isinstance(semiring, sa.SignedMaxProduct):
            hi, lo = r[0, 0], r[1, 0]
            desc = f"largest path product {hi.max():.3e}, smallest {lo.min():.3e}"
        elif isinstance(semiring, sa.Real):
            desc = (
                f"gradient: |grad| max {r[0].abs().max():.3e} at pixel {int(r[0].abs().argmax())}"
            )
        elif isinstance(semiring, sa.MaxProduct):
            desc = f"strongest single path {r[0].max():.3e} from pixel {int(r[0].argmax())}"
        elif isinstance(semiring, sa.Counting):
            desc = f"log #paths per pixel {r[0].max():.4f} (= log 500: every hidden unit)"
        elif isinstance(semiring, sa.Log):
            desc = f"log total |path weight| max {r[0].max():.3f}"
        elif isinstance(semiring, sa.Entropy):
            desc = f"path entropy (nats) mean {r[0].mean():.3f}, max {r[0].max():.3f}"
        else:
            desc = f"pixels with a path: {int(r[0].sum())} of {r.shape[1]}"
        print(f"{name:<18} {t * 1e3:>7.2f}ms {t / t_native:>5.1f}x  {desc}")


if __name__ == "__main__":
    main()
