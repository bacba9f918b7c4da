"""Du et al. (ACL 2023), §5.1: which consumer of the attention block's input — key, query,
value or the residual (skip) — carries the strongest gradient path, on FirstTokenRepeatedOnce.

10,000 sequences of 10 tokens from 1..19; half repeat the first token at exactly one later
position (label 1), the other half never repeat it (label 0); split 7000/1000/2000. A
one-layer BERT (hidden 16, 2 heads, intermediate 32, vocabulary 20, no dropout) is trained
here with Adam (lr 1e-3, batch 32) until validation accuracy reaches 99 %. Then, per
validation sentence, the max-gradient (MaxProduct readout) from ``logits[label]`` to the
attention block's input; per token, its hidden unit of largest value is credited to the
consumer whose message carries it (``sa.consumer_flow``). The table gives the mean credit
per consumer over sentences × positions (0 where another consumer wins), at both
granularities: element level (``MaxProduct()``, exact paths) and tensor level
(``SignedMaxProduct(granularity="tensor")``'s largest end: the paper's max-gradient, which
takes the max only where a tensor's gradients from several consumers merge and keeps real
sums inside matmuls and broadcasts). See docs/paper.md.

    python examples/paper/first_token_repeated.py [--png first_token_repeated.png]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import BertConfig, BertForSequenceClassification

import semiring_autograd as sa
from semiring_autograd.explain.flow import capture

#: the paper's means (Table 1, FirstTokenRepeatedOnce): key, query, value, skip
PAPER = {"key": 0.030, "query": 0.017, "value": 0.001, "skip": 0.009}
CONSUMERS = ("key", "query", "value", "skip")


@dataclass(frozen=True)
class Setting:
    sequences: int = 10_000
    split: tuple[int, int, int] = (7000, 1000, 2000)
    length: int = 10
    vocab: int = 20
    target_accuracy: float = 0.99
    max_epochs: int = 200
    batch: int = 32
    lr: float = 1e-3


def dataset(setting: Setting, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Token ids (n, length) from 1..vocab-1 and labels: 1 where the first token occurs
    again at exactly one later position, 0 where it never does."""
    gen = torch.Generator().manual_seed(seed)
    n, length, top = setting.sequences, setting.length, setting.vocab - 1
    first = torch.randint(1, top + 1, (n, 1), generator=gen)
    # the other tokens: uniform over the values other than the first token
    rest = torch.randint(1, top, (n, length - 1), generator=gen)
    rest = rest + (rest >= first).long()
    labels = torch.arange(n) % 2
    where = torch.randint(0, length - 1, (n,), generator=gen)
    rows = labels.nonzero().squeeze(1)
    rest[rows, where[rows]] = first[rows, 0]
    order = torch.randperm(n, generator=gen)
    return torch.cat([first, rest], 1)[order], labels[order]


def model_for(setting: Setting) -> BertForSequenceClassification:
    config = BertConfig(
        vocab_size=setting.vocab,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=setting.length,
        type_vocab_size=1,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def accuracy(model: nn.Module, ids: Tensor, labels: Tensor) -> float:
    with torch.no_grad():
        return float((model(input_ids=ids).logits.argmax(-1) == labels).float().mean())


def train(setting: Setting, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor, int, float]:
    """The trained model, the validation split, the epochs taken and validation accuracy."""
    ids, labels = dataset(setting, seed)
    n_train, n_valid, _ = setting.split
    train_ids, train_labels = ids[:n_train], labels[:n_train]
    valid_ids, valid_labels = ids[n_train : n_train + n_valid], labels[n_train : n_train + n_valid]
    torch.manual_seed(seed)
    model = model_for(setting)
    optimizer = torch.optim.Adam(model.parameters(), lr=setting.lr)
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(1, setting.max_epochs + 1):
        model.train()
        for batch in torch.randperm(n_train, generator=gen).split(setting.batch):
            optimizer.zero_grad()
            out = model(input_ids=train_ids[batch], labels=train_labels[batch])
            out.loss.backward()
            optimizer.step()
        model.eval()
        valid = accuracy(model, valid_ids, valid_labels)
        if valid >= setting.target_accuracy:
            return model, valid_ids, valid_labels, epoch, valid
    raise RuntimeError(
        f"validation accuracy {valid:.3f} after {setting.max_epochs} epochs, below "
        f"{setting.target_accuracy}"
    )


class LabelLogit(nn.Module):
    """Σ over sentences of logits[label]: one backward gives every sentence's paths (no path
    runs from one sentence to another)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor, labels: Tensor) -> Tensor:
        return self.model(input_ids=ids).logits.gather(1, labels[:, None]).sum()


#: the two definitions of the max-gradient compared: exact paths, and the paper's
GRANULARITIES = {
    "element": sa.MaxProduct(),
    "tensor": sa.SignedMaxProduct(granularity="tensor"),  # its largest end: the paper's
}


def credits(
    model: nn.Module, ids: Tensor, labels: Tensor, granularity: str = "element"
) -> dict[str, Tensor]:
    """Per consumer, the credit of each (sentence, position): the max-gradient at the
    position's strongest hidden unit where that consumer's message carries it, else 0."""
    semiring = GRANULARITIES[granularity]
    readout = LabelLogit(model)
    with sa.patch(readout, semiring), capture(model, ["bert.embeddings"]) as seen:
        total = readout(ids, labels)
    flows = sa.consumer_flow(total, seen["bert.embeddings"])
    by_name = {}
    for flow in flows:
        part = flow.module.rsplit(".", 1)[-1]
        value = flow.readout[0] if granularity == "tensor" else flow.readout
        by_name["skip" if part == "output" else part] = value
    if set(by_name) != set(CONSUMERS):
        raise RuntimeError(f"unexpected consumers of the attention input: {sorted(by_name)}")
    stacked = torch.stack([by_name[c] for c in CONSUMERS])  # (4, sentences, length, hidden)
    merged = stacked.amax(0)
    unit = merged.argmax(-1, keepdim=True)  # the strongest hidden unit per token
    at_unit = stacked.gather(-1, unit.expand(4, *unit.shape)).squeeze(-1)
    winner = at_unit.argmax(0)
    value = merged.gather(-1, unit).squeeze(-1)
    return {c: torch.where(winner == i, value, 0.0) for i, c in enumerate(CONSUMERS)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--png", default="first_token_repeated.png", help="figure (matplotlib)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    setting = Setting()
    model, ids, labels, epochs, valid = train(setting)
    print(f"trained in {epochs} epochs; validation accuracy {valid:.3f}")
    results = {g: credits(model, ids, labels, g) for g in GRANULARITIES}
    print("consumer   element level (won)   tensor level (won)   paper (tensor level)")
    for c in CONSUMERS:
        cells = [
            f"{float(results[g][c].mean()):.4f} ({float((results[g][c] != 0).float().mean()):.2f})"
            for g in GRANULARITIES
        ]
        print(f"{c:8s}  {cells[0]:>20s}  {cells[1]:>19s}  {PAPER[c]:21.3f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    x = torch.arange(len(CONSUMERS)).float()
    for shift, g in ((-0.27, "element"), (0.0, "tensor")):
        ours = [float(results[g][c].mean()) for c in CONSUMERS]
        ax.bar(x + shift, ours, 0.27, label=f"semiring_autograd ({g} level)")
    ax.bar(x + 0.27, [PAPER[c] for c in CONSUMERS], 0.27, label="paper (tensor level)")
    ax.set_xticks(x, CONSUMERS)
    ax.set_ylabel("mean max-gradient credited")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
