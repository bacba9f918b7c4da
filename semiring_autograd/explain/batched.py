"""Batched token attribution: many records, one patched forward and one semiring backward per
batch.

A record is a text with an optional target and read position of its own. The texts of a
batch are padded to one length on the tokenizer's padding side, with an attention mask that
is 0 on the padding and position ids that count only real tokens, so each example computes
what it computes alone. The logit read for example b is ``logits[b, p_b, t_b]`` (its own
read position p_b, its own target t_b): the backward is seeded with the semiring's one at
each of these B outputs. Examples share no path (no op mixes the batch dimension in eval
mode), so the message reaching example b's embeddings is the ⊕ over the paths to its own
logit: its one-at-a-time readout. Padding tokens reach no logit (masked keys, and under
causal attention, later positions); their scores are dropped.

Records are bucketed by length (sorted within a window) so a batch pads little; with
``compile`` the length is rounded up to a multiple of 8 and the batch filled to its size
with copies of its last example (discarded), so the captured program of a
(batch, length) shape is replayed across batches.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import Tensor, nn

from ..engine.compiled import backward as compiled_backward
from ..engine.compiled.step import compiled_step
from ..engine.grad import grad, message_value, seed_message
from ..engine.patch import patch
from ..semirings.base import Semiring
from ..semirings.registry import inherited_spec
from .token_scores import (
    Attribution,
    check_position,
    input_leaf,
    prediction_at,
    reached_elements,
    target_id,
)
from .paths import Path, PathFinder, shift_attention

#: the config attributes that hold a model's context length, by model family
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
#: with ``compile``, a batch's length is rounded up to a multiple of this
LENGTH_MULTIPLE = 8


@dataclass(frozen=True)
class Record:
    """One input of a batched attribution: ``text``; ``target`` (a logit index or a token
    string; None: the call's); ``position`` (the read position; None: the call's);
    ``id``: the caller's name for the record (kept in the output)."""

    text: str
    target: int | str | None = None
    position: int | None = None
    id: str | None = None


def as_record(item: Any) -> Record:
    """``item`` as a :class:`Record`: a text, a mapping with ``text`` (and optionally
    ``target``, ``position``, ``id``) or a Record. TypeError otherwise."""
    if isinstance(item, Record):
        return item
    if isinstance(item, str):
        return Record(item)
    if isinstance(item, Mapping):
        unknown = set(item) - {"text", "target", "position", "id"}
        if unknown:
            raise ValueError(
                f"a record has the keys text, target, position, id; got also {sorted(unknown)}"
            )
        ident = item.get("id")
        return Record(
            item.get("text"),
            item.get("target"),
            item.get("position"),
            None if ident is None else str(ident),
        )
    raise TypeError(
        f"a record is a text, a mapping with 'text' (and 'target', 'position', 'id') or a "
        f"Record, got {type(item).__name__}"
    )


@dataclass(frozen=True)
class Prepared:
    """A checked record: its ``index`` in the input, token ids and attention mask (the
    tokenizer's, unpadded), the target's logit index and label, and the read position
    (non-negative)."""

    index: int
    record: Record
    ids: list[int]
    mask: list[int]
    target: int
    label: str
    position: int


def context_limit(model: nn.Module) -> int | None:
    """The most tokens ``model`` reads, from its config (None where it names no limit)."""
    return config_context_limit(getattr(model, "config", None))


