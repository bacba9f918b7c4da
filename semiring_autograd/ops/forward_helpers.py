"""Forward computations that must expose more than the op's output (e.g. a dropout mask).

Each helper returns ``(output, aux)``; ``aux`` is non-differentiable and formulas read it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def dropout_with_noise(
    input: Tensor, p: float, training: bool, inplace: bool
) -> tuple[Tensor, Tensor]:
    """Training-mode dropout drawing its mask exactly as ``torch.nn.functional.dropout`` does
    (so the same seed gives the same output): noise ~ Bernoulli(1-p) / (1-p),
    output = input · noise. Returns (output, noise)."""
    if input.is_cuda and 0 < p < 1 and input.numel() > 0:
        out, mask = torch.native_dropout(input, p, True)
        return out, mask.to(input.dtype) / (1 - p)
    if p == 1:
        noise = torch.zeros_like(input)
        return input * noise, noise
    noise = torch.empty_like(input).bernoulli_(1 - p)
    noise.div_(1 - p)
    return input * noise, noise
