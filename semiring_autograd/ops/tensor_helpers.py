"""Computations on saved primal tensors that YAML formulas may call (no semiring involved).

They rebuild, in backward, primal quantities an op's forward computed internally (the
attention probabilities of ``scaled_dot_product_attention``) or index arithmetic (the flat
positions a ``gather`` read). They compute in at least float32 (see ``message_dtype``) and
return the primal's dtype, so Real-semiring formulas stay in it as torch.autograd does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Number
from typing import Sequence

import torch
from torch import Tensor

from .. import kernels
from ..kernels import workspace
from ..semirings.base import message_dtype, normalize_dims
from .shape_helpers import attention_scale, grouped_heads, grouped_rows_shape, keepdim_shape


def grouped_rows(x: Tensor, kv_shape: Sequence[int], enable_gqa: bool) -> Tensor:
    """``x`` (…, query heads, rows, last) with the query heads that share a key/value head
    side by side along rows (``shape_helpers.grouped_rows_shape``; a view where ``x``'s
    layout allows); ``x`` itself without grouped heads."""
    return x.reshape(grouped_rows_shape(x.shape, kv_shape, enable_gqa))


def attention_probs(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool = False,
) -> Tensor:
    """softmax(q·kᵀ·scale + mask) along keys, as ``scaled_dot_product_attention`` computes it
    (bool masks and ``is_causal`` exclude positions; float masks are added; with
    ``enable_gqa`` each key head serves the query heads of its group). A query row whose
    keys are all excluded has probability 0 everywhere (no edges), not NaN. On the CPU, with
    no mask, ``is_causal`` or a bool (L, S) mask, one ``softmax_rows`` pass over the
    product; otherwise each step after the product writes into the product's storage: a
    fresh (…, L, S) tensor per step costs its page faults, more than the step."""
    dtype = message_dtype(query.dtype)
    q, k = query.to(dtype), key.to(dtype)
    factor = attention_scale(q.shape, scale)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(dtype)
    scores = torch.matmul(grouped_rows(q, k.shape, enable_gqa), k.transpose(-2, -1))
    if grouped_heads(q.shape, k.shape, enable_gqa):  # each query head's rows again
        scores = scores.reshape(*scores.shape[:-3], *q.shape[-3:-1], k.shape[-2])
    # the kept keys only where softmax_rows may take them (off the CPU a causal mask built
    # per block would be thrown away)
    keep = _kept_keys(scores, attn_mask, is_causal) if scores.is_cpu else _ANY_MASK
    if keep is not _ANY_MASK and kernels.softmax_rows(scores, keep, factor):
        return scores.to(query.dtype)
    scores = scores.mul_(factor)
    scores = mask_scores(scores, attn_mask, is_causal, inplace=True)
    if scores.numel() == 0:  # no query or no key: no probabilities (amax needs a key)
        return scores.to(query.dtype)
    top = scores.amax(-1, keepdim=True)
    excluded = torch.isneginf(top)  # masks on row maxima only: elementwise selects are slow
    weights = scores.sub_(top.masked_fill_(excluded, 0.0)).exp_()
    # an excluded row's weights are all e^-inf = 0: dividing by 1 keeps them 0 (and a NaN
    # score still makes its row NaN)
    probs = weights.div_(weights.sum(-1, keepdim=True).masked_fill_(excluded, 1.0))
    return probs.to(query.dtype)


#: a mask ``softmax_rows`` does not take (a float mask, or a bool mask of more dims)
_ANY_MASK = object()


def _kept_keys(scores: Tensor, attn_mask: Tensor | None, is_causal: bool) -> Tensor | None:
    """The keys each query row keeps as one (L, S) bool for ``kernels.softmax_rows``: None
    where every key is kept, ``_ANY_MASK`` for a mask it does not take (a float mask, a
    bool mask of more than two dims; ``is_causal`` with a mask). A bool mask of at most
    two dims is taken whatever rows it has (the same path for every block of query rows)."""
    length, source = scores.shape[-2:]
    if attn_mask is None:
        if not is_causal:
            return None
        return torch.ones(length, source, dtype=torch.bool, device=scores.device).tril()
    if is_causal or attn_mask.dtype != torch.bool or attn_mask.dim() > 2:
        return _ANY_MASK
    if not _broadcasts_to(attn_mask.shape, (length, source)):
        return _ANY_MASK
    return attn_mask.expand(length, source).contiguous()


def mask_scores(
    scores: Tensor, attn_mask: Tensor | None, is_causal: bool, inplace: bool = False
) -> Tensor:
    """Attention scores with ``scaled_dot_product_attention``'s masking: ``is_causal`` and
    a bool mask (True = attend) set excluded positions to −inf; a float mask is added. With
    ``inplace`` (``scores`` a fresh tensor) each step writes into ``scores``, but where the
    mask broadcasts it to a larger shape."""
    if inplace and attn_mask is not None and not _broadcasts_to(attn_mask.shape, scores.shape):
        inplace = False
    fill = Tensor.masked_fill_ if inplace else Tensor.masked_fill
    length, source = scores.shape[-2], scores.shape[-1]
    if is_causal:
        keep = torch.ones(length, source, dtype=torch.bool, device=scores.device).tril()
        scores = fill(scores, ~keep, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = fill(scores, ~attn_mask, -math.inf)
        else:
            scores = scores.add_(attn_mask) if inplace else scores + attn_mask
    return scores


def _broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without enlarging it."""
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def element_positions(
    shape: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int64
) -> Tensor:
    """A tensor of ``shape`` holding each element's flat position: indexed, gathered or
    padded as an op reads its input, it says which input element each output reads."""
    return torch.arange(math.prod(shape), dtype=dtype, device=device).reshape(tuple(shape))


