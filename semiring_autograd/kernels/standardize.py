"""Layer norm's composition for MaxProduct, Log and Entropy on fused CPU operators
(``standardize.h``): the message at x from the message at n = c·s, one operator call per
tensor where the composition (``Semiring.standardize``) takes about fifteen passes.

Each takes the message (Entropy: its two components), c = x − μ of the message's shape and
s = (mean(c²) + eps)^(−1/2) with the normalised dims kept at size 1, all CPU float32/float64
of one dtype, normalised over the trailing ``dims``; it returns None otherwise, where the
kernels are off, unbuilt or failed their check (``kernels``'s modes), or (Log, Entropy)
where a row's terms hold NaN or +inf, its s is not finite and positive, or (Entropy) its r
is not finite: the callers then run the composition. MaxProduct's
results are the composition's to the bit; Log's and Entropy's logs and exponentials are the
kernels' series (within a few ulp of torch's).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from . import _nonempty_ready
from .operators import op


def _rows(a: Tensor, centred: Tensor, rstd: Tensor, dims: Any) -> int | None:
    """The row length (the product of the normalised trailing dims) when ``a``, ``centred``
    and ``rstd`` are the operands of a row kernel, else None."""
    if isinstance(dims, int):
        dims = (dims,)
    rank = a.dim()
    if dims is None or not len(dims) or rank < len(dims) or centred.shape != a.shape:
        return None
    if any(not -rank <= d < rank for d in dims):
        return None
    count = len(dims)
    if sorted(d % rank for d in dims) != list(range(rank - count, rank)):
        return None
    if rstd.shape != (*a.shape[: rank - count], *(1,) * count):
        return None
    n = math.prod(a.shape[rank - count :])
    return n if n > 0 else None


def standardize_max(a: Tensor, centred: Tensor, rstd: Tensor, dims: Any) -> Tensor | None:
    """MaxProduct's message at x from ``a`` at n = c·s: g_s = max_j a_j·|c_j|, g_c,j =
    max(a_j·s, g_s·|−s³/2|·|2c_j/n|), out_j = max(g_c,j, (max_j g_c,j)·(1/n)), by the fused CPU
    kernel; None where it does not apply."""
    n = _rows(a, centred, rstd, dims)
    if n is None or not _nonempty_ready("standardize_max", a, centred, rstd):
        return None
    out = op("standardize_max")(
        a.contiguous().view(-1, n), centred.contiguous().view(-1, n), rstd.contiguous()
    )
    return out.view(a.shape)


def standardize_log(a: Tensor, centred: Tensor, rstd: Tensor, dims: Any) -> Tensor | None:
    """Log's message at x from ``a`` at n = c·s (the composition with ⊕ = logaddexp and ⊗
    lift(w) = + log|w|), by the fused CPU kernel; None where it does not apply or a row's
    terms hold NaN or +inf (or its s is not finite and positive)."""
    n = _rows(a, centred, rstd, dims)
    if n is None or not _nonempty_ready("standardize_log", a, centred, rstd):
        return None
    out, declined = op("standardize_log")(
        a.contiguous().view(-1, n), centred.contiguous().view(-1, n), rstd.contiguous()
    )
    return None if declined else out.view(a.shape)


def entropy_standardize(
    la: Tensor, r: Tensor, centred: Tensor, rstd: Tensor, dims: Any
) -> tuple[Tensor, Tensor] | None:
    """Entropy's message (log Z, r) at x from (``la``, ``r``) at n = c·s, by the fused CPU
    kernel; None where it does not apply, or a row's terms hold NaN or +inf or its r is not
    finite."""
    n = _rows(la, centred, rstd, dims)
    if n is None or r.shape != la.shape:
        return None
    if not _nonempty_ready("entropy_standardize", la, r, centred, rstd):
        return None
    out_l, out_r, declined = op("entropy_standardize")(
        la.contiguous().view(-1, n),
        r.contiguous().view(-1, n),
        centred.contiguous().view(-1, n),
        rstd.contiguous(),
    )
    return None if declined else (out_l.view(la.shape), out_r.view(la.shape))
