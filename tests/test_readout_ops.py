"""Reading a score out of a patched model's output after the ``with`` block: advanced
indexing, ``gather``, ``masked_select``, ``take``, softmax and the losses taken outside the
patch (torch's own backward ops on messages: index_put / scatter_add / masked_scatter / put,
the losses' backward ops, elementwise scalings)
give the same readouts as the same reads recorded inside the patch (the YAML entries,
checked against oracles in the op table). Views and shape ops of the input taken before
the patched model (``m(x.unbind(0)[0][None])``, ``torch.stack``, ``as_strided`` …: torch's
own backward of each on messages) equal path enumeration under every semiring."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_checks import assert_value_close, random_cotangent, raw_value
from oracle import Program
from small_models import setup_model
from user_semirings import Tropical

import semiring_autograd as sa
from semiring_autograd.engine.grad import seed_message
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

LABELS = torch.tensor([2, 0])

READS = {
    "index": lambda o: o[torch.arange(2), LABELS],
    "index_negative": lambda o: o[torch.tensor([-1, 0]), torch.tensor([-1, 1])],
    "index_repeated": lambda o: o[[0, 0, 1], [1, 1, 2]],
    "index_with_slice": lambda o: o[:, LABELS],
    "mask": lambda o: o[o > 0],
    "masked_select": lambda o: o.masked_select(o > 0),
    "masked_select_broadcast_mask": lambda o: o.masked_select(torch.tensor([True, False, True])),
    "take": lambda o: o.take(torch.tensor([[0, -1], [4, 0]])),
    "gather": lambda o: o.gather(1, LABELS[:, None]),
    "gather_repeated": lambda o: o.gather(1, torch.tensor([[1, 1], [0, 2]])),
    "gather_dim0": lambda o: o.gather(0, torch.tensor([[1, 0, 1]])),
    "softmax": lambda o: o.softmax(-1)[:, 0],
    "cross_entropy": lambda o: F.cross_entropy(o, LABELS),
    "cross_entropy_weight_none": lambda o: F.cross_entropy(
        o, LABELS, weight=_spread(o[0]).exp(), reduction="none"
    ),
    "cross_entropy_ignore": lambda o: F.cross_entropy(o, torch.tensor([-100, 1])),
    "nll_loss": lambda o: F.nll_loss(o.log_softmax(-1), LABELS, reduction="sum"),
    "mse_loss": lambda o: F.mse_loss(o, _spread(o)),
    "l1_loss": lambda o: F.l1_loss(o, _spread(o), reduction="sum"),
    "smooth_l1_loss": lambda o: F.smooth_l1_loss(o, _spread(o), beta=0.5),
    "huber_loss": lambda o: F.huber_loss(o, _spread(o), delta=0.5, reduction="none"),
    "bce_with_logits": lambda o: F.binary_cross_entropy_with_logits(o, _spread(o).sigmoid()),
    "kl_div": lambda o: F.kl_div(o.log_softmax(-1), _spread(o).softmax(-1), reduction="batchmean"),
    # views and shape ops whose backward stacks, concatenates or pads with torch's zeros
    "unbind": lambda o: o.unbind(0)[1],
    "split": lambda o: o.split(1, 1)[2],
    "chunk": lambda o: o.chunk(2, 1)[0],
    "stack_of_rows": lambda o: torch.stack(o.unbind(0)[::-1]),
    "flip": lambda o: o.flip(-1),
    "unfold": lambda o: o.unfold(1, 2, 1),
    "pad": lambda o: F.pad(o, (1, 1)),
    "diagonal": lambda o: o.diagonal(),
}


def _spread(o: torch.Tensor) -> torch.Tensor:
    """A fixed real target shaped like ``o``."""
    return torch.linspace(-1.0, 1.0, o.numel(), dtype=o.dtype).reshape(o.shape)


SEMIRINGS = [sa.Real(formulas=True)] + [cls() for cls in BUILTIN_SEMIRINGS]
SEMIRINGS += [sa.KBest(3), sa.MaxProduct(granularity="tensor")]


class _Read(torch.nn.Module):
    def __init__(self, model, read):
        super().__init__()
        self.model, self.read = model, read

    def forward(self, x):
        out = self.model(x)
        return out if self.read is None else self.read(out)


@pytest.mark.parametrize("semiring", SEMIRINGS, ids=repr)
@pytest.mark.parametrize("read", list(READS))
def test_read_outside_the_patch_equals_inside(read: str, semiring):
    model, x0, _ = setup_model("mlp")
    results = []
    for inside in (False, True):
        x = x0.clone().requires_grad_()
        wrapped = _Read(model, READS[read] if inside else None)
        with sa.patch(wrapped, semiring):
            out = wrapped(x)
        y = out if inside else READS[read](out)
        # distinct real weights per read element: each read's own message is checked
        seed = torch.linspace(0.5, 1.5, y.numel(), dtype=y.dtype).reshape(y.shape)
        results.append(sa.grad(y, x, seed=seed))
    torch.testing.assert_close(results[0], results[1], rtol=1e-12, atol=0, equal_nan=True)


@pytest.mark.parametrize("read", ["index_repeated", "cross_entropy", "l1_loss", "kl_div"])
def test_real_read_outside_the_patch_is_torch_autograd(read: str):
    model, x0, _ = setup_model("mlp")
    x = x0.clone().requires_grad_()
    with sa.patch(model, sa.Real(formulas=True)):
        out = model(x)
    got = sa.grad(READS[read](out).sum(), x)
    ref = x0.clone().requires_grad_()
    want = torch.autograd.grad(READS[read](model(ref)).sum(), ref)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_a_scaling_in_another_backward_is_refused():
    """Only backward nodes whose local derivatives are elementwise scale messages: a
    native op whose backward mixes elements is refused with the node named."""
    model, x0, _ = setup_model("mlp")
    x = x0.clone().requires_grad_()
    with sa.patch(model, sa.MaxProduct()):
        out = model(x)
    with pytest.raises(sa.ForeignOpError, match="CumprodBackward0"):
        sa.grad(out.cumprod(-1).sum(), x)


# ----- views and shapes of the input taken before the patched model -----------------------
#: (x's shape, the view or shape op taken of x before the patched model, whose last dim is 4)
INPUT_VIEWS = {
    "unbind_one": ((3, 4), lambda x: x.unbind(0)[1][None]),  # nnsight's inputs_embeds
    "unbind_all": ((3, 4), lambda x: torch.stack(x.unbind(0)[::-1])),
    "unbind_last_dim": ((4, 2), lambda x: torch.stack(x.unbind(1)[:1], 0)),
    "stack": ((3, 4), lambda x: torch.stack([x[0], x[2]])),
    "stack_dim1": ((4, 3), lambda x: torch.stack([x[:, 2], x[:, 0]], 1).mT),
    "cat": ((3, 4), lambda x: torch.cat([x[2:], x[:1]], 0)),
    "cat_last_dim": ((3, 4), lambda x: torch.cat([x[:, 3:], x[:, :3]], 1)),
    "split": ((3, 4), lambda x: x.split(2, 0)[1]),
    "split_sizes": ((3, 4), lambda x: x.split([1, 2], 0)[1]),
    "unsafe_split": ((3, 4), lambda x: x.unsafe_split(2, 0)[0]),
    "chunk": ((3, 4), lambda x: x.chunk(2, 0)[0]),
    "tensor_split": ((5, 4), lambda x: x.tensor_split([1, 3], 0)[1]),
    "vsplit": ((3, 4), lambda x: torch.vsplit(x, 3)[2]),
    "narrow": ((3, 4), lambda x: x.narrow(0, 1, 2)),
    "select": ((3, 4), lambda x: x[1]),
    "select_negative": ((3, 4), lambda x: x.select(0, -1)),
    "slice": ((3, 4), lambda x: x[1:]),
    "slice_step": ((5, 4), lambda x: x[::2]),
    "expand": ((1, 4), lambda x: x.expand(3, 4)),
    "expand_new_dims": ((4,), lambda x: x.expand(2, 3, 4)),
    "broadcast_to": ((1, 4), lambda x: torch.broadcast_to(x, (2, 4))),
    "repeat": ((1, 4), lambda x: x.repeat(3, 1)),
    "tile": ((2, 2), lambda x: x.tile(2, 2)),
    "permute": ((4, 2, 3), lambda x: x.permute(2, 1, 0)),
    "transpose": ((4, 3), lambda x: x.transpose(0, 1)),
    "movedim": ((4, 3), lambda x: x.movedim(0, 1)),
    "squeeze": ((3, 1, 4), lambda x: x.squeeze(1)),
    "squeeze_all": ((1, 3, 1, 4), lambda x: x.squeeze()),
    "unsqueeze": ((3, 4), lambda x: x.unsqueeze(0)),
    "view": ((2, 2, 4), lambda x: x.view(4, 4)),
    "reshape_transposed": ((4, 3), lambda x: x.t().reshape(3, 4)),
    "flatten": ((2, 2, 4), lambda x: x.flatten(0, 1)),
    "unflatten": ((12,), lambda x: x.unflatten(0, (3, 4))),
    "as_strided": ((3, 4), lambda x: x.as_strided((2, 4), (4, 1), 4)),
    "as_strided_overlapping": ((3, 4), lambda x: x.as_strided((3, 4), (2, 1), 1)),
    "flip": ((3, 4), lambda x: x.flip(0, 1)),
    "roll": ((3, 4), lambda x: x.roll(1, 1)),
    "rot90": ((4, 4), lambda x: x.rot90(1, (0, 1))),
    "diagonal": ((4, 4), lambda x: x.diagonal(1)[None].expand(2, 3)[:, :2].repeat(1, 2)),
    "unfold": ((10,), lambda x: x.unfold(0, 4, 3)),
    "index_select": ((3, 4), lambda x: x.index_select(0, torch.tensor([2, 0, 2]))),
    "pad": ((3, 2), lambda x: F.pad(x, (1, 1))),
    "tril": ((4, 4), lambda x: x.tril(-1)),
    "twice_overlapping_slices": ((3, 4), lambda x: torch.cat([x[:2], x[1:]], 0)),
    "twice_unbind_and_select": ((3, 4), lambda x: torch.stack([x[0], x.unbind(0)[0], x[2]])),
    "twice_transposed": ((4, 4), lambda x: torch.cat([x, x.t()])),
}

VIEW_SEMIRINGS = (
    [sa.Real(formulas=True)] + [cls() for cls in BUILTIN_SEMIRINGS] + [sa.KBest(2), Tropical()]
)


def _linear_tanh() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()).double()


def _view_oracle(S, model, view, x: torch.Tensor, seed: torch.Tensor):
    """Path enumeration through x → v = view(x) → h = W v + b → y = tanh(h) (the view's
    edges from its Jacobian: one of weight 1 per element read, several where x is read
    several times)."""
    weight, bias = model[0].weight.detach(), model[0].bias.detach()
    p = Program(x=x)
    p.op("v", view, "x")
    p.op("h", lambda v: F.linear(v, weight, bias), "v")
    p.op("y", torch.tanh, "h")
    return p.path_sum(S, "y", seed, ["x"])[0]


@pytest.mark.parametrize("S", VIEW_SEMIRINGS, ids=repr)
def test_views_of_the_input_before_the_patch_equal_their_oracles(S):
    """``m(view(x))`` with ``view`` taken outside the patch: torch's own backward of the view
    (stack, cat, select_backward, as_strided's copy and index_add …) runs on the messages.
    Every row's readout at ``x`` equals path enumeration (Real: ``torch.autograd`` of the
    unpatched model in float64). One test per semiring; every failing row reported."""
    model = _linear_tanh()
    failures = []
    for name, (shape, view) in INPUT_VIEWS.items():
        try:
            n = torch.Size(shape).numel()
            x = torch.linspace(-2.0, 2.0, n, dtype=torch.float64).reshape(shape)
            x = x.requires_grad_()
            with sa.patch(model, S):
                y = model(view(x))
            seed = random_cotangent(y.shape, torch.Generator().manual_seed(len(name)))
            raw = sa.grad(y, x, seed=seed, raw=True, retain_graph=True)
            got = sa.grad(y, x, seed=seed)
            if isinstance(S, sa.Real):
                ref = x.detach().clone().requires_grad_()
                (want,) = torch.autograd.grad(model(view(ref)), ref, seed)
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
            expected = _view_oracle(S, model, view, x, seed)
            assert_value_close(raw_value(S, raw, x), expected, "raw value vs oracle", 1e-7, 1e-9)
            torch.testing.assert_close(got, S.readout(expected), rtol=1e-7, atol=1e-9)
        except Exception as exc:  # noqa: BLE001 - reported with its row, below
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not failures, f"{len(failures)} of {len(INPUT_VIEWS)} rows fail under {S!r}:\n" + (
        "\n".join(failures)
    )


@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Log(), sa.KBest(2)], ids=repr)
def test_an_unused_piece_is_the_semiring_zero(S):
    """``x.unbind(0)[1]`` alone: torch's backward stacks real zeros for the unused pieces,
    which must read as the semiring's zero (no path), not as a real 0."""
    model = _linear_tanh()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with sa.patch(model, S):
        y = model(x.unbind(0)[1])
    got = sa.grad(y, x)
    nothing = S.readout(S.zero((3, 4), x.detach()))
    rows = (slice(None), [0, 2]) if got.dim() == 3 else ([0, 2],)
    torch.testing.assert_close(got[rows], nothing[rows])


