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
:func:`ones` keeps a read-only ones buffer the same way, for backward kernels that take an
upstream gradient.
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


def outside_tracing(t: Tensor) -> bool:
    """Whether a tensor built from ``t`` may be kept and served to later calls: ``t`` is not
    batched by ``torch.vmap`` nor functionalized, and no dispatch mode (a tracer, the compiled
    recorder) and no compilation is running, where a kept tensor would become a traced or
    recorded constant."""
    return not (
        torch._C._functorch.is_batchedtensor(t)
        or torch._C._functorch.is_functionaltensor(t)
        or torch._C._len_torch_dispatch_stack() != 0
        or torch.compiler.is_compiling()
    )


#: the largest ones operand :func:`ones` keeps: 16 MiB
_ONES_BYTES = 16 << 20


def ones(x: Tensor) -> Tensor | None:
    """Dense ones shaped like ``x`` for a backward kernel's unit upstream gradient: a view of
    one buffer per dtype and thread, filled once and grown to the largest size asked for
    (callers never write it). For a plain CPU tensor of at most 16 MiB outside
    ``torch.func`` transforms, dispatch modes and compilation; None otherwise. Torch's GELU
    backward kernel reads it 1.5–2.5× faster than a broadcast of one element."""
    if (
        type(x) is not Tensor
        or not x.is_cpu
        or x.element_size() * x.numel() > _ONES_BYTES
        or not outside_tracing(x)
    ):
        return None
    kept = _LOCAL.__dict__.setdefault("ones", {})
    numel = x.numel()
    buffer = kept.get(x.dtype)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # kept for later calls, in any mode
            buffer = torch.ones(numel, dtype=x.dtype)
        kept[x.dtype] = buffer
    return buffer[:numel].view(x.shape)
