"""The wheel: codegen installed as semiring_autograd.codegen, the YAML as package data, and
`generate` running from the installed copy to the same files as the checkout's generated/."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (
    "pyproject.toml",
    "README.md",
    "semiring_autograd",
    "semiring_autograd_cli.py",
    "codegen",
    "generated",
    "derivatives",
)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of the sources and unpacked (an install
    without the checkout on the path)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    dist = tmp / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(dist),
            str(src),
        ],
        check=True,
    )
    (wheel,) = dist.glob("semiring_autograd-*.whl")
    site = tmp / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def _run(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )


def test_wheel_holds_codegen_and_the_yaml(installed):
    package = installed / "semiring_autograd"
    assert sorted(p.name for p in (package / "derivatives").glob("*.yaml")) == sorted(
        p.name for p in (ROOT / "derivatives").glob("*.yaml")
    )
    assert (package / "codegen" / "templates" / "functions.py.j2").is_file()
    assert (package / "generated" / "ops_table.py").is_file()
    assert not (installed / "codegen").exists(), "codegen must not install as a top-level package"
    assert (installed / "semiring_autograd_cli.py").is_file(), "the command line's parser"
    for init in (ROOT / "semiring_autograd").rglob("__init__.py"):
        module = init.parent.relative_to(ROOT)
        assert (installed / module / "__init__.py").is_file(), f"{module} is not in the wheel"


def test_generate_runs_from_the_installed_copy(installed, tmp_path):
    where = _run(installed, tmp_path, "-c", "import semiring_autograd as sa; print(sa.__file__)")
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(installed)), where.stdout
    done = _run(installed, tmp_path, "-m", "semiring_autograd.codegen.generate")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "generated"
    for path in (ROOT / "generated").iterdir():
        if path.is_file():
            assert (out / path.name).read_text() == path.read_text(), path.name
