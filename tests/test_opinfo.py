"""Every YAML op on PyTorch's own OpInfo samples, under every semiring.

Each entry of ``derivatives/*.yaml`` names under ``opinfo:`` the OpInfo entries of
``torch.testing._internal.common_methods_invocations.op_db`` whose samples call it. Every
sample of those OpInfos (float64 on CPU: 0-dim and empty tensors, broadcasting both ways,
negative dims, keyword variants, non-contiguous inputs) runs as a one-op module under
``sa.patch``. One test runs per (OpInfo, semiring): it generates the OpInfo's samples (from a
seed of its name, so each OpInfo's samples are the same in every run and every worker), runs
each, and reports every failing sample by its index. Per semiring:

* the patched forward equals the unpatched one exactly;
* Real (``formulas=True``, the generated formulas) equals ``torch.autograd.grad`` with a
  random cotangent (rtol 1e-7, atol 1e-9);
* every other built-in semiring and a user semiring (tropical, only its definition written)
  equals the op's Jacobian read through the semiring (⊕ over the non-zero entries of each
  column of lift(J), :func:`oracle.op_oracle`), or for a composition entry path enumeration
  through the stated composition (:mod:`composition_oracles`); raw value and readout,
  rtol 1e-7, atol 1e-9 (``LOOSER`` states the samples held to less, and why).

The max-pooling OpInfos generate the full cross product of their options (up to 1,440
samples each); ``THINNED`` runs an evenly spaced subset of at most ``THINNED_TO`` of them, and
``test_thinned_samples_cover_every_option`` checks that the subset still holds every value of
every option and input shape the full set has.

Every differentiable tensor of a sample (floating point, requiring grad) is an input of
the module; a tensor passed twice is two inputs. A sample an entry does not accept must be
refused at forward with an ``UnsupportedOpError``: ``REFUSALS`` lists, per OpInfo, what the
refusal says, and each OpInfo's test keeps the list exact (a listed OpInfo refuses a sample,
an unlisted one none).
"""

from __future__ import annotations

import functools
import inspect
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from composition_oracles import (
    attention_paths,
    channel_norm_paths,
    layer_norm_paths,
    rms_norm_paths,
)
from op_checks import Apply, assert_value_close, random_cotangent, raw_value
from oracle import op_oracle
from torch import Tensor
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import OpInfo, SampleInput
from user_semirings import Tropical

import semiring_autograd as sa
from semiring_autograd.codegen.loader import load_entries
from semiring_autograd.errors import UnsupportedOpError
from semiring_autograd.semirings import BUILTIN_SEMIRINGS, Semiring, Value

RTOL, ATOL = 1e-7, 1e-9
RNG_SEED = 1234  # torch's global seed before each forward (dropout draws its mask from it)
ENTRIES = load_entries(Path(__file__).resolve().parents[1] / "derivatives")
OP_DB: dict[str, OpInfo] = {
    f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name: op for op in op_db
}

#: OpInfo name → the YAML entries that declare it
DECLARED: dict[str, list[str]] = {}
for _entry in ENTRIES:
    for _name in _entry.opinfo:
        DECLARED.setdefault(_name, []).append(_entry.name)
COMPOSITIONS = {e.name for e in ENTRIES if not e.granularity.startswith("op")}
#: the declared OpInfos op_db has (test_declared_opinfos_exist reports the others)
OPINFOS = sorted(name for name in DECLARED if name in OP_DB)

#: OpInfos whose samples are a cross product of options, run as an evenly spaced subset
THINNED = {
    "nn.functional.max_pool1d",
    "nn.functional.max_pool2d",
    "nn.functional.max_pool3d",
}
THINNED_TO = 48

#: OpInfo → what the refusal of its samples says (a sample of an OpInfo listed here may
#: still be accepted; one of an OpInfo not listed must be)
REFUSALS: dict[str, str] = {
    "nn.functional.scaled_dot_product_attention": "dropout_p == 0",
    # training-mode alpha dropout (p > 0) and rrelu draw noise the patch cannot read
    "nn.functional.alpha_dropout": "not training or p == 0",
    "nn.functional.feature_alpha_dropout.with_train": "not training or p == 0",
    "nn.functional.rrelu": "not training",
}

