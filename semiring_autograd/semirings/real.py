"""The Real semiring (+, ×): the ordinary gradient."""

from __future__ import annotations

from .base import InlineForms, Semiring
from .tensor_ops import filled


class Real(Semiring):
    """(+, ×): the ordinary gradient. lift(w) = w.

    Real messages are torch's own gradients, so under ``sa.patch`` torch records its own
    graph of each op (its backward nodes and fused kernels); every call is still bound to its
    YAML entry and its node named. ``formulas=True`` runs the generated Real Functions
    instead: the YAML formulas in real arithmetic, the same gradient. That is the check that
    the formulas every semiring shares compute it.
    """

    name = "real"
    inline = InlineForms(lift="{w}", mul="{a} * {b}", add="{a} + {b}", mul_lift="{a} * {w}")
    formulas = False  # (a subclass is a user semiring: it always runs the formulas)

    def __init__(self, formulas: bool = False):
        self.formulas = bool(formulas)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({'formulas=True' if self.formulas else ''})"

    def _identity(self) -> dict:
        # `formulas` only picks how sa.patch records the graph: the semiring is the same
        return {k: v for k, v in vars(self).items() if k != "formulas"}

    def zero(self, shape, like):
        return (filled(shape, 0.0, like),)

    def one(self, shape, like):
        return (filled(shape, 1.0, like),)

    def lift(self, w):
        return (w,)

    def add(self, a, b):
        return (a[0] + b[0],)

    def mul(self, a, b):
        return (a[0] * b[0],)

    def readout(self, a):
        return a[0]

    def _reduce(self, a, dims, keepdim):
        return (a[0].sum(dim=dims, keepdim=keepdim),)

    def loo(self, a, dim):
        return (a[0].sum(dim, keepdim=True) - a[0],)

    def matmul(self, a, b):
        return (a[0] @ b[0],)

    def index_add(self, a, index, size):
        out = a[0].new_zeros((size, *a[0].shape[1:]))
        return (out.index_add(0, index.reshape(-1), a[0]),)
