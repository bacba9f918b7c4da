"""Backward messages: a wrapper tensor subclass that travels through PyTorch's engine.

A :class:`Message` reports the primal's shape, dtype and device (so the engine's checks
pass) and holds the semiring value (a tuple of component tensors) inside. The engine merges
two paths with ``aten.add``, which becomes the semiring's merge (⊕). Ops whose backward only moves, copies or
sums gradients (views, ``select_backward``, ``expand``, ``sum`` …) are structural: their
meaning is the same in every semiring, so they run per component (sums become ⊕).
torch's backward of a view or shape op taken of the input before the patched model
(``unbind``, ``split``, ``as_strided``, ``unfold``, ``index_select``, ``pad`` …), and of a
write into a view inside it (``CopySlices``, ``AsStridedBackward0``), runs its cat, stack,
copy, ``index_add`` or zero fill on messages: the zeros it makes for unused
pieces and empty slots are the semiring's zero, its sums ⊕. A score read from a patched model's output after the ``with`` block adds native backward
nodes: indexing's, ``gather``'s, ``masked_select``'s and ``take``'s scatters, a loss's
backward op, softmax's and log_softmax's, and elementwise scalings inside
the nodes of ``ELEMENTWISE_NODES`` run on messages with their semiring meaning.
Any other aten op reaching a message raises :class:`ForeignOpError`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ..errors import ForeignOpError, SemiringMismatchError
from ..semirings import batching
from ..semirings.base import MESSAGE_DTYPES, Semiring, Value, message_dtype
from .primitives import as_message
from .tensor_helpers import element_positions, gather_positions

aten = torch.ops.aten


class Message(Tensor):
    """A semiring-valued gradient message with the primal's metadata."""

    value: Value
    semiring: Semiring

    @staticmethod
    def __new__(cls, semiring: Semiring, value: Value, shape, dtype, device) -> "Message":
        return _message(semiring, value, shape, dtype, device)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __repr__(self) -> str:  # type: ignore[override]
        parts = ", ".join(repr(c) for c in self.value)
        return f"Message({self.semiring!r}, shape={tuple(self.shape)}, value=({parts}))"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _STRUCTURAL.get(func)
        if handler is None:
            node = torch._C._current_autograd_node()
            if node is None:
                raise ForeignOpError(f"aten op '{func}' was applied to {_NOT_A_GRADIENT}")
            raise ForeignOpError(
                f"aten op '{func}' reached a semiring message during backward, in the "
                f"backward node {node.name()}. This means an op without a semiring formula "
                "sits in the graph between the output and the input (an operation run "
                "outside `sa.patch`, a custom autograd.Function, a reentrant "
                "torch.utils.checkpoint, or a native backward that is not purely "
                "structural). Record the whole computation inside "
                "`sa.patch(model, semiring)`, or add a YAML entry for the op."
            )
        return batching.dispatch(handler, func, args, kwargs)


def _message(semiring: Semiring, value: Value, shape, dtype, device) -> Message:
    """``_message(semiring, value, shape, dtype, device)``: each component expanded to
    ``shape`` where it is not of that shape. This module makes its messages here, without
    the Python calls of the class's ``__new__`` and ``__init__`` (one per message)."""
    if type(shape) is not torch.Size:
        shape = torch.Size(shape)
    r = _make_wrapper_subclass(Message, shape, dtype=dtype, device=device)
    r.semiring = semiring
    fitted = []  # a loop, not a generator: this runs for every message
    for c in value:
        fitted.append(c if c.shape == shape else c.expand(shape))
    r.value = tuple(fitted)
    return r


_make_wrapper_subclass = Tensor._make_wrapper_subclass
#: a CPU message's device: ``t.device`` makes a new object per read, ``t.is_cpu`` reads a flag
_CPU = torch.device("cpu")
#: primal dtypes whose messages are of the same dtype (``message_dtype`` is the identity)
_OWN_PRECISION = (torch.float32, torch.float64)


def _in_precision(value: Value, dtype: torch.dtype) -> Value:
    """Floating components in the message precision of a ``dtype`` primal (an op whose output
    dtype differs from its input's, such as ``softmax(dtype=...)``, hands back components of
    the output's precision)."""
    target = message_dtype(dtype)
    converted = []  # a loop, not a generator: this runs for every message
    for c in value:
        converted.append(c.to(target) if c.is_floating_point() and c.dtype != target else c)
    return tuple(converted)


