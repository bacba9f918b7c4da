"""The primitives YAML formulas are written in, for semiring values (tuples of tensors).

The generic generated module calls ``P.<name>(S, ...)`` for a semiring ``S``; modules
specialised to a one-component semiring call :mod:`.component_primitives` (Real:
:mod:`.real_primitives`), the same set on the component tensor. ``PRIMITIVES`` is the list
the codegen validates formulas against.
"""

from __future__ import annotations

import math
from numbers import Number
from typing import Any, Sequence

import torch
from torch import Tensor

from ..semirings.base import MESSAGE_DTYPES, Semiring, Value, message_dtype
from ..semirings.tensor_ops import live_columns, live_rows
from .einsum_helpers import Contraction, contraction_dims

Ref = tuple[torch.dtype, torch.device]
#: primal dtypes that are their own message dtype
OWN_PRECISION = (torch.float32, torch.float64)
_SUM_TO = Semiring.sum_to

PRIMITIVES = (
    "lift",
    "mul",
    "add",
    "zero",
    "sum",
    "sum_to",
    "matmul",
    "contract",
    "loo",
    "softmax_backward",
    "standardize",
    "index_add",
    "reshape",
    "permute",
    "transpose",
    "expand",
    "narrow",
    "index_select",
    "flip",
    "roll",
    "getitem_backward",
    "cat",
    "split",
    "unbind",
    "stack",
    "fill_zero",
    "cast",
)


def as_message(x: Tensor | Number, ref: Ref) -> Tensor:
    """``x`` as a floating tensor in message precision (half and bfloat16 are computed in
    float32; bool and integer tensors take the output's message precision)."""
    if isinstance(x, Tensor):
        dtype = MESSAGE_DTYPES.get(x.dtype)
        if dtype is None:
            dtype = message_dtype(x.dtype if x.is_floating_point() else ref[0])
        return x.to(dtype)
    dtype = MESSAGE_DTYPES.get(ref[0]) or message_dtype(ref[0])
    return torch.tensor(x, dtype=dtype, device=ref[1])


def lift(S: Semiring, w: Tensor | Number, ref: Ref) -> Value:
    """lift(w): real local derivatives into the semiring (in message precision)."""
    return S.lift(as_message(w, ref))


def mul(S: Semiring, a: Value, b: Value) -> Value:
    """a ⊗ b, broadcasting."""
    return S.mul(a, b)


def add(S: Semiring, a: Value, b: Value) -> Value:
    """a ⊕ b, broadcasting."""
    return S.add(a, b)


def zero(S: Semiring, shape: Sequence[int], ref: Ref) -> Value:
    """The semiring zero (no path) of ``shape``."""
    return S.zero(shape, torch.empty((), dtype=message_dtype(ref[0]), device=ref[1]))


def sum(S: Semiring, a: Value, dims: Any = None, keepdim: bool = False) -> Value:
    """⊕ over ``dims``."""
    return S.sum(a, dims, keepdim)


def sum_to(S: Semiring, a: Value, shape: Sequence[int]) -> Value:
    """⊕ over the dims along which ``shape`` was broadcast (undoes a broadcast); ``a``
    itself where every component has ``shape`` (the common case, decided here without
    ``Semiring.sum_to``'s call where the semiring keeps that method)."""
    if type(S).sum_to is _SUM_TO:
        shape = tuple(shape)
        for c in a:
            if c.shape != shape:
                return S.sum_to(a, shape)
        return a
    return S.sum_to(a, shape)


def matmul(S: Semiring, a: Value, b: Value) -> Value:
    """⊕_k a[..., i, k] ⊗ b[..., k, j]."""
    return S.matmul(a, b)


def contract(S: Semiring, a: Value, b: Value, spec: Contraction) -> Value:
    """``out[c] = ⊕ a[spec.a] ⊗ b[spec.b]`` over the labels not in ``spec.out``: an einsum
    of two operands in the semiring, run as one semiring batched matmul (labels only one
    operand has and the output lacks are ⊕-reduced first; output labels neither has are a
    broadcast)."""
    if spec.summed(spec.b, spec.a):
        b = S.sum(expand(S, b, spec.size(spec.b)), spec.summed(spec.b, spec.a))
    return _contract(S, a, b, spec, S.matmul)


