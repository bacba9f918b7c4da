"""``sa.grad``: run a semiring backward through PyTorch's engine, seeded by ``seed_message``."""

from __future__ import annotations

import numbers
from typing import Any, Sequence

import torch
from torch import Tensor

from ..ops import demand
from . import checkpointing
from . import trace as tracing
from .compiled import run_backward
from ..errors import BackwardOutOfMemoryError, SemiringAutogradError, SemiringMismatchError
from .graph import node_info
from ..ops.message import Message, wrap
from ..semirings import batching
from ..semirings.base import Semiring, message_dtype
from ..semirings.signed_max_product import SignedMaxProduct
from ..semirings.registry import defined_by_library, plain_messages, records_torch_graph


def recorded_semiring(outputs: Tensor | Sequence[Tensor]) -> Semiring:
    """The semiring the graph behind ``outputs`` was recorded with under ``sa.patch``."""
    outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    found: set[Semiring] = set()
    seen: set = set()  # the nodes themselves: ids of freed node wrappers get reused
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        info = node_info(node)
        if info is not None:
            found.add(info.semiring)
            continue
        stack.extend(n for n, _ in node.next_functions)
    if not found:
        raise SemiringAutogradError(
            "no node recorded under sa.patch found in the graph behind these outputs: compute "
            "them from a forward run inside `with sa.patch(model, semiring):` (and with inputs "
            "that require grad)"
        )
    if len(found) > 1:
        raise SemiringMismatchError(
            f"the graph mixes semirings {sorted(map(repr, found))}; one backward pass must use "
            "one semiring"
        )
    return found.pop()


def seed_message(semiring: Semiring, output: Tensor, weights: Tensor | None = None) -> Tensor:
    """The seed message for ``output``: one everywhere, or lift(weights) when given — a
    tensor of the output's shape, or a number for every element (a weight of 0 starts no
    path), lifted in the message precision. For Real it is the ordinary grad_output, in
    the output's dtype."""
    _refuse_meta(semiring, output, weights)
    if isinstance(weights, numbers.Real) and not isinstance(weights, bool):
        weights = torch.full_like(output, float(weights))
    elif weights is not None:
        if not isinstance(weights, Tensor):
            raise TypeError(
                f"a seed is a real number or a tensor of the output's shape, got "
                f"{type(weights).__name__}"
            )
        weights = weights.to(device=output.device)
        if weights.shape != output.shape:
            raise ValueError(
                f"seed has shape {tuple(weights.shape)} but the output has shape "
                f"{tuple(output.shape)}"
            )
    if plain_messages(semiring):
        return torch.ones_like(output) if weights is None else weights.to(output.dtype)
    if weights is None:
        value = semiring.one(output.shape, output)
    else:
        # lifted in the message precision (float32 at least), not the output's
        value = semiring.lift(weights.to(message_dtype(output.dtype)))
    return wrap(semiring, value, output)


def _refuse_meta(semiring: Semiring, output: Tensor, weights: object) -> None:
    """A ValueError for a seed or output on the meta device that the backward cannot use:
    a meta tensor holds no values, and only torch's own graph (Real) runs without them."""
    if isinstance(weights, Tensor) and weights.is_meta and not output.is_meta:
        raise ValueError(
            f"sa.grad: the seed is on the meta device (shape {tuple(weights.shape)}), which "
            f"holds no values, but the output is on {output.device}: give the seed on "
            f"{output.device} (e.g. torch.ones_like(output))"
        )
    if output.is_meta and not records_torch_graph(semiring):
        raise ValueError(
            f"sa.grad: the output (shape {tuple(output.shape)}) is on the meta device, which "
            f"holds no values: the {semiring!r} backward reads the values it multiplies. Load "
            "the model's weights onto a real device (model.to_empty(device=...) and "
            "load_state_dict, or accelerate's device_map) and run the patched forward there"
        )


