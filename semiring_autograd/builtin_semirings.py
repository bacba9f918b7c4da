"""The built-in semirings: Real, MaxProduct, SignedMaxProduct, Log, Counting, Entropy, Boolean.

Each overrides the generic primitives of :class:`Semiring` with vectorised equivalents
(``amax``, ``logsumexp``, scatter-reductions, shift-and-GEMM) that compute the same values.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from . import kernels
from .workspace import scratch
from .semiring import Semiring, Value, message_dtype

NEG_INF = float("-inf")
POS_INF = float("inf")

# Elements of a broadcast product (rows × k × n) an eager max-times matmul holds at once.
_CHUNK_ELEMENTS = 1 << 22
# The largest shifted message operand of a log-space GEMM kept in scratch storage.
_MESSAGE_SCRATCH_BYTES = 16 << 20


def _full(shape: Sequence[int], value: float, like: Tensor) -> Tensor:
    return torch.full(tuple(shape), value, dtype=message_dtype(like.dtype), device=like.device)


def _loo_max(x: Tensor, dim: int, empty: float) -> Tensor:
    """max over all j ≠ i along ``dim`` (``empty`` where there is no other element)."""
    if x.shape[dim] <= 1:
        return torch.full_like(x, empty)
    first, second, at = _top_two(x, dim)
    return first.expand_as(x).contiguous().scatter_(dim, at, second)


def _top_two(x: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """The largest and second largest entries along ``dim`` (size ≥ 2) and the position of
    the largest, each with ``dim`` kept as size 1. A max and a max of the rest: half the
    time of ``topk(2)``."""
    first, at = x.max(dim=dim, keepdim=True)
    second = x.scatter(dim, at, NEG_INF).amax(dim=dim, keepdim=True)
    return first, second, at


def _scatter_extreme(x: Tensor, index: Tensor, size: int, reduce: str, empty: float) -> Tensor:
    """Rows of ``x`` reduced (amax/amin) into ``size`` rows by ``index`` (empty rows = empty)."""
    out = x.new_full((size, *x.shape[1:]), empty)
    idx = index.reshape(-1, *([1] * (x.dim() - 1))).expand_as(x)
    return out.scatter_reduce(0, idx, x, reduce=reduce, include_self=True)


def _batch_flatten(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, tuple[int, ...]]:
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    count = math.prod(batch)
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(count, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(count, *b.shape[-2:])
    return a3, b3, tuple(batch)


def _finite_max(x: Tensor, dim: int) -> Tensor:
    """amax with keepdim, replacing an all -inf slice's max by 0 (a harmless shift)."""
    m = x.amax(dim=dim, keepdim=True)
    return m.masked_fill(~torch.isfinite(m), 0.0)


def _safe_weight(x: Tensor, total: Tensor) -> Tensor:
    """exp(x - total), 0 where total is -inf (then x is -inf too): the -inf - -inf = NaN
    there becomes 0 (arithmetic only; a masked fill is several times slower on CPU)."""
    return torch.sub(x, total).exp_().nan_to_num_(nan=0.0, posinf=POS_INF)


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """num / den where den > 0, else 0 (a sum without terms), in place on a fresh ``num``
    where the kernel runs; a NaN in num stays where den > 0."""
    if kernels.ratio_where_positive(num, den):
        return num
    return torch.where(den > 0, num / den.masked_fill(den <= 0, 1.0), 0.0)


def _nonzero_operand(w: Tensor, dtype: torch.dtype) -> Tensor:
    """w ≠ 0 as 0/1 in ``dtype``, a GEMM operand (Counting, Boolean), in scratch storage
    (valid for the calling matmul only)."""
    nonzero = torch.ne(w, 0, out=scratch("nonzero", w.shape, torch.bool, w.device))
    return scratch("linear_lift", w.shape, dtype, w.device).copy_(nonzero)


def _flat(x: Tensor, batch: tuple[int, ...]) -> Tensor:
    """``x`` broadcast to ``batch`` and flattened to (count, rows, cols)."""
    return x.expand(*batch, *x.shape[-2:]).reshape(math.prod(batch), *x.shape[-2:])


