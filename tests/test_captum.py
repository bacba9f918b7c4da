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
captum_visualization = captum_attr.visualization

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


# --- NoiseTunnel and the layer adapter ------------------------------------------------------

NT_TYPES = ["smoothgrad", "smoothgrad_sq", "vargrad"]


@pytest.mark.parametrize("nt_type", NT_TYPES)
def test_noise_tunnel_under_real_is_noise_tunnel_over_saliency(nt_type):
    model, x = _mlp(), _inputs()
    target = torch.tensor([2, 0, 1])
    results = []
    for method in (
        sa.captum.SemiringAttribution(model, sa.Real()),
        captum_attr.Saliency(model),
    ):
        kwargs = {} if isinstance(method, sa.captum.SemiringAttribution) else {"abs": False}
        torch.manual_seed(7)
        tunnel = captum_attr.NoiseTunnel(method)
        results.append(
            tunnel.attribute(x, nt_type=nt_type, nt_samples=4, stdevs=0.1, target=target, **kwargs)
        )
    torch.testing.assert_close(results[0], results[1], rtol=1e-12, atol=1e-14)
    assert results[0].shape == x.shape


def test_noise_tunnel_under_max_product_is_the_mean_of_the_readouts_of_the_noisy_inputs():
    """SmoothGrad of the strongest-path readout: the mean over the noisy copies of each
    example (drawn as NoiseTunnel draws them, same seed) of sa.grad taken one copy at a time."""
    model, x = _mlp(), _inputs()
    targets, samples, stdev = [1, 2, 0], 4, 0.1
    torch.manual_seed(7)
    tunnel = captum_attr.NoiseTunnel(sa.captum.SemiringAttribution(model, sa.MaxProduct()))
    got = tunnel.attribute(x, nt_samples=samples, stdevs=stdev, target=targets)

    torch.manual_seed(7)
    noise = torch.normal(0, torch.full((3 * samples, 5), stdev))  # NoiseTunnel's draw
    noisy = x.repeat_interleave(samples, dim=0) + noise
    want = torch.zeros_like(x)
    for row in range(3 * samples):
        example = row // samples
        copy = noisy[row : row + 1].clone().requires_grad_()
        with sa.patch(model, sa.MaxProduct()):
            out = model(copy)
        seed = torch.zeros_like(out)
        seed[0, targets[example]] = 1.0
        want[example] += sa.grad(out, copy, seed)[0] / samples
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


class _Residual(nn.Module):
    """x → h = first(x) → out = last(tanh(h) + h): two paths from out through each h."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.first, self.act, self.last = nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)
        self.double().eval()

    def forward(self, x):
        h = self.first(x)
        return self.last(self.act(h) + h)


def _enumerated_from_h(model: _Residual, h: torch.Tensor, semiring, seed: torch.Tensor):
    """The readout at h = model.first(x) by enumerating every path of the scalar graph."""
    last = model.last
    p = Program(h=h)
    p.op("a", torch.tanh, "h")
    p.op("s", torch.add, "a", "h")
    p.op("out", lambda s: s @ last.weight.detach().T + last.bias.detach(), "s")
    (value,) = p.path_sum(semiring, "out", seed, ["h"])
    return semiring.readout(value)


def _seed(targets) -> torch.Tensor:
    seed = torch.zeros(len(targets), 3, dtype=torch.float64)
    seed[torch.arange(len(targets)), targets] = 1.0
    return seed


@pytest.mark.parametrize("to_input", [False, True], ids=["layer-output", "layer-input"])
def test_layer_under_real_is_captums_layer_gradient(to_input):
    model, x = _Residual(), _inputs()
    target = torch.tensor([2, 0, 1])
    layer = model.act  # its input is h, its output tanh(h)
    ours = sa.captum.LayerSemiringAttribution(model, layer, sa.Real()).attribute(
        x, target=target, attribute_to_layer_input=to_input
    )
    theirs = captum_attr.LayerGradientXActivation(model, layer, multiply_by_inputs=False).attribute(
        x, target=target, attribute_to_layer_input=to_input
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    assert ours.shape == (3, 4)


def test_layer_under_real_on_token_ids_is_captums_layer_gradient():
    """The common case: an embedding layer of a model that takes integer ids."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Embedding(7, 4), nn.Flatten(), nn.Linear(12, 3)).double()
    ids = torch.tensor([[1, 4, 6], [0, 0, 2]])
    ours = sa.captum.LayerSemiringAttribution(model, model[0], "real").attribute(ids, target=1)
    theirs = captum_attr.LayerGradientXActivation(
        model, model[0], multiply_by_inputs=False
    ).attribute(ids, target=1)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    assert ours.shape == (2, 3, 4)


@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Log()], ids=["MaxProduct", "Log"])
def test_layer_readout_is_sa_grad_at_the_hooked_tensor(S):
    model, x = _Residual(), _inputs()
    targets = [1, 2, 0]
    got = sa.captum.LayerSemiringAttribution(model, model.first, S).attribute(x, target=targets)
    got_input = sa.captum.LayerSemiringAttribution(model, model.act, S).attribute(
        x, target=targets, attribute_to_layer_input=True
    )
    seen = []
    hook = model.first.register_forward_hook(lambda m, args, out: seen.append(out))
    try:
        with sa.patch(model, S):
            out = model(x.clone().requires_grad_())
    finally:
        hook.remove()
    want = sa.grad(out, seen[0], _seed(targets))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_input, want, rtol=1e-12, atol=1e-14)  # act's input is h


