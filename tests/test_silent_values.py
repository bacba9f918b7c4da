"""Values that must not depend on how a question is batched, empty layers, and the errors
for inputs the backward cannot use.

* ∞·0: an infinite weight feeding a saturated tanh (tanh' = 0 exactly). Each row's
  readout is the same alone and in any batch; NaN in Real, MaxProduct, Log and Entropy
  exactly where torch's float64 gradient is NaN (docs/semantics.md's rule), no NaN elsewhere; the
  other values are the brute-force path enumeration's (tests/oracle.py).
* ``nn.Linear`` with no output or no input features, or a batch of 0: every message is
  the oracle's (the semiring zero where no path reaches).
* A seed or output on the meta device, and a user semiring whose ⊕ or ⊗ returns a value of
  the wrong shape: an error naming the problem, and the graph still usable.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import semiring_autograd as sa
from semiring_autograd.engine.compiled import backward as compiled_backward
from semiring_autograd.errors import SemiringDefinitionError
from semiring_autograd.semirings import BUILTIN_SEMIRINGS
from oracle import Program
from user_semirings import Tropical

ALL = [cls() for cls in BUILTIN_SEMIRINGS] + [sa.Real(formulas=True), sa.KBest(2), Tropical()]
#: where ∞·0 is NaN, as in torch's backward (docs/semantics.md, "NaN, infinities and faults")
NAN_CARRYING = [sa.Real(), sa.Real(formulas=True), sa.MaxProduct(), sa.Log(), sa.Entropy()]
#: a zero derivative is no edge: no path passes it, so no NaN
EDGE_READING = [sa.SignedMaxProduct(), sa.Boolean(), sa.Counting(), sa.KBest(2)]

# ----- ∞·0 --------------------------------------------------------------------------------
#: h = W x + b, y = tanh(h): W[0, 1] = ∞ puts h[0] at ±∞, so tanh'(h[0]) = 0 exactly
WEIGHT = torch.tensor([[0.5, float("inf"), -0.3], [0.2, -0.4, 0.6]], dtype=torch.float64)
BIAS = torch.tensor([0.1, -0.2], dtype=torch.float64)
#: rows where h[1] is moderate (a path runs through y[1]) and rows where tanh saturates at
#: both units (no path leaves the row: its message into the linear layer is the zero)
LIVE = [[0.3, 0.7, -0.2], [-1.1, 0.4, 0.9], [0.8, -0.5, 0.1], [0.2, 0.3, -0.6]]
DEAD = [[100.0, 0.7, -100.0], [-90.0, -0.2, 80.0], [70.0, 1.5, -120.0]]
ROWS = torch.tensor(LIVE + DEAD, dtype=torch.float64)
LIVE_ROWS = set(range(len(LIVE)))
#: batches as row indices into ROWS (mixing live and dead rows; one with dead rows only)
BATCHES = {
    "1": [0],
    "2": [0, 4],
    "2-dead": [4, 5],
    "3": [5, 1, 6],
    "7": [4, 0, 1, 5, 2, 6, 3],
}


def _tanh_layer(weight: torch.Tensor) -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh()).double()
    with torch.no_grad():
        model[0].weight.copy_(weight)
        model[0].bias.copy_(BIAS)
    return model


def _readout(S: sa.Semiring, rows: list[int], weight: torch.Tensor = WEIGHT) -> torch.Tensor:
    model = _tanh_layer(weight)
    x = ROWS[rows].clone().requires_grad_()
    with sa.patch(model, S):
        y = model(x)
    return sa.grad(y, x)


def _rows_of(S: sa.Semiring, readout: torch.Tensor) -> torch.Tensor:
    """The readout with the batch dim first (SignedMaxProduct and KBest put theirs second)."""
    return readout.transpose(0, 1) if readout.dim() == 3 else readout


def _oracle(S: sa.Semiring, rows: list[int], weight: torch.Tensor) -> torch.Tensor:
    """Path enumeration over h = W x + b, y = tanh(h), every y seeded with the one."""
    program = Program(x=ROWS[rows])
    program.op("h", lambda x: F.linear(x, weight, BIAS), "x")
    program.op("y", torch.tanh, "h")
    (value,) = program.path_sum(S, "y", None, ["x"])
    return S.readout(value)


def _torch_nan(rows: list[int]) -> torch.Tensor:
    model = _tanh_layer(WEIGHT)
    x = ROWS[rows].clone().requires_grad_()
    (g,) = torch.autograd.grad(model(x).sum(), x)
    return torch.isnan(g)


@pytest.mark.parametrize("batch", list(BATCHES), ids=lambda b: f"batch{b}")
@pytest.mark.parametrize("S", ALL, ids=repr)
def test_inf_times_zero_gives_each_row_its_value_alone(S, batch):
    rows = BATCHES[batch]
    alone = torch.cat([_rows_of(S, _readout(S, [r])) for r in rows])
    together = _rows_of(S, _readout(S, rows))
    torch.testing.assert_close(together, alone, rtol=1e-12, atol=1e-14, equal_nan=True)


@pytest.mark.parametrize("batch", list(BATCHES), ids=lambda b: f"batch{b}")
@pytest.mark.parametrize("S", NAN_CARRYING, ids=repr)
def test_inf_times_zero_is_nan_where_torch_is(S, batch):
    """NaN exactly where torch's gradient is (every row: 0 · ∞ in its product with W),
    every other element the value of the path enumeration, which is the same with the
    infinity replaced by a finite weight that saturates tanh alike (no path passes a
    zero derivative, whatever the weight before it)."""
    rows = BATCHES[batch]
    got = _readout(S, rows)
    nan = _torch_nan(rows)
    assert nan[:, 1].all() and not nan[:, [0, 2]].any()
    assert torch.equal(torch.isnan(got), nan)
    finite = WEIGHT.nan_to_num(posinf=1e300)
    expected = _oracle(S, rows, finite)
    torch.testing.assert_close(got[~nan], expected[~nan], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch", [b for b in BATCHES if b != "2-dead"], ids=lambda b: f"b{b}")
@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Log(), sa.Entropy()], ids=repr)
def test_inf_times_zero_nan_pattern_is_path_enumerations(S, batch):
    """The path enumeration with the infinite weight itself: its linear layer's Jacobian
    entries from x[:, 1] are 0 · ∞ = NaN (torch's product of a unit cotangent with W) once
    some path reaches that layer, which every batch with a live row has."""
    rows = BATCHES[batch]
    assert LIVE_ROWS & set(rows)
    expected = _oracle(S, rows, WEIGHT)
    assert torch.equal(torch.isnan(_readout(S, rows)), torch.isnan(expected))


@pytest.mark.parametrize("batch", list(BATCHES), ids=lambda b: f"batch{b}")
@pytest.mark.parametrize("S", EDGE_READING, ids=repr)
def test_zero_derivative_is_no_edge_for_the_edge_reading_semirings(S, batch):
    """SignedMaxProduct, Boolean, Counting and KBest: no path passes tanh' = 0, so the
    values are the path enumeration's with the infinity replaced by a finite weight."""
    rows = BATCHES[batch]
    got = _readout(S, rows)
    assert not torch.isnan(got.double()).any()
    expected = _oracle(S, rows, WEIGHT.nan_to_num(posinf=1e300))
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Log(), sa.Entropy()], ids=repr)
def test_captured_backward_reads_inf_times_zero_as_the_eager_one(S):
    """compile=True: a program captured with a finite weight (its dead rows dropped) is not
    replayed with the infinite one, which gets a program of its own (the weight's finiteness
    is a guard); the finite weight again replays the first. Each gives the eager readouts."""
    rows = BATCHES["7"]
    finite = WEIGHT.nan_to_num(posinf=1e300)
    compiled_backward.clear()
    for weight in (finite, WEIGHT, finite):
        model = _tanh_layer(weight)
        x = ROWS[rows].clone().requires_grad_()
        with sa.patch(model, S):
            y = model(x)
        replayed = sa.grad(y, x, compile=True)
        eager = _readout(S, rows, weight)
        torch.testing.assert_close(replayed, eager, rtol=0, atol=0, equal_nan=True)
    counts = compiled_backward.stats()
    assert (counts["captures"], counts["replays"], counts["eager"]) == (2, 1, 0), counts


