"""Reading a score out of a patched model's output after the ``with`` block: advanced
indexing and ``gather`` taken outside the patch (torch's own index_put / scatter_add
backward on messages) give the same readouts as the same reads recorded inside the patch
(the YAML entries ``getitem.advanced`` and ``gather``, checked against oracles in the op
table)."""

from __future__ import annotations

import pytest
import torch
from small_models import setup_model

import semiring_autograd as sa

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
}

SEMIRINGS = [sa.Real(formulas=True)] + [cls() for cls in sa.BUILTIN_SEMIRINGS]
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


def test_real_read_outside_the_patch_is_torch_autograd():
    model, x0, _ = setup_model("mlp")
    x = x0.clone().requires_grad_()
    with sa.patch(model, sa.Real(formulas=True)):
        out = model(x)
    got = sa.grad(READS["index_repeated"](out).sum(), x)
    ref = x0.clone().requires_grad_()
    want = torch.autograd.grad(READS["index_repeated"](model(ref)).sum(), ref)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
