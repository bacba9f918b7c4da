"""The Real semiring's fast path for ops marked ``real_backward: native`` in the YAML.

For Real, a backward message is the ordinary gradient, whatever an entry's granularity: a
composition's internal paths sum to the op's own Jacobian. So the Real Function of such an
op (attention, layer norm, GELU, ...) records torch's own graph of the op in its forward,
on detached copies of its inputs, and its backward runs that graph: torch's fused backward
kernels instead of the formula's composition, with the same result.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor


class Native:
    """torch's graph of one op call: the output and, per Function argument, the detached
    leaf standing in for it (None where the argument is no tensor or needs no gradient,
    and at repeated arguments after the first: their gradient is the same tensor's)."""

    __slots__ = ("output", "leaves")

    def __init__(self, output: Tensor, leaves: list[Tensor | None]):
        self.output = output
        self.leaves = leaves


def native_forward(call: Any, args: Sequence[Any], needs: Sequence[bool]) -> tuple[Tensor, Native]:
    """Run the unpatched ``call`` with grad enabled on detached copies of the tensors in
    ``args`` that need a gradient; returns (the output, detached from that graph; the graph)."""
    replace: dict[int, Tensor] = {}
    leaves: list[Tensor | None] = []
    for value, need in zip(args, needs):
        if not (need and isinstance(value, Tensor)) or id(value) in replace:
            leaves.append(None)
            continue
        leaf = value.detach().requires_grad_()
        replace[id(value)] = leaf
        leaves.append(leaf)
    with torch.enable_grad():
        output = call.substituted(replace)
    if not isinstance(output, Tensor):
        raise TypeError(
            f"real_backward: native needs an op with one tensor output, got {type(output)}"
        )
    return output.detach(), Native(output, leaves)


def native_backward(native: Native, grad: Tensor, needs: Sequence[bool]) -> tuple:
    """The gradients of the recorded call's arguments (None where ``needs`` is false)."""
    wanted = [i for i, leaf in enumerate(native.leaves) if leaf is not None and needs[i]]
    result: list[Tensor | None] = [None] * len(native.leaves)
    if not wanted or not native.output.requires_grad:
        return tuple(result)
    keep = torch._C._autograd._get_current_graph_task_keep_graph()
    grads = torch.autograd.grad(
        native.output,
        [native.leaves[i] for i in wanted],
        grad,
        retain_graph=keep,
        allow_unused=True,
    )
    for i, g in zip(wanted, grads):
        result[i] = g
    return tuple(result)
