"""What keys a compiled program: each test changes one thing a captured program depends on
(the step, its ``read``, the module tree's modes, attributes and hooks, torch's grad mode,
autocast and default dtype) after the program was captured and checked, and asserts the
next call equals the eager run of the same call bit for bit (NaN where NaN); on a program
keyed without it, the replay of the old program differs. Then: a cold step called from two
threads at once, and random sequences of operations on a model and its steps, each call
against eager.

The oracle is the eager run (``sa.patch`` + ``sa.grad``), itself checked against
torch.autograd and path enumeration elsewhere (test_ops_oracle.py)."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import random
import threading
import warnings
import weakref
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import semiring_autograd as sa
from semiring_autograd.engine.compiled import backward as compiled_backward
from semiring_autograd.engine.compiled import program
from semiring_autograd.engine.compiled.signature import Identities
from semiring_autograd.engine.compiled.step import _model_state
from semiring_autograd.errors import SemiringAutogradError

SEMIRING = sa.MaxProduct()


@pytest.fixture(autouse=True)
def _fresh():
    compiled_backward.clear()
    with warnings.catch_warnings():
        # the eager fallbacks warn once per reason; every call is checked against eager
        warnings.simplefilter("ignore", RuntimeWarning)
        yield
    compiled_backward.clear()


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 3))
    return model.double().eval()


def _x(seed: int, dtype: torch.dtype = torch.float64) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, generator=gen, dtype=torch.float64).to(dtype)


def _eager(model: nn.Module, read: Callable, x: Tensor, semiring=SEMIRING) -> Tensor:
    x = x.detach().requires_grad_(True)
    with sa.patch(model, semiring):
        out = read(model, x)
    return sa.grad(out, x)


def _assert_identical(got: Tensor, expected: Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    same = (got == expected) | (torch.isnan(got) & torch.isnan(expected))
    assert bool(same.all()), (got - expected).abs().nan_to_num().max()


def _check(step, model: nn.Module, read: Callable, seed: int, semiring=SEMIRING) -> None:
    """``step`` on a new input equals the eager run of ``read`` (same seed for both)."""
    x = _x(seed)
    torch.manual_seed(seed)
    got = step(x.clone().requires_grad_(True))
    torch.manual_seed(seed)
    _assert_identical(got, _eager(model, read, x, semiring))


def _captured(step, model: nn.Module, read: Callable) -> None:
    """Three calls: a capture, the checked first replay, a replay of a checked program."""
    for seed in range(3):
        _check(step, model, read, seed)
    assert compiled_backward.stats()["replays"] >= 2, compiled_backward.stats()


def _column(k: int) -> Callable:
    return lambda m, x: m(x)[:, k].sum()


# ----- the step and its read ---------------------------------------------------------------
def test_a_new_step_never_replays_a_freed_steps_program():
    """Steps created and freed in a loop (a freed step's ``id()`` is taken by the next one)
    each replay their own read's program."""
    model = _model()
    reads = [_column(k) for k in range(3)]
    for i in range(12):
        read = reads[i % 3]
        step = sa.compiled_step(model, SEMIRING, read)
        for seed in range(3):
            _check(step, model, read, 10 * i + seed)
        del step  # freed at once (no cycle): the next step may take its id()


TARGET = 0


def _global_read(m: nn.Module, x: Tensor) -> Tensor:
    return m(x)[:, TARGET].sum()


def _set_target(k: int) -> None:
    global TARGET
    TARGET = k


def _read_with(how: str) -> tuple[Callable, Callable[[], None], Callable]:
    """A read, a change to what it computes that keeps the read object, and the read that
    computes the changed thing (for the eager run)."""
    if how == "closure cell":
        k = 0

        def read(m, x):
            return m(x)[:, k].sum()

        def change():
            nonlocal k
            k = 2

        return read, change, _column(2)
    if how == "global":
        _set_target(0)
        return _global_read, functools.partial(_set_target, 2), _column(2)
    if how == "default":
        read = lambda m, x, k=0: m(x)[:, k].sum()  # noqa: E731

        def change():
            read.__defaults__ = (2,)

        return read, change, _column(2)
    if how == "code":
        read = lambda m, x: m(x)[:, 0].sum()  # noqa: E731

        def change():
            read.__code__ = (lambda m, x: m(x)[:, 2].sum()).__code__

        return read, change, _column(2)
    assert how == "partial keyword"
    read = functools.partial(lambda m, x, k: m(x)[:, k].sum(), k=0)

    def change():
        read.keywords["k"] = 2

    return read, change, _column(2)


@pytest.mark.parametrize("how", ["closure cell", "global", "default", "code", "partial keyword"])
def test_a_read_changed_after_capture_runs_its_new_computation(how):
    """A read whose closure cell, global, default, code or partial's keyword changes after
    its program was captured and checked runs what it now computes."""
    model = _model()
    read, change, changed = _read_with(how)
    step = sa.compiled_step(model, SEMIRING, read)
    _captured(step, model, read)
    change()
    for seed in range(3, 5):
        _check(step, model, changed, seed)
    _set_target(0)


def test_a_read_that_keeps_what_it_computes_keeps_its_program():
    """A read whose closure, globals and defaults stay as they were replays its program: no
    capture per call (what the keys hold is what a read's result depends on, not more)."""
    model = _model()
    offset = torch.zeros(())  # a tensor in the closure, keyed by identity
    step = sa.compiled_step(model, SEMIRING, lambda m, x: (m(x)[:, 1] + offset).sum())
    _captured(step, model, lambda m, x: m(x)[:, 1].sum())
    stats = compiled_backward.stats()
    assert stats["captures"] == 1 and stats["replays"] == 2 and stats["eager"] == 0, stats


def test_a_steps_read_replaced_runs_the_new_read():
    model = _model()
    step = sa.compiled_step(model, SEMIRING, _column(0))
    _captured(step, model, _column(0))
    step.read = _column(2)
    _check(step, model, _column(2), 5)


# ----- the model: modes, attributes, modules, hooks ---------------------------------------
def test_train_mode_after_a_capture_in_eval_runs_dropout():
    """A program captured in eval mode (dropout the identity) is not replayed in train mode:
    the step runs dropout as eager does under the same seed."""
    model = _model()
    read = _column(1)
    step = sa.compiled_step(model, SEMIRING, read)
    _captured(step, model, read)
    model.train()
    for seed in range(3, 6):
        _check(step, model, read, seed)
    model.eval()
    _check(step, model, read, 6)


def test_a_submodule_in_train_mode_alone_runs_dropout():
    model = _model()
    read = _column(0)
    step = sa.compiled_step(model, SEMIRING, read)
    _captured(step, model, read)
    model[2].train()
    _check(step, model, read, 7)


def test_a_module_attribute_changed_after_capture():
    """A number the forward reads from a module (LeakyReLU's slope) is part of the key."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LeakyReLU(0.1), nn.Linear(6, 3)).double()
    read = _column(0)
    step = sa.compiled_step(model, SEMIRING, read)
    _captured(step, model, read)
    model[1].negative_slope = 0.5
    _check(step, model, read, 8)


def test_a_submodule_without_parameters_replaced():
    model = _model()
    read = _column(0)
    step = sa.compiled_step(model, SEMIRING, read)
    _captured(step, model, read)
    model[1] = nn.Sigmoid().eval()  # in the model's mode: only the module differs
    _check(step, model, read, 9)


def test_a_parameter_given_other_strides_after_capture():
    """The same weight values in a transposed layout (``.data`` replaced, same shape): a
    program reading the weight through its recorded strides is not replayed."""
    model = _model()
    read = _column(0)
    step = sa.compiled_step(model, SEMIRING, read)
    _captured(step, model, read)
    with torch.no_grad():
        model[0].weight.data = model[0].weight.data.t().contiguous().t()
    _check(step, model, read, 10)


class _Settings:
    """Settings a model holds and its forward reads, as a Hugging Face config."""

    def __init__(self) -> None:
        self.scale = 2.0


class _Scaled(nn.Module):
    def __init__(self, settings: _Settings) -> None:
        super().__init__()
        self.settings = settings
        self.linear = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * self.settings.scale


def test_a_setting_of_a_config_changed_after_capture():
    """A number in a settings object the forward reads (``config.scale``) is keyed by
    value: changed after capture, the step computes with the new one."""
    torch.manual_seed(0)
    model = _Scaled(_Settings()).double()
    read = _column(0)
    step = sa.compiled_step(model, SEMIRING, read)
    _captured(step, model, read)
    model.settings.scale = 3.0
    _check(step, model, read, 12)


def _scale_output(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
    return out * 3.0


def _scale_input(module: nn.Module, args: tuple) -> tuple:
    return (args[0] * 3.0,)


def _add_hook(model: nn.Module, kind: str):
    if kind == "forward":
        return model[1].register_forward_hook(_scale_output)
    if kind == "forward pre":
        return model[3].register_forward_pre_hook(_scale_input)
    assert kind == "global forward"
    return nn.modules.module.register_module_forward_hook(
        lambda m, a, out: out * 3.0 if isinstance(m, nn.Tanh) else None
    )


@pytest.mark.parametrize("kind", ["forward", "forward pre", "global forward"])
def test_a_hook_added_and_removed_after_capture(kind):
    """A forward hook that changes what a module computes runs once added, and not once
    removed (each a different program)."""
    model = _model()
    read = _column(0)
    step = sa.compiled_step(model, SEMIRING, read)
    _captured(step, model, read)
    handle = _add_hook(model, kind)
    try:
        for seed in range(3, 6):
            _check(step, model, read, seed)
    finally:
        handle.remove()
    for seed in range(6, 8):
        _check(step, model, read, seed)


# ----- torch's state ----------------------------------------------------------------------
def test_grad_mode_off_behaves_as_eager():
    """Under ``torch.no_grad()`` the forward records no graph: the step raises as the eager
    run raises, instead of replaying a program captured with grad on."""
    model = _model()
    read = _column(0)
    step = sa.compiled_step(model, SEMIRING, read)
    _captured(step, model, read)
    x = _x(3)
    with torch.no_grad(), pytest.raises(SemiringAutogradError, match="no node recorded"):
        _eager(model, read, x)
    with torch.no_grad(), pytest.raises(SemiringAutogradError, match="no node recorded"):
        step(x.clone().requires_grad_(True))


@pytest.mark.parametrize("semiring", [sa.MaxProduct(), sa.Log(), sa.Entropy()], ids=repr)
def test_a_step_under_autocast(semiring):
    """Captured without autocast, called under CPU autocast (bfloat16 matmuls): eager's
    values; captured under autocast, replayed under it: eager's values again."""
    model = _model().float()
    read = _column(0)
    step = sa.compiled_step(model, semiring, read)
    for seed in range(3):
        x = _x(seed, torch.float32)
        _assert_identical(step(x.clone().requires_grad_(True)), _eager(model, read, x, semiring))
    for seed in range(3, 6):
        x = _x(seed, torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = step(x.clone().requires_grad_(True))
            _assert_identical(got, _eager(model, read, x, semiring))


@pytest.mark.parametrize("semiring", [sa.MaxProduct(), sa.Log(), sa.Entropy()], ids=repr)
def test_a_backward_under_autocast(semiring):
    """``sa.grad(compile=True)``: a program captured without autocast is not replayed under
    it, and one captured under it replays what was recorded (no second cast)."""
    model = _model().float()

    def grads(x: Tensor, compile: bool, autocast: bool) -> Tensor:
        x = x.clone().requires_grad_(True)
        with sa.patch(model, semiring):
            y = model(x)[:, 0].sum()
        on = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with on:
            return sa.grad(y, x, compile=compile)

    for seed, autocast in [(0, False), (1, False), (2, False), (3, True), (4, True), (5, True)]:
        x = _x(seed, torch.float32)
        _assert_identical(grads(x, True, autocast), grads(x, False, autocast))


def test_the_default_dtype_changed_after_capture():
    """A tensor the read builds from Python numbers (``torch.tensor``) takes the default
    dtype: a program captured under float32 (holding that tensor) is not replayed under
    float16."""
    model = _model().float()
    read = lambda m, x: (m(x) * torch.tensor([0.1, 0.2, 0.3])).sum()  # noqa: E731
    step = sa.compiled_step(model, SEMIRING, read)
    for seed in range(4):
        x = _x(seed, torch.float32)
        if seed == 3:
            torch.set_default_dtype(torch.float16)
        try:
            got = step(x.clone().requires_grad_(True))
            _assert_identical(got, _eager(model, read, x))
        finally:
            torch.set_default_dtype(torch.float32)


# ----- threads ----------------------------------------------------------------------------
def _in_threads(work: Callable[[int], Any], count: int, prepare: Callable[[int], Any]) -> list:
    """``prepare(i)`` then ``work(i)`` in ``count`` threads, ``work`` started together in
    all; their results (exceptions re-raised here)."""
    results: list = [None] * count
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def run(i: int) -> None:
        try:
            prepare(i)
            barrier.wait()
            results[i] = work(i)
        except BaseException as exc:  # re-raised below, in the test's thread
            barrier.abort()
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("semiring", [sa.MaxProduct(), sa.Log()], ids=repr)
def test_a_cold_step_called_from_two_threads(semiring):
    """Two threads call a step no thread has called yet (a capture and a first replay race;
    each thread ran a backward before, so Log's programs write the capturing thread's
    scratch buffers), then keep calling it: every result is eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Linear(128, 3))
    copies = [copy.deepcopy(model) for _ in range(2)]  # each thread's own, for its warm-up
    read = _column(0)
    inputs = [[torch.randn(4, 32) for _ in range(6)] for _ in range(2)]
    for trial in range(8):
        step = sa.compiled_step(model, semiring, read)
        got = _in_threads(
            lambda i: [step(x.clone().requires_grad_(True)) for x in inputs[i]],
            count=2,
            prepare=lambda i: _eager(copies[i], read, inputs[i][0], semiring),
        )
        for i in range(2):
            for x, value in zip(inputs[i], got[i]):
                _assert_identical(value, _eager(model, read, x, semiring))


def test_a_cold_backward_captured_from_two_threads():
    """``sa.grad(compile=True)`` of one signature in two threads at once: one capture, and
    every result is eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 3))
    graphs = []
    for seed in range(4):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed)).requires_grad_()
        with sa.patch(model, sa.Log()):
            graphs.append((model(x)[:, 0].sum(), x))
    expected = [sa.grad(y, x, retain_graph=True) for y, x in graphs]
    got = _in_threads(
        lambda i: [sa.grad(y, x, compile=True, retain_graph=True) for y, x in graphs[i::2]],
        count=2,
        prepare=lambda i: None,
    )
    for i in range(2):
        for value, want in zip(got[i], expected[i::2]):
            _assert_identical(value, want)
    assert compiled_backward.stats()["captures"] == 1, compiled_backward.stats()


