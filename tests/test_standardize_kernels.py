"""Layer norm's composition on the fused CPU kernels (``kernels/standardize.h``:
``standardize_max``, ``standardize_log``, ``entropy_standardize``).

The message at the input of a patched ``F.layer_norm`` in float32 (the AVX-512 rows) and
float64 is checked against path enumeration through the composition the entry states
(``composition_oracles.layer_norm_paths``), with a spy asserting that the kernel computed
it; MaxProduct's kernel against ``Semiring.standardize`` (the composition in torch) to the
bit; rows the Log and Entropy kernels decline (NaN), operands they do not take, and a
subclass with its own algebra (Counting) against the composition.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from composition_oracles import layer_norm_paths
from torch import Tensor, nn

import semiring_autograd as sa
from semiring_autograd.kernels import standardize as kernels_standardize
from semiring_autograd.semirings import Semiring

SEMIRINGS = [sa.MaxProduct(), sa.Log(), sa.Entropy()]
KERNELS = {
    "MaxProduct": "standardize_max",
    "Log": "standardize_log",
    "Entropy": "entropy_standardize",
}
#: float64 results agree with the float64 enumeration to rounding; float32 results to the
#: float32 rounding of the layer's local derivatives and the kernels' series
TOLERANCES = {torch.float64: (1e-9, 1e-11), torch.float32: (2e-5, 2e-5)}


class _LayerNorm(nn.Module):
    def __init__(self, normalized: tuple[int, ...], w: Tensor, b: Tensor):
        super().__init__()
        self.normalized = normalized
        self.w, self.b = nn.Parameter(w), nn.Parameter(b)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized, self.w, self.b)


@pytest.fixture
def kernel_results(monkeypatch) -> list:
    """The results of the three kernel wrappers in this test (None: declined)."""
    seen: list = []
    for name in KERNELS.values():
        wrapped = getattr(kernels_standardize, name)

        def spy(*args, wrapped=wrapped):
            out = wrapped(*args)
            seen.append(out)
            return out

        monkeypatch.setattr(kernels_standardize, name, spy)
    return seen


@pytest.mark.parametrize("S", SEMIRINGS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape, normalized", [((2, 3, 37), (37,)), ((2, 3, 4, 5), (4, 5))])
def test_layer_norm_message_is_the_path_sum(S, dtype, shape, normalized, kernel_results):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.3
    w = torch.randn(normalized, generator=gen, dtype=torch.float64)
    b = torch.randn(normalized, generator=gen, dtype=torch.float64)
    seed = torch.randn(shape, generator=gen, dtype=torch.float64)
    seed[0, 1] = 0.0  # a row without paths: zeros (MaxProduct) and -inf (Log, Entropy)
    model = _LayerNorm(normalized, w.to(dtype), b.to(dtype))
    xd = x.to(dtype).requires_grad_(True)
    with sa.patch(model, S):
        y = model(xd)
    got = sa.grad(y, xd, seed.to(dtype), raw=True).value
    assert kernel_results and all(r is not None for r in kernel_results)
    want = layer_norm_paths(S, seed, x, normalized, w, b)["x"]
    rtol, atol = TOLERANCES[dtype]
    for g, e in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), e.reshape(shape), rtol=rtol, atol=atol)


def _rows(gen: torch.Generator, shape) -> tuple[Tensor, Tensor]:
    x = torch.randn(shape, generator=gen) * 3
    centred = x - x.mean(-1, keepdim=True)
    return centred, torch.rsqrt((centred * centred).mean(-1, keepdim=True) + 1e-5)


def test_max_product_kernel_is_the_composition_to_the_bit():
    gen = torch.Generator().manual_seed(3)
    centred, rstd = _rows(gen, (4, 6, 53))
    a = torch.rand(4, 6, 53, generator=gen) * 5
    a[0, 1] = 0.0
    a[1, 2, 7] = float("nan")
    a[2, 3, 0] = float("inf")
    a[3, 0, :5] = 2.5  # ties
    S = sa.MaxProduct()
    fused = S.standardize((a,), centred, rstd, (-1,))[0]
    composed = Semiring.standardize(S, (a,), centred, rstd, (-1,))[0]
    torch.testing.assert_close(fused, composed, rtol=0, atol=0, equal_nan=True)
    assert fused[1, 2].isnan().all() and not fused[0].isnan().any()


@pytest.mark.parametrize("S", [sa.Log(), sa.Entropy()], ids=repr)
def test_a_row_holding_nan_takes_the_composition(S, kernel_results):
    gen = torch.Generator().manual_seed(5)
    centred, rstd = _rows(gen, (3, 4, 32))
    a = tuple(torch.randn(3, 4, 32, generator=gen) for _ in range(S.n_components))
    a[0][1, 2, 3] = float("nan")
    got = S.standardize(a, centred, rstd, (-1,))
    assert kernel_results == [None]  # declined: the composition computed every row
    want = Semiring.standardize(S, a, centred, rstd, (-1,))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


def test_operands_the_kernels_do_not_take():
    gen = torch.Generator().manual_seed(1)
    centred, rstd = _rows(gen, (3, 8))
    a = torch.randn(3, 8, generator=gen)
    assert kernels_standardize.standardize_log(a, centred, rstd, (0,)) is None  # not trailing
    assert kernels_standardize.standardize_log(a.double(), centred, rstd, (-1,)) is None
    assert kernels_standardize.standardize_max(a.abs(), centred, rstd.squeeze(-1), -1) is None
    assert kernels_standardize.standardize_max(a.abs(), centred, rstd, -1) is not None


def test_a_subclass_with_its_own_algebra_takes_the_composition(kernel_results):
    """Counting subclasses Log with another lift: Log's kernel must not compute its values."""
    gen = torch.Generator().manual_seed(2)
    centred, rstd = _rows(gen, (3, 4, 32))
    a = (torch.randn(3, 4, 32, generator=gen),)
    S = sa.Counting()
    got = S.standardize(a, centred, rstd, (-1,))
    assert kernel_results == []
    want = Semiring.standardize(S, a, centred, rstd, (-1,))
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert not torch.allclose(got[0], sa.Log().standardize(a, centred, rstd, (-1,))[0])
