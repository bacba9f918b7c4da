"""The explain report: its prediction context, its zero-anchored colour scale (HTML and
PNG alike), readable paths (identity steps hidden, parameters, normalisation and attention
named) checked against the model's own numbers, and the semiring comparison page."""

from __future__ import annotations

import re

import pytest
import torch
from hf_models import tiny_model

import semiring_autograd as sa
from semiring_autograd.explain import report
from semiring_autograd.explain.report import NEGATIVE, POSITIVE, ZERO, Scale

IDS = torch.tensor([[3, 17, 5, 29, 11, 8]])


def _llama(eager: bool = False):
    """The tiny Llama with random norm gains (a gain of exactly 1 would hide a step)."""
    model = tiny_model("LlamaForCausalLM", attn="eager" if eager else "sdpa")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) + 0.5)
    return model


def _encoding():
    return {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}


@pytest.fixture(scope="module")
def attributions():
    """Every built-in semiring's attribution of logit 7 at position -2 of the tiny Llama."""
    model = _llama()
    return {
        type(S).__name__: sa.attribute(model, _encoding(), 7, S, position=-2, model_name="tiny")
        for S in (cls() for cls in sa.BUILTIN_SEMIRINGS)
    }


def test_prediction_is_the_unpatched_models(attributions):
    model = _llama()
    with torch.no_grad():
        logits = model(**_encoding()).logits[0, -2].double()
    probs = logits.softmax(-1)
    for result in attributions.values():
        p = result.prediction
        assert (p.model, p.position, p.token) == ("tiny", 4, "#11")
        assert p.target_logit == pytest.approx(float(logits[7]), rel=1e-12)
        assert p.target_probability == pytest.approx(float(probs[7]), rel=1e-12)
        assert p.target_rank == 1 + int((logits > logits[7]).sum())
        top = probs.topk(5)
        assert [t for t, _ in p.top] == [f"#{int(i)}" for i in top.indices]
        assert [q for _, q in p.top] == pytest.approx(top.values.tolist(), rel=1e-12)


def test_scale_is_anchored_at_zero_and_diverges_for_signed_readouts(attributions):
    for name, result in attributions.items():
        scale = Scale.of(result)
        finite = result.display_scores()[torch.isfinite(result.display_scores())]
        if result.min_scores() is not None:
            finite = torch.cat([finite, result.min_scores()])
        assert scale.limit == pytest.approx(float(finite.abs().max()))
        assert scale.diverging == (name in ("Real", "SignedMaxProduct", "Log")), name
        assert scale.colour(0.0) == ZERO
        assert scale.colour(scale.limit) == POSITIVE
        assert scale.colour(-scale.limit) == (NEGATIVE if scale.diverging else ZERO)
        assert scale.ticks()[0] == (-scale.limit if scale.diverging else 0.0)
        assert result.unit in scale.label and result.meaning in scale.label


def test_scale_keeps_close_large_scores_close():
    """Entropy-like scores 1013.8–1023.1 are all near the full colour, not white to red."""
    scale = Scale(False, 1023.1, "nats")
    low, high = scale.colour(1013.8), scale.colour(1023.1)
    assert max(abs(a - b) for a, b in zip(low, high)) <= 3
    assert scale.colour(float("nan")) == report.NOT_FINITE


def _spans(page: str) -> list[tuple[str, tuple[int, ...]]]:
    found = re.findall(
        r'<span class="tok" style="background: rgb\((\d+), (\d+), (\d+)\);[^"]*" '
        r'title="token \d+: ([^"]+)"',
        page,
    )
    return [(score, tuple(int(c) for c in rgb)) for *rgb, score in found]


def test_html_heat_map_legend_and_context(attributions):
    for name, result in attributions.items():
        page = report.html_page(result)
        scale = Scale.of(result)
        spans = _spans(page)
        assert len(spans) == len(result.tokens)
        for (_, colour), score in zip(spans, result.display_scores().tolist()):
            assert colour == scale.colour(score)
        assert scale.css_gradient() in page and 'class="legend"' in page
        assert result.unit in page
        for text in ("tiny", "position 4, token &#x27;#11&#x27;", "rank", "most probable"):
            assert text in page, (name, text)
        assert ") (" not in page  # no doubled parentheses


def test_png_bars_use_the_reports_colours(attributions, tmp_path):
    image = pytest.importorskip("matplotlib.image")
    result = attributions["Real"]
    result.plot(tmp_path / "r.png")
    pixels = (image.imread(tmp_path / "r.png")[..., :3] * 255).round().astype(int)
    seen = {tuple(p) for p in pixels.reshape(-1, 3).tolist()}
    scale = Scale.of(result)
    for score in result.display_scores().tolist():
        colour = scale.colour(score)
        near = [c for c in seen if max(abs(a - b) for a, b in zip(c, colour)) <= 1]
        assert near, f"bar colour {colour} of score {score} is not in the PNG"


