"""Every supported op × every built-in semiring against the brute-force oracle.

An OpInfo-style table: one row per op (a name, a function of tensors, sample inputs), each
sample run in a tiny module under ``sa.patch``. Checked per (op-sample, semiring): the
forward equals the unpatched forward exactly; the raw semiring value and the readout at every
input equal the oracle's (Jacobian ⊕/⊗ per op, path enumeration for compositions such as
layer norm); for Real, the result also equals ``torch.autograd.grad``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from composition_oracles import (
    attention_paths,
    channel_norm_paths,
    layer_norm_paths,
    rms_norm_paths,
    weight_norm_paths,
)
from op_checks import Apply, assert_value_close, random_cotangent, raw_value
from oracle import merge_positions, op_oracle
from torch import Tensor

import semiring_autograd as sa
from semiring_autograd.semirings import BUILTIN_SEMIRINGS, Semiring, Value

RTOL, ATOL = 1e-7, 1e-9
REAL_RTOL, REAL_ATOL = 1e-10, 1e-12
RNG_SEED = 1234  # torch's global seed before each forward (dropout draws its mask from it)

_GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> Tensor:
    return torch.randn(*shape, generator=_GEN, dtype=torch.float64)


def positive(*shape: int) -> Tensor:
    return torch.rand(*shape, generator=_GEN, dtype=torch.float64) * 1.5 + 0.5


def away_from_zero(*shape: int) -> Tensor:
    sign = torch.randint(0, 2, shape, generator=_GEN).to(torch.float64) * 2 - 1
    return positive(*shape) * sign


def with_zeros(*shape: int) -> Tensor:
    x = randn(*shape)
    x.view(-1)[::3] = 0.0
    return x


def _tied(*shape: int) -> Tensor:
    """Values on a grid of step 0.5 in [-1, 1]: ties between inputs and with bounds."""
    return torch.randint(-2, 3, shape, generator=_GEN).to(torch.float64) * 0.5


@dataclass(frozen=True)
class Sample:
    name: str
    inputs: tuple[Tensor, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: the gradient passes through a half/bfloat16 tensor: Real messages are rounded there,
    #: as torch.autograd's are, so Real is held to torch.autograd only (other semirings keep
    #: float32 messages and still meet the exact oracle)
    low_precision: bool = False


Oracle = Callable[[Semiring, Callable[..., Tensor], Sample, "Tensor | None", Tensor], list[Value]]


@dataclass(frozen=True)
class OpRow:
    """``fn(*sample.inputs, **sample.kwargs)`` is the module's forward; ``oracle`` overrides
    the default (the Jacobian oracle of that function)."""

    name: str
    fn: Callable[..., Tensor]
    samples: Callable[[], list[Sample]]
    oracle: Oracle | None = None


def _jacobian_oracle(
    S: Semiring, f: Callable[..., Tensor], sample: Sample, seed: Tensor | None, ref_out: Tensor
) -> list[Value]:
    return op_oracle(S, f, list(sample.inputs), seed)


def _square_oracle(
    S: Semiring, f: Callable[..., Tensor], sample: Sample, seed: Tensor | None, ref_out: Tensor
) -> list[Value]:
    """``x * x``: two parallel edges x_j → y_j (one per argument position), ⊕-merged."""
    (x,) = sample.inputs
    return merge_positions(S, op_oracle(S, torch.mul, [x, x], seed), [0, 0])


def _dropout_train_oracle(
    S: Semiring, f: Callable[..., Tensor], sample: Sample, seed: Tensor | None, ref_out: Tensor
) -> list[Value]:
    """Edges of weight mask/(1-p), the mask recovered from the unpatched output."""
    p = sample.kwargs["p"]
    kept = (ref_out.detach() != 0).to(torch.float64)
    scale = kept / (1.0 - p)
    return op_oracle(S, lambda x: x * scale, list(sample.inputs), seed)


def _layer_norm_oracle(
    S: Semiring, f: Callable[..., Tensor], sample: Sample, seed: Tensor | None, ref_out: Tensor
) -> list[Value]:
    """Path enumeration through the stated composition (:func:`layer_norm_paths`)."""
    names = ["x", "w", "b"][: len(sample.inputs)]
    values = layer_norm_paths(
        S,
        seed,
        normalized_shape=sample.kwargs["normalized_shape"],
        eps=sample.kwargs.get("eps", 1e-5),
        **dict(zip(names, sample.inputs)),
    )
    return [values[n] for n in names]


def _channel_norm_oracle(kind: str) -> Oracle:
    """Path enumeration through the stated composition (:func:`channel_norm_paths`)."""

    def oracle(
        S: Semiring, f: Callable[..., Tensor], sample: Sample, seed: Tensor | None, ref_out: Tensor
    ) -> list[Value]:
        names = ["x", "w", "b"][: len(sample.inputs)]
        kw = sample.kwargs
        values = channel_norm_paths(
            S, seed, kind=kind, groups=kw.get("groups"), **dict(zip(names, sample.inputs))
        )
        return [values[n] for n in names]

    return oracle


def _rms_norm_oracle(
    S: Semiring, f: Callable[..., Tensor], sample: Sample, seed: Tensor | None, ref_out: Tensor
) -> list[Value]:
    names = ["x", "w"][: len(sample.inputs)]
    values = rms_norm_paths(
        S,
        seed,
        normalized_shape=sample.kwargs["normalized_shape"],
        eps=sample.kwargs.get("eps"),
        **dict(zip(names, sample.inputs)),
    )
    return [values[n] for n in names]


def _weight_norm_oracle(
    S: Semiring, f: Callable[..., Tensor], sample: Sample, seed: Tensor | None, ref_out: Tensor
) -> list[Value]:
    """Path enumeration through the stated composition (:func:`weight_norm_paths`)."""
    values = weight_norm_paths(S, seed, *sample.inputs, dim=sample.kwargs["dim"])
    return [values["v"], values["g"]]


def _layer_norm(
    x: Tensor,
    w: Tensor | None = None,
    b: Tensor | None = None,
    *,
    normalized_shape: tuple[int, ...],
    eps: float = 1e-5,
) -> Tensor:
    return F.layer_norm(x, normalized_shape, w, b, eps)


def _split_cat(x: Tensor) -> Tensor:
    a, b, c = torch.split(x, 2, dim=1)
    return torch.cat([a.exp(), b * 3, c], dim=1)


def _split_sections_cat(x: Tensor) -> Tensor:
    p, q = x.split([1, 3], 0)
    return torch.cat([p.exp(), q * 3])


def _chunk_product(x: Tensor) -> Tensor:
    p, q = x.chunk(2, -1)
    return p * q


def _sdpa(q: Tensor, k: Tensor, v: Tensor, *mask: Tensor, **kw: Any) -> Tensor:
    """SDPA with a float mask passed as a (differentiable) fourth input, or a bool mask in kw."""
    return F.scaled_dot_product_attention(q, k, v, *mask, **kw)


def _sdpa_oracle(
    S: Semiring, f: Callable[..., Tensor], sample: Sample, seed: Tensor | None, ref_out: Tensor
) -> list[Value]:
    """Path enumeration through the stated composition (:func:`attention_paths`)."""
    names = ["q", "k", "v", "attn_mask"][: len(sample.inputs)]
    values = attention_paths(S, seed, **dict(zip(names, sample.inputs)), **sample.kwargs)
    return [values["m" if n == "attn_mask" else n] for n in names]


def _setitem(
    x: Tensor, v: Tensor | None = None, *, index: Any, target: tuple | None = None, number=None
) -> Tensor:
    """``y[index] = v`` on a copy of x; with ``target``, on a constant zeros of that shape
    (x is then the value written); with ``number``, a Python number is written."""
    if target is not None:
        y, v = torch.zeros(target, dtype=x.dtype), x
    else:
        y = x.clone()
    y[index] = number if number is not None else v
    return y


def _cast_round_trip(x: Tensor, **kw: Any) -> Tensor:
    """float64 → (a cast under test) → float64, so input and output dtypes agree."""
    y = {
        "to_dtype": lambda: x.to(torch.float32),
        "to_kw": lambda: x.to(dtype=torch.float32, device="cpu"),
        "float": lambda: x.float(),
        "half": lambda: x.half(),
        "bfloat16": lambda: x.bfloat16(),
        "type": lambda: x.type(torch.float32),
        "type_as": lambda: x.type_as(torch.zeros((), dtype=torch.float32)),
    }[kw["cast"]]()
    return y.double() * 3.0


S_ = Sample  # short alias for the table

OPS: list[OpRow] = [
    # ------------------------------------------------------------------ linear algebra
    OpRow(
        "F.linear",
        F.linear,
        lambda: [
            S_("1d_bias", (randn(3), randn(4, 3), randn(4))),
            S_("3d_bias", (randn(2, 2, 3), randn(4, 3), randn(4))),
            S_("2d_nobias", (randn(2, 3), randn(5, 3))),
            S_("3d_nobias_wT", (randn(2, 2, 3), randn(3, 4).t())),
        ],
    ),
    OpRow(
        "torch.matmul",
        torch.matmul,
        lambda: [
            S_("1d@1d", (randn(4), randn(4))),
            S_("2d@1d", (randn(3, 4), randn(4))),
            S_("1d@2d", (randn(4), randn(4, 3))),
            S_("3d@2d", (randn(2, 3, 4), randn(4, 2))),
            S_("4d@3d_broadcast", (randn(2, 1, 2, 3), randn(3, 3, 2))),
            S_("2d@2d_noncontig", (randn(4, 3).t(), randn(4, 6)[:, ::2])),
        ],
    ),
    OpRow(
        "@",
        lambda x, y: x @ y,
        lambda: [
            S_("2d@2d", (randn(3, 4), randn(4, 2))),
            S_("3d@2d", (randn(2, 3, 4), randn(4, 2))),
            S_("1d@2d", (randn(4), randn(4, 3))),
        ],
    ),
    OpRow(
        "torch.mm",
        torch.mm,
        lambda: [
            S_("3x4@4x2", (randn(3, 4), randn(4, 2))),
            S_("noncontig", (randn(4, 3).t(), randn(2, 4).t())),
        ],
    ),
    OpRow("torch.bmm", torch.bmm, lambda: [S_("2x3x4@2x4x2", (randn(2, 3, 4), randn(2, 4, 2)))]),
    OpRow(
        "torch.addmm",
        lambda c, a, b, **kw: torch.addmm(c, a, b, **kw),
        lambda: [
            S_(
                "beta0.5_alpha2_bcast",
                (randn(2), randn(3, 4), randn(4, 2)),
                dict(beta=0.5, alpha=2),
            ),
            S_("default", (randn(3, 2), randn(3, 4), randn(4, 2))),
            S_("alpha-1.5", (randn(3, 1), randn(3, 4), randn(4, 2)), dict(alpha=-1.5)),
            S_("beta0_no_path_to_input", (randn(3, 2), randn(3, 4), randn(4, 2)), dict(beta=0)),
        ],
    ),
    # ------------------------------------------------------------------ arithmetic
    OpRow(
        "x+y",
        lambda x, y: x + y,
        lambda: [
            S_("bcast_3x1+1x4", (randn(3, 1), randn(1, 4))),
            S_("bcast_2x3x4+4", (randn(2, 3, 4), randn(4))),
        ],
    ),
    OpRow(
        "x-y",
        lambda x, y: x - y,
        lambda: [
            S_("bcast_3x4-3x1", (randn(3, 4), randn(3, 1))),
            S_("bcast_4-2x1x4", (randn(4), randn(2, 1, 4))),
        ],
    ),
    OpRow(
        "x*y",
        lambda x, y: x * y,
        lambda: [
            S_("bcast_3x1*1x4", (randn(3, 1), randn(1, 4))),
            S_("bcast_2x3x4*3x1_noncontig", (randn(4, 3, 2).permute(2, 1, 0), randn(3, 1))),
        ],
    ),
    OpRow(
        "x/y",
        lambda x, y: x / y,
        lambda: [
            S_("bcast_3x4/4", (randn(3, 4), away_from_zero(4))),
            S_("bcast_3x1/2x1x4", (randn(3, 1), away_from_zero(2, 1, 4))),
        ],
    ),
    OpRow("x+2.5", lambda x: x + 2.5, lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("1+x", lambda x: 1 + x, lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("x-2", lambda x: x - 2, lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("2-x", lambda x: 2 - x, lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("x*3", lambda x: x * 3, lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("2*x", lambda x: 2 * x, lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("x/4", lambda x: x / 4, lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("3/x", lambda x: 3 / x, lambda: [S_("3x4", (away_from_zero(3, 4),))]),
    OpRow(
        "torch.add_alpha",
        lambda x, y: torch.add(x, y, alpha=2),
        lambda: [S_("bcast_3x4+4", (randn(3, 4), randn(4)))],
    ),
    OpRow(
        "torch.sub",
        lambda x, y, **kw: torch.sub(x, y, **kw),
        lambda: [
            S_("bcast_3x4-1x4", (randn(3, 4), randn(1, 4))),
            S_("alpha3", (randn(3, 4), randn(3, 4)), dict(alpha=3)),
        ],
    ),
    OpRow("torch.mul", torch.mul, lambda: [S_("bcast", (randn(2, 3), randn(2, 1)))]),
    OpRow("torch.div", torch.div, lambda: [S_("bcast", (randn(2, 3), away_from_zero(3)))]),
    OpRow("x*x", lambda x: x * x, lambda: [S_("3x4", (randn(3, 4),))], _square_oracle),
    OpRow("-x", lambda x: -x, lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("torch.neg", torch.neg, lambda: [S_("2x3x2", (randn(2, 3, 2),))]),
    OpRow("torch.abs", torch.abs, lambda: [S_("3x4_zeros", (with_zeros(3, 4),))]),
    OpRow("abs(x)", lambda x: abs(x), lambda: [S_("2x3", (randn(2, 3),))]),
    # ------------------------------------------------------------------ pointwise
    OpRow(
        "torch.exp",
        torch.exp,
        lambda: [S_("3x4", (randn(3, 4),)), S_("noncontig", (randn(5, 4)[::2].t(),))],
    ),
    OpRow("torch.log", torch.log, lambda: [S_("3x4_pos", (positive(3, 4),))]),
    OpRow("torch.expm1", torch.expm1, lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow(
        "torch.square",
        torch.square,
        lambda: [S_("3x4_zeros", (with_zeros(3, 4),)), S_("noncontig", (randn(4, 3).t(),))],
    ),
    OpRow("x.square()", lambda x: x.square(), lambda: [S_("2x3", (randn(2, 3),))]),
    OpRow("x.pow(3)", lambda x: x.pow(3), lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("x**2", lambda x: x**2, lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("x.pow(0.5)", lambda x: x.pow(0.5), lambda: [S_("3x4_pos", (positive(3, 4),))]),
    OpRow("2 ** x", lambda x: 2.0**x, lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("0.5 ** x (with zeros)", lambda x: 0.5**x, lambda: [S_("3x4", (with_zeros(3, 4),))]),
    OpRow("0 ** x", lambda x: 0.0**x, lambda: [S_("3x4_pos", (positive(3, 4),))]),
    OpRow("torch.sqrt", torch.sqrt, lambda: [S_("3x4_pos", (positive(3, 4),))]),
    OpRow("torch.rsqrt", torch.rsqrt, lambda: [S_("3x4_pos", (positive(3, 4),))]),
    OpRow("torch.tanh", torch.tanh, lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("torch.sigmoid", torch.sigmoid, lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("F.relu", F.relu, lambda: [S_("3x4_zeros", (with_zeros(3, 4),))]),
    OpRow("torch.relu", torch.relu, lambda: [S_("2x3x2_zeros", (with_zeros(2, 3, 2),))]),
    OpRow("x.relu()", lambda x: x.relu(), lambda: [S_("3x4_zeros", (with_zeros(3, 4),))]),
    OpRow(
        "F.gelu",
        lambda x, **kw: F.gelu(x, **kw),
        lambda: [
            S_("none", (randn(3, 4) * 2,), dict(approximate="none")),
            S_("tanh", (randn(3, 4) * 2,), dict(approximate="tanh")),
            S_("default", (randn(3, 4),)),
        ],
    ),
    OpRow("F.silu", F.silu, lambda: [S_("3x4", (randn(3, 4) * 2,))]),
    OpRow(
        "torch.flip",
        lambda x, **kw: torch.flip(x, **kw),
        lambda: [
            S_("dims_0_-1", (randn(2, 3, 4),), dict(dims=(0, -1))),
            S_("dim1", (randn(3, 4),), dict(dims=[1])),
        ],
    ),
    OpRow(
        "x.roll",
        lambda x, **kw: x.roll(**kw),
        lambda: [
            S_("dims", (randn(3, 4),), dict(shifts=(1, -2), dims=(0, 1))),
            S_("flattened", (randn(3, 4),), dict(shifts=5)),
            S_("one_dim", (randn(2, 5),), dict(shifts=3, dims=1)),
        ],
    ),
    OpRow(
        "torch.diagonal",
        lambda x, **kw: torch.diagonal(x, **kw),
        lambda: [
            S_("4x3", (randn(4, 3),)),
            S_("offset_1", (randn(3, 4),), dict(offset=1)),
            S_("3d_dims", (randn(2, 3, 4),), dict(offset=-1, dim1=2, dim2=1)),
        ],
    ),
    OpRow(
        "F.pad",
        lambda x, **kw: F.pad(x, **kw),
        lambda: [
            S_("constant", (randn(2, 3),), dict(pad=(1, 2), value=0.5)),
            S_("constant_crop", (randn(3, 4),), dict(pad=(-1, 1, 1, -1))),
            S_("reflect", (randn(2, 2, 4),), dict(pad=(2, 3), mode="reflect")),
            S_("replicate_2d", (randn(1, 2, 3, 3),), dict(pad=(1, 2, 2, 0), mode="replicate")),
            S_("circular", (randn(1, 2, 3),), dict(pad=(2, 1), mode="circular")),
        ],
    ),
    OpRow(
        "torch.amax",
        lambda x, **kw: torch.amax(x, **kw),
        lambda: [
            S_(
                "ties_dim1",
                (torch.tensor([[1.0, 3.0, 3.0], [2.0, -1.0, 0.5]], dtype=torch.float64),),
                dict(dim=1),
            ),
            S_("all", (randn(3, 4),)),
            S_("dims_keepdim", (randn(2, 3, 4),), dict(dim=(0, 2), keepdim=True)),
        ],
    ),
    OpRow(
        "x.amin",
        lambda x, **kw: x.amin(**kw),
        lambda: [
            S_(
                "ties_dim0",
                (torch.tensor([[1.0, -2.0], [1.0, 0.5], [4.0, -2.0]], dtype=torch.float64),),
                dict(dim=0),
            ),
            S_("empty_dims", (randn(3, 2),), dict(dim=())),
        ],
    ),
    OpRow(
        "torch.logsumexp",
        lambda x, **kw: torch.logsumexp(x, **kw),
        lambda: [
            S_("dim1", (randn(3, 4),), dict(dim=1)),
            S_("dims_keepdim", (randn(2, 3, 4),), dict(dim=(0, 2), keepdim=True)),
        ],
    ),
    OpRow(
        "torch.baddbmm",
        lambda *a, **kw: torch.baddbmm(*a, **kw),
        lambda: [
            S_("2x3x4", (randn(2, 3, 5), randn(2, 3, 4), randn(2, 4, 5))),
            S_(
                "broadcast_beta_alpha",
                (randn(5), randn(2, 3, 4), randn(2, 4, 5)),
                dict(beta=0.5, alpha=-2.0),
            ),
            S_("beta0", (randn(2, 3, 5), randn(2, 3, 4), randn(2, 4, 5)), dict(beta=0)),
        ],
    ),
    OpRow(
        "x.addbmm",
        lambda x, *a, **kw: x.addbmm(*a, **kw),
        lambda: [
            S_("3x2x4", (randn(2, 5), randn(3, 2, 4), randn(3, 4, 5))),
            S_("broadcast_alpha", (randn(1, 5), randn(3, 2, 4), randn(3, 4, 5)), dict(alpha=1.5)),
        ],
    ),
    OpRow(
        "torch.addmv",
        lambda *a, **kw: torch.addmv(*a, **kw),
        lambda: [
            S_("3x4", (randn(3), randn(3, 4), randn(4))),
            S_("scalar_input", (randn(1), randn(3, 4), randn(4)), dict(beta=2.0, alpha=0.5)),
        ],
    ),
    OpRow(
        "torch.cumsum",
        lambda x, **kw: torch.cumsum(x, **kw),
        lambda: [
            S_("dim1", (randn(3, 4),), dict(dim=1)),
            S_("dim0_3d", (randn(4, 2, 3),), dict(dim=0)),
            S_("0d", (randn(1).reshape(()),), dict(dim=0)),
        ],
    ),
    OpRow(
        "torch.maximum",
        lambda x, y: torch.maximum(x, y),
        lambda: [
            S_("ties_broadcast", (_tied(3, 4), _tied(4))),
            S_("0d_other", (randn(3, 4), randn(1).reshape(()))),
        ],
    ),
    OpRow(
        "torch.min(x, y)",
        lambda x, y: torch.min(x, y),
        lambda: [S_("ties_broadcast", (_tied(3, 1), _tied(3, 4)))],
    ),
    OpRow(
        "x.clamp",
        lambda x, *bounds, **kw: x.clamp(*bounds, **kw),
        lambda: [
            S_("numbers_at_bounds", (_tied(3, 4),), dict(min=-0.5, max=0.5)),
            S_("min_only", (_tied(3, 4),), dict(min=0.0)),
            S_("tensors_broadcast", (_tied(3, 4), _tied(4) - 0.5, _tied(3, 1) + 0.5)),
            S_("tensors_min_above_max", (randn(3, 4), randn(4) + 1.0, randn(4) - 1.0)),
        ],
    ),
    OpRow(
        "torch.clamp_min / clamp_max",
        lambda x, b, **kw: torch.clamp_min(x, b) if kw["low"] else torch.clamp_max(x, b),
        lambda: [
            S_("min_tensor", (_tied(3, 4), _tied(4)), dict(low=True)),
            S_("max_tensor", (_tied(3, 4), _tied(4)), dict(low=False)),
        ],
    ),
    OpRow(
        "torch._weight_norm",
        lambda v, g, *, dim: torch._weight_norm(v, g, dim),
        lambda: [
            S_("dim0", (randn(3, 2, 2), positive(3, 1, 1)), dict(dim=0)),
            S_("dim2_conv", (randn(2, 2, 3), positive(1, 1, 3)), dict(dim=2)),
            S_("whole", (randn(2, 3), positive(1).reshape(())), dict(dim=-1)),
        ],
        _weight_norm_oracle,
    ),
    OpRow(
        "torch.cumprod",
        lambda x, **kw: torch.cumprod(x, **kw),
        lambda: [
            S_("dim1", (randn(3, 4),), dict(dim=1)),
            S_("zeros_dim0_3d", (with_zeros(4, 2, 3),), dict(dim=0)),
            S_("two_zeros_in_a_row", (torch.tensor([1.5, 0.0, -2.0, 0.0, 0.5]),), dict(dim=0)),
            S_("0d", (randn(1).reshape(()),), dict(dim=0)),
        ],
    ),
    OpRow(
        "torch.einsum",
        lambda *xs, eq: torch.einsum(eq, *xs),
        lambda: [
            S_("matmul", (randn(3, 4), randn(4, 2)), dict(eq="ij,jk->ik")),
            S_("batched_heads", (randn(2, 3, 4), randn(2, 5, 4)), dict(eq="bqd,bkd->bqk")),
            S_("implicit_transpose", (randn(3, 4), randn(4, 2)), dict(eq="ij,jk")),
            S_("outer", (randn(3), randn(4)), dict(eq="i,j->ij")),
            S_("summed_alone", (randn(3, 4), randn(4, 2)), dict(eq="ij,jk->k")),
            S_("three_operands", (randn(2, 3), randn(3, 4), randn(4, 2)), dict(eq="ij,jk,kl->il")),
            S_("shared_label_3", (randn(3), randn(3), randn(3)), dict(eq="i,i,i->")),
            S_("trace", (randn(3, 3),), dict(eq="ii")),
            S_("diagonal_with_other", (randn(3, 3), randn(3, 2)), dict(eq="ii,ij->ij")),
            S_("ellipsis_broadcast", (randn(2, 3, 4), randn(4, 5)), dict(eq="...ij,...jk->...ik")),
            S_("size1_broadcast", (randn(1, 4), randn(3, 4)), dict(eq="bi,bi->b")),
            S_("permute_only", (randn(2, 3, 4),), dict(eq="abc->cab")),
            S_("with_zeros", (with_zeros(3, 4), with_zeros(4, 3)), dict(eq="ij,jk->ik")),
        ],
    ),
    OpRow(
        "torch.tril",
        lambda x, **kw: torch.tril(x, **kw),
        lambda: [
            S_("4x3", (randn(4, 3),)),
            S_("batched_offset", (randn(2, 3, 4),), dict(diagonal=1)),
        ],
    ),
    OpRow(
        "x.triu",
        lambda x, **kw: x.triu(**kw),
        lambda: [
            S_("3x4_minus1", (randn(3, 4),), dict(diagonal=-1)),
        ],
    ),
    OpRow(
        "F.elu",
        lambda x, **kw: F.elu(x, **kw),
        lambda: [
            S_("3x4_zeros", (with_zeros(3, 4),)),
            S_("alpha_0.5", (randn(2, 5),), dict(alpha=0.5)),
        ],
    ),
    OpRow("F.selu", F.selu, lambda: [S_("3x4_zeros", (with_zeros(3, 4),))]),
    OpRow(
        "F.celu",
        lambda x, **kw: F.celu(x, **kw),
        lambda: [
            S_("3x4_zeros", (with_zeros(3, 4),)),
            S_("alpha_2", (randn(2, 5) * 2,), dict(alpha=2.0)),
        ],
    ),
    OpRow(
        "F.softplus",
        lambda x, **kw: F.softplus(x, **kw),
        lambda: [
            S_("3x4", (randn(3, 4) * 3,)),
            S_("beta_2_threshold_1", (randn(2, 6) * 2,), dict(beta=2.0, threshold=1.0)),
        ],
    ),
    OpRow("F.mish", F.mish, lambda: [S_("3x4", (randn(3, 4) * 2,))]),
    OpRow(
        "F.hardswish",
        F.hardswish,
        lambda: [
            S_(
                "edges",
                (torch.tensor([-4.0, -3.0, -1.0, 0.0, 2.0, 3.0, 5.0], dtype=torch.float64),),
            ),
            S_("3x4", (randn(3, 4) * 4,)),
        ],
    ),
    OpRow(
        "F.hardsigmoid",
        F.hardsigmoid,
        lambda: [
            S_("edges", (torch.tensor([-4.0, -3.0, 0.5, 3.0, 4.0], dtype=torch.float64),)),
        ],
    ),
    OpRow(
        "F.hardtanh",
        lambda x, **kw: F.hardtanh(x, **kw),
        lambda: [
            S_("edges", (torch.tensor([-2.0, -1.0, 0.3, 1.0, 2.0], dtype=torch.float64),)),
            S_("range", (randn(3, 4),), dict(min_val=-0.5, max_val=0.25)),
        ],
    ),
    OpRow(
        "F.relu6",
        F.relu6,
        lambda: [
            S_("edges", (torch.tensor([-1.0, 0.0, 3.0, 6.0, 7.0], dtype=torch.float64),)),
        ],
    ),
    OpRow("F.logsigmoid", F.logsigmoid, lambda: [S_("3x4", (randn(3, 4) * 3,))]),
    OpRow(
        "F.leaky_relu",
        lambda x, **kw: F.leaky_relu(x, **kw),
        lambda: [
            S_("3x4_zeros", (with_zeros(3, 4),)),
            S_("slope_0.2", (randn(2, 5),), dict(negative_slope=0.2)),
            S_("slope_-1.5", (randn(2, 3),), dict(negative_slope=-1.5)),
            S_("slope_0", (randn(4),), dict(negative_slope=0.0)),
        ],
    ),
    # ------------------------------------------------------------------ reductions
    OpRow("x.sum()", lambda x: x.sum(), lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow(
        "x.sum(dim,keepdim)",
        lambda x, **kw: x.sum(**kw),
        lambda: [
            S_("dim1", (randn(3, 4),), dict(dim=1)),
            S_("dim-1_keepdim", (randn(2, 3, 4),), dict(dim=-1, keepdim=True)),
            S_("dim0_keepdim_noncontig", (randn(4, 3).t(),), dict(dim=0, keepdim=True)),
        ],
    ),
    OpRow(
        "x.sum((0,2))",
        lambda x: x.sum((0, 2)),
        lambda: [S_("2x3x4", (randn(2, 3, 4),))],
    ),
    OpRow("torch.sum(x,1)", lambda x: torch.sum(x, 1), lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("x.mean()", lambda x: x.mean(), lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow(
        "x.mean(dim=-1,keepdim=True)",
        lambda x: x.mean(dim=-1, keepdim=True),
        lambda: [S_("2x3x4", (randn(2, 3, 4),))],
    ),
    OpRow("x.mean(0)", lambda x: x.mean(0), lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow(
        "torch.softmax",
        lambda x, **kw: torch.softmax(x, **kw),
        lambda: [
            S_("dim-1", (randn(3, 4),), dict(dim=-1)),
            S_("dim0", (randn(3, 4),), dict(dim=0)),
            S_("3d_dim1", (randn(2, 3, 4),), dict(dim=1)),
        ],
    ),
    OpRow(
        "F.softmax",
        lambda x: F.softmax(x, dim=-1),
        lambda: [S_("noncontig", (randn(5, 3).t(),))],
    ),
    OpRow("x.softmax(-1)", lambda x: x.softmax(-1), lambda: [S_("2x2x4", (randn(2, 2, 4),))]),
    OpRow(
        "F.log_softmax",
        lambda x: F.log_softmax(x, dim=1),
        lambda: [S_("3x4", (randn(3, 4),))],
    ),
    OpRow(
        "torch.log_softmax",
        lambda x: torch.log_softmax(x, -1),
        lambda: [S_("2x3x4", (randn(2, 3, 4),))],
    ),
    # ------------------------------------------------------------------ shape and view
    OpRow(
        "x.view",
        lambda x, **kw: x.view(*kw["shape"]),
        lambda: [
            S_("4x5->2x10", (randn(4, 5),), dict(shape=(2, 10))),
            S_("2x3x2->-1", (randn(2, 3, 2),), dict(shape=(-1,))),
        ],
    ),
    OpRow(
        "x.reshape",
        lambda x: x.reshape(5, 4),
        lambda: [S_("4x5", (randn(4, 5),)), S_("noncontig", (randn(5, 4).t(),))],
    ),
    OpRow(
        "torch.reshape", lambda x: torch.reshape(x, (2, -1)), lambda: [S_("3x4", (randn(3, 4),))]
    ),
    OpRow(
        "x.view_as",
        lambda x, y: x.view_as(y),
        lambda: [S_("4x5_as_2x10", (randn(4, 5), randn(2, 10)))],
    ),
    OpRow(
        "x.reshape_as",
        lambda x, y: x.reshape_as(y),
        lambda: [S_("noncontig_as_20", (randn(5, 4).t(), randn(20)))],
    ),
    OpRow("x.flatten(1)", lambda x: x.flatten(1), lambda: [S_("2x3x2", (randn(2, 3, 2),))]),
    OpRow("torch.flatten", torch.flatten, lambda: [S_("2x3x2", (randn(2, 3, 2),))]),
    OpRow(
        "x.transpose",
        lambda x, **kw: x.transpose(*kw["dims"]),
        lambda: [
            S_("0,1", (randn(3, 4),), dict(dims=(0, 1))),
            S_("-1,0_3d", (randn(2, 3, 4),), dict(dims=(-1, 0))),
        ],
    ),
    OpRow("x.t()", lambda x: x.t(), lambda: [S_("3x4", (randn(3, 4),)), S_("1d", (randn(4),))]),
    OpRow("x.T", lambda x: x.T, lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("x.mT", lambda x: x.mT, lambda: [S_("2x3x4", (randn(2, 3, 4),))]),
    OpRow(
        "x.permute",
        lambda x, **kw: x.permute(*kw["dims"]),
        lambda: [
            S_("2,0,1", (randn(2, 3, 4),), dict(dims=(2, 0, 1))),
            S_("-1,0,1", (randn(2, 3, 4),), dict(dims=(-1, 0, 1))),
        ],
    ),
    OpRow(
        "x.contiguous()", lambda x: x.contiguous(), lambda: [S_("noncontig", (randn(4, 3).t(),))]
    ),
    OpRow(
        "x.expand",
        lambda x: x.expand(3, -1, -1).exp(),
        lambda: [S_("2x3", (randn(2, 3),)), S_("1x2x3", (randn(1, 2, 3),))],
    ),
    OpRow(
        "x.expand*y",
        lambda x, y: x.expand(3, -1, -1) * y,
        lambda: [S_("2x3*3x1x1", (randn(2, 3), randn(3, 1, 1)))],
    ),
    OpRow(
        "x.unsqueeze",
        lambda x, **kw: x.unsqueeze(kw["dim"]),
        lambda: [
            S_("dim1", (randn(3, 4),), dict(dim=1)),
            S_("dim-1", (randn(3, 4),), dict(dim=-1)),
        ],
    ),
    OpRow("x.squeeze()", lambda x: x.squeeze(), lambda: [S_("3x1x4x1", (randn(3, 1, 4, 1),))]),
    OpRow(
        "x.squeeze(dim)",
        lambda x, **kw: x.squeeze(kw["dim"]),
        lambda: [
            S_("dim1", (randn(3, 1, 4),), dict(dim=1)),
            S_("dim-1", (randn(3, 4, 1),), dict(dim=-1)),
        ],
    ),
    # ------------------------------------------------------------------ indexing
    OpRow("x[0]", lambda x: x[0], lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("x[:,1:3]", lambda x: x[:, 1:3], lambda: [S_("3x4", (randn(3, 4),))]),
    OpRow("x[...,None,::2]", lambda x: x[..., None, ::2], lambda: [S_("2x3x4", (randn(2, 3, 4),))]),
    OpRow("x[1,...,-1]", lambda x: x[1, ..., -1], lambda: [S_("3x2x4", (randn(3, 2, 4),))]),
    # ------------------------------------------------------------------ joining and splitting
    OpRow(
        "torch.cat",
        lambda a, b, **kw: torch.cat([a, b], **kw),
        lambda: [
            S_("dim1", (randn(2, 3), randn(2, 2)), dict(dim=1)),
            S_("dim-1_3d", (randn(2, 2, 1), randn(2, 2, 3)), dict(dim=-1)),
            S_("dim0_noncontig", (randn(3, 2).t(), randn(1, 3))),
        ],
    ),
    OpRow(
        "torch.stack",
        lambda a, b, **kw: torch.stack([a, b], **kw),
        lambda: [
            S_("dim0", (randn(2, 3), randn(2, 3)), dict(dim=0)),
            S_("dim-1", (randn(2, 3), randn(2, 3)), dict(dim=-1)),
        ],
    ),
    OpRow(
        "torch.split",
        _split_cat,
        lambda: [S_("size2_dim1_3x5", (randn(3, 5),))],
    ),
    OpRow(
        "torch.split[1]",
        lambda x: torch.split(x, 2, dim=1)[1].tanh(),
        lambda: [S_("size2_dim1_3x5_one_piece", (randn(3, 5),))],
    ),
    OpRow("x.split([1,3],0)", _split_sections_cat, lambda: [S_("4x3", (randn(4, 3),))]),
    OpRow("x.chunk(2,-1)", _chunk_product, lambda: [S_("3x4", (randn(3, 4),))]),
    # ------------------------------------------------------------------ layers
    OpRow(
        "F.embedding",
        lambda w, **kw: F.embedding(kw["idx"], w, padding_idx=kw.get("padding_idx")),
        lambda: [
            S_("repeated", (randn(5, 3),), dict(idx=torch.tensor([[0, 2, 0], [4, 2, 2]]))),
            S_("padding_idx2", (randn(5, 3),), dict(idx=torch.tensor([0, 2, 3, 2]), padding_idx=2)),
            S_(
                "padding_idx-1",
                (randn(5, 3),),
                dict(idx=torch.tensor([[4, 1], [1, 4]]), padding_idx=-1),
            ),
        ],
    ),
    OpRow(
        "F.dropout_eval",
        lambda x: F.dropout(x, p=0.3, training=False),
        lambda: [S_("3x4", (randn(3, 4),))],
    ),
    OpRow(
        "F.dropout_train",
        lambda x, **kw: F.dropout(x, p=kw["p"], training=True),
        lambda: [
            S_("p0.4_4x5", (randn(4, 5),), dict(p=0.4)),
            S_("p0.5_2x3x2", (randn(2, 3, 2),), dict(p=0.5)),
        ],
        _dropout_train_oracle,
    ),
    OpRow(
        "F.dropout1d_eval_or_p0",
        lambda x, **kw: F.dropout1d(x, **kw),
        lambda: [
            S_("eval_2x3x4", (randn(2, 3, 4),), dict(p=0.3, training=False)),
            S_("p0_train_3x4", (randn(3, 4),), dict(p=0.0, training=True)),
        ],
    ),
    OpRow(
        "F.dropout1d_train",
        lambda x, **kw: F.dropout1d(x, p=kw["p"], training=True),
        lambda: [
            S_("p0.5_3x4x2", (randn(3, 4, 2),), dict(p=0.5)),
            S_("p0.4_unbatched_4x3", (randn(4, 3),), dict(p=0.4)),
        ],
        _dropout_train_oracle,
    ),
    OpRow(
        "F.layer_norm",
        _layer_norm,
        lambda: [
            S_("last1_affine", (randn(2, 4), randn(4), randn(4)), dict(normalized_shape=(4,))),
            S_("last1_plain", (randn(3, 4),), dict(normalized_shape=(4,))),
            S_(
                "last2_affine",
                (randn(2, 2, 3), randn(2, 3), randn(2, 3)),
                dict(normalized_shape=(2, 3)),
            ),
            S_(
                "last2_weight_only",
                (randn(2, 2, 3), randn(2, 3)),
                dict(normalized_shape=(2, 3), eps=1e-3),
            ),
        ],
        _layer_norm_oracle,
    ),
    # ------------------------------------------------------------------ convolution
    OpRow(
        "F.conv1d",
        lambda x, w, b=None, **kw: F.conv1d(x, w, b, **kw),
        lambda: [
            S_(
                "stride_pad_groups",
                (randn(2, 4, 7), randn(6, 2, 3), randn(6)),
                dict(stride=2, padding=1, groups=2),
            ),
            S_(
                "unbatched_same_dilated",
                (with_zeros(3, 6), randn(2, 3, 2)),
                dict(padding="same", dilation=2),
            ),
        ],
    ),
    OpRow(
        "F.conv2d",
        lambda x, w, b=None, **kw: F.conv2d(x, w, b, **kw),
        lambda: [
            S_(
                "same_dilated",
                (randn(1, 3, 5, 6), randn(4, 3, 2, 3)),
                dict(padding="same", dilation=(1, 2)),
            ),
            S_(
                "depthwise",
                (with_zeros(1, 2, 4, 4), randn(2, 1, 3, 3), randn(2)),
                dict(padding=1, groups=2),
            ),
            S_("patches", (randn(2, 2, 4, 4), randn(3, 2, 2, 2), randn(3)), dict(stride=2)),
            S_(
                "asymmetric_valid",
                (randn(1, 2, 5, 4), randn(2, 2, 3, 1)),
                dict(stride=(2, 1), padding="valid"),
            ),
        ],
    ),
    OpRow(
        "F.conv3d",
        lambda x, w, b=None, **kw: F.conv3d(x, w, b, **kw),
        lambda: [
            S_(
                "stride_pad",
                (randn(1, 2, 3, 4, 4), randn(2, 2, 2, 2, 2), randn(2)),
                dict(stride=(1, 2, 1), padding=1),
            ),
        ],
    ),
    OpRow(
        "F.conv_transpose1d",
        lambda x, w, b=None, **kw: F.conv_transpose1d(x, w, b, **kw),
        lambda: [
            S_(
                "stride_pad_outpad",
                (randn(2, 4, 3), randn(4, 3, 3), randn(3)),
                dict(stride=2, padding=1, output_padding=1),
            ),
            S_("unbatched_dilated", (randn(2, 4), randn(2, 2, 2)), dict(dilation=2)),
        ],
    ),
    OpRow(
        "F.conv_transpose2d",
        lambda x, w, b=None, **kw: F.conv_transpose2d(x, w, b, **kw),
        lambda: [
            S_(
                "groups_dilated",
                (randn(1, 4, 3, 3), randn(4, 1, 2, 3), randn(2)),
                dict(stride=(2, 1), groups=2, dilation=(2, 1)),
            ),
            S_("upsample2", (with_zeros(2, 2, 2, 3), randn(2, 3, 2, 2)), dict(stride=2)),
        ],
    ),
    OpRow(
        "F.conv_transpose3d",
        lambda x, w, b=None, **kw: F.conv_transpose3d(x, w, b, **kw),
        lambda: [
            S_(
                "stride2_pad",
                (randn(1, 2, 2, 2, 2), randn(2, 2, 2, 2, 2)),
                dict(stride=2, padding=1),
            )
        ],
    ),
    # ------------------------------------------------------------------ pooling, resampling
    OpRow(
        "F.max_pool1d",
        lambda x, **kw: F.max_pool1d(x, **kw),
        lambda: [
            S_("overlap_pad", (randn(2, 3, 7),), dict(kernel_size=3, stride=2, padding=1)),
            S_(
                "ties_dilated_ceil",
                (torch.tensor([[[1.0, 2, 2, 0, 2, 1, 2, 2]]], dtype=torch.float64),),
                dict(kernel_size=2, dilation=2, ceil_mode=True),
            ),
        ],
    ),
    OpRow(
        "F.max_pool2d",
        lambda x, **kw: F.max_pool2d(x, **kw),
        lambda: [
            S_("resnet_stem", (randn(1, 2, 5, 5),), dict(kernel_size=3, stride=2, padding=1)),
            S_(
                "ties_unbatched",
                (torch.tensor([[[0.5, 0.5, 1], [0.5, 1, 1], [0, 0, 0]]], dtype=torch.float64),),
                dict(kernel_size=2, stride=1),
            ),
        ],
    ),
    OpRow(
        "F.max_pool3d",
        lambda x, **kw: F.max_pool3d(x, **kw),
        lambda: [
            S_(
                "2x3x4",
                (randn(1, 2, 2, 3, 4),),
                dict(kernel_size=2, stride=(1, 2, 2), ceil_mode=True),
            )
        ],
    ),
    OpRow(
        "F.adaptive_max_pool2d",
        lambda x, **kw: F.adaptive_max_pool2d(x, **kw),
        lambda: [S_("5x7_to_3x4", (randn(1, 2, 5, 7),), dict(output_size=(3, None)))],
    ),
    OpRow(
        "F.adaptive_max_pool1d",
        lambda x, **kw: F.adaptive_max_pool1d(x, **kw),
        lambda: [S_("unbatched", (randn(2, 7),), dict(output_size=3))],
    ),
    OpRow(
        "F.adaptive_max_pool3d",
        lambda x, **kw: F.adaptive_max_pool3d(x, **kw),
        lambda: [S_("to_1", (randn(1, 2, 2, 3, 3),), dict(output_size=1))],
    ),
    OpRow(
        "F.avg_pool1d",
        lambda x, **kw: F.avg_pool1d(x, **kw),
        lambda: [
            S_("pad_counted", (randn(2, 2, 7),), dict(kernel_size=3, padding=1)),
            S_(
                "pad_not_counted_ceil",
                (randn(1, 2, 6),),
                dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
            ),
        ],
    ),
    OpRow(
        "F.avg_pool2d",
        lambda x, **kw: F.avg_pool2d(x, **kw),
        lambda: [
            S_(
                "ceil_not_counted",
                (with_zeros(1, 2, 5, 5),),
                dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
            ),
            S_(
                "divisor_override",
                (randn(2, 4, 5),),
                dict(kernel_size=(2, 3), stride=1, divisor_override=4),
            ),
        ],
    ),
    OpRow(
        "F.avg_pool3d",
        lambda x, **kw: F.avg_pool3d(x, **kw),
        lambda: [S_("pad", (randn(1, 1, 3, 4, 4),), dict(kernel_size=2, padding=1))],
    ),
    OpRow(
        "F.adaptive_avg_pool1d",
        lambda x, **kw: F.adaptive_avg_pool1d(x, **kw),
        lambda: [S_("7_to_3", (randn(2, 3, 7),), dict(output_size=3))],
    ),
    OpRow(
        "F.adaptive_avg_pool2d",
        lambda x, **kw: F.adaptive_avg_pool2d(x, **kw),
        lambda: [
            S_("5x7_to_3x4", (randn(1, 2, 5, 7),), dict(output_size=(3, 4))),
            S_("global", (randn(2, 3, 3, 3),), dict(output_size=1)),
        ],
    ),
    OpRow(
        "F.adaptive_avg_pool3d",
        lambda x, **kw: F.adaptive_avg_pool3d(x, **kw),
        lambda: [S_("grow", (randn(1, 1, 2, 3, 3),), dict(output_size=(3, 2, None)))],
    ),
    OpRow(
        "F.interpolate",
        lambda x, **kw: F.interpolate(x, **kw),
        lambda: [
            S_("nearest_scale", (randn(1, 2, 3, 4),), dict(scale_factor=1.7)),
            S_("nearest_exact_size", (randn(2, 1, 5),), dict(size=3, mode="nearest-exact")),
            S_("linear", (randn(1, 2, 6),), dict(size=4, mode="linear")),
            S_("bilinear_scale", (randn(1, 2, 3, 4),), dict(scale_factor=2.5, mode="bilinear")),
            S_(
                "bilinear_corners",
                (randn(1, 1, 3, 4),),
                dict(size=(5, 2), mode="bilinear", align_corners=True),
            ),
            S_(
                "trilinear",
                (randn(1, 1, 2, 2, 3),),
                dict(scale_factor=(1.5, 2, 1), mode="trilinear", recompute_scale_factor=True),
            ),
        ],
    ),
    OpRow(
        "F.unfold",
        lambda x, **kw: F.unfold(x, **kw),
        lambda: [
            S_(
                "pad_stride_dilation",
                (randn(1, 2, 4, 5),),
                dict(kernel_size=(2, 3), padding=1, stride=(2, 1), dilation=(1, 2)),
            )
        ],
    ),
    OpRow(
        "F.fold",
        lambda x, **kw: F.fold(x, **kw),
        lambda: [
            S_(
                "overlap_pad",
                (randn(2, 2 * 4, 15),),
                dict(output_size=(4, 5), kernel_size=2, padding=1, stride=(1, 2)),
            ),
            S_(
                "unbatched",
                (randn(3, 2),),
                dict(output_size=(3, 3), kernel_size=(3, 1), stride=(1, 2)),
            ),
        ],
    ),
    OpRow(
        "x.unfold",
        lambda x, **kw: x.unfold(**kw),
        lambda: [S_("overlap", (randn(2, 7),), dict(dimension=1, size=3, step=2))],
    ),
    OpRow(
        "F.glu",
        lambda x, **kw: F.glu(x, **kw),
        lambda: [S_("dim0", (randn(4, 3),), dict(dim=0))],
    ),
    OpRow(
        "F.prelu",
        lambda x, w: F.prelu(x, w),
        lambda: [
            S_("per_channel", (with_zeros(2, 3, 2), positive(3))),
            S_("shared", (randn(4), positive(1))),
        ],
    ),
    OpRow(
        "torch.index_select",
        lambda x, **kw: torch.index_select(x, **kw),
        lambda: [S_("repeats", (randn(3, 4),), dict(dim=1, index=torch.tensor([3, 0, 3])))],
    ),
    OpRow(
        "F.interpolate(bicubic, area)",
        lambda x, **kw: F.interpolate(x, **kw),
        lambda: [
            S_("bicubic", (randn(1, 1, 3, 4),), dict(size=(5, 3), mode="bicubic")),
            S_(
                "bicubic_corners",
                (randn(1, 2, 2, 3),),
                dict(scale_factor=1.5, mode="bicubic", align_corners=True),
            ),
            S_("area", (randn(1, 2, 5, 7),), dict(size=(2, 3), mode="area")),
        ],
    ),
    # ------------------------------------------------------------------ normalisation
    OpRow(
        "F.batch_norm(eval)",
        lambda x, w=None, b=None, **kw: F.batch_norm(
            x, kw["mean"], kw["var"], w, b, eps=kw.get("eps", 1e-5)
        ),
        lambda: [
            S_(
                "affine_2d",
                (randn(2, 3, 2, 2), randn(3), randn(3)),
                dict(mean=randn(3), var=positive(3)),
            ),
            S_("plain_1d", (with_zeros(4, 3),), dict(mean=randn(3), var=positive(3), eps=1e-3)),
        ],
    ),
    OpRow(
        "F.batch_norm(batch statistics)",
        lambda x, w=None, b=None, **kw: F.batch_norm(x, None, None, w, b, training=True),
        lambda: [
            S_("affine_3d", (randn(3, 2, 2), randn(2), randn(2))),
            S_("plain_2d", (randn(2, 2, 1, 2),)),
        ],
        _channel_norm_oracle("batch"),
    ),
    OpRow(
        "F.group_norm",
        lambda x, w=None, b=None, **kw: F.group_norm(x, kw["groups"], w, b),
        lambda: [
            S_("2_groups_affine", (randn(2, 4, 2), randn(4), randn(4)), dict(groups=2)),
            S_("1_group_plain", (randn(1, 2, 2, 2),), dict(groups=1)),
        ],
        _channel_norm_oracle("group"),
    ),
    OpRow(
        "F.instance_norm",
        lambda x, w=None, b=None, **kw: F.instance_norm(x, weight=w, bias=b),
        lambda: [
            S_("affine_1d", (randn(2, 2, 3), randn(2), randn(2))),
            S_("plain_2d", (randn(1, 2, 2, 2),)),
        ],
        _channel_norm_oracle("instance"),
    ),
    OpRow(
        "F.rms_norm",
        lambda x, w=None, **kw: F.rms_norm(x, kw["normalized_shape"], w, kw.get("eps")),
        lambda: [
            S_("last1_weight", (randn(2, 4), randn(4)), dict(normalized_shape=(4,), eps=1e-6)),
            S_("last2_default_eps", (randn(2, 2, 3),), dict(normalized_shape=(2, 3))),
        ],
        _rms_norm_oracle,
    ),
    # ------------------------------------------------------------------ losses
    OpRow(
        "F.cross_entropy",
        lambda x, *rest, **kw: F.cross_entropy(x, rest[0] if rest else kw.pop("labels"), **kw),
        lambda: [
            S_("mean", (randn(3, 4),), dict(labels=torch.tensor([1, 0, 3]))),
            S_(
                "none_ignore_2d",
                (randn(2, 3, 2),),
                dict(labels=torch.tensor([[0, -100], [2, 1]]), reduction="none"),
            ),
            S_(
                "weight_smoothing",
                (randn(3, 4),),
                dict(labels=torch.tensor([3, 3, 0]), weight=positive(4), label_smoothing=0.2),
            ),
            S_(
                "probabilities",
                (randn(2, 3), torch.rand(2, 3, generator=_GEN, dtype=torch.float64)),
                dict(reduction="sum"),
            ),
        ],
    ),
    OpRow(
        "F.nll_loss",
        lambda x, **kw: F.nll_loss(x, kw.pop("labels"), **kw),
        lambda: [
            S_(
                "mean_weight",
                (randn(3, 4),),
                dict(labels=torch.tensor([1, 0, 1]), weight=positive(4)),
            ),
            S_("unbatched", (randn(4),), dict(labels=torch.tensor(2))),
        ],
    ),
    OpRow(
        "F.mse_loss",
        lambda x, t, **kw: F.mse_loss(x, t, **kw),
        lambda: [
            S_("mean", (randn(2, 3), randn(2, 3))),
            S_(
                "none_equal",
                (
                    torch.tensor([1.0, 2.0], dtype=torch.float64),
                    torch.tensor([1.0, 0.5], dtype=torch.float64),
                ),
                dict(reduction="none"),
            ),
        ],
    ),
    OpRow(
        "F.l1_loss",
        lambda x, t, **kw: F.l1_loss(x, t, **kw),
        lambda: [
            S_(
                "sum_tie",
                (
                    torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64),
                    torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64),
                ),
                dict(reduction="sum"),
            )
        ],
    ),
    OpRow(
        "F.smooth_l1_loss",
        lambda x, t, **kw: F.smooth_l1_loss(x, t, **kw),
        lambda: [S_("beta", (randn(2, 4), randn(2, 4)), dict(beta=0.7))],
    ),
    OpRow(
        "F.huber_loss",
        lambda x, t, **kw: F.huber_loss(x, t, **kw),
        lambda: [S_("none", (randn(3, 2), randn(3, 2)), dict(delta=0.5, reduction="none"))],
    ),
    OpRow(
        "F.binary_cross_entropy_with_logits",
        lambda x, t, **kw: F.binary_cross_entropy_with_logits(x, t, **kw),
        lambda: [
            S_(
                "pos_weight",
                (randn(3, 2), torch.rand(3, 2, generator=_GEN, dtype=torch.float64)),
                dict(pos_weight=positive(2)),
            ),
            S_(
                "weight_none",
                (randn(4), torch.rand(4, generator=_GEN, dtype=torch.float64)),
                dict(weight=positive(4), reduction="none"),
            ),
        ],
    ),
    OpRow(
        "F.kl_div",
        lambda x, t, **kw: F.kl_div(x, t, **kw),
        lambda: [
            S_(
                "batchmean",
                (randn(2, 3), torch.rand(2, 3, generator=_GEN, dtype=torch.float64)),
                dict(reduction="batchmean"),
            ),
            S_("log_target", (randn(2, 3), randn(2, 3)), dict(log_target=True, reduction="sum")),
        ],
    ),
    # ------------------------------------------------------------------ attention, masking, casts
    OpRow(
        "F.scaled_dot_product_attention",
        _sdpa,
        lambda: [
            S_("plain", (randn(2, 2, 3, 4), randn(2, 2, 5, 4), randn(2, 2, 5, 3))),
            S_(
                "bool_mask_scale",
                (randn(1, 2, 3, 4), randn(1, 2, 5, 4), randn(1, 2, 5, 3)),
                dict(
                    attn_mask=torch.tensor(
                        [[1, 1, 0, 1, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool
                    ),
                    scale=0.7,
                ),
            ),
            S_(
                "float_mask_input",
                (randn(2, 1, 3, 4), randn(2, 1, 4, 4), randn(2, 1, 4, 2), randn(2, 1, 1, 4)),
            ),
            S_(
                "causal",
                (randn(1, 2, 4, 3), randn(1, 2, 4, 3), randn(1, 2, 4, 2)),
                dict(is_causal=True),
            ),
            S_(
                "gqa",
                (randn(1, 4, 2, 3), randn(1, 2, 3, 3), randn(1, 2, 3, 2)),
                dict(enable_gqa=True),
            ),
        ],
        _sdpa_oracle,
    ),
    OpRow(
        "x.masked_fill(scalar)",
        lambda x, **kw: x.masked_fill(kw["mask"], -1e4),
        lambda: [
            S_("bcast_mask", (randn(3, 4),), dict(mask=torch.tensor([[True, False, False, True]]))),
        ],
    ),
    OpRow(
        "torch.masked_fill(tensor)",
        lambda x, v, **kw: torch.masked_fill(x, kw["mask"], v),
        lambda: [
            S_(
                "0d_value",
                (randn(2, 3), randn(())),
                dict(mask=torch.tensor([[True, False, True], [False, False, True]])),
            ),
        ],
    ),
    OpRow(
        "torch.where",
        lambda x, y, **kw: torch.where(kw["cond"], x, y),
        lambda: [
            S_(
                "bcast",
                (randn(3, 4), randn(4)),
                dict(cond=torch.tensor([[True], [False], [True]])),
            ),
        ],
    ),
    OpRow(
        "torch.where(scalar other)",
        lambda x, **kw: torch.where(kw["cond"], x, 0.5),
        lambda: [S_("3x2", (randn(3, 2),), dict(cond=torch.tensor([[True, False]] * 3)))],
    ),
    OpRow(
        "torch.where(scalar input)",
        lambda y, **kw: torch.where(kw["cond"], -2.0, y),
        lambda: [S_("3x2", (randn(3, 2),), dict(cond=torch.tensor([[True, False]] * 3)))],
    ),
    OpRow(
        "x.where",
        lambda x, y, **kw: x.where(kw["cond"], y),
        lambda: [S_("2x3", (randn(2, 3), randn(2, 3)), dict(cond=torch.rand(2, 3) > 0.5))],
    ),
    OpRow(
        "torch.gather",
        lambda x, **kw: torch.gather(x, kw["dim"], kw["index"]),
        lambda: [
            S_(
                "dim1_repeats",
                (randn(3, 4),),
                dict(dim=1, index=torch.tensor([[0, 0, 3], [2, 1, 2], [3, 3, 3]])),
            ),
            S_(
                "dim0_short",
                (randn(3, 4),),
                dict(dim=0, index=torch.tensor([[2, 0, 1, 2], [2, 2, 0, 1]])),
            ),
            S_(
                "3d_dim-1",
                (randn(2, 2, 3),),
                dict(dim=-1, index=torch.tensor([[[2], [0]], [[1], [1]]])),
            ),
        ],
    ),
    OpRow(
        "torch.repeat_interleave",
        lambda x, **kw: torch.repeat_interleave(x, **kw),
        lambda: [
            S_("int_dim1", (randn(2, 3),), dict(repeats=2, dim=1)),
            S_("tensor_dim0", (randn(3, 2),), dict(repeats=torch.tensor([1, 0, 3]), dim=0)),
            S_("flattened", (randn(2, 2),), dict(repeats=3)),
            S_(
                "output_size",
                (randn(2, 2),),
                dict(repeats=torch.tensor([2, 1]), dim=-1, output_size=3),
            ),
        ],
    ),
    OpRow(
        "torch.masked_select",
        lambda x, **kw: torch.masked_select(x, kw["mask"]),
        lambda: [
            S_("3x4", (randn(3, 4),), dict(mask=torch.rand(3, 4, generator=_GEN) > 0.4)),
            S_(
                "broadcast_input",
                (randn(1, 4),),
                dict(mask=torch.tensor([[True, False]] * 2 + [[False, True]] * 2).reshape(2, 4)),
            ),
            S_("broadcast_mask", (randn(2, 3),), dict(mask=torch.tensor([False, True, True]))),
        ],
    ),
    OpRow(
        "x.take",
        lambda x, **kw: x.take(kw["index"]),
        lambda: [
            S_(
                "repeats_negative",
                (randn(3, 4),),
                dict(index=torch.tensor([[0, -1, 5], [5, 11, -12]])),
            ),
            S_("scalar_input", (randn(()),), dict(index=torch.tensor([0, 0, -1]))),
        ],
    ),
    OpRow(
        "torch.linalg.vector_norm",
        lambda x, **kw: torch.linalg.vector_norm(x, **kw),
        lambda: [
            S_("l2_all", (randn(3, 4),)),
            S_(
                "l2_dim_zero_row",
                (torch.cat([torch.zeros(1, 3, dtype=torch.float64), randn(2, 3)]),),
                dict(dim=1),
            ),
            S_("l1_with_zeros", (with_zeros(3, 4),), dict(ord=1, dim=-1, keepdim=True)),
            S_("l3_dims", (randn(2, 3, 2),), dict(ord=3, dim=(0, 2))),
            S_("l0.5_with_zeros", (with_zeros(2, 5),), dict(ord=0.5, dim=1)),
            S_("l1.5", (randn(2, 4),), dict(ord=1.5, dim=0)),
            S_("inf_ties", (_tied(3, 4),), dict(ord=float("inf"), dim=1)),
            S_("-inf", (away_from_zero(2, 3),), dict(ord=float("-inf"))),
            S_("l0_no_edges", (with_zeros(2, 3),), dict(ord=0, dim=1)),
        ],
    ),
    OpRow(
        "x.gather",
        lambda x, **kw: x.gather(1, kw["index"]),
        lambda: [S_("2x3", (randn(2, 3),), dict(index=torch.tensor([[1, 1], [0, 2]])))],
    ),
    OpRow(
        "x[index] = v",
        _setitem,
        lambda: [
            S_("column_from_one", (randn(3, 4), randn(1)), dict(index=(slice(None), 1))),
            S_(
                "basic_block", (randn(3, 4), randn(2, 2)), dict(index=(slice(1, 3), slice(0, 4, 2)))
            ),
            S_("advanced", (randn(4, 3), randn(2, 3)), dict(index=torch.tensor([2, 0]))),
            S_(
                "advanced_pairs",
                (randn(4, 3), randn(2)),
                dict(index=(torch.tensor([0, 3]), torch.tensor([2, 1]))),
            ),
            S_(
                "mask",
                (randn(3, 4), randn(())),
                dict(index=torch.tensor([[True, False, True, False]] * 3)),
            ),
            S_(
                "ellipsis_leading_one",
                (randn(2, 3, 4), randn(1, 1, 4)),
                dict(index=(Ellipsis, 0, slice(None))),
            ),
            S_("into_constant", (randn(2),), dict(index=(slice(None), 2), target=(2, 3))),
            S_("python_number", (randn(3, 4),), dict(index=(0,), number=2.5)),
            S_("cast_float32_value", (randn(3, 4), randn(4).float()), dict(index=1)),
        ],
    ),
    OpRow(
        "casts",
        _cast_round_trip,
        lambda: [
            S_(c, (randn(3, 4),), dict(cast=c), low_precision=c in ("half", "bfloat16"))
            for c in ("to_dtype", "to_kw", "float", "half", "bfloat16", "type", "type_as")
        ],
    ),
]

#: Real twice: torch's own graph (the default) and the generated formulas
SEMIRINGS = [sa.Real(formulas=True)] + [cls() for cls in BUILTIN_SEMIRINGS] + [sa.KBest(3)]


@dataclass(frozen=True)
class Case:
    row: OpRow
    sample: Sample
    ones_seed: bool

    @property
    def id(self) -> str:
        return f"{self.row.name}[{self.sample.name}{',seed=None' if self.ones_seed else ''}]"

    def fn(self, *inputs: Tensor) -> Tensor:
        return self.row.fn(*inputs, **self.sample.kwargs)


def _cases() -> list[Case]:
    cases = []
    for row in OPS:
        samples = row.samples()
        cases += [Case(row, s, False) for s in samples]
        cases.append(Case(row, samples[0], True))
    return cases


CASES = _cases()


def _seed_for(case: Case, out: Tensor) -> Tensor | None:
    """A random real seed with no zeros (entries of magnitude in [0.5, 1.5), both signs)."""
    if case.ones_seed:
        return None
    return random_cotangent(out.shape, torch.Generator().manual_seed(zlib.crc32(case.id.encode())))


def _leaves(case: Case) -> list[Tensor]:
    """Fresh leaves sharing the sample's storage and strides (non-contiguous stays so)."""
    return [t.detach().requires_grad_() for t in case.sample.inputs]