@pytest.mark.parametrize("S", SEMIRINGS, ids=[type(s).__name__ for s in SEMIRINGS])
def test_layer_readout_is_path_enumeration(S):
    model, x = _Residual(), _inputs()
    targets = [1, 2, 0]
    want = _enumerated_from_h(model, model.first(x), S, _seed(targets))
    explainer = sa.captum.LayerSemiringAttribution(model, model.first, S)
    got = explainer.attribute(x, target=targets)
    if isinstance(S, sa.SignedMaxProduct):
        torch.testing.assert_close(got, want[0], rtol=1e-12, atol=1e-14)
        low = explainer.attribute(x, target=targets, which="min")
        torch.testing.assert_close(low, want[1], rtol=1e-12, atol=1e-14)
    else:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_layer_with_a_function_forward_and_a_tuple_layer_output():
    model = _Residual()
    x = _inputs()

    class Split(nn.Module):  # a layer returning two tensors
        def forward(self, h):
            return h[:, :2], h[:, 2:]

    split = Split()

    def forward(x):
        first, second = split(model.first(x))
        return model.last(torch.cat([first, second], dim=1))

    explainer = sa.captum.LayerSemiringAttribution(forward, split, sa.MaxProduct(), model=model)
    left, right = explainer.attribute(x, target=0)
    assert left.shape == (3, 2) and right.shape == (3, 2)
    torch.testing.assert_close(torch.cat([left, right], 1), model.last.weight[0].abs().expand(3, 4))
    assert all("forward" not in m.__dict__ for m in model.modules())  # unpatched


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda m, x: sa.captum.LayerSemiringAttribution(m, "first", "log"),
            TypeError,
            "not an nn.Module",
        ),
        (
            lambda m, x: sa.captum.LayerSemiringAttribution(lambda x: m(x), m.first, "log"),
            TypeError,
            "model=",
        ),
        (
            lambda m, x: sa.captum.LayerSemiringAttribution(m, nn.Tanh(), "log").attribute(x, 0),
            ValueError,
            "ran 0 times",
        ),
    ],
    ids=["layer-not-a-module", "function-without-model", "layer-not-run"],
)
def test_layer_bad_input_is_refused_clearly(call, error, message):
    with pytest.raises(error, match=message):
        call(_Residual(), _inputs())


# ----- visualize_text: sa.attribute's token scores as Captum's VisualizationDataRecord
def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double().eval()


def _per_element(model, ids, semiring) -> torch.Tensor:
    """The readout of logit 5 at the last position at every embedding element, through
    Captum: Saliency for Real, SemiringAttribution otherwise."""
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()

    def last_logits(e):
        return model(inputs_embeds=e).logits[:, -1]

    if isinstance(semiring, sa.Real):
        return captum_attr.Saliency(last_logits).attribute(emb, target=5, abs=False)[0]
    explainer = sa.captum.SemiringAttribution(last_logits, semiring, model=model)
    return explainer.attribute(emb, target=5)[0]


@pytest.mark.parametrize(
    "S, per_token, kind",
    [
        (sa.Real(), lambda r: r.sum(-1), "zero"),
        (sa.MaxProduct(), lambda r: r.amax(-1), "zero"),
        (sa.Log(), lambda r: r.logsumexp(-1), "from best"),
        (sa.Boolean(), lambda r: r.amax(-1), "presence"),
    ],
    ids=["Real", "MaxProduct", "Log", "Boolean"],
)
def test_visualization_record_places_token_scores_on_captums_range(S, per_token, kind):
    """Token scores are the ⊕ over a token's embedding elements of the per-element
    readouts (Real: Captum's Saliency summed), placed on [-1, 1] as the reports' scales
    place them."""
    model = _tiny_llama()
    ids = torch.tensor([[3, 7, 1, 12, 9]])
    result = sa.attribute(model, {"input_ids": ids}, 5, S, paths=False)
    record = sa.captum.visualization_record(result)
    token = per_token(_per_element(model, ids, S)).double()
    if kind == "zero":
        want = token / token.abs().max()
    elif kind == "from best":
        want = (token - token.min()) / (token.max() - token.min())
    else:
        want = (token > 0).double()
    torch.testing.assert_close(record.word_attributions, want, rtol=1e-9, atol=1e-12)
    assert record.raw_input_ids == result.tokens and record.attr_class == result.target
    assert record.pred_class == result.prediction.top[0][0]
    html = captum_visualization.format_word_importances(
        record.raw_input_ids, record.word_attributions
    )
    assert all(token in html for token in result.tokens)


def test_visualize_text_takes_the_record():
    pytest.importorskip("IPython")  # captum's visualize_text renders through IPython
    result = sa.attribute(
        _tiny_llama(), {"input_ids": torch.tensor([[3, 7, 1]])}, 5, "max-product", paths=False
    )
    html = captum_visualization.visualize_text([sa.captum.visualization_record(result)])
    assert all(token in html.data for token in result.tokens)
