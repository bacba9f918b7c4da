"""``sa.grad(compile=True)``: a replayed program equals the eager backward of the same call
bit for bit (NaN where NaN), on inputs it was not captured on, for every built-in semiring,
a k-best and a user semiring; guards on data read in the backward; the signature; and the
calls that run eagerly, each with one warning that says why.

The eager backward is itself checked against torch.autograd and path enumeration elsewhere
(test_ops_oracle.py, test_hf_models.py); here it is the oracle of the replay."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf
from model_zoo import llama_config
from torch import Tensor, nn
from user_semirings import Tropical

import semiring_autograd as sa
from semiring_autograd.engine.compiled import backward as compiled
from semiring_autograd.ops.message import Message
from semiring_autograd.semirings import BUILTIN_SEMIRINGS, tensor_ops

tf.logging.set_verbosity_error()

SEMIRINGS = [sa.Real(formulas=True)] + [cls() for cls in BUILTIN_SEMIRINGS if cls is not sa.Real]
SEMIRINGS += [sa.KBest(3), Tropical()]


@pytest.fixture(autouse=True)
def _fresh():
    compiled.clear()
    yield
    compiled.clear()


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(llama_config(vocab_size=50)).eval()


def _embeddings(model: nn.Module, seed: int, length: int = 6, dtype=torch.float32) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=gen)
    with torch.no_grad():
        emb = model.get_input_embeddings()(ids).to(dtype)
    return emb.requires_grad_(True)


def _read(model: nn.Module, semiring, emb: Tensor) -> Tensor:
    with sa.patch(model, semiring):
        return model(inputs_embeds=emb).logits[0, -1, 7]


def _assert_identical(got: Tensor, expected: Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    same = (got == expected) | (torch.isnan(got) & torch.isnan(expected))
    assert bool(same.all()), (got - expected).abs().nan_to_num().max()


def _compiled_against_eager(model: nn.Module, semiring, inputs) -> list[str]:
    """``sa.grad(model(x), x, compile=True)`` for each input, asserted identical to the
    eager backward of the same graph; the compile=True warnings raised meanwhile."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in inputs:
            with sa.patch(model, semiring):
                y = model(x)
            expected = sa.grad(y, x, retain_graph=True)
            _assert_identical(sa.grad(y, x, compile=True), expected)
    return [str(w.message) for w in caught if "compile=True" in str(w.message)]


@pytest.mark.parametrize("semiring", SEMIRINGS, ids=repr)
def test_replay_equals_eager_on_new_inputs(llama, semiring):
    """Captured on one input, verified on a second, replayed on three more: each result
    equals the eager backward of the same forward, bit for bit."""
    for seed in range(5):
        emb = _embeddings(llama, seed)
        expected = sa.grad(_read(llama, semiring, emb), emb)
        got = sa.grad(_read(llama, semiring, emb), emb, compile=True)
        _assert_identical(got, expected)
        assert got.double().abs().nan_to_num().sum() > 0
    stats = compiled.stats()
    assert stats["captures"] == 1 and stats["replays"] == 4 and stats["eager"] == 0, stats


@pytest.mark.parametrize("semiring", [sa.MaxProduct(), sa.Entropy()], ids=repr)
def test_raw_messages_and_several_inputs(llama, semiring):
    """raw=True gives the messages (their components equal eager's); two inputs, one of
    which is an interior tensor, and a seed tensor."""
    for seed in range(3):
        emb = _embeddings(llama, seed)
        seed_weights = torch.rand(1, 6, 50, generator=torch.Generator().manual_seed(seed))

        def run(**kw):
            with sa.patch(llama, semiring):
                hidden = emb * 1.0
                out = llama(inputs_embeds=hidden).logits
            return sa.grad(out, [emb, hidden], seed_weights, raw=True, **kw)

        expected, got = run(), run(compile=True)
        for e, g in zip(expected, got):
            assert isinstance(g, Message) and g.shape == e.shape
            for ge, ee in zip(g.value, e.value):
                _assert_identical(ge, ee)
    assert compiled.stats()["replays"] == 2


