"""Tensor-level max-gradient: the paper's definition (Du et al., ACL 2023, as its framework
computes it), ``MaxProduct(granularity="tensor")`` and
``SignedMaxProduct(granularity="tensor")``.

Inside an op the message is the ordinary vector-Jacobian product, a real sum (a matmul's
sum over k, undoing a broadcast); the max is taken only where a tensor's messages from its
several consumers merge (:meth:`merge`). The ⊕ and ⊗ the op formulas use are therefore
those of real arithmetic, over |w| (MaxProduct) or over signed w, componentwise on the pair
(largest, smallest) (SignedMaxProduct); the engine's merge is max (and min). The signed
pair is put in order — (max, min) of its two ends, elementwise — as it enters the next op
(:meth:`settle`) and when merged or read out, as the framework does after each op.

An element-level path is not defined here: a message is a sum over many paths. A composite
op of this library (layer norm, softmax, attention) is one op: its messages are real sums
inside it, with no merge between its internal uses of an input.
"""

from __future__ import annotations

import torch

from .base import Semiring, Value
from .tensor_ops import filled


def _ordered(a: Value) -> Value:
    """(max, min) of the two ends, elementwise."""
    hi, lo = a
    return torch.maximum(hi, lo), torch.minimum(hi, lo)


class TensorMaxProduct(Semiring):
    """m(x) = max over the ops c reading x of Σ_i m(y_i) |∂y_i/∂x| (the real sum inside c).
    Readout: m at the input; 0 where nothing reaches."""

    name = "max_product_tensor"

    def __repr__(self) -> str:
        return "MaxProduct(granularity='tensor')"

    def zero(self, shape, like):
        return (filled(shape, 0.0, like),)

    def one(self, shape, like):
        return (filled(shape, 1.0, like),)

    def lift(self, w):
        return (w.abs(),)

    def add(self, a, b):
        return (a[0] + b[0],)

    def mul(self, a, b):
        return (a[0] * b[0],)

    def merge(self, a, b):
        return (torch.maximum(a[0], b[0]),)

    def readout(self, a):
        return a[0]

    def _reduce(self, a, dims, keepdim):
        return (a[0].sum(dim=dims, keepdim=keepdim),)

    def matmul(self, a, b):
        return (torch.matmul(a[0], b[0]),)

    def matmul_lift(self, a, w):
        return (torch.matmul(a[0], w.abs()),)

    def mul_lift(self, a, w):
        return (a[0] * w.abs(),)

    def index_add(self, a, index, size):
        out = a[0].new_zeros((size, *a[0].shape[1:]))
        return (out.index_add_(0, index.reshape(-1), a[0]),)


class TensorSignedMaxProduct(Semiring):
    """The pair (largest, smallest): each end's real vector-Jacobian product through an op
    (signed derivatives), put in order; at a merge, the max of the largest ends and the min
    of the smallest. Readout shape (2, *input)."""

    name = "signed_max_product_tensor"
    n_components = 2
    settles = True

    def __repr__(self) -> str:
        return "SignedMaxProduct(granularity='tensor')"

    def zero(self, shape, like):
        return (filled(shape, 0.0, like), filled(shape, 0.0, like))

    def one(self, shape, like):
        return (filled(shape, 1.0, like), filled(shape, 1.0, like))

    def lift(self, w):
        return (w, w)

    def add(self, a, b):
        return (a[0] + b[0], a[1] + b[1])

    def mul(self, a, b):
        return (a[0] * b[0], a[1] * b[1])

    def merge(self, a, b):
        (ahi, alo), (bhi, blo) = _ordered(a), _ordered(b)
        return (torch.maximum(ahi, bhi), torch.minimum(alo, blo))

    def settle(self, a):
        return _ordered(a)

    def readout(self, a):
        return torch.stack(torch.broadcast_tensors(*_ordered(a)))

    def _reduce(self, a, dims, keepdim):
        return tuple(c.sum(dim=dims, keepdim=keepdim) for c in a)

    def matmul(self, a, b):
        return (torch.matmul(a[0], b[0]), torch.matmul(a[1], b[1]))

    def matmul_lift(self, a, w):
        return (torch.matmul(a[0], w), torch.matmul(a[1], w))

    def mul_lift(self, a, w):
        return (a[0] * w, a[1] * w)

    def index_add(self, a, index, size):
        flat = index.reshape(-1)
        return tuple(
            c.new_zeros((size, *c.shape[1:])).index_add_(0, flat, c)
            for c in torch.broadcast_tensors(*a)
        )


def tensor_level_instance(cls: type, owner: type, granularity: str, tensor_cls: type):
    """For ``owner(granularity=...)`` called as ``cls(...)``: a ``tensor_cls`` instance for
    ``"tensor"``, None for ``"element"`` (``cls`` is then built as usual); a clear error for
    any other value, or for ``"tensor"`` on a subclass of ``owner``."""
    if granularity not in ("element", "tensor"):
        raise ValueError(
            f"{cls.__name__}(granularity=...): 'element' (exact paths, the default) or "
            f"'tensor' (the paper's max-gradient), got {granularity!r}"
        )
    if granularity == "element":
        return None
    if cls is not owner:
        raise ValueError(f"{cls.__name__}: granularity='tensor' is {owner.__name__}'s option")
    return tensor_cls()
