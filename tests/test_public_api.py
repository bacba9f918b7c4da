"""The public surface: ``sa.__all__`` is exactly what users call, each name documented, and
the namespace holds nothing else but the subpackages and the lazy ``sa.captum``."""

from __future__ import annotations

import inspect
import types

import semiring_autograd as sa

PUBLIC = [
    # functions
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
    # semirings
    "Semiring",
    "Real",
    "MaxProduct",
    "SignedMaxProduct",
    "Log",
    "Counting",
    "Boolean",
    "Entropy",
    "KBest",
    # errors
    "SemiringAutogradError",
    "UnsupportedOpError",
    "ForeignOpError",
    "SemiringMismatchError",
    "PatchError",
    "SemiringLawError",
    "SemiringDefinitionError",
    "BackwardOutOfMemoryError",
]


def test_all_is_the_public_list():
    assert sorted(sa.__all__) == sorted(PUBLIC)
    assert len(sa.__all__) == len(set(sa.__all__))


def test_every_public_name_is_documented():
    for name in sa.__all__:
        doc = inspect.getdoc(getattr(sa, name))
        assert doc and doc.strip(), f"sa.{name} has no docstring"


def test_the_namespace_holds_only_the_public_names_and_subpackages():
    others = {
        name
        for name, value in vars(sa).items()
        if not name.startswith("_") and name not in sa.__all__
    }
    assert all(isinstance(getattr(sa, name), types.ModuleType) for name in others), others
    assert "captum" not in vars(sa)  # imported on first use
