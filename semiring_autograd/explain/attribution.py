"""Token attribution for Hugging Face models, shaped like Captum's.

``sa.attribute(model, inputs, target, semiring)`` runs one patched forward from the input
embeddings and one semiring backward from the target logit. A token's score is the
semiring's ⊕ over its embedding's elements, read out: MaxProduct — the weight of the
strongest path from the token to the logit; Log — the log of the total path weight; Entropy —
how spread the gradient flow is; Real — the summed gradient. With MaxProduct (or
SignedMaxProduct) every token also gets its top path, element by element.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path as FilePath
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from ..engine.compiled import backward as compiled_backward
from ..engine.compiled.step import compiled_step
from ..engine.grad import grad, message_value
from ..engine.patch import patch
from . import report
from .paths import Path, PathFinder
from ..semirings.base import Semiring
from ..semirings.registry import inherited_spec, semiring_named
from ..semirings.tensor_level import TensorMaxProduct, TensorSignedMaxProduct


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


def _attribute_one(
    model: nn.Module,
    encoding: Any,
    target: int | str,
    semiring: Semiring,
    tokenizer,
    position: int,
    paths: bool,
    model_name: str,
    text: str | None = None,
    compile: bool = False,
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
    check_position(position, length)
    mask = encoding.get("attention_mask")
    index, label = target_id(target, tokenizer)
    with torch.no_grad():
        emb = model.get_input_embeddings()(ids)
    x = emb.detach().requires_grad_()
    spec = inherited_spec(semiring)
    want_paths = paths and spec is not None and spec.top_paths in ("max", "signed")
    if compile and not want_paths:
        raw, first = _compiled_scores(model, semiring, x, mask, index, position)
    else:
        with patch(model, semiring, paths=want_paths):
            y, first = _read_logit(model, x, mask, index=index, position=position)
        # with paths, the path search's own recorded backward gives the message at x
        finder = PathFinder(y, x, which="max") if want_paths else None
        raw = finder.message if want_paths else grad(y, x, raw=True, compile=compile)
    if tokenizer is None:
        tokens = [f"#{i}" for i in ids[0].tolist()]
    else:
        tokens = [tokenizer.decode([i]) for i in ids[0].tolist()]
    row = first if first.dim() == 1 else first[position]
    read = None if first.dim() == 1 else position % length
    prediction = _prediction(row.detach(), index, tokenizer, model_name, text, read, tokens)
    token_values = semiring.sum(message_value(raw, semiring, x), -1)
    scores = semiring.readout(token_values)
    scores = scores[:, 0] if scores.dim() == 3 else scores[0]  # drop the batch dim
    found = _token_paths(finder) if want_paths else []
    signed = want_paths and spec.top_paths == "signed"
    smallest = _token_paths(PathFinder(y, x, which="min")) if signed else []
    reached = _reached(semiring, token_values)[0]
    return Attribution(
        tokens, scores.detach(), semiring, label, found, smallest, prediction, reached
    )


def _reached(semiring: Semiring, values: Any) -> Tensor:
    """Per element of the semiring value ``values``, whether it differs from the zero (a
    path reaches it)."""
    zero = semiring.zero(values[0].shape, values[0])
    return ~torch.stack([torch.eq(c, z) for c, z in zip(values, zero)]).all(0)


def _read_logit(
    model: nn.Module, x: Tensor, attention_mask: Tensor | None = None, *, index: int, position: int
) -> tuple[Tensor, Tensor]:
    """The target logit of the forward from the embeddings ``x`` and the first sequence's
    logits (n_labels,) or (n, vocabulary)."""
    out = model(inputs_embeds=x, attention_mask=attention_mask)
    logits = out.logits if hasattr(out, "logits") else out[0]
    if not 0 <= index < logits.shape[-1]:
        raise ValueError(
            f"target id {index} is outside the model's {logits.shape[-1]} logits "
            f"(give 0 … {logits.shape[-1] - 1}, or a token string with tokenizer=)"
        )
    y = logits[0, index] if logits.dim() == 2 else logits[0, position, index]
    return y, logits[0]


def _compiled_scores(
    model: nn.Module,
    semiring: Semiring,
    x: Tensor,
    mask: Tensor | None,
    index: int,
    position: int,
) -> tuple[Any, Tensor]:
    """``_read_logit``'s forward and the semiring backward to ``x`` as one compiled step
    (``sa.compiled_step``, captured per input shape): the raw message at ``x`` and the
    first sequence's logits, detached. The step is kept among the library's own (up to 16,
    until ``engine.compiled.backward.clear()``) for the next text with this model,
    semiring, target and position; it holds the model, as its programs hold the
    parameters."""
    steps = compiled_backward.OWN_STEPS
    key = ("attribute", id(model), semiring, index, position)
    step = steps.get(key)
    if step is None:
        read = functools.partial(_read_logit, index=index, position=position)
        step = steps[key] = compiled_step(model, semiring, read, raw=True, has_aux=True)
        while len(steps) > compiled_backward.MAX_OWN_STEPS:
            steps.popitem(last=False)
    steps.move_to_end(key)
    return step(x) if mask is None else step(x, attention_mask=mask)


def _token_paths(finder: PathFinder) -> list[Path | None]:
    """Per token, the path of its best embedding element (None where no path reaches)."""
    values = finder.element_values()[0]
    found: list[Path | None] = []
    for t in range(values.shape[0]):
        has_path = torch.isfinite(values[t]).any()
        found.append(finder.path((0, t, int(values[t].argmax()))) if has_path else None)
    return found


def _prediction(
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


def attribute(
    model: nn.Module,
    inputs: Any,
    target: int | str | None = None,
    semiring: Semiring | str = "max-product",
    *,
    tokenizer=None,
    position: int = -1,
    paths: bool = True,
    progress: bool = True,
    model_name: str | None = None,
    compile: bool = False,
    batch_size: int = 1,
) -> Attribution | list[Attribution]:
    """Per-token semiring attribution of one logit of a Hugging Face model.

    ``inputs``: a tokenizer's output for one sequence (``input_ids`` of shape (1, n)), or —
    with ``tokenizer`` — a text, a list of texts, or a file of texts given as a
    ``pathlib.Path`` (one per line; a list is returned, with a progress bar). A ``str`` is
    always a text, never a file name. ``target``: a logit index, or a token string (with
    ``tokenizer``). ``position``: the sequence position whose logits are read (language
    models; default the last). ``paths``: recover each token's top path (max semirings
    only; SignedMaxProduct also the path of the smallest signed product). ``model_name``
    names the model in reports (default: :func:`model_label`).
    ``compile``: without top paths, the patched forward and the scores' backward run as one
    ``sa.compiled_step`` per (semiring, target, position), one captured program per input
    length replayed for the texts of that length; with top paths (which run their own
    eager backward) the scores' backward runs as ``sa.grad(..., compile=True)``.

    ``inputs`` may also be a list or an iterable of records: texts, or mappings with
    ``text`` and optionally their own ``target``, ``position`` and ``id`` (see
    :mod:`.batched`). With ``batch_size`` > 1, or records that are mappings, the texts run
    ``batch_size`` at a time: padded on the tokenizer's padding side with its attention
    mask, one forward and one backward per batch seeded at each example's own target
    logit, which gives each example its one-at-a-time scores (padding dropped); top paths
    then index the batch's tensors, (example, position, ...), the batch padded on the
    right. The model runs in eval mode; every module's train/eval mode is restored after.
    """
    semiring = semiring_named(semiring)
    if isinstance(semiring, (TensorMaxProduct, TensorSignedMaxProduct)):
        raise ValueError(
            f"attribute: a token's score is the ⊕ over its embedding elements, and under "
            f"{semiring!r} ⊕ is the real sum used inside ops, not the max; use "
            "granularity='element', or sa.grad for per-element tensor-level readouts"
        )
    if model_name is None:
        model_name = model_label(model)
    if isinstance(inputs, os.PathLike):
        inputs = read_texts(inputs)
    batched = _is_batched(inputs, batch_size)
    if batched:
        inputs = list(inputs)
    elif target is None:
        raise ValueError("attribute needs a target: a logit index or a token string")
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        if batched:
            from .batched import attribute_records

            return attribute_records(
                model,
                inputs,
                target,
                semiring,
                tokenizer,
                position=position,
                paths=paths,
                progress=progress,
                model_name=model_name,
                compile=compile,
                batch_size=batch_size,
            )
        return _attribute(
            model,
            inputs,
            target,
            semiring,
            tokenizer,
            position,
            paths,
            progress,
            model_name,
            compile,
        )
    finally:
        for m, training in modes:
            m.training = training


def _is_batched(inputs: Any, batch_size: int) -> bool:
    """Whether ``inputs`` run as batched records: ``batch_size`` > 1 with several texts, a
    list of records with mappings among them, or an iterable other than a list or tuple."""
    if isinstance(inputs, (str, dict)) or hasattr(inputs, "keys"):
        return False
    if isinstance(inputs, (list, tuple)):
        return batch_size > 1 or any(not isinstance(i, str) for i in inputs)
    return hasattr(inputs, "__iter__") and not isinstance(inputs, Tensor)


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
    model_name: str,
    compile: bool,
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
                _attribute_one(
                    model,
                    encoding,
                    target,
                    semiring,
                    tokenizer,
                    position,
                    paths,
                    model_name,
                    text,
                    compile,
                )
            )
        return results[0] if isinstance(inputs, str) else results
    return _attribute_one(
        model, inputs, target, semiring, tokenizer, position, paths, model_name, None, compile
    )
