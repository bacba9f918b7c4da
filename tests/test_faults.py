"""Fault injection: one table of faults and bad inputs, each with the error it must raise or
the value it must give. After every fault the model is unpatched (no hook, no forward
wrapper, patchable again), no torch-function mode is left on the thread, and no graph is
kept alive (a weakref to a saved activation dies)."""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils.checkpoint import checkpoint

import semiring_autograd as sa
from semiring_autograd.engine.grad import seed_message
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

ALL = [cls() for cls in BUILTIN_SEMIRINGS] + [sa.Real(formulas=True)]
FUNCTIONS = [s for s in ALL if repr(s) != "Real()"]


class Fault(BaseException):
    """A BaseException that is not an Exception, as KeyboardInterrupt is: torch's
    always-called module hooks do not see it."""


class Probe(nn.Module):
    """Raises ``fault`` (when set) after an op on its input; keeps a weakref to a tensor
    the graph saves, so a test can check the graph is freed."""

    def __init__(self, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.fault: BaseException | None = None
        self.catch: type[BaseException] | None = None
        self.saved: weakref.ref | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x)  # tanh saves its result
        self.saved = weakref.ref(h)
        if self.fault is not None:
            raise self.fault
        if self.inner is not None:
            if self.catch is None:
                h = self.inner(h)
            else:
                try:
                    h = self.inner(h)
                except self.catch:
                    pass
        return h * 2.0


def _nested(depth: int) -> tuple[nn.Module, list[Probe]]:
    """A chain of ``depth`` + 1 nested probes; probes[d] runs at depth d."""
    probe = Probe()
    probes = [probe]
    for _ in range(depth):
        probe = Probe(probe)
        probes.insert(0, probe)
    return probes[0], probes


def _x() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(3, 4, requires_grad=True)


def _assert_clean(model: nn.Module, hooks: tuple[int, int]) -> None:
    """The model as it was before the patch, and nothing of the patch left on the thread."""
    assert torch._C._len_torch_function_stack() == 0, "a torch-function mode was left on"
    assert "forward" not in model.__dict__, "the forward wrapper was left on the model"
    counts = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))
    assert counts == hooks, "module hooks were left registered"
    with sa.patch(model, sa.MaxProduct()):  # patchable again: the old patch is forgotten
        pass
    assert torch._C._len_torch_function_stack() == 0


def _hooks() -> tuple[int, int]:
    return len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)


def _assert_freed(ref: weakref.ref | None) -> None:
    gc.collect()
    assert ref is not None and ref() is None, "the graph (a saved activation) is still alive"


# ----- the table ------------------------------------------------------------------------
@dataclass
class ForwardFault:
    """A fault raised in the forward at ``depth`` (0: the patched model itself)."""

    name: str
    fault: Callable[[], BaseException]
    depth: int


FORWARD_FAULTS = [
    ForwardFault(f"{kind}-depth{d}", make, d)
    for kind, make in [
        ("RuntimeError", lambda: RuntimeError("injected")),
        ("KeyboardInterrupt", lambda: KeyboardInterrupt()),
        ("BaseException", lambda: Fault()),
        ("OutOfMemory", lambda: torch.OutOfMemoryError("CUDA out of memory (injected)")),
    ]
    for d in (0, 1, 3)
]


@pytest.mark.parametrize("case", FORWARD_FAULTS, ids=lambda c: c.name)
@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Real()], ids=repr)
def test_fault_in_forward_propagates_and_leaves_nothing(case, S):
    model, probes = _nested(3)
    probes[case.depth].fault = case.fault()
    hooks = _hooks()
    x = _x()
    with pytest.raises(type(probes[case.depth].fault)):
        with sa.patch(model, S):
            model(x)
    ref = probes[case.depth].saved
    _assert_clean(model, hooks)
    for p in probes:
        p.fault = None
    _assert_freed(ref)


