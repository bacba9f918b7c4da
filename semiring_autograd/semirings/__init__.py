"""Semirings: the interface with its generic algorithms, the built-in semirings (one module
each), the k-best semiring, the tensor-level max-gradient, their registry, and the law checker ``check_semiring``.
"""

from .base import Semiring, Value, message_dtype
from .boolean import Boolean
from .counting import Counting
from .entropy import Entropy
from .k_best import KBest
from .laws import check_semiring
from .log import Log
from .max_product import MaxProduct
from .real import Real
from .registry import BUILTIN_SEMIRINGS, SEMIRINGS, SemiringSpec, semiring_named, spec_of
from .signed_max_product import SignedMaxProduct

__all__ = [
    "BUILTIN_SEMIRINGS",
    "SEMIRINGS",
    "Boolean",
    "Counting",
    "Entropy",
    "KBest",
    "Log",
    "MaxProduct",
    "Real",
    "Semiring",
    "SemiringSpec",
    "SignedMaxProduct",
    "Value",
    "check_semiring",
    "message_dtype",
    "semiring_named",
    "spec_of",
]
