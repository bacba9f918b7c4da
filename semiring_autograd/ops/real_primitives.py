"""The formula primitives for the Real semiring, on plain tensors (messages are gradients).

The generated Real module spells ``lift`` (identity), ``mul`` (×), ``add`` (+) and the
structural primitives as tensor expressions and calls the rest from here; each mirrors its
namesake in :mod:`.primitives`, in the primal's dtype (as torch.autograd computes).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from .einsum_helpers import Contraction

Ref = tuple[torch.dtype, torch.device]


def zero(shape: Sequence[int], ref: Ref) -> Tensor:
    return torch.zeros(tuple(shape), dtype=ref[0], device=ref[1])


def sum(a: Tensor, dims: Any = None, keepdim: bool = False) -> Tensor:
    if dims is None:
        return a.sum(dim=tuple(range(a.dim())), keepdim=keepdim) if keepdim else a.sum()
    if isinstance(dims, (list, tuple)) and not dims:
        return a
    return a.sum(dim=dims, keepdim=keepdim)


def sum_to(a: Tensor, shape: Sequence[int]) -> Tensor:
    shape = tuple(shape)
    if a.shape == shape:
        return a
    return a.sum_to_size(shape) if len(shape) else a.sum()


def matmul(a: Tensor, b: Tensor) -> Tensor:
    return a @ b


def contract(a: Tensor, b: Tensor, spec: Contraction) -> Tensor:
    out = torch.einsum(f"{spec.a},{spec.b}->{spec.present}", a, b)
    if spec.present == spec.out:
        return out
    return out.reshape(spec.spread).expand(spec.size(spec.out))


def loo(a: Tensor, dim: int) -> Tensor:
    return a.sum(dim, keepdim=True) - a


def softmax_backward(a: Tensor, probs: Tensor, dim: int) -> Tensor:
    return a * (probs * (1 - probs)) + loo(a * probs, dim) * -probs


def standardize(a: Tensor, centred: Tensor, rstd: Tensor, dims: Any) -> Tensor:
    count = max(centred.numel() // max(rstd.numel(), 1), 1)
    g_s = (a * centred).sum(dims, keepdim=True)
    g_c = a * rstd + g_s * (-0.5 * rstd.pow(3)) * (2.0 * centred / count)
    return g_c - g_c.sum(dims, keepdim=True) / count


def index_add(a: Tensor, index: Tensor, size: int) -> Tensor:
    return a.new_zeros((size, *a.shape[1:])).index_add(0, index.reshape(-1), a)


def getitem_backward(a: Tensor, shape: Sequence[int], index: Any) -> Tensor:
    z = a.new_zeros(tuple(shape))
    z[index] = a
    return z


def fill_zero(
    parts: Sequence[Tensor | None], shapes: Sequence[Sequence[int]], ref: Ref
) -> list[Tensor]:
    return [zero(s, ref) if p is None else p for p, s in zip(parts, shapes)]


def cast(a: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    return a.to(device=device, dtype=dtype)
