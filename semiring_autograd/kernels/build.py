"""Build and load the CPU kernels (``operators.cpp``) with ``torch.utils.cpp_extension``.

Built on first use into ``$SEMIRING_AUTOGRAD_CACHE`` (default
``~/.cache/semiring_autograd``), one build per source, compiler flags and CPU (the flags
hold ``-march=native``), with ``-O3 -march=native -fno-trapping-math -fopenmp`` (and
``-mprefer-vector-width=512`` on x86-64). A build without OpenMP is tried when the first
fails; its kernels run on one thread. Loading registers the CPU kernels of the operators
``operators.py`` defines. No compiler or no ninja: one warning naming what is missing, and
the callers use their eager formulas. ``SEMIRING_AUTOGRAD_CXXFLAGS`` appends flags
(space-separated; e.g. ``-mno-avx512f`` builds the portable paths on an AVX-512 machine).
A build that really compiles (no cached one) says so on stderr first: it takes a minute or
two on a busy machine.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import threading
import warnings
from pathlib import Path

import torch

_HERE = Path(__file__).parent
_SOURCES = (_HERE / "operators.cpp", _HERE / "extreme_matmul.h")
ENV = "SEMIRING_AUTOGRAD_KERNELS"
_LOCK = threading.Lock()

FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-std=c++17"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # the auto-vectorised loops are 256 bits wide by default even where the CPU has
    # AVX-512 (the matmul kernels use its registers explicitly); 512 runs them faster
    FLAGS.append("-mprefer-vector-width=512")
#: tried first: the kernels then run on torch's own OpenMP threads
OPENMP_FLAGS = ["-fopenmp"]


def enabled() -> bool:
    """False when ``SEMIRING_AUTOGRAD_KERNELS=eager`` asks for eager evaluation."""
    return os.environ.get(ENV, "").strip().lower() != "eager"


def cache_dir() -> Path:
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


def _load(flags: list[str]) -> None:
    """Build (or find built) and load the extension with ``flags``."""
    from torch.utils import cpp_extension

    key = hashlib.sha256()
    for source in _SOURCES:
        key.update(source.read_bytes())
    key.update(" ".join(flags).encode() + torch.__version__.encode() + _cpu_signature().encode())
    name = f"semiring_autograd_kernels_{key.hexdigest()[:16]}"
    directory = cache_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    openmp = bool(set(OPENMP_FLAGS) & set(flags))
    if not (directory / f"{name}.so").is_file():
        _announce_build(openmp)
    cpp_extension.load(
        name=name,
        sources=[str(_SOURCES[0])],
        extra_cflags=flags,
        extra_ldflags=OPENMP_FLAGS if openmp else [],
        extra_include_paths=[str(_HERE)],
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )


@functools.cache
def _built() -> tuple[str, ...] | None:
    """The flags the loaded build used, or None when it could not be built."""
    missing = _missing_tool()
    if missing is not None:
        _warn(missing)
        return None
    error = None
    for flags in (FLAGS + OPENMP_FLAGS + _extra_flags(), FLAGS + _extra_flags()):
        try:
            _load(flags)
            return tuple(flags)
        except (RuntimeError, OSError, ImportError) as exc:  # a failed compile or link
            error = exc
    _warn(f"the build failed: {str(error)[-2000:]}")
    return None


def available() -> bool:
    """Whether the CPU kernels are enabled and built (building them on the first call)."""
    if not enabled():
        return False
    with _LOCK:
        return _built() is not None


def uses_openmp() -> bool:
    """Whether the loaded build runs its kernels on OpenMP threads (False when not built)."""
    return available() and OPENMP_FLAGS[0] in _built()


def _announce_build(openmp: bool) -> None:
    """One line on stderr before a compile that no cached build saves."""
    variant = "" if openmp else ", without OpenMP"
    print(
        f"semiring_autograd: building the fused CPU kernels{variant} "
        f"(once, 20 s to 2 min; cached in {cache_dir()}) ...",
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