@pytest.mark.parametrize("kind", [KeyboardInterrupt, Fault, RuntimeError])
def test_fault_caught_inside_the_with_block_ends_recording(kind):
    """A fault escaping the forward and caught inside ``with sa.patch``: the ops that follow
    in the block are the user's, not the model's, and are not recorded."""
    model, probes = _nested(2)
    probes[2].fault = kind("injected")
    hooks = _hooks()
    x = _x()
    with sa.patch(model, sa.MaxProduct()):
        try:
            model(x)
        except kind:
            pass
        assert torch._C._len_torch_function_stack() == 0
        z = x * 3.0
        assert sa.node_info(z.grad_fn) is None
        probes[2].fault = None
        y = model(x)  # the patch still records the next forward
    assert sa.node_info(y.grad_fn).op == "mul.Scalar"
    expected = sa.grad(y, x)
    with sa.patch(model, sa.MaxProduct()):
        again = model(x)
    torch.testing.assert_close(expected, sa.grad(again, x), rtol=0, atol=0)
    _assert_clean(model, hooks)


@pytest.mark.parametrize("kind", [KeyboardInterrupt, Fault])
def test_fault_swallowed_inside_the_forward_keeps_module_names(kind):
    """A BaseException caught by a module of the model: the ops after it are named by the
    module that runs them, and the value is the model's without the failed branch."""
    model, probes = _nested(2)
    probes[0].catch = kind
    probes[2].fault = kind("injected")
    x = _x()
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    assert sa.node_info(y.grad_fn).module == "Probe"  # the model's own mul, not inner.inner
    # the caught branch contributes nothing: y = 2·tanh(x), strongest path 2·tanh'(x)
    expected = 2.0 * (1 - torch.tanh(x.detach()) ** 2)
    torch.testing.assert_close(sa.grad(y, x), expected, rtol=1e-6, atol=0)


def test_fault_in_backward_propagates_and_state_recovers():
    """An error in the semiring backward (an out-of-memory simulated in a hook) propagates
    (as sa.BackwardOutOfMemoryError, a torch.OutOfMemoryError), the graph's tensors are
    freed with the outputs, and the next backward on a new graph gives the right value."""
    model, probes = _nested(1)
    x = _x()
    with sa.patch(model, sa.Log()):
        y = model(x)

    def out_of_memory(grad):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    y.grad_fn.register_prehook(out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="injected") as caught:
        sa.grad(y, x)
    assert isinstance(caught.value, sa.BackwardOutOfMemoryError)
    ref = probes[1].saved
    del y
    _assert_freed(ref)
    with sa.patch(model, sa.Log()):
        y = model(x)
    t = torch.tanh(x.detach())
    # y = 2·(2·tanh(tanh(x))): one path per element, log of its weight
    u = torch.tanh(t)
    expected = torch.log(4 * (1 - u**2) * (1 - t**2))
    torch.testing.assert_close(sa.grad(y, x), expected, rtol=1e-5, atol=1e-6)


def test_forward_in_another_thread_is_not_recorded():
    model, _ = _nested(1)
    x = _x()
    seen = {}

    def other():
        seen["y"] = model(x)

    with sa.patch(model, sa.MaxProduct()):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        y = model(x)
    assert sa.node_info(seen["y"].grad_fn) is None
    assert sa.node_info(y.grad_fn) is not None
    torch.testing.assert_close(seen["y"], y, rtol=0, atol=0)


def test_nested_patches_with_two_semirings_are_refused_and_both_restored():
    inner, _ = _nested(0)
    outer = nn.Sequential(nn.Linear(4, 4), inner)
    free = nn.Linear(4, 4)

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = outer

        def forward(self, x):
            return free(self.a(x))

    both = Both()
    hooks = _hooks()
    with pytest.raises(sa.SemiringMismatchError, match="one graph takes one semiring"):
        with sa.patch(both, sa.MaxProduct()), sa.patch(free, sa.Log()):
            both(_x())
    _assert_clean(both, hooks)
    _assert_clean(free, hooks)


def test_inplace_change_of_a_saved_tensor_is_caught_at_backward():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = _x()
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    with torch.no_grad():
        y.mul_(2.0)  # tanh saved its result
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        sa.grad(y, x)


def test_unsupported_op_is_refused_at_forward_and_leaves_nothing():
    class Odd(nn.Module):
        def forward(self, x):
            return torch.special.erfcx(x)

    model = Odd()
    hooks = _hooks()
    with pytest.raises(sa.UnsupportedOpError, match="erfcx"):
        with sa.patch(model, sa.MaxProduct()):
            model(_x())
    _assert_clean(model, hooks)


