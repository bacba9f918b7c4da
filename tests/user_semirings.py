"""A user-defined semiring for the tests: only the definition is written."""

from __future__ import annotations

import math

import torch

from semiring_autograd.semirings import Semiring


class Tropical(Semiring):
    """(min, +) over −log|w|: the cost of the cheapest path. zero = +inf, one = 0.

    Only the definition is written: sum, loo, exclusive_scan, matmul, index_add and sum_to
    are the generic defaults."""

    name = "tropical"

    def zero(self, shape, like):
        return (torch.full(tuple(shape), math.inf, dtype=like.dtype, device=like.device),)

    def one(self, shape, like):
        return (torch.zeros(tuple(shape), dtype=like.dtype, device=like.device),)

    def lift(self, w):
        return (-torch.log(w.abs()),)

    def add(self, a, b):
        return (torch.minimum(a[0], b[0]),)

    def mul(self, a, b):
        return (a[0] + b[0],)

    def readout(self, a):
        return torch.exp(-a[0])