def wrap(semiring: Semiring, value: Value | None, like: Tensor) -> Message | None:
    """A message for ``value`` with ``like``'s metadata (None stays the symbolic zero)."""
    if value is None:
        return None
    return _message(semiring, _in_precision(value, like.dtype), like.shape, like.dtype, like.device)


def wrap_meta(semiring: Semiring, value: Value | None, meta) -> Message | None:
    """A message for ``value`` with metadata ``meta = (shape, dtype, device)``."""
    if value is None:
        return None
    shape, dtype, device = meta
    # _message(semiring, _in_precision(value, dtype), ...), inline: this runs for every
    # message of a semiring of several components
    target = dtype if dtype in _OWN_PRECISION else message_dtype(dtype)
    if type(shape) is not torch.Size:
        shape = torch.Size(shape)
    fitted = []
    for c in value:
        if c.dtype != target and c.is_floating_point():
            c = c.to(target)
        fitted.append(c if c.shape == shape else c.expand(shape))
    r = _make_wrapper_subclass(Message, shape, dtype=dtype, device=device)
    r.semiring = semiring
    r.value = tuple(fitted)
    return r


def unwrap(semiring: Semiring, grad: Tensor | None, op: str) -> Value | None:
    """The semiring value inside an incoming message (None stays None)."""
    if grad is None:
        return None
    if not isinstance(grad, Message):
        raise SemiringMismatchError(
            f"{op}: the backward received a plain tensor where a {semiring!r} message was "
            "expected. Seed the backward with `sa.grad(...)`, or run the library's own "
            "`.backward()` / `torch.autograd.grad` inside `with sa.seeding():`, which lifts "
            "its real gradient into the semiring."
        )
    if grad.semiring is not semiring and grad.semiring != semiring:
        raise SemiringMismatchError(
            f"{op}: a {grad.semiring!r} message reached a node recorded under {semiring!r}. "
            "One backward pass must use one semiring."
        )
    return semiring.settle(grad.value) if semiring.settles else grad.value


def wrap_one(semiring: Semiring, component: Tensor | None, meta) -> Message | None:
    """A message of a one-component semiring from its component tensor, with metadata
    ``meta = (shape, dtype, device)`` (None stays the symbolic zero)."""
    if component is None:
        return None
    shape, dtype, device = meta
    if component.dtype != dtype or dtype not in _OWN_PRECISION:
        target = MESSAGE_DTYPES.get(dtype) or message_dtype(dtype)
        if component.dtype != target and component.is_floating_point():
            component = component.to(target)
    # _message's body, inline: this runs for every message of a one-component semiring
    if type(shape) is not torch.Size:
        shape = torch.Size(shape)
    r = _make_wrapper_subclass(Message, shape, dtype=dtype, device=device)
    r.semiring = semiring
    r.value = (component if component.shape == shape else component.expand(shape),)
    return r


# ----- structural aten ops on messages -------------------------------------------------
def _msg_args(args) -> tuple[Message, Semiring]:
    for a in args:
        if isinstance(a, Message):
            return a, a.semiring
    raise AssertionError("structural handler called without a message")


def _per_component(func, msg: Message, *args, **kwargs) -> Message:
    out = tuple(func(c, *args, **kwargs) for c in msg.value)
    return _message(msg.semiring, out, out[0].shape, msg.dtype, _CPU if msg.is_cpu else msg.device)


def _map(func, msg, *args, **kwargs):
    return _per_component(func, msg, *args, **kwargs)


def _view(func, msg, size):
    """A view of a message: each component reshaped (a component's strides are its own,
    not the contiguous ones the message reports: a transposed one is copied)."""
    return _per_component(aten.reshape.default, msg, size)


#: the end of the error for arithmetic on a message outside a backward pass
_NOT_A_GRADIENT = (
    "a semiring message (a Message) outside a backward pass. A message holds semiring "
    "components (`.value`), not a gradient: optimizers and arithmetic cannot use it. Read "
    "it with `sa.grad(...)` (readouts) or `msg.semiring.readout(msg.value)`, and set "
    "`p.grad = None` on every parameter before an optimizer step or an ordinary backward."
)


