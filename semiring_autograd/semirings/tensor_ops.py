"""Tensor building blocks the built-in semirings share: extremes and leave-one-out maxima,
⊕-scatters by amax/amin, batch flattening for matmuls, and matmuls on the live rows only."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .. import kernels
from ..kernels.workspace import scratch
from .base import Terms, Value, broadcast_shape, message_dtype
from .batching import across_rows, batched

NEG_INF = float("-inf")
POS_INF = float("inf")

# Elements of a broadcast product (rows × k × n) an eager max-times matmul holds at once.
CHUNK_ELEMENTS = 1 << 22
#: the products (rows × k × n) below which ``on_live_rows`` computes every row: finding
#: the live rows and columns takes some twenty operators, which cost more than the
#: semiring GEMM they would trim at that size
PRUNE_PRODUCTS = 1 << 23


def any_nan_or_inf(tensors: Sequence[Tensor], signs: Sequence[int]) -> bool:
    """Whether some tensor holds a NaN or an infinity of the sign given for it (+1: +inf,
    -1: -inf, 0: either). The test runs in one operator and only its outcome is read, so a
    captured backward (``sa.grad(compile=True)``) guards on the outcome. True for tensors
    batched by ``torch.vmap`` (the callers' general path then holds for every row)."""
    if batched(*tensors):
        return True
    fused = kernels.any_nan_or_inf(tensors, signs)
    if fused is not None:
        return fused
    return any(_nan_or_inf(t, sign) for t, sign in zip(tensors, signs))


def _nan_or_inf(t: Tensor, sign: int) -> bool:
    """``any_nan_or_inf`` of one tensor from its extremes (a NaN propagates through them):
    one pass in any dtype, no tensor of ``t``'s size."""
    if t.numel() == 0:
        return False
    low, high = torch.aminmax(t)
    found = torch.isnan(high)
    if sign >= 0:
        found |= torch.isposinf(high)
    if sign <= 0:
        found |= torch.isneginf(low)
    return bool(found)


def all_finite(*tensors: Tensor) -> bool:
    """Whether every entry of ``tensors`` is finite (see ``any_nan_or_inf``)."""
    return not any_nan_or_inf(tensors, (0,) * len(tensors))


def filled(shape: Sequence[int], value: float, like: Tensor) -> Tensor:
    return torch.full(tuple(shape), value, dtype=message_dtype(like.dtype), device=like.device)


def loo_max(x: Tensor, dim: int, empty: float) -> Tensor:
    """max over all j ≠ i along ``dim`` (``empty`` where there is no other element)."""
    if x.shape[dim] <= 1:
        return torch.full_like(x, empty)
    first, second, at = top_two(x, dim)
    out = first.expand_as(x).contiguous()
    # torch.vmap batches scatter out of place only
    return out.scatter(dim, at, second) if batched(out) else out.scatter_(dim, at, second)


def top_two(x: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """The largest and second largest entries along ``dim`` (size ≥ 2) and the position of
    the largest, each with ``dim`` kept as size 1: a max and a max of the rest, cheaper
    than ``topk(2)``."""
    first, at = x.max(dim=dim, keepdim=True)
    second = x.scatter(dim, at, NEG_INF).amax(dim=dim, keepdim=True)
    return first, second, at


def scatter_extreme(x: Tensor, index: Tensor, size: int, reduce: str, empty: float) -> Tensor:
    """Rows of ``x`` reduced (amax/amin) into ``size`` rows by ``index`` (empty rows = empty)."""
    out = x.new_full((size, *x.shape[1:]), empty)
    idx = index.reshape(-1, *([1] * (x.dim() - 1))).expand_as(x)
    return out.scatter_reduce(0, idx, x, reduce=reduce, include_self=True)


def batch_flatten(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, tuple[int, ...]]:
    batch = broadcast_shape(a.shape[:-2], b.shape[:-2])
    count = math.prod(batch)
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(count, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(count, *b.shape[-2:])
    return a3, b3, tuple(batch)


def safe_weight(x: Tensor, total: Tensor) -> Tensor:
    """exp(x - total), 0 where total is -inf (then x is -inf too): the -inf - -inf = NaN
    there becomes 0 (arithmetic only; a masked fill is several times slower on CPU)."""
    return torch.sub(x, total).exp_().nan_to_num_(nan=0.0, posinf=POS_INF)


def ratio_or_zero(num: Tensor, den: Tensor) -> Tensor:
    """num / den where den > 0, else 0 (a sum without terms), in place on a fresh ``num``
    where the kernel runs; a NaN in num stays where den > 0."""
    if kernels.ratio_where_positive(num, den):
        return num
    return torch.where(den > 0, num / den.masked_fill(den <= 0, 1.0), 0.0)


def nonzero_operand(w: Tensor, dtype: torch.dtype) -> Tensor:
    """w ≠ 0 as 0/1 in ``dtype``, a GEMM operand (Counting, Boolean), in scratch storage
    (valid for the calling matmul only), written by one comparison."""
    return torch.ne(w, 0, out=scratch("linear_lift", w.shape, dtype, w.device))


def flat_batch(x: Tensor, batch: tuple[int, ...]) -> Tensor:
    """``x`` broadcast to ``batch`` and flattened to (count, rows, cols)."""
    return x.expand(*batch, *x.shape[-2:]).reshape(math.prod(batch), *x.shape[-2:])


def live_rows(parts: Value, terms: Terms, w: Tensor) -> tuple[Value, Tensor, Tensor] | None:
    """The rows of ``parts`` (…, m, k) a matmul by the real weight ``w`` (k, n) needs:
    None when every row (…, m) has a term, or some row has none and ``w`` holds an infinity
    or NaN where ``terms.nan_at_zero_times_inf`` (zero ⊗ lift(w) is then NaN, as in torch's
    backward, and the rows and columns without a term must stay); else ``parts`` broadcast
    to one shape, the rows with a term (…, m) and their flat indices. For ``parts``
    batched by ``torch.vmap``, the rows with a term in some seed row (in the others, such a
    row's result is the zero that a dropped row gets)."""
    if terms.all_live(parts):
        return None
    live = across_rows(terms.live(parts, -1))
    if bool(live.all()):
        return None
    if terms.nan_at_zero_times_inf and not all_finite(w):
        return None
    parts = torch.broadcast_tensors(*parts)
    live = live.expand(parts[0].shape[:-1])
    return parts, live, live.reshape(-1).nonzero().squeeze(1)


def live_columns(picked: Value, terms: Terms) -> Tensor | None:
    """The indices of the columns of ``picked`` (rows, k) with a term in some row; None
    when every column has one (for ``picked`` batched by ``torch.vmap``: in some row)."""
    columns = across_rows(terms.live(picked, -2))
    return None if bool(columns.all()) else columns.nonzero().squeeze(1)


def worth_pruning(parts: tuple[Tensor, ...], w: Tensor) -> bool:
    """Whether the product of ``parts`` (…, m, k) by a 2-D ``w`` has
    :data:`PRUNE_PRODUCTS` terms or more (rows × k × n), enough for finding its live rows to
    pay (read at the call: tests lower the bound)."""
    return parts[0].numel() * w.shape[-1] >= PRUNE_PRODUCTS


def on_live_rows(
    parts: tuple[Tensor, ...],
    terms: Terms,
    w: Tensor,
    fn,
    empty: tuple[float, ...],
    dtype: torch.dtype | None = None,
) -> Value | None:
    """``fn(parts, w)`` (a matmul by a 2-D ``w``) on the rows of ``parts`` (…, m, k) with
    a term (``terms.live(parts, -1)``, (…, m)) only, the other rows' results set to ``empty``:
    rows without a term (where no path reaches, e.g. every token but the read-out one in a
    last layer) cost nothing. Among those rows, the k columns without a term in any of them
    are dropped too, with their rows of ``w`` (a read-out of one logit reaches one row of an
    lm_head's weight). Such a row's result is the semiring zero and a dropped column adds
    nothing where the zero annihilates every entry of ``w`` (0 ⊗ x = 0); where zero ⊗
    lift(∞) is NaN (``terms.nan_at_zero_times_inf``) nothing is dropped from a matmul by a
    weight with an infinity or NaN, so each row's result is the same in any batch. Without
    a live row the result's dtype is ``dtype``, by default that of ``parts`` and ``w`` promoted. None when every
    row is live, k is 0, ``w`` is batched, or ``w`` is not finite where zero ⊗ lift(w) is
    NaN (see ``live_rows``; the caller then computes all rows), or the product has fewer
    than :data:`PRUNE_PRODUCTS` terms (rows × k × n)."""
    if w.dim() != 2 or parts[0].shape[-1] == 0 or not worth_pruning(parts, w):
        return None
    found = live_rows(parts, terms, w)
    if found is None:
        return None
    parts, live, rows = found
    k, n = parts[0].shape[-1], w.shape[-1]
    flat = [p.reshape(-1, k) for p in parts]
    results = None
    if rows.numel():
        picked = tuple(p[rows] for p in flat)
        kept = live_columns(picked, terms)
        if kept is not None:
            picked, w = tuple(p[:, kept] for p in picked), w[kept]
        results = fn(tuple(p[None] for p in picked), w)
    if results:
        dtype = results[0].dtype
    elif dtype is None:
        dtype = torch.promote_types(flat[0].dtype, w.dtype)
    outs = [flat[0].new_full((flat[0].shape[0], n), value, dtype=dtype) for value in empty]
    if results and batched(*results):  # torch.vmap batches index_copy out of place only
        outs = [out.index_copy(0, rows, result[0]) for out, result in zip(outs, results)]
    else:
        for out, result in zip(outs, results or ()):
            out.index_copy_(0, rows, result[0])
    return tuple(out.reshape(*live.shape, n) for out in outs)


#: the most entries of a middle dim that an ⊕-reduction folds pairwise
FOLD_ENTRIES = 8


def folded_middle(S, a: tuple, dims: tuple[int, ...], keepdim: bool) -> tuple | None:
    """S's ⊕ over one dim that is not the last and holds at most :data:`FOLD_ENTRIES`
    entries (a sum over a few heads or groups), as the fold
    a_0 ⊕ a_1 ⊕ … of its slices: one elementwise ⊕ per entry, where a reduction across
    that dim's strides (a log-sum-exp, KBest's stack and top-k) takes several times their
    time; None for other reductions."""
    if len(dims) != 1 or any(c.shape != a[0].shape for c in a):
        return None
    dim = dims[0] % a[0].dim()
    if dim == a[0].dim() - 1:
        return None
    n = a[0].shape[dim]
    if n == 0 or n > FOLD_ENTRIES:
        return None
    slices = [c.unbind(dim) for c in a]
    out = tuple(parts[0] for parts in slices)
    for i in range(1, n):
        out = S.add(out, tuple(parts[i] for parts in slices))
    return tuple(c.unsqueeze(dim) for c in out) if keepdim else out