def _on_live_rows(
    parts: tuple[Tensor, ...],
    live_of,
    w: Tensor,
    fn,
    empty: tuple[float, ...],
    dtype: torch.dtype | None = None,
) -> Value | None:
    """``fn(parts, w)`` (a matmul by a 2-D ``w``) on the rows of ``parts`` (…, m, k) where
    ``live_of(parts, -1)`` (…, m) holds only, the other rows' results set to ``empty``:
    rows without a term (where no path reaches, e.g. every token but the read-out one in a
    last layer) cost nothing. Among those rows, the k columns without a term in any of them
    are dropped too, with their rows of ``w`` (a read-out of one logit reaches one row of an
    lm_head's weight). Such a row's result is the semiring zero whatever w holds (the zero
    annihilates: 0 ⊗ x = 0), and a dropped column adds nothing, where IEEE arithmetic would
    give NaN for an inf or NaN weight; such a weight still shows in every live row it
    reaches (when every row is live no column is dropped, and IEEE arithmetic on such a
    weight in a column without a term still gives NaN). Without a live row the result's
    dtype is ``dtype``, by default that of ``parts`` and ``w`` promoted. None when every
    row is live, k is 0 or ``w`` is batched (the caller then computes all rows)."""
    if w.dim() != 2 or parts[0].shape[-1] == 0:
        return None
    live = live_of(parts, -1)
    if bool(live.all()):
        return None
    parts = torch.broadcast_tensors(*parts)
    live = live.expand(parts[0].shape[:-1])
    k, n = parts[0].shape[-1], w.shape[-1]
    flat = [p.reshape(-1, k) for p in parts]
    rows = live.reshape(-1).nonzero().squeeze(1)
    results = None
    if rows.numel():
        picked = tuple(p[rows] for p in flat)
        columns = live_of(picked, -2)
        if not bool(columns.all()):
            kept = columns.nonzero().squeeze(1)
            picked, w = tuple(p[:, kept] for p in picked), w[kept]
        results = fn(tuple(p[None] for p in picked), w)
    if results:
        dtype = results[0].dtype
    elif dtype is None:
        dtype = torch.promote_types(flat[0].dtype, w.dtype)
    outs = [flat[0].new_full((flat[0].shape[0], n), value, dtype=dtype) for value in empty]
    for out, result in zip(outs, results or ()):
        out.index_copy_(0, rows, result[0])
    return tuple(out.reshape(*live.shape, n) for out in outs)


def _max_product_live(a: Value, dim: int) -> Tensor:
    """Rows (dim -1) or columns (dim -2) with a path: a non-zero entry (NaN counts as
    live)."""
    return a[0].amax(dim) != 0


def _signed_live(a: Value, dim: int) -> Tensor:
    """Rows (dim -1) or columns (dim -2) with a non-empty entry (hi ≥ lo; NaN counts as
    live). A reduction: comparing every entry and reducing the bools took 4x longer."""
    return ~((a[0] - a[1]).amax(dim) < 0)


def _boolean_live(a: Value, dim: int) -> Tensor:
    """Rows (dim -1) or columns (dim -2) with a path: a true entry."""
    return a[0].any(dim)


def _log_live(a: Value, dim: int) -> Tensor:
    """Rows (dim -1) or columns (dim -2) with a term (a log value above -inf; NaN counts as
    live)."""
    return a[0].amax(dim) != NEG_INF


def _gemm_exact(z: Tensor, live: Tensor, tiny: float, may_overflow: bool) -> bool:
    """Whether every shifted GEMM sum in ``z`` (count, m, n) is trustworthy: none below
    ``tiny`` (where the products may have underflowed) in the rows whose maximum is finite
    (``live``, (count, m, 1): a row of -inf has no term and its sums are rightly 0) and, when
    ``may_overflow``, none infinite. Reductions instead of elementwise masks, over the
    whole tensor when every row is live (several times faster than per row); a NaN answers
    False (then the caller checks element by element)."""
    if z.numel() == 0:
        return True
    if bool(live.all()):
        low, high = torch.aminmax(z)
    else:
        low, high = torch.aminmax(z, dim=-1, keepdim=True)
        low, high = low.masked_fill(~live, POS_INF).min(), high.max()
    return bool(low >= tiny) and not (may_overflow and bool(high == POS_INF))


