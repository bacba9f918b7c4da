"""Asynchronous interrupts: a ``KeyboardInterrupt`` landing at any point of a patch's entry,
the patched forward, the semiring backward or the patch's removal leaves the model (every
module's ``__dict__``, parameters), the thread (no torch-function mode, no running patch,
grad mode on) and ``torch.autograd.Function.apply`` exactly as they were, and an unrelated
forward and backward afterwards gives its usual gradients.

The interrupt is raised by a trace function at the N-th trace event where CPython can
deliver an asynchronous exception, for N over the events of one patched forward and
backward: every event inside the patch's own code, and a dense sample of the rest (torch,
the generated Functions, the primitives). A trace function can also raise where no
asynchronous exception lands: at the line event of a ``with`` statement's exit, between its
body and the call of ``__exit__`` (CPython polls for asynchronous exceptions only at calls,
function entries and backward jumps). Those events are skipped: raising there would leave a
lock held or grad mode off in torch's own code and this library's alike. So are the events
of a context manager's ``__enter__`` and ``__exit__`` outside this library (torch's,
contextlib's): an interrupt at their entry or return leaves their own state half-entered or
half-exited (torch.utils.checkpoint's saved-tensor hooks on the thread), which is theirs;
and the events of generators outside this library, which such context managers run their
entry and exit in (torch.utils.checkpoint's ``_checkpoint_without_reentrant_generator``
pushes its hooks, yields to the forward and pops them).

What no Python code can guard is the hand-over of the handle: an interrupt at the return of
``sa.patch``, in ``__enter__`` or at the entry of ``__exit__`` leaves the patch whole (every
module wrapped, the handle live); ``handle.remove()`` then gives the model back exactly.
"""

from __future__ import annotations

import dis
import functools
import gc
import sys
from dataclasses import dataclass
from inspect import CO_GENERATOR
from types import CodeType, FrameType
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import semiring_autograd as sa
from semiring_autograd.engine import patch as patch_module
from user_semirings import Tropical

pytestmark = [
    pytest.mark.filterwarnings("ignore:sa.patch. the custom autograd.Function _Double"),
    # an interrupt raised inside a finalizer (a generator closed, a weakref callback) is
    # swallowed by the interpreter, which reports it: the run goes on, as the test expects
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]
#: trace events that run through the patch's own code: each one gets an interrupt
OWN_FILES = ("engine/patch.py", "engine/custom_functions.py", "engine/checkpointing.py")
#: one in this many of the other events gets an interrupt
STRIDE = 40
#: after one in this many interrupts the model is patched again and an unrelated model run
FUNCTIONAL_STRIDE = 8
#: the functions where an interrupt may leave the patch whole: the hand-over of the handle
HAND_OVER = ("patch", "__enter__", "__exit__")


class _Double(torch.autograd.Function):
    """A custom Function: under a semiring patch it runs as its forward's ops, with
    ``Function.apply`` swapped while the patched forward runs."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x * 2.0

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g * 2.0


class _Block(nn.Module):
    """A linear layer, a custom Function, an in-place add and a checkpointed tanh (its
    recompute runs under the semiring, during backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.act = nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        h = _Double.apply(self.linear(x))
        h.add_(0.5)
        return checkpoint(self.act, h, use_reentrant=False)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_Block(), nn.Linear(3, 2)).double()


def _input() -> Tensor:
    return torch.linspace(-1.0, 1.0, 20, dtype=torch.float64).reshape(5, 4).requires_grad_()


def _patched_forward_backward(model: nn.Module, x: Tensor, semiring: sa.Semiring) -> Tensor:
    with sa.patch(model, semiring):
        y = model(x)
    return sa.grad(y.sum(), x)


def _plain_forward_backward() -> list[Tensor]:
    """The gradients of an unrelated, unpatched model (its custom Function's own backward)."""
    model, x = _model(), _input()
    model(x).sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


@functools.cache
def _instructions(code: CodeType) -> tuple[list[dis.Instruction], dict[int, int]]:
    instructions = list(dis.get_instructions(code))
    return instructions, {ins.offset: i for i, ins in enumerate(instructions)}


