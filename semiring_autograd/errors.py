"""Exceptions raised by semiring_autograd, each naming the problem and the fix."""

import torch


class SemiringAutogradError(RuntimeError):
    """Base class of every error this library raises on purpose."""


class UnsupportedOpError(SemiringAutogradError):
    """A torch function touched a grad-requiring tensor and has no semiring formula."""


class ForeignOpError(SemiringAutogradError):
    """A non-structural aten op reached a semiring message during backward."""


class SemiringMismatchError(SemiringAutogradError):
    """Messages of different semirings met, or a message met a plain gradient."""


class PatchError(SemiringAutogradError):
    """`sa.patch` was used wrongly (already patched, bad semiring, …)."""


class SemiringDefinitionError(SemiringAutogradError):
    """A user semiring's ⊕ or ⊗ returned something other than a value of its operands'
    broadcast shape with ``n_components`` tensors."""


class SemiringLawError(SemiringAutogradError):
    """`sa.check_semiring` found a violated law."""


class BackwardOutOfMemoryError(SemiringAutogradError, torch.OutOfMemoryError):
    """The semiring backward ran out of memory; the message names the op (a
    ``torch.OutOfMemoryError``, so handlers of torch's error catch it)."""