def test_removed_handle_is_refused():
    model, _ = _nested(0)
    handle = sa.patch(model, sa.MaxProduct())
    with handle:
        pass
    assert handle.removed
    with pytest.raises(sa.PatchError, match="was removed"):
        with handle:
            model(_x())
    assert "forward" not in model.__dict__


def test_compiled_modules_are_refused():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(sa.PatchError, match="torch.compile'd module"):
        sa.patch(torch.compile(model), sa.MaxProduct())
    model[0] = torch.compile(model[0])
    with pytest.raises(sa.PatchError, match="submodule '0'"):
        sa.patch(model, sa.MaxProduct())
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("where", ["model", "submodule"])
def test_modules_compiled_in_place_are_refused(where):
    """``module.compile()`` keeps the module's class (no OptimizedModule) and routes its
    calls through a compiled ``_call_impl``: refused like a torch.compile'd wrapper."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    (model if where == "model" else model[0]).compile()
    name = "the model" if where == "model" else "submodule '0'"
    with pytest.raises(sa.PatchError, match=rf"{name} is a torch.compile'd module.*\.compile\(\)"):
        sa.patch(model, sa.MaxProduct())
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_model_with_its_own_forward_attribute_gets_it_back():
    model = nn.Linear(4, 3)
    own = model.forward
    model.forward = lambda x: own(x) + 1.0
    mine = model.__dict__["forward"]
    x = _x()
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    assert model.__dict__["forward"] is mine
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    assert sa.node_info(y.grad_fn) is not None


# ----- sa.grad's arguments ----------------------------------------------------------------
def test_grad_seed_and_argument_errors():
    model = nn.Linear(4, 3)
    x = _x()
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    by_number = sa.grad(y, x, seed=2.0, retain_graph=True)
    by_tensor = sa.grad(y, x, seed=torch.full_like(y, 2.0), retain_graph=True)
    torch.testing.assert_close(by_number, by_tensor, rtol=0, atol=0)
    torch.testing.assert_close(by_number, 2.0 * model.weight.detach().abs().amax(0).expand(3, 4))
    with pytest.raises(TypeError, match="seed is None, a number, a tensor"):
        sa.grad(y, x, seed={"a": 1}, retain_graph=True)
    with pytest.raises(TypeError, match="a seed is a real number or a tensor"):
        sa.grad(y, x, seed=[True], retain_graph=True)
    with pytest.raises(ValueError, match="seed has shape"):
        sa.grad(y, x, seed=torch.ones(2), retain_graph=True)
    with pytest.raises(ValueError, match="does not require grad"):
        sa.grad(y, x.detach(), retain_graph=True)
    with pytest.raises(TypeError, match=r"inputs\[1\] is str"):
        sa.grad(y, [x, "w"], retain_graph=True)


# ----- checkpointing ----------------------------------------------------------------------
class Checkpointed(nn.Module):
    """Two linear layers with a tanh between, optionally inside torch.utils.checkpoint."""

    def __init__(self, hidden: int, reentrant: bool | None) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = nn.Linear(16, hidden), nn.Linear(hidden, 16)
        self.reentrant = reentrant

    def body(self, x):
        return self.b(torch.tanh(self.a(x)))

    def forward(self, x):
        if self.reentrant is None:
            return self.body(x) * 1.5
        return checkpoint(self.body, x, use_reentrant=self.reentrant) * 1.5


@pytest.mark.parametrize("hidden", [16, 12], ids=["square", "non-square"])
@pytest.mark.parametrize("S", ALL, ids=repr)
def test_checkpointed_region_gives_the_same_readouts(S, hidden):
    x = torch.randn(3, 16, requires_grad=True)
    plain, ckpt = Checkpointed(hidden, None), Checkpointed(hidden, False)
    with sa.patch(plain, S):
        y0 = plain(x)
    with sa.patch(ckpt, S):
        y1 = ckpt(x)
    torch.testing.assert_close(y0, y1, rtol=0, atol=0)
    torch.testing.assert_close(sa.grad(y1, x), sa.grad(y0, x), rtol=0, atol=0, equal_nan=True)


def test_reentrant_checkpoint_is_refused_with_the_fix():
    x = torch.randn(3, 16, requires_grad=True)
    model = Checkpointed(12, True)
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    with pytest.raises(sa.SemiringAutogradError, match="use_reentrant=False"):
        sa.grad(y, x)
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    with pytest.raises(sa.ForeignOpError, match="reentrant torch.utils.checkpoint"):
        y.backward(seed_message(sa.MaxProduct(), y))


# ----- messages are not gradients ---------------------------------------------------------
def test_optimizer_step_on_messages_is_refused_and_changes_nothing():
    model = nn.Linear(4, 3)
    x = _x()
    with sa.patch(model, sa.MaxProduct()):
        y = model(x)
    y.backward(seed_message(sa.MaxProduct(), y))
    before = [p.detach().clone() for p in model.parameters()]
    for foreach in (False, True):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=foreach)
        with pytest.raises(sa.ForeignOpError, match="outside a backward pass"):
            optimizer.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


# ----- NaN, infinities, magnitudes --------------------------------------------------------
def _mlp_with(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """4 → 5 → 3 with tanh; ``kind`` puts a NaN or an infinity in a weight or the input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(2, 4, dtype=torch.float64)
    with torch.no_grad():
        if kind == "nan-weight":
            model[0].weight[1, 2] = float("nan")
        elif kind == "nan-input":
            x[0, 1] = float("nan")
        elif kind == "inf-weight":
            model[2].weight[1, 3] = float("inf")
    return model, x.requires_grad_()


