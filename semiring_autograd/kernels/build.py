"""Build and load the CPU kernels (``operators.cpp``) with ``torch.utils.cpp_extension``.

``SEMIRING_AUTOGRAD_KERNELS`` selects how the fused kernels run: ``check`` (the default:
each kernel is checked against its torch formula on its first use per device and dtype,
``checks.py``), ``trust`` (no check), ``off`` (none of them; ``eager`` is the same). Any
other value raises ValueError on first use.

The build happens on first use, once per cache key, into
``$SEMIRING_AUTOGRAD_CACHE/<name>/`` (default ``~/.cache/semiring_autograd``). The name
hashes what the library depends on: the sources' contents, the compiler flags, torch's
version, C++ ABI and debug flag, the Python ABI tag, the compiler (``$CXX --version``,
first line) and the CPU (``-march=native``). The sources are copied into that directory
and compiled there, so the build commands do not name the checkout; a finished build
leaves ``build.json`` next to the library, and later loads take the library directly
(``torch.ops.load_library``) without ``cpp_extension``, whichever checkout or virtual
environment asks. Two checkouts with the same sources therefore share one build.

Flags: ``-O3 -march=native -fno-trapping-math -fopenmp`` (and ``-mprefer-vector-width=512``
on x86-64); a build without OpenMP is tried when the first fails (its kernels run on one
thread). ``SEMIRING_AUTOGRAD_CXXFLAGS`` appends flags (space-separated; e.g.
``-mno-avx512f`` builds the portable paths on an AVX-512 machine). Loading registers the
CPU kernels of the operators ``operators.py`` defines.

A build that compiles prints one line on stderr first, ``semiring_autograd: building
semiring kernels for <CPU model> (torch <version>), about N s, once (cached in <dir>)
...``, N being the last build time recorded in the cache root (``DEFAULT_BUILD_SECONDS``
before any), and records its own time in ``build.json``.

A cache root or build directory that another user could write (not owned by this user,
or group- or world-writable) is refused: one warning naming it, its owner and mode and the
fix, and nothing is loaded from it (the callers use their eager formulas). So do a missing
compiler or ninja and a failed build, each with one warning.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import shutil
import stat
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path

import torch

_HERE = Path(__file__).parent
_SOURCES = (
    _HERE / "operators.cpp",
    _HERE / "extreme_matmul.h",
    _HERE / "k_best.h",
    _HERE / "log_entries.h",
    _HERE / "extreme_entries.h",
    _HERE / "counting_entries.h",
    _HERE / "standardize.h",
    _HERE / "attention_rows.h",
)
ENV = "SEMIRING_AUTOGRAD_KERNELS"
MODES = ("off", "check", "trust")
ALIASES = {"eager": "off"}
_LOCK = threading.Lock()
#: the estimate of a build's time before one is recorded in the cache root
DEFAULT_BUILD_SECONDS = 60
#: the record a finished build leaves in its directory (JSON; "seconds" when it compiled)
RECORD = "build.json"

FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-std=c++17"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # the auto-vectorised loops are 256 bits wide by default even where the CPU has
    # AVX-512 (the matmul kernels use its registers explicitly); 512 runs them faster
    FLAGS.append("-mprefer-vector-width=512")
#: tried first: the kernels then run on torch's own OpenMP threads
OPENMP_FLAGS = ["-fopenmp"]


def mode() -> str:
    """``off``, ``check`` or ``trust``: ``SEMIRING_AUTOGRAD_KERNELS`` (default ``check``;
    ``eager`` is ``off``), read on every call. An unknown value raises ValueError."""
    raw = _ENVIRON.get(_KEY) if _ENVIRON is not None else os.environ.get(ENV)
    value = _PARSED.get(raw)
    if value is None:
        text = os.environ.get(ENV, "")
        value = text.strip().lower() or "check"
        value = ALIASES.get(value, value)
        if value not in MODES:
            raise ValueError(
                f"{ENV}={text!r} is not a kernel mode: use off (no fused kernels; eager is the "
                f"same), check (each kernel checked on first use; the default) or trust"
            )
        _PARSED[raw] = value
    return value


#: the environment's value (as ``_ENVIRON`` holds it; None: unset) -> its mode
_PARSED: dict = {}
#: ``os.environ``'s own mapping (CPython's ``_data``, which every write to ``os.environ``
#: updates) and the variable's key in it: a kernel call reads the mode with one dict lookup,
#: without the three Python calls of ``os.environ.get``
_ENVIRON: dict | None = getattr(os.environ, "_data", None)
_KEY = os.environ.encodekey(ENV) if _ENVIRON is not None else None


def enabled() -> bool:
    """Whether the fused kernels may run: ``SEMIRING_AUTOGRAD_KERNELS`` is not ``off``."""
    return mode() != "off"


def cache_dir() -> Path:
    """The cache root: ``$SEMIRING_AUTOGRAD_CACHE``, else ``~/.cache/semiring_autograd``."""
    root = os.environ.get("SEMIRING_AUTOGRAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "semiring_autograd"
    )
    return Path(root)


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU model and its flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _missing_tool() -> str | None:
    """What the build needs and this machine lacks, or None."""
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found; set CXX)"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja not found (pip install ninja)"
    return None


def _extra_flags() -> list[str]:
    return os.environ.get("SEMIRING_AUTOGRAD_CXXFLAGS", "").split()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's processor."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    except OSError:  # no /proc (not Linux)
        names = []
    return names[0] if names else platform.processor() or platform.machine()


@functools.cache
def _compiler() -> str:
    """The compiler's identity: the first line of ``$CXX --version`` (c++ by default)."""
    cxx = os.environ.get("CXX") or "c++"
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
        return f"{cxx}: {(done.stdout.splitlines() or [''])[0]}"
    except (OSError, subprocess.SubprocessError) as error:
        return f"{cxx}: {type(error).__name__}"