def gather_positions(input_shape: torch.Size, dim: int, index: Tensor) -> Tensor:
    """For ``out = input.gather(dim, index)``: the flat position in ``input`` that each
    element of ``out`` (flattened) was read from."""
    ndim = len(input_shape)
    dim = dim % ndim if ndim else 0
    strides = torch.ones(ndim, dtype=torch.int64)
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * input_shape[d + 1]
    flat = torch.zeros(index.shape, dtype=torch.int64, device=index.device)
    for d in range(ndim):
        if d == dim:
            coord = index.to(torch.int64)
        else:
            view = [1] * ndim
            view[d] = index.shape[d]
            coord = torch.arange(index.shape[d], device=index.device).view(view)
        flat = flat + coord * int(strides[d])
    return flat.reshape(-1)


def index_positions(shape: torch.Size, device: torch.device, index: object) -> Tensor:
    """For ``out = input[index]`` (any index torch takes: lists, integer and boolean
    tensors, slices): the flat position in ``input`` that each element of ``out``
    (flattened) was read from."""
    return element_positions(shape, device)[index].reshape(-1)


def selected_positions(shape: torch.Size, dim: int, index: Tensor) -> Tensor:
    """For ``out = input.index_select(dim, index)``: the flat position in ``input`` that
    each element of ``out`` (flattened) was read from."""
    positions = element_positions(shape, index.device)
    return positions.index_select(dim, index.reshape(-1)).reshape(-1)


def window_view_positions(shape: torch.Size, dim: int, size: int, step: int) -> Tensor:
    """For ``out = input.unfold(dim, size, step)`` (sliding windows): the flat position in
    ``input`` that each element of ``out`` (flattened) reads."""
    return element_positions(shape, torch.device("cpu")).unfold(dim, size, step).reshape(-1)


def written(shape: torch.Size, positions: Tensor) -> Tensor:
    """A bool tensor of ``shape``, true at the flat ``positions`` an op writes."""
    hit = torch.zeros(math.prod(shape), dtype=torch.bool, device=positions.device)
    return hit.index_fill(0, positions, True).reshape(tuple(shape))


def put_positions(
    shape: torch.Size, device: torch.device, indices: Sequence
) -> tuple[Tensor, torch.Size]:
    """For ``input.index_put(indices, values)``: the flat positions written, in the order of
    ``input[indices]``, and that shape (a None index is a whole dim)."""
    where = tuple(slice(None) if i is None else i for i in indices)
    read = element_positions(shape, device)[where]
    return read.reshape(-1), read.shape


def mask_positions(mask: Tensor, shape: torch.Size) -> Tensor:
    """For ``input.masked_scatter(mask, source)``: the flat positions of ``input`` the mask
    selects, in the order they take source's elements."""
    return element_positions(shape, mask.device)[mask.expand(tuple(shape))].reshape(-1)


