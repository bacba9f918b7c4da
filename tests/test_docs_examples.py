"""Every ```python block of README.md and docs/*.md runs as pasted.

Each block runs alone in a fresh interpreter (``sys.executable``, working directory a
temporary folder, Hugging Face offline): it must import what it uses, build or load its
model, exit with status 0 and print something. One test case per block, named
``file:line`` (the line of its opening fence). A block that is not meant to run is fenced
with another language (``text``, ``bash``, ``python-skip``), never ``python``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the languages that name a Python block; ```python-skip and others are not run
PYTHON = {"python", "py", "python3"}
# the slowest block loads the embedded SmolLM2-135M (15-30 s alone, more on a busy machine)
TIMEOUT_S = 300

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line of the opening fence, language, code) of every fenced block of a Markdown text,
    as CommonMark reads fences: up to 3 spaces of indent, at least 3 backticks or tildes,
    closed by a fence of the same character at least as long; an unclosed block runs to the
    end. The code loses the opening fence's indent."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        info = opening["info"].strip()
        if fence[0] == "`" and "`" in info:
            i += 1  # an inline code span, not a fence
            continue
        language = info.split()[0].lower() if info else ""
        body = []
        j = i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if (
                closing is not None
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
                and not closing["info"].strip()
            ):
                break
            line = lines[j]
            strip = min(indent, len(line) - len(line.lstrip(" ")))
            body.append(line[strip:])
            j += 1
        blocks.append((i + 1, language, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def python_blocks() -> list[tuple[str, int, str]]:
    """(document relative to the repository, line, code) of every Python block."""
    found = []
    for document in DOCUMENTS:
        name = document.relative_to(ROOT).as_posix()
        for line, language, code in code_blocks(document.read_text(encoding="utf-8")):
            if language in PYTHON:
                found.append((name, line, code))
    return found


def run_block(code: str, line: int, directory: Path, name: str = "block.py"):
    """Run ``code`` as a script in a fresh interpreter inside ``directory``. The script is
    padded so that its lines carry their numbers in the document: a traceback points at the
    Markdown line."""
    script = directory / name
    script.write_text("\n" * line + code, encoding="utf-8")
    env = dict(os.environ, HF_HUB_OFFLINE="1", MPLBACKEND="Agg")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        env["OMP_NUM_THREADS"] = "1"  # one thread per worker, as tests/conftest.py sets
    return subprocess.run(
        [sys.executable, script.name],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


BLOCKS = python_blocks()
# a block that loads the embedded SmolLM2-135M (de-quantised from GGUF, 15-30 s) is slow
_SLOW = ("load_causal_lm()", "load_model()")


@pytest.mark.parametrize(
    "document, line, code",
    [
        pytest.param(
            name,
            line,
            code,
            id=f"{name}:{line}",
            marks=[pytest.mark.slow] if any(s in code for s in _SLOW) else [],
        )
        for name, line, code in BLOCKS
    ],
)
def test_block_runs_as_pasted(document, line, code, tmp_path):
    result = run_block(code, line, tmp_path, Path(document).stem + ".py")
    assert result.returncode == 0, (
        f"the ```python block at {document}:{line} exits with {result.returncode}:\n"
        f"{result.stderr[-4000:]}"
    )
    assert result.stdout.strip(), f"the ```python block at {document}:{line} prints nothing"


def test_the_documents_have_python_blocks():
    """The extraction reads every page of the documentation and finds its examples (a parser
    that finds none passes every case above vacuously): the README's quick start and the
    embedded SmolLM2 loaded from Python, and an example per public function in docs/api.md."""
    names = {document.relative_to(ROOT).as_posix() for document in DOCUMENTS}
    for page in ("api", "semantics", "interop", "architecture", "performance", "paper"):
        assert f"docs/{page}.md" in names
    readme = [code for name, _, code in BLOCKS if name == "README.md"]
    assert len(readme) >= 2
    assert any("sa.patch(" in code and "sa.grad(" in code for code in readme)
    assert any("load_causal_lm()" in code for code in readme)
    api = "\n".join(code for name, _, code in BLOCKS if name == "docs/api.md")
    for call in (
        "sa.compiled_step(",
        "sa.trace(",
        "sa.top_path(",
        "sa.top_paths(",
        "sa.attribute(",
        "sa.module_flow(",
        "sa.consumer_flow(",
        "sa.node_info(",
        "sa.check_semiring(",
        "sa.captum.",
    ):
        assert call in api, f"docs/api.md has no example calling {call}"


def test_the_documents_name_only_public_sa_names():
    """The README and docs/ write ``sa.X`` only for the public API (``sa.__all__`` and the
    lazy ``sa.captum``, and ``sa.__file__``); every other name is written with its module path, which is where
    it is imported from. CHANGELOG.md is history and names what existed then."""
    import semiring_autograd as sa

    public = set(sa.__all__) | {"captum", "__all__", "__file__"}
    wrong = []
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), 1):
            for name in re.findall(r"(?<![\w.])sa\.(\w+)", line):
                if name not in public:
                    wrong.append(f"{document.relative_to(ROOT)}:{number}: sa.{name}")
    assert not wrong, "names that are not in sa.__all__:\n" + "\n".join(wrong)


def test_code_blocks_reads_fences_as_markdown_does():
    text = "\n".join(
        [
            "Prose with ```inline``` code.",
            "```python",
            "print(1)",
            "```",
            "",
            "```python-skip",
            "not run",
            "```",
            "  ````py title",
            "  x = '```'",
            "  ```",
            "  print(x)",
            "  ````",
            "~~~",
            "shell",
            "~~~",
        ]
    )
    assert code_blocks(text) == [
        (2, "python", "print(1)\n"),
        (6, "python-skip", "not run\n"),
        (9, "py", "x = '```'\n```\nprint(x)\n"),
        (14, "", "shell\n"),
    ]


def test_a_failing_block_fails_and_names_its_line(tmp_path):
    """The runner reports a broken block: its exit status, and the traceback at the
    block's own line of the document."""
    result = run_block("import math\nprint(undefined_model)\n", 40, tmp_path)
    assert result.returncode != 0
    assert "NameError" in result.stderr
    assert "line 42" in result.stderr