def _add(func, a, b, *, alpha=1):
    if alpha != 1 or not isinstance(a, Message) or not isinstance(b, Message):
        if torch._C._current_autograd_node() is None:
            raise ForeignOpError(f"aten op '{func}' was applied to {_NOT_A_GRADIENT}")
        other = b if isinstance(a, Message) else a
        raise ForeignOpError(
            "A semiring message was added to "
            + (f"a plain tensor of shape {tuple(other.shape)}" if alpha == 1 else f"alpha={alpha}")
            + ". This happens when a leaf's `.grad` still holds an ordinary gradient: set "
            "`x.grad = None` before a semiring backward."
        )
    if a.semiring is not b.semiring and a.semiring != b.semiring:
        raise SemiringMismatchError(
            f"cannot merge a {a.semiring!r} message with a {b.semiring!r} message"
        )
    value = a.semiring.merge(a.value, b.value)
    shape = a.shape if a.shape == b.shape else torch.broadcast_shapes(a.shape, b.shape)
    return _message(a.semiring, value, shape, a.dtype, _CPU if a.is_cpu else a.device)


def _add_inplace(func, a, b, *, alpha=1):
    merged = _add(func, a, b, alpha=alpha)
    a.value = merged.value
    return a


def _sum(func, msg, dim=None, keepdim=False, *, dtype=None):
    value = msg.semiring.sum(msg.value, dim, keepdim)
    return _message(msg.semiring, value, value[0].shape, dtype or msg.dtype, msg.device)


def _zero_fill(msg: Message, shape, place: Callable[[Tensor, Tensor], None]) -> Message:
    zero = msg.semiring.zero(shape, msg.value[0])
    out = []
    for z, c in zip(zero, msg.value):
        z = z.to(c.dtype).clone()
        place(z, c)
        out.append(z)
    return _message(msg.semiring, tuple(out), shape, msg.dtype, msg.device)


def _select_backward(func, msg, input_sizes, dim, index):
    return _zero_fill(msg, input_sizes, lambda z, c: z.select(dim, index).copy_(c))


def _slice_backward(func, msg, input_sizes, dim, start, end, step):
    return _zero_fill(
        msg,
        input_sizes,
        lambda z, c: z[
            (slice(None),) * (dim % len(input_sizes)) + (slice(start, end, step),)
        ].copy_(c),
    )


def _new_zeros(func, msg, size, **kwargs):
    value = msg.semiring.zero(size, msg.value[0])
    return _message(msg.semiring, value, size, msg.dtype, msg.device)


def _new_empty_strided(func, msg, size, stride, **kwargs):
    return _new_zeros(func, msg, size)


def _copy_inplace(func, dst, src, non_blocking=False):
    if not isinstance(dst, Message) or not isinstance(src, Message):
        raise ForeignOpError(
            "a semiring message was copied to or from a plain tensor; messages only copy "
            "into messages"
        )
    if dst.semiring != src.semiring:
        raise SemiringMismatchError(
            f"cannot copy a {src.semiring!r} message into a {dst.semiring!r} message"
        )
    return _assign(dst, src.value)


def _zeros_like(func, msg, **kwargs):
    return _new_zeros(func, msg, msg.shape)


def _to_copy(func, msg, *, dtype=None, **kwargs):
    return _message(msg.semiring, msg.value, msg.shape, dtype or msg.dtype, msg.device)


def _scatter_into(func, base, flat_positions: Tensor, values):
    """base ⊕ (the values ⊕-scattered to the flat positions of base), where ``values``
    holds one message element per position (a read taken several times gives several paths
    into one element, merged by ⊕ as any op's)."""
    if not isinstance(base, Message) or not isinstance(values, Message):
        raise ForeignOpError(
            f"aten op '{func}' mixed a semiring message with a plain tensor; only messages "
            "scatter into messages"
        )
    semiring = base.semiring
    if values.semiring != semiring:
        raise SemiringMismatchError(
            f"cannot scatter a {values.semiring!r} message into a {semiring!r} message"
        )
    flat = flat_positions.reshape(-1)
    spread = tuple(c.expand(flat_positions.shape).reshape(-1) for c in values.value)
    scattered = semiring.index_add(spread, flat, base.numel())
    value = semiring.add(base.value, tuple(c.reshape(base.shape) for c in scattered))
    return _message(semiring, _in_precision(value, base.dtype), base.shape, base.dtype, base.device)


