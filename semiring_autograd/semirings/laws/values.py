"""Values in the law checker: picking elements of a semiring value, comparing two values
(equal infinities agree, NaN never does) and printing counterexamples."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from ..base import Value

# Numbers printed per component tensor in a counterexample.
_MAX_PRINTED = 48


def fmt_number(x: float | bool | int) -> str:
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if math.isnan(x) or math.isinf(x):
        return str(x)
    return f"{x:.17g}" if x == int(x) and abs(x) < 1e15 else f"{x:.10g}"


def fmt_tensor(t: Tensor) -> str:
    """A tensor as nested lists (truncated when large)."""
    t = t.detach().cpu()
    if t.dim() == 0:
        return fmt_number(t.item())
    flat = [fmt_number(x) for x in t.reshape(-1).tolist()[:_MAX_PRINTED]]
    if t.numel() > _MAX_PRINTED:
        return f"<shape {tuple(t.shape)}: {', '.join(flat)}, ...>"
    it = iter(flat)

    def nest(shape: Sequence[int]) -> str:
        if not shape:
            return next(it)
        return "[" + ", ".join(nest(shape[1:]) for _ in range(shape[0])) + "]"

    return nest(tuple(t.shape))


def fmt_value(v: Value | Tensor, index: tuple[int, ...] | None = None) -> str:
    """A value (tuple of components) or real tensor, at ``index`` when given."""
    if isinstance(v, Tensor):
        return fmt_tensor(v if index is None else v[index])
    try:
        shape = value_shape(v)
        comps = [c.expand(shape) for c in v]
    except Exception:  # shapes do not broadcast: print them as they are
        comps = list(v)
        index = None
    if index is not None:
        comps = [c[index] for c in comps]
    return "(" + ", ".join(fmt_tensor(c) for c in comps) + ("," if len(comps) == 1 else "") + ")"


# ----- values -----------------------------------------------------------------------------


def value_shape(v: Value) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*(c.shape for c in v)))


def take(v: Value, index: Tensor | tuple) -> Value:
    """Elements ``index`` of a value (each component broadcast to the value's shape first)."""
    shape = value_shape(v)
    return tuple(c.expand(shape)[index] for c in v)


def at(v: Value, *index: int | slice) -> Value:
    """``v[..., *index]`` for every component."""
    shape = value_shape(v)
    return tuple(c.expand(shape)[(Ellipsis, *index)] for c in v)


def expand(v: Value, shape: Sequence[int]) -> Value:
    return tuple(c.expand(tuple(shape)) for c in v)


def where(mask: Tensor, a: Value, b: Value) -> Value:
    """Elementwise choice between two values of the same shape."""
    return tuple(torch.where(mask, ca, cb) for ca, cb in zip(a, b))


def stack(values: Sequence[Value], dim: int) -> Value:
    shape = torch.broadcast_shapes(*(value_shape(v) for v in values))
    return tuple(
        torch.stack([v[i].expand(shape) for v in values], dim) for i in range(len(values[0]))
    )


def mismatch(
    lhs: Value, rhs: Value, rtol: float, atol: float
) -> tuple[str, tuple[int, ...] | None] | None:
    """``None`` when the values agree, else (reason, first differing index or None).

    Equal infinities are equal, bool and integer components must match exactly, floating
    components up to |l - r| <= atol + rtol·max(|l|, |r|); a NaN on either side differs."""
    if len(lhs) != len(rhs):
        return f"{len(lhs)} components vs {len(rhs)}", None
    try:
        sl, sr = value_shape(lhs), value_shape(rhs)
    except RuntimeError as e:
        return f"components do not broadcast ({e})", None
    if sl != sr:
        return f"shape {sl} vs {sr}", None
    bad = torch.zeros(sl, dtype=torch.bool, device=lhs[0].device)
    reasons: list[str] = []
    for i, (cl, cr) in enumerate(zip(lhs, rhs)):
        cl, cr = cl.expand(sl), cr.to(cl.device).expand(sl)
        if cl.is_floating_point() != cr.is_floating_point() or (cl.dtype == torch.bool) != (
            cr.dtype == torch.bool
        ):
            return f"component {i} dtype {cl.dtype} vs {cr.dtype}", None
        if not cl.is_floating_point():
            diff = cl != cr
        else:
            cl64, cr64 = cl.double(), cr.double()
            nan = torch.isnan(cl64) | torch.isnan(cr64)
            if nan.any():
                reasons.append(f"NaN in component {i}")
            finite = torch.isfinite(cl64) & torch.isfinite(cr64)
            scale = torch.maximum(cl64.abs(), cr64.abs())
            dl = torch.where(finite, cl64, torch.zeros_like(cl64))
            dr = torch.where(finite, cr64, torch.zeros_like(cr64))
            close = torch.where(finite, (dl - dr).abs() <= atol + rtol * scale, cl64 == cr64)
            diff = nan | ~close
        bad |= diff
    if not bad.any():
        return None
    first = tuple(int(i) for i in bad.nonzero()[0].tolist())
    return ("; ".join(reasons) or "values differ"), first


def nan_index(v: Value | Tensor) -> tuple[int, ...] | None:
    comps = (v,) if isinstance(v, Tensor) else v
    for c in comps:
        if c.is_floating_point() and torch.isnan(c).any():
            return tuple(int(i) for i in torch.isnan(c).nonzero()[0].tolist())
    return None


# ----- the checker ------------------------------------------------------------------------


def at_row(v: Value, i: int) -> Value:
    shape = value_shape(v)
    return tuple(c.expand(shape)[i] for c in v)
