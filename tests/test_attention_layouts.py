"""The layouts the attention backward reads its products in: MaxProduct's max-times of a
transposed operand (read as the product's transpose) and its ⊕-reduction of a transposed
message, against the products of the contiguous operands (the same bits, NaN and ±inf
included) and the brute-force max over k; and the probabilities rebuilt in place, against
torch's softmax of the masked scores in float64, with every mask kind, including masks that
broadcast the scores to more dims."""

from __future__ import annotations

import math

import pytest
import torch

import semiring_autograd as sa
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