def _index_put(func, base, indices, values, accumulate=False):
    """The backward of advanced indexing (``x[idx]``): ``index_put(zeros, idx, grad,
    accumulate=True)``."""
    if not accumulate:
        raise ForeignOpError(
            f"aten op '{func}' without accumulate reached a semiring message: only the "
            "accumulating index_put of an indexing backward is supported"
        )
    where = tuple(slice(None) if i is None else i for i in indices)
    return _scatter_into(func, base, element_positions(base.shape, base.device)[where], values)


def _scatter_add(func, base, dim, index, src):
    """The backward of ``gather``: ``scatter_add(zeros, dim, index, grad)`` (the part of
    ``src`` of ``index``'s shape is scattered)."""
    if isinstance(src, Message):
        part = tuple(slice(0, n) for n in index.shape)
        value = tuple(c[part] for c in src.value)
        src = Message(src.semiring, value, index.shape, src.dtype, src.device)
    positions = gather_positions(base.shape, dim, index).view(index.shape)
    return _scatter_into(func, base, positions, src)


# ----- torch's backward of view and shape ops run before the patch --------------------
# A view, slice, split, stack … of the input taken before the patched model (``x.unbind(0)``,
# ``torch.stack``, ``x.as_strided``) leaves torch's own backward nodes between the model
# and the input; their formulas only move, copy or ⊕-sum messages, and fill the elements
# no message reaches with zero, which must be the semiring's zero.
def _value_of(func, t, semiring: Semiring, like: Message) -> Value:
    """The semiring value of one operand of a structural op: a message's, or the semiring's
    zero for a plain tensor of zeros (what torch's backward formulas create for an output
    whose gradient is undefined: ``unbind``'s and ``split``'s unused pieces)."""
    if isinstance(t, Message):
        if t.semiring is not semiring and t.semiring != semiring:
            raise SemiringMismatchError(
                f"aten op '{func}' combined a {t.semiring!r} message with a {semiring!r} one"
            )
        return t.value
    if not isinstance(t, Tensor) or bool(t.ne(0).any()):
        raise ForeignOpError(
            f"aten op '{func}' combined a semiring message with a plain tensor that is not "
            "zero: only torch's zeros for an unused output stand in for the semiring zero. "
            "Record the computation inside `sa.patch(model, semiring)`."
        )
    zero = semiring.zero(t.shape, like.value[0])
    return tuple(z.to(c.dtype) for z, c in zip(zero, like.value))


def _joined(join):
    """``cat``/``stack`` of messages (and torch's zeros for unused pieces), per component."""

    def handler(func, tensors, dim=0):
        like = next(t for t in tensors if isinstance(t, Message))
        values = [_value_of(func, t, like.semiring, like) for t in tensors]
        out = tuple(join([v[i] for v in values], dim) for i in range(len(like.value)))
        return Message(like.semiring, out, out[0].shape, like.dtype, like.device)

    return handler


def _assign(dst: Message, value: Value) -> Message:
    """Write ``value`` into ``dst``: in place into its components where they alias another
    message's (a view made by ``as_strided``), else by replacing them."""
    value = _in_precision(tuple(v.expand(dst.shape) for v in value), dst.dtype)
    if getattr(dst, "_aliases", False):
        for d, v in zip(dst.value, value):
            d.copy_(v)
    else:
        dst.value = tuple(v.clone() for v in value)
    return dst


def _as_strided(func, msg, size, stride, storage_offset=None):
    """A strided view of a message's elements in their contiguous order (the layout the
    message reports): each component viewed the same way, aliasing it, so a write into the
    view (``as_strided_backward``'s ``copy_``) reaches the message."""
    bases = tuple(c if c.is_contiguous() else c.contiguous() for c in msg.value)
    msg.value = bases
    out = tuple(
        c.as_strided(size, stride, c.storage_offset() + (storage_offset or 0)) for c in bases
    )
    view = _message(msg.semiring, out, size, msg.dtype, msg.device)
    view._aliases = True
    return view


def _index_add(func, base, dim, index, source, alpha=1):
    """``index_select``'s and an overlapping ``as_strided``'s backward: ``source`` ⊕-added
    into ``base`` at ``index`` along ``dim``."""
    if not isinstance(source, Message):
        _refuse_overlapping_as_strided(func)
    if alpha != 1:
        raise ForeignOpError(f"aten op '{func}' with alpha={alpha} reached a semiring message")
    positions = element_positions(base.shape, base.device)
    if base.dim():
        positions = positions.index_select(dim, index.to(torch.int64))
    else:
        positions = positions.reshape(1)[index.to(torch.int64)].reshape(source.shape)
    return _scatter_into(func, base, positions, source)