def _readout(S, model, x):
    with sa.patch(model, S):
        y = model(x)
    return sa.grad(y, x)


#: semirings whose readouts carry NaN (Boolean and Counting see a NaN derivative as an
#: edge: NaN ≠ 0)
NAN_CARRYING = [sa.Real(), sa.Real(formulas=True), sa.MaxProduct(), sa.Log(), sa.Entropy()]


@pytest.mark.parametrize("kind", ["nan-weight", "nan-input"])
@pytest.mark.parametrize("S", NAN_CARRYING + [sa.SignedMaxProduct()], ids=repr)
def test_nan_propagates_where_torch_gradient_is_nan(S, kind):
    model, x = _mlp_with(kind)
    torch_nan = torch.isnan(torch.autograd.grad(model(x).sum(), x)[0])
    assert torch_nan.any() and not torch_nan.all() if kind == "nan-input" else torch_nan.all()
    got = _readout(S, model, x)
    if isinstance(S, sa.SignedMaxProduct):
        assert torch.equal(torch.isnan(got[0]), torch_nan)
        assert torch.equal(torch.isnan(got[1]), torch_nan)
    else:
        assert torch.equal(torch.isnan(got), torch_nan)


@pytest.mark.parametrize("kind", ["nan-weight", "nan-input", "inf-weight"])
@pytest.mark.parametrize("S", FUNCTIONS, ids=repr)
def test_kernels_and_eager_agree_on_nan_and_inf(S, kind, monkeypatch):
    """The fused kernels read NaN as "no term": values with NaN take the eager path."""
    model, x = _mlp_with(kind)
    fused = _readout(S, model, x)
    monkeypatch.setenv("SEMIRING_AUTOGRAD_KERNELS", "eager")
    eager = _readout(S, model, x)
    torch.testing.assert_close(fused, eager, rtol=1e-12, atol=0, equal_nan=True)


@pytest.mark.parametrize("S", [sa.Boolean(), sa.Counting()], ids=repr)
def test_boolean_and_counting_count_a_nan_derivative_as_an_edge(S):
    model, x = _mlp_with("nan-weight")
    one = _mlp_with("none")[0]
    with torch.no_grad():
        one[0].weight[1, 2] = 1.0
    torch.testing.assert_close(_readout(S, model, x), _readout(S, one, x), rtol=0, atol=0)