def _exact_terms(
    a3: Tensor,
    b3: Tensor,
    ra3: Tensor | None,
    rb3: Tensor | None,
    bad: Tensor,
    out: Tensor,
    r: Tensor | None,
) -> None:
    """Recompute the ``bad`` entries of ``out`` (and ``r``) that have a term, each by an
    exact logsumexp over its k terms (log-space a3 (count, m, k), b3 (count, k, n))."""
    dtype = a3.dtype
    reach = (torch.isfinite(a3).to(dtype) @ torch.isfinite(b3).to(dtype)) > 0
    where = (bad & reach).nonzero()
    step = max(1, _CHUNK_ELEMENTS // max(1, a3.shape[-1]))
    for s in range(0, where.shape[0], step):
        bt, i, j = where[s : s + step].unbind(1)
        terms = a3[bt, i, :] + b3[bt, :, j]
        total = torch.logsumexp(terms, dim=-1)
        out[bt, i, j] = total
        if r is not None:
            w = _safe_weight(terms, total[:, None])
            r[bt, i, j] = (w * (ra3[bt, i, :] + rb3[bt, :, j])).sum(-1)


class _LogSpaceGemm:
    """(logsumexp, weighted mean) matmul via shift-and-GEMM, exact blocked fallback where
    the shifted products underflow.

    The r component costs one more GEMM: with A = [ea·ra | ea] (m × 2k) and
    B = [eb; eb·rb] (2k × n), Σ_k ea·eb·(ra + rb) = A @ B."""

    @staticmethod
    def run(
        la: Tensor,
        lb: Tensor | None,
        ra: Tensor | None,
        rb: Tensor | None,
        b_linear: Tensor | None = None,
    ):
        """``lb`` (and ``rb``) is b in log space; or pass ``lb=None`` and ``b_linear``, b as
        linear GEMM operands needing no shift (a lifted weight): exp(lb) = |w| (…, k, n)
        without r, or [exp(lb); exp(lb)·rb] stacked (…, 2k, n) with r (``rb=None``)."""
        with_r = ra is not None
        if b_linear is not None:
            k = b_linear.shape[-2] // (2 if with_r else 1)
            batch = torch.broadcast_shapes(la.shape[:-2], b_linear.shape[:-2])
            a3, b_lin, b3 = _flat(la, batch), _flat(b_linear, batch), None
        else:
            a3, b3, batch = _batch_flatten(la, lb)
            k = a3.shape[-1]
        count, m, n = a3.shape[0], a3.shape[-2], (b_lin if b3 is None else b3).shape[-1]
        if k == 0:
            out = a3.new_full((*batch, m, n), NEG_INF)
            return out, (None if ra is None else torch.zeros_like(out))
        mb = None
        if b3 is not None:
            mb = _finite_max(b3, -2)
            b_lin = b3.new_empty(count, (2 if with_r else 1) * k, n)
            torch.sub(b3, mb, out=b_lin[:, :k]).exp_()
            if with_r:
                torch.mul(b_lin[:, :k], _flat(rb, batch), out=b_lin[:, k:])
        # the shifted a (and its r product) are GEMM operands only: scratch storage, up to
        # a bound (a message grows with batch and sequence, and scratch stays resident)
        shape = (count, m, (2 if with_r else 1) * k)
        if math.prod(shape) * a3.element_size() <= _MESSAGE_SCRATCH_BYTES:
            stacked = scratch("log_space_a", shape, a3.dtype, a3.device)
        else:
            stacked = a3.new_empty(shape)
        ra3 = _flat(ra, batch).contiguous() if with_r else None
        fused = kernels.log_space_rows(a3.contiguous(), ra3, stacked)
        if fused is not None:
            ma, live = fused
            ea = stacked[..., -k:]
        else:
            row_max = a3.amax(dim=-1, keepdim=True)
            live = torch.isfinite(row_max)
            ma = row_max.masked_fill(~live, 0.0)
            ea = torch.sub(a3, ma, out=stacked[..., -k:]).exp_()
            if with_r:
                torch.mul(ea, ra3, out=stacked[..., :k])
        z = torch.bmm(ea, b_lin[:, :k])
        # r's numerators: Σ ea·eb·(ra + rb), then divided by z
        r = torch.bmm(stacked, b_lin) if with_r else None
        tiny = torch.finfo(z.dtype).tiny / torch.finfo(z.dtype).eps
        bad = None
        if not _gemm_exact(z, live, tiny, b3 is None):
            bad = (z < tiny) & live
            if b3 is None:
                bad |= torch.isinf(z)  # |w| unshifted: the sum may overflow
        if with_r:  # 0 where no term (z = 0)
            r = _ratio(r, z)
        out = z.log_().add_(ma)
        if mb is not None:
            out.add_(mb)
        if bad is not None and bad.any():
            if b3 is None:  # back to log space from the linear operands
                eb = b_lin[:, :k]
                b3 = torch.log(eb)
                rb3 = torch.where(eb > 0, b_lin[:, k:] / eb, 0.0) if with_r else None
            else:
                rb3 = _flat(rb, batch) if with_r else None
            _exact_terms(a3, b3, ra3, rb3, bad, out, r)
        out = out.reshape(*batch, m, n)
        return out, (None if r is None else r.reshape(*batch, m, n))


class Real(Semiring):
    """(+, ×): the ordinary gradient. lift(w) = w.

    Real messages are torch's own gradients, so under ``sa.patch`` torch records its own
    graph of each op (its backward nodes and fused kernels); every call is still bound to its
    YAML entry and its node named. ``formulas=True`` runs the generated Real Functions
    instead: the YAML formulas in real arithmetic, the same gradient. That is the check that
    the formulas every semiring shares compute it.
    """

    name = "real"
    formulas = False  # (a subclass is a user semiring: it always runs the formulas)

    def __init__(self, formulas: bool = False):
        self.formulas = bool(formulas)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({'formulas=True' if self.formulas else ''})"

    def _identity(self) -> dict:
        # `formulas` only picks how sa.patch records the graph: the semiring is the same
        return {k: v for k, v in vars(self).items() if k != "formulas"}

    def zero(self, shape, like):
        return (_full(shape, 0.0, like),)

    def one(self, shape, like):
        return (_full(shape, 1.0, like),)

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


class MaxProduct(Semiring):
    """(max, ×) over |w|: the weight of the strongest path. Zero is 0, one is 1."""

    name = "max_product"

    def zero(self, shape, like):
        return (_full(shape, 0.0, like),)

    def one(self, shape, like):
        return (_full(shape, 1.0, like),)

    def lift(self, w):
        return (w.abs(),)

    def add(self, a, b):
        return (torch.maximum(a[0], b[0]),)

    def mul(self, a, b):
        return (a[0] * b[0],)

    def readout(self, a):
        return a[0]

    def _reduce(self, a, dims, keepdim):
        return (a[0].amax(dim=dims, keepdim=keepdim),)

    def loo(self, a, dim):
        return (_loo_max(a[0], dim, 0.0),)

    def matmul(self, a, b):
        return (_max_times(a[0], b[0]),)

    def matmul_lift(self, a, w):
        result = _on_live_rows(a, _max_product_live, w, self._matmul_lift, (0.0,))
        return result or self._matmul_lift(a, w)

    def _matmul_lift(self, a, w):
        return (_max_times(a[0], w, abs_b=True),)

    def index_add(self, a, index, size):
        return (_scatter_extreme(a[0], index, size, "amax", 0.0),)


def _max_times(a: Tensor, b: Tensor, abs_b: bool = False) -> Tensor:
    """max_k a[..., i, k] · b[..., k, j] for non-negative a, b (0 where k is empty), or
    with |b| when ``abs_b`` (b a real derivative): the fused kernel, else in row blocks so
    m×k×n is never held at once."""
    a3, b3, batch = _batch_flatten(a, b)
    m, k, n = a3.shape[-2], a3.shape[-1], b3.shape[-1]
    if k == 0:
        return a.new_zeros((*batch, m, n))
    fused = kernels.max_times(a3, b3, abs_b=abs_b)
    if fused is not None:
        return fused.reshape(*batch, m, n)
    if abs_b:
        b3 = b3.abs()
    rows = max(1, _CHUNK_ELEMENTS // max(1, k * n * a3.shape[0]))
    out = (
        torch.cat(
            [
                (a3[:, s : s + rows, :, None] * b3[:, None, :, :]).amax(dim=-2)
                for s in range(0, m, rows)
            ],
            dim=-2,
        )
        if m
        else a3.new_zeros((a3.shape[0], 0, n))
    )
    return out.reshape(*batch, m, n)


class SignedMaxProduct(Semiring):
    """Pairs (largest, smallest) signed path product. Zero is (-inf, +inf), the empty set;
    lift(w) = (w, w) and lift(0) = zero; ⊗ takes the extremes of the four cross products."""

    name = "signed_max_product"
    n_components = 2

    def zero(self, shape, like):
        return (_full(shape, NEG_INF, like), _full(shape, POS_INF, like))

    def one(self, shape, like):
        return (_full(shape, 1.0, like), _full(shape, 1.0, like))

    def lift(self, w):
        nz = w != 0
        return (
            torch.where(nz, w, torch.full_like(w, NEG_INF)),
            torch.where(nz, w, torch.full_like(w, POS_INF)),
        )

    def add(self, a, b):
        return (torch.maximum(a[0], b[0]), torch.minimum(a[1], b[1]))

    def mul(self, a, b):
        return _signed_combine(a, b, None)

    def readout(self, a):
        valid = a[0] >= a[1]
        zero = torch.zeros_like(a[0])
        return torch.stack([torch.where(valid, a[0], zero), torch.where(valid, a[1], zero)])

    def _reduce(self, a, dims, keepdim):
        return (a[0].amax(dim=dims, keepdim=keepdim), a[1].amin(dim=dims, keepdim=keepdim))

    def loo(self, a, dim):
        hi, lo = torch.broadcast_tensors(*a)
        return (_loo_max(hi, dim, NEG_INF), -_loo_max(-lo, dim, NEG_INF))

    def matmul(self, a, b):
        fused = _signed_matmul_fused(a, b)
        return fused if fused is not None else _signed_combine(a, b, "matmul")

    def matmul_lift(self, a, w):
        result = _on_live_rows(a, _signed_live, w, self._matmul_lift, (NEG_INF, POS_INF))
        return result or self._matmul_lift(a, w)

    def _matmul_lift(self, a, w):
        fused = _signed_lift_fused(a, w)
        return fused if fused is not None else _signed_combine(a, self.lift(w), "matmul")

    def mul_lift(self, a, w):
        fused = kernels.signed_mul_lift(a[0], a[1], w) if kernels.enabled() else None
        if fused is not None:
            return fused
        # w > 0 keeps the order of (hi, lo), w < 0 swaps it; an empty (-inf, +inf) stays
        # empty either way, and w = 0 is no edge
        pos = w > 0
        hi = torch.where(pos, a[0], a[1]) * w
        lo = torch.where(pos, a[1], a[0]) * w
        zero = w == 0
        return (hi.masked_fill(zero, NEG_INF), lo.masked_fill(zero, POS_INF))

    def index_add(self, a, index, size):
        hi, lo = torch.broadcast_tensors(*a)
        return (
            _scatter_extreme(hi, index, size, "amax", NEG_INF),
            _scatter_extreme(lo, index, size, "amin", POS_INF),
        )


def _nan_empty(a: Value) -> tuple[Tensor, Tensor, bool]:
    """A signed value's (hi, lo) with NaN marking empty entries, and whether it is a point
    (hi == lo wherever it is not empty: a lifted derivative)."""
    hi, lo = torch.broadcast_tensors(*a)
    empty = hi < lo
    point = torch.equal(torch.where(empty, 0.0, hi), torch.where(empty, 0.0, lo))
    nan = torch.tensor(float("nan"), dtype=hi.dtype, device=hi.device)
    return torch.where(empty, nan, hi), torch.where(empty, nan, lo), point


def _signed_matmul_fused(a: Value, b: Value):
    """The fused signed matmul of a and b; None when the kernel is unavailable or a
    dimension is empty. A point operand halves the corner products; a point on the left is
    moved to the right by transposing. (a ⊗ lift(w) for a real w: `_signed_lift_fused`.)"""
    if not kernels.enabled():
        return None
    ah, al, a_point = _nan_empty(a)
    bh, bl, b_point = _nan_empty(b)
    if 0 in (ah.shape[-2], ah.shape[-1], bh.shape[-1]):
        return None
    swap = a_point and not b_point
    if swap:
        ah, al, bh, bl = bh.mT, bl.mT, ah.mT, al.mT
    a3h, b3h, batch = _batch_flatten(ah, bh)
    a3l, b3l, _ = _batch_flatten(al, bl)
    out = kernels.signed_times(a3h, a3l, b3h, None if (a_point or b_point) else b3l)
    if out is None:
        return None
    shape = (*batch, a3h.shape[-2], b3h.shape[-1])
    hi, lo = (c.reshape(shape) for c in out)
    return (hi.mT, lo.mT) if swap else (hi, lo)


def _signed_lift_fused(a: Value, w: Tensor) -> Value | None:
    """a ⊗ lift(w) (semiring matmul) on the fused path; a 2-D w folds a's batch dimensions
    into its rows. None when the kernel is unavailable or a dimension is empty."""
    if not kernels.enabled():
        return None
    hi, lo = torch.broadcast_tensors(*a)
    if 0 in (hi.shape[-2], hi.shape[-1], w.shape[-1]):
        return None
    if w.dim() == 2:
        shape = (*hi.shape[:-1], w.shape[-1])
        h3, l3, w3 = hi.reshape(1, -1, hi.shape[-1]), lo.reshape(1, -1, lo.shape[-1]), w[None]
    else:
        h3, w3, batch = _batch_flatten(hi, w)
        l3 = lo.expand(*batch, *lo.shape[-2:]).reshape(h3.shape)
        shape = (*batch, hi.shape[-2], w.shape[-1])
    out = kernels.pair_lift_matmul(h3, l3, w3, zero_empty=True)
    return None if out is None else tuple(c.reshape(shape) for c in out)


def _signed_combine(a: Value, b: Value, mode: str | None) -> Value:
    """⊗ (mode None) or semiring matmul (mode "matmul") of signed (hi, lo) pairs."""
    if mode == "matmul":
        hi_a, lo_a, hi_b, lo_b = a[0], a[1], b[0], b[1]
        a3h, b3h, batch = _batch_flatten(hi_a, hi_b)
        a3l, b3l, _ = _batch_flatten(lo_a.expand_as(hi_a), lo_b.expand_as(hi_b))
        m, k, n = a3h.shape[-2], a3h.shape[-1], b3h.shape[-1]
        rows = max(1, _CHUNK_ELEMENTS // max(1, 4 * k * n * a3h.shape[0]))
        his, los = [], []
        for s in range(0, m, rows):
            pa = (a3h[:, s : s + rows, :, None], a3l[:, s : s + rows, :, None])
            pb = (b3h[:, None, :, :], b3l[:, None, :, :])
            hi, lo = _signed_combine(pa, pb, None)
            his.append(hi.amax(dim=-2) if k else hi.sum(-2))
            los.append(lo.amin(dim=-2) if k else lo.sum(-2))
        if not his or k == 0:
            shape = (*batch, m, n)
            return (a3h.new_full(shape, NEG_INF), a3h.new_full(shape, POS_INF))
        return (torch.cat(his, -2).reshape(*batch, m, n), torch.cat(los, -2).reshape(*batch, m, n))
    valid = (a[0] >= a[1]) & (b[0] >= b[1])
    zero = torch.zeros((), dtype=a[0].dtype, device=a[0].device)
    ah, al = torch.where(a[0] >= a[1], a[0], zero), torch.where(a[0] >= a[1], a[1], zero)
    bh, bl = torch.where(b[0] >= b[1], b[0], zero), torch.where(b[0] >= b[1], b[1], zero)
    p1, p2, p3, p4 = ah * bh, ah * bl, al * bh, al * bl
    hi = torch.maximum(torch.maximum(p1, p2), torch.maximum(p3, p4))
    lo = torch.minimum(torch.minimum(p1, p2), torch.minimum(p3, p4))
    return (
        torch.where(valid, hi, torch.full_like(hi, NEG_INF)),
        torch.where(valid, lo, torch.full_like(lo, POS_INF)),
    )


def _top_two_shifts(x: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Along ``dim`` (n ≥ 2): the argmax position and the largest and second largest
    entries as shifts (0 where not finite), each with ``dim`` kept as size 1."""
    first, second, at = _top_two(x, dim)
    shifts = [t.masked_fill(~torch.isfinite(t), 0.0) for t in (first, second)]
    return at, shifts[0], shifts[1]


def _log_loo(x: Tensor, dim: int) -> Tensor:
    """log Σ_{j≠i} exp(x_j) along ``dim`` from the top two entries (no scan).

    Shifted by the maximum, every position but the argmax keeps the argmax's term 1 in its
    sum, so total - e_i loses no precision. The argmax position sums the others afresh,
    shifted by the second largest, so a gap between the two never underflows."""
    n = x.shape[dim]
    if n <= 1:
        return torch.full_like(x, NEG_INF)
    if dim in (-1, x.dim() - 1):
        fused = kernels.loo_log(x, None)
        if fused is not None:
            return fused[0]
    first, s1, s2 = _top_two_shifts(x, dim)
    e = torch.exp(x - s1)
    rest = torch.log((e.sum(dim, keepdim=True) - e).clamp_min(0.0)) + s1
    others = torch.exp(x - s2).scatter(dim, first, 0.0).sum(dim, keepdim=True)
    at_max = torch.log(others) + s2
    return rest.scatter(dim, first, at_max)


def _entropy_loo(la: Tensor, r: Tensor, dim: int) -> Value:
    """Leave-one-out ⊕ of Entropy values (log Z, r) along ``dim``, with the shifts of
    :func:`_log_loo`: r of the rest is Σ_{j≠i} w_j r_j / Σ_{j≠i} w_j (0 where no j has
    weight). Fresh tensors are updated in place (fewer passes)."""
    n = la.shape[dim]
    if n <= 1:
        return torch.full_like(la, NEG_INF), torch.zeros_like(r)
    if dim in (-1, la.dim() - 1):
        fused = kernels.loo_log(la, r)
        if fused is not None:
            return fused
    first, s1, s2 = _top_two_shifts(la, dim)
    e = torch.sub(la, s1).exp_()
    er = e * r
    den = e.sum(dim, keepdim=True).sub(e).clamp_min_(0.0)
    # den ≥ 1 but at the argmax (its sum is replaced below) and in all -inf rows (0/0)
    rest_r = _ratio(torch.sub(er.sum(dim, keepdim=True), er, out=er), den)
    rest_l = den.log_().add_(s1)
    e2 = torch.sub(la, s2).exp_().scatter_(dim, first, 0.0)
    den2 = e2.sum(dim, keepdim=True)
    at_r = _ratio(e2.mul_(r).sum(dim, keepdim=True), den2)
    at_l = den2.log_().add_(s2)
    return rest_l.scatter_(dim, first, at_l), rest_r.scatter_(dim, first, at_r)


class Log(Semiring):
    """(logaddexp, +) over log|w|: log of the total |path| weight, -inf where no path."""

    name = "log"

    def zero(self, shape, like):
        return (_full(shape, NEG_INF, like),)

    def one(self, shape, like):
        return (_full(shape, 0.0, like),)

    def lift(self, w):
        return (torch.log(w.abs()),)

    def add(self, a, b):
        return (torch.logaddexp(a[0], b[0]),)

    def mul(self, a, b):
        return (a[0] + b[0],)

    def readout(self, a):
        return a[0]

    def _reduce(self, a, dims, keepdim):
        return (torch.logsumexp(a[0], dim=dims, keepdim=keepdim),)

    def loo(self, a, dim):
        return (_log_loo(a[0], dim),)

    def matmul(self, a, b):
        return (_LogSpaceGemm.run(a[0], b[0], None, None)[0],)

    def linear_lift(self, w: Tensor) -> Tensor:
        """exp(lift(w)), computed without exp or log, in scratch storage (valid for the
        calling matmul only)."""
        return torch.abs(w, out=scratch("linear_lift", w.shape, w.dtype, w.device))

    def matmul_lift(self, a, w):
        result = _on_live_rows(a, _log_live, w, self._matmul_lift, (NEG_INF,))
        return result or self._matmul_lift(a, w)

    def _matmul_lift(self, a, w):
        return (_LogSpaceGemm.run(a[0], None, None, None, b_linear=self.linear_lift(w))[0],)

    def index_add(self, a, index, size):
        x = a[0]
        top = _scatter_extreme(x, index, size, "amax", NEG_INF)
        shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        idx = index.reshape(-1)
        z = torch.zeros_like(top).index_add(0, idx, torch.exp(x - shift[idx]))
        return (torch.log(z) + shift,)


class Counting(Log):
    """(+, ×) on path counts, kept in log space: lift(w) = 1 if w ≠ 0 else 0; the readout
    is the natural log of the number of non-zero paths (-inf where none)."""

    name = "counting"

    def lift(self, w):
        return (torch.where(w != 0, 0.0, NEG_INF).to(message_dtype(w.dtype)),)

    def linear_lift(self, w):
        return _nonzero_operand(w, message_dtype(w.dtype))

    def mul_lift(self, a, w):
        return (torch.where(w == 0, NEG_INF, a[0]),)


def _entropy_weights(w: Tensor) -> Tensor:
    """The Entropy GEMM operand of lift(w) (…, k, n): [|w|; |w|·(-log|w|)] stacked along the
    rows (…, 2k, n), in scratch storage (valid for the calling matmul only). -|w|log|w| is
    0 at w = 0 (where it is 0·inf = NaN) and at NaN, whose Z sums are NaN anyway."""
    k, n = w.shape[-2:]
    out = scratch("entropy_weights", (*w.shape[:-2], 2 * k, n), w.dtype, w.device)
    if kernels.entropy_weights(w, out):
        return out
    magnitude = torch.abs(w, out=out[..., :k, :])
    # in place, several times faster than xlogy, and nan_to_num_ than a masked fill, on CPU
    weighted = torch.log(magnitude, out=out[..., k:, :]).mul_(magnitude).neg_()
    weighted.nan_to_num_(nan=0.0, posinf=POS_INF, neginf=NEG_INF)
    return out


class Entropy(Semiring):
    """The expectation semiring ⟨|w|, −|w| log|w|⟩ kept in log space as (log Z, r), with
    r = (Σ_paths p̃·(−log p̃)) / Z. ⊕: (logaddexp, Z-weighted mean of r); ⊗: (+, +).
    The readout log Z + r is the entropy (nats) of paths with p ∝ Π|w| (0 for ≤ 1 path)."""

    name = "entropy"
    n_components = 2

    def zero(self, shape, like):
        return (_full(shape, NEG_INF, like), _full(shape, 0.0, like))

    def one(self, shape, like):
        return (_full(shape, 0.0, like), _full(shape, 0.0, like))

    def lift(self, w):
        la = torch.log(w.abs())
        return (la, (-la).masked_fill(w == 0, 0.0))

    def add(self, a, b):
        fused = kernels.entropy_add(a[0], a[1], b[0], b[1])
        if fused is not None:
            return fused
        la = torch.logaddexp(a[0], b[0])
        r = _safe_weight(a[0], la) * a[1] + _safe_weight(b[0], la) * b[1]
        return (la, r)

    def mul(self, a, b):
        la = a[0] + b[0]
        return (la, (a[1] + b[1]).masked_fill(torch.isneginf(la), 0.0))

    def readout(self, a):
        la, r = torch.broadcast_tensors(*a)
        h = (la + r).clamp_min(0.0)
        return torch.where(torch.isneginf(la), torch.zeros_like(h), h)

    def _reduce(self, a, dims, keepdim):
        la, r = a
        if dims == (la.dim() - 1,) and la.shape[-1] > 0:
            fused = kernels.entropy_reduce_rows(la, r)
            if fused is not None:
                return fused if keepdim else tuple(c.squeeze(-1) for c in fused)
        total = torch.logsumexp(la, dim=dims, keepdim=True)
        rs = (_safe_weight(la, total) * r).sum(dim=dims, keepdim=keepdim)
        return (total if keepdim else total.squeeze(dims), rs)

    def matmul(self, a, b):
        la, ra = torch.broadcast_tensors(*a)
        lb, rb = torch.broadcast_tensors(*b)
        return _LogSpaceGemm.run(la, lb, ra, rb)

    def matmul_lift(self, a, w):
        result = _on_live_rows(a, _log_live, w, self._matmul_lift, (NEG_INF, 0.0))
        return result or self._matmul_lift(a, w)

    def _matmul_lift(self, a, w):
        la, ra = torch.broadcast_tensors(*a)
        return _LogSpaceGemm.run(la, None, ra, None, b_linear=_entropy_weights(w))

    def mul_lift(self, a, w):
        fused = kernels.entropy_mul_lift(a[0], a[1], w)
        if fused is not None:
            return fused
        log_w = torch.log(w.abs())  # -inf at 0: no edge
        la = a[0] + log_w
        return (la, (a[1] - log_w).masked_fill(torch.isneginf(la), 0.0))

    def loo(self, a, dim):
        return _entropy_loo(*torch.broadcast_tensors(*a), dim)

    def index_add(self, a, index, size):
        la, r = torch.broadcast_tensors(*a)
        top = _scatter_extreme(la, index, size, "amax", NEG_INF)
        shift = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        idx = index.reshape(-1)
        w = torch.exp(la - shift[idx])
        z = torch.zeros_like(top).index_add(0, idx, w)
        num = torch.zeros_like(top).index_add(0, idx, w * r)
        out_r = torch.where(z > 0, num / torch.where(z > 0, z, torch.ones_like(z)), 0.0)
        return (torch.log(z) + shift, out_r)


class Boolean(Semiring):
    """(or, and): whether any path with all local derivatives non-zero exists."""

    name = "boolean"

    def zero(self, shape, like):
        return (torch.zeros(tuple(shape), dtype=torch.bool, device=like.device),)

    def one(self, shape, like):
        return (torch.ones(tuple(shape), dtype=torch.bool, device=like.device),)

    def lift(self, w):
        return (w != 0,)

    def add(self, a, b):
        return (a[0] | b[0],)

    def mul(self, a, b):
        return (a[0] & b[0],)

    def readout(self, a):
        return a[0]

    def _reduce(self, a, dims, keepdim):
        return (a[0].any(dim=dims, keepdim=keepdim),)

    def loo(self, a, dim):
        count = a[0].to(torch.int64)
        return ((count.sum(dim, keepdim=True) - count) > 0,)

    def matmul(self, a, b):
        # a GEMM of 0/1 entries: a sum of 0s and 1s is > 0 exactly when some term is 1, in
        # any float format (no term rounds away and a positive sum never rounds to 0)
        return ((a[0].to(torch.float32) @ b[0].to(torch.float32)) > 0,)

    def matmul_lift(self, a, w):
        """On the GEMM operand w ≠ 0 in scratch storage, without a bool lift(w) and its
        float copy per call; on the live rows and columns only (see ``_on_live_rows``)."""
        result = _on_live_rows(a, _boolean_live, w, self._matmul_lift, (False,), torch.bool)
        return result or self._matmul_lift(a, w)

    def _matmul_lift(self, a, w):
        return ((a[0].to(torch.float32) @ _nonzero_operand(w, torch.float32)) > 0,)

    def index_add(self, a, index, size):
        x = a[0].to(torch.int64)
        out = x.new_zeros((size, *x.shape[1:])).index_add(0, index.reshape(-1), x)
        return (out > 0,)


BUILTIN_SEMIRINGS: tuple[type[Semiring], ...] = (
    Real,
    MaxProduct,
    SignedMaxProduct,
    Log,
    Entropy,
    Boolean,
    Counting,
)