#: samples held to a stated looser tolerance, and why
LOOSER: dict[str, tuple[float, float, str]] = {
    **{
        f"nn.functional.scaled_dot_product_attention[{i}]": (
            1e-4,
            1e-3,
            "scores up to 80: rows whose largest probability rounds to 1 in float64, so "
            "p(1 − p) cancels, in the formula and in torch's Jacobian alike",
        )
        for i in (20, 21)
    },
}

SEMIRINGS = (
    [sa.Real(formulas=True)] + [cls() for cls in BUILTIN_SEMIRINGS] + [Tropical(), sa.KBest(3)]
)
#: OpInfos left out of a semiring's column: KBest's attention oracle walks each of the
#: ~10⁵ paths of the larger samples with k-list ⊗ (minutes per sample); KBest's attention
#: is checked in test_ops_oracle (its sdpa rows), test_compositions and test_k_best
#: (a tiny BERT against top_paths)
LEFT_OUT = {("nn.functional.scaled_dot_product_attention", sa.KBest(3))} | {
    # dropout3d's rules are dropout2d's (identity; × the mask): its samples of 5⁵ elements
    # (about a second per semiring for the oracle) run under Real and MaxProduct only, its
    # rules under every semiring on dropout2d's samples
    ("nn.functional.dropout3d", S)
    for S in SEMIRINGS
    if not isinstance(S, (sa.Real, sa.MaxProduct))
}


# ----------------------------------------------------------------------------- samples as calls
def _differentiable(x: object) -> bool:
    return isinstance(x, Tensor) and x.requires_grad and x.dtype.is_floating_point


@dataclass(frozen=True)
class _Slot:
    """Where the ``index``-th differentiable tensor of a sample goes."""

    index: int


def _template(x: object, found: list[Tensor]) -> object:
    """``x`` with each differentiable tensor replaced by a :class:`_Slot`, in ``found``."""
    if _differentiable(x):
        found.append(x)
        return _Slot(len(found) - 1)
    if isinstance(x, (list, tuple)):
        return type(x)([_template(item, found) for item in x])
    if isinstance(x, dict):
        return {k: _template(v, found) for k, v in x.items()}
    return x


def _fill(x: object, leaves: tuple[Tensor, ...]) -> object:
    if isinstance(x, _Slot):
        return leaves[x.index]
    if isinstance(x, (list, tuple)):
        return type(x)([_fill(item, leaves) for item in x])
    if isinstance(x, dict):
        return {k: _fill(v, leaves) for k, v in x.items()}
    return x


def _output_tensors(out: object) -> list[Tensor]:
    return [out] if isinstance(out, Tensor) else [t for t in out if isinstance(t, Tensor)]


@dataclass(frozen=True)
class Case:
    opinfo: str
    index: int
    sample: SampleInput
    template: tuple[list, dict]
    tensors: tuple[Tensor, ...]

    @property
    def id(self) -> str:
        return f"{self.opinfo}[{self.index}]"

    def arguments(self, leaves: tuple[Tensor, ...]) -> tuple[list, dict]:
        args, kwargs = self.template
        return _fill(args, leaves), _fill(kwargs, leaves)

    def call(self, *leaves: Tensor) -> list[Tensor]:
        """The OpInfo's call of this sample on ``leaves``; its output tensors."""
        args, kwargs = self.arguments(leaves)
        out = OP_DB[self.opinfo].op(*args, **kwargs)
        return _output_tensors(self.sample.output_process_fn_grad(out))

    def leaves(self) -> tuple[Tensor, ...]:
        """Fresh leaves sharing the sample's storage and strides (non-contiguous stays so)."""
        return tuple(t.detach().requires_grad_() for t in self.tensors)


def _samples(name: str) -> list[tuple[int, SampleInput]]:
    """The OpInfo's samples with their indices (an evenly spaced subset where ``THINNED``),
    drawn from a seed of ``name``; torch's global generator is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(zlib.crc32(name.encode()))
        samples = list(
            enumerate(OP_DB[name].sample_inputs("cpu", torch.float64, requires_grad=True))
        )
    if name in THINNED:
        # an odd step, so an option that alternates from sample to sample keeps both values
        return samples[:: -(-len(samples) // THINNED_TO) | 1]
    return samples


@functools.lru_cache(maxsize=2)  # the tests run OpInfo by OpInfo, each under every semiring
def _cases(name: str) -> tuple[Case, ...]:
    """The OpInfo's samples with a differentiable tensor, as cases."""
    cases = []
    for i, sample in _samples(name):
        found: list[Tensor] = []
        template = _template(([sample.input, *sample.args], dict(sample.kwargs)), found)
        if found:
            cases.append(Case(name, i, sample, template, tuple(found)))
    return tuple(cases)