def test_infinite_weight_gives_inf_or_documented_nan():
    """y = W x with one infinite weight W[0, 1]: x[:, 1] reaches y[0] through it. MaxProduct
    and Log read +inf there; Entropy reads NaN (the path distribution is undefined), and
    every other element reads the value it has without the infinity."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    finite = _readout(sa.Entropy(), model, x)
    with torch.no_grad():
        model.weight[0, 1] = float("inf")
    assert torch.equal(_readout(sa.MaxProduct(), model, x)[:, 1], torch.full((2,), torch.inf))
    assert torch.equal(_readout(sa.Log(), model, x)[:, 1], torch.full((2,), torch.inf))
    entropy = _readout(sa.Entropy(), model, x)
    assert torch.isnan(entropy[:, 1]).all()
    others = [0, 2, 3]
    torch.testing.assert_close(entropy[:, others], finite[:, others], rtol=1e-12, atol=0)
    signed = _readout(sa.SignedMaxProduct(), model, x)  # the largest product is +inf
    assert torch.equal(signed[0, :, 1], torch.full((2,), torch.inf, dtype=torch.float64))
    assert torch.isfinite(signed[1, :, 1]).all()  # the smallest runs through a finite weight


def _chain(scale: float, depth: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layer = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.tensor([[scale, 0.0], [0.0, scale]]))
        layers.append(layer)
    return nn.Sequential(*layers)


@pytest.mark.parametrize("scale", [1e30, 1e-30], ids=["huge", "tiny"])
def test_huge_and_tiny_magnitudes(scale):
    """Two float32 layers of weight ``scale``: the path weight scale² over- or underflows
    float32. MaxProduct reads it as float32 does (inf, or 0 below float32's smallest
    value); the log-space semirings read it exactly, and nothing is NaN."""
    model = _chain(scale, 2)
    x = torch.ones(1, 2, requires_grad=True)
    max_product = _readout(sa.MaxProduct(), model, x)
    expected = torch.full((1, 2), scale) ** 2  # in float32: inf, or 0
    assert torch.equal(max_product, expected)
    log = _readout(sa.Log(), model, x)
    torch.testing.assert_close(log, torch.full((1, 2), 2 * torch.log(torch.tensor(scale)).item()))
    torch.testing.assert_close(_readout(sa.Entropy(), model, x), torch.zeros(1, 2))
    torch.testing.assert_close(_readout(sa.Counting(), model, x), torch.zeros(1, 2))
    assert _readout(sa.Boolean(), model, x).all()


# ----- empty tensors and half precision ----------------------------------------------------
class Attention(nn.Module):
    def forward(self, q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)


@pytest.mark.parametrize("shape", [(1, 2, 0, 4), (1, 2, 3, 0), (0, 2, 3, 4)])
@pytest.mark.parametrize("S", ALL, ids=repr)
def test_empty_tensors_through_attention(S, shape):
    q = torch.randn(*shape, requires_grad=True)
    with sa.patch(Attention(), S) as handle:
        y = handle.model(q)
    got = sa.grad(y, q)
    assert got.shape == ((2, *shape) if isinstance(S, sa.SignedMaxProduct) else shape)


class Mixer(nn.Module):
    """Linear, layer norm, log-softmax, a softmax over the rows and a second linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.log_softmax(self.norm(self.a(x)), -1)
        return self.b(h * torch.softmax(x.sum(-1, keepdim=True), -2))


@pytest.mark.parametrize("shape", [(0, 4), (0, 5, 4), (3, 0, 4)])
@pytest.mark.parametrize("S", ALL, ids=repr)
def test_empty_tensors_through_linear_norm_and_softmax(S, shape):
    x = torch.randn(*shape, requires_grad=True)
    with sa.patch(Mixer(), S) as handle:
        y = handle.model(x)
    got = sa.grad(y, x)
    assert got.shape == ((2, *shape) if isinstance(S, sa.SignedMaxProduct) else shape)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Log()], ids=repr)
def test_half_precision_readouts_follow_the_float32_model(S, dtype):
    """A half-precision model's messages are float32: its readouts equal the float32 model
    with the same rounded weights, to the half-precision rounding of the local derivatives."""
    torch.manual_seed(0)
    half = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    full = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    full.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    x = torch.randn(2, 4).to(dtype)
    got = _readout(S, half, x.clone().requires_grad_())
    expected = _readout(S, full, x.float().requires_grad_())
    assert got.dtype == torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


# ----- the documented promises (docs/semantics.md, docs/api.md) ----------------------------
def _module_state(model: nn.Module) -> list[tuple[str, dict]]:
    return [(name, dict(vars(m))) for name, m in model.named_modules()]