def _at_with_exit(frame: FrameType) -> bool:
    """Whether the line starting at ``frame.f_lasti`` begins a ``with`` statement's exit:
    ``__exit__(None, None, None)`` (after a ``return``'s value is set aside) or the handler
    that calls it with the exception."""
    instructions, index = _instructions(frame.f_code)
    i = index.get(frame.f_lasti)
    if i is None:
        return False
    window = instructions[i : i + 6]
    names = [ins.opname for ins in window]
    if "WITH_EXCEPT_START" in names[:2]:
        return True
    start = 1 if names[0] == "SWAP" else 0
    nones = window[start : start + 3]
    call = window[start + 3] if len(window) > start + 3 else None
    return (
        len(nones) == 3
        and all(ins.opname == "LOAD_CONST" and ins.argval is None for ins in nones)
        and call is not None
        and call.opname in ("PRECALL", "CALL")
        and call.arg == 2
    )


def _interrupt_point(frame: FrameType, event: str) -> bool:
    """Whether this trace event is one where the test interrupts (see the module
    docstring)."""
    code = frame.f_code
    foreign = "/semiring_autograd/" not in code.co_filename.replace("\\", "/")
    if foreign and (code.co_name in ("__enter__", "__exit__") or code.co_flags & CO_GENERATOR):
        return False
    return event in ("call", "return") or (event == "line" and not _at_with_exit(frame))


def _own(frame: FrameType) -> bool:
    return frame.f_code.co_filename.replace("\\", "/").endswith(OWN_FILES)


class _Events:
    """A trace function counting the interrupt points; with ``raise_at``
    it raises ``KeyboardInterrupt`` at that one (tracing then stops) and records where."""

    def __init__(self, raise_at: int | None = None) -> None:
        self.raise_at = raise_at
        self.count = 0
        self.own: list[int] = []
        self.landed: tuple[str, str, str] | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Callable | None:
        if not _interrupt_point(frame, event):
            return self
        self.count += 1
        if self.raise_at is None:
            if _own(frame):
                self.own.append(self.count)
            return self
        if self.count == self.raise_at:
            self.landed = (frame.f_code.co_filename, frame.f_code.co_name, event)
            raise KeyboardInterrupt(f"trace event {self.count}")
        return self


def _run_traced(events: _Events, fn: Callable[[], Any]) -> str | None:
    """``fn()`` under the trace function; how it ended when it raised ("KeyboardInterrupt"
    for the injected interrupt). The exception is dropped, and with its traceback the
    frames it held: a generator of torch's they suspended (torch.utils.checkpoint's
    saved-tensor hooks) is closed now, as it is when a user's traceback goes. The cyclic
    garbage collector is off meanwhile: its callbacks (a WeakKeyDictionary's, say) would add
    trace events where a collection happens to fall, and every run must count the same."""
    gc.disable()
    sys.settrace(events)
    try:
        fn()
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    except BaseException as exc:  # noqa: BLE001 - what the interrupt caused, reported
        return f"{type(exc).__name__}: {exc}"
    finally:
        sys.settrace(None)
        gc.enable()
    return None


@dataclass
class _State:
    """What the model and the thread were before a run."""

    dicts: list[tuple[nn.Module, dict]]
    parameters: list[tuple[nn.Module, dict]]
    values: list[Tensor]

    @classmethod
    def of(cls, model: nn.Module) -> "_State":
        return cls(
            [(m, dict(m.__dict__)) for m in model.modules()],
            [(m, dict(m._parameters)) for m in model.modules()],
            [p.detach().clone() for p in model.parameters()],
        )

    def problems(self, model: nn.Module) -> list[str]:
        """How the model, the thread and the process differ from this state."""
        found = _thread_problems()
        for m, before in self.dicts:
            now = m.__dict__
            if now.keys() != before.keys() or any(now[k] is not before[k] for k in before):
                found.append(f"{type(m).__name__}.__dict__ changed: {set(now) ^ set(before)}")
        for m, before in self.parameters:
            if any(m._parameters.get(k) is not p for k, p in before.items()):
                found.append(f"{type(m).__name__}'s parameters replaced")
        for p, v in zip(model.parameters(), self.values):
            if not torch.equal(p, v) or p.grad is not None:
                found.append("a parameter's value or .grad changed")
        if any(m in patch_module._PATCHED for m in model.modules()):
            found.append("the model is still recorded as patched")
        return found


