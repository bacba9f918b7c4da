"""The derivatives YAML (one entry per op), shipped inside the package so that `generate`
runs from an installed copy. The folder ``derivatives/`` imports as
``semiring_autograd.derivatives`` only."""

if __name__ != "semiring_autograd.derivatives":
    raise ImportError(
        f"the derivatives YAML imports as semiring_autograd.derivatives, not {__name__!r}"
    )
