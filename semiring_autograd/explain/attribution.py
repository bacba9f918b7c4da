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
from pathlib import Path as FilePath
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from ..engine.compiled import backward as compiled_backward
from ..engine.compiled.step import compiled_step
from ..engine.grad import grad, message_value
from ..engine.patch import patch
from .batched import attribute_records
from .paths import Path, PathFinder
from .token_scores import (
    Attribution,
    check_position,
    input_leaf,
    model_label,
    prediction_at,
    reached_elements,
    target_id,
)
from ..semirings.base import Semiring
from ..semirings.registry import inherited_spec, semiring_named
from ..semirings.tensor_level import TensorMaxProduct, TensorSignedMaxProduct


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
    x = input_leaf(model, ids)
    mask = None if mask is None else mask.to(x.device)  # a tokenizer's tensors: on the CPU
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
    prediction = prediction_at(row.detach(), index, tokenizer, model_name, text, read, tokens)
    token_values = semiring.sum(message_value(raw, semiring, x), -1)
    scores = semiring.readout(token_values)
    scores = scores[:, 0] if scores.dim() == 3 else scores[0]  # drop the batch dim
    found = _token_paths(finder) if want_paths else []
    signed = want_paths and spec.top_paths == "signed"
    smallest = _token_paths(PathFinder(y, x, which="min")) if signed else []
    reached = reached_elements(semiring, token_values)[0]
    return Attribution(
        tokens, scores.detach(), semiring, label, found, smallest, prediction, reached
    )


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
    then index the batch's tensors, (example, padded position, ...), and their attention
    edges the text's own positions. The model runs in eval mode; every module's
    train/eval mode is restored after.
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