def test_a_new_shape_is_a_new_signature(llama):
    semiring = sa.Log()
    for length in (4, 6, 4, 6):
        emb = _embeddings(llama, length, length)
        expected = sa.grad(_read(llama, semiring, emb), emb)
        _assert_identical(sa.grad(_read(llama, semiring, emb), emb, compile=True), expected)
    stats = compiled.stats()
    assert stats["signatures"] == 2 and stats["captures"] == 2 and stats["replays"] == 2


def test_float64_and_float32_models_differ_in_signature(llama):
    semiring = sa.MaxProduct()
    for dtype in (torch.float32, torch.float64, torch.float32):
        model = llama.to(dtype)
        emb = _embeddings(model, 1, dtype=dtype)
        expected = sa.grad(_read(model, semiring, emb), emb)
        _assert_identical(sa.grad(_read(model, semiring, emb), emb, compile=True), expected)
    llama.to(torch.float32)
    assert compiled.stats()["signatures"] == 2


def test_data_read_in_the_backward_is_guarded(llama, monkeypatch):
    """The live rows of a seed decide which rows a matmul multiplies (a nonzero whose shape
    the replay checks; the products of this small model are pruned to their live rows with
    the size bound lifted): a seed with another number of live rows fails the guard, runs
    eagerly under the recorder and becomes a second program of the same signature."""
    monkeypatch.setattr(tensor_ops, "PRUNE_PRODUCTS", 0)
    semiring = sa.MaxProduct()
    emb = _embeddings(llama, 0)
    seeds = [torch.zeros(1, 6, 50) for _ in range(4)]
    seeds[0][0, -1, 3] = seeds[1][0, -1, 9] = 1.0  # one live row
    seeds[2][0, 2:, 3] = seeds[3][0, 2:, 4] = 1.0  # four live rows
    for seed in seeds:
        with sa.patch(llama, semiring):
            out = llama(inputs_embeds=emb).logits
        expected = sa.grad(out, emb, seed, retain_graph=True)
        _assert_identical(sa.grad(out, emb, seed, compile=True), expected)
    stats = compiled.stats()
    assert stats["signatures"] == 1 and stats["programs"] == 2, stats
    assert stats["captures"] == 2 and stats["replays"] == 2


class _Branching(Tropical):
    """A user semiring whose ⊕ branches on data in Python (the branches give different
    values: the test needs them told apart, not a lawful semiring)."""

    def add(self, a, b):
        if bool((a[0] < 0).any()):
            return (torch.minimum(a[0], b[0]) + 0.5,)
        return (torch.minimum(a[0], b[0]),)


