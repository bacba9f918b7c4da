"""semiring_autograd: backpropagation over arbitrary semirings for PyTorch.

>>> import semiring_autograd as sa
>>> with sa.patch(model, sa.MaxProduct()):
...     y = model(x)
>>> score = sa.grad(y[0, 3], x)   # weight of the strongest path to every element of x
"""

from .attribution import Attribution, attribute
from .api import grad, message_value, recorded_semiring, seed_message
from .builtin_semirings import (
    BUILTIN_SEMIRINGS,
    Boolean,
    Counting,
    Entropy,
    Log,
    MaxProduct,
    Real,
    SignedMaxProduct,
)
from .errors import (
    ForeignOpError,
    PatchError,
    SemiringAutogradError,
    SemiringLawError,
    SemiringMismatchError,
    UnsupportedOpError,
)
from .graph import NodeInfo, node_info
from .message import Message
from .op_table import Registry
from .patching import PatchHandle, patch
from .paths import Path, PathFinder, Step, top_path
from .semiring import Semiring, Value
from .tracing import TraceEvent, trace

__all__ = [
    "Attribution",
    "attribute",
    "BUILTIN_SEMIRINGS",
    "Boolean",
    "Counting",
    "Entropy",
    "ForeignOpError",
    "Log",
    "MaxProduct",
    "Message",
    "NodeInfo",
    "PatchError",
    "PatchHandle",
    "Path",
    "PathFinder",
    "Real",
    "Registry",
    "Semiring",
    "SemiringAutogradError",
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
    "trace",
]


def __getattr__(name: str):
    if name == "check_semiring":
        from .checks import check_semiring

        return check_semiring
    raise AttributeError(f"module 'semiring_autograd' has no attribute {name!r}")
