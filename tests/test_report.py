"""The explain report: its prediction context, each semiring's colour scale (HTML and PNG
alike; log-domain readouts from the largest, Boolean in two colours, the rest from zero;
one scale per semiring across texts unless asked), readable paths (identity steps hidden,
parameters, normalisation and attention named) checked against the model's own numbers,
and the semiring comparison page."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch
from model_zoo import tiny_model

import semiring_autograd as sa
from semiring_autograd.explain import report
from semiring_autograd.explain.report import NEGATIVE, POSITIVE, ZERO, Scale
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

IDS = torch.tensor([[3, 17, 5, 29, 11, 8]])
OTHER_IDS = torch.tensor([[9, 4, 21, 2, 30, 6, 12]])


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
        for S in (cls() for cls in BUILTIN_SEMIRINGS)
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


#: each built-in semiring's scale kind: log-domain readouts by their difference from the
#: largest, Boolean in two colours, the rest anchored at zero
KINDS = {
    "Real": "diverging",
    "MaxProduct": "sequential",
    "SignedMaxProduct": "diverging",
    "Log": "from_best",
    "Entropy": "from_best",
    "Counting": "from_best",
    "Boolean": "presence",
}


def _has_path(attributions) -> list[bool]:
    """Per token, whether a path reaches the logit: where Boolean's readout is 1."""
    return [bool(v) for v in attributions["Boolean"].scores.tolist()]


def _shown(result, has_path: list[bool]) -> list[float]:
    """The display scores, a token without a path at -inf where the scale is from the best
    (Entropy reads 0 there)."""
    scores = result.display_scores().tolist()
    if KINDS[type(result.semiring).__name__] != "from_best":
        return scores
    return [s if p else -math.inf for s, p in zip(scores, has_path)]


def _finite(result, has_path: list[bool]) -> torch.Tensor:
    values = torch.tensor(_shown(result, has_path), dtype=torch.float64)
    if result.min_scores() is not None:
        values = torch.cat([values, result.min_scores()])
    return values[torch.isfinite(values)]


def test_reached_is_where_a_path_exists(attributions):
    has_path = _has_path(attributions)
    assert has_path == [True] * 5 + [False]  # position 4 is read: token 5 has no path
    for name, result in attributions.items():
        assert result.reached.tolist() == has_path, name


def test_each_semiring_has_its_kind_of_scale(attributions):
    for name, result in attributions.items():
        scale = Scale.of(result)
        finite = _finite(result, _has_path(attributions))
        assert scale.kind == KINDS[name], name
        assert result.unit in scale.label and result.meaning in scale.label
        if scale.kind == "from_best":
            assert (scale.lower, scale.upper) == (float(finite.min()), float(finite.max()))
            assert scale.colour(float(finite.max())) == POSITIVE
            assert scale.colour(float(finite.min())) == ZERO
            assert scale.ticks() == [
                f"{float(finite.min() - finite.max()):.4g}",
                "0",
            ]
        elif scale.kind == "presence":
            assert scale.colour(1.0) == POSITIVE and scale.colour(0.0) == ZERO
        else:
            assert scale.upper == pytest.approx(float(finite.abs().max()))
            assert scale.colour(0.0) == ZERO
            assert scale.colour(scale.upper) == POSITIVE
            low = NEGATIVE if scale.kind == "diverging" else ZERO
            assert scale.colour(-scale.upper) == low
            assert scale.ticks()[-1] == f"{float(finite.abs().max()):.4g}"
        assert scale.colour(float("nan")) == report.NOT_FINITE


def test_log_domain_scale_spreads_large_close_readouts():
    """Log readouts 384.6–386.9 (SmolLM2's): the smallest white, the largest red, the middle
    halfway, where a zero-anchored scale would draw all three within 1 of the full colour."""
    scale = Scale("from_best", 384.6, 386.9, "nats")
    assert scale.colour(384.6) == ZERO and scale.colour(386.9) == POSITIVE
    halfway = tuple(round((z + p) / 2) for z, p in zip(ZERO, POSITIVE))
    assert max(abs(a - b) for a, b in zip(scale.colour(385.75), halfway)) <= 1


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
        for (_, colour), score in zip(spans, _shown(result, _has_path(attributions))):
            assert colour == scale.colour(score)
        assert scale.css_gradient() in page and 'class="legend"' in page
        assert result.unit in page
        for text in ("tiny", "position 4, token &#x27;#11&#x27;", "rank", "most probable"):
            assert text in page, (name, text)
        assert ") (" not in page  # no doubled parentheses


@pytest.mark.parametrize("name", ["Real", "Log", "Boolean"])
def test_png_bars_use_the_reports_colours(attributions, tmp_path, name):
    image = pytest.importorskip("matplotlib.image")
    result = attributions[name]
    result.plot(tmp_path / "r.png")
    pixels = (image.imread(tmp_path / "r.png")[..., :3] * 255).round().astype(int)
    seen = {tuple(p) for p in pixels.reshape(-1, 3).tolist()}
    scale = Scale.of(result)
    for score in result.display_scores().tolist():
        if not math.isfinite(score):
            continue
        colour = scale.colour(score)
        near = [c for c in seen if max(abs(a - b) for a, b in zip(c, colour)) <= 1]
        assert near, f"bar colour {colour} of score {score} is not in the PNG"


