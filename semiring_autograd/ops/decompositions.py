"""The compositions that define composite ops, written with elementary torch ops.

An op whose YAML granularity is a composition (the normalisations, ``scaled_dot_product_attention``)
has one semiring formula for the whole op; its internal nodes are nodes of the gradient graph
but not tensors of the recorded graph. To name a path through them, :mod:`paths` re-runs the
op as this composition (each step an op with its own formula) on the recorded inputs. Each
function takes the torch function's own arguments.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .shape_helpers import (
    attention_scale,
    channel_shape,
    group_shape,
    other_dims,
    weight_norm_dims,
)
from .tensor_helpers import mask_scores


def _standardized(x: Tensor, dims, eps: float) -> Tensor:
    """μ = mean(x); c = x − μ; v = mean(c²); s = (v + eps)^(−1/2); n = c·s over ``dims``
    (c² is one edge of weight 2c per element, as the YAML formulas state, not c·c's two)."""
    c = x - x.mean(dims, keepdim=True)
    return c * torch.rsqrt(c.pow(2).mean(dims, keepdim=True) + eps)


def _affine(y: Tensor, weight: Tensor | None, bias: Tensor | None, shape) -> Tensor:
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y


def layer_norm(
    input: Tensor,
    normalized_shape,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """n standardised over the normalised dims; y = n·w + b."""
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    return _affine(_standardized(input, dims, eps), weight, bias, tuple(normalized_shape))


def batch_norm_batch_stats(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """n standardised over every dim but the channel; y = n·w + b per channel (the running
    statistics are left as they are)."""
    y = _standardized(input, other_dims(input.dim()), eps)
    return _affine(y, weight, bias, channel_shape(input.shape))


def group_norm(
    input: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """n standardised over each sample's group of channels; y = n·w + b per channel."""
    grouped = input.reshape(group_shape(input.shape, num_groups))
    y = _standardized(grouped, -1, eps).reshape(input.shape)
    return _affine(y, weight, bias, channel_shape(input.shape))


def instance_norm(
    input: Tensor,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """n standardised over each sample's channel; y = n·w + b per channel."""
    y = _standardized(input, tuple(range(2, input.dim())), eps)
    return _affine(y, weight, bias, channel_shape(input.shape))


def rms_norm(
    input: Tensor, normalized_shape, weight: Tensor | None = None, eps: float | None = None
) -> Tensor:
    """m = mean(x²); s = (m + eps)^(−1/2); n = x·s; y = n·w."""
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    eps = torch.finfo(input.dtype).eps if eps is None else eps
    y = input * torch.rsqrt(input.pow(2).mean(dims, keepdim=True) + eps)
    return y if weight is None else y * weight


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """s = q·kᵀ·scale + mask (excluded positions −inf); p = softmax(s); o = p·v; with
    enable_gqa, key and value heads are first copied to the query heads of their group. A
    query row whose keys are all excluded (a left-padded batch's padding) attends to every
    key here, where softmax over no key is NaN; the op gives it 0 and no edges, and
    :func:`excluded_queries` names it (see :data:`CONSTANT_OUTPUTS`)."""
    rows = excluded_queries(query, key, attn_mask=attn_mask, is_causal=is_causal)
    if rows is not None and bool(rows.any()):
        attn_mask = (
            attn_mask | rows if attn_mask.dtype == torch.bool else attn_mask.masked_fill(rows, 0.0)
        )
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = (_repeat_heads(t, groups) for t in (key, value))
    factor = attention_scale(query.shape, scale)
    s = mask_scores((query @ key.transpose(-2, -1)) * factor, attn_mask, is_causal)
    return s.softmax(-1) @ value


def excluded_queries(
    query: Tensor,
    key: Tensor,
    value: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor | None:
    """Per query row of ``scaled_dot_product_attention`` (a bool tensor (…, L, 1)), whether
    ``attn_mask`` and ``is_causal`` exclude every key (None without a mask: causal masking
    alone leaves each row its first key)."""
    if attn_mask is None or key.shape[-2] == 0:
        return None
    with torch.no_grad():
        blank = torch.zeros(query.shape[-2], key.shape[-2], device=query.device)
        allowed = mask_scores(blank, attn_mask.detach(), is_causal)
        return torch.isneginf(allowed.amax(-1, keepdim=True))


def _repeat_heads(x: Tensor, groups: int) -> Tensor:
    """(…, h, n, d) → (…, h·groups, n, d), each head repeated ``groups`` times in place."""
    shape = x.shape
    expanded = x.unsqueeze(-3).expand(*shape[:-2], groups, *shape[-2:])
    return expanded.reshape(*shape[:-3], shape[-3] * groups, *shape[-2:])


def weight_norm(v: Tensor, g: Tensor, dim: int = 0) -> Tensor:
    """n = ‖v‖ over every dim but ``dim`` (all for −1); s = g / n; w = v·s. The norm runs as
    sqrt(Σ v²), one path per element of v whose edges multiply to v/n."""
    n = v.pow(2).sum(weight_norm_dims(v.dim(), dim), keepdim=True).sqrt()
    return v * (g / n)


DECOMPOSITIONS: dict[str, Callable[..., Tensor]] = {
    "_weight_norm": weight_norm,
    "layer_norm": layer_norm,
    "batch_norm.batch_stats": batch_norm_batch_stats,
    "group_norm": group_norm,
    "instance_norm": instance_norm,
    "rms_norm": rms_norm,
    "scaled_dot_product_attention": scaled_dot_product_attention,
}


#: per composite op, the output elements that depend on none of its inputs, where its
#: composition computes them otherwise (a bool tensor broadcastable to the output, or None;
#: the function takes the op's own arguments): a path search seeds them with no message
CONSTANT_OUTPUTS: dict[str, Callable[..., Tensor | None]] = {
    "scaled_dot_product_attention": excluded_queries,
}
