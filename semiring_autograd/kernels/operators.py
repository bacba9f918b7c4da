"""The semiring kernels as torch operators: ``torch.ops.semiring_autograd.*``.

Schemas are defined here, with fake implementations (shapes, dtypes and strides without
data, for ``torch.compile``, ``torch.export`` and fake-tensor tracing) and the CUDA kernels
of the three matmuls (``triton_matmul.py``); the CPU kernels come from ``operators.cpp``
(``build.py`` compiles and loads it). Every operator works on float32 or float64 operands of
one dtype.

======================== ==================================================================
``max_times``            max(init, max_k a[b, i, k]·b[b, k, j]), a (B, m, k), b (B, k, n);
                         NaN terms never win; |b| when ``abs_b``
``max_times_finite``     (max_times, whether some entry of a or b is NaN or infinite: then
                         the first is all NaN); CPU only
``k_best_times``         (out, flag): out (k, B, m, n) the k largest products a[r]·b[s] over
                         (l, r, s) of lists a (ka components (B, m, l)), b (kb components
                         (B or 1, l, n)); |b| when
                         ``abs_b``; the flag: a NaN or an infinity that counts (then out is
                         all NaN); CPU only
``k_best_add``           (out, flag): out (k, *shape) the k largest of two descending lists
                         a, b of k components each, one shape, any strides (KBest's ⊕);
                         the flag: a list not descending or with a NaN (then out is all
                         NaN); CPU only
``k_best_loo``           (out, flag): out (k, *shape), out[t][..., j] the t-th largest entry
                         of the descending lists a (k components) at the other positions of
                         the last dim (KBest's leave-one-out ⊕); the flag: a list not
                         descending or with a NaN (then out is all NaN); CPU only
``k_best_softmax_backward`` (out, flag): out (k, *shape), KBest's message at softmax's input
                         from descending lists a (k components) at its output p along the
                         last dim (p of their shape); the flag: a list not descending or a
                         NaN product (then out is all NaN); CPU only
``signed_times``         (max_k, min_k) of the corner products of signed pairs; NaN = empty
``lift_times``           the signed pair a times lift(w): (max_k, min_k) of a_hi·w or a_lo·w
                         by the sign of w
``signed_mul_lift``      the signed pair times lift(w), elementwise (broadcasting)
``entropy_mul_lift``     Entropy's (la, r) times lift(w), elementwise (broadcasting)
``entropy_add``          Entropy's ⊕, elementwise (broadcasting)
``entropy_add_rows_``    the same into ``(out_l, out_r)`` for 2-D (rows, n) operands with
                         unit stride along rows and any row stride; the outputs may be
                         (la, ra) or (lb, rb); CPU only
``ratio_where_positive_`` num / den where den > 0, else 0, in place
``loo_log``              leave-one-out log-sum-exp along the last dim (and Entropy's r)
``entropy_reduce_rows``  Entropy's ⊕-reduction along the last dim
``log_space_rows``       the row shift, liveness and shifted exponentials of a log GEMM
``log_space_columns``    the same for a message held transposed (count, k, m); CPU only
``entropy_weights``      the stacked Entropy GEMM operands [|w|; -|w|·log|w|], into ``out``
``plus_log_abs``         a + log|w| (log|w| without a), elementwise, one shape; CPU only
``log_add``              log(e^a + e^b), elementwise, one shape; CPU only
``log_add_rows_``        the same into ``out`` for 2-D (rows, n) operands with unit stride
                         along rows and any row stride; ``out`` may be a or b; CPU only
``softmax_backward_log`` (out, flag): Log's message at softmax's input s from g at its
                         output p = softmax(s) along the last dim, g and p of one shape;
                         the flag: a row held NaN or +inf (then left uncomputed); CPU only
``softmax_backward_max`` MaxProduct's message at softmax's input s from g at its output p
                         along the last dim, g and p of one shape; CPU only
``softmax_backward_or``  Boolean's, g bool, p float, of one shape; CPU only
``softmax_backward_signed`` (hi, lo, flag): SignedMaxProduct's, g a (hi, lo) pair; the
                         flag: a row held NaN (then left uncomputed); CPU only
``entropy_softmax_backward`` (l, r, flag): Entropy's message at softmax's input from
                         (gl, gr) at its output p along the last dim, all of one shape;
                         the flag: a row held NaN or +inf (then left uncomputed); CPU only
``standardize_max``      MaxProduct's message at x from a at layer norm's n = c·s along the
                         last dim (c = x − μ, s one entry per row), a and c of one shape;
                         CPU only
``standardize_log``      (out, flag): Log's; the flag: a row held NaN or +inf, or its s
                         was not finite and positive (then left uncomputed); CPU only
``entropy_standardize``  (l, r, flag): Entropy's, a the pair (la, r) (the flag also where
                         a row's r was not finite); CPU only
``where_zero``           where(w == 0, fill, y), fill of no dimension (Counting's y times
                         lift(w) with fill -inf); CPU only
``softmax_rows_``        scores ← softmax(scores · factor) along the last dim in place, the
                         entries where keep (query rows × keys, bool) is false excluded; a
                         row with NaN or +inf kept is NaN, a row with none kept 0; CPU only
``any_nan_or_inf``       some tensor holds a NaN, or an infinity of the sign given for it
                         (+1, -1; 0: either) (0-d bool; CPU tensors of any dtype)
``all_rows_live``        every row (last dim) of x has a term: its maximum is not ``empty``
                         (or, given y, the maximum of x - y is not below 0); NaN counts
``log_gemm_finish_``     a log-space GEMM's last steps, in place, when no sum of a live row
                         is below ``tiny`` (nor infinite, given ``may_overflow``): num / z
                         (0 at 0/0) and log z + shift (+ shift_b); whether it wrote (0-d
                         bool)
======================== ==================================================================

The row operators return a 0-d bool last: true when a row held NaN or +inf and was left
uncomputed, so that the caller runs its torch formula instead. The tests (``any_nan_or_inf``,
the exactness test of ``log_gemm_finish_``) scan the entries: one operator
and one read where the Python formula takes several operators per tensor.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

NAMESPACE = "semiring_autograd"

SCHEMAS = {
    "max_times": "(Tensor a, Tensor b, float init, bool abs_b) -> Tensor",
    "max_times_finite": "(Tensor a, Tensor b, float init, bool abs_b) -> (Tensor, Tensor)",
    "k_best_times": "(Tensor[] a, Tensor[] b, int k, bool abs_b, bool dead_count) -> (Tensor, Tensor)",
    "k_best_add": "(Tensor[] a, Tensor[] b) -> (Tensor, Tensor)",
    "k_best_loo": "(Tensor[] a) -> (Tensor, Tensor)",
    "k_best_softmax_backward": "(Tensor[] a, Tensor p) -> (Tensor, Tensor)",
    "signed_times": "(Tensor a_hi, Tensor a_lo, Tensor b_hi, Tensor? b_lo) -> (Tensor, Tensor)",
    "lift_times": "(Tensor a_hi, Tensor a_lo, Tensor w, bool zero_empty) -> (Tensor, Tensor)",
    "signed_mul_lift": "(Tensor a_hi, Tensor a_lo, Tensor w) -> (Tensor, Tensor)",
    "entropy_mul_lift": "(Tensor la, Tensor r, Tensor w) -> (Tensor, Tensor)",
    "entropy_add": "(Tensor la, Tensor ra, Tensor lb, Tensor rb) -> (Tensor, Tensor)",
    "entropy_add_rows_": (
        "(Tensor(a!) out_l, Tensor(b!) out_r, Tensor la, Tensor ra, Tensor lb, Tensor rb) -> ()"
    ),
    "ratio_where_positive_": "(Tensor(a!) num, Tensor den) -> ()",
    "loo_log": "(Tensor x, Tensor? r) -> (Tensor, Tensor, Tensor)",
    "entropy_reduce_rows": "(Tensor la, Tensor r) -> (Tensor, Tensor, Tensor)",
    "log_space_rows": "(Tensor a, Tensor? r, Tensor(a!) out) -> (Tensor, Tensor)",
    "log_space_columns": "(Tensor a, Tensor? r, Tensor(a!) out) -> (Tensor, Tensor)",
    "entropy_weights": "(Tensor w, Tensor(a!) out) -> ()",
    "plus_log_abs": "(Tensor? a, Tensor w) -> Tensor",
    "log_add": "(Tensor a, Tensor b) -> Tensor",
    "log_add_rows_": "(Tensor(a!) out, Tensor a, Tensor b) -> ()",
    "softmax_backward_log": "(Tensor g, Tensor p) -> (Tensor, Tensor)",
    "softmax_backward_max": "(Tensor g, Tensor p) -> Tensor",
    "softmax_backward_or": "(Tensor g, Tensor p) -> Tensor",
    "softmax_backward_signed": "(Tensor g_hi, Tensor g_lo, Tensor p) -> (Tensor, Tensor, Tensor)",
    "standardize_max": "(Tensor a, Tensor c, Tensor s) -> Tensor",
    "standardize_log": "(Tensor a, Tensor c, Tensor s) -> (Tensor, Tensor)",
    "entropy_standardize": "(Tensor la, Tensor r, Tensor c, Tensor s) -> (Tensor, Tensor, Tensor)",
    "where_zero": "(Tensor w, Tensor fill, Tensor y) -> Tensor",
    "softmax_rows_": "(Tensor(a!) scores, Tensor? keep, float factor) -> ()",
    "entropy_softmax_backward": "(Tensor gl, Tensor gr, Tensor p) -> (Tensor, Tensor, Tensor)",
    "any_nan_or_inf": "(Tensor[] tensors, int[] signs) -> Tensor",
    "all_rows_live": "(Tensor x, Tensor? y, float empty) -> Tensor",
    "log_gemm_finish_": "(Tensor(a!) z, Tensor(b!)? num, Tensor shift, Tensor? shift_b, "
    "Tensor live, float tiny, bool may_overflow) -> Tensor",
}

_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
for _name, _schema in SCHEMAS.items():
    _LIBRARY.define(_name + _schema)

#: vectors per register row (``C`` in extreme_matmul.h) times 64-byte vectors
_BLOCK_VECTORS = 2


def block_width(dtype: torch.dtype) -> int:
    """The column block of max_times and signed_times: their (B, m, n) results are views
    of (B, m, n padded to a multiple of this)."""
    return _BLOCK_VECTORS * 64 // torch.empty((), dtype=dtype).element_size()


def op(name: str):
    """The operator ``torch.ops.semiring_autograd.<name>``."""
    return getattr(getattr(torch.ops, NAMESPACE), name)


def _padded_result(a: Tensor, n: int) -> Tensor:
    batch, m = a.shape[0], a.shape[1]
    width = block_width(a.dtype)
    return a.new_empty((batch, m, -(-n // width) * width))[..., :n]


def _declined(x: Tensor) -> Tensor:
    return x.new_empty((), dtype=torch.bool)


def _fake(name: str):
    return torch.library.register_fake(f"{NAMESPACE}::{name}", lib=_LIBRARY)


@_fake("max_times")
def _(a, b, init, abs_b):
    return _padded_result(a, b.shape[-1])


@_fake("max_times_finite")
def _(a, b, init, abs_b):
    return _padded_result(a, b.shape[-1]), _declined(a)


@_fake("k_best_times")
def _(a, b, k, abs_b, dead_count):
    return a[0].new_empty((k, *a[0].shape[:2], b[0].shape[2])), _declined(a[0])


@_fake("k_best_add")
def _(a, b):
    return a[0].new_empty((len(a), *a[0].shape)), _declined(a[0])


@_fake("k_best_loo")
def _(a):
    return a[0].new_empty((len(a), *a[0].shape)), _declined(a[0])


@_fake("k_best_softmax_backward")
def _(a, p):
    return a[0].new_empty((len(a), *a[0].shape)), _declined(a[0])


@_fake("signed_times")
def _(a_hi, a_lo, b_hi, b_lo):
    return _padded_result(a_hi, b_hi.shape[-1]), _padded_result(a_hi, b_hi.shape[-1])


@_fake("lift_times")
def _(a_hi, a_lo, w, zero_empty):
    shape = (a_hi.shape[0], a_hi.shape[1], w.shape[-1])
    return w.new_empty(shape), w.new_empty(shape)


def _broadcast_pair(*inputs: Tensor) -> tuple[Tensor, Tensor]:
    shape = torch.broadcast_shapes(*(t.shape for t in inputs))
    return inputs[0].new_empty(shape), inputs[0].new_empty(shape)


_fake("signed_mul_lift")(_broadcast_pair)
_fake("entropy_mul_lift")(_broadcast_pair)
_fake("entropy_add")(_broadcast_pair)


@_fake("plus_log_abs")
def _(a, w):
    return w.new_empty(w.shape)


def _like_first(a, b):
    return a.new_empty(a.shape)


for _name in ("log_add", "softmax_backward_max", "softmax_backward_or"):
    _fake(_name)(_like_first)


@_fake("standardize_max")
def _(a, c, s):
    return a.new_empty(a.shape)


@_fake("standardize_log")
def _(a, c, s):
    return a.new_empty(a.shape), _declined(a)


@_fake("entropy_standardize")
def _(la, r, c, s):
    return la.new_empty(la.shape), la.new_empty(la.shape), _declined(la)


@_fake("softmax_backward_log")
def _(g, p):
    return g.new_empty(g.shape), _declined(g)


@_fake("softmax_backward_signed")
def _(g_hi, g_lo, p):
    return g_hi.new_empty(g_hi.shape), g_lo.new_empty(g_lo.shape), _declined(p)


@_fake("entropy_softmax_backward")
def _(gl, gr, p):
    return p.new_empty(p.shape), p.new_empty(p.shape), _declined(p)


@_fake("where_zero")
def _(w, fill, y):
    return torch.where(w == 0, fill, y)


@_fake("ratio_where_positive_")
def _(num, den):
    return None


@_fake("entropy_weights")
def _(w, out):
    return None


@_fake("log_add_rows_")
def _(out, a, b):
    return None


@_fake("entropy_add_rows_")
def _(out_l, out_r, la, ra, lb, rb):
    return None


@_fake("softmax_rows_")
def _(scores, keep, factor):
    return None


@_fake("loo_log")
def _(x, r):
    out_r = x.new_empty(0) if r is None else x.new_empty(r.shape)
    return x.new_empty(x.shape), out_r, _declined(x)


def _row_shape(x: Tensor) -> tuple[int, ...]:
    return (*x.shape[:-1], 1)


@_fake("entropy_reduce_rows")
def _(la, r):
    return la.new_empty(_row_shape(la)), la.new_empty(_row_shape(la)), _declined(la)


@_fake("any_nan_or_inf")
def _(tensors, signs):
    return _declined(tensors[0])


@_fake("all_rows_live")
def _(x, y, empty):
    return _declined(x)


@_fake("log_gemm_finish_")
def _(z, num, shift, shift_b, live, tiny, may_overflow):
    return _declined(z)


@_fake("log_space_rows")
def _(a, r, out):
    return a.new_empty(_row_shape(a)), a.new_empty(_row_shape(a), dtype=torch.bool)


@_fake("log_space_columns")
def _(a, r, out):
    shape = (a.shape[0], a.shape[2], 1)
    return a.new_empty(shape), a.new_empty(shape, dtype=torch.bool)


# ----- CUDA: the hand-tiled Triton kernels of triton_matmul.py, imported on first use -----
@functools.cache
def _triton():
    from . import triton_matmul

    return triton_matmul


def _cuda(name: str):
    return torch.library.register_kernel(f"{NAMESPACE}::{name}", "cuda", lib=_LIBRARY)


@_cuda("max_times")
def _(a, b, init, abs_b):
    return _triton().max_times(a, b, init, abs_b, _padded_result(a, b.shape[-1]))


@_cuda("signed_times")
def _(a_hi, a_lo, b_hi, b_lo):
    n = b_hi.shape[-1]
    out = _padded_result(a_hi, n), _padded_result(a_hi, n)
    return _triton().signed_times(a_hi, a_lo, b_hi, b_lo, *out)


@_cuda("lift_times")
def _(a_hi, a_lo, w, zero_empty):
    shape = (a_hi.shape[0], a_hi.shape[1], w.shape[-1])
    return _triton().lift_times(a_hi, a_lo, w, zero_empty, w.new_empty(shape), w.new_empty(shape))