def tie_share(input: Tensor, result: Tensor, dims: int | Sequence[int] | None) -> Tensor:
    """For ``result`` = the max (or min) of ``input`` over ``dims``: 1/(number of elements
    equal to it) at those elements, 0 elsewhere — how torch.autograd splits an amax/amin
    gradient among ties."""
    reduced = normalize_dims(dims, input.dim())
    kept = result.reshape(keepdim_shape(input.shape, dims))
    hit = (input == kept).to(input.dtype)
    return hit / hit.sum(dim=reduced, keepdim=True) if reduced else hit


def extreme_share(input: Tensor, other: Tensor, largest: bool) -> Tensor:
    """For ``torch.maximum(input, other)`` (``largest``; else ``minimum``): input's share of
    each output's gradient as torch.autograd gives it — 1 where input is taken or either is
    NaN, 1/2 at a tie, 0 where other is taken (broadcast to the output's shape)."""
    dtype = torch.result_type(input, other)
    taken_by_other = input < other if largest else input > other
    share = torch.ones(
        torch.broadcast_shapes(input.shape, other.shape), dtype=dtype, device=input.device
    )
    return share.masked_fill(input == other, 0.5).masked_fill(taken_by_other, 0.0)


def clamp_passes(input: Tensor, min: Tensor | Number | None, max: Tensor | Number | None) -> Tensor:
    """1 where ``input.clamp(min, max)`` passes input's gradient (min ≤ x ≤ max; a missing
    bound is no condition), else 0, as torch.autograd; broadcast to the output's shape."""
    passes = torch.ones_like(input, dtype=torch.bool)
    if min is not None:
        passes = passes & (input >= min)
    if max is not None:
        passes = passes & (input <= max)
    return passes.to(input.dtype if input.is_floating_point() else torch.get_default_dtype())


def clamp_bound_passes(input: Tensor, min: Tensor | None, max: Tensor | None, bound: str) -> Tensor:
    """1 where ``input.clamp(min, max)`` takes the tensor bound ``bound`` ("min" or "max") as
    torch.autograd passes it a gradient — min where x < min (and min < max when both are
    given), max where x > max (or max < min) — else 0; broadcast to the output's shape."""
    if bound == "min":
        taken = input < min if max is None else (input < min) & (min < max)
        like = min
    else:
        taken = input > max if min is None else (input > max) | (max < min)
        like = max
    return taken.to(torch.result_type(input, like))


def diagonal_positions(
    shape: torch.Size, offset: int, dim1: int, dim2: int, device: torch.device
) -> Tensor:
    """For ``out = input.diagonal(offset, dim1, dim2)``: the flat position in ``input`` of
    each element of ``out`` (flattened)."""
    return element_positions(shape, device).diagonal(offset, dim1, dim2).reshape(-1)


def pad_positions(shape: torch.Size, pad: Sequence[int], mode: str, device: torch.device) -> Tensor:
    """For ``out = F.pad(input, pad, mode)``: the flat position in ``input`` that each
    element of ``out`` (flattened) reads — the same padding applied to the positions —
    and ``input.numel()`` where it reads the constant."""
    numel = math.prod(shape)
    positions = element_positions(shape, device, torch.float64)
    if mode == "constant":
        padded = torch.nn.functional.pad(positions, list(pad), mode, value=float(numel))
    else:
        padded = torch.nn.functional.pad(positions, list(pad), mode)
    return padded.reshape(-1).to(torch.int64)