class _Square(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return (x * x).sum()


def test_python_branch_in_a_user_semiring_is_exact():
    """A user semiring branching on data: the outcome read is a guard, so a program runs
    only where every outcome matches the capture's, and each branch gets its own program.
    y = Σ x·x merges two messages of lift(x) = -log|x|, negative where |x| > 1."""
    semiring = _Branching()
    for scale in (0.5, 3.0, 0.25, 2.0, 0.5):
        x = (torch.linspace(0.1, 0.9, 8) * scale).requires_grad_(True)
        model = _Square()
        with sa.patch(model, semiring, check=False):  # not lawful, on purpose
            y = model(x)
        expected = sa.grad(y, x, retain_graph=True)
        _assert_identical(sa.grad(y, x, compile=True), expected)
    stats = compiled.stats()
    assert stats["programs"] == 2 and stats["replays"] == 3 and stats["eager"] == 0, stats


def test_too_many_branches_run_eagerly_with_one_warning(llama, monkeypatch):
    monkeypatch.setattr(compiled, "MAX_VARIANTS", 1)
    monkeypatch.setattr(tensor_ops, "PRUNE_PRODUCTS", 0)  # live rows pruned: branches
    semiring = sa.MaxProduct()
    emb = _embeddings(llama, 0)
    seeds = [torch.zeros(1, 6, 50) for _ in range(3)]
    seeds[0][0, -1, 3] = 1.0
    seeds[1][0, 2:, 3] = 1.0
    seeds[2][0, 1:, 3] = 1.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in seeds:
            with sa.patch(llama, semiring):
                out = llama(inputs_embeds=emb).logits
            expected = sa.grad(out, emb, seed, retain_graph=True)
            _assert_identical(sa.grad(out, emb, seed, compile=True), expected)
    messages = [str(w.message) for w in caught if "compile=True" in str(w.message)]
    assert len(messages) == 1 and "branches" in messages[0]
    assert compiled.stats()["eager"] == 2


def test_shapes_changing_every_call_stop_capturing(monkeypatch):
    monkeypatch.setattr(compiled, "NEW_SIGNATURE_LIMIT", 3)
    lin = nn.Linear(4, 3)
    inputs = (torch.rand(rows, 4).requires_grad_(True) for rows in range(1, 7))
    messages = _compiled_against_eager(lin, sa.Log(), inputs)
    assert len(messages) == 1 and "changed on each of 3 calls" in messages[0]
    stats = compiled.stats()
    assert stats["captures"] == 3 and stats["eager"] == 3


def test_a_program_that_disagrees_is_dropped(llama):
    """The first replay of a program is checked against eager: a program made to return
    something else is dropped with one warning, and the eager result is returned."""
    semiring = sa.Log()
    emb = _embeddings(llama, 0)
    sa.grad(_read(llama, semiring, emb), emb, compile=True)
    (captured,) = compiled._CACHE.values()
    program = captured.programs[0]
    honest = program.run
    program.run = lambda slots: tuple((c[0] + 1,) for c in honest(slots))
    emb = _embeddings(llama, 1)
    expected = sa.grad(_read(llama, semiring, emb), emb)
    with pytest.warns(RuntimeWarning, match="disagreed with the eager run"):
        got = sa.grad(_read(llama, semiring, emb), emb, compile=True)
    _assert_identical(got, expected)
    _assert_identical(sa.grad(_read(llama, semiring, emb), emb, compile=True), expected)
    assert compiled.stats()["programs"] == 0 and compiled.stats()["eager"] == 2


def test_trace_runs_eagerly_with_a_warning(llama):
    semiring = sa.MaxProduct()
    emb = _embeddings(llama, 0)
    expected = sa.grad(_read(llama, semiring, emb), emb)
    with pytest.warns(RuntimeWarning, match="sa.trace reports each node"):
        with sa.trace() as events:
            got = sa.grad(_read(llama, semiring, emb), emb, compile=True)
    _assert_identical(got, expected)
    assert len(events.events) > 0


def test_real_runs_torch_engine(llama):
    """sa.Real() records torch's own graph: compile=True runs torch's engine (no capture)."""
    emb = _embeddings(llama, 0)
    expected = sa.grad(_read(llama, sa.Real(), emb), emb)
    _assert_identical(sa.grad(_read(llama, sa.Real(), emb), emb, compile=True), expected)
    assert compiled.stats()["signatures"] == 0


def test_replay_under_an_active_patch(llama):
    """Calling compile=True inside the patch: the program's torch calls are not recorded
    as forward ops."""
    semiring = sa.Entropy()
    for seed in range(3):
        emb = _embeddings(llama, seed)
        with sa.patch(llama, semiring):
            out = llama(inputs_embeds=emb).logits[0, -1, 7]
            expected = sa.grad(out, emb, retain_graph=True)
            got = sa.grad(out, emb, compile=True)
        _assert_identical(got, expected)
    assert compiled.stats()["replays"] == 2


def test_program_source_is_straight_line(llama):
    """A program is one function of plain operator calls: no loops, no autograd."""
    emb = _embeddings(llama, 0)
    sa.grad(_read(llama, sa.MaxProduct(), emb), emb, compile=True)
    (captured,) = compiled._CACHE.values()
    source = captured.programs[0].source
    assert source.startswith("def program(S):")
    assert "for " not in source and "while " not in source and "backward" not in source
    assert source.count("\n") > captured.programs[0].steps


class _Power(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.exponent = 2.0

    def forward(self, x: Tensor) -> Tensor:
        return torch.pow(x, self.exponent).sum(dim=-1)


def test_an_op_argument_is_part_of_the_signature():
    """Same shapes, another exponent: another signature (the exponent is in the backward's
    formula), each replayed only on its own graphs."""
    model = _Power()
    semiring = sa.Log()
    for exponent in (2.0, 3.0, 2.0, 3.0, -0.0, 0.0):
        model.exponent = exponent
        x = torch.linspace(0.5, 2.0, 6).reshape(2, 3).requires_grad_(True)
        with sa.patch(model, semiring):
            y = model(x)
        expected = sa.grad(y, x, retain_graph=True)
        _assert_identical(sa.grad(y, x, compile=True), expected)
    stats = compiled.stats()
    assert stats["signatures"] == 4 and stats["replays"] == 2 and stats["eager"] == 0, stats


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_out_of_memory_names_the_op_and_frees_the_backward(llama, monkeypatch, compile):
    """An allocation failing inside a backward (simulated: CPU tests cannot exhaust a GPU)
    raises BackwardOutOfMemoryError naming the op, its module and the allocator's message;
    the messages computed so far are freed, and the next call works."""
    import gc
    import weakref

    semiring = sa.MaxProduct()
    emb = _embeddings(llama, 0)
    expected = sa.grad(_read(llama, semiring, emb), emb)
    made = []
    original = type(semiring).matmul_lift

    def failing(self, a, w):
        made.append(weakref.ref(a[0]))
        if w.shape == (24, 16):  # the input message of the last layer's up projection
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return original(self, a, w)

    monkeypatch.setattr(type(semiring), "matmul_lift", failing)
    with pytest.raises(sa.BackwardOutOfMemoryError) as caught:
        sa.grad(_read(llama, semiring, emb), emb, compile=compile)
    message = str(caught.value)
    assert "Tried to allocate 2.00 GiB" in message
    if not compile:
        assert "'linear' in module 'model.layers.1.mlp.up_proj'" in message
    gc.collect()
    assert made and all(ref() is None for ref in made)
    monkeypatch.setattr(type(semiring), "matmul_lift", original)
    _assert_identical(sa.grad(_read(llama, semiring, emb), emb, compile=compile), expected)


# ----- sa.compiled_step: forward and backward as one program ---------------------------------
@pytest.mark.parametrize("semiring", SEMIRINGS + [sa.Real()], ids=repr)
def test_compiled_step_equals_eager(llama, semiring):
    """A compiled step equals patched forward + eager sa.grad, bit for bit, on inputs it was
    not captured on (Real included: the step replays torch's own backward too)."""
    step = sa.compiled_step(llama, semiring, lambda m, x: m(inputs_embeds=x).logits[0, -1, 7])
    for seed in range(4):
        emb = _embeddings(llama, seed)
        expected = sa.grad(_read(llama, semiring, emb), emb)
        _assert_identical(step(emb), expected)
    stats = compiled.stats()
    assert stats["captures"] == 1 and stats["replays"] == 3 and stats["eager"] == 0, stats


def test_compiled_step_keyword_tensors_are_inputs(llama, monkeypatch):
    """Tensors passed as keyword arguments (an attention mask, a scale) are read from each
    call, not frozen into the program (the products pruned to their live rows whatever
    their size, so that the masks' live rows are read in the backward)."""
    monkeypatch.setattr(tensor_ops, "PRUNE_PRODUCTS", 0)
    semiring = sa.Log()
    step = sa.compiled_step(
        llama,
        semiring,
        lambda m, x, attention_mask: m(inputs_embeds=x, attention_mask=attention_mask).logits[
            0, -1, 7
        ],
    )
    emb = _embeddings(llama, 0)
    masks = [torch.ones(1, 6, dtype=torch.long) for _ in range(3)]
    masks[1][0, :2] = 0
    masks[2][0, 3] = 0
    for mask in masks:
        with sa.patch(llama, semiring):
            out = llama(inputs_embeds=emb, attention_mask=mask).logits[0, -1, 7]
        _assert_identical(step(emb, attention_mask=mask), sa.grad(out, emb))
    # each mask takes other branches (the model tests for an all-ones mask, the backward
    # reads which rows are live): a variant each
    stats = compiled.stats()
    assert stats["eager"] == 0 and stats["programs"] == 3, stats
    step = sa.compiled_step(
        llama, semiring, lambda m, x, scale: m(inputs_embeds=x * scale).logits[0, -1, 7]
    )
    for value in (1.0, 2.0, 0.5):
        scale = torch.full((1, 6, 1), value)
        with sa.patch(llama, semiring):
            out = llama(inputs_embeds=emb * scale).logits[0, -1, 7]
        _assert_identical(step(emb, scale=scale), sa.grad(out, emb))
    stats = compiled.stats()
    assert stats["eager"] == 0 and stats["programs"] == 4 and stats["replays"] == 2, stats


def test_compiled_step_sees_weights_changed_in_place_and_new_dtypes(llama):
    semiring = sa.MaxProduct()
    step = sa.compiled_step(llama, semiring, lambda m, x: m(inputs_embeds=x).logits[0, -1, 7])
    emb = _embeddings(llama, 0)
    step(emb)
    weight = llama.model.layers[0].mlp.up_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(-2.0)
        for seed in (1, 2):
            emb = _embeddings(llama, seed)
            _assert_identical(step(emb), sa.grad(_read(llama, semiring, emb), emb))
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    llama.to(torch.float64)
    try:
        emb = _embeddings(llama, 3, dtype=torch.float64)
        _assert_identical(step(emb), sa.grad(_read(llama, semiring, emb), emb))
    finally:
        llama.to(torch.float32)
    assert compiled.stats()["signatures"] == 2


def test_compiled_step_raw_and_several_inputs(llama):
    semiring = sa.Entropy()

    def read(m, x, scale):
        return m(inputs_embeds=x * scale).logits[0, -1, 7]

    step = sa.compiled_step(llama, semiring, read, raw=True)
    for seed in range(3):
        emb = _embeddings(llama, seed)
        scale = torch.full((1, 1, 16), 1.5 + seed).requires_grad_(True)
        with sa.patch(llama, semiring):
            out = read(llama, emb, scale)
        expected = sa.grad(out, [emb, scale], raw=True)
        got = step(emb, scale)
        for g, e in zip(got, expected):
            assert isinstance(g, Message)
            for gc, ec in zip(g.value, e.value):
                _assert_identical(gc, ec)


def test_compiled_step_has_aux(llama):
    """With has_aux the step also returns forward tensors (the logits), detached, equal to
    the eager forward's bit for bit in replays; aux as one tensor or a tuple."""
    semiring = sa.MaxProduct()

    def read(m, x):
        logits = m(inputs_embeds=x).logits
        return logits[0, -1, 7], logits[0]

    def read_tuple(m, x):
        logits = m(inputs_embeds=x).logits
        return logits[0, -1, 7], (logits[0, -1], logits[0, 0] * 2)

    step = sa.compiled_step(llama, semiring, read, has_aux=True)
    step_tuple = sa.compiled_step(llama, semiring, read_tuple, has_aux=True)
    for seed in range(3):
        emb = _embeddings(llama, seed)
        with sa.patch(llama, semiring):
            out, logits = read(llama, emb)
        expected = sa.grad(out, emb)
        got, aux = step(emb)
        _assert_identical(got, expected)
        assert not aux.requires_grad
        _assert_identical(aux, logits.detach())
        got, (last, first) = step_tuple(emb)
        _assert_identical(got, expected)
        _assert_identical(last, logits[-1].detach())
        _assert_identical(first, logits[0].detach() * 2)
    stats = compiled.stats()
    assert stats["captures"] == 2 and stats["replays"] == 4 and stats["eager"] == 0, stats


@pytest.mark.parametrize(
    "read, message",
    [
        (lambda m, x: m(inputs_embeds=x).logits[0, -1, 7], "read must return \\(out, aux\\)"),
        (lambda m, x: (m(inputs_embeds=x).logits[0, -1, 7], [x]), "aux must be a tensor"),
    ],
    ids=["no-aux", "list-aux"],
)
def test_compiled_step_has_aux_refuses_other_returns(llama, read, message):
    step = sa.compiled_step(llama, sa.Log(), read, has_aux=True)
    with pytest.raises(ValueError, match=message):
        step(_embeddings(llama, 0))


def test_compiled_step_aux_keeps_its_structure(llama):
    calls = []

    def read(m, x):
        logits = m(inputs_embeds=x).logits
        calls.append(None)
        return logits.sum(), (logits[0] if len(calls) == 1 else (logits[0],))

    step = sa.compiled_step(llama, sa.Log(), read, has_aux=True)
    step(_embeddings(llama, 0))
    with pytest.raises(ValueError, match="same structure"):
        step(_embeddings(llama, 0, length=4))


def test_compiled_step_refuses_inputs_without_grad(llama):
    step = sa.compiled_step(llama, sa.Log(), lambda m, x: m(inputs_embeds=x).logits[0, -1, 7])
    with pytest.raises(ValueError, match="input 0 is not a tensor that requires grad"):
        step(_embeddings(llama, 0).detach())
    with pytest.raises(sa.SemiringAutogradError, match="semiring instance"):
        sa.compiled_step(llama, sa.Log, lambda m, x: x)


@pytest.mark.parametrize("semiring", SEMIRINGS, ids=repr)
def test_replay_with_the_torch_formulas(llama, semiring, monkeypatch):
    """With the fused kernels off (the formulas a GPU runs), compile=True captures and
    replays eager bit for bit: an ``out=`` operator's result aliases its ``out`` buffer
    (Entropy's weight operand), not its input, so writing into it is no write into a tensor
    the graph saved."""
    monkeypatch.setenv("SEMIRING_AUTOGRAD_KERNELS", "off")
    for seed in range(2):
        x = _embeddings(llama, seed)
        expected = sa.grad(_read(llama, semiring, x), x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an eager fallback warns
            _assert_identical(sa.grad(_read(llama, semiring, x), x, compile=True), expected)


def test_an_out_variant_aliases_its_out_argument():
    from semiring_autograd.engine.compiled.steps import _traits

    aten = torch.ops.aten
    assert _traits(aten.abs.out).alias_of == (1, "out")
    assert _traits(aten.mul_.Tensor).alias_of == (0, "self")
    assert _traits(aten.view.default).alias_of == (0, "self")
    assert _traits(aten.mul.Tensor).alias_of is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("semiring", SEMIRINGS, ids=repr)
def test_replay_on_cuda(llama, semiring):
    """On CUDA (float64): eager within rounding of the CPU's result, and compile=True and a
    compiled step equal to eager bit for bit. Llama's rotary tables are computed in float32
    whatever the model's dtype (transformers casts to ``.float()``), and CUDA's sin and cos
    differ from the CPU's in the last float32 bits: the devices agree to float32 rounding
    (2.4e-7 apart on an NVIDIA H200), not float64's."""
    llama.to(torch.float64)
    embeddings = [_embeddings(llama, seed, dtype=torch.float64) for seed in range(3)]
    on_cpu = [sa.grad(_read(llama, semiring, emb), emb) for emb in embeddings]
    llama.to("cuda")
    try:
        step = sa.compiled_step(llama, semiring, lambda m, x: m(inputs_embeds=x).logits[0, -1, 7])
        for emb, cpu in zip(embeddings, on_cpu):
            x = emb.detach().to("cuda").requires_grad_(True)
            expected = sa.grad(_read(llama, semiring, x), x)
            _assert_identical(sa.grad(_read(llama, semiring, x), x, compile=True), expected)
            _assert_identical(step(x), expected)
            torch.testing.assert_close(expected.cpu(), cpu, rtol=1e-5, atol=1e-6)
    finally:
        llama.to("cpu", torch.float32)


def test_compiled_step_input_at_another_storage_offset(llama):
    """An input of the same shape and strides at another storage offset (a slice of a
    larger tensor) is another signature: the program's views of it are exact."""
    semiring = sa.Log()
    step = sa.compiled_step(llama, semiring, lambda m, x: m(inputs_embeds=x).logits[0, -1, 7])
    base = _embeddings(llama, 0, length=9).detach()
    for start in (0, 3, 0, 3):
        x = base[:, start : start + 6].detach().requires_grad_(True)
        expected = sa.grad(_read(llama, semiring, x), x)
        _assert_identical(step(x), expected)
    stats = compiled.stats()
    assert stats["signatures"] == 2 and stats["replays"] == 2 and stats["eager"] == 0, stats


def test_random_operators_run_eagerly_with_a_warning():
    """Dropout in train mode draws random numbers: the step is not captured (a replay would
    draw others than the eager run it is checked against), with one warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3)).train()
    step = sa.compiled_step(model, sa.MaxProduct(), lambda m, x: m(x).sum())
    x = torch.rand(4, 6).requires_grad_(True)
    with pytest.warns(RuntimeWarning, match="draws random numbers"):
        first = step(x)
    second = step(x)
    assert first.shape == second.shape == (4, 6)
    stats = compiled.stats()
    assert stats["captures"] == 0 and stats["eager"] == 2, stats


def test_compiled_step_of_a_model_without_parameters():
    """A model with no parameters or buffers is still a forward to record (its operators'
    results require grad), not a backward recording a graph."""
    model = _Square()
    step = sa.compiled_step(model, sa.MaxProduct(), lambda m, x: m(x))
    for scale in (0.5, 2.0, 3.0):
        x = (torch.linspace(0.1, 0.9, 8) * scale).requires_grad_(True)
        with sa.patch(model, sa.MaxProduct()):
            y = model(x)
        _assert_identical(step(x), sa.grad(y, x))
    stats = compiled.stats()
    assert stats["captures"] == 1 and stats["replays"] == 2 and stats["eager"] == 0, stats


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(5, 7), nn.Linear(7, 3)

    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.utils.checkpoint.checkpoint(
            lambda t: torch.tanh(self.inner(t)), x, use_reentrant=False
        )
        return self.outer(hidden).sum()


def test_checkpointed_region_runs_eagerly_with_a_warning():
    """A checkpointed region recomputes its forward in the backward, reading the model's
    parameters from outside the recorded backward: not captured, one warning, eager
    results."""
    torch.manual_seed(0)
    model = _Checkpointed()
    inputs = ((torch.rand(4, 5) * scale).requires_grad_(True) for scale in (1.0, 2.0))
    messages = _compiled_against_eager(model, sa.Log(), inputs)
    assert len(messages) == 1 and "checkpointed region" in messages[0]
    stats = compiled.stats()
    assert stats["captures"] == 0 and stats["eager"] == 2, stats


def test_identity_views_record_nothing():
    """A view operator whose result is its input's view (same storage, offset, shape and
    strides) is no step: its result stands for the input's value. Other views are steps."""
    from semiring_autograd.engine.compiled.program import Program, Recorder

    x = torch.randn(3, 4)
    recorder = Recorder([x])
    with recorder:
        same = x.view(3, 4).expand(3, 4)[:, :]
        flipped = same.t()
        out = (same * 2 + flipped.t()).sum(dim=0)
    program = Program(recorder, [("plain", recorder.ref(out))], 1)
    kinds = [s.func for s in recorder.steps]
    assert torch.ops.aten.view.default not in kinds and torch.ops.aten.expand.default not in kinds
    assert torch.ops.aten.t.default in kinds
    assert len(recorder.steps) == 5  # t, mul, t, add, sum
    assert program.steps == 4  # the view of a view folded: one as_strided
    y = torch.randn(3, 4)
    (got,) = program.run([y])
    _assert_identical(got, (y * 2 + y).sum(dim=0))


def test_a_shape_changed_in_place_after_an_identity_view_is_refused():
    """Two tensor objects stand for one value after an identity view; changing the shape of
    one in place would change the other in a replay, so the capture is refused."""
    from semiring_autograd.engine.compiled.program import Recorder
    from semiring_autograd.engine.compiled.signature import Uncapturable

    x = torch.randn(3, 4)
    with pytest.raises(Uncapturable, match="changes the shape of a tensor in place"):
        with Recorder([x]):
            (x + 1).view(3, 4).t_()


@pytest.mark.parametrize("collector_on", [True, False], ids=["gc-on", "gc-off"])
def test_capture_leaves_the_garbage_collector_as_it_found_it(collector_on):
    """A capture pauses Python's cyclic garbage collector and restores the caller's setting
    after it, whether the capture succeeds or is refused (dropout in train mode)."""
    import gc

    torch.manual_seed(0)
    x = torch.rand(4, 6).requires_grad_(True)
    kept = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).eval()
    refused = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 3)).train()
    was_on = gc.isenabled()
    try:
        gc.enable() if collector_on else gc.disable()
        sa.compiled_step(kept, sa.MaxProduct(), lambda m, x: m(x).sum())(x)
        assert gc.isenabled() is collector_on
        with pytest.warns(RuntimeWarning, match="draws random numbers"):
            sa.compiled_step(refused, sa.MaxProduct(), lambda m, x: m(x).sum())(x)
        assert gc.isenabled() is collector_on
    finally:
        gc.enable() if was_on else gc.disable()
    assert compiled.stats()["captures"] == 1