def config_context_limit(config: Any) -> int | None:
    """The most tokens a Hugging Face ``config`` (its text config, where it has one) names,
    under any of the usual keys; None where it names none."""
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def logit_count(model: nn.Module) -> int | None:
    """The number of logits of a language model's head (None where it has no output
    embeddings)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return None if weight is None else int(weight.shape[0])


def prepare(
    index: int,
    record: Record,
    tokenizer,
    target: int | str | None,
    position: int,
    limit: int | None = None,
    logits: int | None = None,
) -> Prepared:
    """Tokenize and check one record (its own target and position, else ``target`` and
    ``position``): ValueError with the reason for an empty text, a target that is not one
    token or outside the ``logits`` logits, a position outside the text, a text over the
    context ``limit``."""
    if not isinstance(record.text, str) or not record.text.strip():
        raise ValueError("the text is empty: give a non-empty text")
    chosen = record.target if record.target is not None else target
    if chosen is None:
        raise ValueError("no target: give the record a 'target' or the call a target")
    index_, label = target_id(chosen, tokenizer)
    if logits is not None and not 0 <= index_ < logits:
        raise ValueError(f"target id {index_} is outside the model's {logits} logits")
    encoding = tokenizer(record.text)
    ids = list(encoding["input_ids"])
    mask = list(encoding.get("attention_mask", [1] * len(ids)))
    if not ids:
        raise ValueError("the text has no tokens: give a non-empty text")
    if limit is not None and len(ids) > limit:
        raise ValueError(f"the text is {len(ids)} tokens; the model reads at most {limit}")
    read = record.position if record.position is not None else position
    check_position(read, len(ids))
    return Prepared(index, record, ids, mask, index_, label, read % len(ids))


def buckets(items: Iterable[Prepared], batch_size: int, window: int) -> Iterator[list[Prepared]]:
    """Batches of ``batch_size`` records of similar lengths: each ``window`` records (in
    input order) are sorted by length and cut into batches."""
    iterator = iter(items)
    while True:
        chunk = list(itertools.islice(iterator, window))
        if not chunk:
            return
        chunk.sort(key=lambda p: len(p.ids))
        for start in range(0, len(chunk), batch_size):
            yield chunk[start : start + batch_size]


@dataclass
class Padded:
    """A batch padded to one length: ``ids``, ``mask`` (B, L); per example its ``offset``
    (left padding), the read ``positions`` and ``targets`` (B,), and ``position_ids`` (None
    when the model takes none)."""

    ids: Tensor
    mask: Tensor
    offsets: list[int]
    positions: Tensor
    targets: Tensor
    position_ids: Tensor | None

    def to(self, device: torch.device) -> Padded:
        """The batch with its tensors on ``device``."""
        moved = {
            name: None if value is None else value.to(device)
            for name, value in vars(self).items()
            if name != "offsets"
        }
        return Padded(offsets=self.offsets, **moved)


def pad(
    batch: list[Prepared],
    tokenizer,
    takes_position_ids: bool,
    size: int = 0,
    multiple: int = 1,
    side: str | None = None,
) -> Padded:
    """The batch padded on ``side`` (default: the tokenizer's padding side) to its longest
    text (rounded up to ``multiple``), filled to ``size`` rows with copies of its last
    example."""
    rows = batch + [batch[-1]] * max(0, size - len(batch))
    longest = max(len(p.ids) for p in rows)
    length = -(-longest // multiple) * multiple
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    left = (side or getattr(tokenizer, "padding_side", "right")) == "left"
    ids, mask, offsets = [], [], []
    for p in rows:
        gap = length - len(p.ids)
        offsets.append(gap if left else 0)
        ids.append([pad_id] * gap + p.ids if left else p.ids + [pad_id] * gap)
        mask.append([0] * gap + p.mask if left else p.mask + [0] * gap)
    ids_t, mask_t = torch.tensor(ids), torch.tensor(mask)
    positions = torch.tensor([o + p.position for o, p in zip(offsets, rows)])
    targets = torch.tensor([p.target for p in rows])
    position_ids = (mask_t.cumsum(-1) - 1).clamp(min=0) if takes_position_ids else None
    return Padded(ids_t, mask_t, offsets, positions, targets, position_ids)


def takes_position_ids(model: nn.Module) -> bool:
    """Whether ``model``'s forward has a ``position_ids`` argument."""
    return "position_ids" in inspect.signature(model.forward).parameters


def keeps_logits(model: nn.Module) -> bool:
    """Whether ``model``'s forward projects chosen positions only onto the vocabulary
    (``logits_to_keep``, as transformers' causal LMs take)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def read_batch(
    model: nn.Module,
    x: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor | None,
    positions: Tensor,
    targets: Tensor,
    kept: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The B target logits ``logits[b, positions[b], targets[b]]`` of the forward from the
    embeddings ``x``, and each example's logits row there (B, vocabulary). With ``kept``
    (K,) the model projects only those positions onto the vocabulary (``logits_to_keep``)
    and ``positions`` index ``kept``."""
    extra = {} if position_ids is None else {"position_ids": position_ids}
    if kept is not None:
        extra["logits_to_keep"] = kept
    out = model(inputs_embeds=x, attention_mask=attention_mask, **extra)
    logits = out.logits if hasattr(out, "logits") else out[0]
    if logits.dim() != 3:
        raise ValueError(
            f"batched attribution reads a language model's logits (batch, tokens, vocabulary), "
            f"got shape {tuple(logits.shape)}; attribute one input at a time (batch_size=1)"
        )
    rows = torch.arange(x.shape[0], device=x.device)
    return logits[rows, positions, targets], logits[rows, positions]


def kept_positions(padded: Padded, model: nn.Module, every: bool) -> dict[str, Tensor | None]:
    """``read_batch``'s ``positions`` and ``kept``: where the model takes
    ``logits_to_keep``, the read positions (``every``: one per example, a shape that
    depends on the batch size only; else each distinct position once) and each example's
    index among them."""
    if not keeps_logits(model):
        return {"positions": padded.positions, "kept": None}
    if every:
        columns = torch.arange(len(padded.positions), device=padded.positions.device)
        return {"positions": columns, "kept": padded.positions}
    kept, columns = torch.unique(padded.positions, return_inverse=True)
    return {"positions": columns, "kept": kept}


def _compiled_batch(
    model: nn.Module, semiring: Semiring, x: Tensor, padded: Padded
) -> tuple[Any, Tensor]:
    """``read_batch``'s forward and the backward to ``x`` as one ``sa.compiled_step``
    (one program per (batch, length) shape), kept among the library's own steps."""
    steps = compiled_backward.OWN_STEPS
    key = ("attribute-batch", id(model), semiring)
    step = steps.get(key)
    if step is None:
        step = steps[key] = compiled_step(model, semiring, read_batch, raw=True, has_aux=True)
        while len(steps) > compiled_backward.MAX_OWN_STEPS:
            steps.popitem(last=False)
    steps.move_to_end(key)
    return step(
        x,
        attention_mask=padded.mask,
        position_ids=padded.position_ids,
        targets=padded.targets,
        **kept_positions(padded, model, every=True),
    )


@dataclass
class BatchResult:
    """A batch's padded readouts: ``scores`` (B, L), or (2, B, L) for SignedMaxProduct;
    ``reached`` (B, L); the batch as padded. For tests and callers that want the padding."""

    scores: Tensor
    reached: Tensor
    padded: Padded


def attribute_batch(
    model: nn.Module,
    batch: list[Prepared],
    semiring: Semiring,
    tokenizer,
    *,
    paths: bool = True,
    model_name: str = "",
    compile: bool = False,
    batch_size: int = 0,
    keep: list[BatchResult] | None = None,
    best_path_only: bool = False,
    side: str | None = None,
) -> list[Attribution]:
    """One :class:`Attribution` per record of ``batch``, from one patched forward and one
    semiring backward seeded at each example's target logit (with top paths under the max
    semirings: one more recorded backward, for all examples; a path's steps index the
    padded batch, its attention edges the text's own positions; ``best_path_only``: only
    the best token's, None for the others). ``keep``: a list the padded readouts are
    appended to. ``side``: the padding side (default: the tokenizer's)."""
    spec = inherited_spec(semiring)
    want_paths = paths and spec is not None and spec.top_paths in ("max", "signed")
    padded = pad(
        batch,
        tokenizer,
        takes_position_ids(model),
        size=batch_size if compile else 0,
        multiple=LENGTH_MULTIPLE if compile else 1,
        side=side,
    ).to(next(model.parameters()).device)
    x = input_leaf(model, padded.ids)
    read = functools.partial(
        read_batch,
        attention_mask=padded.mask,
        position_ids=padded.position_ids,
        targets=padded.targets,
        **kept_positions(padded, model, every=False),
    )
    if compile and not want_paths:
        raw, rows = _compiled_batch(model, semiring, x, padded)
    else:
        with patch(model, semiring, paths=want_paths):
            y, rows = read(model, x)
        # with paths, the path search's own recorded backward gives the message at x
        finder = _finder(y, x, semiring, "max") if want_paths else None
        raw = finder.message if want_paths else grad(y, x, raw=True, compile=compile)
    values = semiring.sum(message_value(raw, semiring, x), -1)
    scores = semiring.readout(values).detach()
    reached = reached_elements(semiring, values)
    if keep is not None:
        keep.append(BatchResult(scores, reached, padded))
    best = _batch_paths(finder, padded.offsets) if want_paths else None
    signed = want_paths and spec.top_paths == "signed" and not best_path_only
    low = _batch_paths(_finder(y, x, semiring, "min"), padded.offsets) if signed else None
    results = []
    for b, p in enumerate(batch):
        span = slice(padded.offsets[b], padded.offsets[b] + len(p.ids))
        own = scores[..., b, span].clone()
        shown = range(span.start, span.stop)
        if best_path_only:
            shown = [span.start + int((own[0] if own.dim() == 2 else own).argmax())]
        tokens = [tokenizer.decode([i]) for i in p.ids]
        prediction = prediction_at(
            rows[b].detach(), p.target, tokenizer, model_name, p.record.text, p.position, tokens
        )
        results.append(
            Attribution(
                tokens,
                own,
                semiring,
                p.label,
                _paths_of(best, b, span, shown),
                _paths_of(low, b, span, shown),
                prediction,
                reached[b, span].clone(),
            )
        )
    return results


def _paths_of(find, b: int, span: slice, shown) -> list[Path | None]:
    """Example b's paths per token of ``span`` (None where not ``shown``); [] without
    ``find``."""
    if find is None:
        return []
    return [find(b, t) if t in shown else None for t in range(span.start, span.stop)]


def _finder(y: Tensor, x: Tensor, semiring: Semiring, which: str) -> PathFinder:
    """One recorded backward from the B read logits ``y`` to ``x``, seeded at each."""
    return PathFinder(y, x, seed_message(semiring, y), which=which)


def _batch_paths(finder: PathFinder, offsets: list[int]):
    """``path(b, t)``: example b's strongest path (``finder``'s kind) to its padded
    position t (None where no path reaches). A path's indices are the batch's: (example,
    padded position, ...); its attention edges name the text's own positions (less the
    example's left padding, ``offsets[b]``)."""
    values = finder.element_values()

    def path(b: int, t: int) -> Path | None:
        if not torch.isfinite(values[b, t]).any():
            return None
        return shift_attention(finder.path((b, t, int(values[b, t].argmax()))), offsets[b])

    return path


def attribute_records(
    model: nn.Module,
    records: Iterable[Any],
    target: int | str | None,
    semiring: Semiring,
    tokenizer,
    *,
    position: int = -1,
    paths: bool = True,
    progress: bool = True,
    model_name: str = "",
    compile: bool = False,
    batch_size: int = 8,
) -> list[Attribution]:
    """One :class:`Attribution` per record, in input order, computed ``batch_size`` records
    at a time (sorted by length first, so a batch pads little). ValueError naming the first
    bad record (``record i: reason``) before any work."""
    if tokenizer is None:
        raise ValueError("records need the tokenizer: attribute(..., tokenizer=tokenizer)")
    if batch_size < 1:
        raise ValueError(f"batch_size is a positive number of records, got {batch_size}")
    limit, logits = context_limit(model), logit_count(model)
    prepared = []
    for i, item in enumerate(records):
        try:
            prepared.append(prepare(i, as_record(item), tokenizer, target, position, limit, logits))
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"record {i}: {exc}") from None
    results: list[Attribution | None] = [None] * len(prepared)
    bar = None
    if progress and len(prepared) > 1:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prepared), desc=f"attribute ({type(semiring).__name__})", unit="text")
    try:
        for batch in buckets(prepared, batch_size, max(1, len(prepared))):
            found = attribute_batch(
                model,
                batch,
                semiring,
                tokenizer,
                paths=paths,
                model_name=model_name,
                compile=compile,
                batch_size=batch_size,
            )
            for p, a in zip(batch, found):
                results[p.index] = a
            if bar is not None:
                bar.update(len(batch))
    finally:
        if bar is not None:
            bar.close()
    return results  # type: ignore[return-value]