def test_png_title_names_model_text_position_and_target(attributions, tmp_path, monkeypatch):
    figure = pytest.importorskip("matplotlib.figure")
    titles = []
    save = figure.Figure.savefig

    def record_title(fig, *args, **kwargs):
        titles.append(fig.get_suptitle())
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(figure.Figure, "savefig", record_title)
    attributions["MaxProduct"].plot(tmp_path / "m.png")
    title = " ".join(titles[0].split())  # the title's lines, wrapped to the figure, joined
    assert title.startswith("tiny") and "position 4 ('#11')" in title
    assert attributions["MaxProduct"].target in title and "probability" in title


def test_comparison_page_has_every_semiring_on_its_own_scale(attributions, tmp_path):
    group = list(attributions.values())
    page = report.html_page([group], tmp_path / "all.html")
    assert "7 semirings compared" in page
    for result in group:
        name = type(result.semiring).__name__
        assert f'<th title="{result.meaning}">{name}</th>' in page
        assert Scale.of(result).css_gradient() in page
    cells = re.findall(r'<td class="num" style="background: rgb\((\d+), (\d+), (\d+)\)', page)
    assert len(cells) == len(group) * len(group[0].tokens)
    first_row = [tuple(map(int, c)) for c in cells[: len(group)]]
    want = [Scale.of(r).colour(float(r.display_scores()[0])) for r in group]
    assert first_row == want
    with pytest.raises(ValueError, match="same tokens"):
        report.html_page([[group[0], sa.attribute(_llama(), {"input_ids": IDS[:, :3]}, 7)]])


def _column_colours(page: str, columns: int) -> list[list[tuple[int, ...]]]:
    """The comparison table's cell colours, per column (semiring)."""
    cells = re.findall(r'<td class="num" style="background: rgb\((\d+), (\d+), (\d+)\)', page)
    colours = [tuple(int(c) for c in cell) for cell in cells]
    return [colours[j::columns] for j in range(columns)]


def _spread(colours: list[tuple[int, ...]]) -> int:
    """The largest difference in any colour channel between two of ``colours``."""
    return max(max(c[k] for c in colours) - min(c[k] for c in colours) for k in range(3))


@pytest.mark.parametrize("offset", [0.0, 380.0], ids=["tiny", "shifted"])
def test_no_comparison_column_is_one_colour_when_its_scores_differ(attributions, offset):
    """Each column whose finite scores differ spans at least half its colour range.
    ``shifted``: the log-domain readouts moved by 380, as a deep model's are (SmolLM2:
    Log 384.6–386.9), which a zero-anchored scale draws in one dark red."""
    group = [
        replace(r, scores=r.scores + offset) if KINDS[name] == "from_best" else r
        for name, r in attributions.items()
    ]
    page = report.html_page([group])
    has_path = _has_path(attributions)
    for result, colours in zip(group, _column_colours(page, len(group))):
        scores = _shown(result, has_path)
        finite = [(s, c) for s, c in zip(scores, colours) if math.isfinite(s)]
        values = [s for s, _ in finite]
        if max(values) - min(values) <= 1e-9 * max(1.0, abs(max(values))):
            continue
        name = type(result.semiring).__name__
        assert _spread([c for _, c in finite]) >= 116, (name, values, colours)


def _log_of_two_texts():
    model = _llama()
    return [
        sa.attribute(model, {"input_ids": ids}, 7, sa.Log(), position=-2, model_name="tiny")
        for ids in (IDS, OTHER_IDS)
    ]


def _from_best_colour(value: float, lower: float, upper: float) -> tuple[int, ...]:
    t = (value - lower) / (upper - lower)
    return tuple(round(z + (p - z) * t) for z, p in zip(ZERO, POSITIVE))


def test_texts_share_one_scale_per_semiring():
    texts = _log_of_two_texts()
    page = report.html_page(texts)
    assert "one scale per semiring, shared by the 2 texts" in page
    scores = [s for r in texts for s in r.display_scores().tolist()]
    finite = [s for s in scores if math.isfinite(s)]
    lower, upper = min(finite), max(finite)
    spans = _spans(page)
    assert len(spans) == len(scores)
    for (_, colour), score in zip(spans, scores):
        want = _from_best_colour(score, lower, upper) if math.isfinite(score) else None
        assert colour == (want or report.NOT_FINITE), score
    assert [colour for _, colour in spans].count(POSITIVE) == scores.count(upper)


def test_texts_on_their_own_scales_when_asked():
    texts = _log_of_two_texts()
    page = report.html_page(texts, per_text_scales=True)
    assert "each text on its own scale" in page
    spans = iter(_spans(page))
    for result in texts:
        scores = result.display_scores().tolist()
        finite = [s for s in scores if math.isfinite(s)]
        for score in scores:
            _, colour = next(spans)
            if math.isfinite(score):
                assert colour == _from_best_colour(score, min(finite), max(finite))


def test_every_legend_says_what_its_colours_mean(attributions):
    group = list(attributions.values())
    page = report.html_page([group])
    meanings = re.findall(r'<div class="meaning">([^<]+)</div>', page)
    assert len(meanings) == len(group)
    by_name = dict(zip(attributions, meanings))
    assert "path" in by_name["Boolean"] and "no path" in by_name["Boolean"]
    assert "<span>no path</span><span>path</span>" in page
    for name in ("Log", "Entropy", "Counting"):
        best = Scale.of(attributions[name]).upper
        assert f"difference from the largest score, {best:.6g}" in by_name[name]
    assert "white at 0" in by_name["Real"] and "white at 0" in by_name["MaxProduct"]


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
