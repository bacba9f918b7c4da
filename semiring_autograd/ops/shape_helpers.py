"""Pure shape arithmetic that YAML formulas may call (no tensors, no semiring);
``normalize_dims`` is the semirings' own, so a formula and a reduction read dims alike."""

from __future__ import annotations

import math
from typing import Sequence

from ..semirings.base import normalize_dims


def keepdim_shape(shape: Sequence[int], dims: int | Sequence[int] | None) -> tuple[int, ...]:
    """``shape`` with the reduced ``dims`` kept as size 1."""
    reduced = normalize_dims(dims, len(shape))
    return tuple([1 if i in reduced else s for i, s in enumerate(shape)])


def reduction_dims(dims: int | Sequence[int] | None) -> int | Sequence[int] | None:
    """A ``dim`` argument with torch's reading of None and of an empty list (a reduction:
    every dim; roll: the flattened tensor): None."""
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        return None
    return dims


def negated(shifts: int | Sequence[int]) -> int | tuple[int, ...]:
    """Shifts undone: ``roll(roll(x, s), negated(s)) == x``."""
    return -shifts if isinstance(shifts, int) else tuple(-s for s in shifts)


def reduced_numel(shape: Sequence[int], dims: int | Sequence[int] | None) -> int:
    """How many elements each output of a reduction over ``dims`` combines."""
    return math.prod(shape[d] for d in normalize_dims(dims, len(shape)))


def inverse_permutation(dims: Sequence[int]) -> tuple[int, ...]:
    """The permutation undoing ``permute(dims)``."""
    n = len(dims)
    inverse = [0] * n
    for i, d in enumerate(dims):
        inverse[d % n] = i
    return tuple(inverse)