@pytest.mark.parametrize("S", ALL, ids=repr)
def test_patch_leaves_the_model_exactly_as_it_was(S):
    """Every module's attributes (parameters, buffers, hooks, training flags) are the same
    objects after a patched forward and backward, and the forward output is the unpatched
    model's to the bit."""
    torch.manual_seed(0)
    model = Mixer().train()
    model.norm.eval()
    model.b.register_forward_hook(lambda m, i, o: None)
    before = _module_state(model)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 4, requires_grad=True)
    expected = model(x)
    with sa.patch(model, S):
        y = model(x)
    sa.grad(y, x)
    assert torch.equal(y, expected)
    after = _module_state(model)
    assert [name for name, _ in after] == [name for name, _ in before]
    for (name, attrs), (_, old) in zip(after, before):
        assert attrs.keys() == old.keys(), f"{name}: attributes added or removed"
        for key, value in attrs.items():
            assert value is old[key] or value == old[key], f"{name}.{key} changed"
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k])


@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Entropy(), sa.Real(formulas=True)], ids=repr)
def test_hugging_face_activation_checkpointing_gives_the_same_readouts(S):
    """A tiny Llama in train mode with every decoder layer checkpointed (transformers'
    activation checkpointing, non-reentrant) against the same model without it."""
    from model_zoo import tiny_inputs, tiny_model

    model = tiny_model("LlamaForCausalLM").train()
    emb, mask = tiny_inputs(model)

    def readout():
        x = emb.clone().requires_grad_()
        with sa.patch(model, S):
            logits = model(inputs_embeds=x, attention_mask=mask).logits
        return logits, sa.grad(logits[0, -1, 5], x)

    plain_logits, plain = readout()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.model.gradient_checkpointing
    logits, checkpointed = readout()
    torch.testing.assert_close(logits, plain_logits, rtol=0, atol=0)
    torch.testing.assert_close(checkpointed, plain, rtol=1e-12, atol=1e-12)


