"""The k-best semiring: the k largest path weights (products of |w|) per element.

A value is k components w_1 ≥ w_2 ≥ … ≥ w_k ≥ 0: the k largest weights among the paths
that reach an element, 0 where fewer than k paths do (a path of weight 0 is no path).
⊕ merges two lists and keeps the k largest; ⊗ forms the k² products and keeps the k
largest; lift(w) = (|w|, 0, …, 0). With k = 1 it is MaxProduct. Paths are counted with
their multiplicity: two distinct paths of equal weight are two entries.
"""

from __future__ import annotations

import math
import torch
from torch import Tensor

from .. import kernels
from .base import Semiring, Value, broadcast_shape, broadcast_value, keeps_algebra, message_dtype
from .batching import across_rows
from .tensor_ops import CHUNK_ELEMENTS, filled, folded_middle


def _stacked(a: Value) -> Tensor:
    """The components of ``a`` stacked along a new last dim (best first)."""
    shape = a[0].shape
    if any(c.shape != shape for c in a[1:]):
        a = broadcast_value(a)
    return torch.stack(a, -1)


def _best(lists: Tensor, k: int) -> Value:
    """The k largest entries of the last dim of ``lists``, best first, as components
    (0 where it holds fewer than k)."""
    n = lists.shape[-1]
    if n < k:
        pad = lists.new_zeros((*lists.shape[:-1], k - n))
        lists = torch.cat([lists, pad], -1)
    top = lists.topk(k, dim=-1, sorted=True).values if lists.shape[-1] > k else lists
    return tuple(top.unbind(-1))


def _fused_matmul(a: Value, b: Value, k: int, abs_b: bool, dead_count: bool) -> Value | None:
    """The k best of a[..., i, l, r] · b[..., l, j, s] over (l, r, s) from the fused kernel
    (``kernels.k_best_times``; |b| when ``abs_b``; b's entries at an index l where no row
    of a has a path are ignored unless ``dead_count``), else None (kernel unavailable, an
    operand not finite: the torch formulas then run)."""
    if a[0].dim() < 2 or b[0].dim() < 2 or a[0].device.type != "cpu":
        return None  # the kernel is the CPU's
    a, b = broadcast_value(a), broadcast_value(b)
    (m, l), n = a[0].shape[-2:], b[0].shape[-1]
    if b[0].shape[-2] != l:
        return None
    batch = broadcast_shape(a[0].shape[:-2], b[0].shape[:-2])
    a3 = [_batched(c, batch) for c in a]
    if math.prod(b[0].shape[:-2]) > 1:
        b3 = [_batched(c, batch) for c in b]
    else:  # one b for every batch entry (a weight, read in place)
        b3 = [c.reshape(1, l, n) for c in b]
    out = kernels.k_best_times(a3, b3, k, abs_b=abs_b, dead_count=dead_count)
    if out is None:
        return None
    return tuple(c.reshape(*batch, m, n) for c in out.unbind(0))


def _batched(c: Tensor, batch: tuple[int, ...]) -> Tensor:
    """A component (*batch dims, rows, cols) broadcast to ``batch`` and flattened to
    (count, rows, cols): a view where no batch dim is broadcast."""
    rows, cols = c.shape[-2:]
    return c.expand(*batch, rows, cols).reshape(math.prod(batch), rows, cols)


