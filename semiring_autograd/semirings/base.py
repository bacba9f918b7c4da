"""The semiring interface and its generic, always-correct default algorithms.

A semiring value is a tuple of tensors (its *components*), broadcastable against each
other elementwise. Subclasses define ``zero``, ``one``, ``lift``, ``add`` (⊕), ``mul`` (⊗)
and ``readout``; every other primitive (⊕-reduction, leave-one-out ⊕, ⊕-scatter, semiring
matmul) has a generic default written only in terms of those, which built-in semirings
override with faster equivalents.
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import Tensor

from .. import kernels
from ..errors import SemiringDefinitionError

Value = tuple[Tensor, ...]

# Elements of the broadcast product a generic semiring matmul may hold at once.
_MATMUL_CHUNK_ELEMENTS = 1 << 22


def normalize_dims(dims: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """Dims as sorted non-negative ints; None means every dim (a 0-d tensor has none)."""
    if dims is None:
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = (dims,)
    return tuple(sorted({d % ndim for d in dims})) if ndim else ()


#: primal dtypes whose messages are kept in float32 (too coarse for products of many factors)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


#: floating primal dtype -> its message dtype (``message_dtype``), for callers that run per
#: backward node and read it with one dict lookup
MESSAGE_DTYPES = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float32: torch.float32,
    torch.float64: torch.float64,
}


def message_dtype(dtype: torch.dtype) -> torch.dtype:
    """The floating dtype of semiring components for a primal of ``dtype``: the primal's own,
    at least float32 (half and bfloat16 primals get float32 messages); float default for
    non-floating primals."""
    if dtype in _LOW_PRECISION:
        return torch.float32
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def _message(x: Tensor) -> Tensor:
    """Real local derivatives ``x`` (floating) in message precision."""
    return x.to(message_dtype(x.dtype))


def broadcast_shape(*shapes: Sequence[int]) -> torch.Size:
    """``torch.broadcast_shapes(*shapes)``, with the common cases (all equal, or all but one
    empty) decided without it: it costs 30-140 µs per call in Python, more than most operators
    of the dispatch-bound tiny Llama. A loop, not generators: this runs for most backward
    nodes."""
    first = None
    for s in shapes:
        if len(s):
            if first is None:
                first = s
            elif s != first:
                return torch.broadcast_shapes(*shapes)
    return torch.Size(()) if first is None else torch.Size(first)


def broadcast_value(a: Value) -> Value:
    """The components of ``a`` expanded to their common shape."""
    if len(a) == 1:
        return a
    shape = broadcast_shape(*[c.shape for c in a])
    return tuple([c.expand(shape) for c in a])


def _strided(c: Tensor, dim: int, start: int) -> Tensor:
    """Every second element of ``c`` along ``dim``, from ``start``."""
    return c[(slice(None),) * dim + (slice(start, None, 2),)]


@dataclass(frozen=True)
class InlineForms:
    """How generated code spells a one-component semiring's elementwise primitives: Python
    expressions over the component tensors ``{a}`` and ``{b}`` and real local derivatives
    ``{w}`` (already in message precision), each placeholder used once. They must equal the
    methods they stand for (``tests/test_codegen.py`` checks): ``lift`` is ``lift(w)[0]``,
    ``mul`` and ``add`` are ``mul``/``add`` of one-component values, ``mul_lift`` is
    ``mul_lift((a,), w)[0]``; None leaves a primitive to the semiring's method. Code
    generation emits a module specialised to a built-in semiring from these (see the
    semiring registry)."""

    lift: str | None
    mul: str
    add: str
    mul_lift: str | None


@dataclass(frozen=True)
class Terms:
    """Which entries of a semiring's values hold a term (a path reaches them): those whose
    first component is not ``zero`` (the semiring zero's), or with ``signed`` the pairs
    (hi, lo) with hi ≥ lo. NaN counts as a term. With ``nan_at_zero_times_inf`` the zero
    annihilates finite weights only: zero ⊗ lift(±∞ or NaN) is NaN (IEEE 0·∞, as in torch's
    backward), so an entry without a term still meets every non-finite weight."""

    zero: float = 0.0
    signed: bool = False
    nan_at_zero_times_inf: bool = False

    def live(self, a: Value, dim: int) -> Tensor:
        """Rows (dim -1) or columns (dim -2) with a term: one reduction (cheaper than
        testing every entry and reducing the bools)."""
        if self.signed:
            return ~((a[0] - a[1]).amax(dim) < 0)
        if a[0].dtype == torch.bool:  # truth values (zero False): one any
            return a[0].any(dim)
        return a[0].amax(dim) != self.zero

    def all_live(self, a: Value) -> bool | None:
        """Whether every row has a term (``live(a, -1).all()``) in one operator; None where
        the kernels do not take ``a``."""
        return kernels.all_rows_live(a[0], a[1] if self.signed else None, self.zero)


#: the library's own semirings (checked by its tests): their ⊕ and ⊗ run unwrapped
_LIBRARY_PREFIX = __name__.rsplit(".", 2)[0] + "."

#: (class, operation, operand and result shapes) already found well formed, per process
_WELL_FORMED: set[tuple] = set()
_WELL_FORMED_LIMIT = 4096

_SYMBOLS = {"add": "⊕", "mul": "⊗"}


def _result_shapes(where: str, out: object) -> tuple[torch.Size, ...]:
    """The shapes of the components of ``out``, or the error saying it is not a value."""
    if not isinstance(out, (tuple, list)) or not all(isinstance(c, Tensor) for c in out):
        raise SemiringDefinitionError(
            f"{where} returned {type(out).__name__}, not a tuple of tensors (a semiring "
            "value is the tuple of its component tensors)"
        )
    return tuple(c.shape for c in out)


def _check_result(semiring: Semiring, name: str, a: Value, b: Value, out: Value) -> None:
    """A SemiringDefinitionError unless ``out`` = a ⊕ b (or a ⊗ b) has ``n_components``
    components whose broadcast shape is that of the operands' components: ⊕ and ⊗ are
    elementwise, with broadcasting. Each combination of shapes is checked once."""
    cls = type(semiring)
    try:
        key = (cls, name, *(c.shape for c in a), None, *(c.shape for c in b), None)
        key += tuple(c.shape for c in out)
    except (AttributeError, TypeError):
        key = None  # not tuples of tensors: reported below
    if key in _WELL_FORMED:
        return
    where = f"{cls.__name__}.{name} ({_SYMBOLS[name]})"
    got = _result_shapes(where, out)
    if len(out) != semiring.n_components:
        raise SemiringDefinitionError(
            f"{where} returned {len(out)} components, but {cls.__name__}.n_components is "
            f"{semiring.n_components}: set n_components to the number of tensors in a value"
        )
    shapes = (tuple(c.shape for c in a), tuple(c.shape for c in b))
    expected = torch.broadcast_shapes(*shapes[0], *shapes[1])
    try:
        result = torch.broadcast_shapes(*got)
    except RuntimeError:
        result = None  # components that do not broadcast: reported with their shapes below
    if result != expected:
        raise SemiringDefinitionError(
            f"{where} returned components of shapes {[tuple(s) for s in got]} for operands "
            f"of shapes {[tuple(s) for s in shapes[0]]} and {[tuple(s) for s in shapes[1]]}: "
            f"expected the operands' broadcast shape {tuple(expected)} ({_SYMBOLS[name]} is "
            "elementwise with broadcasting)"
        )
    if len(_WELL_FORMED) >= _WELL_FORMED_LIMIT:
        _WELL_FORMED.clear()
    _WELL_FORMED.add(key)


def _checked(name: str, method: Callable) -> Callable:
    """``method`` (a user semiring's plain ``add`` or ``mul`` function) with its result
    checked."""

    @functools.wraps(method)
    def checked(self: Semiring, a: Value, b: Value) -> Value:
        out = method(self, a, b)
        _check_result(self, name, a, b, out)
        return out

    checked.checks_result = True
    return checked


def _checked_attribute(name: str, attribute: object) -> object:
    """A class attribute ``add`` or ``mul`` with its results checked: a function, or the
    function inside a ``staticmethod`` or ``classmethod`` (wrapped in the same kind);
    anything else (a callable object) as it is."""
    if getattr(attribute, "checks_result", False):
        return attribute
    if isinstance(attribute, types.FunctionType):
        return _checked(name, attribute)
    if isinstance(attribute, staticmethod):
        inner = attribute.__func__
        return _checked(name, lambda self, a, b: inner(a, b))
    if isinstance(attribute, classmethod):
        inner = attribute.__func__
        return _checked(name, lambda self, a, b: inner(type(self), a, b))
    return attribute


#: the methods that define a semiring's values (and Log's helpers its ⊕ and ⊗ call): a
#: subclass that overrides one of them is another algebra, to which its base's fused
#: formulas do not apply
_ALGEBRA = (
    "zero",
    "one",
    "lift",
    "add",
    "mul",
    "mul_lift",
    "sum",
    "_reduce",
    "log_abs",
    "log_add",
    "plus_log_abs",
)


def keeps_algebra(sub: type, cls: type) -> bool:
    """Whether ``sub`` (a subclass of ``cls``) has ``cls``'s ⊕, ⊗, lift and reductions, so
    that ``cls``'s fused formulas compute its values."""
    return all(getattr(sub, name, None) is getattr(cls, name, None) for name in _ALGEBRA)


class Semiring:
    """Base class: (K, ⊕, ⊗, zero, one) plus ``lift`` from real local derivatives into K.

    ``lift`` must be a monoid homomorphism: lift(ab) = lift(a) ⊗ lift(b), lift(1) = one,
    lift(0) = zero. ``sa.check_semiring`` verifies this and the semiring laws. A user
    semiring's ``add`` and ``mul`` are checked where they run: a result that is not a value
    of the operands' broadcast shape raises :class:`SemiringDefinitionError`.
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__module__.startswith(_LIBRARY_PREFIX):
            return
        for name in _SYMBOLS:
            if name in vars(cls):
                setattr(cls, name, _checked_attribute(name, vars(cls)[name]))

    #: number of component tensors in a value
    n_components: int = 1
    #: short name used in error messages and generated module names
    name: str = "semiring"
    #: a one-component semiring's primitives as tensor expressions, for generated code
    inline: ClassVar[InlineForms | None] = None
    #: messages are brought to a canonical form (:meth:`settle`) as they enter an op
    settles: ClassVar[bool] = False
    #: which entries of a value hold a term, where the zero annihilates (0 ⊗ x = 0 for
    #: every x): rows and columns without one are skipped in a matmul by a weight
    terms: ClassVar[Terms | None] = None

    # ----- the definition: subclasses implement these -------------------------------
    def zero(self, shape: Sequence[int], like: Tensor) -> Value:
        """The ⊕ identity (no path), with ``like``'s floating dtype and device."""
        raise NotImplementedError(f"{type(self).__name__} must define zero()")

    def one(self, shape: Sequence[int], like: Tensor) -> Value:
        """The ⊗ identity (the empty path)."""
        raise NotImplementedError(f"{type(self).__name__} must define one()")

    def lift(self, w: Tensor) -> Value:
        """Map real local derivatives ``w`` elementwise into the semiring."""
        raise NotImplementedError(f"{type(self).__name__} must define lift()")

    def add(self, a: Value, b: Value) -> Value:
        """⊕, elementwise with broadcasting."""
        raise NotImplementedError(f"{type(self).__name__} must define add()")

    def mul(self, a: Value, b: Value) -> Value:
        """⊗, elementwise with broadcasting."""
        raise NotImplementedError(f"{type(self).__name__} must define mul()")

    def readout(self, a: Value) -> Tensor:
        """What a user reads at an input: a plain tensor of the input's shape."""
        raise NotImplementedError(f"{type(self).__name__} must define readout()")

    # ----- where the engine merges, and message entry -----------------------------------
    def merge(self, a: Value, b: Value) -> Value:
        """How the engine combines the messages of one tensor from its several consumers:
        ⊕, except in a tensor-level semiring (its ⊕ inside ops differs from the merge)."""
        return self.add(a, b)

    def settle(self, a: Value) -> Value:
        """A message as it enters an op's backward, where ``settles`` is set."""
        return a

    # ----- identity and display ---------------------------------------------------------
    def _identity(self) -> dict:
        """The attributes that make two instances of one class the same semiring."""
        return vars(self)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self._identity().items()))))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ----- generic primitives -----------------------------------------------------------
    def add_into(self, acc: Value, b: Value) -> None:
        """acc ← acc ⊕ b, written into ``acc``'s components: tensors of the result's shape
        that nothing else reads (an accumulator, or a view of one). The default computes
        acc ⊕ b and copies it in."""
        for c, value in zip(acc, self.add(acc, b)):
            c.copy_(value)

    def sum(
        self, a: Value, dims: int | Sequence[int] | None = None, keepdim: bool = False
    ) -> Value:
        """⊕-reduction over ``dims`` (all dims when None)."""
        a = broadcast_value(a)
        shape = a[0].shape
        d = normalize_dims(dims, len(shape))
        if not d:
            return a
        if 0 in shape and any(shape[i] == 0 for i in d):
            out = a
            for i in d:
                out = self._sum_dim(out, i)
            return out if keepdim else tuple(c.squeeze(d) for c in out)
        return self._reduce(a, d, keepdim)

    def _reduce(self, a: Value, dims: tuple[int, ...], keepdim: bool) -> Value:
        """⊕ over non-empty ``dims`` of same-shaped components (generic: pairwise halving)."""
        for d in dims:
            a = self._sum_dim(a, d)
        return a if keepdim else tuple(c.squeeze(dims) for c in a)

    def _sum_dim(self, a: Value, dim: int) -> Value:
        n = a[0].shape[dim]
        if n == 0:
            shape = list(a[0].shape)
            shape[dim] = 1
            return self.zero(shape, a[0])
        while n > 1:
            half = n // 2
            lo = tuple(c.narrow(dim, 0, half) for c in a)
            hi = tuple(c.narrow(dim, half, half) for c in a)
            merged = self.add(lo, hi)
            if n % 2:
                rest = tuple(c.narrow(dim, 2 * half, 1) for c in a)
                merged = tuple(torch.cat([m, r], dim) for m, r in zip(merged, rest))
            a, n = merged, half + n % 2
        return a

    def exclusive_scan(self, a: Value, dim: int) -> Value:
        """Exclusive prefix ⊕ along ``dim``: out_i = a_0 ⊕ … ⊕ a_{i-1} (O(n) work)."""
        a = broadcast_value(a)
        dim = dim % a[0].dim()
        n = a[0].shape[dim]
        shape = list(a[0].shape)
        shape[dim] = 1
        zero = self.zero(shape, a[0])
        if n <= 1:
            return tuple(z.expand(c.shape).clone() for z, c in zip(zero, a))
        if n % 2:
            a = tuple(torch.cat([c, z.expand(shape)], dim) for c, z in zip(a, zero))
        evens = tuple(_strided(c, dim, 0) for c in a)
        odds = tuple(_strided(c, dim, 1) for c in a)
        pair_prefix = self.exclusive_scan(self.add(evens, odds), dim)
        odd_out = self.add(pair_prefix, evens)
        out = tuple(
            torch.stack([e, o], dim + 1).flatten(dim, dim + 1) for e, o in zip(pair_prefix, odd_out)
        )
        return tuple(c.narrow(dim, 0, n) for c in out)

    def loo(self, a: Value, dim: int) -> Value:
        """Leave-one-out ⊕ along ``dim``: out_i = ⊕_{j≠i} a_j, from prefix and suffix scans."""
        a = broadcast_value(a)
        dim = dim % a[0].dim()
        prefix = self.exclusive_scan(a, dim)
        flipped = tuple(c.flip(dim) for c in a)
        suffix = tuple(c.flip(dim) for c in self.exclusive_scan(flipped, dim))
        return self.add(prefix, suffix)

    def index_add(self, a: Value, index: Tensor, size: int) -> Value:
        """⊕-scatter rows: out[r] = ⊕ of a[i] over i with index[i] == r; out has ``size`` rows."""
        a = broadcast_value(a)
        flat_index = index.reshape(-1)
        rows = torch.arange(size, device=index.device)
        onehot = rows[:, None] == flat_index[None, :]
        lifted = self.lift(onehot.to(a[0].dtype if a[0].is_floating_point() else torch.float))
        trail = a[0].shape[1:]
        flat = tuple(c.reshape(c.shape[0], math.prod(trail)) for c in a)
        return tuple(c.reshape(size, *trail) for c in self.matmul(lifted, flat))

    def matmul(self, a: Value, b: Value) -> Value:
        """Semiring matmul with torch.matmul's batch broadcasting (both operands ≥ 2-D):
        out[..., i, j] = ⊕_k a[..., i, k] ⊗ b[..., k, j]."""
        m, k = a[0].shape[-2], a[0].shape[-1]
        n = b[0].shape[-1]
        rows = max(1, _MATMUL_CHUNK_ELEMENTS // max(1, k * n))
        pieces = []
        for start in range(0, m, rows):
            ai = tuple(c[..., start : start + rows, :, None] for c in a)
            bi = tuple(c[..., None, :, :] for c in b)
            pieces.append(self.sum(self.mul(ai, bi), dims=-2))
        if not pieces:
            batch = torch.broadcast_shapes(a[0].shape[:-2], b[0].shape[:-2])
            return self.zero((*batch, m, n), a[0])
        return tuple(torch.cat(parts, dim=-2) for parts in zip(*pieces))

    def mul_lift(self, a: Value, w: Tensor) -> Value:
        """a ⊗ lift(w) for real derivatives ``w``, broadcasting; override to skip
        materialising lift(w)."""
        return self.mul(a, self.lift(w))

    def matmul_lift(self, a: Value, w: Tensor) -> Value:
        """matmul(a, lift(w)) for real derivatives ``w``; override to skip work ``lift``
        does that the matmul would undo."""
        return self.matmul(a, self.lift(w))

    def softmax_backward(self, a: Value, probs: Tensor, dim: int) -> Value:
        """The message at softmax's input s from the message ``a`` at its output p =
        softmax(s) along ``dim`` (``probs``), through ∂p_i/∂s_i = p_i(1 − p_i) and
        ∂p_j/∂s_i = −p_j·p_i (j ≠ i): a_i ⊗ lift(p_i(1 − p_i)) ⊕ (⊕_{j≠i} a_j ⊗ lift(p_j))
        ⊗ lift(−p_i). Override to compute it in fewer passes."""
        own = self.mul_lift(a, _message(probs * (1 - probs)))
        others = self.loo(self.mul_lift(a, _message(probs)), dim)
        return self.add(own, self.mul_lift(others, _message(-probs)))

    def standardize(self, a: Value, centred: Tensor, rstd: Tensor, dims: Any) -> Value:
        """The message at x from the message ``a`` at n = c·s, through layer norm's
        composition μ = mean(x); c = x − μ; v = mean(c²); s = (v + eps)^(−1/2) over ``dims``
        (kept), whose nodes are nodes of the gradient graph: c → n weighs s, s → n weighs c,
        v → s −s³/2, c → v 2c/count (c² one edge), x → c 1, μ → c −1, x → μ 1/count.
        ``centred`` is c, ``rstd`` s. Override to compute it in fewer passes."""
        count = max(centred.numel() // max(rstd.numel(), 1), 1)
        c, dtype = _message(centred), message_dtype(centred.dtype)

        def constant(x: float) -> Tensor:
            return torch.tensor(x, dtype=dtype, device=centred.device)

        g_s = self.sum(self.mul_lift(a, c), dims, True)
        g_v = self.mul_lift(g_s, _message(-0.5 * rstd.pow(3)))
        g_c = self.add(
            self.mul_lift(a, _message(rstd)), self.mul_lift(g_v, _message(2.0 * centred / count))
        )
        # the edges c → μ all weigh −1: ⊗ by it after the ⊕ (distributivity; exact, |−1| = 1)
        g_mu = self.mul_lift(self.sum(g_c, dims, True), constant(-1.0))
        return self.add(g_c, self.mul_lift(g_mu, constant(1.0 / count)))

    # ----- helpers shared by formulas ---------------------------------------------------
    def sum_to(self, a: Value, shape: Sequence[int]) -> Value:
        """⊕ over the dims along which ``shape`` was broadcast to ``a``'s shape."""
        shape = tuple(shape)
        full = a[0].shape
        for c in a:  # a loop: components of one shape (the common case) need no broadcast
            if c.shape != full:
                full = broadcast_shape(*[c.shape for c in a])
                break
        if tuple(full) == shape:
            return a
        lead = len(full) - len(shape)
        dims = list(range(lead))
        dims += [lead + i for i, s in enumerate(shape) if s == 1 and full[lead + i] != 1]
        out = self.sum(a, dims, keepdim=True)
        return tuple([c.reshape(shape) for c in out])
