"""``scaled_dot_product_attention``'s backward rule run in blocks of query rows.

The rule (derivatives/models.yaml) rebuilds the attention probabilities p = softmax(s) and
the messages at s, heads × L × S each for L queries and S keys. Every query row of them
depends on that query, the full key and value, and the mask's row alone, so the rule runs
on ``rows`` queries at a time: the query's message is the blocks' messages side by side,
the key's and value's (and a mask's broadcast over queries) the ⊕ of the blocks'. Peak
memory is then batch × heads × rows × S per layer, not batch × heads × L × S, for rows
set by :func:`query_rows`: blocks of a few MiB on the CPU, where caches set the cost, and of
hundreds of MiB on an accelerator, where each block's kernel launches do. ``is_causal``
becomes the block's rows of the causal mask (key j ≤ query i), which the rule excludes as
it excludes a boolean mask, and the block reads the keys and values up to its last query
only: the keys after it have p = 0 at each of its queries, no edge, so their messages from
the block are the semiring zero. A causal backward then does about half the work of the
full score matrix.

Values: the message at each query row (query, a per-row mask) is the one the unblocked
rule computes (the same row-local formulas; bit-identical on the CPU tested), except that
a causal block normalises its probabilities by sums over its keys only, which round
differently from the whole row's (an ulp or so of p). The key's and value's regroup their
⊕ over queries by block: exact for a ⊕ that picks an operand (MaxProduct,
SignedMaxProduct, Boolean, KBest), a few ulps of rounding for a float sum (Real, Log,
Entropy, Counting).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable

import torch
from torch import Tensor

from ..semirings.base import Semiring, broadcast_value

#: elements of one batch × heads × rows × S block on the CPU (4 MiB a tensor in float32) …
BLOCK_ELEMENTS = 1 << 20
#: … and on an accelerator (256 MiB a tensor in float32): each block launches the rule's
#: few dozen kernels again, so blocks there stay few (Llama-2-7B's 32 heads: one block up
#: to 1448 tokens) …
DEVICE_BLOCK_ELEMENTS = 1 << 26
#: … but at least this many query rows: each block also reads the key and value
#: (lifts, the ⊕ into their messages), work that fewer rows do not repay
MIN_ROWS = 128

_OP = "scaled_dot_product_attention"
#: the rule's results that are messages over key positions, by index
_KEYS = {1: "key", 2: "value"}


def query_rows(batch_heads: int, queries: int, keys: int, device_type: str = "cpu") -> int:
    """Queries per block: as many as fill :data:`BLOCK_ELEMENTS` on the CPU,
    :data:`DEVICE_BLOCK_ELEMENTS` on another device, at least :data:`MIN_ROWS`, at most
    ``queries`` (one block: the rule runs unblocked)."""
    budget = BLOCK_ELEMENTS if device_type == "cpu" else DEVICE_BLOCK_ELEMENTS
    return min(queries, max(MIN_ROWS, budget // max(1, batch_heads * keys), 1))


def blocked_rule(name: str, rule: Callable, semiring: Semiring | None) -> Callable:
    """``rule`` itself, except for scaled_dot_product_attention: its rule run in blocks of
    query rows. ``semiring`` is the module's (None: the rule takes it first, generic) and
    sets how values look: a tuple of components (generic) or one component tensor."""
    if name != _OP:
        return rule
    signature = inspect.signature(rule)
    names = list(signature.parameters)
    at_query, at_key = names.index("query"), names.index("key")
    generic = semiring is None

    @functools.wraps(rule)
    def blocked(*args: Any) -> Any:
        query, key = args[at_query], args[at_key]
        shape = query.shape
        rows = query_rows(math.prod(shape[:-2]), shape[-2], key.shape[-2], query.device.type)
        if rows >= query.shape[-2]:
            return rule(*args)
        call = signature.bind(*args).arguments
        S = call["S"] if generic else semiring
        return _run_blocks(rule, call, rows, S, generic)

    return blocked


def _run_blocks(rule: Callable, call: dict, rows: int, S: Semiring, generic: bool) -> tuple:
    """The rule on each block of ``rows`` queries; the blocks' messages joined as each
    block ends (the query's, and a per-row mask's, side by side along queries; the key's,
    the value's and a mask's broadcast over queries ⊕-accumulated in block order). A
    causal block reads the keys and values up to its last query only (see
    :func:`_causal_block`). The key's and value's ⊕ are written into one accumulator
    each (:func:`_add_keys`), not into a new tensor per block."""
    query, mask = call["query"], call["attn_mask"]
    length, keys = query.shape[-2], call["key"].shape[-2]
    per_row = mask is not None and mask.dim() >= 2 and mask.shape[-2] == length
    shapes = (call["query__shape"], None, None, call["attn_mask__shape"] if per_row else None)
    wrap = (lambda v: v) if generic else (lambda v: (v,))
    joined: list[Any] = [None] * 4  # per target: a list of block values, or the ⊕ so far
    for start in range(0, length, rows):
        size = min(rows, length - start)
        block = dict(call)
        block["grad"] = _narrow_value(call["grad"], start, size, length, generic)
        block["query"] = query.narrow(-2, start, size)
        block["query__shape"] = block["query"].shape
        if call["is_causal"]:
            _causal_block(block, start, size, keys)
        elif per_row:
            block["attn_mask"] = mask.narrow(-2, start, size)
            block["attn_mask__shape"] = block["attn_mask"].shape
        for i, part in enumerate(rule(**block)):
            if part is None:
                continue
            if shapes[i] is not None:
                joined[i] = (joined[i] or []) + [_expanded(wrap(part), shapes[i], size)]
            elif i in (1, 2):  # the key's and value's: causal blocks cover fewer keys
                if joined[i] is None:
                    joined[i] = _key_accumulator(S, wrap(part), call[_KEYS[i] + "__shape"])
                else:
                    _add_keys(S, joined[i], wrap(part))
            elif joined[i] is None:
                joined[i] = wrap(part)
            else:
                joined[i] = S.add(joined[i], wrap(part))
    for i, shape in enumerate(shapes):
        if shape is not None and joined[i] is not None:
            joined[i] = tuple(torch.cat(components, -2) for components in zip(*joined[i]))
    return tuple(v if v is None or generic else v[0] for v in joined)


def _causal_block(block: dict, start: int, size: int, keys: int) -> None:
    """``block`` (the rule's arguments) set to queries [start, start + size) of a causal
    attention: the causal mask's rows, and the keys and values up to the last query. Key
    j > i has p = 0 at every query i ≤ start + size − 1, so its messages from this block
    are the semiring zero (each is a product with lift(0)) and ⊕ them changes nothing."""
    end = min(keys, start + size)
    for name in ("key", "value"):
        block[name] = block[name].narrow(-2, 0, end)
        block[name + "__shape"] = block[name].shape
    block["attn_mask"] = _causal_rows(start, size, end, block["query"].device)
    block["is_causal"] = False


def _key_accumulator(S: Semiring, value: tuple, shape: torch.Size) -> tuple:
    """The first block's key or value message as an accumulator over all ``shape[-2]``
    keys: fresh components laid out as the block's (a transposed product stays
    transposed, so that later blocks add into it entry for entry), the semiring zero at
    the keys the block does not reach (more keys than queries, causal)."""
    value = broadcast_value(value)
    have, keys = value[0].shape[-2], shape[-2]
    rest = S.zero((*value[0].shape[:-2], keys - have, value[0].shape[-1]), value[0])
    acc = []
    for c, z in zip(value, rest):
        full = (*c.shape[:-2], keys, c.shape[-1])
        dense = all(s != 0 or n == 1 for n, s in zip(c.shape, c.stride()))
        order = sorted(range(c.dim()), key=lambda d: -c.stride(d)) if dense else range(c.dim())
        component = torch.empty_permuted(full, order, dtype=c.dtype, device=c.device)
        component.narrow(-2, 0, have).copy_(c)
        component.narrow(-2, have, keys - have).copy_(z)
        acc.append(component)
    return tuple(acc)


def _add_keys(S: Semiring, acc: tuple, part: tuple) -> None:
    """acc ⊕= part in place, for a block's key or value message ``part`` over the leading
    keys of the accumulator ``acc`` (a causal block's: it is zero at the keys after)."""
    part = broadcast_value(part)
    keys = part[0].shape[-2]
    S.add_into(tuple(c.narrow(-2, 0, keys) for c in acc), part)


def _expanded(value: tuple, shape: torch.Size, rows: int) -> tuple:
    """A block's value (a tuple of components) with every component at the block's shape:
    ``shape`` with ``rows`` queries (a component may broadcast)."""
    return tuple(c.expand(*shape[:-2], rows, shape[-1]) for c in value)


def _narrow_value(value: Any, start: int, size: int, length: int, generic: bool) -> Any:
    """Rows [start, start + size) of a message value along queries (components that
    broadcast over queries stay whole)."""
    if not generic:
        return _narrow(value, start, size, length)
    return tuple(_narrow(c, start, size, length) for c in value)


def _narrow(c: Tensor, start: int, size: int, length: int) -> Tensor:
    if c.dim() >= 2 and c.shape[-2] == length:
        return c.narrow(-2, start, size)
    return c


def _causal_rows(start: int, size: int, keys: int, device: torch.device) -> Tensor:
    """Rows [start, start + size) of the causal mask over ``keys`` keys: key j ≤ query i
    (torch's ``is_causal``: the lower triangle, aligned at the top left)."""
    queries = torch.arange(start, start + size, device=device).unsqueeze(-1)
    return torch.arange(keys, device=device) <= queries
