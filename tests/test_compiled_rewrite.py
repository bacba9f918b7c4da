"""The rewrites of a recorded program (``engine/compiled/rewrite.py``) and its guards checked
in batches: each rewrite leaves fewer operators where it applies, and a replay on new
inputs equals the same function run eagerly on them bit for bit; where a rewrite must not
apply (a value read again, a buffer filled in part, a tensor written or returned), the
replay still equals eager, which it would not if the rewrite applied."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from torch import Tensor, nn

import semiring_autograd as sa
from semiring_autograd.engine.compiled import backward as compiled
from semiring_autograd.engine.compiled.program import (
    GuardFailure,
    Program,
    Recorder,
    _fast_binding,
)
from semiring_autograd.kernels.workspace import scratch

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _fresh():
    compiled.clear()
    yield
    compiled.clear()


def _record(fn, *inputs: Tensor) -> Program:
    """The program of ``fn(*inputs)`` (one tensor result), captured on ``inputs``."""
    recorder = Recorder(list(inputs))
    with recorder:
        out = fn(*inputs)
    return Program(recorder, [("plain", recorder.ref(out))], len(inputs))


def _calls(program: Program, op) -> int:
    """How many times the program's source calls ``op``."""
    names = [k for k, v in program.run.__globals__.items() if v is _fast_binding(op)]
    return sum(len(re.findall(rf"\b{name}\(", program.source)) for name in names)


def _replay(program: Program, fn, *inputs: Tensor) -> Tensor:
    """The replay on ``inputs``, asserted identical to ``fn(*inputs)`` run eagerly."""
    (got,) = program.replay(list(inputs))
    expected = fn(*inputs)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.equal(got, expected)
    return got