def test_the_key_of_a_patched_model_is_its_unpatched_key():
    """The ``forward`` wrappers a patch installs (another thread's capture or eager run) are
    not part of the key: computed while the model is patched, it equals the unpatched key
    (a module's own ``forward`` keyed as the function the wrapper wraps)."""
    model = _model()
    model[1].forward = lambda x: torch.tanh(x)
    ids = Identities()
    unpatched = _model_state(model, ids)[0]
    with sa.patch(model, SEMIRING):
        assert "forward" in model[0].__dict__
        patched = _model_state(model, ids)[0]
    assert patched == unpatched


def test_a_step_called_while_another_thread_holds_a_patch_replays():
    """A step called while another thread holds a patch on its model replays its program
    (no capture under a key that never occurs again)."""
    model = _model()
    read = _column(0)
    step = sa.compiled_step(model, SEMIRING, read)
    _captured(step, model, read)
    before = compiled_backward.stats()
    patched, release = threading.Event(), threading.Event()

    def hold() -> None:
        with sa.patch(model, SEMIRING):
            patched.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert patched.wait(30)
        x = _x(7)
        got = step(x.clone().requires_grad_(True))
    finally:
        release.set()
        holder.join()
    after = compiled_backward.stats()
    assert after["captures"] == before["captures"], after
    assert after["replays"] == before["replays"] + 1, after
    _assert_identical(got, _eager(model, read, x))


