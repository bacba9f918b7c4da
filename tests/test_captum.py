"""``sa.captum.SemiringAttribution``: a Captum ``Attribution`` whose values are the semiring
readouts — Real against Captum's own ``Saliency``, every other semiring against path
enumeration, and Captum's metrics taking it as they take ``Saliency``."""

from __future__ import annotations

import pytest
import torch
from oracle import Program
from torch import nn
from user_semirings import Tropical

import semiring_autograd as sa
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

captum_attr = pytest.importorskip("captum.attr")
captum_metrics = pytest.importorskip("captum.metrics")

SEMIRINGS = [cls() for cls in BUILTIN_SEMIRINGS if cls is not sa.Real] + [Tropical()]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double().eval()
    with torch.no_grad():
        model[0].weight[1, 2] = 0.0  # a missing edge: fewer paths for some pairs
    return model


def _inputs() -> torch.Tensor:
    return torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _enumerated(model: nn.Module, x: torch.Tensor, semiring, seed: torch.Tensor):
    """The readout at x by enumerating every path of the MLP's scalar graph."""
    first, last = model[0], model[2]
    p = Program(x=x)
    p.op("h", lambda x: x @ first.weight.detach().T + first.bias.detach(), "x")
    p.op("a", torch.tanh, "h")
    p.op("out", lambda a: a @ last.weight.detach().T + last.bias.detach(), "a")
    (value,) = p.path_sum(semiring, "out", seed, ["x"])
    return semiring.readout(value)


def test_real_is_captums_saliency():
    model, x = _mlp(), _inputs()
    target = torch.tensor([2, 0, 1])
    ours = sa.captum.SemiringAttribution(model, sa.Real()).attribute(x, target=target)
    theirs = captum_attr.Saliency(model).attribute(x, target=target, abs=False)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("S", SEMIRINGS, ids=[type(s).__name__ for s in SEMIRINGS])
def test_semiring_readout_is_path_enumeration(S):
    model, x = _mlp(), _inputs()
    targets = [1, 2, 0]
    seed = torch.zeros(3, 3, dtype=torch.float64)
    seed[torch.arange(3), targets] = 1.0
    want = _enumerated(model, x, S, seed)
    explainer = sa.captum.SemiringAttribution(model, S)
    got = explainer.attribute(x, target=targets)
    if isinstance(S, sa.SignedMaxProduct):
        torch.testing.assert_close(got, want[0], rtol=1e-12, atol=1e-14)
        low = explainer.attribute(x, target=targets, which="min")
        torch.testing.assert_close(low, want[1], rtol=1e-12, atol=1e-14)
    else:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert got.shape == x.shape


def test_captum_metrics_take_it_as_they_take_saliency():
    """sensitivity_max and infidelity, same perturbations, give the same numbers for
    SemiringAttribution under Real and for Saliency(abs=False)."""
    model, x = _mlp(), _inputs()
    ours = sa.captum.SemiringAttribution(model, "real")
    saliency = captum_attr.Saliency(model)

    def perturb(inputs):
        noise = torch.randn(inputs.shape, dtype=inputs.dtype)
        return noise, inputs - noise

    results = []
    for explain, kwargs in ((ours.attribute, {}), (saliency.attribute, {"abs": False})):
        torch.manual_seed(5)
        sens = captum_metrics.sensitivity_max(explain, x, target=1, n_perturb_samples=4, **kwargs)
        attributions = explain(x, target=1, **kwargs)
        torch.manual_seed(6)
        infid = captum_metrics.infidelity(model, perturb, x, attributions, target=1)
        results.append((sens, infid))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_function_forward_tuple_inputs_and_the_model_left_as_it_was():
    model = _mlp()
    x = _inputs()
    scale = torch.full((3, 1), 2.0, dtype=torch.float64)

    def forward(x, scale, shift):
        return model(x * scale) + shift

    before = model(x).detach()
    explainer = sa.captum.SemiringAttribution(forward, sa.MaxProduct(), model=model)
    got_x, got_scale = explainer.attribute(
        (x, scale), target=(2,), additional_forward_args=(torch.tensor(1.0),)
    )
    seed = torch.zeros(3, 3, dtype=torch.float64)
    seed[:, 2] = 1.0
    torch.testing.assert_close(got_x, 2.0 * _enumerated(model, 2.0 * x, sa.MaxProduct(), seed))
    assert got_scale.shape == scale.shape and (got_scale > 0).all()
    assert torch.equal(model(x), before) and not x.requires_grad
    assert all("forward" not in m.__dict__ for m in model.modules())  # unpatched


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m, x: sa.captum.SemiringAttribution(lambda x: m(x), "log"), TypeError, "model="),
        (lambda m, x: sa.captum.SemiringAttribution(m, "log").attribute(x), ValueError, "target="),
        (
            lambda m, x: sa.captum.SemiringAttribution(m, "log").attribute(x, target=7),
            ValueError,
            "does not index its output",
        ),
        (
            lambda m, x: sa.captum.SemiringAttribution(m, "log").attribute(x, target=[0, 1]),
            ValueError,
            "2 targets for a batch of 3",
        ),
        (
            lambda m, x: sa.captum.SemiringAttribution(m, "log").attribute(x, 0, which="min"),
            ValueError,
            "SignedMaxProduct",
        ),
    ],
    ids=["function-without-model", "no-target", "bad-target", "target-count", "min-unsigned"],
)
def test_bad_input_is_refused_clearly(call, error, message):
    with pytest.raises(error, match=message):
        call(_mlp(), _inputs())
