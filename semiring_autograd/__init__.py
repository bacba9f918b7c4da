"""semiring_autograd: backpropagation over semirings for PyTorch.

>>> import semiring_autograd as sa
>>> with sa.patch(model, sa.MaxProduct()):
...     y = model(x)
>>> score = sa.grad(y[0, 3], x)   # weight of the strongest path to every element of x

This namespace holds what a user calls: ``patch``, ``grad``, ``compiled_step`` and
``seeding`` (other libraries' plain ``.backward()`` seeded with the semiring's one); the
readouts built on them (``trace``, ``top_path``, ``top_paths``, ``attribute``,
``module_flow``, ``consumer_flow``, ``node_info``); the semirings and ``check_semiring``;
the exceptions; and ``sa.captum`` (imported on first use, it needs ``captum``). The types
these return and the rest live in their modules, one layer on the next
(docs/architecture.md): ``semirings`` (the algebra) and ``kernels``; ``ops`` (what a
generated Function computes with); ``generated`` (one Function per op, emitted by
``codegen``); ``engine`` (the patch, ``sa.grad``, node records, tracing, and
``engine.compiled``); ``explain`` (top paths, attribution); ``integrations`` (Hugging Face
loading, the CLI, Captum).
"""

import importlib.util as _importlib_util
from pathlib import Path as _Path


def _serve_checkout_subpackages() -> None:
    """A checkout on ``PYTHONPATH`` with nothing installed (a bare GPU machine): the
    subpackages that live at the top of the checkout (``generated``, ``codegen``,
    ``derivatives``) are found there, as an install maps them."""
    root = _Path(__file__).resolve().parent.parent
    if _importlib_util.find_spec(__name__ + ".generated") is None:
        if (root / "generated" / "__init__.py").is_file():
            __path__.append(str(root))


_serve_checkout_subpackages()

from .engine.compiled.step import compiled_step
from .engine.grad import grad
from .engine.graph import node_info
from .engine.patch import patch
from .engine.plain_backward import seeding
from .engine.trace import trace
from .errors import (
    BackwardOutOfMemoryError,
    ForeignOpError,
    PatchError,
    SemiringAutogradError,
    SemiringDefinitionError,
    SemiringLawError,
    SemiringMismatchError,
    UnsupportedOpError,
)
from .explain.attribution import attribute
from .explain.dataset import attribute_dataset
from .explain.flow import consumer_flow, module_flow
from .explain.k_paths import top_paths
from .explain.paths import top_path
from .semirings import (
    Boolean,
    Counting,
    Entropy,
    KBest,
    Log,
    MaxProduct,
    Real,
    Semiring,
    SignedMaxProduct,
    check_semiring,
)
from .semirings.frozen import frozen_weights

__all__ = [
    "patch",
    "grad",
    "compiled_step",
    "seeding",
    "trace",
    "top_path",
    "top_paths",
    "attribute",
    "attribute_dataset",
    "frozen_weights",
    "module_flow",
    "consumer_flow",
    "node_info",
    "check_semiring",
    "Semiring",
    "Real",
    "MaxProduct",
    "SignedMaxProduct",
    "Log",
    "Counting",
    "Boolean",
    "Entropy",
    "KBest",
    "SemiringAutogradError",
    "UnsupportedOpError",
    "ForeignOpError",
    "SemiringMismatchError",
    "PatchError",
    "SemiringLawError",
    "SemiringDefinitionError",
    "BackwardOutOfMemoryError",
]


def __getattr__(name: str):
    """``sa.captum``: the Captum adapter, imported on first use (it needs ``captum``)."""
    if name == "captum":
        import importlib

        return importlib.import_module(".integrations.captum", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