def grad(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    seed: Tensor | Sequence[Tensor | None] | None = None,
    *,
    retain_graph: bool = False,
    raw: bool = False,
    trace: bool | "tracing.trace" = False,
    compile: bool = False,
    is_grads_batched: bool = False,
) -> Tensor | tuple[Tensor | None, ...] | None:
    """Semiring analogue of ``torch.autograd.grad``.

    Every element of every output starts a path with the semiring's one (or lift(seed)
    where ``seed`` gives real weights). Returns, per input, the readout (a plain tensor of
    the input's shape; SignedMaxProduct: shape (2, *input)), or with ``raw=True`` the
    message (``.value`` holds the semiring components; None where no path reaches).
    ``trace=True`` (or an ``sa.trace`` instance) reports each backward node as it runs, as
    inside ``with sa.trace():``.

    ``compile=True`` runs the backward as a program captured on the first call for this
    graph's signature (structure, saved tensors' shapes, op arguments), without PyTorch's
    engine or Python per op after that (``engine/compiled/``): results bit-identical to
    the eager backward, which runs instead (with one warning) where capture cannot be exact.
    Hooks on graph nodes or tensors do not run in a replay; the graph is kept until its
    outputs are freed, whatever ``retain_graph`` says. Under ``sa.Real()`` (torch's own graph,
    whose backward already runs in C++) it runs torch's engine.

    ``is_grads_batched=True``: each seed holds B seeds stacked on a new leading dimension
    (shape (B, *output)), and each readout gains that dimension first (row b: the readout
    of seed row b). Under ``sa.Real()`` one batched backward computes them (torch's
    ``is_grads_batched``); under the other built-in semirings, one backward under
    ``torch.vmap`` per 16 rows (the rules skip only rows and columns that no row's paths
    reach, and the fused CPU kernels give way to the torch formulas); under
    SignedMaxProduct or a user-defined semiring, with an active ``sa.trace`` or
    ``trace=True``, one backward per row on the graph kept in between. With ``compile=True``
    the rows replay the program the first captured where their seeds reach the same
    elements (else the eager backward runs, with one warning).
    """
    if is_grads_batched:
        return _batched(outputs, inputs, seed, retain_graph, raw, trace, compile)
    single_input = isinstance(inputs, Tensor)
    ins = _tensors("inputs", inputs)
    outs = _tensors("outputs", outputs)
    for i, x in enumerate(ins):
        if not x.requires_grad:
            raise ValueError(
                f"sa.grad: input {i} (shape {tuple(x.shape)}) does not require grad, so no "
                "path can reach it: call x.requires_grad_() before the patched forward"
            )
    if isinstance(seed, (Tensor, numbers.Real)) or seed is None:
        seeds = [seed]
    elif isinstance(seed, Sequence):
        seeds = list(seed)
    else:
        raise TypeError(
            "sa.grad: seed is None, a number, a tensor, or a sequence of those (one per "
            f"output), got {type(seed).__name__}"
        )
    if len(seeds) == 1 and len(outs) > 1:
        seeds = seeds * len(outs)
    if len(seeds) != len(outs):
        raise ValueError(f"got {len(seeds)} seeds for {len(outs)} outputs")
    semiring = recorded_semiring(outs)
    grad_outputs = [seed_message(semiring, o, s) for o, s in zip(outs, seeds)]
    own = tracing.trace() if trace is True else (trace or None)
    if own is not None:
        own.attach(outs)
    traced = tracing.attach_active(outs) or own is not None

    def backward(retain: bool):
        with demand.requesting(outs, ins):
            return torch.autograd.grad(
                outs, ins, grad_outputs, retain_graph=retain, allow_unused=True
            )

    try:
        if compile and not records_torch_graph(semiring):
            results = run_backward(outs, ins, grad_outputs, backward, retain_graph, traced)
        else:
            results = backward(retain_graph)
    except torch.OutOfMemoryError as exc:
        error = _out_of_memory(exc, semiring, compile)
        exc.__traceback__ = None  # its frames hold the messages computed so far
        raise error from None
    except RuntimeError as exc:
        if checkpointing.is_reentrant_refusal(exc):
            raise SemiringAutogradError(checkpointing.REENTRANT_FIX) from exc
        raise
    finally:
        if own is not None:
            own.detach()
    final = readouts(semiring, ins, results, raw)
    return final[0] if single_input else final


