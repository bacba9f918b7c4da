"""Small models vs explicit scalar-path enumeration, for every built-in semiring.

Each model is an ``nn.Module`` written with ordinary torch ops; its oracle is the same
composition written as a :class:`Program` of elementary ops (granularity per torch op: a
``linear`` is one op whose Jacobian gives edges from input and weight elements, a softmax is
one op, …). One output element is seeded (a single 1, zeros elsewhere: a zero seed starts no
path) and every path from it to the input and to the weights is enumerated.
"""

from __future__ import annotations

import pytest
import torch
from op_checks import raw_value
from small_models import MODELS, setup_model

import semiring_autograd as sa
from semiring_autograd.semirings import BUILTIN_SEMIRINGS, Semiring

RTOL, ATOL = 1e-7, 1e-9
SEMIRINGS = [cls() for cls in BUILTIN_SEMIRINGS] + [sa.KBest(3)]
SEMIRING_IDS = [type(s).__name__ for s in SEMIRINGS]


SEEDED = [(1, 2), (0, 0)]


@pytest.mark.parametrize("S", SEMIRINGS, ids=SEMIRING_IDS)
@pytest.mark.parametrize("element", SEEDED, ids=[f"out{e}" for e in SEEDED])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_against_path_enumeration(name: str, element: tuple[int, int], S: Semiring):
    model, x0, program = setup_model(name)
    weight_specs = MODELS[name][3]
    weights = [model.get_parameter(attr) for attr, _ in weight_specs]
    x = x0.clone().requires_grad_()
    with sa.patch(model, S):
        out = model(x)
    assert torch.equal(out, model(x0)), "the patched forward differs from the unpatched one"
    torch.testing.assert_close(out.detach(), program.values["out"], rtol=1e-13, atol=0)

    seed = torch.zeros_like(out)
    seed[element] = 1.0
    targets = [x, *weights]
    raw = sa.grad(out, targets, seed=seed, raw=True, retain_graph=True)
    readouts = sa.grad(out, targets, seed=seed)
    expected = program.path_sum(S, "out", seed, ["x", *(n for _, n in weight_specs)])
    labels = ["x", *(attr for attr, _ in weight_specs)]
    for label, target, message, readout, want in zip(labels, targets, raw, readouts, expected):
        got = raw_value(S, message, target)
        assert len(got) == len(want)
        for k, (a, e) in enumerate(zip(got, want)):
            torch.testing.assert_close(
                a, e, rtol=RTOL, atol=ATOL, msg=lambda m: f"{label} component {k}: {m}"
            )
        torch.testing.assert_close(
            readout, S.readout(want), rtol=RTOL, atol=ATOL, msg=lambda m: f"{label} readout: {m}"
        )

    if isinstance(S, sa.Real):
        native = torch.autograd.grad(model(x), targets, seed)
        for label, message, g in zip(labels, raw, native):
            torch.testing.assert_close(
                message, g, rtol=1e-10, atol=1e-12, msg=lambda m: f"{label} vs autograd: {m}"
            )


@pytest.mark.parametrize("name", list(MODELS))
def test_path_counts_are_nontrivial(name: str):
    """The enumerated graphs are what the docstring says: many paths, several per element."""
    _, _, program = setup_model(name)
    counts = program.count_paths("out", 1 * program.values["out"].shape[1] + 2, "x")
    assert sum(counts) > 150 and max(counts) > 50