@pytest.mark.parametrize("S", SEMIRINGS, ids=repr)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_against_oracle(case: Case, S: Semiring):
    module = Apply(case.fn)
    ref_inputs = _leaves(case)
    torch.manual_seed(RNG_SEED)
    ref_out = module(*ref_inputs)

    inputs = _leaves(case)
    with sa.patch(module, S):
        torch.manual_seed(RNG_SEED)
        out = module(*inputs)
    assert torch.equal(out, ref_out), "the patched forward differs from the unpatched one"

    seed = _seed_for(case, out)
    raw = sa.grad(out, inputs, seed=seed, raw=True, retain_graph=True)
    readouts = sa.grad(out, inputs, seed=seed)
    oracle = case.row.oracle or _jacobian_oracle
    expected = oracle(S, case.fn, case.sample, seed, ref_out)

    exact = not (isinstance(S, sa.Real) and case.sample.low_precision)
    for k, (x, message, readout, want) in enumerate(zip(inputs, raw, readouts, expected)):
        if not exact:
            continue
        assert_value_close(raw_value(S, message, x), want, f"input {k} raw value", RTOL, ATOL)
        torch.testing.assert_close(
            readout, S.readout(want), rtol=RTOL, atol=ATOL, msg=lambda m: f"input {k} readout: {m}"
        )

    if isinstance(S, sa.Real):
        grad_output = torch.ones_like(ref_out) if seed is None else seed
        native = torch.autograd.grad(ref_out, ref_inputs, grad_output, allow_unused=True)
        for k, (x, message, g) in enumerate(zip(inputs, raw, native)):
            g = torch.zeros_like(x) if g is None else g
            torch.testing.assert_close(
                raw_value(S, message, x)[0],
                g,
                rtol=REAL_RTOL,
                atol=REAL_ATOL,
                msg=lambda m: f"input {k} vs torch.autograd: {m}",
            )
