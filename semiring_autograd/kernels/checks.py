"""Self-checks of the fused kernels against the torch formulas they replace.

``verified(name, device, dtype, call)`` says whether the fused kernel ``name`` may compute
for operands on ``device`` of ``dtype``. In ``check`` mode (``SEMIRING_AUTOGRAD_KERNELS``,
the default) the first use per (name, device, dtype) in a process runs the kernel through
``call`` (the operator the wrapper calls) on small deterministic operands (batches of 2,
5×7×9, column and row tails, exact zeros, NaN and empty markers, declined rows) and
compares its results with the torch formula it replaces (``_CHECKS`` maps each kernel to
its check): the matmuls, max and min of identical products, and the exact kernels to the
value; the kernels with a log or exp series of their own within 8 ulp of each entry's
scale (their docstrings promise 2 to 4). A mismatch or an exception gives one
RuntimeWarning naming the kernel, device and dtype, and the verdict False for the rest of
the process: the wrappers then return None and the callers use their torch formulas.
``trust`` mode takes every kernel without a check. The check runs under a lock, outside
any dispatch mode (a compiled backward's recorder, fake tensors) and without autograd; its
verdict is cached. Where it cannot run (while torch.compile traces, or a CUDA graph
captures), the kernel is not used for that call and the check waits for a later one.
"""

from __future__ import annotations

import threading
import warnings
import zlib
from typing import Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

NAN, INF = float("nan"), float("inf")

#: (name, device, dtype) -> whether the kernel agreed with its formula
_VERDICTS: dict[tuple, bool] = {}
_LOCK = threading.Lock()


