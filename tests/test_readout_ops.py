"""Reading a score out of a patched model's output after the ``with`` block: advanced
indexing, ``gather``, softmax and the losses taken outside the patch (torch's own backward
ops on messages: index_put / scatter_add, the losses' backward ops, elementwise scalings)
give the same readouts as the same reads recorded inside the patch (the YAML entries,
checked against oracles in the op table)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from small_models import setup_model

import semiring_autograd as sa
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

LABELS = torch.tensor([2, 0])

READS = {
    "index": lambda o: o[torch.arange(2), LABELS],
    "index_negative": lambda o: o[torch.tensor([-1, 0]), torch.tensor([-1, 1])],
    "index_repeated": lambda o: o[[0, 0, 1], [1, 1, 2]],
    "index_with_slice": lambda o: o[:, LABELS],
    "mask": lambda o: o[o > 0],
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