def _thread_problems() -> list[str]:
    """How the thread and torch differ from their state outside any patched forward."""
    found = []
    if torch._C._len_torch_function_stack():
        found.append(f"{torch._C._len_torch_function_stack()} torch-function mode(s) left")
    if patch_module._running():
        found.append("a patch left running on the thread")
    if not torch.is_grad_enabled():
        found.append("grad mode left off")
    if torch.autograd.Function.__dict__["apply"] is not ORIGINAL_APPLY:
        found.append("torch.autograd.Function.apply left swapped")
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        found.append("saved-tensor hooks left on the thread")
    return found


def _whole_patch(model: nn.Module) -> "patch_module.PatchHandle | None":
    """The live handle whose wrappers are on every module, or None when any part is missing."""
    handle = getattr(model.__dict__.get("forward"), "__semiring_autograd_patch__", None)
    if handle is None or handle.removed or model not in patch_module._PATCHED:
        return None
    for m in model.modules():
        if getattr(m.__dict__.get("forward"), "__semiring_autograd_patch__", None) is not handle:
            return None
    return handle


def _landed(events: _Events, outcome: str | None, allowed: tuple[str, ...]) -> list[str]:
    """What is wrong with how a run ended: the interrupt must have been raised, and the run
    end with it, with an error in ``allowed``, or normally (an interrupt raised in a
    finalizer is swallowed)."""
    where = f"interrupt at event {events.raise_at} ({events.landed})"
    if events.landed is None:
        return [f"{where}: the run ended before the event ({outcome})"]
    if outcome is not None and outcome.partition(":")[0] not in ("KeyboardInterrupt",) + allowed:
        return [f"{where}: ended with {outcome}"]
    return []


def _check_after_interrupt(
    model: nn.Module, before: _State, events: _Events, outcome: str | None
) -> list[str]:
    """Every way the state after an interrupt at ``events.raise_at`` is wrong."""
    found = _landed(events, outcome, ())
    if found:
        return found
    where = f"interrupt at event {events.raise_at} ({events.landed})"
    handle = _whole_patch(model)
    if handle is not None:  # the hand-over of the handle: whole, and removable
        landed = events.landed
        if not (landed[0].endswith(OWN_FILES[0]) and landed[1] in HAND_OVER):
            found.append(f"{where}: the patch is left on the model")
        handle.remove()
    found += [f"{where}: {p}" for p in before.problems(model)]
    return found


def _interrupt_points(
    run: Callable[[Any], Any], prepare: Callable[[], Any], finish: Callable[[Any], Any]
) -> list[int]:
    """The events ``run(prepare())`` is interrupted at (``finish`` its result afterwards,
    untraced): every one in the patch's own code, one in :data:`STRIDE` of the rest
    (counted on a second run, the first warms caches). The runs interrupted afterwards
    must call ``run`` as ``lambda: run(prepared)`` does, one Python frame deep, so they
    count the same events."""
    for counting in (_Events(), _Events()):
        prepared = prepare()
        outcome = _run_traced(counting, lambda: run(prepared))
        finish(prepared)
        assert outcome is None, outcome
    assert counting.own, "the patch's own code is not traced"
    others = sorted(set(range(1, counting.count + 1)) - set(counting.own))
    return sorted(set(counting.own) | set(others[::STRIDE]))