def contract_lift(S: Semiring, a: Value, w: Tensor, spec: Contraction, ref: Ref) -> Value:
    """contract(a, lift(w)), which the generator emits for that pattern: the matmul runs as
    the semiring's ``matmul_lift`` (no lift of w where w has labels of its own to ⊕ first)."""
    if spec.summed(spec.b, spec.a):
        return contract(S, a, lift(S, w, ref), spec)
    return _contract(S, a, (w,), spec, lambda x, y: S.matmul_lift(x, as_message(y[0], ref)))


def _contract(S: Semiring, a: Value, b: tuple, spec: Contraction, matmul) -> Value:
    """:func:`contract` once ``b`` has no labels of its own left: ``matmul`` multiplies the
    (batch, left, inner) and (batch, inner, right) blocks."""
    size = spec.size
    a = expand(S, a, size(spec.a))
    b = expand(S, b, size(spec.kept(spec.b, spec.a)))
    if spec.summed(spec.a, spec.b):
        a = S.sum(a, spec.summed(spec.a, spec.b))
    batch, left, inner, right = spec.layout()
    n, rows, inner_n, cols = (math.prod(size(labels)) for labels in (batch, left, inner, right))
    a = permute(S, a, contraction_dims(spec.kept(spec.a, spec.b), batch + left + inner))
    b = permute(S, b, contraction_dims(spec.kept(spec.b, spec.a), batch + inner + right))
    a = reshape(S, a, (n, rows, inner_n))
    b = reshape(S, b, (n, inner_n, cols))
    out = reshape(S, matmul(a, b), size(batch + left + right))
    out = permute(S, out, contraction_dims(batch + left + right, spec.present))
    if spec.present != spec.out:
        out = expand(S, reshape(S, out, spec.spread), size(spec.out))
    return out


def matmul_lift(S: Semiring, a: Value, w: Tensor, ref: Ref) -> Value:
    """matmul(a, lift(w)), which the generator emits for that pattern: a semiring may skip
    materialising lift(w) (the log-space semirings never take log|w| only to exp it)."""
    if w.dtype in OWN_PRECISION:  # weight_operands' answer, inline: (a, w) as they are
        return S.matmul_lift(a, w)
    return S.matmul_lift(*weight_operands(S, a, w, ref))


def weight_operands(S: Semiring, a: Value, w: Tensor, ref: Ref) -> tuple[Value, Tensor]:
    """``a`` and ``w`` in message precision for ``S.matmul_lift(a, w)``. A 2-D weight
    stored in lower precision (bfloat16, half) is converted after dropping the columns of
    ``a`` that ``S.matmul_lift`` drops (those without a term in any row that has one, where
    some row has none: see ``on_live_rows``) with their rows of ``w``: a read-out of one
    logit converts one row of an lm_head, not the whole weight."""
    terms = S.terms
    if terms is None or w.dim() != 2 or w.dtype in OWN_PRECISION:
        return a, as_message(w, ref)
    if w.dtype == message_dtype(w.dtype):
        return a, as_message(w, ref)
    found = live_rows(a, terms, w)
    if found is None or not found[2].numel():
        return a, as_message(w, ref)
    parts, _, rows = found
    kept = live_columns(tuple(p.reshape(-1, p.shape[-1])[rows] for p in parts), terms)
    if kept is None:
        return a, as_message(w, ref)
    return tuple(p.index_select(-1, kept) for p in parts), as_message(w[kept], ref)


def mul_lift(S: Semiring, a: Value, w: Tensor | Number, ref: Ref) -> Value:
    """mul(a, lift(w)), which the generator emits for that pattern (the signed semiring
    multiplies by a point without building lift(w) and its four corner products)."""
    if isinstance(w, Tensor):  # as_message's floating case, inline: this runs per node
        dtype = MESSAGE_DTYPES.get(w.dtype)
        if dtype is not None:
            return S.mul_lift(a, w.to(dtype))
    return S.mul_lift(a, as_message(w, ref))


def loo(S: Semiring, a: Value, dim: int) -> Value:
    """Leave-one-out ⊕ along ``dim`` (a 0-dim value is one element: no other, the zero)."""
    if a[0].dim() == 0:
        return tuple(c.squeeze(0) for c in S.loo(tuple(c.unsqueeze(0) for c in a), 0))
    return S.loo(a, dim)


