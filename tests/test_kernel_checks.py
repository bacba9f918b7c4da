"""The fused kernels' self-checks (``kernels/checks.py``) and ``SEMIRING_AUTOGRAD_KERNELS``.

A kernel made wrong on purpose (its operator patched to perturb one entry) must be caught
by its check on first use, with one warning naming it and the device, after which the
wrapper declines and the semiring results are the torch formulas' (the kernels off); in
``trust`` mode the same wrong kernel is used, which shows that the check is what protects.
The oracles are the computations with the kernels off and each check's own verdict on the
real kernels; the Triton kernels are checked in Triton's interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import semiring_autograd as sa
from semiring_autograd import kernels
from semiring_autograd.kernels import checks, operators

ENV = "SEMIRING_AUTOGRAD_KERNELS"
DTYPES = [torch.float32, torch.float64]
CPU = torch.device("cpu")
#: kernels answering yes/no questions (one, or one per entry): made wrong by flipping the answer
BOOLEAN = {"any_nan_or_inf", "all_rows_live", "log_gemm_finish_", "softmax_backward_or"}
#: kernels returning nothing: made wrong in the argument they write
WRITES = {
    "ratio_where_positive_": 0,
    "entropy_weights": 1,
    "log_add_rows_": 0,
    "entropy_add_rows_": 0,
    "softmax_rows_": 0,
}


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch):
    """Kernels built, ``check`` mode, and no verdict from other tests (before and after)."""
    monkeypatch.delenv(ENV, raising=False)
    if not kernels.available():
        pytest.skip("the CPU kernels could not be built on this machine")
    checks.reset()
    yield
    checks.reset()


def _perturb(name: str, out, args):
    """The kernel's result made wrong: the answer flipped, or 1 added to the first finite
    entry of its first floating-point output."""
    if name in BOOLEAN:
        return ~out
    found = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]
    found = [t for t in found if t.is_floating_point() and t.numel()]
    target = found[0] if found else args[WRITES[name]]
    index = tuple(torch.isfinite(target).nonzero()[0])
    target[index] += 1.0
    return out


def _wrong_op(names: set[str], counts: dict | None = None, error: Exception | None = None):
    """``operators.op`` with the kernels ``names`` made wrong (or raising ``error``); calls
    of each counted in ``counts``."""

    def op(name):
        real = operators.op(name)

        def call(*args):
            if counts is not None:
                counts[name] = counts.get(name, 0) + 1
            if name in names and error is not None:
                raise error
            out = real(*args)
            return _perturb(name, out, args) if name in names else out

        return call

    return op


def _model_grad(semiring):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Tanh(), torch.nn.Linear(20, 5))
    x = torch.randn(3, 12, requires_grad=True)
    with sa.patch(model, semiring):
        y = model(x)
    return sa.grad(y, x)


def _kernel_warnings(record, name: str):
    return [w for w in record if issubclass(w.category, RuntimeWarning) and name in str(w.message)]


def test_wrong_kernel_is_caught_once_and_the_formulas_take_over(monkeypatch):
    """check mode: one warning naming max_times_finite (MaxProduct's CPU matmul), the CPU
    and the dtype; the wrapper then declines, and MaxProduct's gradient equals the one with
    the kernels off."""
    monkeypatch.setenv(ENV, "off")
    expected = _model_grad(sa.MaxProduct())
    monkeypatch.setenv(ENV, "check")
    monkeypatch.setattr(kernels, "op", _wrong_op({"max_times_finite"}))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = _model_grad(sa.MaxProduct())
        a, b = torch.rand(2, 5, 7), torch.rand(2, 7, 9)
        assert kernels.max_times_finite(a, b) is None
    found = _kernel_warnings(record, "max_times_finite")
    assert len(found) == 1, [str(w.message) for w in record]
    message = str(found[0].message)
    assert f"max_times_finite on {checks.device_name(CPU)}, torch.float32" in message
    assert "failed its self-check (max_times_finite" in message
    assert "the torch formulas are used for it from now on" in message
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.warns(RuntimeWarning, match="max_times_finite on .*, torch.float64, failed"):
        assert kernels.max_times_finite(a.double(), b.double()) is None  # float64: its own check
    assert checks.failed(("max_times_finite", CPU, torch.float64))


def test_trust_uses_the_kernel_unchecked(monkeypatch):
    """trust mode: no check and no warning; the wrong kernel's values reach the gradient."""
    monkeypatch.setenv(ENV, "off")
    expected = _model_grad(sa.MaxProduct())
    monkeypatch.setenv(ENV, "trust")
    monkeypatch.setattr(kernels, "op", _wrong_op({"max_times_finite"}))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = _model_grad(sa.MaxProduct())
    assert not _kernel_warnings(record, "max_times_finite")
    assert not torch.equal(got, expected)


@pytest.mark.parametrize("value", ["off", "eager", " OFF "])
def test_off_and_eager_turn_the_kernels_off(monkeypatch, value):
    counts: dict = {}
    monkeypatch.setattr(kernels, "op", _wrong_op(set(), counts))
    monkeypatch.setenv(ENV, value)
    assert kernels.mode() == "off" and not kernels.enabled() and not kernels.available()
    assert kernels.max_times(torch.rand(2, 5, 7), torch.rand(2, 7, 9)) is None
    assert counts == {}


def test_unknown_mode_raises_on_use_not_on_import(monkeypatch):
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match=r"SEMIRING_AUTOGRAD_KERNELS='fast'.*off.*check.*trust"):
        kernels.max_times(torch.rand(2, 5, 7), torch.rand(2, 7, 9))
    child = subprocess.run(
        [sys.executable, "-c", "import semiring_autograd"],
        env={**os.environ, ENV: "fast"},
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stderr[-2000:]


def test_check_runs_once_per_kernel_device_and_dtype(monkeypatch):
    """The first call of max_times per dtype runs the check (several kernel calls), later
    calls only the kernel; four threads racing on a fresh kernel check it once."""
    counts: dict = {}
    monkeypatch.setattr(kernels, "op", _wrong_op(set(), counts))
    a, b = torch.rand(2, 5, 7), torch.rand(2, 7, 9)
    assert kernels.max_times(a, b) is not None
    in_check = counts["max_times"] - 1
    assert in_check > 0
    for _ in range(3):
        kernels.max_times(a, b)
    assert counts["max_times"] == in_check + 4
    kernels.max_times(a.double(), b.double())
    assert counts["max_times"] == 2 * in_check + 5
    checks.reset()
    counts.clear()
    threads = [threading.Thread(target=kernels.max_times, args=(a, b)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counts["max_times"] == in_check + 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", checks.NAMES)
def test_every_kernel_passes_its_check(name, dtype):
    assert checks.mismatch(name, CPU, dtype, operators.op(name)) is None


@pytest.mark.parametrize("name", checks.NAMES)
def test_every_check_sees_a_wrong_value(name):
    problem = checks.mismatch(name, CPU, torch.float32, _wrong_op({name})(name))
    assert problem is not None and problem.startswith(name), problem


def test_every_fused_kernel_has_a_check():
    assert set(checks.NAMES) == set(operators.SCHEMAS)


def test_a_kernel_that_raises_is_dropped_with_one_warning(monkeypatch):
    """A kernel raising in its check (check mode) or in a call (trust mode, the CUDA
    path's compile failure) is dropped for its (device, dtype) with one warning."""
    error = RuntimeError("no kernel image for this device")
    monkeypatch.setattr(kernels, "op", _wrong_op({"max_times"}, error=error))
    a, b = torch.rand(2, 5, 7), torch.rand(2, 7, 9)
    for mode in ("check", "trust"):
        checks.reset()
        monkeypatch.setenv(ENV, mode)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert kernels._cuda_call("max_times", a, b, 0.0, False) is None
            assert kernels._cuda_call("max_times", a, b, 0.0, False) is None
        found = _kernel_warnings(record, "max_times")
        assert len(found) == 1, [str(w.message) for w in record]
        assert "raised RuntimeError: no kernel image for this device" in str(found[0].message)


def test_the_check_runs_outside_dispatch_modes():
    """A mode active around the first call (a compiled backward's recorder) sees the
    kernel's call and none of the check's operators."""

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    a, b = torch.rand(2, 5, 7), torch.rand(2, 7, 9)
    with Seen() as seen:
        got = kernels.max_times(a, b)
    assert got is not None
    assert seen.ops == ["semiring_autograd.max_times.default"]


INTERPRETED = r"""
import importlib.util, os, sys, warnings
import torch
from semiring_autograd import kernels
from semiring_autograd.kernels import checks, operators

spec = importlib.util.spec_from_file_location("_tm", sys.argv[1])
tm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tm)
pad = operators._padded_result


def pair(a, w):
    return w.new_empty(a.shape[0], a.shape[1], w.shape[-1])


launchers = {
    "max_times": lambda a, b, i, s: tm.max_times(a, b, i, s, pad(a, b.shape[-1])),
    "signed_times": lambda ah, al, bh, bl: tm.signed_times(
        ah, al, bh, bl, pad(ah, bh.shape[-1]), pad(ah, bh.shape[-1])
    ),
    "lift_times": lambda ah, al, w, z: tm.lift_times(ah, al, w, z, pair(ah, w), pair(ah, w)),
}
# a GPU stand-in: the operands stay on the CPU, where the interpreter runs the kernels
checks._to = lambda x, device: [t.clone() for t in x] if isinstance(x, list) else (
    x.clone() if isinstance(x, torch.Tensor) else x
)
torch.cuda.get_device_name = lambda index=None: "Interpreted GPU"
gpu = torch.device("cuda", 0)
for dtype in (torch.float32, torch.float64):
    for name, launch in launchers.items():
        assert checks.verified(name, gpu, dtype, launch), (name, dtype)


def wrong(a, b, i, s):
    out = launchers["max_times"](a, b, i, s)
    out[0, 0, 0] += 1.0
    return out


checks.reset()
with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    assert not checks.verified("max_times", gpu, torch.float32, wrong)
    assert not checks.verified("max_times", gpu, torch.float32, wrong)
mine = [str(w.message) for w in record if "max_times" in str(w.message)]
assert len(mine) == 1, mine
print(mine[0])
"""


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_triton_kernels_pass_their_checks_in_the_interpreter():
    """The Triton matmuls (the CUDA kernels) in Triton's interpreter, on a stand-in GPU
    device: each passes its check in both dtypes; a wrong one is caught with one warning
    naming the GPU."""
    pytest.importorskip("triton")
    source = Path(kernels.__file__).with_name("triton_matmul.py")
    child = subprocess.run(
        [sys.executable, "-c", INTERPRETED, str(source)],
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore::RuntimeWarning"},
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-4000:]
    assert "max_times on cuda:0 (Interpreted GPU), torch.float32, failed its self-check" in (
        child.stdout
    )