def build_name(flags: list[str]) -> str:
    """The build's directory and library name: a hash of what the library depends on (the
    sources' contents, the flags, torch's version and C++ ABI, the Python ABI, the
    compiler, the CPU), never of where the sources or torch lie."""
    key = hashlib.sha256()
    for source in _SOURCES:
        key.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    parts = [
        " ".join(flags),
        torch.__version__,
        str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")),
        str(torch.version.debug),
        sys.implementation.cache_tag or "",
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        _compiler(),
        _cpu_signature(),
    ]
    key.update("\0".join(parts).encode())
    return f"semiring_autograd_kernels_{key.hexdigest()[:16]}"


def unsafe(directory: Path) -> str | None:
    """Why another user could write ``directory`` (not owned by this user, or group- or
    world-writable), or None. POSIX only."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:
        return None
    st = directory.stat()
    mode_bits = stat.S_IMODE(st.st_mode)
    if st.st_uid != getuid():
        return f"owned by uid {st.st_uid}, not by you (uid {getuid()}), mode {mode_bits:o}"
    if mode_bits & 0o022:
        return f"owner uid {st.st_uid}, mode {mode_bits:o}: writable by group or others"
    return None


def _refusal(directory: Path) -> str | None:
    """The warning text when ``directory`` (created 0700 if missing) is unsafe, else None."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    why = unsafe(directory)
    if why is None:
        return None
    return (
        f"semiring_autograd: refusing the kernel cache {directory} ({why}): another user "
        f"could replace the compiled kernels loaded from it; using eager torch formulas, "
        f"which are slower. Fix: chmod 700 {directory} as its owner, or set "
        f"SEMIRING_AUTOGRAD_CACHE to a directory only you can write."
    )


def _copy_sources(directory: Path) -> Path:
    """The sources copied into the build directory (the build reads them there, so its
    commands are the same whichever checkout loads it); the copy of operators.cpp."""
    for source in _SOURCES:
        target = directory / source.name
        data = source.read_bytes()
        if not target.is_file() or target.read_bytes() != data:
            partial = target.with_name(f".{source.name}.{os.getpid()}")
            partial.write_bytes(data)
            os.replace(partial, target)
    return directory / _SOURCES[0].name


def _write_record(directory: Path, record: dict) -> None:
    partial = directory / f".{RECORD}.{os.getpid()}"
    partial.write_text(json.dumps(record))
    os.replace(partial, directory / RECORD)


def estimate_seconds(root: Path) -> int:
    """The last build time recorded under ``root`` (rounded up), else
    ``DEFAULT_BUILD_SECONDS``."""
    latest, seconds = -1.0, None
    for record in root.glob(f"*/{RECORD}"):
        try:
            data = json.loads(record.read_text())
            mtime = record.stat().st_mtime
        except (OSError, ValueError):
            continue  # a record being written or damaged: the others decide
        if isinstance(data.get("seconds"), (int, float)) and mtime > latest:
            latest, seconds = mtime, data["seconds"]
    return DEFAULT_BUILD_SECONDS if seconds is None else max(1, math.ceil(seconds))


