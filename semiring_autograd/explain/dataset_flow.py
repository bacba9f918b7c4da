"""Module flow per record of a dataset run: how much of each record's readout passes
through each decoder layer's attention and MLP.

For a record with input embeddings x and target logit y, and a module with output T,
the record's flow through T is ⊕ over every element j of x of ``sa.module_flow(y, x,
{T})[j]``: the semiring's readout over the paths from any of the record's tokens to y
that cross T (MaxProduct: the best such path's weight; Log: the log of their total
weight; Real: the gradient through T summed over x). Its share compares it with the
readout over all paths, F = ⊕_j sa.grad(y, x)[j]: flow / F (MaxProduct, Real) or
exp(flow − F) (Log, Counting). Under MaxProduct a share of 1 means the record's
strongest path crosses T.

A batch runs one patched forward and ``sa.module_flow``'s backwards seeded at every
example's target logit: no path joins two examples, so the flow reaching example b's
embeddings is its own.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from ..engine.patch import patch
from ..semirings.base import Semiring
from .batched import Prepared, kept_positions, read_batch, pad, takes_position_ids
from .flow import capture, module_flow
from .token_scores import Attribution, input_leaf

#: a decoder layer's child's whole name → its part (Llama's self_attn, GPT-2's attn,
#: GPT-NeoX's attention, Falcon's self_attention; mlp, feed_forward, Mixtral's
#: block_sparse_moe)
_PARTS = (
    ("attention", re.compile(r"(self_?)?(attn|attention)", re.I)),
    ("mlp", re.compile(r"mlp|feed_forward|ffn|block_sparse_moe|moe", re.I)),
)


def _ratio(flow: float, total: float) -> float | None:
    return flow / total if total != 0 and math.isfinite(total) else None


def _log_ratio(flow: float, total: float) -> float | None:
    return math.exp(flow - total) if math.isfinite(total) else None


#: the semirings (command-line names) a run records flow under, each with its share
SHARES: dict[str, Callable[[float, float], float | None]] = {
    "max-product": _ratio,
    "log": _log_ratio,
    "counting": _log_ratio,
    "real": _ratio,
}


@dataclass(frozen=True)
class FlowModule:
    """A module whose flow a run records: its ``name`` (as in ``named_modules``), its
    decoder ``layer`` (None where the name holds no number) and its ``part``."""

    name: str
    layer: int | None
    part: str


def flow_column(semiring_name: str) -> str:
    """The flow column of a semiring's command-line name: ``flow_max_product``."""
    return "flow_" + semiring_name.replace("-", "_")


def part_of(child: str) -> str:
    """``attention`` or ``mlp`` for a decoder layer's child named like one, else the name."""
    for part, pattern in _PARTS:
        if pattern.fullmatch(child):
            return part
    return child


def named_module(name: str) -> FlowModule:
    """A module name as a :class:`FlowModule`: its layer is the name's last number, its part
    what follows the number (``model.layers.3.self_attn`` → layer 3, ``attention``)."""
    pieces = name.split(".")
    numbers = [i for i, p in enumerate(pieces) if p.isdigit()]
    if not numbers:
        return FlowModule(name, None, part_of(pieces[-1]))
    at = numbers[-1]
    return FlowModule(name, int(pieces[at]), part_of(".".join(pieces[at + 1 :]) or pieces[-1]))


def decoder_parts(model: nn.Module) -> list[FlowModule]:
    """The attention and MLP of each decoder layer: the children, named like a part, of the
    layers of ``model``'s longest ``nn.ModuleList`` whose layers have an attention child.
    ValueError where the model has none."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module):
            continue
        children = [c for layer in module for c, _ in layer.named_children()]
        if any(part_of(c) == "attention" for c in children):
            if best is None or len(module) > len(best[1]):
                best = (name, module)
    if best is None:
        raise ValueError(
            f"flow=True records each decoder layer's attention and MLP; "
            f"{type(model).__name__} has no list of layers with an attention child: pass "
            "flow=[module names] (as in model.named_modules())"
        )
    prefix, layers = best
    found = []
    for number, layer in enumerate(layers):
        for child, _ in layer.named_children():
            if part_of(child) in ("attention", "mlp"):
                found.append(named_module(f"{prefix}.{number}.{child}"))
    return found


def flow_modules(model: nn.Module, flow: bool | Sequence[str]) -> list[FlowModule]:
    """The modules a run records flow through: none (False), each decoder layer's
    attention and MLP (True), or the modules named (ValueError for a name that is not a
    submodule)."""
    if flow is False or flow is None:
        return []
    if flow is True:
        return decoder_parts(model)
    if isinstance(flow, str):
        raise TypeError("flow is True, False or a list of module names, got one string")
    names = list(flow)
    known = dict(model.named_modules())
    missing = [n for n in names if n not in known or not n]
    if missing or not names:
        raise ValueError(
            f"flow: {missing or 'an empty list'} names no submodule of "
            f"{type(model).__name__}; give names as in model.named_modules()"
        )
    return [named_module(n) for n in names]


def batch_flows(
    model: nn.Module,
    batch: list[Prepared],
    semiring: Semiring,
    tokenizer,
    modules: list[FlowModule],
) -> list[list[float]]:
    """Per record of ``batch``, per module, the record's flow (see the module's docstring)
    under ``semiring``: one patched forward and ``sa.module_flow`` for the whole batch."""
    padded = pad(batch, tokenizer, takes_position_ids(model)).to(next(model.parameters()).device)
    x = input_leaf(model, padded.ids)
    names = [m.name for m in modules]
    with patch(model, semiring), capture(model, names) as seen:
        y, _ = read_batch(
            model,
            x,
            padded.mask,
            padded.position_ids,
            targets=padded.targets,
            **kept_positions(padded, model, every=False),
        )
    absent = [n for n in names if n not in seen]
    if absent:
        raise ValueError(f"flow: the modules {absent} did not run in the model's forward")
    flows = module_flow(y, x, seen)
    found = []
    for b, p in enumerate(batch):
        span = slice(padded.offsets[b], padded.offsets[b] + len(p.ids))
        found.append([total_readout(semiring, flows[n][b, span]) for n in names])
    return found


def total_readout(semiring: Semiring, readout: torch.Tensor) -> float:
    """⊕ of a readout over all its elements (a semiring of :data:`SHARES`, whose value is
    its readout)."""
    return float(semiring.readout(semiring.sum((readout,))))


def flow_cells(
    name: str,
    semiring: Semiring,
    modules: list[FlowModule],
    flows: list[float],
    attribution: Attribution,
) -> list[dict]:
    """A record's flow cell: per module its name, layer, part, flow and share of the
    record's total readout (⊕ of its token scores)."""
    total = total_readout(semiring, attribution.scores)
    share = SHARES[name]
    return [
        {"module": m.name, "layer": m.layer, "part": m.part, "flow": f, "share": share(f, total)}
        for m, f in zip(modules, flows)
    ]