# ----- empty linear layers ------------------------------------------------------------------
#: (in features, out features, batch)
EMPTY = [(3, 0, 2), (0, 3, 2), (0, 0, 2), (3, 2, 0), (3, 0, 0)]


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("shape", EMPTY, ids=lambda s: "in{}-out{}-batch{}".format(*s))
@pytest.mark.parametrize("S", ALL, ids=repr)
def test_empty_linear_messages_are_the_path_enumerations(S, shape):
    """y = tanh(W x + b) with an empty dimension: the messages at x, W and b are the
    oracle's (the semiring zero where no path reaches; b's sum over the batch in
    Linear(0, n)); Real's are torch's float64 gradients."""
    n_in, n_out, batch = shape
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(n_in, n_out), nn.Tanh()).double()
    with torch.no_grad():
        model[0].bias.copy_(torch.randn(n_out, dtype=torch.float64))
    x = torch.randn(batch, n_in, dtype=torch.float64, requires_grad=True)
    params = [x, model[0].weight, model[0].bias]
    with sa.patch(model, S):
        y = model(x)
    got = sa.grad(y, params)
    if S.name == "real":
        expected = torch.autograd.grad(model(x).sum(), params, allow_unused=True)
    else:
        program = Program(x=x, w=model[0].weight, b=model[0].bias)
        program.op("h", F.linear, "x", "w", "b")
        program.op("y", torch.tanh, "h")
        expected = [S.readout(v) for v in program.path_sum(S, "y", None, ["x", "w", "b"])]
    for g, e, p in zip(got, expected, params):
        assert g.shape[-p.dim() :] == p.shape
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("dim, indices", [(0, [[1, 2]]), (3, [[]]), (0, [[]])])
@pytest.mark.parametrize("S", ALL, ids=repr)
def test_empty_embedding_messages_are_the_path_enumerations(S, dim, indices):
    """An embedding of width 0, or a lookup of no index: the weight's message is the
    oracle's (the semiring zero: no path); Real's is torch's float64 gradient."""
    torch.manual_seed(0)
    model = nn.Embedding(5, dim).double()
    index = torch.tensor(indices, dtype=torch.long)
    with sa.patch(model, S):
        y = model(index)
    got = sa.grad(y, model.weight)
    if S.name == "real":
        (expected,) = torch.autograd.grad(model(index).sum(), model.weight)
    else:
        program = Program(w=model.weight)
        program.op("y", lambda w: F.embedding(index, w), "w")
        (value,) = program.path_sum(S, "y", None, ["w"])
        expected = S.readout(value)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# ----- inputs the backward cannot use --------------------------------------------------------
