"""semiring_autograd: backpropagation over arbitrary semirings for PyTorch.

>>> import semiring_autograd as sa
>>> with sa.patch(model, sa.MaxProduct()):
...     y = model(x)
>>> score = sa.grad(y[0, 3], x)   # weight of the strongest path to every element of x

The package, one layer on the next (docs/architecture.md): ``semirings`` (the algebra) and
``kernels``; ``ops`` (what a generated Function computes with); ``generated`` (one
Function per op, emitted from derivatives/*.yaml by ``codegen``); ``engine`` (the patch,
``sa.grad``, node records, tracing); ``explain`` (top paths, attribution); ``integrations``
(Hugging Face loading, the CLI).
"""

from .engine.dispatch import Registry
from .engine.compiled import clear as clear_compiled
from .engine.compiled import stats as compiled_stats
from .engine.compiled_step import CompiledStep, compiled_step
from .engine.grad import grad, message_value, recorded_semiring, seed_message
from .engine.graph import NodeInfo, node_info
from .engine.patch import PatchHandle, patch
from .engine.trace import TraceEvent, trace
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
from .explain.attribution import Attribution, Prediction, attribute
from .explain.flow import ConsumerFlow, capture, consumer_flow, module_flow
from .explain.k_paths import top_paths, top_paths_from
from .explain.paths import AttentionEdge, Path, PathFinder, Step, top_path
from .ops.message import Message
from .semirings import (
    BUILTIN_SEMIRINGS,
    Boolean,
    Counting,
    Entropy,
    KBest,
    Log,
    MaxProduct,
    Real,
    Semiring,
    SignedMaxProduct,
    Value,
    check_semiring,
)

__all__ = [
    "AttentionEdge",
    "BackwardOutOfMemoryError",
    "Attribution",
    "attribute",
    "capture",
    "clear_compiled",
    "compiled_stats",
    "compiled_step",
    "CompiledStep",
    "consumer_flow",
    "ConsumerFlow",
    "BUILTIN_SEMIRINGS",
    "Boolean",
    "Counting",
    "Entropy",
    "KBest",
    "ForeignOpError",
    "Log",
    "MaxProduct",
    "Message",
    "module_flow",
    "NodeInfo",
    "PatchError",
    "PatchHandle",
    "Path",
    "PathFinder",
    "Prediction",
    "Real",
    "Registry",
    "Semiring",
    "SemiringAutogradError",
    "SemiringDefinitionError",
    "SemiringLawError",
    "SemiringMismatchError",
    "SignedMaxProduct",
    "Step",
    "TraceEvent",
    "UnsupportedOpError",
    "Value",
    "check_semiring",
    "grad",
    "message_value",
    "node_info",
    "patch",
    "recorded_semiring",
    "seed_message",
    "top_path",
    "top_paths",
    "top_paths_from",
    "trace",
]


def __getattr__(name: str):
    """``sa.captum``: the Captum adapter, imported on first use (it needs ``captum``)."""
    if name == "captum":
        import importlib

        return importlib.import_module(".integrations.captum", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
