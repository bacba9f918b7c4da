"""The ``nn.Module`` inside an interpretability library's wrapper, for :func:`sa.patch`.

nnsight's ``NNsight(model)`` and ``LanguageModel(...)`` (its ``Envoy`` objects) are not
modules: they hold the ``nn.Module`` they run in ``_module`` and run it, in a direct call and
in ``.trace(...)``. Patching the wrapper patches that module, so the wrapper's runs record
the semiring graph and compute what the unwrapped model computes. The wrapper is recognised by
what it holds (no import of nnsight, an optional package).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def module_of(model: Any) -> Any:
    """``model`` itself; a wrapper object (not an ``nn.Module``, holding one in ``_module``:
    nnsight's ``NNsight``, ``LanguageModel`` and their submodule envoys) is unwrapped to the
    module it runs."""
    if isinstance(model, nn.Module):
        return model
    inner = getattr(model, "_module", None)
    return inner if isinstance(inner, nn.Module) else model
