"""The CPU kernels' build (``kernels/build.py``): one cache key per content, shared by every
checkout; the announcement before a compile; cache directories another user could write
refused. No test here compiles: they reuse the session's build (the same key), or are
refused before any build starts."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from semiring_autograd import kernels
from semiring_autograd.kernels import build

ANNOUNCEMENT = re.compile(
    r"semiring_autograd: building semiring kernels for .+ \(torch [^)]+\), about (\d+) s, "
    r"once \(cached in (.+)\) \.\.\."
)


@pytest.fixture
def reload_after():
    """``_built`` forgotten after the test, so that the next use loads the session's
    build again (from its cache)."""
    yield
    build._built.cache_clear()


def _checkout(root: Path) -> tuple[Path, ...]:
    """The kernel sources copied into ``root``: another checkout's paths, same contents."""
    root.mkdir()
    return tuple(Path(shutil.copy(source, root)) for source in build._SOURCES)


def _flags() -> list[str]:
    return build.FLAGS + build.OPENMP_FLAGS + build._extra_flags()


def test_cache_key_is_the_contents_not_the_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "_SOURCES", _checkout(tmp_path / "a"))
    name_a = build.build_name(_flags())
    b = _checkout(tmp_path / "b")
    monkeypatch.setattr(build, "_SOURCES", b)
    assert build.build_name(_flags()) == name_a
    assert build.build_name(_flags() + ["-DNDEBUG"]) != name_a
    b[1].write_bytes(b[1].read_bytes() + b"\n")
    assert build.build_name(_flags()) != name_a


def test_second_checkout_loads_the_first_ones_build(tmp_path, monkeypatch, capfd, reload_after):
    """Two checkouts (the sources at two paths) load one library: the second neither
    compiles (cpp_extension.load is never called, nothing is announced) nor touches the
    library or its build.ninja."""
    if not kernels.available():
        pytest.skip("the CPU kernels are switched off or could not be built here")
    from torch.utils import cpp_extension

    loaded = {}
    for checkout in ("a", "b"):
        monkeypatch.setattr(build, "_SOURCES", _checkout(tmp_path / checkout))
        build._built.cache_clear()
        assert build._built() is not None
        library = build.library_path()
        ninja = library.with_name("build.ninja")
        loaded[checkout] = (library, library.stat(), ninja.stat() if ninja.exists() else None)
        monkeypatch.setattr(cpp_extension, "load", _no_compile)
    assert "building semiring kernels" not in capfd.readouterr().err
    (lib_a, so_a, ninja_a), (lib_b, so_b, ninja_b) = loaded["a"], loaded["b"]
    assert lib_a == lib_b and lib_a.parent.parent == build.cache_dir()
    assert (so_a.st_ino, so_a.st_mtime_ns) == (so_b.st_ino, so_b.st_mtime_ns)
    assert ninja_a is None or ninja_a.st_mtime_ns == ninja_b.st_mtime_ns
    # the build reads its own copy of the sources
    for source in build._SOURCES:
        assert (lib_a.parent / source.name).read_bytes() == source.read_bytes()
    assert json.loads((lib_a.parent / build.RECORD).read_text())["torch"]


def _no_compile(*args, **kwargs):
    raise AssertionError("the second checkout compiled the kernels")


def test_announcement_is_one_line_with_the_recorded_time(tmp_path, capsys):
    root = tmp_path / "cache"
    target = root / "semiring_autograd_kernels_new"
    build._announce_build(True, target)
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    match = ANNOUNCEMENT.fullmatch(err.strip())
    assert match, err
    assert int(match.group(1)) == build.DEFAULT_BUILD_SECONDS
    assert match.group(2) == str(target)
    for name, seconds in (("old", 80.0), ("last", 41.2)):
        (root / name).mkdir(parents=True)
        (root / name / build.RECORD).write_text(json.dumps({"seconds": seconds}))
    os.utime(root / "old" / build.RECORD, (1, 1))
    build._announce_build(False, target)
    match = ANNOUNCEMENT.fullmatch(capsys.readouterr().err.strip())
    assert match and match.group(1) == "42", "the latest recorded build time, rounded up"


def test_a_build_is_announced_only_when_it_compiles(tmp_path, monkeypatch, capsys):
    """With cpp_extension.load faked: the first load announces itself, compiles the copy of
    the sources in the build directory and records its time; the second loads the library
    directly, without a word."""
    import torch
    from torch.utils import cpp_extension

    compiled, loaded = [], []

    def fake_load(name, sources, build_directory, **kwargs):
        compiled.append(sources)
        (Path(build_directory) / f"{name}.so").write_bytes(b"")

    monkeypatch.setenv("SEMIRING_AUTOGRAD_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(build, "_LOADED", [])
    build._load(build.FLAGS)
    err = capsys.readouterr().err
    directory = tmp_path / build.build_name(build.FLAGS)
    assert err.count("\n") == 1 and ANNOUNCEMENT.fullmatch(err.strip()), err
    assert compiled == [[str(directory / "operators.cpp")]]
    assert json.loads((directory / build.RECORD).read_text())["seconds"] >= 0
    build._load(build.FLAGS)  # the finished build: loaded without a word
    assert capsys.readouterr().err == "" and len(compiled) == 1
    assert loaded == [str(directory / f"{directory.name}.so")]
    assert build.library_path() == directory / f"{directory.name}.so"


def _refused(record, directory: Path) -> list[str]:
    return [
        str(w.message)
        for w in record
        if "refusing the kernel cache" in str(w.message) and str(directory) in str(w.message)
    ]


def test_cache_writable_by_others_is_refused(tmp_path, monkeypatch, reload_after):
    """A world-writable cache root: one warning with the directory, its owner and mode and
    the fix; nothing is built or loaded from it."""
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setenv("SEMIRING_AUTOGRAD_CACHE", str(root))
    build._built.cache_clear()
    with pytest.warns(RuntimeWarning) as record:
        assert not build.available()
    (message,) = _refused(record, root)
    assert f"owner uid {os.getuid()}, mode 777" in message
    assert f"chmod 700 {root}" in message and "SEMIRING_AUTOGRAD_CACHE" in message
    assert list(root.iterdir()) == []


def test_build_directory_writable_by_others_is_refused(tmp_path, monkeypatch, reload_after):
    """A safe root holding a group-writable build directory of this build's name: refused
    with one warning, and the library is not loaded from it."""
    root = tmp_path / "cache"
    directory = root / build.build_name(_flags())
    directory.mkdir(parents=True)
    root.chmod(0o700)
    directory.chmod(0o770)
    monkeypatch.setenv("SEMIRING_AUTOGRAD_CACHE", str(root))
    build._built.cache_clear()
    with pytest.warns(RuntimeWarning) as record:
        assert build._built() is None
    (message,) = _refused(record, directory)
    assert "mode 770: writable by group or others" in message
    assert list(directory.iterdir()) == []


def test_cache_owned_by_another_user_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.skip("only root can give a directory to another user")
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, -1)
    assert build.unsafe(directory) == "owned by uid 65534, not by you (uid 0), mode 700"
    os.chown(directory, 0, -1)
    assert build.unsafe(directory) is None
