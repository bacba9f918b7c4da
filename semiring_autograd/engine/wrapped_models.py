"""The ``nn.Module`` inside an interpretability library's wrapper, for :func:`sa.patch`."""

from __future__ import annotations

from typing import Any


def module_of(model: Any) -> Any:
    """``model`` itself; a wrapper object (one that is not an ``nn.Module`` but holds one) is
    unwrapped to the module it runs."""
    return model
