"""``torch._grouped_mm`` (the grouped GEMM of mixture-of-experts layers) under every semiring.

op_db has no OpInfo for it, and its CPU kernel takes float32, bfloat16 and float16 only, so
the rows here are float32 (the op table's rows are float64). Per (row, semiring):

* the patched forward equals the unpatched one exactly (on the outputs the groups write:
  torch leaves the rows past ``offs[-1]`` uninitialised);
* the raw value and the readout at each input equal :func:`oracle.op_oracle` on the
  Jacobian of :func:`_reference`, a float64 per-group matmul written with ``torch.mm``
  alone (float32 tolerances);
* under Real, the result also equals ``torch.autograd.grad`` of the float32 op where some
  group reads the input; where none does, ``Real(formulas=True)`` gives exact zeros (torch's
  own backward, which ``sa.Real()`` records, leaves them uninitialised).

Then the compiled backward (it guards on the offsets), the refusals (overlapping groups,
offsets past the end, a bias, another out_dtype), and the two MoE
families whose experts run ``torch._grouped_mm`` (Mixtral, Qwen2-MoE): their
``experts_implementation="grouped_mm"`` readouts equal the ``"eager"`` experts' (a loop of
per-expert ``F.linear``), the same paths through other ops, under Real, MaxProduct, Log,
Counting and Entropy.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch
from op_checks import Apply, assert_value_close, random_cotangent, raw_value
from oracle import op_oracle
from torch import Tensor

import semiring_autograd as sa
from semiring_autograd.errors import UnsupportedOpError
from semiring_autograd.generated.ops_table import OPS
from semiring_autograd.semirings import BUILTIN_SEMIRINGS, Semiring

RTOL, ATOL = 1e-5, 1e-5  # float32 messages against a float64 oracle
REAL_RTOL, REAL_ATOL = 1e-5, 1e-6

_GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> Tensor:
    return torch.randn(*shape, generator=_GEN, dtype=torch.float32)


def _ends(offs: Tensor | None) -> list[int]:
    return [] if offs is None else offs.tolist()


def _reference(a: Tensor, b: Tensor, offs: Tensor | None) -> Tensor:
    """torch._grouped_mm by its definition, one ``torch.mm`` per group; zeros where no
    group writes."""
    if offs is None:
        return torch.stack([torch.mm(x, y) for x, y in zip(a, b)])
    ends = _ends(offs)
    groups = list(zip([0] + ends[:-1], ends))
    if a.dim() == 2 and b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[2])
        for g, (s, e) in enumerate(groups):
            out = out.index_add(0, torch.arange(s, e), torch.mm(a[s:e], b[g]))
        return out
    if a.dim() == 3:
        out = a.new_zeros(a.shape[1], b.shape[1])
        for g, (s, e) in enumerate(groups):
            out = out.index_add(1, torch.arange(s, e), torch.mm(a[g], b[:, s:e]))
        return out
    return torch.stack([torch.mm(a[:, s:e], b[s:e]) for s, e in groups])


def _written(out: Tensor, a: Tensor, b: Tensor, offs: Tensor | None) -> Tensor:
    """The part of ``out`` that the groups write (not the rows or columns past offs[-1])."""
    if offs is None or a.dim() == b.dim():
        return out
    end = _ends(offs)[-1]
    return out[:end] if a.dim() == 2 else out[:, :end]


@dataclass(frozen=True)
class Row:
    name: str
    a: Tensor
    b: Tensor
    offs: Tensor | None = None


def _offs(*ends: int) -> Tensor:
    return torch.tensor(ends, dtype=torch.int32)


ROWS = [
    # transformers' call: rows of tokens sorted by expert, one weight per expert
    Row("2d@3d", randn(7, 4), randn(3, 4, 4), _offs(3, 5, 7)),
    Row("2d@3d_empty_group_tail_row", randn(7, 4), randn(3, 4, 4), _offs(2, 2, 6)),
    Row("2d@3d_transposed_weight", randn(6, 4), randn(3, 8, 4).transpose(-2, -1), _offs(1, 4, 6)),
    Row("3d@2d", randn(3, 5, 4), randn(4, 12), _offs(4, 4, 10)),
    Row("2d@2d", randn(4, 12), randn(12, 4), _offs(4, 4, 10)),
    Row("3d@3d", randn(2, 3, 4), randn(2, 4, 8)),
]

SEMIRINGS = [sa.Real(formulas=True)] + [cls() for cls in BUILTIN_SEMIRINGS] + [sa.KBest(3)]


@pytest.mark.parametrize("S", SEMIRINGS, ids=repr)
@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_grouped_mm_against_oracle(row: Row, S: Semiring):
    module = Apply(lambda a, b: torch._grouped_mm(a, b, offs=row.offs))
    ref_inputs = [row.a.detach().requires_grad_(), row.b.detach().requires_grad_()]
    ref = module(*ref_inputs)
    inputs = [row.a.detach().requires_grad_(), row.b.detach().requires_grad_()]
    with sa.patch(module, S):
        out = module(*inputs)
    assert torch.equal(_written(out, *inputs, row.offs), _written(ref, *inputs, row.offs))

    g = torch.Generator().manual_seed(zlib.crc32(row.name.encode()))
    seed = random_cotangent(out.shape, g).float()
    raw = sa.grad(out, inputs, seed=seed, raw=True, retain_graph=True)
    readouts = sa.grad(out, inputs, seed=seed)
    want = op_oracle(
        S,
        lambda a, b: _reference(a, b, row.offs),
        [x.detach().double() for x in inputs],
        seed.double(),
    )
    for k, (x, message, readout, value) in enumerate(zip(inputs, raw, readouts, want)):
        got = tuple(_double(c) for c in raw_value(S, message, x))
        if (
            isinstance(S, sa.Real) and not S.formulas
        ):  # torch's own graph: its gradient where no group reads is garbage
            read = _read_by_groups(k, row)
            got, value, readout = (got[0][read],), (value[0][read],), readout[read]
        assert_value_close(got, value, f"input {k} raw value", RTOL, ATOL)
        torch.testing.assert_close(
            _double(readout),
            S.readout(value),
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m: f"input {k} readout: {m}",
        )

    if isinstance(S, sa.Real):
        native = torch.autograd.grad(ref, ref_inputs, seed)
        for k, (x, message, n) in enumerate(zip(inputs, raw, native)):
            got = raw_value(S, message, x)[0]
            read = _read_by_groups(k, row)
            torch.testing.assert_close(got[read], n[read], rtol=REAL_RTOL, atol=REAL_ATOL)
            if S.formulas:  # torch's own backward leaves them uninitialised
                assert not got[~read].any(), "an element no group reads has a non-zero gradient"


def _double(t: Tensor) -> Tensor:
    return t.double() if t.is_floating_point() else t


def _read_by_groups(k: int, row: Row) -> Tensor:
    """Which elements of input k some group reads."""
    x = (row.a, row.b)[k]
    read = torch.ones(x.shape, dtype=torch.bool)
    if row.offs is None:
        return read
    end = _ends(row.offs)[-1]
    if row.a.dim() == 2 and row.b.dim() == 3 and k == 0:
        read[end:] = False
    elif row.a.dim() == 3 and k == 1:
        read[:, end:] = False
    elif row.a.dim() == 2 and row.b.dim() == 2:
        if k == 0:
            read[:, end:] = False
        else:
            read[end:] = False
    return read


def test_compiled_backward_guards_on_the_offsets():
    """``sa.grad(compile=True)`` replays a program only for the offsets it was captured
    with: other group sizes (same shapes) capture another program, equal to eager."""
    a0, b0 = randn(8, 4), randn(3, 4, 4)
    for ends in [(2, 5, 8), (2, 5, 8), (3, 3, 8), (1, 4, 8), (3, 3, 8), (2, 5, 8)]:
        offs = _offs(*ends)
        module = Apply(lambda a, b: torch._grouped_mm(a, b, offs=offs))
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        with sa.patch(module, sa.MaxProduct()):
            y = module(a, b)
        seed = torch.ones_like(y)
        eager = sa.grad(y, [a, b], seed=seed, retain_graph=True)
        compiled = sa.grad(y, [a, b], seed=seed, compile=True)
        for e, c in zip(eager, compiled):
            assert torch.equal(e, c), ends


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "why, offs",
    [
        ("overlapping groups", _offs(4, 2, 7)),
        ("offsets past the end", _offs(2, 4, 9)),
        ("no group", _offs()),
    ],
)
def test_grouped_mm_refuses_offsets_it_cannot_read(why: str, offs: Tensor):
    """torch's CPU kernel runs these (later groups overwrite earlier ones, the last group
    is cut at the end; with no group, torch's own backward fails); the entry refuses them
    at forward, naming what it requires."""
    module = Apply(lambda a, b: torch._grouped_mm(a, b, offs=offs))
    a, b = randn(7, 4).requires_grad_(), randn(len(offs), 4, 4)
    with sa.patch(module, sa.MaxProduct()):
        with pytest.raises(UnsupportedOpError, match=r"torch\._grouped_mm.*_grouped_mm requires"):
            module(a, b)


def test_grouped_mm_entries_refuse_a_bias_and_another_out_dtype():
    """A bias (which torch's own backward does not differentiate, and its CPU kernel does not
    take) and an out_dtype other than the inputs' are refused by every entry."""
    specs = [op for op in OPS if op.name.startswith("_grouped_mm")]
    assert len(specs) == 4
    a, b, offs = randn(7, 4), randn(3, 4, 4), _offs(2, 4, 7)
    for kwargs in (dict(bias=torch.zeros(3, 4)), dict(out_dtype=torch.float64)):
        bound = [op.bind((a, b), dict(offs=offs, **kwargs)) for op in specs]
        assert all(x is not None for x in bound)
        assert not any(op.accepted(x) for op, x in zip(specs, bound)), kwargs
    assert [op.accepted(op.bind((a, b), dict(offs=offs))) for op in specs].count(True) == 1