# ----------------------------------------------------------------------------- oracles
def _seeds(case: Case, outputs: list[Tensor]) -> list[Tensor]:
    """Per output, a random real cotangent with no zeros (|entries| in [0.5, 1.5), both
    signs), in the output's dtype."""
    g = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))
    return [random_cotangent(out.shape, g).to(out.dtype) for out in outputs]


def _seeded(fn: Callable[..., list[Tensor]]) -> Callable[..., list[Tensor]]:
    def run(*leaves: Tensor) -> list[Tensor]:
        torch.manual_seed(RNG_SEED)
        return fn(*leaves)

    return run


def _jacobian_oracle(
    S: Semiring, case: Case, differentiable: list[int], seeds: list[Tensor]
) -> list[Value]:
    """⊕ over the non-zero entries of each column of lift(J), J the Jacobian of the
    differentiable outputs (flattened and concatenated) with respect to every leaf."""
    call = _seeded(case.call)
    leaves = case.leaves()

    def flat(*xs: Tensor) -> Tensor:
        outs = call(*xs)
        return torch.cat([outs[k].reshape(-1).to(torch.float64) for k in differentiable])

    seed = torch.cat([s.reshape(-1).to(torch.float64) for s in seeds])
    return op_oracle(S, flat, leaves, seed)


def _bind(signature: inspect.Signature, case: Case, leaves: tuple[Tensor, ...]) -> dict:
    args, kwargs = case.arguments(leaves)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _values_by_leaf(
    S: Semiring, leaves: tuple[Tensor, ...], named: dict[str, Tensor], values: dict[str, Value]
) -> list[Value]:
    """Each leaf's value, found by identity among the oracle's named inputs."""
    by_id = {id(t): values[name] for name, t in named.items() if name in values}
    return [by_id.get(id(x), S.zero(x.shape, x.detach())) for x in leaves]


def _layer_norm_oracle(
    S: Semiring, case: Case, differentiable: list[int], seeds: list[Tensor]
) -> list[Value]:
    leaves = case.leaves()
    a = _bind(inspect.signature(F.layer_norm), case, leaves)
    named = {"x": a["input"], "w": a["weight"], "b": a["bias"]}
    detached = {k: None if t is None else t.detach() for k, t in named.items()}
    values = layer_norm_paths(
        S,
        seeds[0],
        detached["x"],
        tuple(a["normalized_shape"]),
        w=detached["w"],
        b=detached["b"],
        eps=a["eps"],
    )
    return _values_by_leaf(S, leaves, named, values)


def _detached(a: dict, names: dict[str, str]) -> tuple[dict, dict]:
    """The oracle's named inputs (bound argument by name) and their detached values."""
    named = {k: a[arg] for k, arg in names.items()}
    return named, {k: None if t is None else t.detach() for k, t in named.items()}


def _channel_norm_oracle(function: Callable, kind: str) -> Callable[..., list[Value]]:
    """Path enumeration through a channel normalisation's composition; batch norm with
    running statistics in evaluation is elementwise (the Jacobian oracle)."""

    def oracle(S: Semiring, case: Case, differentiable: list[int], seeds: list[Tensor]):
        leaves = case.leaves()
        a = _bind(inspect.signature(function), case, leaves)
        if kind == "batch" and not a["training"] and a["running_mean"] is not None:
            return _jacobian_oracle(S, case, differentiable, seeds)
        named, detached = _detached(a, {"x": "input", "w": "weight", "b": "bias"})
        values = channel_norm_paths(
            S,
            seeds[0],
            detached["x"],
            kind,
            detached["w"],
            detached["b"],
            a["eps"],
            a.get("num_groups"),
        )
        return _values_by_leaf(S, leaves, named, values)

    return oracle