def cumsum_edges(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The (n, n) edges of a cumulative sum read from its output side: [i, j] = 1 where
    output i sums input j (i ≥ j), else 0."""
    return torch.ones(n, n, dtype=dtype, device=device).tril()


def cumprod_edges(input: Tensor, dim: int, dtype: torch.dtype | None) -> Tensor:
    """The edges of ``input.cumprod(dim, dtype=dtype)`` read from its output side, with
    ``dim`` swapped to the last place: [..., i, j] = Π_{k ≤ i, k ≠ j} x_k for j ≤ i (output
    i's derivative in x_j), else 0."""
    x = input.transpose(dim, -1).to(dtype or input.dtype)
    n = x.shape[-1]
    others = x.unsqueeze(-2).expand(*x.shape[:-1], n, n).clone()  # [..., j, k] = x_k
    others.diagonal(dim1=-2, dim2=-1).fill_(1)  # x_j left out of row j
    return others.cumprod(-1).transpose(-1, -2).tril()


def pow_base_derivative(base: Tensor, exponent: Tensor) -> Tensor:
    """d base**y / d base = y · base^(y − 1) elementwise, 0 where y = 0 (as torch.autograd)."""
    return torch.where(exponent == 0, 0.0, exponent * base.pow(exponent - 1))


def pow_exponent_derivative(base: Tensor | float, exponent: Tensor, result: Tensor) -> Tensor:
    """d base**y / dy = base^y · log(base) elementwise, as torch.autograd takes it: 0 where
    base = 0 and y ≥ 0; NaN for a negative base. ``base`` is a tensor or a number."""
    if not isinstance(base, Tensor):
        base = torch.tensor(base, dtype=result.dtype, device=result.device)
    return torch.where((base == 0) & (exponent >= 0), 0.0, result * base.log())


def gelu_derivative(x: Tensor, approximate: str) -> Tensor:
    """d gelu(x) / dx elementwise, by torch's own fused GELU backward (one pass)."""
    return torch.ops.aten.gelu_backward(_ones_view(x), x, approximate=approximate)


def silu_derivative(x: Tensor) -> Tensor:
    """d silu(x) / dx elementwise, by torch's own fused SiLU backward (one pass)."""
    return torch.ops.aten.silu_backward(_ones_view(x), x)


def _ones_view(x: Tensor) -> Tensor:
    """Ones shaped like ``x``: the unit upstream gradient for a backward kernel that gives
    a local derivative. Dense ones kept for reuse on the CPU (``workspace.ones``), else a
    broadcast view of one element (no x-sized buffer)."""
    dense = workspace.ones(x)
    if dense is not None:
        return dense
    return torch.ones((), dtype=x.dtype, device=x.device).expand_as(x)


@dataclass(frozen=True)
class LossEdges:
    """A loss's edges: each element of its input and target (broadcast against each other)
    feeds one element of the loss — its own, its row's, or the reduced loss."""

    shape: tuple[int, ...]  # the shape input and target are read at
    view: tuple[int, ...]  # the loss's shape, with 1s where it broadcasts over ``shape``
    input: Tensor  # each input element's local derivative, of ``shape``
    target: Tensor | None  # the same for a floating target (None for class indices)


def loss_edges(loss, input: Tensor, target: Tensor, broadcast: bool, **kwargs) -> LossEdges:
    """The edges of ``loss(input, target, **kwargs)`` as torch.autograd computes them: since
    each element feeds one loss element, the vector-Jacobian product with a cotangent of
    ones reads off each edge's weight (``broadcast``: input and target are broadcast
    against each other first, so each copy is an element of its own)."""
    with torch._C.DisableTorchFunction(), torch.enable_grad():
        shape = tuple(input.shape)
        if broadcast:
            shape = tuple(torch.broadcast_shapes(input.shape, target.shape))
        x = input.detach().expand(shape).clone().requires_grad_()
        wants_target = target.is_floating_point()
        t = target.detach()
        if wants_target:
            t = t.expand(shape if broadcast else t.shape).clone().requires_grad_()
        out = loss(x, t, **kwargs)
        leaves = [x, t] if wants_target else [x]
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
    if out.dim() == 0:
        view = (1,) * len(shape)
    elif tuple(out.shape) == shape:
        view = shape
    else:  # a loss per row of classes: (N, *d) over (N, C, *d)
        view = (*out.shape[:1], 1, *out.shape[1:])
    derivatives = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads)]
    return LossEdges(shape, view, derivatives[0], derivatives[1] if wants_target else None)


HELPERS = (
    "extreme_share",
    "clamp_passes",
    "clamp_bound_passes",
    "cumprod_edges",
    "loss_edges",
    "written",
    "put_positions",
    "mask_positions",
    "selected_positions",
    "window_view_positions",
    "grouped_rows",
    "attention_probs",
    "gather_positions",
    "index_positions",
    "pow_base_derivative",
    "pow_exponent_derivative",
    "gelu_derivative",
    "silu_derivative",
    "tie_share",
    "cumsum_edges",
    "diagonal_positions",
    "pad_positions",
)