# ----------------------------------------------------------------------------- MoE models
def _moe(family: str, experts: str):
    tf = pytest.importorskip("transformers")
    sizes = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=24,
        vocab_size=48,
        max_position_embeddings=32,
        experts_implementation=experts,
    )
    torch.manual_seed(0)
    if family == "mixtral":
        config = tf.MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2)
        model = tf.MixtralForCausalLM(config)
    else:
        config = tf.Qwen2MoeConfig(
            **sizes,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=8,
        )
        model = tf.Qwen2MoeForCausalLM(config)
    return model.float().eval()


def _calls_grouped_mm(model, x: Tensor) -> bool:
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Spy():
        model(inputs_embeds=x)
    return torch._grouped_mm in seen


@pytest.mark.filterwarnings("ignore:sa.patch. the custom autograd.Function")
@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_moe_grouped_mm_experts_equal_the_eager_experts(family: str):
    grouped, eager = _moe(family, "grouped_mm"), _moe(family, "eager")
    ids = torch.randint(1, 48, (2, 5), generator=torch.Generator().manual_seed(1))
    x0 = grouped.get_input_embeddings()(ids).detach()
    assert _calls_grouped_mm(grouped, x0)

    x = x0.clone().requires_grad_()
    want = torch.autograd.grad(grouped(inputs_embeds=x).logits.reshape(-1)[-3], x)[0]
    for S in (sa.Real(formulas=True), sa.MaxProduct(), sa.Log(), sa.Counting(), sa.Entropy()):
        readouts = []
        for model in (grouped, eager):
            x = x0.clone().requires_grad_()
            with sa.patch(model, S):
                out = model(inputs_embeds=x).logits
            readouts.append(sa.grad(out.reshape(-1)[-3], x))
        torch.testing.assert_close(
            readouts[0], readouts[1], rtol=1e-5, atol=1e-6, msg=lambda m: f"{S!r}: {m}"
        )
        if isinstance(S, sa.Real):
            torch.testing.assert_close(readouts[0], want, rtol=1e-5, atol=1e-6)