def test_comparison_page_has_every_semiring_on_its_own_scale(attributions, tmp_path):
    group = list(attributions.values())
    page = report.html_page([group], tmp_path / "all.html")
    assert "7 semirings compared" in page
    for result in group:
        name = type(result.semiring).__name__
        assert f"<th>{name}<br>" in page
        assert Scale.of(result).css_gradient() in page
    cells = re.findall(r'<td class="num" style="background: rgb\((\d+), (\d+), (\d+)\)', page)
    assert len(cells) == len(group) * len(group[0].tokens)
    first_row = [tuple(map(int, c)) for c in cells[: len(group)]]
    want = [Scale.of(r).colour(float(r.display_scores()[0])) for r in group]
    assert first_row == want
    with pytest.raises(ValueError, match="same tokens"):
        report.html_page([[group[0], sa.attribute(_llama(), {"input_ids": IDS[:, :3]}, 7)]])


#: Llama's RMSNorm computes in float32 inside the float64 model: a path's weight (its
#: message) and the float64 product of its steps' derivatives agree to float32 rounding
FLOAT32 = 1e-6


def _product(steps) -> float:
    w = 1.0
    for s in steps[1:]:
        w *= s.local_derivative
    return w


def test_path_text_hides_only_weight_one_steps(attributions):
    result = attributions["MaxProduct"]
    path = result.paths[result.best_other_token()]
    full, short = path.format(hide_identity=False), path.format(tokens=result.tokens)
    hidden = [s for s in path.steps[1:] if s.is_identity]
    assert hidden and all(s.local_derivative == 1.0 for s in hidden)
    assert f"{len(hidden)} steps of weight 1 hidden" in short
    assert len(full.splitlines()) == len(path.steps) + 1
    assert "  to  " in full and "  to  " not in short
    residual = [s for s in path.steps if s.op == "add.Tensor" and s.local_derivative == 1.0]
    assert sum(int(m) for m in re.findall(r"\((\d+) residual adds?\)", short)) == len(residual)
    assert abs(_product(path.steps)) == pytest.approx(path.weight, rel=FLOAT32)


def test_path_names_parameters_normalisation_and_attention():
    """Each named edge's weight is the model's own number: the weight element, the norm's
    gain, 1/rms of the norm's input, the attention probability of that head and pair (read
    from the same weights run with eager attention, which returns its probabilities)."""
    result = sa.attribute(_llama(), _encoding(), 7, sa.MaxProduct(), position=-2)
    model = _llama(eager=True)
    modules = dict(model.named_modules())
    inputs = {}
    hooks = [
        m.register_forward_hook(lambda m, a, o, n=n: inputs.__setitem__(n, a[0].detach()))
        for n, m in modules.items()
        if n.endswith("norm")
    ]
    with torch.no_grad():
        out = model(**_encoding(), output_attentions=True)
    for h in hooks:
        h.remove()
    seen = set()
    for path in filter(None, result.paths):
        for prev, step in zip(path.steps, path.steps[1:]):
            w = step.local_derivative
            if step.op == "linear":
                want = modules[step.module].weight.detach()[step.index[-1], prev.index[-1]]
                assert step.note == f"weight[{step.index[-1]}, {prev.index[-1]}]"
                assert w == pytest.approx(float(want), rel=1e-12)
                seen.add("linear")
            elif step.note.startswith("× weight["):
                gain = modules[step.module].weight.detach()[step.index[-1]]
                assert w == pytest.approx(float(gain), rel=1e-12)
                seen.add("gain")
            elif step.note.startswith("× rsqrt"):
                x = inputs[step.module][step.index[:-1]]
                eps = modules[step.module].variance_epsilon
                want = (x.float().pow(2).mean() + eps).rsqrt()
                assert w == pytest.approx(float(want), rel=FLOAT32)
                seen.add("rms")
            elif step.attention is not None and step.attention.via == "value":
                a = step.attention
                layer = int(step.module.split(".")[2])
                p = out.attentions[layer][0, a.head, a.query, a.key]
                assert w == pytest.approx(float(p), rel=FLOAT32)  # eager: float32 softmax
                text = step.describe(result.tokens)
                assert f"head {a.head}, query {a.query} '#" in text and "probability" in text
                seen.add("attention")
    assert seen == {"linear", "gain", "rms", "attention"}


def test_headline_paths_and_signed_smallest(attributions):
    signed = attributions["SignedMaxProduct"]
    low = signed.min_scores()
    for t, path in enumerate(signed.min_paths):
        if path is None:  # a token after the read position: no path
            assert t > signed.prediction.position
            continue
        assert path.weight == pytest.approx(float(low[t]), rel=1e-12)
        assert _product(path.steps) == pytest.approx(path.weight, rel=FLOAT32)
    titles = [title for title, _, _ in signed.headline_paths()]
    assert len(titles) == 3 and "smallest signed product" in titles[2]
    other = signed.best_other_token()
    assert other != signed.prediction.position
    scores = signed.display_scores()
    rest = [float(scores[t]) for t in range(len(scores)) if t != signed.prediction.position]
    assert float(scores[other]) == max(rest)
    assert "smallest" in str(signed) and "largest" in str(signed)
    assert attributions["Log"].headline_paths() == []
