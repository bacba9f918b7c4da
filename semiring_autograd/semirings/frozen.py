"""Lifted weight operands kept across calls while the caller declares the weights frozen.

A semiring matmul by a lifted weight derives a GEMM operand from the whole weight on every
call: |w| (Log), w ≠ 0 (Counting), [|w|; −|w| log|w|] (Entropy). Inside
:func:`frozen_weights` the operand of each declared weight is built once and served again
while the weight's version counter, storage, offset, shape, strides and dtype are those it
was built from; it is dropped when the scope exits. A write through ``.data`` (or any
alias torch's version counter does not see) inside the scope breaks the caller's
declaration: the operand built before it is served unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor

from ..kernels.workspace import outside_tracing

_scopes: list["_Scope"] = []


class _Scope:
    """One frozen-weights scope: the declared weights by storage address (held, so the
    address names that storage while the scope lives) and the operands built from them."""

    def __init__(self, weights: list[Tensor]) -> None:
        self.held = {w.untyped_storage().data_ptr(): w.detach() for w in weights}
        self.operands: dict[tuple, tuple[int, Tensor]] = {}


def _weights_of(sources: tuple) -> list[Tensor]:
    """The tensors named by ``sources``: modules' parameters, tensors, iterables of them."""
    found: list[Tensor] = []
    for source in sources:
        if isinstance(source, torch.nn.Module):
            found.extend(source.parameters())
        elif isinstance(source, Tensor):
            found.append(source)
        elif isinstance(source, Iterable):
            found.extend(_weights_of(tuple(source)))
        else:
            raise TypeError(
                "sa.frozen_weights takes modules, tensors or iterables of them; got "
                f"{type(source).__name__}"
            )
    return found


@contextlib.contextmanager
def frozen_weights(*sources: torch.nn.Module | Tensor | Iterable) -> Iterator[None]:
    """Declare the parameters of ``sources`` (modules, tensors, iterables of them)
    unchanged inside the block: semiring matmuls by them (Log, Counting, Entropy) build
    each lifted GEMM operand once per weight version and reuse it, until the block exits.
    The operands take 1× (Log, Counting) or 2× (Entropy) the weights' memory. A tracked
    in-place write (``w.mul_(…)`` under ``no_grad``, an optimizer step) bumps the version
    and the operand is rebuilt; a write through ``.data`` is not seen and must not happen
    inside the block."""
    scope = _Scope(_weights_of(sources))
    _scopes.append(scope)
    try:
        yield
    finally:
        _scopes.remove(scope)


def _cacheable(w: Tensor) -> bool:
    """Whether ``w`` is a real tensor outside tracing, recording and ``torch.vmap`` (where an
    operand kept across calls would become a traced or recorded constant)."""
    return type(w) in (Tensor, torch.nn.Parameter) and outside_tracing(w)


def kept_operand(tag: object, w: Tensor, build: Callable[[Tensor], Tensor]) -> Tensor | None:
    """``build(w)`` (a fresh tensor, read only by its callers), kept per ``tag`` and weight
    version while ``w`` lies in a weight declared frozen; None when no scope holds ``w``
    (the caller builds its operand in scratch storage)."""
    if not _scopes or not _cacheable(w):
        return None
    address = w.untyped_storage().data_ptr()
    scope = next((s for s in reversed(_scopes) if address in s.held), None)
    if scope is None:
        return None
    key = (tag, address, w.storage_offset(), w.shape, w.stride(), w.dtype, w.device)
    version = w._version
    kept = scope.operands.get(key)
    if kept is not None and kept[0] == version:
        return kept[1]
    with torch.no_grad():
        operand = build(w)
    scope.operands[key] = (version, operand)
    return operand
