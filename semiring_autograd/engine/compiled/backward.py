"""``sa.grad(..., compile=True)``: the semiring backward as a captured program.

The first call for a graph signature runs the backward eagerly under a dispatch mode that
records every aten and ``semiring_autograd`` operator it runs on plain tensors (the
components inside messages included). The second call turns the record into one
straight-line Python function (``rewrite.py`` first drops what a replay need not run): the
operators in order, each a direct call, with ``del`` after a value's last use; so a
signature called once costs no build. Later calls with the same signature run that function on the new graph's saved tensors
and seeds: no autograd engine, no generated backward, no message wrapping, no per-node
Python.

The signature (``signature.py``) says which graphs one program serves: the graph's
structure, each node's non-tensor state (op arguments, shapes), the metadata of the tensors
it saved and of the seeds, and torch's state an operator reads besides its arguments (the
default dtype, deterministic algorithms, autocast, the active torch function and dispatch
modes: ``signature.context``). A program replays the operators as recorded (after
autocast's casts: autocast is off during a replay). The recorder and the program
(``program.py``) are shared with ``sa.compiled_step`` (``step.py``), which records
the patched forward too, and keys its programs by the step, its ``read`` and the model's
state as well. This module holds the programs per signature: it captures, checks a
program's first replay, replays, and runs eagerly where it must.

**Threads.** One capture per signature runs at a time: a thread that finds another one
capturing waits, then replays what was captured. Programs replay side by side in several
threads: a scratch buffer of the capturing thread that a program writes into is, in any
other thread, that thread's own buffer of the same layout (``program.py``).

**Exact or not at all.** Python in the backward that reads tensor data (``bool(t)``,
``t.item()``: an operator returning a number) or an operator whose result shape depends on
data (``nonzero``, boolean indexing) becomes a guard: replay recomputes it and compares
with the recorded value or shape; on a mismatch the call runs eagerly and is captured again
as a variant of the signature (at most ``MAX_VARIANTS``). The first replay of a program is
checked against the eager backward of the same call (every result bit-identical, NaN where
NaN); a program that disagrees is dropped and the signature runs eagerly from then on, with
one warning. A backward that mutates a saved tensor, reads a tensor requiring grad from
outside it (a checkpointed region recomputed reads the model's parameters), draws random
numbers, holds state the signature cannot
describe, or runs with hooks that must see messages (``trace``) is not captured: eager,
with one warning saying why.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ...ops.message import Message
from .program import Constant, GuardFailure, Program, Recorder, gc_paused
from .signature import ProgramKey, Uncapturable, context, signature

#: captured programs kept per signature (data-dependent branches taken differently)
MAX_VARIANTS = 4
#: signatures kept (least recently used dropped)
MAX_SIGNATURES = 64


_CACHE: OrderedDict[ProgramKey, "Captured"] = OrderedDict()
#: guards the cache and the program lists (sa.grad may run in several threads)
_LOCK = threading.Lock()
_COUNTS = {"captures": 0, "replays": 0, "eager": 0}
#: compiled steps the library makes for its own callers (``sa.attribute`` keeps one per
#: model, semiring, target and position for its next text), most recently used last, at
#: most MAX_OWN_STEPS; cleared with the programs
OWN_STEPS: OrderedDict[Any, Any] = OrderedDict()
MAX_OWN_STEPS = 16
#: this many calls in a row, each with a signature never seen, stop capturing new ones
NEW_SIGNATURE_LIMIT = 8
_new_in_a_row = 0
_WARNED: set[str] = set()


def refuse(reason: str) -> None:
    """Count a compile=True call that runs eagerly, and warn why (once per reason)."""
    _COUNTS["eager"] += 1
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(
            f"sa.grad(compile=True): running the eager backward ({reason})",
            RuntimeWarning,
            stacklevel=3,
        )


def clear() -> None:
    """Forget every captured program (and the library's own compiled steps), the counts and
    the warnings given."""
    global _new_in_a_row
    with _LOCK:
        _CACHE.clear()
        OWN_STEPS.clear()
    _COUNTS.update(dict.fromkeys(_COUNTS, 0))
    _WARNED.clear()
    _new_in_a_row = 0


def stats() -> dict[str, int]:
    """Signatures and programs held (``built``: those built, on their first replay;
    ``steps``: the operators of the built ones), and how many compile=True calls captured a
    program, replayed one, or ran eagerly. Builds nothing."""
    with _LOCK:
        programs = [p for c in _CACHE.values() for p in c.programs]
    built = [p.built for p in programs]
    return {
        "signatures": len(_CACHE),
        "programs": len(programs),
        "built": sum(b is not None for b in built),
        "steps": sum(b[2] for b in built if b is not None),
        **_COUNTS,
    }


class Captured:
    """The programs of one signature: replayed when their guards hold, the first replay of
    each checked against eager; a new variant captured when none holds (one capture at a
    time: a thread that finds another capturing waits, then replays what it captured); or,
    once refused, the reason it runs eagerly."""

    def __init__(self) -> None:
        self.programs: list[Program] = []
        self.refused: str | None = None
        self.capturing = threading.Lock()

    def call(
        self,
        slots: list[Tensor],
        eager: Callable[[bool], Sequence[Any]],
        retain_graph: bool,
        parameters: frozenset[int] = frozenset(),
    ) -> Sequence[Any]:
        found = self._replay(slots, eager, retain_graph)
        if found is not None:
            return found
        with self.capturing:
            found = self._replay(slots, eager, retain_graph)  # captured meanwhile?
            if found is not None:
                return found
            return self._capture(slots, eager, retain_graph, parameters)

    def _replay(
        self, slots: list[Tensor], eager: Callable[[bool], Sequence[Any]], retain_graph: bool
    ) -> Sequence[Any] | None:
        """The results of the first program whose guards hold (of eager where refused, or
        on the first replay, which is checked against it); None where none holds."""
        if self.refused is not None:
            _COUNTS["eager"] += 1
            return eager(retain_graph)
        for program in list(self.programs):
            try:
                values = program.replay(slots)
            except GuardFailure:
                continue
            results = _assemble(program.results, values)
            if program.verified:
                _COUNTS["replays"] += 1
                return results
            expected = eager(retain_graph)
            if all(_identical(r, e) for r, e in zip(results, expected)):
                program.verified = True
                _COUNTS["replays"] += 1
            else:
                with _LOCK:
                    self.programs.clear()
                    self.refused = "its captured program disagreed with the eager run"
                refuse(self.refused)
            return expected
        return None

    def _capture(
        self,
        slots: list[Tensor],
        eager: Callable[[bool], Sequence[Any]],
        retain_graph: bool,
        parameters: frozenset[int],
    ) -> Sequence[Any]:
        """Eager's results, recorded as a new program of this signature where it can be."""
        if len(self.programs) >= MAX_VARIANTS:
            refuse(
                f"the data read in the computation took more than {MAX_VARIANTS} branches for "
                "one signature"
            )
            return eager(retain_graph)
        recorder = Recorder(slots, parameters)
        try:
            with gc_paused():
                with recorder:
                    results = eager(True)  # a failed capture must be able to run again
                layout = [_result_refs(recorder, r) for r in results]
                program = Program(recorder, layout, len(slots))
        except Uncapturable as exc:
            self.refused = str(exc)
            refuse(self.refused)
            return eager(retain_graph)
        with _LOCK:
            self.programs.append(program)
        _COUNTS["captures"] += 1
        return results


def programs_for(key: ProgramKey) -> Captured | None:
    """The programs of ``key`` (new when unseen), or None when new signatures are no longer
    captured (``NEW_SIGNATURE_LIMIT`` new ones in a row)."""
    global _new_in_a_row
    with _LOCK:
        captured = _CACHE.get(key)
        if captured is None and _new_in_a_row < NEW_SIGNATURE_LIMIT:
            _new_in_a_row += 1
            captured = _CACHE[key] = Captured()
            while len(_CACHE) > MAX_SIGNATURES:
                _CACHE.popitem(last=False)
        elif captured is not None:
            _new_in_a_row = 0
            _CACHE.move_to_end(key)
    if captured is None:
        refuse(
            f"the signature changed on each of {NEW_SIGNATURE_LIMIT} calls in a row (shapes "
            "that change every call? a new compiled step, or a read whose closure or globals "
            "change, each call?): new signatures are not captured"
        )
        return None
    return captured


def run_backward(
    outputs: Sequence[Tensor],
    inputs: Sequence[Tensor],
    grad_outputs: Sequence[Any],
    eager: Callable[[bool], Sequence[Any]],
    retain_graph: bool,
    traced: bool = False,
) -> Sequence[Any]:
    """The results of ``eager(retain_graph)`` (a backward through PyTorch's engine), from
    a captured program where one exists for this graph's signature; eager when ``traced``
    (``sa.trace`` reports each node as it runs)."""
    if traced:
        refuse("sa.trace reports each node as it runs")
        return eager(retain_graph)
    try:
        parts, slots = signature(outputs, inputs, grad_outputs)
    except Uncapturable as exc:
        refuse(str(exc))
        return eager(retain_graph)
    programs = programs_for(ProgramKey(("backward", parts, context())))
    if programs is None:
        return eager(retain_graph)
    return programs.call(slots, eager, retain_graph)


def _result_refs(recorder: Recorder, result: Any) -> Any:
    if result is None:
        return None
    if isinstance(result, Message):
        refs = [recorder.ref(c) for c in result.value]
        meta = (result.semiring, result.shape, result.dtype, result.device)
        found = ("message", refs, meta)
    else:
        refs = [recorder.ref(result)]
        found = ("plain", refs[0])
    if any(isinstance(r, Constant) for r in refs):
        raise Uncapturable("a result is a tensor from outside the captured computation")
    return found


def _assemble(layout: list, values: tuple) -> list:
    results = []
    for spec, value in zip(layout, values):
        if spec is None:
            results.append(None)
        elif spec[0] == "plain":
            results.append(value)
        else:
            semiring, shape, dtype, device = spec[2]
            message = Message.__new__(Message, semiring, value, shape, dtype, device)
            results.append(message)
    return results


def _identical(got: Any, expected: Any) -> bool:
    if got is None or expected is None:
        return got is None and expected is None
    a = got.value if isinstance(got, Message) else (got,)
    b = expected.value if isinstance(expected, Message) else (expected,)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


def _equal(x: Tensor, y: Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.is_floating_point():
        return bool(((x == y) | (torch.isnan(x) & torch.isnan(y))).all())
    return torch.equal(x, y)
