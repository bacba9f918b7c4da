"""``sa.compiled_step``: a model's patched forward and its semiring backward as one program.

``sa.grad(..., compile=True)`` replays the backward, but the patched forward still runs one
Python ``autograd.Function`` per op. A step captures both: its first call for a signature
(the tensors' shapes, strides, storage offsets, dtypes and devices, the other arguments,
the model's parameters and buffers) runs ``with sa.patch(model, semiring): out =
read(model, *inputs)`` and ``sa.grad(out, inputs)`` under the recorder of ``compiled.py``
(``program.py``); later calls run the
recorded operators, forward and backward, from the new inputs, with no patch, no graph and
no engine. Guards, variants, the check of a program's first replay against eager and the
refusals are ``compiled.py``'s.

The program reads the model's parameters and buffers as they are when it runs (it holds
the tensors, not copies): a weight changed in place is seen; replacing a parameter or
buffer, or moving the model, changes the signature. State the forward keeps outside its
tensors' values (a module attribute set during the forward, a cache carried from one call
to the next) is not replayed.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor, nn

from ..errors import SemiringAutogradError
from ..semirings.base import Semiring
from . import compiled
from .signature import Key, Signature, Uncapturable
from .grad import grad, readouts
from .patch import patch


class CompiledStep:
    """``step(*inputs, **kwargs)`` = the readouts of ``sa.grad(out, inputs)`` where
    ``out = read(model, *inputs, **kwargs)`` ran under ``sa.patch(model, semiring)``."""

    def __init__(
        self, model: nn.Module, semiring: Semiring, read: Callable[..., Tensor], raw: bool
    ) -> None:
        self.model = model
        self.semiring = semiring
        self.read = read
        self.raw = raw

    def __call__(self, *inputs: Tensor, **kwargs: Any) -> Tensor | tuple:
        if not inputs:
            raise ValueError("a compiled step takes the tensors to differentiate w.r.t.")
        for i, x in enumerate(inputs):
            if not isinstance(x, Tensor) or not x.requires_grad:
                raise ValueError(
                    f"compiled step: input {i} is not a tensor that requires grad; pass the "
                    "tensors to differentiate w.r.t. positionally (x.requires_grad_()) and "
                    "anything else as keyword arguments"
                )
        ins = list(inputs)

        def eager(retain: bool) -> tuple:
            with patch(self.model, self.semiring):
                out = self.read(self.model, *ins, **kwargs)
            return grad(out, ins, raw=True)

        results = self._run(ins, kwargs, eager)
        final = readouts(self.semiring, ins, results, self.raw)
        return final[0] if len(ins) == 1 else final

    def _run(self, ins: list[Tensor], kwargs: dict, eager: Callable[[bool], tuple]) -> Any:
        sig = Signature()  # its slots: the inputs, then the tensors among kwargs
        try:
            inputs = tuple(sig.tensor(x) for x in ins)
            extra = sig.describe(kwargs)
            held = _held_tensors(self.model)
            model = tuple((id(t), t.shape, t.dtype, t.device) for t in held)
        except Uncapturable as exc:
            compiled.refuse(str(exc))
            return eager(False)
        key = Key(("step", id(self), self.semiring, inputs, extra, model))
        programs = compiled.programs_for(key)
        if programs is None:
            return eager(False)
        parameters = frozenset(id(t) for t in held)
        return programs.call(sig.slots, eager, False, parameters)


def _held_tensors(model: nn.Module) -> list[Tensor]:
    """The parameters and buffers of ``model`` and its submodules, in a fixed order for a
    fixed module tree (each module's own dicts read directly: ``model.parameters()``'s
    generators and name prefixes cost several times more, on every call of a step)."""
    held: list[Tensor] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        held += [t for t in module._parameters.values() if t is not None]
        held += [t for t in module._buffers.values() if t is not None]
        stack += [m for m in module._modules.values() if m is not None]
    return held


def compiled_step(
    model: nn.Module,
    semiring: Semiring,
    read: Callable[..., Tensor],
    *,
    raw: bool = False,
) -> CompiledStep:
    """A function ``step(*inputs, **kwargs)`` giving, per input, the readout of the semiring
    backward from ``read(model, *inputs, **kwargs)`` (the model's forward under
    ``sa.patch(model, semiring)`` and what is read from it) — ``sa.grad``'s result, or with
    ``raw=True`` the messages — as one program captured per signature: see the module
    docstring. Inputs are tensors that require grad; tensors among the keyword arguments
    (an attention mask) are inputs of the program too."""
    if not isinstance(model, nn.Module):
        raise SemiringAutogradError(f"compiled_step takes an nn.Module, got {type(model)}")
    if not isinstance(semiring, Semiring):
        raise SemiringAutogradError(
            f"compiled_step takes a semiring instance (e.g. sa.MaxProduct()), got {semiring!r}"
        )
    return CompiledStep(model, semiring, read, raw)