class _SignlessMaxTimes(sa.Semiring):
    """(max, ×) with lift(w) = scale·w: a user's max-times that forgot |w|. Max does not
    distribute over a negative factor (-1 ⊗ (2 ⊕ 0) = -2, but (-1 ⊗ 2) ⊕ (-1 ⊗ 0) = 0),
    and 0 is no identity of max below 0."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def zero(self, shape, like):
        return (torch.zeros(tuple(shape), dtype=like.dtype, device=like.device),)

    def one(self, shape, like):
        return (torch.ones(tuple(shape), dtype=like.dtype, device=like.device),)

    def lift(self, w):
        return (w * self.scale,)

    def add(self, a, b):
        return (torch.maximum(a[0], b[0]),)

    def mul(self, a, b):
        return (a[0] * b[0],)

    def readout(self, a):
        return a[0]


def _lawless_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def test_a_user_semiring_that_violates_a_law_is_refused_with_the_model_as_it_was():
    from semiring_autograd.engine import patch as patch_module

    S = _SignlessMaxTimes()
    a, b, c = S.lift(torch.tensor(-1.0)), S.lift(torch.tensor(2.0)), S.lift(torch.tensor(0.0))
    assert S.mul(a, S.add(b, c))[0] != S.add(S.mul(a, b), S.mul(a, c))[0]  # really lawless
    model = _lawless_model()
    before = _module_state(model)
    with pytest.raises(sa.SemiringLawError) as refusal:
        sa.patch(model, S)
    message = str(refusal.value)
    assert message.startswith("sa.patch refuses _SignlessMaxTimes(): ")
    assert "left distributivity: values differ" in message and "a ⊗ (b ⊕ c) = (" in message
    assert "sa.patch(model, semiring, check=False)" in message
    with pytest.raises(sa.SemiringLawError) as direct:
        sa.check_semiring(S, samples=16)
    laws = [law for law, _ in refusal.value.failures]
    assert "left distributivity" in laws and laws == [law for law, _ in direct.value.failures]
    after = _module_state(model)
    assert [name for name, _ in after] == [name for name, _ in before]
    for (name, attrs), (_, old) in zip(after, before):
        assert attrs.keys() == old.keys() and all(attrs[k] is old[k] for k in old), name
    assert model not in patch_module._PATCHED
    with sa.patch(model, sa.MaxProduct()):  # patchable: nothing of the refusal is left
        pass


def test_check_false_patches_a_semiring_the_law_check_refuses():
    model = _lawless_model()
    x = torch.randn(5, 4, requires_grad=True)
    expected = model(x)
    with sa.patch(model, _SignlessMaxTimes(), check=False):
        y = model(x)
    assert torch.equal(y, expected)
    info = sa.node_info(y.grad_fn)
    assert info is not None and info.semiring == _SignlessMaxTimes()


def _counting_law_checks(monkeypatch) -> list:
    """The semirings sa.patch checks from now on, on empty verdict caches."""
    from semiring_autograd.engine import patch as patch_module

    checked = []
    check = patch_module.check_semiring

    def counting_check(S, **kwargs):
        checked.append(S)
        check(S, **kwargs)

    monkeypatch.setattr(patch_module, "check_semiring", counting_check)
    monkeypatch.setattr(patch_module, "_LAWS_CHECKED", OrderedDict())
    monkeypatch.setattr(patch_module, "_LAWS_CHECKED_BY_ID", {})
    return checked


def test_the_law_check_runs_once_per_user_semiring_class_and_parameters(monkeypatch):
    from user_semirings import Tropical

    checked = _counting_law_checks(monkeypatch)
    model = _lawless_model()
    for S in [Tropical(), Tropical(), sa.MaxProduct(), sa.Real(formulas=True), sa.KBest(2)]:
        with sa.patch(model, S):
            pass
    assert checked == [Tropical()]  # built-in semirings are tested with the library
    for S in [_SignlessMaxTimes(2.0), _SignlessMaxTimes(2.0), _SignlessMaxTimes(3.0)]:
        with pytest.raises(sa.SemiringLawError, match=r"refuses _SignlessMaxTimes\(\)"):
            sa.patch(model, S)
    assert checked == [Tropical(), _SignlessMaxTimes(2.0), _SignlessMaxTimes(3.0)]


def test_threads_patching_their_own_models_at_once_leave_every_model_unpatched():
    from semiring_autograd.engine import patch as patch_module

    models = [nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)) for _ in range(4)]
    start = threading.Barrier(len(models))
    errors: list[BaseException] = []

    def patch_and_remove(model: nn.Module) -> None:
        start.wait()
        try:
            for _ in range(5000):
                sa.patch(model, sa.MaxProduct()).remove()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=patch_and_remove, args=(m,)) for m in models]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # a thread switch between almost any two bytecodes
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    for model in models:
        assert model not in patch_module._PATCHED
        assert all("forward" not in m.__dict__ for m in model.modules())
        with sa.patch(model, sa.MaxProduct()):  # patchable again
            pass


def test_the_law_check_keeps_an_unhashable_user_semiring_by_identity(monkeypatch):
    from semiring_autograd.engine import patch as patch_module
    from user_semirings import Tropical

    class ListTropical(Tropical):
        """Tropical with a parameter in a list: Semiring.__hash__ (over the attributes)
        refuses it."""

        def __init__(self) -> None:
            self.tags = ["a"]

    checked = _counting_law_checks(monkeypatch)
    S = ListTropical()
    with pytest.raises(TypeError):
        hash(S)
    model = _lawless_model()
    for _ in range(2):
        with sa.patch(model, S):
            pass
    assert checked == [S]  # once for both patches
    S.tags.append("b")  # its parameters changed: checked again
    with sa.patch(model, S):
        pass
    assert len(checked) == 2
    checked.clear()
    del S
    gc.collect()
    assert not patch_module._LAWS_CHECKED_BY_ID  # the verdict goes with the semiring


def test_the_law_check_keeps_the_most_recently_used_verdicts(monkeypatch):
    from semiring_autograd.engine import patch as patch_module
    from user_semirings import Tropical

    class TaggedTropical(Tropical):
        def __init__(self, tag: int) -> None:
            self.tag = tag

    checked = _counting_law_checks(monkeypatch)
    monkeypatch.setattr(patch_module, "_LAWS_CHECKED_LIMIT", 2)
    model = _lawless_model()
    for tag in [0, 1, 0, 2, 0, 1]:  # 1 is the least recently used when 2 comes in
        with sa.patch(model, TaggedTropical(tag)):
            pass
    assert [S.tag for S in checked] == [0, 1, 2, 1]
    assert len(patch_module._LAWS_CHECKED) == 2
