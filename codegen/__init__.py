"""Code generator: derivatives/*.yaml → generated/ (one autograd.Function per op per semiring).

The folder ``codegen/`` is installed as ``semiring_autograd.codegen`` and imports under that
name only (one module, one ``DerivativesError`` class, wherever it is imported from).
"""

if __name__ != "semiring_autograd.codegen":
    raise ImportError(
        f"the code generator imports as semiring_autograd.codegen, not {__name__!r}: "
        "install the project (pip install -e .) and import it under that name"
    )
