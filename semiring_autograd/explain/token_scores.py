"""What a token attribution holds and the checks of its request: :class:`Attribution`
(per-token scores, top paths, the prediction), :class:`Prediction`, a target token's logit
index and a read position, checked; shared by one-at-a-time (:mod:`.attribution`) and
batched (:mod:`.batched`) attribution."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path as FilePath
from typing import Any

import torch
from torch import Tensor, nn

from . import report
from .paths import Path
from ..semirings.base import Semiring
from ..semirings.registry import inherited_spec


@dataclass(frozen=True)
class Prediction:
    """What the model predicts where the target's logit is read: the context of a report.

    ``position``: the sequence position whose logits are read (non-negative; None for a
    model with one output per sequence); ``token``: the input token there; ``top``: the
    most probable next tokens, (token, probability), most probable first."""

    model: str
    text: str | None
    position: int | None
    token: str | None
    target_logit: float
    target_probability: float
    target_rank: int
    top: list[tuple[str, float]]

    def __str__(self) -> str:
        where = "" if self.position is None else f" at position {self.position} {self.token!r}"
        top = ", ".join(f"{t!r} {p:.3f}" for t, p in self.top)
        return (
            f"model {self.model}; logits read{where}\n"
            f"target logit {self.target_logit:.4g}, probability {self.target_probability:.4g} "
            f"(rank {self.target_rank}); most probable: {top}"
        )


@dataclass
class Attribution:
    """Per-token scores for one input, with the top path per token for max semirings.

    ``paths``: per token, its strongest path (None where no path reaches); ``min_paths``:
    SignedMaxProduct's path of the smallest signed product per token; ``prediction``: what
    the model predicted where the logit is read; ``reached``: per token, whether a path
    reaches the logit (its ⊕ is not the semiring's zero; None where not known)."""

    tokens: list[str]
    scores: Tensor  # (tokens,); SignedMaxProduct: (2, tokens) = (max, min)
    semiring: Semiring
    target: str
    paths: list[Path | None] = field(default_factory=list)
    min_paths: list[Path | None] = field(default_factory=list)
    prediction: Prediction | None = None
    reached: Tensor | None = None

    @property
    def meaning(self) -> str:
        spec = inherited_spec(self.semiring)
        return spec.meaning if spec is not None else "semiring readout"

    @property
    def unit(self) -> str:
        spec = inherited_spec(self.semiring)
        return spec.unit if spec is not None else "the semiring's readout"

    def display_scores(self) -> Tensor:
        """The scores shown, in float64 (SignedMaxProduct: the largest products)."""
        s = self.scores.double()
        return s[0] if s.dim() == 2 else s

    def min_scores(self) -> Tensor | None:
        """SignedMaxProduct's smallest signed products per token, in float64 (else None)."""
        return self.scores.double()[1] if self.scores.dim() == 2 else None

    def best_token(self) -> int:
        return int(self.display_scores().argmax())

    def best_other_token(self) -> int | None:
        """The best token other than the one whose logits are read, among those with a path
        (None when there is none): its path has to cross attention."""
        read = None if self.prediction is None else self.prediction.position
        candidates = [t for t, p in enumerate(self.paths) if p is not None and t != read]
        if not candidates:
            return None
        scores = self.display_scores()
        return max(candidates, key=lambda t: float(scores[t]))

    def smallest_token(self) -> int | None:
        """SignedMaxProduct: the token with the smallest signed product (None otherwise)."""
        low = self.min_scores()
        if low is None or not any(p is not None for p in self.min_paths):
            return None
        return int(low.argmin())

    def __str__(self) -> str:
        lines = [
            f"{type(self.semiring).__name__}: {self.meaning} [{self.unit}], "
            f"target {self.target}"
        ]
        if self.prediction is not None:
            lines.append(str(self.prediction))
        scores, low = self.display_scores(), self.min_scores()
        width = max(len(repr(t)) for t in self.tokens)
        if low is not None:
            lines.append(f"  {'#':>3}  {'token':<{width}}  {'largest':>12}  {'smallest':>12}")
        for i, tok in enumerate(self.tokens):
            row = f"  {i:3d}  {repr(tok):<{width}}  {float(scores[i]): .6g}"
            if low is not None:
                row = f"  {i:3d}  {repr(tok):<{width}}  {float(scores[i]):>12.6g}  {float(low[i]):>12.6g}"
            lines.append(row)
        for title, token, paths in self.headline_paths():
            lines.append(f"{title}:")
            lines.append(paths[token].format(tokens=self.tokens))
        return "\n".join(lines)

    def headline_paths(self) -> list[tuple[str, int, list[Path | None]]]:
        """The paths a report shows first: (title, token, the path list it is in) for the
        best token's path, the best path from another token, and SignedMaxProduct's
        smallest."""
        shown: list[tuple[str, int, list[Path | None]]] = []
        if not self.paths or self.paths[self.best_token()] is None:
            return shown
        best = self.best_token()
        shown.append((f"top path, from token {best} {self.tokens[best]!r}", best, self.paths))
        other = self.best_other_token()
        if other is not None and other != best:
            title = f"top path from another token than the one read: token {other} {self.tokens[other]!r}"
            shown.append((title, other, self.paths))
        low = self.smallest_token()
        if low is not None and self.min_paths[low] is not None:
            title = f"path of the smallest signed product, from token {low} {self.tokens[low]!r}"
            shown.append((title, low, self.min_paths))
        return shown

    def to_html(self, path: str | os.PathLike | None = None) -> str:
        """A self-contained HTML page: the prediction, the tokens as a heat map of their
        scores on the semiring's colour scale with its legend, and the headline paths (each
        token's path in a collapsible section). Written to ``path`` when given; returned
        either way."""
        return report.html_page(self, path)

    def plot(self, path: str | os.PathLike) -> None:
        """A PNG bar chart of the token scores, coloured on the report's scale with its
        colour bar (needs matplotlib: the ``plot`` extra)."""
        report.plot_scores(self, path)


def target_id(target: int | str, tokenizer) -> tuple[int, str]:
    """(the target's logit index, its label): ValueError for a string that is not one token."""
    if isinstance(target, int):
        known = tokenizer is not None and 0 <= target < len(tokenizer)
        label = repr(tokenizer.convert_ids_to_tokens(target)) if known else f"#{target}"
        return target, f"{label} (id {target})"
    if tokenizer is None:
        raise ValueError("a token string target needs the tokenizer: attribute(..., tokenizer=)")
    ids = tokenizer(target, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        spaced = _spaced_id(target, tokenizer)
        hint = (
            f"; {' ' + target!r}, with a leading space, is one token (id {spaced})"
            if spaced is not None
            else ""
        )
        raise ValueError(
            f"target {target!r} is {len(ids)} tokens {pieces}; give a single token{hint}"
        )
    return ids[0], f"{target!r} (id {ids[0]})"


def _spaced_id(target: str, tokenizer) -> int | None:
    """The id of ``" " + target`` where that is one token other than ``target``'s and
    ``target`` has no leading space (None otherwise; a tokenizer that drops spaces, as
    WordPiece does, gives None)."""
    if not target or target[0].isspace():
        return None
    ids = tokenizer(" " + target, add_special_tokens=False)["input_ids"]
    own = tokenizer(target, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 and ids != own else None


def target_hint(target: int | str, tokenizer) -> str | None:
    """A hint for a token-string target without a leading space when the spaced form is a
    token too: a word that follows a space is usually that one (None: no hint)."""
    if not isinstance(target, str) or tokenizer is None:
        return None
    spaced = _spaced_id(target, tokenizer)
    if spaced is None:
        return None
    return (
        f"target {target!r} has no leading space; a word after a space is the token "
        f"{' ' + target!r} (id {spaced}): give that if the text's next word is meant"
    )


def check_position(position: int, length: int) -> None:
    """ValueError unless ``position`` indexes a sequence of ``length`` tokens."""
    if not -length <= position < length:
        raise ValueError(
            f"position {position} is outside the sequence of {length} tokens "
            f"(give -{length} … {length - 1}; -1 is the last)"
        )


def input_leaf(model: nn.Module, ids: Tensor) -> Tensor:
    """The model's input embeddings of the token ``ids`` (moved to the model's device) as
    a fresh leaf that requires grad: where the semiring backward ends."""
    device = next(model.parameters()).device
    with torch.no_grad():
        emb = model.get_input_embeddings()(ids.to(device))
    return emb.detach().requires_grad_()


def reached_elements(semiring: Semiring, values: Any) -> Tensor:
    """Per element of the semiring value ``values``, whether it differs from the zero (a
    path reaches it)."""
    zero = semiring.zero(values[0].shape, values[0])
    return ~torch.stack([torch.eq(c, z) for c, z in zip(values, zero)]).all(0)


def prediction_at(
    row: Tensor,
    target: int,
    tokenizer,
    model_name: str,
    text: str | None,
    position: int | None,
    tokens: list[str],
    k: int = 5,
) -> Prediction:
    """The target's logit, probability and rank, and the ``k`` most probable tokens, from
    the logits ``row`` (softmax in float64; without a tokenizer a token is named #id)."""
    logits = row.double()
    probs = logits.softmax(-1)
    rank = int((logits > logits[target]).sum()) + 1
    top = probs.topk(min(k, probs.numel()))
    name = (lambda i: tokenizer.decode([i])) if tokenizer is not None else (lambda i: f"#{i}")
    return Prediction(
        model_name,
        text,
        position,
        None if position is None else tokens[position],
        float(logits[target]),
        float(probs[target]),
        rank,
        [(name(int(i)), float(p)) for p, i in zip(top.values, top.indices)],
    )


def model_label(model: nn.Module) -> str:
    """The model's name for a report: its ``name_or_path`` as a Hub id, or the last
    component of a local directory (never the directory itself), else its class name."""
    source = str(getattr(model, "name_or_path", "") or "")
    if not source:
        return type(model).__name__
    where = FilePath(source)
    if where.is_absolute() or where.exists():
        return where.name or type(model).__name__
    return source