def _randn(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_an_identity_operator_is_no_step():
    def f(x):
        return x * torch.tensor(2.0)

    program = _record(f, _randn(3))
    assert _calls(program, aten.lift_fresh.default) == 0
    _replay(program, f, _randn(3, seed=1))


def test_a_view_taken_twice_is_taken_once():
    def f(x):
        return x.t() * 2 + x.t()

    program = _record(f, _randn(3, 4))
    assert _calls(program, aten.t.default) == 0  # views are as_strided
    assert _calls(program, aten.as_strided.default) == 1
    _replay(program, f, _randn(3, 4, seed=1))


def test_views_whose_shape_changes_in_place_are_kept_apart():
    """``b.t_()`` changes ``b`` alone: ``a`` (the same view before it) is still ``x.t()``."""

    def f(x):
        y = x * 1
        a, b = y.t(), y.t()
        b.t_()
        return a * 1 + b

    program = _record(f, _randn(3, 3))
    assert _calls(program, aten.as_strided.default) == 2
    _replay(program, f, _randn(3, 3, seed=1))


def test_a_fresh_buffer_filled_from_a_fresh_value_is_that_value():
    def f(x):
        return x.new_empty((3, 4)).copy_(x * 2) + 1

    program = _record(f, _randn(3, 4))
    assert _calls(program, aten.copy_.default) == 0
    assert _calls(program, aten.new_empty.default) == 0
    _replay(program, f, _randn(3, 4, seed=1))


def test_a_copy_of_a_value_read_again_stays_a_copy():
    """Were the buffer the value, ``add_`` would change the value read after it (the copy
    stays, as a ``clone``)."""

    def f(x):
        z = x * 2
        b = x.new_empty((3, 4)).copy_(z)
        b.add_(1)
        return b + z

    program = _record(f, _randn(3, 4))
    assert _calls(program, aten.copy_.default) + _calls(program, aten.clone.default) == 1
    _replay(program, f, _randn(3, 4, seed=1))


def test_a_new_buffer_filled_by_a_copy_is_a_clone():
    def f(x):
        return torch.zeros(4, 3).copy_(x.t()) * 2

    program = _record(f, _randn(3, 4))
    assert _calls(program, aten.copy_.default) == 0
    assert _calls(program, aten.zeros.default) == 0
    assert _calls(program, aten.clone.default) == 1
    _replay(program, f, _randn(3, 4, seed=1))


def _read_before_the_copy(x):
    b = torch.zeros(3, 4)
    before = b * 1
    b.copy_(x)
    return b + before


@pytest.mark.parametrize(
    "f, shape",
    [
        (lambda r: torch.zeros(3, 4).copy_(r) * 2, (4,)),  # broadcast: a clone is (4,)
        (lambda x: torch.zeros(4, 4).index_fill_(0, torch.tensor([0]), 1.0) + x, (4, 4)),
        (_read_before_the_copy, (3, 4)),
    ],
    ids=["broadcast", "written-elsewhere", "read-before"],
)
def test_a_copy_that_fills_a_buffer_otherwise_stays(f, shape):
    program = _record(f, _randn(*shape))
    _replay(program, f, _randn(*shape, seed=1))


def _rotate_half_backward(g):
    """The rotary embedding's backward pads each half of a gradient with its other half's
    zeros, then adds the two."""
    low, high = g.split([2, 2], -1)
    a = torch.full((3, 4), -1.5)
    a[..., 2:].copy_(low * -1)
    b = torch.full((3, 4), -1.5)
    b[..., :2].copy_(high)
    return a + b


@pytest.mark.parametrize(
    "f, shape",
    [
        (lambda x: _copied_into(torch.zeros(4, 4), slice(0, 2), x) * 2, (2, 4)),
        (lambda x: _copied_into(torch.ones(2, 5, 3), (slice(None), slice(1, 3)), x) * 1, (2, 2, 3)),
        (_rotate_half_backward, (3, 4)),
    ],
    ids=["rows", "middle", "rotate-half"],
)
def test_a_buffer_filled_in_part_is_one_cat(f, shape):
    program = _record(f, _randn(*shape))
    for op in (aten.copy_.default, aten.zeros.default, aten.ones.default, aten.full.default):
        assert _calls(program, op) == 0, op
    assert _calls(program, aten.cat.default) >= 1
    for seed in (1, 2):
        got = _replay(program, f, _randn(*shape, seed=seed))
        assert got.stride() == f(_randn(*shape, seed=seed)).stride()


def _copied_into(buffer, part, x):
    buffer[part].copy_(x)
    return buffer


def _read_before(x):
    b = torch.zeros(4, 4)
    before = b.sum()
    b[:2].copy_(x)
    return b * before


def _view_read_again(x):
    b = torch.zeros(4, 4)
    part = b[:2]
    part.copy_(x)
    return b + part.sum()


def _view_taken_again(x):
    b = torch.zeros(4, 4)
    b[:2].copy_(x)
    return b * b[:2].sum()


def _read_between_view_and_copy(x):
    b = torch.zeros(4, 4)
    part = b[:2]
    total = b.sum()
    part.copy_(x)
    return b * total


def _misaligned(x):
    b = torch.zeros(4, 4)
    b.as_strided((2, 4), (4, 1), 1).copy_(x)
    return b * 1


def _copy_read(x):
    b = torch.zeros(4, 4)
    return b[:2].copy_(x) * 1 + b[2:]


@pytest.mark.parametrize(
    "f, shape, copies",
    [
        (_read_before, (2, 4), 1),
        (_view_read_again, (2, 4), 1),
        (_view_taken_again, (2, 4), 1),
        (_read_between_view_and_copy, (2, 4), 1),
        (_copy_read, (2, 4), 1),
        (lambda r: _copied_into(torch.zeros(4, 4), slice(0, 2), r) * 1, (4,), 1),  # broadcast
        (lambda x: _copied_into(torch.zeros(4, 4), (slice(0, 2), slice(0, 2)), x) * 1, (2, 2), 1),
        (lambda x: _copied_into(torch.zeros(4, 4), (slice(None), slice(0, 4, 2)), x), (4, 2), 1),
        (lambda x: _copied_into(torch.zeros(4, 4, dtype=torch.float64), slice(0, 2), x), (2, 4), 1),
        (_misaligned, (2, 4), 1),
    ],
    ids=[
        "read-before",
        "view-read-again",
        "view-taken-again",
        "read-between",
        "copy-read",
        "broadcast",
        "two-dims",
        "stepped",
        "dtype",
        "misaligned",
    ],
)
def test_a_buffer_filled_in_part_otherwise_stays(f, shape, copies):
    program = _record(f, _randn(*shape))
    assert _calls(program, aten.copy_.default) == copies
    for seed in (1, 2):
        _replay(program, f, _randn(*shape, seed=seed))


def test_tensors_made_from_numbers_are_made_once():
    def f(x):
        return x * torch.full((3, 4), 2.0) + torch.ones(4).expand(3, 4)

    program = _record(f, _randn(3, 4))
    for op in (aten.full.default, aten.ones.default, aten.expand.default):
        assert _calls(program, op) == 0, op
    _replay(program, f, _randn(3, 4, seed=1))


def _written_directly(x):
    z = torch.zeros(3, 4)
    z.add_(x)
    return z * 1


def _written_through_a_view(x):
    z = torch.zeros(3, 4)
    z.t().add_(x.t())
    return z * 1


@pytest.mark.parametrize("f", [_written_directly, _written_through_a_view], ids=["direct", "view"])
def test_a_tensor_made_from_numbers_and_written_is_made_on_every_replay(f):
    """Made once, the tensor would keep what each replay added to it."""
    program = _record(f, _randn(3, 4))
    assert _calls(program, aten.zeros.default) == 1
    for seed in (1, 2):
        _replay(program, f, _randn(3, 4, seed=seed))


def test_a_returned_tensor_made_from_numbers_is_new_on_every_replay():
    def f(x):
        return torch.ones(3) if bool((x > -10).all()) else x

    program = _record(f, _randn(3))
    (first,) = program.replay([_randn(3, seed=1)])
    first.add_(1)
    (second,) = program.replay([_randn(3, seed=2)])
    assert torch.equal(second, torch.ones(3))


def _branch(x):
    return x * 2 if bool((x > 0).all()) else x * 3


def test_bool_guards_are_checked_in_one_batch():
    program = _record(_branch, _randn(4).abs())
    assert _calls(program, aten._local_scalar_dense.default) == 0
    assert "_hold(" in program.source
    _replay(program, _branch, _randn(4, seed=1).abs())
    with pytest.raises(GuardFailure):
        program.replay([-_randn(4, seed=1).abs()])


def test_an_operator_failing_after_a_failed_guard_is_that_guard_failure():
    """``y[i]`` with ``i`` out of range raises in a replay whose deferred guard (``i < 3``)
    fails: the replay reports the guard."""

    def f(x, y):
        i = (x * 3).long()
        return y[i] * 2 if bool((i < 3).all()) else y.sum()

    program = _record(f, torch.rand(5), torch.randn(3))
    with pytest.raises(GuardFailure):
        program.replay([torch.full((5,), 5.0), torch.randn(3)])


def test_guards_are_checked_before_a_write_into_a_tensor_from_outside():
    """A replay whose guard fails leaves the tensors it does not own as they were."""
    counter = torch.zeros(3)

    def f(x):
        if bool((x > 0).all()):
            counter.add_(1)
        return x * 2

    program = _record(f, _randn(3).abs())
    before = counter.clone()
    with pytest.raises(GuardFailure):
        program.replay([-_randn(3, seed=1).abs()])
    assert torch.equal(counter, before)


def test_a_program_is_built_on_its_first_replay():
    """The capturing call only records; the next call (the checked first replay) builds."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).eval()
    step = sa.compiled_step(model, sa.MaxProduct(), lambda m, x: m(x)[:, 0].sum())
    x = torch.randn(3, 4, requires_grad=True)
    first = step(x)
    (captured,) = compiled._CACHE.values()
    assert captured.programs[0].built is None
    second = step(x)
    assert captured.programs[0].built is not None
    assert torch.equal(first, second)


# ----- what _escaping reads of an aliasing operator --------------------------------------
_LIBRARY = torch.library.Library("sa_test_compiled_rewrite", "DEF")
_LIBRARY.define("second(Tensor x, Tensor(a) y) -> Tensor(a)")
_LIBRARY.impl("second", lambda x, y: torch.ops.aten.alias(y), "CompositeExplicitAutograd")


def test_a_tensor_made_from_numbers_that_a_result_aliases_is_made_on_every_replay():
    """``second(x, z)`` returns a view of its *second* argument (its schema says so): the
    ``add_`` through that view writes ``z``, which must be made anew on every replay (made
    once, it would keep what each replay added)."""

    def f(x):
        z = torch.zeros(3)
        torch.ops.sa_test_compiled_rewrite.second(x, z).add_(x)
        return z * 1

    program = _record(f, _randn(3))
    assert _calls(program, aten.zeros.default) == 1
    for seed in (1, 2):
        _replay(program, f, _randn(3, seed=seed))


def test_a_tensor_made_from_numbers_read_by_an_out_operator_is_made_once():
    """``abs(k, out=b)`` aliases and writes ``b``, not ``k``: ``k`` is made once."""

    def f(x):
        b = x.new_empty(3)
        torch.abs(torch.full((3,), -2.0), out=b)
        return b + x

    program = _record(f, _randn(3))
    assert _calls(program, aten.full.default) == 0
    for seed in (1, 2):
        _replay(program, f, _randn(3, seed=seed))


# ----- views of constants -----------------------------------------------------------------
def test_views_of_a_constant_are_taken_once_and_see_its_writes():
    w = _randn(4, 3)

    def f(x):
        return x @ w.t() + w.t()[0]

    program = _record(f, _randn(2, 3))
    assert _calls(program, aten.as_strided.default) == 0
    _replay(program, f, _randn(2, 3, seed=1))
    w.mul_(-2)  # in place: the views held see it
    _replay(program, f, _randn(2, 3, seed=2))


def test_views_of_an_input_are_taken_on_every_replay():
    w = _randn(3, 3)

    def f(x):
        return x.t() * 2 + w.t()

    program = _record(f, _randn(3, 3))
    assert _calls(program, aten.as_strided.default) == 1  # x.t(); w.t() is held
    for seed in (1, 2):  # each input at another storage (of the recorded layout)
        _replay(program, f, _randn(3, 3, seed=seed))


def test_views_of_a_parameter_whose_data_is_set_are_taken_anew():
    w = nn.Parameter(_randn(4, 3))

    def f(x):
        return x @ w.t()

    x = _randn(2, 3)
    recorder = Recorder([x], parameters=frozenset({id(w)}))
    with recorder, torch.no_grad():
        out = f(x)
    program = Program(recorder, [("plain", recorder.ref(out))], 1)
    assert _calls(program, aten.as_strided.default) == 0
    with torch.no_grad():
        _replay(program, f, _randn(2, 3, seed=1))
        for seed in (2, 3):
            w.data = _randn(4, 3, seed=seed)  # new storage: the held view would be stale
            _replay(program, f, _randn(2, 3, seed=seed))


def test_a_compiled_step_sees_a_parameter_set_or_replaced():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).eval()

    def read(m, x):
        return m(x)[:, 0].sum()

    def eager(x):
        with sa.patch(model, sa.MaxProduct()):
            return sa.grad(read(model, x), x)

    step = sa.compiled_step(model, sa.MaxProduct(), read)
    x = torch.randn(5, 3, requires_grad=True)
    step(x), step(x)  # captured, then checked
    model[0].weight.data = torch.randn(4, 3)
    assert torch.equal(step(x), eager(x))
    model[0].weight = nn.Parameter(torch.randn(4, 3))
    step(x)
    assert torch.equal(step(x), eager(x))
    assert compiled.stats()["eager"] == 0


def test_a_view_of_an_empty_storage_is_taken_on_every_replay():
    """Storage of no bytes has no address of its own: a view of it, taken once, would keep
    the dtype the constant had."""
    c = torch.empty(0)

    def f(x):
        return x + c[:0]

    x = torch.empty(0, dtype=torch.float16)
    program = _record(f, x)
    _replay(program, f, x)
    c.data = torch.empty(0, dtype=torch.float64)
    _replay(program, f, x)


def test_an_empty_constant_is_not_taken_for_an_empty_value():
    """Two tensors on storage of no bytes share the address 0: the constant ``k`` is read as
    itself, not as the input of its shape and dtype (whose replay would keep float32 after
    ``k`` became float64)."""
    k = torch.empty(0)

    def f(x):
        return x + k

    x = torch.empty(0)
    program = _record(f, x)
    _replay(program, f, x)
    k.data = torch.empty(0, dtype=torch.float64)
    _replay(program, f, x)


def test_a_returned_view_of_a_constant_is_new_on_every_replay():
    w = _randn(3, 4)

    def f(x):
        return w.t() if bool((x > -10).all()) else x

    program = _record(f, _randn(4, 3))
    (first,) = program.replay([_randn(4, 3, seed=1)])
    first.t_()
    _replay(program, f, _randn(4, 3, seed=2))


def test_views_of_a_constant_in_a_program_that_reshapes_in_place_are_taken_each_replay():
    """``v.t_()`` changes the view itself: taken once, it would be transposed again on each
    replay."""
    c = _randn(4, 3)

    def f(x):
        v = c.t()
        v.t_()
        return x * v

    program = _record(f, _randn(4, 3))
    for seed in (1, 2):
        _replay(program, f, _randn(4, 3, seed=seed))


def test_a_view_of_a_constant_given_as_out_of_its_shape_is_taken_once():
    c = torch.zeros(6)

    def f(x):
        return torch.abs(x, out=c[1:4]) * 2

    program = _record(f, _randn(3))
    assert _calls(program, aten.as_strided.default) == 0
    for seed in (1, 2):
        _replay(program, f, _randn(3, seed=seed))


def test_a_view_of_a_constant_an_out_resizes_is_taken_each_replay():
    """``add(x, 1, out=v)`` resizes the empty view ``v`` to ``x``'s shape: taken once, ``v``
    would have that shape when read before the ``add`` on the next replay."""
    c = torch.zeros(6)

    def f(x):
        v = c[:0]
        before = v.sum()
        torch.add(x, 1, out=v)
        return v * 1 + before

    program = _record(f, _randn(3))
    for seed in (1, 2):
        _replay(program, f, _randn(3, seed=seed))


def test_stats_builds_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).eval()
    step = sa.compiled_step(model, sa.MaxProduct(), lambda m, x: m(x)[:, 0].sum())
    x = torch.randn(3, 4, requires_grad=True)
    step(x)
    (captured,) = compiled._CACHE.values()
    stats = compiled.stats()
    assert captured.programs[0].built is None
    assert (stats["programs"], stats["built"], stats["steps"]) == (1, 0, 0)
    step(x)
    stats = compiled.stats()
    assert (stats["built"], stats["steps"]) == (1, captured.programs[0].steps) and stats["steps"]


def _through_scratch(x):
    """``x``'s halves swapped through a scratch buffer taken twice: the program reads the
    workspace's one buffer as two constants (each read of a tensor from outside is one),
    each with its views."""
    first = scratch("test_compiled_rewrite", torch.Size([2]), torch.float32, torch.device("cpu"))
    first.copy_(x[2:])
    low = first * 1
    second = scratch("test_compiled_rewrite", torch.Size([4]), torch.float32, torch.device("cpu"))
    second[2:].copy_(x[:2])
    return torch.cat([low, second[2:] * 1])


def test_views_of_a_scratch_buffer_written_are_each_threads_own():
    _through_scratch(_randn(4))  # the buffer made before the capture, which records it
    program = _record(_through_scratch, _randn(4))
    assert _calls(program, aten.as_strided.default) == 2  # x's halves; the buffer's are held
    assert program.source.count("_own(") == 2
    _replay(program, _through_scratch, _randn(4, seed=1))
    got: list = []
    thread = threading.Thread(target=lambda: got.append(program.replay([_randn(4, seed=2)])))
    thread.start()
    thread.join()
    (other,) = got[0]
    assert torch.equal(other, _through_scratch(_randn(4, seed=2)))
    assert program.run.__globals__["shared0"].untyped_storage().data_ptr() != (
        other.untyped_storage().data_ptr()
    )


def test_an_operator_on_a_constant_written_through_data_sees_the_write():
    """A write through ``.data`` leaves the tensor's version counter as it was: an operator
    on constants alone runs on every replay, not only where a version changed."""
    w = _randn(3, 3)

    def f(x):
        return x * (w == 0) + w.abs()

    program = _record(f, _randn(3, 3))
    _replay(program, f, _randn(3, 3, seed=1))
    w.data[1, 1] = 0.0
    w.data.mul_(-2)
    _replay(program, f, _randn(3, 3, seed=2))


def test_a_view_of_a_merged_view_is_a_view_of_the_first():
    """``b`` is ``a`` (the same view of ``y``): ``b[0]`` is then ``a[0]``, one view."""

    def f(x):
        y = x * 1
        a, b = y.t(), y.t()
        return a[0] * b[0] + (a + b).sum()

    program = _record(f, _randn(3, 4))
    assert _calls(program, aten.as_strided.default) == 2  # a and a[0]
    _replay(program, f, _randn(3, 4, seed=1))


def test_the_one_part_of_a_split_with_empty_parts_is_its_input():
    def f(x):
        y = x * 2
        _, b, _ = torch.split(y, [0, 4, 0], dim=1)
        return b * 3

    program = _record(f, _randn(3, 4))
    assert _calls(program, aten.split_with_sizes.default) == 0
    _replay(program, f, _randn(3, 4, seed=1))


def test_a_split_into_two_parts_stays_a_split():
    def f(x):
        a, b = torch.split(x * 2, [1, 3], dim=1)
        return a * b

    program = _record(f, _randn(3, 4))
    assert _calls(program, aten.split_with_sizes.default) == 1
    _replay(program, f, _randn(3, 4, seed=1))


def _compared(x: Tensor) -> Tensor:
    """Comparisons with numbers: an int, a float that float32 does not hold (0.1), -inf,
    and one writing into a buffer of another dtype."""
    out = torch.empty(x.shape, dtype=torch.float64)
    return torch.stack(
        [
            torch.where(x == 0, -torch.inf, x),
            (x > 0.1).to(x.dtype),
            (x != -torch.inf).to(x.dtype),
            torch.ne(x, 0, out=out).to(x.dtype),
        ]
    )


def _number_comparisons(program: Program) -> int:
    """How many comparisons in the program's source compare with a number (a literal, or
    a constant that is no tensor)."""
    names = program.run.__globals__
    bindings = {_fast_binding(getattr(aten, c).Scalar) for c in ("eq", "ne", "gt")}
    calls = [k for k, v in names.items() if any(v is b for b in bindings)]
    count = 0
    for name in calls:
        for other in re.findall(rf"\b{name}\(v\d+, ([^,)]+)", program.source):
            count += not isinstance(names.get(other.strip()), Tensor)
    return count


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_comparison_with_a_number_compares_with_a_constant_of_its_dtype(dtype):
    """0.1 becomes float32's nearest 0.1 for a float32 tensor (so x = float32(0.1) is not
    above it, as in eager), float64's own for a float64 tensor."""
    x = torch.tensor([0.0, -0.0, 0.1, 0.2, -torch.inf, torch.nan], dtype=dtype)
    program = _record(_compared, x)
    assert _number_comparisons(program) == 0
    y = torch.tensor([0.1, 0.0, -torch.inf, 3.0, -0.0, 0.5], dtype=dtype)
    got = _replay(program, _compared, y)
    expected = [
        [0.1, -torch.inf, -torch.inf, 3.0, -torch.inf, 0.5],
        [0.0, 0.0, 0.0, 1.0, 0.0, 1.0],
        [1.0, 1.0, 0.0, 1.0, 1.0, 1.0],
        [1.0, 0.0, 1.0, 1.0, 0.0, 1.0],
    ]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=dtype), rtol=0, atol=0)