def test_a_programs_thread_copies_go_with_the_program(monkeypatch):
    """The copies of the capturing thread's scratch buffers that a replaying thread writes
    into are the program's: ``compiled_backward.clear()`` frees them while that thread lives."""
    made: list = []

    def recorded(t: Tensor) -> Tensor:
        copy = same_layout(t)
        made.append(weakref.ref(copy))
        return copy

    same_layout = program._same_layout
    monkeypatch.setattr(program, "_same_layout", recorded)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 3)).double()
    read = _column(0)
    _eager(copy.deepcopy(model), read, _x(0), sa.Log())  # this thread's scratch buffers
    step = sa.compiled_step(model, sa.Log(), read)
    for seed in range(3):
        _check(step, model, read, seed, sa.Log())
    replayed, cleared = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def replay() -> None:
        try:
            x = _x(5)
            _assert_identical(
                step(x.clone().requires_grad_(True)), _eager(model, read, x, sa.Log())
            )
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)
        replayed.set()
        cleared.wait(30)

    worker = threading.Thread(target=replay)
    worker.start()
    try:
        assert replayed.wait(30)
        if errors:
            raise errors[0]
        assert made, "the replaying thread made no copy of a scratch buffer"
        compiled_backward.clear()
        gc.collect()
        assert all(ref() is None for ref in made)
    finally:
        cleared.set()
        worker.join()


