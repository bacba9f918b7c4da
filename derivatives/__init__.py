"""The derivatives YAML (one entry per op), shipped inside the package so that `generate`
runs from an installed copy."""