def softmax_backward(S: Semiring, a: Value, probs: Tensor, dim: int) -> Value:
    """The message at softmax's input from ``a`` at its output ``probs`` along ``dim``
    (``Semiring.softmax_backward``)."""
    return S.softmax_backward(a, probs, dim)


def standardize(S: Semiring, a: Value, centred: Tensor, rstd: Tensor, dims: Any) -> Value:
    """The message at x from the message ``a`` at layer norm's n = c·s, through the
    composition whose nodes are nodes of the gradient graph (``Semiring.standardize``:
    μ = mean(x); c = x − μ; v = mean(c²); s = (v + eps)^(−1/2) over ``dims``).
    ``centred`` is c, ``rstd`` s."""
    return S.standardize(a, centred, rstd, dims)


def index_add(S: Semiring, a: Value, index: Tensor, size: int) -> Value:
    """⊕-scatter of rows of ``a`` into ``size`` rows at ``index``."""
    return S.index_add(a, index, size)


# The view primitives act on each component alike; one list comprehension each (no
# generator, no lambda per component): they run for most backward nodes.
def reshape(S: Semiring, a: Value, shape: Sequence[int]) -> Value:
    return tuple([c.reshape(shape) for c in a])


def permute(S: Semiring, a: Value, dims: Sequence[int]) -> Value:
    dims = tuple(dims)
    return tuple([c.permute(dims) for c in a])


def transpose(S: Semiring, a: Value, d0: int, d1: int) -> Value:
    return tuple([c.transpose(d0, d1) for c in a])


def expand(S: Semiring, a: Value, shape: Sequence[int]) -> Value:
    shape = tuple(shape)
    return tuple([c.expand(shape) for c in a])


def narrow(S: Semiring, a: Value, dim: int, start: int, length: int) -> Value:
    return tuple([c.narrow(dim, start, length) for c in a])


def index_select(S: Semiring, a: Value, dim: int, index: Tensor) -> Value:
    """The entries of ``a`` at ``index`` along ``dim`` (a gather of messages)."""
    return tuple([c.index_select(dim, index) for c in a])


def flip(S: Semiring, a: Value, dims: Sequence[int]) -> Value:
    dims = tuple(dims)
    return tuple([c.flip(dims) for c in a])


def roll(S: Semiring, a: Value, shifts: Any, dims: Any) -> Value:
    return tuple([c.roll(shifts, dims) for c in a])


def getitem_backward(S: Semiring, a: Value, shape: Sequence[int], index: Any) -> Value:
    """Semiring zero of ``shape`` with ``a`` placed at ``[index]`` (basic indexing)."""
    out = []
    for z, c in zip(S.zero(shape, a[0]), a):
        z = c.new_empty(shape).copy_(z)  # batched as c is under torch.vmap
        z[index] = c
        out.append(z)
    return tuple(out)


def cat(S: Semiring, parts: Sequence[Value], dim: int) -> Value:
    return tuple(torch.cat(cs, dim) for cs in zip(*parts))


def split(S: Semiring, a: Value, sizes: Sequence[int], dim: int) -> list[Value]:
    pieces = [c.split(list(sizes), dim) for c in a]
    return [tuple(p) for p in zip(*pieces)]


def unbind(S: Semiring, a: Value, dim: int) -> list[Value]:
    return [tuple(p) for p in zip(*(c.unbind(dim) for c in a))]


def stack(S: Semiring, parts: Sequence[Value], dim: int) -> Value:
    return tuple(torch.stack(cs, dim) for cs in zip(*parts))


def fill_zero(
    S: Semiring, parts: Sequence[Value | None], shapes: Sequence[Sequence[int]], ref: Ref
) -> list[Value]:
    """Replace symbolic zeros (None) by materialised semiring zeros of the given shapes."""
    return [zero(S, s, ref) if p is None else p for p, s in zip(parts, shapes)]


def cast(S: Semiring, a: Value, dtype: torch.dtype, device: torch.device) -> Value:
    """The message of a dtype/device cast's input (identity edges): components moved to
    ``device``; wrapping the result as the input's message puts floating components in the
    message precision of ``dtype``."""
    return tuple([c.to(device) for c in a])