def _rms_norm_oracle(
    S: Semiring, case: Case, differentiable: list[int], seeds: list[Tensor]
) -> list[Value]:
    leaves = case.leaves()
    a = _bind(inspect.signature(F.rms_norm), case, leaves)
    named, detached = _detached(a, {"x": "input", "w": "weight"})
    values = rms_norm_paths(
        S, seeds[0], detached["x"], tuple(a["normalized_shape"]), detached["w"], a["eps"]
    )
    return _values_by_leaf(S, leaves, named, values)


def _sdpa_signature(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """F.scaled_dot_product_attention's parameters (the builtin has no Python signature)."""


def _attention_oracle(
    S: Semiring, case: Case, differentiable: list[int], seeds: list[Tensor]
) -> list[Value]:
    leaves = case.leaves()
    a = _bind(inspect.signature(_sdpa_signature), case, leaves)
    named = {"q": a["query"], "k": a["key"], "v": a["value"], "m": a["attn_mask"]}
    detached = {k: None if t is None else t.detach() for k, t in named.items()}
    values = attention_paths(
        S,
        seeds[0],
        detached["q"],
        detached["k"],
        detached["v"],
        attn_mask=detached["m"],
        is_causal=a["is_causal"],
        scale=a["scale"],
        enable_gqa=a["enable_gqa"],
    )
    return _values_by_leaf(S, leaves, named, values)


#: composition entry → its path-enumeration oracle on an OpInfo sample
COMPOSITION_ORACLES: dict[str, Callable[..., list[Value]]] = {
    "layer_norm": _layer_norm_oracle,
    "batch_norm.batch_stats": _channel_norm_oracle(F.batch_norm, "batch"),
    "group_norm": _channel_norm_oracle(F.group_norm, "group"),
    "instance_norm": _channel_norm_oracle(F.instance_norm, "instance"),
    "rms_norm": _rms_norm_oracle,
    "scaled_dot_product_attention": _attention_oracle,
}


def _oracle_for(opinfo: str) -> Callable[..., list[Value]]:
    compositions = [e for e in DECLARED[opinfo] if e in COMPOSITIONS]
    if not compositions:
        return _jacobian_oracle
    assert (
        len(compositions) == 1 and compositions[0] in COMPOSITION_ORACLES
    ), f"{opinfo}: composition entries {compositions} need an oracle in COMPOSITION_ORACLES"
    return COMPOSITION_ORACLES[compositions[0]]


# ----------------------------------------------------------------------------- the tests
def test_declared_opinfos_exist():
    """Every name under ``opinfo:`` is an OpInfo of op_db that supports autograd."""
    missing = sorted(n for n in DECLARED if n not in OP_DB)
    assert not missing, f"opinfo names not in op_db: {missing}"
    no_grad = sorted(n for n in DECLARED if not OP_DB[n].supports_autograd)
    assert not no_grad, f"OpInfos without autograd support: {no_grad}"


def _options(sample: SampleInput) -> set[tuple[str, str]]:
    return {("shape", str(tuple(sample.input.shape))), ("args", str(sample.args))} | {
        (k, str(v)) for k, v in sample.kwargs.items()
    }


@pytest.mark.parametrize("name", sorted(THINNED))
def test_thinned_samples_cover_every_option(name: str):
    every = set().union(*(_options(s) for s in OP_DB[name].sample_inputs("cpu", torch.float64)))
    kept = set().union(*(_options(s) for _, s in _samples(name)))
    assert kept == every, f"{name}: the subset lacks {sorted(every - kept)}"
    assert len(_samples(name)) <= THINNED_TO


def test_every_entry_declares_opinfo_or_says_why():
    """Every entry is covered by OpInfo samples, or is one of those op_db has none for."""
    without = sorted(e.name for e in ENTRIES if not e.opinfo)
    assert without == sorted(NO_OPINFO), f"entries without an opinfo mapping: {without}"


#: entries op_db has no OpInfo for (covered by tests/test_ops_oracle.py's own samples)
NO_OPINFO = {
    "fold",  # op_db has no OpInfo for F.fold; its op-table rows check it
    "_weight_norm",  # none in op_db; its op-table rows check it against path enumeration
    # op_db's clamp OpInfos pass tensor bounds; the number forms are the op-table's x.clamp rows
    "clamp",
    "clamp_min",
    "clamp_max",
    "softmax.functional",
    "log_softmax.functional",
    "type",
    "type_as",
    "dropout1d",  # none in op_db; its op-table rows check it (eval, p = 0 and training)
    "dropout1d.train",
    # none in op_db (and torch's CPU kernel takes no float64): tests/test_grouped_mm.py's rows
    "_grouped_mm",
    "_grouped_mm.a3d_b2d",
    "_grouped_mm.a2d_b2d",
    "_grouped_mm.a3d_b3d",
}


@pytest.mark.parametrize(
    "name, S",
    [(name, S) for name in OPINFOS for S in SEMIRINGS if (name, S) not in LEFT_OUT],
    ids=lambda v: v if isinstance(v, str) else repr(v),
)
def test_opinfo_samples(name: str, S: Semiring):
    """Every sample of the OpInfo under ``S``; the failures of all its samples reported.
    A sample is refused at forward exactly when its OpInfo is in REFUSALS, saying what is
    listed there, and an OpInfo listed there has a refused sample."""
    cases = _cases(name)
    failures: list[tuple[Case, Exception]] = []
    refused = 0
    for case in cases:
        try:
            refused += _check_sample(case, S)
        except Exception as exc:  # noqa: BLE001 - reported with the sample, below
            failures.append((case, exc))
    if name in REFUSALS and not refused and not failures:
        failures.append((cases[0], AssertionError(f"REFUSALS lists {name}; no sample refused")))
    if failures:
        lines = [
            f"{case.id}: {''.join(traceback.format_exception_only(exc)).strip()}"
            for case, exc in failures
        ]
        raise AssertionError(
            f"{len(failures)} of {len(cases)} samples of {name} fail under {S!r} (the first's "
            "traceback above):\n" + "\n".join(lines)
        ) from failures[0][1]


def _check_sample(case: Case, S: Semiring) -> bool:
    """One sample under ``S``: the patched forward, then the backward against its oracle;
    whether the forward refused it (as REFUSALS says)."""
    module = Apply(case.call)
    ref_leaves = case.leaves()
    torch.manual_seed(RNG_SEED)
    ref = module(*ref_leaves)

    leaves = case.leaves()
    with sa.patch(module, S):
        torch.manual_seed(RNG_SEED)
        try:
            out = module(*leaves)
        except UnsupportedOpError as exc:
            assert case.opinfo in REFUSALS and REFUSALS[case.opinfo] in str(
                exc
            ), f"{case.id} refused, not listed in REFUSALS: {exc}"
            return True
    assert len(out) == len(ref)
    for k, (o, r) in enumerate(zip(out, ref)):
        torch.testing.assert_close(
            o, r, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"patched output {k}: {m}"
        )
        assert o.requires_grad == r.requires_grad, f"output {k}: requires_grad differs"
    differentiable = [k for k, r in enumerate(ref) if r.requires_grad]
    if not differentiable:
        return False
    outs = [out[k] for k in differentiable]
    seeds = _seeds(case, outs)
    raw = sa.grad(outs, leaves, seed=seeds, raw=True, retain_graph=True)

    if isinstance(S, sa.Real):
        native = torch.autograd.grad(
            [ref[k] for k in differentiable], ref_leaves, seeds, allow_unused=True
        )
        for k, (x, message, g) in enumerate(zip(leaves, raw, native)):
            g = torch.zeros_like(x) if g is None else g
            torch.testing.assert_close(
                raw_value(S, message, x)[0],
                g,
                rtol=RTOL,
                atol=ATOL,
                equal_nan=True,
                msg=lambda m: f"input {k} vs torch.autograd: {m}",
            )
        return False

    readouts = sa.grad(outs, leaves, seed=seeds)
    if sum(s.numel() for s in seeds) == 0:  # an empty output: no path
        expected = [S.zero(x.shape, x.detach()) for x in leaves]
    else:
        expected = _oracle_for(case.opinfo)(S, case, differentiable, seeds)
    rtol, atol, _ = LOOSER.get(case.id, (RTOL, ATOL, ""))
    for k, (x, message, readout, want) in enumerate(zip(leaves, raw, readouts, expected)):
        assert_value_close(
            raw_value(S, message, x), want, f"input {k} raw value", rtol, atol, equal_nan=True
        )
        torch.testing.assert_close(
            readout,
            S.readout(want),
            rtol=rtol,
            atol=atol,
            equal_nan=True,
            msg=lambda m: f"input {k} readout: {m}",
        )
    return False