# ----- random sequences of operations ------------------------------------------------------
_READS = [_column(0), lambda m, x: m(x)[1].sum(), lambda m, x: (m(x) * m(x)).sum()]

_NAMES = [
    "create",
    "call",
    "call",
    "call",
    "train",
    "eval",
    "edit",
    "module",
    "parameter",
    "hook",
    "unhook",
    "delete",
]
_OPERATIONS = st.lists(
    st.tuples(st.sampled_from(_NAMES), st.integers(0, 2)),
    min_size=6,
    max_size=30,
)


class _World:
    """A model with dropout, its steps (each with one of ``_READS``) and forward hooks, and
    the operations a sequence applies to them."""

    def __init__(self) -> None:
        self.model = _model()
        self.steps: list[tuple[Any, Callable]] = []
        self.hooks: list = []
        self.calls = 0

    def apply(self, operation: str, arg: int) -> None:
        getattr(self, operation)(arg)

    def create(self, arg: int) -> None:
        """A new step; beyond two, the oldest is freed first (the new one may take its
        ``id()``)."""
        if len(self.steps) >= 2:
            del self.steps[0]
        self.steps.append((sa.compiled_step(self.model, SEMIRING, _READS[arg]), _READS[arg]))

    def call(self, arg: int) -> None:
        """Two calls of a step on new inputs (after a capture, the second replays a checked
        program)."""
        if not self.steps:
            self.create(arg)
        step, read = self.steps[arg % len(self.steps)]
        for _ in range(2):
            self.calls += 1
            _check(step, self.model, read, 1000 + self.calls)

    def train(self, arg: int) -> None:
        (self.model if arg == 0 else self.model[2]).train()

    def eval(self, arg: int) -> None:
        self.model.eval()

    def edit(self, arg: int) -> None:
        with torch.no_grad():
            self.model[0].weight.mul_(-1.5 if arg else 0.5)
            if arg == 2:
                self.model[3].bias[0] = float("nan")

    def module(self, arg: int) -> None:
        self.model[1] = [nn.Tanh, nn.Sigmoid, nn.ReLU][arg]().train(self.model.training)

    def parameter(self, arg: int) -> None:
        layer = self.model[3 * (arg % 2)]
        layer.weight = nn.Parameter(layer.weight.detach() + 0.25)

    def hook(self, arg: int) -> None:
        self.hooks.append(_add_hook(self.model, ["forward", "forward pre", "global forward"][arg]))

    def unhook(self, arg: int) -> None:
        if self.hooks:
            self.hooks.pop(arg % len(self.hooks)).remove()

    def delete(self, arg: int) -> None:
        if self.steps:
            del self.steps[arg % len(self.steps)]

    def close(self) -> None:
        for handle in self.hooks:
            handle.remove()


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(operations=_OPERATIONS)
def test_random_operations_against_eager(operations):
    """Any sequence of creating steps, switching train/eval, editing weights in place,
    replacing a submodule or a parameter, adding or removing hooks, deleting steps and
    calling them: every call equals eager under the same seed, bit for bit."""
    compiled_backward.clear()
    world = _World()
    try:
        for operation, arg in operations + [("call", 0)]:
            world.apply(operation, arg)
    finally:
        world.close()


def test_seeded_sequences_against_eager():
    """Many short random sequences of the same operations, each on a fresh model with no
    program captured (each order of changes gets its chance to come first), every call
    against eager."""
    for seed in range(40):
        compiled_backward.clear()
        rng = random.Random(seed)
        world = _World()
        try:
            for _ in range(20):
                world.apply(rng.choice(_NAMES), rng.randrange(3))
        finally:
            world.close()