def test_a_comparison_in_half_precision_compares_with_the_number():
    x = torch.tensor([0.0, 0.1, 2.0], dtype=torch.bfloat16)

    def f(x):
        return (x > 0.1).to(x.dtype) + (x == 0).to(x.dtype)

    program = _record(f, x)
    assert _number_comparisons(program) == 2
    _replay(program, f, torch.tensor([0.1, 0.0, 0.5], dtype=torch.bfloat16))


def _zero_select(x: Tensor, w: Tensor) -> Tensor:
    """Counting's x ⊗ lift(w): -inf where w = 0."""
    return torch.where(w == 0, -torch.inf, x) * 2


def _where_zero_calls(program: Program) -> int:
    return _calls(program, torch.ops.semiring_autograd.where_zero.default)


@pytest.mark.skipif(not sa.kernels.available(), reason="the CPU kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_select_by_a_zero_test_is_one_operator(dtype):
    x, w = _randn(4, 5).to(dtype), _randn(4, 5, seed=1).to(dtype)
    program = _record(_zero_select, x, w)
    assert _where_zero_calls(program) == 1
    assert _calls(program, aten.where.self) == 0
    w = torch.tensor([[0.0, -0.0, torch.nan, torch.inf, 1.0]] * 4, dtype=dtype)
    got = _replay(program, _zero_select, _randn(4, 5, seed=2).to(dtype), w)
    expected = (_randn(4, 5, seed=2).to(dtype) * 2).masked_fill(w == 0, -torch.inf)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    broadcast = _record(_zero_select, x, w[0])  # w broadcast: torch's where inside the operator
    assert _where_zero_calls(broadcast) == 1
    _replay(broadcast, _zero_select, _randn(4, 5, seed=3).to(dtype), w[1])


@pytest.mark.skipif(not sa.kernels.available(), reason="the CPU kernels are not built here")
def test_a_zero_test_read_again_or_written_between_stays_apart():
    """The mask read twice, or ``w`` written between the test and the select (the select
    must see the mask of w before the write): eq and where stay."""

    def read_again(x, w):
        m = w == 0
        return torch.where(m, -torch.inf, x) + m

    def written_between(x, w):
        w = w * 1
        m = w == 0
        w.add_(1)
        return torch.where(m, -torch.inf, x) + w

    for f in (read_again, written_between):
        x, w = _randn(3, 4), _randn(3, 4, seed=1).masked_fill(_randn(3, 4, seed=4) > 0, 0.0)
        program = _record(f, x, w)
        assert _where_zero_calls(program) == 0
        w = torch.tensor([[0.0, -1.0, 1.0, -0.0]] * 3)
        _replay(program, f, _randn(3, 4, seed=2), w)


def test_a_conversion_to_its_own_dtype_and_a_clone_of_a_fresh_value_are_no_steps():
    def f(x):
        return (x * 2).to(torch.float32).clone() + 1

    program = _record(f, _randn(3, 4))
    assert _calls(program, aten.to.dtype) == 0
    assert _calls(program, aten.clone.default) == 0
    _replay(program, f, _randn(3, 4, seed=1))


def test_a_clone_of_a_value_read_again_or_not_row_major_stays_a_clone():
    """Were the clone its source, ``add_`` would change the source read after it; the
    product of a transposed input is laid out as the input, its row-major copy is not (a
    view of the flat copy reads it so)."""

    def read_again(x):
        y = x * 2
        z = y.clone()
        z.add_(1)
        return z + y

    def transposed(x):
        return (x.t() * 2).contiguous().view(-1)

    for f in (read_again, transposed):
        program = _record(f, _randn(3, 4))
        assert _calls(program, aten.clone.default) == 1
        _replay(program, f, _randn(3, 4, seed=1))