def test_as_strided_of_overlapping_memory_is_refused_with_the_fix():
    """``as_strided`` of an expanded tensor: torch's backward divides the gradient among the
    elements sharing memory, which no semiring can; refused, naming ``.contiguous()``."""
    model = _linear_tanh()
    x = torch.randn(1, 4, dtype=torch.float64, requires_grad=True)
    with sa.patch(model, sa.MaxProduct()):
        y = model(x.expand(3, 4).as_strided((2, 4), (0, 1)))
    with pytest.raises(sa.ForeignOpError, match=r"overlap in memory.*\.contiguous\(\)"):
        sa.grad(y, x)


def test_a_plain_non_zero_tensor_joined_to_a_message_is_refused():
    """A message stacked with a real tensor that is not zero (not torch's stand-in for an
    unused piece) has no semiring meaning: refused, naming the op."""
    message = seed_message(sa.Log(), torch.zeros(2, 4))
    with pytest.raises(sa.ForeignOpError, match="aten.cat"):
        torch.cat([message, torch.ones(2, 4)])


@pytest.mark.parametrize("S", [sa.MaxProduct(), sa.Entropy()], ids=repr)
def test_unbound_inputs_embeds_of_a_hugging_face_model(S):
    """nnsight's ``LanguageModel`` feeds ``inputs_embeds`` as ``x.unbind(0)[0][None]``: the
    readout at ``x`` is the readout of the same row fed as a leaf, in row 0, and the zero
    in the other rows."""
    from model_zoo import tiny_inputs, tiny_model

    model = tiny_model("LlamaForCausalLM")
    emb, mask = tiny_inputs(model)
    x = emb.clone().requires_grad_()
    with sa.patch(model, S):
        got = sa.grad(model(inputs_embeds=x.unbind(0)[0][None]).logits[0, -1, 3], x)
    row = emb[:1].clone().requires_grad_()
    with sa.patch(model, S):
        want = sa.grad(model(inputs_embeds=row).logits[0, -1, 3], row)
    torch.testing.assert_close(got[:1], want, rtol=1e-12, atol=0)
    nothing = S.readout(S.zero(emb[1:].shape, emb))
    torch.testing.assert_close(got[1:], nothing)
