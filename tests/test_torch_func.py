"""torch.func transforms over a patched forward (semiring_autograd/ops/transforms.py).

``torch.func.grad(f)(x)`` and ``vjp`` of a patched forward hand back ``sa.grad``'s readout
under every semiring whose readout has the input's shape; both are checked against path
enumeration on the small models (tests/oracle.py), against ``sa.grad`` on a tiny Llama, and
under ``sa.Real()`` against torch.autograd in float64. KBest and SignedMaxProduct readouts
(a leading component dimension), vmap/jacrev over a semiring backward and forward-mode
transforms are refused with an error naming what to do instead.
"""

from __future__ import annotations

import pytest
import torch
from model_zoo import tiny_inputs, tiny_model
from small_models import setup_model
from torch.func import grad, jacfwd, jacrev, jvp, vjp, vmap

import semiring_autograd as sa

#: every built-in semiring whose readout has the input's shape
SAME_SHAPE = [sa.MaxProduct(), sa.Log(), sa.Entropy(), sa.Boolean(), sa.Counting()]
#: readouts of shape (components, *input)
COMPONENT_DIM = [sa.KBest(3), sa.SignedMaxProduct()]
TOL = dict(rtol=1e-9, atol=1e-12)


def _patched(model: torch.nn.Module, S: sa.Semiring):
    def f(x: torch.Tensor) -> torch.Tensor:
        with sa.patch(model, S):
            return model(x)

    return f


def _enumerated(S: sa.Semiring, name: str, seed: torch.Tensor | None) -> torch.Tensor:
    """The readout at x of path enumeration on the model's program."""
    _, x, program = setup_model(name)
    (value,) = program.path_sum(S, "out", seed, ["x"])
    return S.readout(value).to(x.dtype)


@pytest.mark.parametrize("name", ["mlp", "attention"])
@pytest.mark.parametrize("S", SAME_SHAPE, ids=repr)
def test_grad_of_a_patched_forward_is_the_enumerated_readout(name, S):
    model, x, _ = setup_model(name)
    f = _patched(model, S)
    got = grad(lambda x: f(x).sum())(x)
    torch.testing.assert_close(got, _enumerated(S, name, None), **TOL)
    # one element read: the seed reaches the output through select's backward
    index = (1, 2)
    seed = torch.zeros_like(f(x.detach()))
    seed[index] = 1
    got = grad(lambda x: f(x)[index])(x)
    torch.testing.assert_close(got, _enumerated(S, name, seed), **TOL)


@pytest.mark.parametrize("S", SAME_SHAPE, ids=repr)
def test_vjp_lifts_the_cotangent_as_sa_grad_lifts_a_seed(S):
    model, x, _ = setup_model("attention")
    f = _patched(model, S)
    out, pullback = vjp(f, x)
    cotangent = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    cotangent[0] = 0  # a zero weight starts no path
    (got,) = pullback(cotangent)
    torch.testing.assert_close(got, _enumerated(S, "attention", cotangent), **TOL)


@pytest.mark.parametrize("name", ["mlp", "attention"])
def test_real_transforms_equal_torch_autograd(name):
    model, x, _ = setup_model(name)
    x = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(model(x).sum(), x)
    jacobian = torch.autograd.functional.jacobian(model, x.detach())
    f = _patched(model, sa.Real())  # torch's own graph: every transform applies
    torch.testing.assert_close(grad(lambda x: f(x).sum())(x.detach()), want, **TOL)
    torch.testing.assert_close(jacrev(f)(x.detach()), jacobian, **TOL)
    formulas = _patched(model, sa.Real(formulas=True))  # the generated Real rules
    torch.testing.assert_close(grad(lambda x: formulas(x).sum())(x.detach()), want, **TOL)