class KBest(Semiring):
    """The k largest path weights (products of |local derivative|) per element, best first.

    ``sa.grad`` reads out shape (k, *input): row r is the (r+1)-th best path weight, 0 where
    fewer than r+1 paths reach the element. Exact at element level, like MaxProduct (which
    is row 0)."""

    name = "k_best"

    def __init__(self, k: int = 3):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"KBest(k): k is a positive int, got {k!r}")
        self.k = k
        self.n_components = k

    def __repr__(self) -> str:
        return f"KBest({self.k})"

    def _identity(self) -> dict:
        return {"k": self.k}

    def zero(self, shape, like):
        return tuple(filled(shape, 0.0, like) for _ in range(self.k))

    def one(self, shape, like):
        return (filled(shape, 1.0, like),) + tuple(
            filled(shape, 0.0, like) for _ in range(self.k - 1)
        )

    def lift(self, w):
        first = w.abs()
        return (first,) + tuple(torch.zeros_like(first) for _ in range(self.k - 1))

    def add(self, a, b):
        if len(a) == self.k:
            merged = kernels.k_best_add(a, b)  # the two lists merged in one pass (CPU)
            if merged is not None:
                return tuple(merged.unbind(0))
        return _best(_stacked((*a, *b)), self.k)  # one stack of both lists, then top-k

    def mul(self, a, b):
        return _best((_stacked(a)[..., :, None] * _stacked(b)[..., None, :]).flatten(-2), self.k)

    def mul_lift(self, a, w):
        w = w.abs()
        return tuple(c * w for c in a)  # |w| ≥ 0 keeps the order

    def softmax_backward(self, a, probs, dim):
        """The default's paths along the last dim in one kernel call per tensor on the CPU
        (``kernels.k_best_softmax_backward``: the same products and selections, its values
        to the bit), for a KBest that keeps KBest's algebra and probabilities in message
        precision; else the default."""
        last = dim in (-1, probs.dim() - 1)
        if last and len(a) == self.k and message_dtype(probs.dtype) == probs.dtype:
            if keeps_algebra(type(self), KBest) and type(self).loo is KBest.loo:
                fused = kernels.k_best_softmax_backward(a, probs)
                if fused is not None:
                    return tuple(fused.unbind(0))
        return super().softmax_backward(a, probs, dim)

    def loo(self, a, dim):
        """out_i = the k best entries of the lists a_j, j ≠ i, along ``dim``: they are among
        the 2k best entries of all the lists, of which at most k are a_i's own. One top-2k
        over all entries, a_i's own masked per i, one top-k: a selection of entries, so
        the values are the prefix and suffix scans' to the bit, in a fixed number of ops.
        On the CPU one operator does it per row of lists (``kernels.k_best_loo``)."""
        a = broadcast_value(a)
        dim, k = dim % a[0].dim(), self.k
        if len(a) == k:
            fused = kernels.k_best_loo(tuple(c.movedim(dim, -1) for c in a))
            if fused is not None:
                return tuple(c.movedim(-1, dim) for c in fused.unbind(0))
        lists = _stacked(a).movedim(dim, -2)  # (..., n, k)
        n = lists.shape[-2]
        entries = lists.flatten(-2)  # entry e comes from list e // k
        if n < 2:  # zeros (no path) as entries of no list make 2k
            pad = entries.new_zeros((*entries.shape[:-1], (2 - n) * k))
            entries = torch.cat([entries, pad], -1)
        best = entries.topk(2 * k, dim=-1)
        own = best.indices[..., None, :] // k == torch.arange(n, device=lists.device)[:, None]
        others = best.values[..., None, :].masked_fill(own, -math.inf)  # (..., n, 2k)
        out = others.topk(k, dim=-1).values.movedim(-2, dim)
        return tuple(out.unbind(-1))

    def readout(self, a):
        return torch.stack(broadcast_value(a), 0)

    def _reduce(self, a, dims, keepdim):
        folded = folded_middle(self, a, dims, keepdim)  # a few slices: k_best_add each
        if folded is not None:
            return folded
        lists = _stacked(a)
        rest = [d for d in range(lists.dim() - 1) if d not in dims]
        moved = lists.permute(*rest, *dims, lists.dim() - 1)
        merged = _best(moved.flatten(len(rest)), self.k)
        if keepdim:
            shape = [1 if d in dims else n for d, n in enumerate(lists.shape[:-1])]
            merged = tuple(c.reshape(shape) for c in merged)
        return merged

    def matmul(self, a, b):
        fused = _fused_matmul(a, b, self.k, abs_b=False, dead_count=True)
        return fused if fused is not None else self._contract(_stacked(a), _stacked(b))

    def matmul_lift(self, a, w):
        fused = _fused_matmul(a, (w,), self.k, abs_b=True, dead_count=False)
        return fused if fused is not None else self._contract_lift(_stacked(a), w.abs())

    def _contract_lift(self, a: Tensor, w: Tensor) -> Value:
        """out[..., i, j] = the k best of a[..., i, l, r] · w[..., l, j] over (l, r), for
        lists a (…, m, l, ka) and weights w ≥ 0 (…, l, n). Only the k indices l of largest
        a[i, l, 0] · w[l, j] can contribute (any other l's terms are each below those k
        first terms), so the k best are taken over those k lists; indices l where no row of
        a has a path are dropped first."""
        (m, l, ka), n = a.shape[-3:], w.shape[-1]
        batch = torch.broadcast_shapes(a.shape[:-3], w.shape[:-2])
        count = math.prod(batch)
        a4 = a.expand(*batch, m, l, ka).reshape(count, m, l, ka)
        w3 = w.expand(*batch, l, n).reshape(count, l, n)
        # under torch.vmap: the indices with a path in some seed row
        live = across_rows((a4[..., 0] != 0).any(1).any(0))
        if not bool(live.all()):
            a4, w3 = a4[:, :, live], w3[:, live]
            l = a4.shape[2]
        if m == 0 or n == 0 or l == 0:
            return self.zero((*batch, m, n), a)
        keep = min(self.k, l)
        rows = max(1, CHUNK_ELEMENTS // max(1, count * l * n))
        pieces = []
        for s in range(0, m, rows):
            block = a4[:, s : s + rows]  # (B, r, l, ka)
            firsts = block[..., 0, None] * w3[:, None]  # (B, r, l, n)
            chosen = firsts.topk(keep, dim=2).indices  # (B, r, keep, n)
            r = block.shape[1]
            lists = block.gather(2, chosen.reshape(count, r, keep * n, 1).expand(-1, -1, -1, ka))
            weights = w3[:, None].expand(count, r, l, n).gather(2, chosen)
            terms = lists.reshape(count, r, keep, n, ka) * weights[..., None]
            pieces.append(_best(terms.permute(0, 1, 3, 2, 4).flatten(3), self.k))
        return tuple(torch.cat(parts, 1).reshape(*batch, m, n) for parts in zip(*pieces))

    def _contract(self, a: Tensor, b: Tensor) -> Value:
        """out[..., i, j] = the k best of a[..., i, l, r] · b[..., l, j, s] over (l, r, s):
        a (…, m, l, ka) and b (…, l, n, kb) hold lists of non-negative weights; in row
        blocks so m·l·n·ka·kb products are never held at once."""
        (m, l, ka), (n, kb) = a.shape[-3:], b.shape[-2:]
        batch = torch.broadcast_shapes(a.shape[:-3], b.shape[:-3])
        count = math.prod(batch)
        if m == 0 or n == 0 or l == 0:
            return self.zero((*batch, m, n), a)
        a4 = a.expand(*batch, m, l, ka).reshape(count, m, l, ka)
        b4 = b.expand(*batch, l, n, kb).reshape(count, l, n, kb)
        rows = max(1, CHUNK_ELEMENTS // max(1, count * l * n * ka * kb))
        pieces = []
        for s in range(0, m, rows):
            terms = a4[:, s : s + rows, :, None, :, None] * b4[:, None, :, :, None, :]
            lists = terms.permute(0, 1, 3, 2, 4, 5).flatten(3)
            pieces.append(_best(lists, self.k))
        return tuple(torch.cat(parts, 1).reshape(*batch, m, n) for parts in zip(*pieces))

    def index_add(self, a, index, size):
        """⊕-scatter of rows: each target's k best among the entries of the lists sent to
        it. The entries are sorted by weight, then stably by target, and each target keeps
        its first k (O(E log E) for E entries; no dense one-hot)."""
        lists = _stacked(a)  # (rows, *trail, k)
        trail = lists.shape[1:-1]
        cols = math.prod(trail)
        values = lists.reshape(-1)
        index = index.reshape(-1).to(lists.device)
        column = torch.arange(cols, device=lists.device)
        target = (index[:, None, None] * cols + column[None, :, None]).expand(
            index.numel(), cols, self.k
        )
        target = target.reshape(-1)
        by_value = torch.argsort(values, descending=True, stable=True)
        order = by_value[torch.argsort(target[by_value], stable=True)]
        target, values = target[order], values[order]
        counts = torch.bincount(target, minlength=size * cols)
        rank = (
            torch.arange(target.numel(), device=lists.device) - (counts.cumsum(0) - counts)[target]
        )
        kept = rank < self.k
        out = lists.new_zeros((size * cols, self.k))
        out[target[kept], rank[kept]] = values[kept]
        return tuple(out.reshape(size, *trail, self.k).unbind(-1))
