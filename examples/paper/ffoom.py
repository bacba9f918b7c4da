"""Du et al. (ACL 2023), App. B.1 (Fig. 6b): gradient-path entropy of a one-hidden-layer MLP
on the "first feature out of many" (FFOOM) task, against its width.

X ~ U[0, 1)⁴, y = [x₀ > 0.5], 20,000 points, 80 % for training; Linear(4, H) →
leaky_relu(0.01) → Linear(H, 2); Adam (lr 1e-3), batch 32, 500 steps. The loss is the mean
cross-entropy written as nll(z − (log Σ exp(z − max z) + max z)), so its paths run through
the max too. Read: the entropy (nats) of the distribution over gradient paths
(p ∝ Π |local derivative|) from the loss to each input element — the Entropy semiring's
readout — averaged over the last training batch; 3 seeds per width.

    python examples/paper/ffoom.py [--png ffoom.png]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import semiring_autograd as sa

WIDTHS = (4, 8, 16, 32, 64, 128)
#: the paper's means for the relevant feature x₀ (Fig. 6b)
PAPER = {4: 2.31, 8: 2.83, 16: 3.75, 32: 4.47, 64: 5.10, 128: 5.79}


@dataclass(frozen=True)
class Setting:
    points: int = 20_000
    train_share: float = 0.8
    steps: int = 500
    batch: int = 32
    lr: float = 1e-3


class Loss(nn.Module):
    """Mean cross-entropy written as nll(z − (log Σ exp(z − max z) + max z)), z = net(x)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        z = self.net(x)
        top = z.gather(-1, z.argmax(-1, keepdim=True))  # max z, derivative 1 on the max
        log_probs = z - ((z - top).exp().sum(-1, keepdim=True).log() + top)
        return -log_probs[torch.arange(len(y)), y].mean()


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(4, width), nn.LeakyReLU(0.01), nn.Linear(width, 2))


def path_entropy(width: int, seed: int, setting: Setting = Setting()) -> Tensor:
    """Train one MLP; the batch-mean path entropy per input feature on its last batch."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(setting.points, 4, generator=gen)
    y = (x[:, 0] > 0.5).long()
    train = int(setting.train_share * setting.points)
    torch.manual_seed(seed)
    loss = Loss(mlp(width))
    optimizer = torch.optim.Adam(loss.parameters(), lr=setting.lr)
    order = torch.randperm(train, generator=gen)
    batch = order[: setting.batch]
    for step in range(setting.steps):
        start = (step * setting.batch) % train
        batch = order[start : start + setting.batch]
        optimizer.zero_grad()
        loss(x[batch], y[batch]).backward()
        optimizer.step()
    inputs = x[batch].clone().requires_grad_()
    with sa.patch(loss, sa.Entropy()):
        value = loss(inputs, y[batch])
    return sa.grad(value, inputs).mean(0)


def table(widths=WIDTHS, seeds=(0, 1, 2), setting: Setting = Setting()) -> dict[int, Tensor]:
    """Per width, the path entropy per feature, mean over seeds (4 values)."""
    return {h: torch.stack([path_entropy(h, s, setting) for s in seeds]).mean(0) for h in widths}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--png", default="ffoom.png", help="figure file (needs matplotlib)")
    args = parser.parse_args()
    results = table()
    print("width  x0 (ours)  x0 (paper)  x1..x3 (ours, mean)")
    for h, values in results.items():
        print(f"{h:5d}  {values[0]:9.2f}  {PAPER[h]:10.2f}  {values[1:].mean():19.2f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(WIDTHS, [float(results[h][0]) for h in WIDTHS], "o-", label="x₀ (semiring_autograd)")
    ax.plot(WIDTHS, [PAPER[h] for h in WIDTHS], "s--", label="x₀ (paper, Fig. 6b)")
    ax.plot(WIDTHS, [float(results[h][1:].mean()) for h in WIDTHS], "^:", label="x₁..x₃")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("hidden width H")
    ax.set_ylabel("gradient-path entropy (nats)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
