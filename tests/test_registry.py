"""The registry of built-in semirings is what the patch, dispatch, paths and CLI obey."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import semiring_autograd as sa
import semiring_autograd_cli
from semiring_autograd.semirings.registry import (
    SEMIRINGS,
    records_torch_graph,
    semiring_named,
    spec_of,
)

IDS = [s.cls.__name__ for s in SEMIRINGS]


def _recorded(semiring: sa.Semiring, paths: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    with sa.patch(model, semiring, paths=paths):
        y = model(x)
    return y, x


def test_cli_offers_the_registry_names():
    explain = semiring_autograd_cli.parser()._subparsers._group_actions[0].choices["explain"]
    (action,) = [a for a in explain._actions if a.dest == "semiring"]
    assert list(action.choices) == [s.cli_name for s in SEMIRINGS] + ["all"]
    for spec in SEMIRINGS:
        assert type(semiring_named(spec.cli_name)) is spec.cls


@pytest.mark.parametrize("spec", SEMIRINGS, ids=IDS)
def test_each_op_runs_the_module_the_registry_names(spec):
    y, _ = _recorded(spec.cls())
    if records_torch_graph(spec.cls()):
        assert not hasattr(type(y.grad_fn), "_forward_cls")  # torch's own node
        y, _ = _recorded(spec.cls(formulas=True))
    module = type(y.grad_fn)._forward_cls.__module__
    assert module.rsplit(".", 1)[-1] == spec.generated_module


def test_torch_graph_is_real_without_formulas_only():
    class MyReal(sa.Real):
        pass

    assert records_torch_graph(sa.Real())
    assert not records_torch_graph(sa.Real(formulas=True))
    assert not records_torch_graph(MyReal()) and spec_of(MyReal()) is None


@pytest.mark.parametrize("spec", SEMIRINGS, ids=IDS)
def test_top_paths_where_the_registry_says(spec):
    y, x = _recorded(spec.cls(), paths=True)
    if spec.top_paths is None:
        with pytest.raises(sa.SemiringAutogradError, match="top paths need"):
            sa.top_path(y[0, 1], x)
    elif spec.top_paths == "witness":  # a path that exists, weighed by its own product
        path = sa.top_path(y[0, 1], x)
        assert bool(sa.grad(y[0, 1], x, retain_graph=True)[path.steps[0].index])
        assert path.weight > 0
    else:
        path = sa.top_path(y[0, 1], x)
        weight = sa.grad(y[0, 1], x, retain_graph=True)
        best = weight if weight.dim() == x.dim() else weight[0]
        assert path.weight == pytest.approx(float(best.max()), rel=1e-12)
