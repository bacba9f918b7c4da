"""Complex numbers under semiring formulas, as pairs of real nodes.

A complex element is two nodes of the gradient graph, its real and imaginary parts. A
rotary embedding written with complex numbers (Llama 4's: ``view_as_complex`` of real
pairs, a product by constant unit complex numbers, ``view_as_real``) is a real linear map
on those pairs: ``z · k`` with ``k = a + bi`` sends ``(x, y)`` to ``(a·x − b·y, b·x + a·y)``.
Under a patch with semiring formulas:

* ``view_as_complex(p)`` of real pairs ``p`` that require grad returns the complex view of
  ``p``'s values (the same memory), a leaf whose edges are kept as ``p``: every op that
  reads it is bound here or refused;
* a product of such a tensor by a tensor or number that requires no grad runs as the
  semiring einsum ``...ij,...j->...i`` of the real 2×2 matrices ``[[a, −b], [b, a]]`` with
  the pairs (its entry's formulas; its forward is the complex product itself, so the values
  are torch's bit for bit), and returns the complex view of the result, kept as it;
* ``view_as_real`` of it returns the real pairs that carry its edges.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

#: the products bound here, by the torch function the call names
PRODUCTS = frozenset(
    {torch.mul, torch.multiply, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
)
FUNCTIONS = PRODUCTS | {torch.view_as_complex, torch.view_as_real}
#: the einsum of the 2×2 real matrices with the pairs
EQUATION = "...ij,...j->...i"

NOT_BOUND = object()
"""What :meth:`ComplexPairs.call` returns for a call it does not take."""

#: runs ``torch.einsum(EQUATION, matrices, pairs)`` under its entry, with the given forward
Einsum = Callable[[Tensor, Tensor, Callable[..., Tensor], tuple], Tensor]


def _product(func: Any, pairs: Tensor, other: Any, first: bool) -> Tensor:
    """The real pairs of ``func(z, other)`` (``func(other, z)`` unless ``first``), ``z`` the
    complex view of ``pairs``: the model's complex product, computed as it computes it."""
    z = torch.view_as_complex(pairs)
    return torch.view_as_real(func(z, other) if first else func(other, z))


def _matrices(other: Any, like: Tensor) -> Tensor:
    """``[[a, −b], [b, a]]`` per element of ``other = a + bi``, in ``like``'s dtype: the real
    Jacobian of ``z ↦ z · other`` on (real, imaginary) pairs."""
    k = torch.as_tensor(other, device=like.device)
    a = (k.real if k.is_complex() else k).to(like.dtype)
    b = k.imag.to(like.dtype) if k.is_complex() else torch.zeros_like(a)
    return torch.stack([torch.stack([a, -b], -1), torch.stack([b, a], -1)], -2)


class ComplexPairs:
    """The complex tensors a patch made from real pairs, each kept with the pairs that
    carry its edges (held weakly: a tensor the model drops is forgotten)."""

    def __init__(self) -> None:
        self._pairs: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def call(self, func: Any, args: tuple, kwargs: dict, einsum: Einsum) -> Any:
        """The result of the call ``func(*args, **kwargs)`` bound here, or :data:`NOT_BOUND`
        (the caller refuses a call that reads a complex tensor and is not bound here)."""
        if func is torch.view_as_complex:
            pairs = args[0] if args else kwargs.get("input")
            if len(args) + len(kwargs) != 1 or not isinstance(pairs, Tensor):
                return NOT_BOUND
            if pairs.is_complex() or not pairs.requires_grad:
                return NOT_BOUND
            z = torch.view_as_complex(pairs.detach()).requires_grad_()
            self._pairs[z] = pairs
            return z
        if func is torch.view_as_real:
            z = args[0] if args else kwargs.get("input")
            if len(args) + len(kwargs) != 1 or not isinstance(z, Tensor):
                return NOT_BOUND
            return self._pairs.get(z, NOT_BOUND)
        if not self._pairs or kwargs or len(args) != 2:
            return NOT_BOUND
        kept = [i for i, t in enumerate(args) if isinstance(t, Tensor) and t in self._pairs]
        if len(kept) != 1:
            return NOT_BOUND
        other = args[1 - kept[0]]
        if isinstance(other, Tensor) and other.requires_grad:
            return NOT_BOUND
        if not isinstance(other, (Tensor, int, float, complex)) or isinstance(other, bool):
            return NOT_BOUND
        pairs = self._pairs[args[kept[0]]]
        out = einsum(_matrices(other, pairs), pairs, _product, (func, other, kept[0] == 0))
        z = torch.view_as_complex(out.detach()).requires_grad_()
        self._pairs[z] = out
        return z
