"""Forward computations that must expose more than the op's output (e.g. a dropout mask).

Each helper returns ``(output, aux)``; ``aux`` is non-differentiable and formulas read it.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F


def dropout_with_noise(
    input: Tensor, p: float, training: bool, inplace: bool
) -> tuple[Tensor, Tensor]:
    """Training-mode dropout drawing its mask exactly as ``torch.nn.functional.dropout`` does
    (so the same seed gives the same output): noise ~ Bernoulli(1-p) / (1-p),
    output = input · noise, always out of place. Returns (output, noise). With ``inplace``
    the mask is drawn as the in-place call draws it (on CUDA torch's out-of-place dropout
    runs a fused kernel with its own draw, the in-place one does not); the patch runs an
    ``inplace=True`` call on a copy of the input and writes the output back."""
    if input.is_cuda and not inplace and 0 < p < 1 and input.numel() > 0:
        out, mask = torch.native_dropout(input, p, True)
        return out, mask.to(input.dtype) / (1 - p)
    if p == 1:
        noise = torch.zeros_like(input)
        return input * noise, noise
    noise = torch.empty_like(input).bernoulli_(1 - p)
    noise.div_(1 - p)
    return input * noise, noise


def _feature_dropout_with_noise(dropout):
    """A forward helper for a training-mode channel dropout (``F.dropout1d``/``2d``/``3d``):
    the function itself run on ones draws the mask as it draws it on the input (the noise
    shape comes from the input's shape), and gives the noise, one value per channel,
    broadcast; output = input · noise is the product torch computes, element by element."""

    def forward(input: Tensor, p: float, training: bool, inplace: bool) -> tuple[Tensor, Tensor]:
        noise = dropout(torch.ones_like(input), p, training)
        return input * noise, noise

    forward.__name__ = f"{dropout.__name__}_with_noise"
    forward.__doc__ = (
        f"Training-mode ``F.{dropout.__name__}`` and its noise (mask/(1-p) per channel, "
        "broadcast to the input's shape), drawn as torch draws it. Returns (output, noise)."
    )
    return forward


dropout1d_with_noise = _feature_dropout_with_noise(F.dropout1d)
dropout2d_with_noise = _feature_dropout_with_noise(F.dropout2d)
dropout3d_with_noise = _feature_dropout_with_noise(F.dropout3d)


def _pool_with_indices(pool):
    """A forward helper for a max-pooling function whose ``return_indices=True`` form also
    returns the indices torch selects (flat within each plane)."""

    def forward(input: Tensor, *args) -> tuple[Tensor, Tensor]:
        return pool(input, *args[:-1], return_indices=True)

    forward.__name__ = f"{pool.__name__}_with_indices"
    forward.__doc__ = (
        f"``F.{pool.__name__}`` and the indices of the elements it selects (the first of "
        "tied maxima, as torch routes the gradient). Returns (output, indices)."
    )
    return forward


max_pool1d_with_indices = _pool_with_indices(F.max_pool1d)
max_pool2d_with_indices = _pool_with_indices(F.max_pool2d)
max_pool3d_with_indices = _pool_with_indices(F.max_pool3d)
adaptive_max_pool1d_with_indices = _pool_with_indices(F.adaptive_max_pool1d)
adaptive_max_pool2d_with_indices = _pool_with_indices(F.adaptive_max_pool2d)
adaptive_max_pool3d_with_indices = _pool_with_indices(F.adaptive_max_pool3d)


def topk(input: Tensor, k: int, dim: int, largest: bool, sorted: bool) -> tuple[Tensor, Tensor]:
    """``torch.topk``: (values, indices)."""
    return tuple(torch.topk(input, k, dim, largest, sorted))


def sort(input: Tensor, dim: int, descending: bool, stable: bool) -> tuple[Tensor, Tensor]:
    """``torch.sort``: (values, indices)."""
    return tuple(torch.sort(input, dim=dim, descending=descending, stable=bool(stable)))


def max_dim(input: Tensor, dim: int, keepdim: bool) -> tuple[Tensor, Tensor]:
    """``torch.max(input, dim)``: (values, indices of the first maximum)."""
    return tuple(torch.max(input, dim, keepdim))


def min_dim(input: Tensor, dim: int, keepdim: bool) -> tuple[Tensor, Tensor]:
    """``torch.min(input, dim)``: (values, indices of the first minimum)."""
    return tuple(torch.min(input, dim, keepdim))


def kthvalue(input: Tensor, k: int, dim: int, keepdim: bool) -> tuple[Tensor, Tensor]:
    """``torch.kthvalue``: (values, indices)."""
    return tuple(torch.kthvalue(input, k, dim, keepdim))
