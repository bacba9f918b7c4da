"""A patched forward under ``torch.func`` transforms (``grad``, ``vjp``; refusals for the rest).

Inside a transform a generated Function runs as torch's ``custom_function_call``: its
forward and ``setup_context`` apart, its vmap rule the one torch generates from them
(:meth:`.function.SemiringFunction.transformed`). Three things make the transform's
answer the semiring's:

- the seed: the transform's cotangent (``torch.func.grad``: one at the output) reaches the
  patched ops as a real tensor g — carried by torch's own backward of the ops the function
  runs after the patched model (an index, ``.sum()``) — and starts the paths with lift(g),
  as ``sa.grad``'s ``seed`` does (:func:`lifted`). So ``grad(f)(x)`` with ``f(x) = s(y)``,
  ``y`` the patched model's output, is ``sa.grad(y, x, seed=∂s/∂y)``: ``sa.grad(f(x), x)``
  where ``s`` reads each element of ``y`` along one path (an index, a sum, a mean, a view,
  a scaling), while a score that merges paths after the patch (``y[0] + y.sum()``) is
  lifted as one real sum;
- the readout: each input the transform differentiates (a grad-tracking leaf of the
  transform's level) enters the patched ops through one identity node,
  :class:`ReadoutBoundary`, whose backward turns the ⊕ of every path reaching the input
  into the readout the transform hands back (:func:`through_boundary`);
- refusals: forward-mode transforms (``jvp``, ``jacfwd``, ``hessian``), ``vmap`` and
  ``jacrev`` over a semiring backward (a message's ⊕ runs inside PyTorch's engine, where
  batched tensors cannot enter), and semirings whose readout has another shape than the
  input (``KBest``, ``SignedMaxProduct``) raise an error naming what answers them
  (``sa.grad``, with ``is_grads_batched=True`` for many readouts).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor
from torch._C._functorch import (
    TransformType,
    _unwrap_for_grad,
    is_gradtrackingtensor,
    maybe_get_level,
    unwrap_if_dead,
)
from torch._functorch.pyfunctorch import (
    retrieve_all_functorch_interpreters,
    retrieve_current_functorch_interpreter,
)
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import SemiringAutogradError
from ..semirings.base import Semiring, message_dtype
from .message import Message, wrap
from .spec import NODE_INFO_KEY

#: grad-tracking leaf → (semiring, the output of its ReadoutBoundary)
_BOUNDARIES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def refuse(semiring: Semiring, op: str) -> None:
    """A SemiringAutogradError where ``torch.func.vmap`` (or ``jacrev``, which vmaps its
    backward over cotangents) or a forward-mode transform runs over a semiring forward or
    backward."""
    kinds = [i.key() for i in retrieve_all_functorch_interpreters()]
    if TransformType.Jvp in kinds:
        raise SemiringAutogradError(f"{op}: {FORWARD_MODE}")
    if TransformType.Vmap in kinds:
        raise SemiringAutogradError(
            f"torch.func: vmap (or jacrev, hessian: they vmap the backward over cotangents) "
            f"reached op '{op}' under {semiring!r}: a semiring message's ⊕ runs inside "
            "PyTorch's engine, where vmap's batched tensors cannot enter. For many readouts "
            "from one backward call sa.grad(y, x, seed=stacked, is_grads_batched=True) "
            "(seed: one readout's real weights per row, e.g. rows of torch.eye for a "
            "Jacobian); for many inputs, give the patched model one batch, or loop"
        )


def _transformed_leaf(t: Any) -> bool:
    """A tensor a grad transform differentiates: a grad-tracking leaf that requires grad."""
    return (
        isinstance(t, Tensor) and t.requires_grad and t.grad_fn is None and is_gradtrackingtensor(t)
    )


def _refuse_ops_before(semiring: Semiring, op: str, t: Any) -> None:
    """A SemiringAutogradError for a tensor of a grad transform computed by an op outside
    the patch (``model(x * 2)``): the transform would hand back a message, not a readout."""
    if not isinstance(t, Tensor) or not is_gradtrackingtensor(t) or t.grad_fn is None:
        return
    node = t.grad_fn
    recorded = node.metadata.get(NODE_INFO_KEY) is not None  # recorded by sa.patch
    if recorded or isinstance(node, ReadoutBoundary._backward_cls):
        return
    raise SemiringAutogradError(
        f"torch.func: op '{op}' under {semiring!r} reads a tensor of shape {tuple(t.shape)} "
        f"made from the transformed input by {node.name()}, an op run before the patched "
        "model: the transform would reach the input with a message, not a readout. Run "
        "that op inside the patched model, differentiate with respect to its result, or "
        "call sa.grad"
    )


def readout_keeps_shape(semiring: Semiring, like: Tensor) -> bool:
    """Whether ``semiring``'s readout of a value has the primal's shape (not KBest's or
    SignedMaxProduct's leading component dimension)."""
    probe = semiring.readout(semiring.zero((1,), like))
    return tuple(probe.shape) == (1,)


def _forget_finished() -> None:
    """Drop the boundaries of transforms that have returned (their leaves' wrappers are
    dead): a boundary's graph holds its leaf, so the weak keys alone would not."""
    for leaf in [t for t in _BOUNDARIES.keys() if unwrap_if_dead(t) is not t]:
        del _BOUNDARIES[leaf]


def through_boundary(semiring: Semiring, op: str, values: Sequence[Any]) -> list[Any]:
    """``values`` with each transformed leaf replaced by its :class:`ReadoutBoundary`
    output (one per leaf and semiring, so that the engine ⊕-merges every path into it);
    refused under vmap."""
    refuse(semiring, op)
    out = list(values)
    for i, t in enumerate(values):
        if isinstance(t, list):
            out[i] = through_boundary(semiring, op, t)
            continue
        if not _transformed_leaf(t):
            _refuse_ops_before(semiring, op, t)
            continue
        known = _BOUNDARIES.get(t)
        if known is not None and known[0] == semiring:
            out[i] = known[1]
            continue
        if not readout_keeps_shape(semiring, t):
            raise SemiringAutogradError(
                f"torch.func: the {semiring!r} readout of an input of shape {tuple(t.shape)} "
                f"has another shape (a leading component dimension), but a torch.func "
                f"transform hands back one value per input element (op '{op}'). Call "
                "sa.grad(f(x), x) on a patched forward (several readouts at once: "
                "sa.grad(..., seed=stacked, is_grads_batched=True))"
            )
        _forget_finished()
        boundary = ReadoutBoundary.apply(t, semiring)
        _BOUNDARIES[t] = (semiring, boundary)
        out[i] = boundary
    return out


class ReadoutBoundary(torch.autograd.Function):
    """Identity on a transformed input; its backward hands the transform the readout of
    the ⊕ of every path's message reaching the input (the semiring zero's where none)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, semiring: Semiring) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        x, semiring = inputs
        ctx.set_materialize_grads(False)
        ctx.semiring = semiring
        ctx.meta = (x.shape, x.dtype, x.device)

    @staticmethod
    def backward(ctx: Any, message: Tensor | None) -> tuple[Tensor | None, None]:
        with below():
            return ReadoutBoundary.readout(ctx, message), None

    @staticmethod
    def readout(ctx: Any, message: Tensor | None) -> Tensor:
        S = ctx.semiring
        shape, dtype, device = ctx.meta
        if message is None:
            like = torch.empty((), dtype=message_dtype(dtype), device=device)
            return S.readout(S.zero(shape, like)).to(dtype)
        message = lifted(S, (message,))[0]  # a seed reaching the input with no op between
        return S.readout(message.value).to(dtype)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise SemiringAutogradError(FORWARD_MODE)


#: the error for a forward-mode transform
FORWARD_MODE = (
    "torch.func: forward-mode transforms (jvp, jacfwd, hessian, linearize) push real "
    "tangents forward, which have no semiring meaning: a semiring backward runs from the "
    "outputs to the inputs. Use torch.func.grad, vjp or jacrev (reverse mode) over the "
    "patched forward, or sa.grad"
)


def below_level(tree: Any) -> Any:
    """``tree`` with each tensor of the running grad transform's level unwrapped to the
    level below: a backward rule computes on those (a message's components are not the
    transform's tensors, which torch cannot read inside a message's ``__torch_dispatch__``)."""
    tracked = [t for t in tree_leaves(tree) if isinstance(t, Tensor) and is_gradtrackingtensor(t)]
    level = max((maybe_get_level(t) for t in tracked), default=None)

    def unwrap(t: Tensor) -> Tensor:
        if is_gradtrackingtensor(t) and maybe_get_level(t) == level:
            return _unwrap_for_grad(t, level)
        return t

    return tree_map_only(Tensor, unwrap, tree)


@contextmanager
def below() -> Iterator[None]:
    """Run a backward rule below the running grad transform's level, without recording:
    what it computes (a message's components) is not a tensor of the transform."""
    if torch._C._functorch.peek_interpreter_stack() is None:  # vjp's pullback, called after
        with torch.no_grad():
            yield
        return
    with torch.no_grad(), retrieve_current_functorch_interpreter().lower():
        yield


def lifted(semiring: Semiring, grads: tuple) -> tuple:
    """``grads`` unwrapped from the transform's level, each real tensor g (the transform's
    cotangent, carried by ops run after the patch) replaced by the message lift(g)."""
    out = []
    for g in below_level(grads):
        if g is None or isinstance(g, Message):
            out.append(g)
        else:
            out.append(wrap(semiring, semiring.lift(g.to(message_dtype(g.dtype))), g))
    return tuple(out)