def _index_add_inplace(func, base, dim, index, source, alpha=1):
    return _assign(base, _index_add(func, base, dim, index, source, alpha).value)


def _unfold_backward(func, msg, input_sizes, dim, size, step):
    """Each input element ⊕ over the windows that read it."""
    positions = element_positions(input_sizes, msg.device).unfold(dim, size, step)
    return _scatter_into(func, _new_zeros(func, msg, input_sizes), positions, msg)


def _relocated(op: Callable[..., Tensor]):
    """An op that moves each element of its input to at most one place and fills the rest
    with zero (``diagonal_backward``, ``constant_pad_nd``, ``tril``, ``triu``): run on the
    elements' positions, it says where each message element goes; the rest is the
    semiring's zero."""

    def handler(func, msg, *args, **kwargs):
        source = op(element_positions(msg.shape, msg.device) + 1, *args, **kwargs)
        read, present = (source - 1).clamp(min=0).reshape(-1), source > 0
        zero = msg.semiring.zero(source.shape, msg.value[0])
        out = tuple(
            torch.where(present, c.reshape(-1)[read].reshape(source.shape), z.to(c.dtype))
            for c, z in zip(msg.value, zero)
        )
        return _message(msg.semiring, out, source.shape, msg.dtype, msg.device)

    return handler


def _scatter_like(scatter):
    """``select_scatter``/``slice_scatter``/``diagonal_scatter``/``as_strided_scatter`` of a
    message into a message (the functional form of a view backward: ``new_zeros`` then the
    scatter), per component."""

    def handler(func, base, src, *args, **kwargs):
        like = base if isinstance(base, Message) else src
        b = _value_of(func, base, like.semiring, like)
        s = _value_of(func, src, like.semiring, like)
        out = tuple(
            scatter(bc.contiguous(), sc.to(bc.dtype), *args, **kwargs) for bc, sc in zip(b, s)
        )
        return Message(like.semiring, out, out[0].shape, like.dtype, like.device)

    return handler


def _masked_scatter(func, base, mask, source):
    """``masked_select``'s backward: ``masked_scatter(zeros, mask, grad)``, the k-th
    message element placed at the k-th element the mask selects (base and mask broadcast
    together), the rest kept (torch's zeros: the semiring's zero)."""
    like = source if isinstance(source, Message) else base
    b = _value_of(func, base, like.semiring, like)
    s = _value_of(func, source, like.semiring, like)
    shape = torch.broadcast_shapes(base.shape, mask.shape)
    out = tuple(
        bc.expand(shape).contiguous().masked_scatter(mask, sc.to(bc.dtype)) for bc, sc in zip(b, s)
    )
    return Message(like.semiring, out, shape, like.dtype, like.device)


def _put(func, base, index, source, accumulate=False):
    """``take``'s backward: ``put(zeros, index, grad, accumulate=True)``, each message
    element ⊕-added at its index of the flattened base (negative indices from the end)."""
    if not accumulate or not isinstance(source, Message):
        raise ForeignOpError(
            f"aten op '{func}' without accumulate, or into a message, reached a semiring "
            "message: only the accumulating put of take's backward is supported"
        )
    S = source.semiring
    zero = Message(S, _value_of(func, base, S, source), base.shape, source.dtype, source.device)
    positions = torch.remainder(index.reshape(-1), max(base.numel(), 1))
    return _scatter_into(func, zero, positions.reshape(index.shape), source)


def _refuse_overlapping_as_strided(func) -> None:
    """The error for ``as_strided`` of a tensor whose elements share memory, where torch's
    backward counts the sharing elements (``index_add_`` of ones) and divides by the count."""
    node = torch._C._current_autograd_node()
    if node is not None and node.name() == "AsStridedBackward0":
        raise ForeignOpError(
            f"aten op '{func}': as_strided was taken of a tensor whose elements overlap in "
            "memory (an expanded tensor, or a view with a zero stride): torch's backward "
            "divides the gradient among the elements sharing a memory location, which has "
            "no semiring meaning. Take `.contiguous()` (or `.clone()`) of the tensor before "
            "`as_strided`, or record the computation inside `sa.patch(model, semiring)`."
        )