def _batched(
    outputs: Tensor | Sequence[Tensor],
    inputs: Tensor | Sequence[Tensor],
    seed: object,
    retain_graph: bool,
    raw: bool,
    trace: bool | "tracing.trace",
    compile: bool,
) -> Tensor | tuple[Tensor, ...]:
    """``sa.grad(..., is_grads_batched=True)``: per input, the readouts of each seed row,
    stacked (see :func:`grad`)."""
    outs = _tensors("outputs", outputs)
    ins = _tensors("inputs", inputs)
    seeds = [seed] if isinstance(seed, Tensor) else seed
    if raw or not isinstance(seeds, Sequence) or not all(isinstance(s, Tensor) for s in seeds):
        raise TypeError(
            "sa.grad(is_grads_batched=True) takes a tensor seed per output, of shape "
            "(B, *output): B seeds stacked on a leading dimension (raw messages are not "
            "batched: call sa.grad(..., raw=True) per seed)"
        )
    seeds = list(seeds) * len(outs) if len(seeds) == 1 else list(seeds)
    if len(seeds) != len(outs):
        raise ValueError(f"got {len(seeds)} seeds for {len(outs)} outputs")
    for o, s in zip(outs, seeds):
        if s.dim() == 0 or tuple(s.shape[1:]) != tuple(o.shape):
            raise ValueError(
                f"sa.grad(is_grads_batched=True): a seed of shape {tuple(s.shape)} for an "
                f"output of shape {tuple(o.shape)}; give shape (B, {', '.join(map(str, o.shape))})"
                " with B seeds stacked on the first dimension"
            )
    rows = {s.shape[0] for s in seeds}
    if len(rows) != 1 or 0 in rows:
        raise ValueError(
            f"sa.grad(is_grads_batched=True): seeds of {sorted(rows)} rows; give every "
            "output the same number of seed rows, at least one"
        )
    (count,) = rows
    semiring = recorded_semiring(outs)
    if records_torch_graph(semiring):
        with demand.requesting(outs, ins):
            results = torch.autograd.grad(
                outs,
                ins,
                [s.to(device=o.device, dtype=o.dtype) for o, s in zip(outs, seeds)],
                retain_graph=retain_graph,
                allow_unused=True,
                is_grads_batched=True,
            )
        final = tuple(
            torch.zeros(count, *x.shape, dtype=x.dtype, device=x.device) if r is None else r
            for x, r in zip(ins, results)
        )
    elif vmappable(semiring) and not compile and not trace and not _tracing():
        # in chunks of rows: a chunk's messages stay in cache (measured 1.6-3x faster at 64
        # rows on the tiny Llama of benchmarks/batched_seeds.py than one vmap over all)
        chunks = [
            _vmapped(
                semiring,
                outs,
                ins,
                [s[start : start + VMAP_ROWS] for s in seeds],
                retain_graph or start + VMAP_ROWS < count,
            )
            for start in range(0, count, VMAP_ROWS)
        ]
        final = tuple(torch.cat(parts) for parts in zip(*chunks))
    else:
        per_row = [
            grad(
                outs,
                ins,
                [s[b] for s in seeds],
                retain_graph=retain_graph or b < count - 1,
                trace=trace,
                compile=compile,
            )
            for b in range(count)
        ]
        final = tuple(torch.stack([row[i] for row in per_row]) for i in range(len(ins)))
    return final[0] if isinstance(inputs, Tensor) else final


def vmappable(semiring: Semiring) -> bool:
    """Whether a batched backward of ``semiring`` runs under ``torch.vmap``: the library's
    own semirings (a user-defined semiring's ⊕ and ⊗ may branch on values) but
    SignedMaxProduct, whose matmul without the fused kernel builds every corner product
    (measured 1.2-25x slower than one backward per row, benchmarks/batched_seeds.py)."""
    return defined_by_library(semiring) and not isinstance(semiring, SignedMaxProduct)


#: the seed rows one backward under torch.vmap takes at most
VMAP_ROWS = 16


def _tracing() -> bool:
    """Whether an ``sa.trace`` is active in this thread (it reports per-row messages)."""
    return bool(getattr(tracing._ACTIVE, "stack", ()))


