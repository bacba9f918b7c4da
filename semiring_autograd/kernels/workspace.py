"""Reused scratch tensors for weight-sized temporaries on the CPU.

A fresh CPU allocation of a few MB is mapped from the OS and faults in page by page on its
first write, so a weight-sized temporary costs several times more in fresh storage than
in reused storage (docs/performance.md has the figures). Semiring matmuls over lifted weights (Log, Counting, Entropy, Boolean) need |w|,
w ≠ 0 or a function of them as a GEMM operand for every linear layer, and the log-space
GEMM a shifted copy of the message, so they take these from here.

Each thread keeps one buffer per purpose and dtype, grown to the largest size asked for
(for the weight operands, the largest weight's size; the shifted message of the log-space
GEMM uses scratch only up to 16 MiB). A scratch tensor is valid until the same purpose is
asked for again in the same thread: callers use it within one call and never return it.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

_LOCAL = threading.local()


def scratch(purpose: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised tensor of ``shape`` for ``purpose``: reused storage on the CPU,
    a fresh tensor elsewhere (the CUDA caching allocator already reuses memory)."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    buffers = _LOCAL.__dict__.setdefault("buffers", {})
    numel = math.prod(shape)
    buffer = buffers.get((purpose, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(numel, dtype=dtype)
        buffers[purpose, dtype] = buffer
    return buffer[:numel].view(shape)


def is_scratch(t: Tensor) -> bool:
    """Whether ``t`` lies in one of this thread's scratch buffers (its storage is one)."""
    buffers = _LOCAL.__dict__.get("buffers", {})
    storage = t.untyped_storage().data_ptr()
    return any(b.untyped_storage().data_ptr() == storage for b in buffers.values())
