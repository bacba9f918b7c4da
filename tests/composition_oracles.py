"""Path-enumeration oracles of the composition entries (layer norm, attention).

Each builds the composition its YAML entry states as a :class:`oracle.Program` of elementary
ops and enumerates every path, so the internal steps are nodes of the gradient graph exactly
as the entry says. Inputs are named; ``None`` inputs are left out. Each returns, per given
input name, the semiring value at that input.
"""

from __future__ import annotations

import torch
from oracle import Program
from torch import Tensor

from semiring_autograd.semirings import Semiring, Value


def _standardize(p: Program, source: str, dims, eps: float) -> None:
    """n = c·s of μ = mean(x); c = x − μ; v = mean(c²); s = (v + eps)^(−1/2) over ``dims``."""
    p.op("mu", lambda x: x.mean(dims, keepdim=True), source)
    p.op("c", torch.sub, source, "mu")
    p.op("v", lambda c: (c * c).mean(dims, keepdim=True), "c")
    p.op("s", lambda v: (v + eps).pow(-0.5), "v")
    p.op("n", torch.mul, "c", "s")


def _affine(p: Program, source: str, w: Tensor | None, b: Tensor | None, shape) -> None:
    """y = n·w + b with w, b viewed as ``shape`` (one op, as the entries state)."""
    if w is not None and b is not None:
        p.op("y", lambda n, w, b: n * w.reshape(shape) + b.reshape(shape), source, "w", "b")
    elif w is not None:
        p.op("y", lambda n, w: n * w.reshape(shape), source, "w")
    elif b is not None:
        p.op("y", lambda n, b: n + b.reshape(shape), source, "b")
    else:
        p.op("y", torch.clone, source)


def normalization_paths(
    S: Semiring,
    seed: Tensor | None,
    x: Tensor,
    dims,
    w: Tensor | None = None,
    b: Tensor | None = None,
    eps: float = 1e-5,
    groups: int | None = None,
    param_shape=None,
) -> dict[str, Value]:
    """Normalisation over ``dims`` (of x viewed as (N, groups, −1) when ``groups``), then
    the affine map with w, b viewed as ``param_shape``:
    μ = mean(x); c = x − μ; v = mean(c²); s = (v + eps)^(−1/2); n = c·s; y = n·w + b."""
    given = {k: t for k, t in dict(x=x, w=w, b=b).items() if t is not None}
    p = Program(**given)
    if groups is None:
        _standardize(p, "x", dims, eps)
        _affine(p, "n", w, b, param_shape)
    else:
        p.op("grouped", lambda x: x.reshape(x.shape[0], groups, x[0].numel() // groups), "x")
        _standardize(p, "grouped", -1, eps)
        p.op("ungrouped", lambda n: n.reshape(x.shape), "n")
        _affine(p, "ungrouped", w, b, param_shape)
    return dict(zip(given, p.path_sum(S, "y", seed, list(given))))


def layer_norm_paths(
    S: Semiring,
    seed: Tensor | None,
    x: Tensor,
    normalized_shape: tuple[int, ...],
    w: Tensor | None = None,
    b: Tensor | None = None,
    eps: float = 1e-5,
) -> dict[str, Value]:
    """μ = mean(x); c = x − μ; v = mean(c²); s = (v + eps)^(−1/2); n = c·s; y = n·w + b."""
    dims = tuple(range(-len(normalized_shape), 0))
    return normalization_paths(S, seed, x, dims, w, b, eps, param_shape=tuple(normalized_shape))


def channel_norm_paths(
    S: Semiring,
    seed: Tensor | None,
    x: Tensor,
    kind: str,
    w: Tensor | None = None,
    b: Tensor | None = None,
    eps: float = 1e-5,
    groups: int | None = None,
) -> dict[str, Value]:
    """Batch norm with batch statistics (``kind`` "batch": over every dim but the channel),
    instance norm ("instance": over the spatial dims) or group norm ("group"), w and b per
    channel."""
    channel = tuple(s if i == 1 else 1 for i, s in enumerate(x.shape))
    if kind == "group":
        return normalization_paths(S, seed, x, None, w, b, eps, groups, channel)
    dims = (
        tuple(d for d in range(x.dim()) if d != 1) if kind == "batch" else tuple(range(2, x.dim()))
    )
    return normalization_paths(S, seed, x, dims, w, b, eps, param_shape=channel)


def rms_norm_paths(
    S: Semiring,
    seed: Tensor | None,
    x: Tensor,
    normalized_shape: tuple[int, ...],
    w: Tensor | None = None,
    eps: float | None = None,
) -> dict[str, Value]:
    """m = mean(x²); s = (m + eps)^(−1/2); n = x·s; y = n·w."""
    dims = tuple(range(-len(normalized_shape), 0))
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    given = {k: t for k, t in dict(x=x, w=w).items() if t is not None}
    p = Program(**given)
    p.op("m", lambda x: (x * x).mean(dims, keepdim=True), "x")
    p.op("s", lambda m: (m + eps).pow(-0.5), "m")
    p.op("n", torch.mul, "x", "s")
    if w is not None:
        p.op("y", torch.mul, "n", "w")
    else:
        p.op("y", torch.clone, "n")
    return dict(zip(given, p.path_sum(S, "y", seed, list(given))))


def weight_norm_paths(
    S: Semiring, seed: Tensor | None, v: Tensor, g: Tensor, dim: int
) -> dict[str, Value]:
    """n = ‖v‖ over every dim but ``dim`` (all for −1); s = g / n; w = v·s."""
    dims = (
        tuple(range(v.dim()))
        if dim == -1
        else tuple(d for d in range(v.dim()) if d != dim % v.dim())
    )
    p = Program(v=v, g=g)
    p.op("n", lambda v: torch.linalg.vector_norm(v, 2, dims, True), "v")
    p.op("s", torch.div, "g", "n")
    p.op("w", torch.mul, "v", "s")
    return dict(zip(("v", "g"), p.path_sum(S, "w", seed, ["v", "g"])))


def attention_paths(
    S: Semiring,
    seed: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> dict[str, Value]:
    """(For GQA, key/value heads copied to their query heads); s = q·kᵀ·scale + mask;
    p = softmax(s) over keys; o = p·v. A boolean mask and ``is_causal`` exclude positions;
    a float mask is added (an input of the graph)."""
    scale = 1.0 / q.shape[-1] ** 0.5 if scale is None else scale
    groups = q.shape[-3] // k.shape[-3] if enable_gqa else 1
    float_mask = attn_mask is not None and attn_mask.dtype != torch.bool
    given = dict(q=q, k=k, v=v, **({"m": attn_mask} if float_mask else {}))
    p = Program(**given)
    p.op("kr", lambda k: k.repeat_interleave(groups, -3), "k")
    p.op("vr", lambda v: v.repeat_interleave(groups, -3), "v")
    length, source = q.shape[-2], k.shape[-2]
    excluded = torch.zeros(length, source, dtype=torch.bool)
    if is_causal:
        excluded |= ~torch.ones(length, source, dtype=torch.bool).tril()
    if attn_mask is not None and not float_mask:
        excluded = excluded | ~attn_mask

    def scores(q: Tensor, kr: Tensor, *m: Tensor) -> Tensor:
        s = (q @ kr.mT) * scale + (m[0] if m else 0.0)
        return s.masked_fill(excluded, float("-inf"))

    p.op("s", scores, "q", "kr", *(["m"] if float_mask else []))
    p.op("p", lambda s: torch.softmax(s, -1), "s")
    p.op("o", torch.matmul, "p", "vr")
    return dict(zip(given, p.path_sum(S, "o", seed, list(given))))