def promote_matmul_shapes(
    a: Sequence[int], b: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """torch.matmul's operand shapes after 1-D promotion, and the promoted product shape."""
    a2 = tuple(a) if len(a) > 1 else (1, *a)
    b2 = tuple(b) if len(b) > 1 else (*b, 1)
    batch = _broadcast(a2[:-2], b2[:-2])
    return a2, b2, (*batch, a2[-2], b2[-1])


def _broadcast(x: Sequence[int], y: Sequence[int]) -> tuple[int, ...]:
    n = max(len(x), len(y))
    x = (1,) * (n - len(x)) + tuple(x)
    y = (1,) * (n - len(y)) + tuple(y)
    return tuple([max(p, q) if min(p, q) == 1 else p for p, q in zip(x, y)])


def split_sizes(shapes: Sequence[Sequence[int]], dim: int) -> list[int]:
    """Sizes along ``dim`` of the pieces that were concatenated (0 for a legacy empty 1-D
    tensor among higher-dimensional ones, which ``torch.cat`` skips)."""
    ndim = max(map(len, shapes))
    return [0 if len(s) == 1 and s[0] == 0 and ndim > 1 else s[dim] for s in shapes]


def is_basic_index(index: object) -> bool:
    """Whether ``index`` uses only ints, slices, None and Ellipsis (no tensors/lists)."""
    items = index if isinstance(index, tuple) else (index,)
    for i in items:  # a loop, not a generator: this runs for every recorded indexing
        if not (
            i is None
            or i is Ellipsis
            or isinstance(i, slice)
            or (isinstance(i, int) and not isinstance(i, bool))
        ):
            return False
    return True


def attention_scale(query_shape: Sequence[int], scale: float | None) -> float:
    """``scaled_dot_product_attention``'s factor: ``scale``, or 1/sqrt(head dim) when None."""
    if scale is not None:
        return scale
    return 1.0 / math.sqrt(query_shape[-1]) if query_shape[-1] else math.inf  # torch's 1/√0


def grouped_heads(shape: Sequence[int], kv_shape: Sequence[int], enable_gqa: bool) -> bool:
    """Whether (…, heads, rows, last) tensors of ``shape`` are read by key/value heads of
    ``kv_shape`` in groups (grouped-query attention: fewer key/value heads)."""
    return enable_gqa and min(len(shape), len(kv_shape)) >= 3 and shape[-3] != kv_shape[-3]


def attention_scores_shape(
    query_shape: Sequence[int],
    key_shape: Sequence[int],
    value_shape: Sequence[int],
    mask_shape: Sequence[int] | None,
    enable_gqa: bool,
) -> tuple[int, ...]:
    """The shape of ``scaled_dot_product_attention``'s scores (…, L, S): query, key and
    value broadcast over their batch dims (and heads, but with grouped key/value heads:
    then the query's), and a mask's shape broadcast in."""
    lead = 3 if grouped_heads(query_shape, key_shape, enable_gqa) else 2
    batch = _broadcast(_broadcast(query_shape[:-lead], key_shape[:-lead]), value_shape[:-lead])
    heads = (query_shape[-3],) if lead == 3 else ()
    scores = (*batch, *heads, query_shape[-2], key_shape[-2])
    return scores if mask_shape is None else _broadcast(scores, mask_shape)


def grouped_rows_shape(
    shape: Sequence[int], kv_shape: Sequence[int], enable_gqa: bool
) -> tuple[int, ...]:
    """A (…, heads, rows, last) shape with the query heads that share a key/value head of
    ``kv_shape`` taken as one head of their rows side by side, (…, kv heads, group · rows,
    last): a product with that key/value head then reads each of them once, and a product
    over rows ⊕-sums the group; ``shape`` itself without grouped heads."""
    if not grouped_heads(shape, kv_shape, enable_gqa):
        return tuple(shape)
    kv_heads = kv_shape[-3]
    return (*shape[:-3], kv_heads, shape[-3] // kv_heads * shape[-2], shape[-1])


def channel_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape a per-channel vector takes to broadcast over ``(N, C, *spatial)`` (a 1-D
    input, which torch's batch norm accepts only empty, keeps its shape)."""
    if len(shape) < 2:
        return tuple(shape)
    return tuple(s if i == 1 else 1 for i, s in enumerate(shape))


def group_shape(shape: Sequence[int], groups: int) -> tuple[int, int, int]:
    """``(N, C, *spatial)`` viewed as (N, groups, the rest of each sample's group)."""
    return (shape[0], groups, math.prod(shape[1:]) // groups if groups else 0)


def other_dims(ndim: int, dim: int = 1) -> tuple[int, ...]:
    """Every dim of an ``ndim``-dim tensor but ``dim``."""
    return tuple(d for d in range(ndim) if d != dim)


def repeat_blocks(shape: Sequence[int], repeats: Sequence[int]) -> tuple[int, ...]:
    """For ``x.repeat(*repeats)``: the output's shape split into (copies, size) pairs, dim
    by dim (``x`` read with leading size-1 dims up to ``len(repeats)``)."""
    padded = (1,) * (len(repeats) - len(shape)) + tuple(shape)
    return tuple(n for r, s in zip(repeats, padded) for n in (r, s))


def leading_block(shape: Sequence[int]) -> tuple[slice, ...]:
    """The index of the leading block of ``shape`` inside a larger tensor."""
    return tuple(slice(0, n) for n in shape)


def column_shape(shape: Sequence[int], dim: int) -> tuple[int, ...]:
    """``shape`` with ``dim`` and the last dim swapped, then a trailing 1: the shape that
    makes the swapped dim a column (for ⊕ over it against an (…, n, n) edge matrix)."""
    out = list(shape)
    out[dim], out[-1] = out[-1], out[dim]
    return (*out, 1)


def weight_norm_dims(ndim: int, dim: int) -> tuple[int, ...]:
    """The dims ``torch._weight_norm(v, g, dim)`` takes v's norm over: every dim but ``dim``
    (all of them for ``dim = -1``)."""
    if dim == -1:
        return tuple(range(ndim))
    return tuple(d for d in range(ndim) if d != dim % ndim)


def row_matrix_shape(shape: Sequence[int], width: int) -> tuple[int, int]:
    """A tensor of ``shape`` (…, n) viewed as rows of ``width`` entries: (prod(shape[:-1]),
    ``width``), the shape ``reshape(-1, width)`` cannot infer when ``width`` is 0."""
    return (math.prod(shape[:-1]), width)


HELPERS = (
    "row_matrix_shape",
    "column_shape",
    "weight_norm_dims",
    "repeat_blocks",
    "leading_block",
    "channel_shape",
    "other_dims",
    "group_shape",
    "normalize_dims",
    "keepdim_shape",
    "reduced_numel",
    "reduction_dims",
    "negated",
    "inverse_permutation",
    "promote_matmul_shapes",
    "split_sizes",
    "is_basic_index",
    "attention_scale",
    "grouped_heads",
    "attention_scores_shape",
    "grouped_rows_shape",
)