def _div_tensor_inplace(func, a, b):
    _refuse_overlapping_as_strided(func)
    return _div_inplace(func, a, b)


# ----- native backward ops of a score read from a patched model's output ---------------
#: autograd nodes whose backward scales each element's gradient by its local derivative
#: (a diagonal Jacobian, broadcast copies summed by the engine): ``grad * w``, ``grad / w``
#: and ``-grad`` there are ⊗ lift(w), ⊗ lift(1/w) and ⊗ lift(−1) on messages
ELEMENTWISE_NODES = frozenset(
    {
        "MulBackward0",
        "MulBackward1",
        "DivBackward0",
        "DivBackward1",
        "NegBackward0",
        "SubBackward0",
        "SubBackward1",
        "RsubBackward0",
        "RsubBackward1",
        "AbsBackward0",
        "MeanBackward0",
        "MeanBackward1",
        "ExpBackward0",
        "LogBackward0",
        "BinaryCrossEntropyWithLogitsBackward0",
        "MseLossBackward0",
        "SmoothL1LossBackward0",
        "HuberLossBackward0",
    }
)


def _scaled(func, msg: Message, w: Tensor | float) -> Message:
    """``msg`` ⊗ lift(w) elementwise (broadcasting), where the backward node allows it."""
    node = torch._C._current_autograd_node()
    if node is None:
        raise ForeignOpError(f"aten op '{func}' was applied to {_NOT_A_GRADIENT}")
    if node.name() not in ELEMENTWISE_NODES:
        raise ForeignOpError(
            f"aten op '{func}' scaled a semiring message in the backward node {node.name()}, "
            "whose local derivatives are not read off elementwise. Compute this score inside "
            "`sa.patch(model, semiring)`, or add a YAML entry for its op."
        )
    S = msg.semiring
    weight = as_message(w, (msg.dtype, msg.device))
    value = S.mul_lift(msg.value, weight)
    shape = torch.broadcast_shapes(msg.shape, weight.shape)
    return Message(S, _in_precision(value, msg.dtype), shape, msg.dtype, msg.device)


def _mul(func, a, b):
    if isinstance(a, Message) and isinstance(b, Message):
        raise ForeignOpError(f"aten op '{func}' multiplied two semiring messages")
    return _scaled(func, a, b) if isinstance(a, Message) else _scaled(func, b, a)


def _div(func, a, b, **kwargs):
    if not isinstance(a, Message) or isinstance(b, Message) or kwargs.get("rounding_mode"):
        raise ForeignOpError(f"aten op '{func}' divided by a semiring message")
    return _scaled(func, a, 1.0 / b)


def _div_inplace(func, a, b):
    out = _div(func, a, b)
    a.value = out.value
    return a


def _neg(func, msg):
    return _scaled(func, msg, -1.0)


def _loss_backward(func, grad, input, *args, **kwargs):
    """A loss's native backward (``nll_loss_backward``, ``mse_loss_backward`` …): each
    input element feeds one loss element, so the backward of a unit cotangent is each
    edge's weight; the message at each element is its loss element's message ⊗ lift(it)."""
    if not isinstance(grad, Message):
        raise ForeignOpError(f"aten op '{func}' received a semiring message as a tensor input")
    unit = func(
        torch.ones(grad.shape, dtype=grad.dtype, device=grad.device), input, *args, **kwargs
    )
    if grad.dim() == 0:
        view = (1,) * unit.dim()
    elif grad.shape == unit.shape:
        view = tuple(unit.shape)
    else:  # a loss per row of classes: (N, *d) over (N, C, *d)
        view = (*grad.shape[:1], 1, *grad.shape[1:])
    S = grad.semiring
    spread = tuple(c.reshape(view).expand(unit.shape) for c in grad.value)
    value = S.mul_lift(spread, as_message(unit, (grad.dtype, grad.device)))
    return Message(S, _in_precision(value, unit.dtype), unit.shape, unit.dtype, unit.device)


#: the YAML rules of the entries behind native backward ops a score read after the patch
#: meets (entry name → its rule in the generic module, ``rule(S, grad, result=…, dim=…,
#: _ref=…)``); ``engine/dispatch.py`` fills it when it loads the generated modules
ENTRY_RULES: dict[str, Callable[..., Value]] = {}