def _patched_linear(S: sa.Semiring, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2, device=device)
    x = torch.randn(2, 3, device=device, requires_grad=True)
    with sa.patch(model, S):
        y = model(x)
    return y, x


@pytest.mark.parametrize("S", [sa.Real(), sa.MaxProduct(), sa.Entropy()], ids=repr)
def test_seed_on_meta_device_is_refused_and_the_graph_kept(S):
    y, x = _patched_linear(S)
    with pytest.raises(ValueError, match=r"the seed is on the meta device .* give the seed on cpu"):
        sa.grad(y, x, seed=torch.ones(2, 2, device="meta"))
    expected = _patched_linear(S)
    torch.testing.assert_close(sa.grad(y, x), sa.grad(*expected), rtol=0, atol=0)


@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Log(), sa.Real(formulas=True)], ids=repr)
def test_output_on_meta_device_is_refused_by_semirings_that_read_values(S):
    y, x = _patched_linear(S, "meta")
    with pytest.raises(ValueError, match=r"output \(shape \(2, 2\)\) is on the meta device"):
        sa.grad(y, x)


def test_output_on_meta_device_runs_torchs_graph_under_real():
    y, x = _patched_linear(sa.Real(), "meta")
    g = sa.grad(y, x, seed=torch.ones(2, 2, device="meta"))
    assert g.is_meta and g.shape == x.shape


