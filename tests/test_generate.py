"""`generate` writes all or nothing, touches only the files it generated, and stops at once
on Ctrl-C."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from semiring_autograd.codegen import generate

ROOT = Path(__file__).resolve().parent.parent
GENERATE = [sys.executable, "-m", "semiring_autograd.codegen.generate"]


@pytest.fixture(scope="module")
def small_yaml(tmp_path_factory) -> Path:
    """Two ops of core.yaml: renders in a second or two."""
    directory = tmp_path_factory.mktemp("derivatives")
    core = yaml.safe_load((ROOT / "derivatives" / "core.yaml").read_text(encoding="utf-8"))
    kept = [e for e in core if e["name"].split("(")[0] in ("linear", "sum.dim")]
    (directory / "core.yaml").write_text(yaml.safe_dump(kept, allow_unicode=True))
    return directory


def _contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _stale_copy(out: Path) -> dict[str, bytes]:
    """``out`` holding the project's generated files with one edited, a generated module
    the sources no longer produce, and two files of the user's; its contents."""
    shutil.copytree(ROOT / "generated", out, ignore=shutil.ignore_patterns("__pycache__"))
    (out / "log.py").write_text((out / "log.py").read_text() + "\n# hand edit\n")
    header = (out / "real.py").read_text().splitlines()[0]
    (out / "retired.py").write_text(header + "\nX = 1\n")
    (out / "helpers.py").write_text("# mine\nY = 2\n")
    (out / "notes.md").write_text("my notes\n")
    return _contents(out)


def test_files_without_the_header_survive_and_are_not_listed(small_yaml, tmp_path, capsys):
    out = tmp_path / "gen"
    out.mkdir()
    (out / "helpers.py").write_text("Y = 2\n")
    (out / "README.md").write_text("mine\n")
    assert generate.main(["--yaml-dir", str(small_yaml), "--out-dir", str(out)]) == 0
    listed = capsys.readouterr().out
    assert "helpers.py" not in listed and "README.md" not in listed
    assert (out / "helpers.py").read_text() == "Y = 2\n"
    assert (out / "README.md").read_text() == "mine\n"
    assert generate.main(["--check", "--yaml-dir", str(small_yaml), "--out-dir", str(out)]) == 0
    assert not [p for p in tmp_path.iterdir() if p.name != "gen"], "a staging folder was left"


def test_stale_generated_modules_are_removed_and_others_kept(small_yaml, tmp_path, capsys):
    out = tmp_path / "gen"
    assert generate.main(["--yaml-dir", str(small_yaml), "--out-dir", str(out)]) == 0
    header = (out / "real.py").read_text().splitlines()[0]
    (out / "retired.py").write_text(header + "\nX = 1\n")
    (out / "helpers.py").write_text("Y = 2\n")
    capsys.readouterr()
    args = ["--yaml-dir", str(small_yaml), "--out-dir", str(out)]
    assert generate.main(["--check", *args]) == 1
    assert "retired.py" in capsys.readouterr().err
    assert generate.main(args) == 0
    assert not (out / "retired.py").exists() and (out / "helpers.py").read_text() == "Y = 2\n"
    assert generate.main(["--check", *args]) == 0


def test_a_file_of_the_users_under_a_generated_name_is_refused(small_yaml, tmp_path, capsys):
    out = tmp_path / "gen"
    out.mkdir()
    (out / "real.py").write_text("# my own real.py\n")
    assert generate.main(["--yaml-dir", str(small_yaml), "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "real.py without the @generated header" in err and "move them away" in err
    assert [p.name for p in out.iterdir()] == ["real.py"]
    assert (out / "real.py").read_text() == "# my own real.py\n"


def test_an_interrupt_while_moving_files_in_is_held_until_all_are_in(
    small_yaml, tmp_path, monkeypatch
):
    """The swap itself: SIGINT arriving after the first file moved in is handled only once
    every file is in (KeyboardInterrupt then), so the folder is never a mix."""
    out = tmp_path / "gen"
    assert generate.main(["--yaml-dir", str(small_yaml), "--out-dir", str(out)]) == 0
    new = _contents(out)
    for path in out.glob("*.py"):
        path.write_text(path.read_text().splitlines()[0] + "\n# an older rendering\n")
    replace = os.replace
    moved = []

    def replace_then_interrupt(src, dst):
        replace(src, dst)
        moved.append(dst)
        if len(moved) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(generate.os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        generate.write(small_yaml, out, check=False)
    assert len(moved) > 1 and _contents(out) == new


def _interrupted_run(out: Path, after_line: str | None, delay: float) -> tuple[int, float, str]:
    """Run ``generate --out-dir out`` in a subprocess, send SIGINT ``delay`` seconds after
    it starts (or after it prints ``after_line`` to stderr); (exit code, seconds from the
    signal to the exit, stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*GENERATE, "--out-dir", str(out)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=ROOT,
    )
    seen = []
    if after_line is not None:
        for line in proc.stderr:
            seen.append(line)
            if after_line in line:
                break
        assert proc.poll() is None, f"generate ended before {after_line!r}: {''.join(seen)}"
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    try:
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    exited = time.monotonic()
    return code, exited - sent, "".join(seen) + proc.stderr.read()


@pytest.mark.slow
@pytest.mark.parametrize(
    "after_line, delay",
    [(None, 1.0), ("formatting", 0.5), ("formatting", 3.0), ("formatted", 0.0)],
    ids=["starting", "formatting-begun", "formatting", "one-worker-done"],
)
def test_sigint_leaves_the_folder_whole_and_exits_within_two_seconds(tmp_path, after_line, delay):
    out = tmp_path / "gen"
    before = _stale_copy(out)
    code, seconds, err = _interrupted_run(out, after_line, delay)
    assert code != 0, err
    assert seconds < 2.0, f"{seconds:.1f} s from SIGINT to exit\n{err}"
    assert _contents(out) == before, "an interrupted run changed the folder"
    assert [p.name for p in tmp_path.iterdir()] == ["gen"], "a staging folder was left"
    if after_line is not None:
        assert "generate: interrupted" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "folder, name",
    [
        ("codegen", "semiring_autograd.codegen"),
        ("generated", "semiring_autograd.generated"),
        ("derivatives", "semiring_autograd.derivatives"),
    ],
)
def test_each_top_level_folder_imports_under_one_name_only(folder, name):
    """From the checkout's root, ``import codegen`` (say) would make a second module with
    its own classes: it raises, naming the one import name."""
    run = subprocess.run(
        [sys.executable, "-c", f"import {folder}"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode != 0 and "ImportError" in run.stderr, run.stderr
    assert name in run.stderr.splitlines()[-1], run.stderr
    subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, check=True)


def test_the_loader_is_one_module_with_one_error_class():
    import semiring_autograd.codegen.loader as loader

    assert sys.modules["semiring_autograd.codegen.loader"] is loader
    assert "codegen.loader" not in sys.modules
    assert loader.DerivativesError.__module__ == "semiring_autograd.codegen.loader"
