"""The layouts the attention backward reads its products in: MaxProduct's max-times of a
transposed operand (read as the product's transpose) and its ⊕-reduction of a transposed
message, against the products of the contiguous operands (the same bits, NaN and ±inf
included) and the brute-force max over k; and the probabilities rebuilt in place, against
torch's softmax of the masked scores in float64, with every mask kind, including masks that
broadcast the scores to more dims, and the CPU kernel that rebuilds them in one pass."""

from __future__ import annotations

import math

import pytest
import torch

import semiring_autograd as sa
from semiring_autograd import kernels
from semiring_autograd.ops import tensor_helpers
from semiring_autograd.semirings import max_product

NAN, INF = float("nan"), float("inf")


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(
        got.nan_to_num(), want.nan_to_num()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("special", [None, INF, NAN])
@pytest.mark.parametrize("abs_b", [False, True])
def test_transposed_max_times_is_the_contiguous_product(dtype, special, abs_b):
    gen = torch.Generator().manual_seed(1)
    stored = torch.rand(3, 33, 100, generator=gen, dtype=dtype)  # a is its transpose
    stored = stored * (torch.rand(3, 33, 100, generator=gen) < 0.6)
    b = torch.randn(3, 33, 40, generator=gen, dtype=dtype)
    b = b if abs_b else b.abs()
    if special is not None:
        stored[0, 1, 2] = special
        b[2, 0, 5] = special
    a = stored.mT
    assert max_product._transposed(a, b)
    got = max_product.max_times(a, b, abs_b=abs_b)
    assert _same(got, max_product.max_times(a.contiguous(), b, abs_b=abs_b))
    terms = a[..., :, :, None] * (b.abs() if abs_b else b)[..., None, :, :]
    assert _same(got, terms.amax(-2))


def test_transposed_message_reduces_to_the_same_maxima():
    gen = torch.Generator().manual_seed(2)
    message = torch.rand(2, 6, 50, 8, generator=gen).mT  # stored (…, 8, 50)
    message[0, 1, 3, 4] = NAN
    S = sa.MaxProduct()
    for dims, keepdim in (((1,), False), ((0, 1), True)):
        (got,) = S.sum((message,), dims, keepdim)
        assert _same(got, message.contiguous().amax(dim=dims, keepdim=keepdim))


def _reference_probs(q, k, mask, causal, scale):
    """softmax(q·kᵀ·scale + mask) in float64 (rows with no key: 0)."""
    scores = (q.double() @ k.double().mT) * (scale or 1 / math.sqrt(q.shape[-1]))
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), -INF)
    if mask is not None:
        masked = scores.masked_fill(~mask, -INF) if mask.dtype == torch.bool else None
        scores = masked if masked is not None else scores + mask.double()
    return torch.softmax(scores, -1).nan_to_num(nan=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_probabilities_in_place_match_softmax(dtype):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 7, 4, generator=gen, dtype=dtype)
    k = torch.randn(2, 3, 9, 4, generator=gen, dtype=dtype)
    masks = [
        None,
        torch.rand(7, 9, generator=gen) < 0.7,
        torch.zeros(7, 9, dtype=torch.bool),  # every key excluded: p = 0
        torch.randn(2, 1, 7, 9, generator=gen, dtype=dtype),
        torch.rand(4, 2, 3, 7, 9, generator=gen) < 0.5,  # broadcasts the scores to 5 dims
        torch.randn(5, 1, 1, 1, 9, generator=gen, dtype=dtype),
    ]
    tol = 8 * torch.finfo(dtype).eps
    for mask in masks:
        for causal in (False, True) if mask is None else (False,):
            for scale in (None, 0.3):
                got = tensor_helpers.attention_probs(q, k, mask, causal, scale)
                want = _reference_probs(q, k, mask, causal, scale)
                assert got.shape == want.shape
                torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("keys", [9, 37, 300])
def test_softmax_rows_kernel_equals_softmax(dtype, keys):
    """``kernels.softmax_rows`` (the probabilities' one pass on the CPU) against torch's
    softmax of the scaled, masked scores in float64: within 8 ulps of the row's spread
    (|s| rounds into e^(s − max)), NaN throughout a row with a kept NaN or +inf, 0 throughout
    a row with no kept key, an excluded NaN without effect; a float mask, a mask of more
    dims or a non-contiguous scores tensor declined (untouched)."""
    if not kernels.available():
        pytest.skip("the CPU kernels are switched off or could not be built here")
    gen = torch.Generator().manual_seed(keys)
    scores = (torch.randn(2, 3, 6, keys, generator=gen, dtype=torch.float64) * 6).to(dtype)
    keep = torch.rand(6, keys, generator=gen) < 0.7
    keep[:, 0] = True
    keep[2] = False  # no key kept
    scores[0, 0, 1, 1] = NAN
    scores[1, 2, 1, 2] = INF
    scores[0, 1, 3, 0] = -INF
    scores[1, 1, 4, ~keep[4]] = NAN  # excluded
    for mask, factor in ((keep, 0.125), (None, 1.5)):
        s = scores.double() * factor
        if mask is not None:
            s = s.masked_fill(~mask, -INF)
        want = torch.softmax(s, -1)
        none_kept = (s == -INF).all(-1, keepdim=True) & ~s.isnan().any(-1, keepdim=True)
        want = want.masked_fill(none_kept, 0.0)
        got = scores.clone()
        assert kernels.softmax_rows(got, mask, factor)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        spread = 1 + s.abs().nan_to_num(posinf=0.0, neginf=0.0).amax(-1, keepdim=True)
        tol = 8 * torch.finfo(dtype).eps * want * spread
        close = ((got.double() - want).abs() <= tol) | torch.isnan(want)
        assert bool(close.all()), (got.double() - want).abs().nan_to_num().max()
    for scores_, mask in (
        (scores.clone(), keep.double()),
        (scores.clone(), keep.expand(2, 3, 6, keys).contiguous()),
        (scores.clone().transpose(-1, -2).contiguous().transpose(-1, -2), None),
    ):
        before = scores_.clone()
        assert not kernels.softmax_rows(scores_, mask, 0.5)
        assert torch.equal(scores_.nan_to_num(), before.nan_to_num())
