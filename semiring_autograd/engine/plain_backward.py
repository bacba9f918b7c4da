"""``sa.seeding()``: other libraries' plain backward calls seeded with the semiring's one.

A backward over a graph recorded under ``sa.patch`` needs a seed message of the semiring
(``grad.seed_message``); a library that calls ``loss.backward()``,
``torch.autograd.backward`` or ``torch.autograd.grad`` itself (TransformerLens'
``run_with_cache(incl_bwd=True)``, Captum's layer methods) passes a real tensor or none, and
the first semiring node refuses it with ``SemiringMismatchError``. Inside
``with sa.seeding():`` a :class:`~torch.overrides.TorchFunctionMode` (this thread only)
catches those three calls and replaces, per output recorded under a semiring, the real
gradient ``g`` by the message ``lift(g)`` — ``lift(1)``, the semiring's one, for every
element when none is given (an output of any shape, as in ``sa.grad``; under ``sa.Real()``
the real gradient as it is). Gradients already given as messages and outputs of graphs
recorded outside any patch go through unchanged. Backward hooks then receive messages, and
``.grad`` of the leaves holds messages (``m.semiring.readout(m.value)`` reads one).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..errors import SemiringAutogradError, SemiringMismatchError
from ..ops.message import Message
from ..semirings.base import Semiring
from .grad import recorded_semiring, seed_message

#: the three entry points of a backward pass, each with the name of its gradient argument;
#: torch's own functions, under any wrapper another library installed (nnsight replaces
#: ``Tensor.backward`` by a ``functools.wraps`` wrapper, which the mode then receives)
_BACKWARD_CALLS = {
    inspect.unwrap(torch.Tensor.backward): "gradient",
    inspect.unwrap(torch.autograd.backward): "grad_tensors",
    inspect.unwrap(torch.autograd.grad): "grad_outputs",
}
_SIGNATURES = {func: inspect.signature(func) for func in _BACKWARD_CALLS}


def _semiring_of(output: Tensor) -> Semiring | None:
    """The semiring the graph behind ``output`` was recorded with; None for a graph recorded
    outside ``sa.patch`` (an ordinary backward)."""
    if output.grad_fn is None:
        return None
    try:
        return recorded_semiring(output)
    except SemiringMismatchError:
        raise
    except SemiringAutogradError:  # no node recorded under sa.patch behind it
        return None


def _seeded(output: Tensor, gradient: Any, seed: Tensor | float | None) -> Any:
    """The gradient ``output`` gets: ``gradient`` unchanged when it is a message or the
    graph is not a semiring graph, else the seed message lifting ``gradient`` (or ``seed``
    where no gradient is given)."""
    if isinstance(gradient, Message) or not isinstance(output, Tensor):
        return gradient
    semiring = _semiring_of(output)
    if semiring is None:
        return gradient
    return seed_message(semiring, output, seed if gradient is None else gradient)


class _SeedingMode(TorchFunctionMode):
    """Seeds the backward calls made while it is on (see the module docstring)."""

    def __init__(self, seed: Tensor | float | None):
        super().__init__()
        self.seed = seed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        torch_func = inspect.unwrap(func) if hasattr(func, "__wrapped__") else func
        name = _BACKWARD_CALLS.get(torch_func)
        if name is None:
            return func(*args, **(kwargs or {}))
        bound = _SIGNATURES[torch_func].bind(*args, **(kwargs or {}))
        first = next(iter(bound.arguments))  # self (Tensor.backward), tensors or outputs
        bound.arguments[name] = self._gradients(bound.arguments[first], bound.arguments.get(name))
        return func(*bound.args, **bound.kwargs)

    def _gradients(self, outputs: Tensor | Sequence[Tensor], given: Any) -> Any:
        """``given`` with every output's gradient seeded (:func:`_seeded`)."""
        if isinstance(outputs, Tensor):
            if isinstance(given, Sequence) and not isinstance(given, Tensor):
                return [_seeded(outputs, g, self.seed) for g in given]
            return _seeded(outputs, given, self.seed)
        outs = list(outputs)
        gradients = [None] * len(outs) if given is None else _as_list(given)
        if len(gradients) != len(outs):
            return given  # torch refuses the call, naming the mismatch
        return [_seeded(o, g, self.seed) for o, g in zip(outs, gradients)]


def _as_list(given: Any) -> list:
    """The gradients of a call with several outputs as torch reads them: one tensor is a
    sequence of one."""
    return [given] if isinstance(given, Tensor) else list(given)


@contextmanager
def seeding(seed: Tensor | float | None = None) -> Iterator[None]:
    """Within this block (this thread), a plain ``.backward()``, ``torch.autograd.backward``
    or ``torch.autograd.grad`` over a graph recorded under ``sa.patch(model, S)`` starts
    from the semiring seed: a real gradient ``g`` given to the call becomes ``lift(g)``,
    and where none is given every element of the output starts a path with ``lift(seed)``
    (``seed``: a number, or a tensor of the output's shape; None is 1, the semiring's
    one). Under ``sa.Real()`` a given gradient is used as it is (torch's backward)."""
    mode = _SeedingMode(seed)
    with mode:
        yield