@pytest.mark.parametrize(
    "semiring", [sa.MaxProduct(), sa.Real(), Tropical()], ids=["MaxProduct", "Real", "user"]
)
def test_an_interrupt_anywhere_leaves_model_thread_and_torch_as_they_were(semiring):
    """Patch entry, forward, backward and exit, ``with sa.patch(...)``."""
    x = _input()
    expected = _patched_forward_backward(_model(), x, semiring)
    plain = _plain_forward_backward()
    run = functools.partial(_patched_forward_backward, x=x, semiring=semiring)
    points = _interrupt_points(run, _model, lambda model: None)

    problems: list[str] = []
    for i, n in enumerate(points):
        model = _model()
        before = _State.of(model)
        events = _Events(raise_at=n)
        outcome = _run_traced(events, lambda: run(model))
        problems += _check_after_interrupt(model, before, events, outcome)
        if problems:
            break
        if i % FUNCTIONAL_STRIDE:
            continue
        again = _patched_forward_backward(model, x, semiring)
        torch.testing.assert_close(again, expected, rtol=0, atol=0)
        for got, want in zip(_plain_forward_backward(), plain):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not problems, "\n".join(problems[:5])


class _Fail(nn.Module):
    """The model's own error at the end of its forward."""

    def forward(self, x: Tensor) -> Tensor:
        raise ValueError("the model's own error")


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
@pytest.mark.parametrize("semiring", [sa.MaxProduct(), sa.Real()], ids=["MaxProduct", "Real"])
def test_an_interrupt_in_a_forward_under_a_kept_patch_leaves_the_thread_as_it_was(semiring, fails):
    """A handle kept across forwards: after an interrupted forward (one that returns, or
    raises its own error) and backward the thread is as it was while the patch stays whole,
    and the next forward under it records."""
    x = _input()
    expected = _patched_forward_backward(_model(), x, semiring)

    def forward_backward(kept: tuple) -> None:
        try:
            y = kept[0](x)
        except ValueError:
            if not fails:
                raise
            return
        sa.grad(y.sum(), x)

    def kept() -> tuple[nn.Module, _State, "patch_module.PatchHandle"]:
        model = _model()
        if fails:
            model.append(_Fail())
        before = _State.of(model)
        return model, before, sa.patch(model, semiring)

    problems: list[str] = []
    points = _interrupt_points(forward_backward, kept, lambda kept: kept[2].remove())
    for i, n in enumerate(points):
        model, before, handle = prepared = kept()
        events = _Events(raise_at=n)
        outcome = _run_traced(events, lambda: forward_backward(prepared))
        where = f"interrupt at event {n} ({events.landed})"
        problems += _landed(events, outcome, ())
        problems += [f"{where}: {p}" for p in _thread_problems()]
        if _whole_patch(model) is not handle:
            problems.append(f"{where}: the kept patch is no longer whole")
        if problems:
            break
        if not fails and i % FUNCTIONAL_STRIDE == 0:
            y = model(x)
            torch.testing.assert_close(sa.grad(y.sum(), x), expected, rtol=0, atol=0)
        handle.remove()
        problems += [f"{where}: {p}" for p in before.problems(model)]
    assert not problems, "\n".join(problems[:5])


def test_an_interrupt_in_a_refused_patch_leaves_both_models_as_they_were():
    """``sa.patch`` of a model whose submodule is patched is refused after the model was
    claimed: an interrupt anywhere in the refusal and its undo leaves the model unclaimed
    and the submodule's patch whole."""

    def refused() -> tuple[nn.Module, _State, "patch_module.PatchHandle"]:
        model = _model()
        inner = sa.patch(model[1], sa.MaxProduct())
        return model, _State.of(model), inner

    def attempt(refused: tuple) -> None:
        with pytest.raises(sa.PatchError, match="already patched"):
            sa.patch(refused[0], sa.MaxProduct())

    problems: list[str] = []
    for n in _interrupt_points(attempt, refused, lambda refused: refused[2].remove()):
        model, before, inner = prepared = refused()
        events = _Events(raise_at=n)
        outcome = _run_traced(events, lambda: attempt(prepared))
        where = f"interrupt at event {n} ({events.landed})"
        problems += _landed(events, outcome, ())
        problems += [f"{where}: {p}" for p in _thread_problems()]
        if _whole_patch(model[1]) is not inner or model in patch_module._PATCHED:
            problems.append(f"{where}: the submodule's patch is not whole, or the model claimed")
        problems += [f"{where}: {p}" for p in before.problems(model) if "recorded" not in p]
        inner.remove()
        if problems:
            break
    assert not problems, "\n".join(problems[:5])
