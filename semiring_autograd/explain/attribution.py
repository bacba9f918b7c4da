"""Token attribution for Hugging Face models, shaped like Captum's.

``sa.attribute(model, inputs, target, semiring)`` runs one patched forward from the input
embeddings and one semiring backward from the target logit. A token's score is the
semiring's ⊕ over its embedding's elements, read out: MaxProduct — the weight of the
strongest path from the token to the logit; Log — the log of the total path weight; Entropy —
how spread the gradient flow is; Real — the summed gradient. With MaxProduct (or
SignedMaxProduct) every token also gets its top path, element by element.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path as FilePath
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from ..engine.grad import grad, message_value
from ..engine.patch import patch
from . import report
from .paths import Path, PathFinder
from ..semirings.base import Semiring
from ..semirings.registry import inherited_spec, semiring_named


@dataclass
class Attribution:
    """Per-token scores for one input, with the top path per token for max semirings."""

    tokens: list[str]
    scores: Tensor  # (tokens,); SignedMaxProduct: (2, tokens) = (max, min)
    semiring: Semiring
    target: str
    paths: list[Path | None] = field(default_factory=list)

    @property
    def meaning(self) -> str:
        spec = inherited_spec(self.semiring)
        return spec.meaning if spec is not None else "semiring readout"

    def display_scores(self) -> Tensor:
        """The scores shown, in float64 (SignedMaxProduct: the largest products)."""
        s = self.scores.double()
        return s[0] if s.dim() == 2 else s

    def best_token(self) -> int:
        return int(self.display_scores().argmax())

    def __str__(self) -> str:
        lines = [f"{type(self.semiring).__name__}: {self.meaning}, target {self.target}"]
        scores = self.display_scores()
        width = max(len(repr(t)) for t in self.tokens)
        for i, (tok, score) in enumerate(zip(self.tokens, scores.tolist())):
            lines.append(f"  {i:3d}  {repr(tok):<{width}}  {score: .6g}")
        if self.paths and self.paths[self.best_token()] is not None:
            lines.append(f"top path from token {self.best_token()}:")
            lines.append(str(self.paths[self.best_token()]))
        return "\n".join(lines)

    def to_html(self, path: str | os.PathLike | None = None) -> str:
        """A self-contained HTML page: the tokens as a heat map of their scores, and the top
        path of the best token (each token's path in a collapsible section). Written to
        ``path`` when given; returned either way."""
        return report.html_page(self, path)

    def plot(self, path: str | os.PathLike) -> None:
        """A PNG bar chart of the token scores (needs matplotlib: the ``plot`` extra)."""
        report.plot_scores(self, path)


def _target_id(target: int | str, tokenizer) -> tuple[int, str]:
    if isinstance(target, int):
        known = tokenizer is not None and 0 <= target < len(tokenizer)
        label = repr(tokenizer.convert_ids_to_tokens(target)) if known else f"#{target}"
        return target, f"{label} (id {target})"
    if tokenizer is None:
        raise ValueError("a token string target needs the tokenizer: attribute(..., tokenizer=)")
    ids = tokenizer(target, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise ValueError(f"target {target!r} is {len(ids)} tokens {pieces}; give a single token")
    return ids[0], f"{target!r} (id {ids[0]})"


def _attribute_one(
    model: nn.Module,
    encoding: Any,
    target: int | str,
    semiring: Semiring,
    tokenizer,
    position: int,
    paths: bool,
) -> Attribution:
    ids = encoding["input_ids"]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(
            f"attribute takes one sequence (input_ids of shape (1, n)), got {tuple(ids.shape)}; "
            "pass a list of texts for several"
        )
    if ids.shape[1] == 0:
        raise ValueError("the input has no tokens: give a non-empty text")
    length = ids.shape[1]
    if not -length <= position < length:
        raise ValueError(
            f"position {position} is outside the sequence of {length} tokens "
            f"(give -{length} … {length - 1}; -1 is the last)"
        )
    mask = encoding.get("attention_mask")
    target_id, label = _target_id(target, tokenizer)
    with torch.no_grad():
        emb = model.get_input_embeddings()(ids)
    x = emb.detach().requires_grad_()
    spec = inherited_spec(semiring)
    want_paths = paths and spec is not None and spec.top_paths is not None
    with patch(model, semiring, paths=want_paths):
        out = model(inputs_embeds=x, attention_mask=mask)
    logits = out.logits if hasattr(out, "logits") else out[0]
    if not 0 <= target_id < logits.shape[-1]:
        raise ValueError(
            f"target id {target_id} is outside the model's {logits.shape[-1]} logits "
            f"(give 0 … {logits.shape[-1] - 1}, or a token string with tokenizer=)"
        )
    y = logits[0, target_id] if logits.dim() == 2 else logits[0, position, target_id]
    raw = grad(y, x, raw=True, retain_graph=want_paths)
    token_values = semiring.sum(message_value(raw, semiring, x), -1)
    scores = semiring.readout(token_values)
    scores = scores[:, 0] if scores.dim() == 3 else scores[0]  # drop the batch dim
    if tokenizer is None:
        tokens = [str(i) for i in ids[0].tolist()]
    else:
        tokens = [tokenizer.decode([i]) for i in ids[0].tolist()]
    found: list[Path | None] = []
    if want_paths:
        finder = PathFinder(y, x)
        values = finder.element_values()[0]
        for t in range(ids.shape[1]):
            has_path = torch.isfinite(values[t]).any()
            found.append(finder.path((0, t, int(values[t].argmax()))) if has_path else None)
    where = "" if logits.dim() == 2 else f" at position {position}"
    return Attribution(tokens, scores.detach(), semiring, label + where, found)


def attribute(
    model: nn.Module,
    inputs: Any,
    target: int | str,
    semiring: Semiring | str = "max-product",
    *,
    tokenizer=None,
    position: int = -1,
    paths: bool = True,
    progress: bool = True,
) -> Attribution | list[Attribution]:
    """Per-token semiring attribution of one logit of a Hugging Face model.

    ``inputs``: a tokenizer's output for one sequence (``input_ids`` of shape (1, n)), or —
    with ``tokenizer`` — a text, a list of texts, or a file of texts given as a
    ``pathlib.Path`` (one per line; a list is returned, with a progress bar). A ``str`` is
    always a text, never a file name. ``target``: a logit index, or a token string (with
    ``tokenizer``). ``position``: the sequence position whose logits are read (language
    models; default the last). ``paths``: recover each token's top path (max semirings
    only). The model runs in eval mode; every module's train/eval mode is restored after.
    """
    semiring = semiring_named(semiring)
    if isinstance(inputs, os.PathLike):
        inputs = read_texts(inputs)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        return _attribute(model, inputs, target, semiring, tokenizer, position, paths, progress)
    finally:
        for m, training in modes:
            m.training = training


def read_texts(path: str | os.PathLike) -> list[str]:
    """The non-blank lines of a UTF-8 text file, one text each."""
    lines = FilePath(path).read_text(encoding="utf-8").splitlines()
    texts = [line for line in lines if line.strip()]
    if not texts:
        raise ValueError(f"{path} holds no text (one text per line)")
    return texts


def _attribute(
    model: nn.Module,
    inputs: Any,
    target: int | str,
    semiring: Semiring,
    tokenizer,
    position: int,
    paths: bool,
    progress: bool,
) -> Attribution | list[Attribution]:
    if isinstance(inputs, (str, list, tuple)):
        if tokenizer is None:
            raise ValueError("texts need the tokenizer: attribute(..., tokenizer=tokenizer)")
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        results = []
        iterator: Sequence[str] = texts
        if len(texts) > 1 and progress:
            from tqdm.auto import tqdm

            iterator = tqdm(texts, desc=f"attribute ({type(semiring).__name__})", unit="text")
        for text in iterator:
            encoding = tokenizer(text, return_tensors="pt")
            results.append(
                _attribute_one(model, encoding, target, semiring, tokenizer, position, paths)
            )
        return results[0] if isinstance(inputs, str) else results
    return _attribute_one(model, inputs, target, semiring, tokenizer, position, paths)