class _WrongShape(Tropical):
    """Tropical with ⊕ or ⊗ reducing the last dim (keepdim): a value of the wrong shape."""

    def __init__(self, broken: str) -> None:
        self.broken = broken

    def add(self, a, b):
        out = super().add(a, b)
        return (out[0].amin(-1, keepdim=True),) if self.broken == "add" else out

    def mul(self, a, b):
        out = super().mul(a, b)
        return (out[0].sum(-1, keepdim=True),) if self.broken == "mul" else out


class _NotAValue(Tropical):
    def add(self, a, b):
        return super().add(a, b)[0]  # the tensor, not the one-tuple


@pytest.mark.parametrize("broken, symbol", [("add", "⊕"), ("mul", "⊗")])
def test_user_semiring_of_wrong_shape_names_class_method_and_shapes(broken, symbol):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    with sa.patch(model, _WrongShape(broken), check=False):  # its backward must say it
        y = model(x)
    pattern = (
        rf"_WrongShape\.{broken} \({symbol}\) returned components of shapes \[\(.*, 1\)\] "
        r"for operands of shapes .*: expected the operands' broadcast shape \(.*\)"
    )
    with pytest.raises(SemiringDefinitionError, match=pattern):
        sa.grad(y, x)


def test_user_semiring_returning_a_tensor_names_what_a_value_is():
    with pytest.raises(SemiringDefinitionError, match=r"_NotAValue\.add \(⊕\) returned Tensor"):
        _NotAValue().add((torch.zeros(2),), (torch.ones(2),))


class _ExtraComponent(Tropical):
    def mul(self, a, b):
        out = super().mul(a, b)
        return (out[0], out[0])


def test_user_semiring_with_components_beyond_n_components_says_so():
    with pytest.raises(
        SemiringDefinitionError,
        match=r"_ExtraComponent\.mul \(⊗\) returned 2 components, but "
        r"_ExtraComponent\.n_components is 1",
    ):
        _ExtraComponent().mul((torch.zeros(2),), (torch.ones(2),))


def test_user_semiring_of_right_shape_runs_unchanged():
    """The check passes a correct semiring's values through: Tropical against the oracle."""
    rows = BATCHES["3"]
    finite = WEIGHT.nan_to_num(posinf=1e300)
    torch.testing.assert_close(
        _readout(Tropical(), rows, finite), _oracle(Tropical(), rows, finite), rtol=1e-10, atol=0
    )


class _StaticTropical(Tropical):
    """Tropical with ⊕ a staticmethod and ⊗ a classmethod: checked like plain methods."""

    @staticmethod
    def add(a, b):
        return (torch.minimum(a[0], b[0]),)

    @classmethod
    def mul(cls, a, b):
        return (a[0] + b[0],) if cls is _StaticTropical else (a[0][..., :1] + b[0][..., :1],)


class _BrokenStaticTropical(_StaticTropical):
    pass


def test_user_semiring_with_static_and_class_methods_runs_and_is_checked():
    rows = BATCHES["3"]
    finite = WEIGHT.nan_to_num(posinf=1e300)
    torch.testing.assert_close(
        _readout(_StaticTropical(), rows, finite),
        _oracle(Tropical(), rows, finite),
        rtol=1e-10,
        atol=0,
    )
    with pytest.raises(SemiringDefinitionError, match=r"_BrokenStaticTropical\.mul \(⊗\)"):
        _BrokenStaticTropical().mul((torch.zeros(2, 2),), (torch.ones(2, 2),))