def device_name(device: torch.device) -> str:
    """``cuda:0 (NVIDIA H100 80GB HBM3)``, ``cpu (AMD EPYC 7B13)``; the device otherwise."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    if device.type == "cpu":
        from .build import cpu_model

        return f"cpu ({cpu_model()})"
    return str(device)


def verified(name: str, device: torch.device, dtype: torch.dtype, call: Callable) -> bool:
    """Whether kernel ``name`` agrees with its formula on ``device`` for ``dtype`` (checked
    on first use, then cached); False after a mismatch or an exception (one warning)."""
    key = (name, device, dtype)
    verdict = _VERDICTS.get(key)
    if verdict is not None:
        return verdict
    if torch.compiler.is_compiling() or (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    ):
        return False
    with _LOCK:
        verdict = _VERDICTS.get(key)
        if verdict is None:
            try:
                problem = mismatch(name, device, dtype, call)
            except Exception as error:  # noqa: BLE001 -- a kernel that raises is not used
                problem = f"raised {type(error).__name__}: {str(error)[:500]}"
            verdict = problem is None
            if problem is not None:
                fail(key, f"failed its self-check ({problem})")
            _VERDICTS[key] = verdict
    return verdict


def fail(key: tuple, what: str) -> None:
    """Record kernel ``key`` = (name, device, dtype) as unusable, with one warning."""
    _VERDICTS[key] = False
    name, device, dtype = key
    warnings.warn(
        f"semiring_autograd: the fused kernel {name} on {device_name(device)}, {dtype}, "
        f"{what}; the torch formulas are used for it from now on in this process.",
        RuntimeWarning,
        stacklevel=4,
    )


def failed(key: tuple) -> bool:
    """Whether kernel ``key`` = (name, device, dtype) failed its check or a call."""
    return _VERDICTS.get(key) is False


def reset() -> None:
    """Forget every verdict: the next use of each kernel checks it again."""
    with _LOCK:
        _VERDICTS.clear()


def mismatch(
    name: str, device: torch.device, dtype: torch.dtype, call: Callable, seed: int | None = None
) -> str | None:
    """Run kernel ``name`` through ``call`` on the check's operands (drawn from ``seed``,
    by default one per name) and compare with its formula: None when they agree, else
    where they differ."""
    with _disable_current_modes(), torch.no_grad():
        gen = torch.Generator("cpu").manual_seed(
            zlib.crc32(name.encode()) if seed is None else seed
        )
        return _CHECKS[name](_Case(gen, dtype, device, call))


class _Case:
    """The operands of one check: drawn on the CPU from ``gen``, run on ``device``."""

    def __init__(self, gen: torch.Generator, dtype: torch.dtype, device, call: Callable):
        self.gen, self.dtype, self.device, self.call = gen, dtype, device, call
        self.eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0

    def randn(self, *shape: int, zeros: float = 0.0) -> Tensor:
        x = torch.randn(shape, generator=self.gen, dtype=torch.float64, device="cpu")
        x = x.masked_fill(self.where(zeros, shape), 0.0)
        return x.to(self.dtype)

    def rand(self, *shape: int) -> Tensor:
        return torch.rand(shape, generator=self.gen, dtype=torch.float64, device="cpu").to(
            self.dtype
        )

    def where(self, p: float, shape) -> Tensor:
        return torch.rand(tuple(shape), generator=self.gen, device="cpu") < p

    def run(self, *args):
        """The kernel on ``args`` moved to the device; tensors come back to the CPU, and
        so do the arguments it wrote into (returned second)."""
        moved = [_to(a, self.device) for a in args]
        out = self.call(*moved)
        back = [a.cpu() if isinstance(a, Tensor) else a for a in moved]
        if isinstance(out, (tuple, list)):
            return tuple(o.cpu() if isinstance(o, Tensor) else o for o in out), back
        return (out.cpu() if isinstance(out, Tensor) else out), back


def _to(x, device):
    """``x`` on ``device``: a tensor, or each tensor of a list."""
    if isinstance(x, Tensor):
        return x.to(device, copy=True)
    if isinstance(x, list):
        return [_to(t, device) for t in x]
    return x


def _differs(what: str, got: Tensor, expected: Tensor, tol: Tensor | float = 0.0) -> str | None:
    """Where ``got`` and ``expected`` differ by more than ``tol`` (NaN equals NaN,
    infinities must match); None when they agree everywhere."""
    if tuple(got.shape) != tuple(expected.shape):
        return f"{what} has shape {tuple(got.shape)}, the torch formula {tuple(expected.shape)}"
    g, e = got.double(), expected.double()
    both_nan = torch.isnan(g) & torch.isnan(e)
    close = (g == e) | both_nan | ((g - e).abs() <= tol)
    if bool(close.all()):
        return None
    index = tuple(int(i) for i in (~close).nonzero()[0])
    got_value, expected_value = g[index].item(), e[index].item()
    return f"{what}{list(index)} = {got_value!r} where the torch formula gives {expected_value!r}"


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p is not None), None)


def _ulps(case: _Case, n: float, scale: Tensor) -> Tensor:
    """n ulp of ``scale`` (per entry), at least a subnormal step."""
    tiny = torch.finfo(case.dtype).tiny * case.eps
    return n * case.eps * scale.double().abs().nan_to_num(posinf=0.0) + tiny


# ----- the formulas: the torch computations the kernels replace -----


def max_times_formula(a: Tensor, b: Tensor, init: float, abs_b: bool) -> Tensor:
    """max(init, max_k a[., i, k]·b'[., k, j]) with b' = |b| when ``abs_b``; a NaN product
    never wins."""
    p = a[:, :, :, None] * (b.abs() if abs_b else b)[:, None, :, :]
    p = p.masked_fill(torch.isnan(p), init)
    return p.amax(dim=2).clamp_min(init)


def signed_formula(a_hi: Tensor, a_lo: Tensor, b_hi: Tensor, b_lo: Tensor) -> tuple:
    """(max_k, min_k) of the four corner products of (a_hi, a_lo) and (b_hi, b_lo); a term
    with a NaN corner is empty; an output without a term is (-inf, +inf)."""
    ah, al = a_hi[:, :, :, None], a_lo[:, :, :, None]
    bh, bl = b_hi[:, None, :, :], b_lo[:, None, :, :]
    corners = torch.stack([ah * bh, ah * bl, al * bh, al * bl])
    empty = torch.isnan(corners).any(0)
    top = corners.amax(0).masked_fill(empty, -INF).amax(2)
    bottom = corners.amin(0).masked_fill(empty, INF).amin(2)
    return top, bottom


def _check_max_times(c: _Case) -> str | None:
    problems = []
    for batch, m, k, n in ((2, 5, 7, 9), (1, 6, 19, 37)):
        a = c.randn(batch, m, k, zeros=0.2).abs()
        a.view(-1)[3] = NAN
        b = c.randn(batch, k, n, zeros=0.2)
        for init, abs_b in ((0.0, True), (0.0, False), (-INF, False)):
            got, _ = c.run(a, b, init, abs_b)
            expected = max_times_formula(a, b, init, abs_b)
            problems.append(_differs(f"max_times(init={init}, abs_b={abs_b})", got, expected))
    return _first(*problems)


def _check_max_times_finite(c: _Case) -> str | None:
    """Finite operands: max_times to the value and no flag; a NaN or an infinity in a,
    or in b (a real column, not the padding), raises the flag."""
    problems, operands = [], []
    for batch, m, k, n in ((2, 5, 7, 9), (1, 6, 19, 37)):
        a = c.randn(batch, m, k, zeros=0.2).abs()
        b = c.randn(batch, k, n, zeros=0.2)
        operands.append((a, b))
        for init, abs_b in ((0.0, True), (0.0, False), (-INF, False)):
            (got, flagged), _ = c.run(a, b, init, abs_b)
            if bool(flagged):
                return "max_times_finite flagged finite operands"
            expected = max_times_formula(a, b, init, abs_b)
            problems.append(
                _differs(f"max_times_finite(init={init}, abs_b={abs_b})", got, expected)
            )
    return _first(*problems) or _missed_flag(c, "max_times_finite", operands, (0.0, True))


def _missed_flag(
    c: _Case, name: str, operands: list, rest: tuple, components: bool = False
) -> str | None:
    """Where the kernel misses a NaN or an infinity put into one of its operands (passed
    as lists of their components along the first dim with ``components``)."""
    for pair in operands:
        for which, at, value in ((0, -1, NAN), (0, 4, INF), (1, -1, -INF), (1, 3, NAN)):
            bent = [pair[0].clone(), pair[1].clone()]
            bent[which].view(-1)[at] = value
            args = [list(t) for t in bent] if components else bent
            (_, flagged), _ = c.run(*args, *rest)
            if not bool(flagged):
                return f"{name} missed {value} in {'ab'[which]}"
    return None


def k_best_formula(a: Tensor, b: Tensor, k: int, abs_b: bool) -> Tensor:
    """(k, B, m, n): the k largest of a[r, ., i, q]·b'[s, ., q, j] over (q, r, s), best
    first, 0 where fewer than k (b' = |b| when ``abs_b``)."""
    b = b.abs() if abs_b else b
    p = a[:, None, :, :, :, None] * b[None, :, :, None, :, :]  # (ka, kb, B, m, l, n)
    lists = p.permute(2, 3, 5, 0, 1, 4).flatten(3)
    lists = torch.cat([lists, lists.new_zeros((*lists.shape[:3], k))], -1)
    return lists.topk(k, dim=-1).values.permute(3, 0, 1, 2)


def _k_best_lists(c: _Case, *shape: int) -> Tensor:
    """Lists of weights (shape[0] components, best first) with exact ties and zeros."""
    x = (c.rand(*shape) * 4).floor() / 4
    return x.sort(0, descending=True).values


def _check_k_best_times(c: _Case) -> str | None:
    problems = []
    for (ka, batch, m, l), (kb, bb, n), k in (
        ((3, 2, 5, 7), (1, 1, 9), 3),
        ((2, 1, 6, 19), (2, 1, 37), 5),
        ((1, 2, 3, 4), (3, 2, 17), 7),
        ((3, 1, 70, 40), (1, 1, 19), 4),  # rows in tiles, the lists read transposed
    ):
        a = _k_best_lists(c, ka, batch, m, l)
        a[:, :, :, 1] = 0.0  # a dead index
        b = c.randn(kb, bb, l, n, zeros=0.2)
        b = b if kb == 1 else b.abs().sort(0, descending=True).values
        lists = [x.mT.contiguous().mT for x in a] if m > 64 else list(a)
        for abs_b in (True, False):
            operand = b if abs_b else b.abs()
            (got, flagged), _ = c.run(lists, list(operand), k, abs_b, True)
            if bool(flagged):
                return "k_best_times flagged finite operands"
            want = k_best_formula(a, operand, k, abs_b)
            problems.append(_differs(f"k_best_times(k={k}, abs_b={abs_b})", got, want))
    return _first(*problems) or _missed_flag(
        c, "k_best_times", [(a, b)], (k, True, True), components=True
    )


def _check_k_best_add(c: _Case) -> str | None:
    problems, cases = [], []
    for k, count in ((1, 37), (5, 300), (8, 2 * 256 + 7)):
        a, b = _k_best_lists(c, k, count), _k_best_lists(c, k, count)
        a[:, :3] = 0.0  # no path
        b[:, 5] = a[:, 5]  # ties across the lists
        (got, flagged), _ = c.run(list(a), list(b))
        if bool(flagged):
            return "k_best_add flagged descending lists"
        want = torch.cat([a, b]).topk(k, dim=0).values
        problems.append(_differs(f"k_best_add(k={k})", got, want))
        cases.append((k, a, b))
    return _first(*problems) or _missed_nan(c, cases)


def k_best_loo_formula(lists: Tensor) -> Tensor:
    """(k, rows, n) descending lists → (k, rows, n): per row and position j the k largest
    entries of the lists at the other positions, zeros appended (``torch.topk`` over each
    j's pool, its own entries set to 0, no path)."""
    k, rows, n = lists.shape
    others = lists.permute(1, 2, 0)[:, None].expand(rows, n, n, k)  # (row, j, j', t)
    own = torch.eye(n, dtype=torch.bool, device=lists.device)[None, :, :, None]
    pool = others.masked_fill(own, 0.0).reshape(rows, n, n * k)
    pool = torch.cat([pool, pool.new_zeros(rows, n, k)], -1)
    return pool.topk(k, dim=-1).values.permute(2, 0, 1)


def _check_k_best_loo(c: _Case) -> str | None:
    problems = []
    for k, rows, n in ((1, 3, 5), (3, 4, 1), (5, 2, 17), (4, 3, 40)):
        lists = _k_best_lists(c, k, rows, n)
        lists[:, 0, :2] = 0.0  # no path
        if n > 3:
            lists[:, :, 3] = lists[:, :, 1]  # equal lists at two positions
        (got, flagged), _ = c.run(list(lists))
        if bool(flagged):
            return "k_best_loo flagged descending lists"
        problems.append(_differs(f"k_best_loo(k={k}, n={n})", got, k_best_loo_formula(lists)))
    if _first(*problems):
        return _first(*problems)
    lists = _k_best_lists(c, 3, 2, 6)
    for bad in ("nan", "order"):
        wrong = lists.clone()
        wrong[2, 1, 4] = NAN if bad == "nan" else wrong[0, 1, 4] + 1.0
        (_, flagged), _ = c.run(list(wrong))
        if not bool(flagged):
            return f"k_best_loo missed {'a NaN' if bad == 'nan' else 'a list out of order'}"
    return None


def k_best_softmax_backward_formula(lists: Tensor, p: Tensor) -> Tensor:
    """(k, rows, n) descending lists at softmax's output p (rows, n) → (k, rows, n):
    Semiring.softmax_backward's formula, the k best of lists·|p(1 − p)| and of the
    leave-one-out k best of lists·|p| times |−p|."""
    own = lists * (p * (1 - p)).abs()
    rest = k_best_loo_formula(lists * p.abs()) * (-p).abs()
    return torch.cat([own, rest]).topk(lists.shape[0], dim=0).values


def _check_k_best_softmax_backward(c: _Case) -> str | None:
    problems = []
    for k, rows, n in ((1, 3, 5), (3, 4, 1), (5, 2, 17), (4, 3, 300)):
        lists = _k_best_lists(c, k, rows, n)
        lists[:, 0, :2] = 0.0  # no path
        p = c.rand(rows, n)
        p = p / p.sum(-1, keepdim=True)
        p[0, 3 % n], p[-1, 0] = 0.0, 1.0  # excluded, and certain
        (got, flagged), _ = c.run(list(lists), p)
        if bool(flagged):
            return "k_best_softmax_backward flagged descending lists"
        want = k_best_softmax_backward_formula(lists, p)
        problems.append(_differs(f"k_best_softmax_backward(k={k}, n={n})", got, want))
    if _first(*problems):
        return _first(*problems)
    lists, p = _k_best_lists(c, 3, 2, 6), c.rand(2, 6)
    for bad in ("nan", "order"):
        wrong = lists.clone()
        wrong[2, 1, 4] = NAN if bad == "nan" else wrong[0, 1, 4] + 1.0
        (_, flagged), _ = c.run(list(wrong), p)
        if not bool(flagged):
            return f"k_best_softmax_backward missed {'a NaN' if bad == 'nan' else 'a list out of order'}"
    return None


def _missed_nan(c: _Case, cases: list) -> str | None:
    """Where k_best_add misses a NaN put first into a list a or last into a list b."""
    for k, a, b in cases:
        for which in (0, 1):
            pair = [a.clone(), b.clone()]
            pair[which][(k - 1) * which, 4 + which] = NAN
            (_, flagged), _ = c.run(list(pair[0]), list(pair[1]))
            if not bool(flagged):
                return f"k_best_add missed a NaN in {'ab'[which]} (k={k})"
    return None


def _signed_pair(c: _Case, shape, empty: float) -> tuple[Tensor, Tensor]:
    hi = c.randn(*shape, zeros=0.15)
    lo = hi - c.rand(*shape).masked_fill(hi == 0, 0.0)
    mask = c.where(empty, shape)
    return hi.masked_fill(mask, NAN), lo.masked_fill(mask, NAN)


def _check_signed_times(c: _Case) -> str | None:
    problems = []
    for batch, m, k, n in ((2, 5, 7, 9), (1, 6, 19, 37)):
        a_hi, a_lo = _signed_pair(c, (batch, m, k), 0.3)
        a_hi[0, 1], a_lo[0, 1] = NAN, NAN  # a row without terms
        b_hi, b_lo = _signed_pair(c, (batch, k, n), 0.3)
        for point in (True, False):
            got, _ = c.run(a_hi, a_lo, b_hi, None if point else b_lo)
            expected = signed_formula(a_hi, a_lo, b_hi, b_hi if point else b_lo)
            for end, g, e in zip(("max", "min"), got, expected):
                problems.append(_differs(f"signed_times {end}", g, e))
    return _first(*problems)


def _check_lift_times(c: _Case) -> str | None:
    problems = []
    for batch, m, k, n in ((2, 5, 7, 9), (1, 6, 19, 37)):
        a_hi, a_lo = _signed_pair(c, (batch, m, k), 0.0)
        empty = c.where(0.25, a_hi.shape)
        empty[0, 2] = True  # a row without terms
        given = a_hi.masked_fill(empty, -INF), a_lo.masked_fill(empty, INF)
        nan_hi, nan_lo = a_hi.masked_fill(empty, NAN), a_lo.masked_fill(empty, NAN)
        for w_batch, strided in ((batch, False), (1, True)):
            w = c.randn(w_batch, n, k, zeros=0.2).mT
            w = w if strided else w.contiguous()
            for zero_empty in (True, False):
                got, _ = c.run(*given, w, zero_empty)
                point = w.masked_fill(w == 0, NAN) if zero_empty else w
                point = point.expand(batch, k, n)
                expected = signed_formula(nan_hi, nan_lo, point, point)
                for end, g, e in zip(("max", "min"), got, expected):
                    problems.append(_differs(f"lift_times {end}", g, e))
    return _first(*problems)


def signed_mul_lift_formula(a_hi: Tensor, a_lo: Tensor, w: Tensor) -> tuple:
    """(hi, lo)·lift(w): w > 0 keeps the ends, w < 0 swaps them, each times w; w = 0 is the
    empty (-inf, +inf) unless an end is NaN."""
    pos = w > 0
    hi = torch.where(pos, a_hi, a_lo) * w
    lo = torch.where(pos, a_lo, a_hi) * w
    zero = (w == 0) & ~(torch.isnan(a_hi) | torch.isnan(a_lo))
    return hi.masked_fill(zero, -INF), lo.masked_fill(zero, INF)


def _check_signed_mul_lift(c: _Case) -> str | None:
    problems = []
    for a_shape, w_shape in (((2, 5, 9), (2, 5, 9)), ((2, 5, 9), (5, 1))):
        hi, lo = _signed_pair(c, a_shape, 0.0)
        empty = c.where(0.2, a_shape)
        hi, lo = hi.masked_fill(empty, -INF), lo.masked_fill(empty, INF)
        hi.view(-1)[4], lo.view(-1)[6] = NAN, NAN
        w = c.randn(*w_shape, zeros=0.25)
        w.view(-1)[1] = -0.0
        got, _ = c.run(hi, lo, w)
        expected = signed_mul_lift_formula(hi, lo, w)
        for end, g, e in zip(("hi", "lo"), got, expected):
            problems.append(_differs(f"signed_mul_lift {end}", g, e))
    return _first(*problems)


def _check_entropy_mul_lift(c: _Case) -> str | None:
    problems = []
    shapes = (((2, 5, 9), (2, 5, 9)), ((2, 5, 9), (5, 1)), ((2, 5, 37), (37,)), ((2, 5, 9), ()))
    for a_shape, w_shape in shapes:
        la = c.randn(*a_shape) * 5
        la.view(-1)[:3] = -INF  # no path
        r = c.rand(*a_shape).masked_fill(la == -INF, 0.0)
        w = c.randn(*w_shape, zeros=0.2) * 10.0 ** c.randn(*w_shape).clamp(-3, 3)
        if w.dim():  # (a NaN scalar leaves no finite result)
            w.view(-1)[-1] = NAN
        got, _ = c.run(la, r, w)
        log_w = torch.log(w.double().abs())
        new_la = la.double() + log_w
        new_r = torch.where(new_la == -INF, 0.0, r.double() - log_w)
        scale = la.double().abs().nan_to_num(posinf=0.0) + log_w.abs().nan_to_num(posinf=0.0)
        tol = _ulps(c, 8, scale + r.double())
        problems.append(_differs("entropy_mul_lift log Z", got[0], new_la, tol))
        problems.append(_differs("entropy_mul_lift r", got[1], new_r, tol))
    return _first(*problems)


def _check_plus_log_abs(c: _Case) -> str | None:
    problems = []
    for count in (5 * 9, 2 * 5 * 37):  # a vector tail; several vectors and a tail
        a = c.randn(count) * 5
        a[:3] = -INF  # no path
        a[3] = NAN
        w = c.randn(count, zeros=0.2) * 10.0 ** c.randn(count).clamp(-3, 3)
        w[4], w[5], w[6], w[7] = -0.0, INF, -INF, NAN
        w[8] = torch.finfo(c.dtype).tiny * c.eps  # subnormal
        log_w = torch.log(w.double().abs())
        for given in (a, None):
            got, _ = c.run(given, w)
            want = log_w if given is None else given.double() + log_w
            scale = log_w.abs() + (0.0 if given is None else given.double().abs())
            problems.append(_differs("plus_log_abs", got, want, _ulps(c, 8, scale)))
    return _first(*problems)


def _check_log_add(c: _Case) -> str | None:
    problems = []
    for count in (5 * 9, 2 * 5 * 37):
        a, b = c.randn(count) * 30, c.randn(count) * 30
        b[: count // 3] = a[: count // 3] + c.randn(count // 3) * 1e-3  # close: log1p near log 2
        b[-3:] = a[-3:]  # ties
        a[:4], b[2:6] = -INF, -INF  # one or both without a path
        a[6], b[7], a[8], b[8] = INF, INF, INF, -INF
        a[9], b[10], a[11], b[11] = NAN, NAN, INF, INF
        b[12] = a[12] - 80.0  # t below the rounding of 1 + t
        got, _ = c.run(a, b)
        want = torch.logaddexp(a.double(), b.double())
        scale = torch.maximum(a.double().abs(), b.double().abs()) + want.abs()
        problems.append(_differs("log_add", got, want, _ulps(c, 8, scale)))
    return _first(*problems)


def _check_log_add_rows(c: _Case) -> str | None:
    rows, n, past = 3, 2 * 16 + 5, 7  # vectors and a tail per row; a row stride past n
    a, b = c.randn(rows, n) * 30, c.randn(rows, n) * 30
    b[0, :9] = a[0, :9] + c.randn(9) * 1e-3  # close: log1p near log 2
    a[1, :4], b[1, 2:6] = -INF, -INF  # one or both without a path
    a[1, 6], b[1, 7], a[1, 8], b[1, 8] = INF, INF, INF, -INF
    a[2, 0], b[2, 1], b[2, 2] = NAN, NAN, a[2, 2] - 80.0
    problems = []
    for spread in (False, True):  # b's first row read by every row (row stride 0)
        b_rows = b[:1].expand(rows, n) if spread else b
        want = torch.logaddexp(a.double(), b_rows.double())
        scale = torch.maximum(a.double().abs(), b_rows.double().abs()) + want.abs()
        wide = [_to(torch.full((rows, n + past), 5.0, dtype=c.dtype), c.device) for _ in "ao"]
        wide[0][:, :n] = _to(a, c.device)
        moved_b = _to(b, c.device)
        b_view = moved_b[:1].expand(rows, n) if spread else moved_b
        c.call(wide[1][:, :n], wide[0][:, :n], b_view)  # into another tensor's rows
        problems.append(_differs("log_add_rows_", wide[1][:, :n].cpu(), want, _ulps(c, 8, scale)))
        untouched = torch.full((rows, past), 5.0, dtype=c.dtype)
        problems.append(_differs("log_add_rows_ past its rows", wide[1][:, n:].cpu(), untouched))
        c.call(wide[0][:, :n], wide[0][:, :n], b_view)  # in place
        problems.append(
            _differs("log_add_rows_ in place", wide[0][:, :n].cpu(), want, _ulps(c, 8, scale))
        )
    return _first(*problems)


def _entropy_add_oracle(la: Tensor, ra: Tensor, lb: Tensor, rb: Tensor) -> tuple[Tensor, Tensor]:
    """Entropy's ⊕ in float64: log Z by logaddexp, r the Z-weighted mean (0 with no path)."""
    l64, m64 = la.double(), lb.double()
    r = torch.sigmoid(l64 - m64) * ra.double() + torch.sigmoid(m64 - l64) * rb.double()
    return torch.logaddexp(l64, m64), r.nan_to_num(nan=0.0)


def _check_entropy_add(c: _Case) -> str | None:
    problems = []
    for a_shape, b_shape in (((2, 5, 9), (2, 5, 9)), ((2, 5, 9), (5, 1))):
        la, lb = c.randn(*a_shape) * 30, c.randn(*b_shape) * 30
        la.view(-1)[:4] = -INF
        lb.view(-1)[:2] = -INF
        if la.shape == lb.shape:
            lb.view(-1)[-3:] = la.view(-1)[-3:]  # ties
        ra = c.rand(*a_shape).masked_fill(la == -INF, 0.0)
        rb = c.rand(*b_shape).masked_fill(lb == -INF, 0.0)
        got, _ = c.run(la, ra, lb, rb)
        log_z, r = _entropy_add_oracle(la, ra, lb, rb)
        scale = torch.maximum(la.double().abs(), lb.double().abs()) + log_z.abs()
        problems.append(_differs("entropy_add log Z", got[0], log_z, _ulps(c, 8, scale)))
        problems.append(_differs("entropy_add r", got[1], r, _ulps(c, 16, 1 + r)))
    return _first(*problems)


def _check_entropy_add_rows(c: _Case) -> str | None:
    rows, n, past = 3, 2 * 16 + 5, 7  # vectors and a tail per row; a row stride past n
    la, lb = c.randn(rows, n) * 30, c.randn(rows, n) * 30
    la[1, :4], lb[1, 2:6] = -INF, -INF  # one or both without a path
    lb[2, :3] = la[2, :3]  # ties
    ra = c.rand(rows, n).masked_fill(la == -INF, 0.0)
    rb = c.rand(rows, n).masked_fill(lb == -INF, 0.0)
    problems = []
    for spread in (False, True):  # b's first row read by every row (row stride 0)
        pick = (lambda t: t[:1].expand(rows, n)) if spread else (lambda t: t)
        log_z, r = _entropy_add_oracle(la, ra, pick(lb), pick(rb))
        scale = torch.maximum(la.double().abs(), pick(lb).double().abs()) + log_z.abs()
        wide = [_to(torch.full((rows, n + past), 5.0, dtype=c.dtype), c.device) for _ in "lrLR"]
        wide[0][:, :n], wide[1][:, :n] = _to(la, c.device), _to(ra, c.device)
        b = [pick(_to(t, c.device)) for t in (lb, rb)]
        a = [w[:, :n] for w in wide[:2]]
        out = [w[:, :n] for w in wide[2:]]
        for where, into in (("", out), (" in place", a)):  # into other tensors' rows; into a
            c.call(*into, *a, *b)
            problems.append(
                _differs(
                    f"entropy_add_rows_{where} log Z", into[0].cpu(), log_z, _ulps(c, 8, scale)
                )
            )
            problems.append(
                _differs(f"entropy_add_rows_{where} r", into[1].cpu(), r, _ulps(c, 16, 1 + r))
            )
        untouched = torch.full((rows, past), 5.0, dtype=c.dtype)
        for w in wide:
            problems.append(_differs("entropy_add_rows_ past its rows", w[:, n:].cpu(), untouched))
    return _first(*problems)


def _check_ratio_where_positive(c: _Case) -> str | None:
    num, den = c.randn(2, 5, 9), c.randn(2, 5, 9, zeros=0.2)
    num.view(-1)[:3] = NAN
    den.view(-1)[1] = 0.0
    _, (got, _) = c.run(num.clone(), den)
    expected = torch.where(den > 0, num / den, 0.0)
    return _differs("ratio_where_positive_", got, expected)


def _loo_oracle(x: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    """Leave-one-out log Σ e^x and the e^x-weighted mean of the others' r, by enumeration
    in float64."""
    x, r = x.double(), r.double()
    n = x.shape[-1]
    others = x[..., None, :].expand(*x.shape, n).clone()
    others.diagonal(dim1=-2, dim2=-1).fill_(-INF)
    weights = torch.softmax(others, -1).nan_to_num(nan=0.0)
    return torch.logsumexp(others, -1), (weights * r[..., None, :]).sum(-1)


def _log_rows(c: _Case) -> Tensor:
    """(2, 5, 9) rows in log space: -inf entries, a row of -inf, a row with one finite
    entry, a tied row, a gap of 1000 nats."""
    x = c.randn(2, 5, 9) * 20
    x[0, 0] = -INF
    x[0, 1, 1:] = -INF
    x[0, 2] = 3.0
    x[1, 4, 0] = 1000.0
    x.view(-1)[5::7] = -INF
    return x


def _check_loo_log(c: _Case) -> str | None:
    x = _log_rows(c)
    r = c.rand(*x.shape).masked_fill(x == -INF, 0.0)
    log_z, rest = _loo_oracle(x, r)
    scale = 1 + x.double().nan_to_num(neginf=0.0).abs().amax(-1, keepdim=True)
    problems = []
    for given in (None, r):
        (out_l, out_r, declined), _ = c.run(x, given)
        if bool(declined):
            return "loo_log declined rows without NaN or +inf"
        problems.append(_differs("loo_log log Z", out_l, log_z, _ulps(c, 8, scale)))
        if given is not None:
            problems.append(_differs("loo_log r", out_r, rest, _ulps(c, 32, 1 + rest)))
    bad = x.clone()
    bad[1, 1, 2] = NAN
    (_, _, declined), _ = c.run(bad, r)
    if not bool(declined):
        problems.append("loo_log did not decline a row holding NaN")
    return _first(*problems)


def softmax_backward_oracle(g: Tensor, p: Tensor) -> Tensor:
    """The Log message at softmax's input from ``g`` at its output ``p`` (last dim), by the
    Jacobian in float64: out_i = log Σ_j e^{g_j} |∂p_j/∂s_i|, ∂p_j/∂s_i = p_j(δ_ij − p_i)."""
    g, p = g.double(), p.double()
    eye = torch.eye(p.shape[-1], dtype=torch.float64, device=p.device)
    jacobian = p[..., None, :] * (eye - p[..., :, None])  # [i, j] = ∂p_j/∂s_i
    return torch.logsumexp(g[..., None, :] + torch.log(jacobian.abs()), -1)


def _softmax_rows(c: _Case, n: int) -> tuple[Tensor, Tensor]:
    """(g, p) of (2, 5, n): p a softmax with excluded keys (p = 0), a row with one key (p =
    1), a near-one row; g with -inf (no path) and a row of -inf."""
    scores = c.randn(2, 5, n) * 4
    scores.view(-1)[3::5] = -INF
    scores[0, 1, 1:] = -INF  # p = 1 at key 0
    scores[1, 2, 0] = 40.0  # p within an ulp of 1
    p = torch.softmax(scores.double(), -1).to(c.dtype)
    g = c.randn(2, 5, n) * 20
    g.view(-1)[2::7] = -INF
    g[1, 0] = -INF
    return g, p


def _check_softmax_backward_log(c: _Case) -> str | None:
    problems = []
    for n in (9, 37):  # a vector tail; two vectors and a tail
        g, p = _softmax_rows(c, n)
        (out, declined), _ = c.run(g, p)
        if bool(declined):
            return "softmax_backward_log declined rows without NaN or +inf"
        want = softmax_backward_oracle(g, p)
        t = (g.double() + torch.log(p.double())).nan_to_num(neginf=0.0)
        scale = 1 + t.abs().amax(-1, keepdim=True) + want.nan_to_num(neginf=0.0).abs()
        scale = scale + torch.log(p.double()).nan_to_num(neginf=0.0).abs()
        problems.append(_differs("softmax_backward_log", out, want, _ulps(c, 8, scale)))
        bent = g.clone()
        bent[1, 3, n - 1] = NAN
        (_, declined), _ = c.run(bent, p)
        if not bool(declined):
            problems.append("softmax_backward_log did not decline a row holding NaN")
    return _first(*problems)


def entropy_softmax_backward_oracle(gl: Tensor, gr: Tensor, p: Tensor) -> tuple[Tensor, Tensor]:
    """The Entropy message at softmax's input from (gl, gr) at its output ``p`` (last dim),
    by the Jacobian in float64 and the semiring's definition: terms (gl_j + log|J_ij|,
    gr_j - log|J_ij|) with J_ij = ∂p_j/∂s_i = p_j(δ_ij − p_i), ⊕-reduced over j: log Σ e^l
    and the e^l-weighted mean of r (0 where no term has weight)."""
    gl, gr, p = gl.double(), gr.double(), p.double()
    eye = torch.eye(p.shape[-1], dtype=torch.float64, device=p.device)
    log_j = torch.log((p[..., None, :] * (eye - p[..., :, None])).abs())  # [i, j]
    terms = gl[..., None, :] + log_j
    log_z = torch.logsumexp(terms, -1)
    weight = torch.exp(terms - log_z[..., None]).nan_to_num(nan=0.0)
    values = torch.where(weight > 0, gr[..., None, :] - log_j, 0.0)
    return log_z, (weight * values).sum(-1)


def _check_entropy_softmax_backward(c: _Case) -> str | None:
    problems = []
    for n in (9, 37):  # a vector tail; two vectors and a tail
        gl, p = _softmax_rows(c, n)
        gr = c.randn(*gl.shape) * 3
        (out_l, out_r, declined), _ = c.run(gl, gr, p)
        if bool(declined):
            return "entropy_softmax_backward declined rows without NaN or +inf"
        log_z, mean = entropy_softmax_backward_oracle(gl, gr, p)
        log_p = torch.log(p.double()).nan_to_num(neginf=0.0).abs()
        t = (gl.double() + torch.log(p.double())).nan_to_num(neginf=0.0).abs()
        scale = 1 + t.amax(-1, keepdim=True) + log_z.nan_to_num(neginf=0.0).abs() + log_p
        spread = 1 + gr.double().abs().amax(-1, keepdim=True) + log_p.amax(-1, keepdim=True)
        problems.append(
            _differs("entropy_softmax_backward log Z", out_l, log_z, _ulps(c, 8, scale))
        )
        problems.append(_differs("entropy_softmax_backward r", out_r, mean, _ulps(c, 64, spread)))
        bent = gl.clone()
        bent[1, 3, n - 1] = NAN
        (_, _, declined), _ = c.run(bent, gr, p)
        if not bool(declined):
            problems.append("entropy_softmax_backward did not decline a row holding NaN")
    return _first(*problems)


def softmax_backward_max_formula(g: Tensor, p: Tensor) -> Tensor:
    """MaxProduct's message at softmax's input (last dim), Semiring.softmax_backward's
    formula in torch: max(g_i·|p_i(1 − p_i)|, (max_{j≠i} g_j·|p_j|)·|−p_i|)."""
    t = g * p.abs()
    if t.shape[-1] > 1:
        first, at = t.max(-1, keepdim=True)
        second = t.scatter(-1, at, -INF).amax(-1, keepdim=True)
        others = first.expand_as(t).scatter(-1, at, second)
    else:
        others = torch.zeros_like(t)
    return torch.maximum(g * (p * (1 - p)).abs(), others * (-p).abs())


def standardize_max_formula(a: Tensor, c: Tensor, s: Tensor) -> Tensor:
    """MaxProduct's message at x from ``a`` at layer norm's n = c·s along the last dim
    (``Semiring.standardize`` in torch, in the operands' dtype): the kernel's bits."""
    n = c.shape[-1]
    g_s = (a * c.abs()).amax(-1, keepdim=True)
    g_v = g_s * (-0.5 * s.pow(3)).abs()
    g_c = torch.maximum(a * s.abs(), g_v * (2.0 * c / n).abs())
    one_over_n = torch.tensor(1.0 / n, dtype=a.dtype)
    return torch.maximum(g_c, g_c.amax(-1, keepdim=True) * one_over_n)


def _log_mul_lift(la: Tensor, r: Tensor | None, w: Tensor) -> tuple[Tensor, Tensor | None]:
    """Log's or (given r) Entropy's (la, r) ⊗ lift(w), in float64."""
    log_w = torch.log(w.abs())
    out = la + log_w
    return out, None if r is None else torch.where(out == -INF, 0.0, r - log_w)


def _log_sum(la: Tensor, r: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """⊕ over the last dim (kept), in float64."""
    total = torch.logsumexp(la, -1, keepdim=True)
    if r is None:
        return total, None
    weight = torch.where(total == -INF, 0.0, torch.exp(la - total))
    return total, (weight * r).sum(-1, keepdim=True)


def _log_add(a, ra, b, rb) -> tuple[Tensor, Tensor | None]:
    """a ⊕ b, in float64."""
    total = torch.logaddexp(a, b)
    if ra is None:
        return total, None
    wa = torch.where(total == -INF, 0.0, torch.exp(a - total))
    wb = torch.where(total == -INF, 0.0, torch.exp(b - total))
    return total, wa * ra + wb * rb


def standardize_log_oracle(
    a: Tensor, r: Tensor | None, c: Tensor, s: Tensor
) -> tuple[Tensor, Tensor | None]:
    """Log's (r None) or Entropy's message at x from (a, r) at layer norm's n = c·s along the
    last dim, the composition in float64 (the local derivatives in the operands' dtype)."""
    n = c.shape[-1]
    weights = {
        "c": c,
        "v": -0.5 * s.pow(3),
        "s": s,
        "two_c": 2.0 * c / n,
        "inverse": torch.tensor(1.0 / n, dtype=c.dtype),
    }
    w = {k: v.double() for k, v in weights.items()}
    a, r = a.double(), None if r is None else r.double()
    g_s = _log_sum(*_log_mul_lift(a, r, w["c"]))
    g_v = _log_mul_lift(*g_s, w["v"])
    g_c = _log_add(*_log_mul_lift(a, r, w["s"]), *_log_mul_lift(*g_v, w["two_c"]))
    g_mu = _log_sum(*g_c)
    return _log_add(*g_c, *_log_mul_lift(*g_mu, w["inverse"]))


def _standardize_rows(c: _Case, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """(a, centred, rstd) of layer norm over rows of n: a ≥ 0 with zeros, centred a row of
    x minus its mean (an exact zero in one row), rstd its (mean(c²) + 1e-5)^(−1/2)."""
    x = c.randn(2, 5, n) * 3
    centred = x - x.mean(-1, keepdim=True)
    if n > 2:
        centred[1, 3, 1] = 0.0
    rstd = torch.rsqrt((centred * centred).mean(-1, keepdim=True) + 1e-5)
    a = c.rand(2, 5, n).masked_fill(c.where(0.2, (2, 5, n)), 0.0)
    return a, centred, rstd


def _check_standardize_max(c: _Case) -> str | None:
    problems = []
    for n in (1, 9, 37):
        a, centred, rstd = _standardize_rows(c, n)
        a[0, 2] = 0.5  # ties
        a[1, 0] = 0.0  # no path
        a[0, 3, n - 1] = NAN
        a[1, 4, 0] = INF  # ∞·|c|, ∞·0 where c = 0 in a row of one
        out, _ = c.run(a, centred, rstd)
        problems.append(_differs("standardize_max", out, standardize_max_formula(a, centred, rstd)))
    return _first(*problems)


def _log_rows_of(c: _Case, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(a, r, centred, rstd): log-space a with -inf entries and a row of -inf, r 0 there."""
    _, centred, rstd = _standardize_rows(c, n)
    a = c.randn(2, 5, n) * 20
    a.view(-1)[2::7] = -INF
    a[1, 0] = -INF
    r = c.rand(2, 5, n).masked_fill(a == -INF, 0.0)
    return a, r, centred, rstd


def _check_standardize_log(c: _Case) -> str | None:
    problems = []
    for n in (1, 9, 37):
        a, _, centred, rstd = _log_rows_of(c, n)
        (out, declined), _ = c.run(a, centred, rstd)
        if bool(declined):
            return "standardize_log declined rows without NaN or +inf"
        want, _ = standardize_log_oracle(a, None, centred, rstd)
        problems.append(_differs("standardize_log", out, want, _ulps(c, 16, 1 + want.abs())))
    a, _, centred, rstd = _log_rows_of(c, 9)
    a[1, 1, 2] = NAN
    (_, declined), _ = c.run(a, centred, rstd)
    if not bool(declined):
        problems.append("standardize_log did not decline a row holding NaN")
    return _first(*problems)


def _check_entropy_standardize(c: _Case) -> str | None:
    problems = []
    for n in (1, 9, 37):
        a, r, centred, rstd = _log_rows_of(c, n)
        (out_l, out_r, declined), _ = c.run(a, r, centred, rstd)
        if bool(declined):
            return "entropy_standardize declined rows without NaN or +inf"
        want_l, want_r = standardize_log_oracle(a, r, centred, rstd)
        problems.append(
            _differs("entropy_standardize log Z", out_l, want_l, _ulps(c, 16, 1 + want_l.abs()))
        )
        spread = 1 + want_r.abs() + want_l.abs().nan_to_num(posinf=0.0, neginf=0.0)
        problems.append(_differs("entropy_standardize r", out_r, want_r, _ulps(c, 64, spread)))
    a, r, centred, rstd = _log_rows_of(c, 9)
    r[0, 2, 3] = NAN
    (_, _, declined), _ = c.run(a, r, centred, rstd)
    if not bool(declined):
        problems.append("entropy_standardize did not decline a row whose r holds NaN")
    return _first(*problems)


def softmax_backward_or_formula(g: Tensor, p: Tensor) -> Tensor:
    """Boolean's message at softmax's input (last dim) from the bool ``g``: (g_i ∧ p_i(1 −
    p_i) ≠ 0) ∨ ((∨_{j≠i} g_j ∧ p_j ≠ 0) ∧ −p_i ≠ 0), the leave-one-out ∨ by counts."""
    count = (g & (p != 0)).to(torch.int64)
    others = (count.sum(-1, keepdim=True) - count) > 0
    return (g & (p * (1 - p) != 0)) | (others & (-p != 0))


def _check_softmax_backward_max(c: _Case) -> str | None:
    problems = []
    for n in (1, 9, 37):  # one key; a vector tail; two vectors and a tail
        _, p = _softmax_rows(c, n)
        g = c.rand(2, 5, n).masked_fill(c.where(0.2, (2, 5, n)), 0.0)
        g[0, 2] = 0.5  # ties
        g[1, 4, 0] = INF  # ∞·0 where p = 0: a NaN row
        g[0, 3, n - 1] = NAN
        out, _ = c.run(g, p)
        problems.append(_differs("softmax_backward_max", out, softmax_backward_max_formula(g, p)))
    return _first(*problems)


def _check_softmax_backward_or(c: _Case) -> str | None:
    problems = []
    for n in (1, 9, 37, 70):  # one key; a vector tail; two vectors and a tail; bytes
        _, p = _softmax_rows(c, n)
        p.view(-1)[5::11] = NAN
        g = c.where(0.5, (2, 5, n))
        g[1, 1] = False
        g[0, 4] = c.where(0.05, (n,))  # rows of one or no live term
        out, _ = c.run(g, p)
        problems.append(_differs("softmax_backward_or", out, softmax_backward_or_formula(g, p)))
    return _first(*problems)


def _check_softmax_rows(c: _Case) -> str | None:
    problems = []
    for n in (9, 37):  # a vector tail; two vectors and a tail
        scores = c.randn(2, 5, n) * 4
        keep = c.where(0.7, (5, n))
        keep[:, 0] = True
        keep[2] = False  # no key kept: 0 throughout
        scores[0, 0, 1] = NAN  # kept NaN: NaN throughout
        scores[1, 0, 1] = INF  # kept +inf: NaN throughout
        scores[0, 1, 0] = -INF  # a kept -inf: probability 0
        scores[1, 3, ~keep[3]] = NAN  # excluded: no effect
        for mask, factor in ((keep, 0.125), (None, 1.5)):
            s = scores.double() * factor
            if mask is not None:
                s = s.masked_fill(~mask, -INF)
            want = torch.softmax(s, -1)
            none_kept = (s == -INF).all(-1, keepdim=True) & ~s.isnan().any(-1, keepdim=True)
            want = want.masked_fill(none_kept, 0.0)
            _, (got, _, _) = c.run(scores.clone(), mask, factor)
            # e^(s - top) carries the rounding of s·factor and s - top: ulps of |s| each
            spread = 1 + s.abs().nan_to_num(posinf=0.0, neginf=0.0).amax(-1, keepdim=True)
            problems.append(_differs("softmax_rows_", got, want, _ulps(c, 8, want * spread)))
    return _first(*problems)


def _check_where_zero(c: _Case) -> str | None:
    """where(w == 0, fill, y): w with zeros of both signs, NaN and infinities, of y's shape,
    broadcast along rows, columns or whole (the loop's operands), and y transposed (torch's
    inside the operator); y with -inf and NaN."""
    problems = []
    y = c.randn(2, 5, 37)
    y[0, 0, :2] = torch.tensor([-INF, NAN], dtype=c.dtype)
    ws = [c.randn(2, 5, 37, zeros=0.3), c.randn(37, zeros=0.3), c.randn(2, 5, 1, zeros=0.5)]
    ws[0][0, 1, :4] = torch.tensor([-0.0, NAN, INF, -INF], dtype=c.dtype)
    ws += [torch.ones((), dtype=c.dtype), torch.zeros((), dtype=c.dtype)]
    ws.append(c.randn(5, 1, zeros=0.4))
    for w, y in zip(ws, [y, y, y, y, y, c.randn(7, 5).t()]):
        for fill in (-INF, 0.5) if w.dim() else (float(w) - 0.5,):  # a finite result
            fill = torch.tensor(fill, dtype=c.dtype)
            got, _ = c.run(w, fill, y)
            problems.append(_differs("where_zero", got, torch.where(w == 0, fill, y)))
    return _first(*problems)


def softmax_backward_signed_formula(g_hi: Tensor, g_lo: Tensor, p: Tensor) -> tuple:
    """SignedMaxProduct's message at softmax's input (last dim), Semiring.softmax_backward's
    formula in torch: g_i ⊗ lift(p_i(1 − p_i)) ⊕ (⊕_{j≠i} g_j ⊗ lift(p_j)) ⊗ lift(−p_i), ⊗
    lift(w) keeping (w > 0) or swapping (w < 0) the pair's ends, no edge at w = 0."""

    def lift(h, l, w):
        none = (w == 0) & ~(torch.isnan(h) | torch.isnan(l))
        pos = w > 0
        hi = (torch.where(pos, h, l) * w).masked_fill(none, -INF)
        return hi, (torch.where(pos, l, h) * w).masked_fill(none, INF)

    def loo(x):
        if x.shape[-1] < 2:
            return torch.full_like(x, -INF)
        first, at = x.max(-1, keepdim=True)
        second = x.scatter(-1, at, -INF).amax(-1, keepdim=True)
        return first.expand_as(x).scatter(-1, at, second)

    own_hi, own_lo = lift(g_hi, g_lo, p * (1 - p))
    t_hi, t_lo = lift(g_hi, g_lo, p)
    rest_hi, rest_lo = lift(loo(t_hi), -loo(-t_lo), -p)
    return torch.maximum(own_hi, rest_hi), torch.minimum(own_lo, rest_lo)


def _check_softmax_backward_signed(c: _Case) -> str | None:
    problems = []
    for n in (9, 37):  # a vector tail; two vectors and a tail
        p = _softmax_rows(c, n)[1]
        hi = c.randn(2, 5, n) * 3
        lo = hi - c.rand(2, 5, n) * 2
        empty = c.where(0.2, (2, 5, n))
        hi, lo = hi.masked_fill(empty, -INF), lo.masked_fill(empty, INF)
        hi[0, 2], lo[0, 2] = 0.5, -0.5  # ties of either end
        hi[1, 4, 0] = INF  # +inf·p
        (out_hi, out_lo, declined), _ = c.run(hi, lo, p)
        if bool(declined):
            return "softmax_backward_signed declined rows without NaN"
        want_hi, want_lo = softmax_backward_signed_formula(hi, lo, p)
        problems.append(_differs("softmax_backward_signed hi", out_hi, want_hi))
        problems.append(_differs("softmax_backward_signed lo", out_lo, want_lo))
        bent = lo.clone()
        bent[1, 3, n - 1] = NAN
        (_, _, declined), _ = c.run(hi, bent, p)
        if not bool(declined):
            problems.append("softmax_backward_signed did not decline a row holding NaN")
    return _first(*problems)


def _check_entropy_reduce_rows(c: _Case) -> str | None:
    la = _log_rows(c)
    r = c.rand(*la.shape).masked_fill(la == -INF, 0.0)
    (out_l, out_r, declined), _ = c.run(la, r)
    if bool(declined):
        return "entropy_reduce_rows declined rows without NaN or +inf"
    l64 = la.double()
    log_z = torch.logsumexp(l64, -1, keepdim=True)
    mean = (torch.softmax(l64, -1).nan_to_num(nan=0.0) * r.double()).sum(-1, keepdim=True)
    scale = 1 + l64.nan_to_num(neginf=0.0).abs().amax(-1, keepdim=True)
    problems = [
        _differs("entropy_reduce_rows log Z", out_l, log_z, _ulps(c, 8, scale)),
        _differs("entropy_reduce_rows r", out_r, mean, _ulps(c, 16, 1 + mean)),
    ]
    bad = la.clone()
    bad[0, 3, 4] = INF
    (_, _, declined), _ = c.run(bad, r)
    if not bool(declined):
        problems.append("entropy_reduce_rows did not decline a row holding +inf")
    return _first(*problems)


def _check_log_space_rows(c: _Case) -> str | None:
    a = _log_rows(c)
    depth = 110 if c.dtype == torch.float32 else 760  # e down through its subnormals
    a[1, 3] = -torch.linspace(0, depth, 9, device="cpu")
    k = a.shape[-1]
    problems = []
    for r in (None, c.rand(*a.shape)):
        width = k if r is None else 2 * k
        out = torch.full((*a.shape[:-1], width), 7.0, dtype=c.dtype, device="cpu")
        (shift, live), (_, _, out) = c.run(a, r, out)
        row_max = a.amax(-1, keepdim=True)
        problems.append(_differs("log_space_rows live", live, torch.isfinite(row_max)))
        expected_shift = row_max.masked_fill(~torch.isfinite(row_max), 0.0)
        problems.append(_differs("log_space_rows shift", shift, expected_shift))
        e = torch.exp(a - expected_shift)
        problems.append(_differs("log_space_rows e", out[..., -k:], e, _ulps(c, 8, e)))
        if r is not None:
            er = e * r
            problems.append(_differs("log_space_rows e·r", out[..., :k], er, _ulps(c, 8, er)))
    return _first(*problems)


def _check_log_space_columns(c: _Case) -> str | None:
    rows = _log_rows(c)  # (count, m, k): the message the operand transposes
    rows[1, 3] = -torch.linspace(0, 110 if c.dtype == torch.float32 else 760, 9)
    rows[1, 0, 2], rows[1, 1, 4] = NAN, INF  # columns of std::exp
    count, m, k = rows.shape
    problems = []
    for r in (None, c.rand(count, m, k)):
        held = torch.zeros(count, k, m + 3, dtype=c.dtype)  # a batch stride past the rows
        held[..., :m] = rows.mT
        a = held[..., :m]
        rt = None if r is None else r.mT.contiguous()
        out = torch.full((count, k if r is None else 2 * k, m), 7.0, dtype=c.dtype)
        (shift, live), (_, _, out) = c.run(a, rt, out)
        top = torch.where(rows.isnan().any(-1, keepdim=True), NAN, rows.amax(-1, keepdim=True))
        finite = torch.isfinite(top)
        want_shift = top.masked_fill(~finite, 0.0)
        problems.append(_differs("log_space_columns live", live, finite))
        problems.append(_differs("log_space_columns shift", shift, want_shift))
        e = torch.exp(rows - want_shift).mT
        got_e = out[:, -k:]
        problems.append(_differs("log_space_columns e", got_e, e, _ulps(c, 8, e)))
        if r is not None:
            er = e * r.mT
            problems.append(_differs("log_space_columns e·r", out[:, :k], er, _ulps(c, 8, er)))
    return _first(*problems)


def _check_entropy_weights(c: _Case) -> str | None:
    w = c.randn(2, 5, 9, zeros=0.2) * 10.0 ** c.randn(2, 5, 9).clamp(-3, 3)
    w.view(-1)[:3] = torch.tensor([NAN, INF, -INF], dtype=c.dtype, device="cpu")
    w.view(-1)[3] = -0.0
    out = torch.full((2, 10, 9), 7.0, dtype=c.dtype, device="cpu")
    _, (_, out) = c.run(w, out)
    magnitude = w.double().abs()
    weighted = (-(magnitude * torch.log(magnitude))).nan_to_num(nan=0.0, posinf=INF, neginf=-INF)
    expected = torch.cat([magnitude, weighted], dim=-2)
    return _differs("entropy_weights", out, expected, _ulps(c, 8, expected))


def _check_any_nan_or_inf(c: _Case) -> str | None:
    first = torch.zeros(2, 5, 9, dtype=c.dtype, device="cpu")
    floats = (
        c.randn(2, 5, 9)
        if c.dtype.is_floating_point
        else torch.randn(5, 9, generator=c.gen, device="cpu")
    )
    variants = [floats, floats.clone(), floats.clone(), floats.clone()]
    variants[1].view(-1)[7] = NAN
    variants[2].view(-1)[8] = INF
    variants[3].view(-1)[9] = -INF
    for second in variants:
        for tensors in ([first, second], [second.mT, first]):
            for signs in ((0, 0), (1, -1), (-1, 1)):
                expected = any(
                    t.dtype.is_floating_point
                    and (
                        bool(t.isnan().any())
                        or (s >= 0 and bool(t.isposinf().any()))
                        or (s <= 0 and bool(t.isneginf().any()))
                    )
                    for t, s in zip(tensors, signs)
                )
                got, _ = c.run(tensors, list(signs))
                if bool(got) != expected:
                    return (
                        f"any_nan_or_inf gave {bool(got)} where the torch formula gives {expected}"
                    )
    return None


def _check_all_rows_live(c: _Case) -> str | None:
    x = c.randn(2, 5, 9)
    y = x - c.rand(2, 5, 9)
    cases = []
    for row, value in ((None, None), ((1, 2), None), ((1, 2), NAN), ((0, 4), INF)):
        bent = x.clone()
        if row is not None:
            bent[row] = -INF
            if value is not None:
                bent[row][3] = value
        cases.append((bent, None, -INF, bool((bent.amax(-1) != -INF).all())))
        cases.append((bent, y, 0.0, not bool(((bent - y).amax(-1) < 0).any())))
    for x_, y_, empty, expected in cases:
        got, _ = c.run(x_, y_, empty)
        if bool(got) != expected:
            return f"all_rows_live gave {bool(got)} where the torch formula gives {expected}"
    return None


def _check_log_gemm_finish(c: _Case) -> str | None:
    """Rows of 9 and of 37 entries (16-float vectors and a tail): sums below tiny are not
    exact (nothing written); exact sums get num / z to the value and log z + shift
    (+ shift_b) within 8 ulp of the float64 formula: a dead row's 0, -0 and NaN, live
    rows' +inf in a vector lane and in the tail (not exact only where the sums may
    overflow), 30 decades of sums."""
    for n in (9, 37):
        z = c.rand(2, 5, n) * 10.0 ** (c.rand(2, 5, n) * 30 - 15).floor() + 0.25
        z.view(-1)[::6] = 0.0
        z[1, 3] = 0.0  # a dead row: its sums are rightly 0
        live = torch.ones(2, 5, 1, dtype=torch.bool, device="cpu")
        live[1, 3] = False
        num, shift, shift_b = c.randn(2, 5, n), c.randn(2, 5, 1) * 30, c.randn(2, 1, n) * 30
        tiny = torch.finfo(c.dtype).tiny / c.eps
        # zeros in live rows are below tiny: not exact, nothing written
        (done,), (z_out, num_out, *_) = _tuple(c.run(z, num, shift, shift_b, live, tiny, True))
        if bool(done) or not (torch.equal(z_out, z) and torch.equal(num_out, num)):
            return "log_gemm_finish_ wrote sums below tiny (not exact)"
        z = z.masked_fill((z == 0) & live, 0.5)
        z[1, 3, 1], z[1, 3, 2], z[0, 2, n - 1] = -0.0, NAN, INF
        z[0, 4, 3] = INF  # in a vector's lane where n = 37, not only in the tail
        for sb in (shift_b, None):
            problem = _log_gemm_finished(c, z, num, shift, sb, live, tiny)
            if problem:
                return problem
    return None


def _log_gemm_finished(c: _Case, z, num, shift, shift_b, live, tiny) -> str | None:
    """Where log_gemm_finish_ on exact sums z differs from its formula."""
    (done,), (z_out, num_out, *_) = _tuple(c.run(z, num, shift, shift_b, live, tiny, False))
    if not bool(done):
        return "log_gemm_finish_ declined exact sums"
    b = 0.0 if shift_b is None else shift_b.double()
    log_z = z.double().log()
    want = log_z + shift.double() + b
    scale = log_z.abs() + shift.double().abs() + abs(b)
    ratio = torch.where(z > 0, num / z, 0.0)
    return _first(
        _differs("log_gemm_finish_ log z", z_out, want, _ulps(c, 8, scale)),
        _differs("log_gemm_finish_ num / z", num_out, ratio),
    )


def _tuple(result):
    out, written = result
    return (out if isinstance(out, tuple) else (out,)), written


_CHECKS: dict[str, Callable[[_Case], str | None]] = {
    "max_times": _check_max_times,
    "max_times_finite": _check_max_times_finite,
    "k_best_times": _check_k_best_times,
    "k_best_add": _check_k_best_add,
    "k_best_loo": _check_k_best_loo,
    "k_best_softmax_backward": _check_k_best_softmax_backward,
    "signed_times": _check_signed_times,
    "lift_times": _check_lift_times,
    "signed_mul_lift": _check_signed_mul_lift,
    "entropy_mul_lift": _check_entropy_mul_lift,
    "entropy_add": _check_entropy_add,
    "ratio_where_positive_": _check_ratio_where_positive,
    "loo_log": _check_loo_log,
    "entropy_reduce_rows": _check_entropy_reduce_rows,
    "log_space_rows": _check_log_space_rows,
    "log_space_columns": _check_log_space_columns,
    "entropy_weights": _check_entropy_weights,
    "plus_log_abs": _check_plus_log_abs,
    "log_add": _check_log_add,
    "log_add_rows_": _check_log_add_rows,
    "entropy_add_rows_": _check_entropy_add_rows,
    "softmax_rows_": _check_softmax_rows,
    "softmax_backward_log": _check_softmax_backward_log,
    "softmax_backward_max": _check_softmax_backward_max,
    "softmax_backward_or": _check_softmax_backward_or,
    "softmax_backward_signed": _check_softmax_backward_signed,
    "entropy_softmax_backward": _check_entropy_softmax_backward,
    "standardize_max": _check_standardize_max,
    "standardize_log": _check_standardize_log,
    "entropy_standardize": _check_entropy_standardize,
    "where_zero": _check_where_zero,
    "any_nan_or_inf": _check_any_nan_or_inf,
    "all_rows_live": _check_all_rows_live,
    "log_gemm_finish_": _check_log_gemm_finish,
}

#: the kernels that check themselves
NAMES = tuple(_CHECKS)
