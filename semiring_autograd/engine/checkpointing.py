"""Activation checkpointing inside a patched forward.

``torch.utils.checkpoint(fn, ..., use_reentrant=False)`` (what Hugging Face's
``activation_checkpointing_enable`` uses) saves no activations of ``fn`` at forward and
re-runs ``fn`` when the backward first unpacks one, matching the recomputed saved tensors
to the forward's by order. Run unpatched, that recompute would record torch's own ops, whose
saved tensors are not the generated Functions' (a wrong value, or torch's metadata error).
So the first op recorded inside a checkpointed region wraps the region's recompute to run
under the same semiring: the recompute saves exactly what the forward saved.

The reentrant variant (``use_reentrant=True``) runs ``fn`` under ``no_grad`` and recomputes
it inside its own backward with torch's graph; its backward is refused with a
:class:`~semiring_autograd.errors.SemiringAutogradError` that names the fix.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import SemiringAutogradError

_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
#: the pack hook torch.utils.checkpoint pushes for a non-reentrant checkpointed forward
_PACK_HOOK = "_checkpoint_hook.__init__.<locals>.pack_hook"
#: the attribute marking a recompute function that runs under a semiring
_MARK = "_semiring_autograd_recompute"

REENTRANT_FIX = (
    "torch.utils.checkpoint(..., use_reentrant=True) recomputes the checkpointed region "
    "inside its own backward, without sa.patch, so its ops carry no semiring formulas. "
    "Use use_reentrant=False (Hugging Face: model.activation_checkpointing_enable(), or "
    "gradient_checkpointing_kwargs={'use_reentrant': False}): the recompute then runs "
    "under the same semiring, with the same readouts as without checkpointing."
)


def checkpoint_frame() -> Any | None:
    """The frame of the non-reentrant checkpointed region running now (None: none)."""
    hooks = _top_hooks(False)
    if hooks is None:
        return None
    pack = hooks[0]
    if getattr(pack, "__qualname__", None) != _PACK_HOOK:
        return None
    try:
        cell = pack.__closure__[pack.__code__.co_freevars.index("frame")]
        frame = cell.cell_contents
        frame.recompute_fn
    except (AttributeError, ValueError, TypeError, IndexError) as exc:
        raise SemiringAutogradError(
            "torch.utils.checkpoint's saved-tensor hook does not have the layout this "
            f"version of semiring_autograd reads (torch {torch.__version__}), so a "
            "checkpointed region cannot be recomputed under the semiring. Run the model "
            "without activation checkpointing under sa.patch."
        ) from exc
    return frame


def recompute_under(frame: Any, run: Callable[[Callable[..., None], tuple], None]) -> None:
    """Make ``frame``'s recompute ``original(*args)`` run as ``run(original, args)`` (once
    per frame). The wrapper carries the mark and is published by one assignment, so an
    interrupt leaves the frame's recompute either torch's or wrapped once."""
    if getattr(frame.recompute_fn, _MARK, False):
        return
    original = frame.recompute_fn

    def recompute(*args: Any) -> None:
        run(original, args)

    setattr(recompute, _MARK, True)
    frame.recompute_fn = recompute


def is_reentrant_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's refusal of ``.grad()`` through a reentrant checkpoint."""
    return isinstance(exc, RuntimeError) and "use_reentrant=True" in str(exc)