@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Log()], ids=repr)
def test_grad_of_a_patched_tiny_llama_equals_sa_grad(S):
    model = tiny_model("LlamaForCausalLM")
    embeds, _ = tiny_inputs(model)

    def logit(e: torch.Tensor) -> torch.Tensor:
        with sa.patch(model, S):
            return model(inputs_embeds=e).logits[0, -1, 3]

    got = grad(logit)(embeds)
    leaf = embeds.clone().requires_grad_()
    want = sa.grad(logit(leaf), leaf)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("S", COMPONENT_DIM, ids=repr)
def test_a_readout_with_a_component_dimension_is_refused(S):
    model, x, _ = setup_model("mlp")
    f = _patched(model, S)
    with pytest.raises(sa.SemiringAutogradError, match=r"leading component dimension.*sa\.grad"):
        grad(lambda x: f(x).sum())(x)
    assert not hasattr(model.forward, "__semiring_autograd_patch__")  # the patch is gone


@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Entropy()], ids=repr)
def test_vmap_and_jacrev_over_a_semiring_backward_are_refused(S):
    model, x, _ = setup_model("mlp")
    f = _patched(model, S)
    fix = r"is_grads_batched=True"
    with pytest.raises(sa.SemiringAutogradError, match=fix):
        jacrev(f)(x)
    with pytest.raises(sa.SemiringAutogradError, match=fix):
        vmap(grad(lambda x: f(x).sum()))(x[None])


@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Log()], ids=repr)
def test_forward_mode_is_refused(S):
    model, x, _ = setup_model("mlp")
    f = _patched(model, S)
    with pytest.raises(sa.SemiringAutogradError, match=r"forward-mode.*torch\.func\.grad"):
        jvp(f, (x,), (torch.ones_like(x),))
    with pytest.raises(sa.SemiringAutogradError, match=r"forward-mode"):
        jacfwd(f)(x)


def test_an_op_on_the_input_before_the_patch_is_refused():
    model, x, _ = setup_model("mlp")
    f = _patched(model, sa.MaxProduct())
    with pytest.raises(sa.SemiringAutogradError, match=r"MulBackward0, an op run before"):
        grad(lambda x: f(x * 2).sum())(x)
    torch.testing.assert_close(  # the same op inside the patch: the readout of x
        grad(lambda x: f(x).sum())(x), _enumerated(sa.MaxProduct(), "mlp", None), **TOL
    )


@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Entropy()], ids=repr)
def test_grad_over_parameters_through_functional_call(S):
    model, x, program = setup_model("mlp")
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p: dict, x: torch.Tensor) -> torch.Tensor:
        with sa.patch(model, S):
            return torch.func.functional_call(model, p, (x,)).sum()

    got = grad(f)(params, x)
    values = program.path_sum(S, "out", None, ["wm", "w1"])
    for name, value in zip(["mid.weight", "fc1.weight"], values):
        torch.testing.assert_close(got[name], S.readout(value).to(x.dtype), **TOL)


def test_a_score_merging_paths_after_the_patch_lifts_its_real_cotangent():
    """grad(f)(x) is sa.grad(y, x, seed=∂s/∂y) for f(x) = s(y): here s = y[0, 1] + y.sum(),
    whose cotangent at y[0, 1] is the real 2."""
    S = sa.MaxProduct()
    model, x, _ = setup_model("mlp")
    f = _patched(model, S)
    got = grad(lambda x: (lambda y: y[0, 1] + y.sum())(f(x)))(x)
    seed = torch.ones(2, 3, dtype=x.dtype)
    seed[0, 1] = 2
    torch.testing.assert_close(got, _enumerated(S, "mlp", seed), **TOL)


def test_finished_transforms_leave_no_boundary_behind():
    from semiring_autograd.ops import transforms

    model, x, _ = setup_model("mlp")
    f = _patched(model, sa.Log())
    for _ in range(3):
        grad(lambda x: f(x).sum())(x.clone())
    assert len(transforms._BOUNDARIES) == 1  # the last transform's; earlier ones dropped