#: the loaded library, once loaded
_LOADED: list[Path] = []


def library_path() -> Path | None:
    """The library this process loaded (after ``available()``), or None."""
    return _LOADED[-1] if _LOADED else None


def _load(flags: list[str]) -> None:
    """Load the build of ``flags`` from the cache, building it first when the cache has no
    finished one."""
    name = build_name(flags)
    directory = cache_dir() / name
    refusal = _refusal(directory)
    if refusal is not None:
        raise _Refused(refusal)
    library = directory / f"{name}.so"
    if library.is_file() and (directory / RECORD).is_file():
        torch.ops.load_library(str(library))
        _LOADED.append(library)
        return
    from torch.utils import cpp_extension

    openmp = bool(set(OPENMP_FLAGS) & set(flags))
    compiles = not library.is_file()
    if compiles:
        _announce_build(openmp, directory)
    start = time.perf_counter()
    cpp_extension.load(
        name=name,
        sources=[str(_copy_sources(directory))],
        extra_cflags=flags,
        extra_ldflags=OPENMP_FLAGS if openmp else [],
        extra_include_paths=[str(directory)],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    record = {"flags": flags, "torch": torch.__version__, "cpu": cpu_model()}
    if compiles:
        record["seconds"] = round(time.perf_counter() - start, 1)
    _write_record(directory, record)
    _LOADED.append(library)


class _Refused(Exception):
    """The cache directory is unsafe (the message is the warning)."""


@functools.cache
def _built() -> tuple[str, ...] | None:
    """The flags the loaded build used, or None when it could not be built or loaded."""
    try:
        refusal = _refusal(cache_dir())
    except OSError as error:  # the root cannot be created or read
        _warn(f"the cache directory {cache_dir()} is unusable: {error}")
        return None
    if refusal is not None:
        warnings.warn(refusal, RuntimeWarning, stacklevel=4)
        return None
    missing = _missing_tool()
    if missing is not None:
        _warn(missing)
        return None
    error = None
    for flags in (FLAGS + OPENMP_FLAGS + _extra_flags(), FLAGS + _extra_flags()):
        try:
            _load(flags)
            return tuple(flags)
        except _Refused as refused:
            warnings.warn(str(refused), RuntimeWarning, stacklevel=4)
            return None
        except (RuntimeError, OSError, ImportError) as exc:  # a failed compile or link
            error = exc
    _warn(f"the build failed: {str(error)[-2000:]}")
    return None


def available() -> bool:
    """Whether the CPU kernels are enabled and built (building them on the first call)."""
    return enabled() and built()


def built() -> bool:
    """Whether the CPU kernels are built and loaded, whatever the mode (building them on
    the first call, under a lock; once loaded, a read without it)."""
    if LOADED:
        return True
    with _LOCK:
        flags = _built()
        LOADED[:] = [] if flags is None else [flags]
        return flags is not None


#: the loaded build's flags once ``built()`` has found it loaded (empty until then): a kernel
#: call reads it without a call or the lock
LOADED: list = []
_clear_built = _built.cache_clear


def _forget_build() -> None:
    """``_built.cache_clear()``: the loaded build forgotten, LOADED too; the next ``built()``
    loads it again."""
    LOADED.clear()
    _clear_built()


_built.cache_clear = _forget_build


def uses_openmp() -> bool:
    """Whether the loaded build runs its kernels on OpenMP threads (False when not built)."""
    return available() and OPENMP_FLAGS[0] in _built()


def _announce_build(openmp: bool, directory: Path) -> None:
    """One line on stderr before a compile that no cached build saves."""
    variant = "" if openmp else ", without OpenMP"
    print(
        f"semiring_autograd: building semiring kernels for {cpu_model()} "
        f"(torch {torch.__version__}{variant}), about {estimate_seconds(directory.parent)} s, "
        f"once (cached in {directory}) ...",
        file=sys.stderr,
        flush=True,
    )


def _warn(reason: str) -> None:
    warnings.warn(
        f"semiring_autograd: fused CPU semiring kernels unavailable ({reason}); using eager "
        f"torch formulas, which are slower. Set {ENV}=eager to silence this.",
        RuntimeWarning,
        stacklevel=4,
    )
