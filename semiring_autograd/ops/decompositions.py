"""The compositions that define composite ops, written with elementary torch ops.

An op whose YAML granularity is a composition (``layer_norm``, ``scaled_dot_product_attention``)
has one semiring formula for the whole op; its internal nodes are nodes of the gradient graph
but not tensors of the recorded graph. To name a path through them, :mod:`paths` re-runs the
op as this composition (each step an op with its own formula) on the recorded inputs. Each
function takes the torch function's own arguments.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .shape_helpers import attention_scale
from .tensor_helpers import mask_scores


def layer_norm(
    input: Tensor,
    normalized_shape,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """μ = mean(x); c = x − μ; v = mean(c²); s = (v + eps)^(−1/2); n = c·s; y = n·w + b
    (c² is one edge of weight 2c per element, as the YAML formula states, not c·c's two)."""
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    mu = input.mean(dims, keepdim=True)
    c = input - mu
    v = c.pow(2).mean(dims, keepdim=True)
    s = torch.rsqrt(v + eps)
    y = c * s
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


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
    enable_gqa, key and value heads are first copied to the query heads of their group."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = (_repeat_heads(t, groups) for t in (key, value))
    factor = attention_scale(query.shape, scale)
    s = mask_scores((query @ key.transpose(-2, -1)) * factor, attn_mask, is_causal)
    return s.softmax(-1) @ value


def _repeat_heads(x: Tensor, groups: int) -> Tensor:
    """(…, h, n, d) → (…, h·groups, n, d), each head repeated ``groups`` times in place."""
    shape = x.shape
    expanded = x.unsqueeze(-3).expand(*shape[:-2], groups, *shape[-2:])
    return expanded.reshape(*shape[:-3], shape[-3] * groups, *shape[-2:])


DECOMPOSITIONS: dict[str, Callable[..., Tensor]] = {
    "layer_norm": layer_norm,
    "scaled_dot_product_attention": scaled_dot_product_attention,
}