def _by_entry_rule(entry: str) -> Callable[..., Message]:
    """The handler of ``aten._softmax_backward_data``-shaped ops (grad, output, dim,
    input_dtype): the YAML rule of ``entry`` on the message."""

    def backward(func, grad, output, dim, input_dtype):
        S, ref = grad.semiring, (grad.dtype, grad.device)
        rule = ENTRY_RULES[entry]
        value = rule(S, grad.value, result=as_message(output, ref), dim=dim, _ref=ref)
        return Message(S, _in_precision(value, input_dtype), grad.shape, input_dtype, grad.device)

    backward.__name__ = f"_{entry}_backward"
    return backward


_STRUCTURAL: dict[Any, Callable[..., Any]] = {
    aten.add.Tensor: _add,
    aten.add_.Tensor: _add_inplace,
    aten.detach.default: _map,
    aten.alias.default: _map,
    aten.clone.default: lambda f, m, **kw: _map(f, m),
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.reshape.default: _map,
    aten.expand.default: _map,
    aten.permute.default: _map,
    aten.transpose.int: _map,
    aten.t.default: _map,
    aten.squeeze.dim: _map,
    aten.squeeze.dims: _map,
    aten.squeeze.default: _map,
    aten.unsqueeze.default: _map,
    aten.select.int: _map,
    aten.slice.Tensor: _map,
    aten.sum.dim_IntList: _sum,
    aten.sum.default: _sum,
    aten.select_backward.default: _select_backward,
    aten.slice_backward.default: _slice_backward,
    aten.new_zeros.default: _new_zeros,
    aten.zeros_like.default: _zeros_like,
    aten.new_empty_strided.default: _new_empty_strided,
    aten.copy_.default: _copy_inplace,
    aten._to_copy.default: _to_copy,
    aten.index_put.default: _index_put,
    aten.cat.default: _joined(torch.cat),
    aten.stack.default: _joined(torch.stack),
    aten.as_strided.default: _as_strided,
    aten.index_add.default: _index_add,
    aten.index_add_.default: _index_add_inplace,
    aten.unfold_backward.default: _unfold_backward,
    aten.diagonal_backward.default: _relocated(aten.diagonal_backward.default),
    aten.constant_pad_nd.default: _relocated(aten.constant_pad_nd.default),
    aten.tril.default: _relocated(aten.tril.default),
    aten.triu.default: _relocated(aten.triu.default),
    aten.select_scatter.default: _scatter_like(torch.select_scatter),
    aten.slice_scatter.default: _scatter_like(torch.slice_scatter),
    aten.diagonal_scatter.default: _scatter_like(torch.diagonal_scatter),
    aten.as_strided_scatter.default: _scatter_like(torch.as_strided_scatter),
    aten.flip.default: _map,
    aten.roll.default: _map,
    aten.rot90.default: _map,
    aten.diagonal.default: _map,
    aten.unfold.default: _map,
    aten.movedim.int: _map,
    aten.div_.Tensor: _div_tensor_inplace,
    aten.scatter_add.default: _scatter_add,
    aten.masked_scatter.default: _masked_scatter,
    aten.put.default: _put,
    aten.mul.Tensor: _mul,
    aten.mul.Scalar: _mul,
    aten.div.Tensor: _div,
    aten.div.Scalar: _div,
    aten.div_.Scalar: _div_inplace,
    aten.neg.default: _neg,
    aten.nll_loss_backward.default: _loss_backward,
    aten.nll_loss2d_backward.default: _loss_backward,
    aten.mse_loss_backward.default: _loss_backward,
    aten.smooth_l1_loss_backward.default: _loss_backward,
    aten.huber_loss_backward.default: _loss_backward,
    aten._softmax_backward_data.default: _by_entry_rule("softmax"),
    aten._log_softmax_backward_data.default: _by_entry_rule("log_softmax"),
}


def unwrap_plain(semiring: Semiring, grad: Tensor | None, op: str) -> Tensor | None:
    """Real-semiring backward: the incoming gradient, which must be an ordinary tensor."""
    if isinstance(grad, Message):
        raise SemiringMismatchError(
            f"{op}: a {grad.semiring!r} message reached a node recorded under Real(). "
            "One backward pass must use one semiring."
        )
    return grad