def _vmapped(
    semiring: Semiring,
    outs: list[Tensor],
    ins: list[Tensor],
    seeds: list[Tensor],
    retain_graph: bool,
) -> tuple[Tensor, ...]:
    """Per input, the readouts of each seed row, stacked: one backward under ``torch.vmap``
    over the seed rows, as torch's ``is_grads_batched`` runs one (the messages' components
    carry the rows; a rule's branch on values is taken for every row or not at all, see
    ``semirings/batching.py``)."""

    def backward(*rows: Tensor) -> tuple[Tensor, ...]:
        grad_outputs = [seed_message(semiring, o, s) for o, s in zip(outs, rows)]
        with demand.requesting(outs, ins), batching.vmap_layer():
            results = torch.autograd.grad(
                outs, ins, grad_outputs, retain_graph=retain_graph, allow_unused=True
            )
        return readouts(semiring, ins, results)

    try:
        return torch.vmap(backward)(*seeds)
    except torch.OutOfMemoryError as exc:
        error = _out_of_memory(exc, semiring, False)
        exc.__traceback__ = None
        raise error from None
    except RuntimeError as exc:
        text = str(exc).strip()
        if "vmap" not in text and "Batching rule" not in text:
            raise
        raise SemiringAutogradError(
            f"sa.grad(is_grads_batched=True): a {semiring!r} backward rule in this graph does "
            f"not run under torch.vmap ({text.splitlines()[0]}); run one backward per seed row "
            "instead: sa.grad(outputs, inputs, seed_row, retain_graph=True) for each row, or "
            "is_grads_batched=True with compile=True"
        ) from exc


def readouts(
    semiring: Semiring, inputs: Sequence[Tensor], results: Sequence[Any], raw: bool = False
) -> tuple:
    """Per input, the readout of its message (the zero's where None), or with ``raw`` the
    message itself."""
    if raw:
        return tuple(results)
    plain = plain_messages(semiring)
    final = []
    for x, r in zip(inputs, results):
        if r is None:
            final.append(semiring.readout(semiring.zero(x.shape, x)))
        elif plain:
            final.append(r)
        else:
            final.append(semiring.readout(r.value))
    return tuple(final)


def _out_of_memory(
    exc: torch.OutOfMemoryError, semiring: Semiring, compile: bool
) -> BackwardOutOfMemoryError:
    """The error for ``exc``, raised inside the backward: which op's backward (the innermost
    generated Function in the traceback) and the allocator's message (how much)."""
    where = "a captured program (compile=True)" if compile else "the backward"
    tb, op = exc.__traceback__, None
    while tb is not None:
        ctx = tb.tb_frame.f_locals.get("ctx")
        info = (
            node_info(ctx) if isinstance(ctx, torch.autograd.function.BackwardCFunction) else None
        )
        if info is not None:
            op = info
        tb = tb.tb_next
    if op is not None:
        where = f"the backward of '{op.op}' in module '{op.module or '(top level)'}'"
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
    return BackwardOutOfMemoryError(
        f"sa.grad under {semiring!r} ran out of memory in {where}, computing its inputs' "
        f"messages: {first_line}. Nothing of the backward is kept (the model is not patched "
        "after its forward); free the outputs to release the recorded graph, then use a "
        "shorter input, a smaller batch, or ask for fewer inputs (sa.grad only computes "
        "messages for the inputs it is given)."
    )


def _tensors(what: str, given: Tensor | Sequence[Tensor]) -> list[Tensor]:
    """``given`` as a list of tensors, or a TypeError naming the odd one."""
    items = [given] if isinstance(given, Tensor) else given
    if not isinstance(items, Sequence):
        raise TypeError(
            f"sa.grad: {what} is a tensor or a sequence of tensors, got {type(given).__name__}"
        )
    for i, t in enumerate(items):
        if not isinstance(t, Tensor):
            raise TypeError(f"sa.grad: {what}[{i}] is {type(t).__name__}, not a tensor")
    return list(items)


def message_value(message: Tensor | None, semiring: Semiring, like: Tensor):
    """The semiring value of a raw result (``raw=True``), the zero where None."""
    if message is None:
        return semiring.zero(like.shape, like)
    if isinstance(message, Message):
        return message.value
    return (message,)
