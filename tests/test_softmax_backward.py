"""The softmax-Jacobian primitive ``Semiring.softmax_backward`` (the attention rule's
message at the scores): Log's override, on the fused CPU kernel (``softmax_backward_log``)
and on its torch formula, against the Jacobian's path sums in float64 and against the
generic formula, with p = 0, p = 1, messages without a path (-inf), NaN and +inf; Counting
keeps the generic formula."""

from __future__ import annotations

import pytest
import torch

import semiring_autograd as sa
from semiring_autograd import kernels
from semiring_autograd.kernels import log_entries
from semiring_autograd.kernels.build import ENV
from semiring_autograd.semirings.base import Semiring

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.float32, torch.float64]


def _jacobian_paths(g: torch.Tensor, p: torch.Tensor, keep=None) -> torch.Tensor:
    """log Σ_j e^{g_j}·|∂p_j/∂s_i| along the last dim in float64, ∂p_j/∂s_i = p_j(δ_ij −
    p_i); with ``keep``, |∂p_j/∂s_i| replaced by keep(∂p_j/∂s_i) (Counting: 1 where ≠ 0)."""
    g, p = g.double(), p.double()
    eye = torch.eye(p.shape[-1], dtype=torch.float64)
    jacobian = p[..., None, :] * (eye - p[..., :, None])
    weight = jacobian.abs() if keep is None else keep(jacobian)
    return torch.logsumexp(g[..., None, :] + torch.log(weight), -1)


def _operands(dtype: torch.dtype, n: int, rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, p) of (2, rows, n): p a softmax with excluded keys (p = 0), a row with a single
    key (p = 1), a row within an ulp of 1, rows spread over 40 and 60 nats (the kernel's
    linear frame takes p down to 2^-64, not 2^-87); g with -inf (no path), a row of -inf
    and messages up to ±200."""
    gen = torch.Generator().manual_seed(n)
    scores = torch.randn(2, rows, n, generator=gen, dtype=torch.float64) * 4
    excluded = (torch.arange(scores.numel()) % 4 == 1).reshape(scores.shape)
    excluded[..., 0] = False  # every row keeps a key
    scores = scores.masked_fill(excluded, -INF)
    scores[0, 0, 1:] = -INF
    scores[0, 1, 0] = 60.0
    scores[1, 1] = torch.linspace(-60, 0, n, dtype=torch.float64)
    scores[0, 4] = torch.linspace(-40, 0, n, dtype=torch.float64)  # p down to e^-40
    p = torch.softmax(scores, -1).to(dtype)
    g = torch.randn(2, rows, n, generator=gen, dtype=torch.float64) * 50
    g.view(-1)[::5] = -INF
    g[1, 2] = -INF
    g[1, 3, 0] = 200.0
    return g.to(dtype), p


def _tolerance(dtype: torch.dtype, g: torch.Tensor, p: torch.Tensor, want: torch.Tensor):
    """16 ulp of each row's scale: its largest finite |g + log p|, and |log p_i| and the
    entry's own magnitude."""
    t = (g.double() + torch.log(p.double())).nan_to_num(nan=0.0, neginf=0.0, posinf=0.0)
    scale = 1 + t.abs().amax(-1, keepdim=True) + want.nan_to_num(neginf=0.0).abs()
    scale = scale + torch.log(p.double()).nan_to_num(neginf=0.0).abs()
    return 16 * torch.finfo(dtype).eps * scale


def _assert_within(got, want, tol) -> None:
    got = got.double()
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    close = same | ((got - want).abs() <= tol)
    assert bool(close.all()), (got[~close][:5], want[~close][:5], (~close).nonzero()[:5])


@pytest.fixture
def kernels_off(monkeypatch):
    monkeypatch.setenv(ENV, "off")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 2, 9, 16, 37, 128])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_log_override_equals_the_jacobian_paths(dtype, n, path, monkeypatch):
    """Log's softmax_backward, on the kernel and on its torch formula (kernels off), within
    16 ulp of the rows' scale of the Jacobian's path sums, -inf where no path."""
    if path == "kernel" and not kernels.available():
        pytest.skip("the CPU kernels are switched off or could not be built here")
    if path == "torch":
        monkeypatch.setenv(ENV, "off")
    g, p = _operands(dtype, n)
    S = sa.Log()
    if path == "kernel":
        assert log_entries.softmax_backward(g, p, -1) is not None
    (got,) = S.softmax_backward((g,), p, -1)
    assert got.dtype == dtype and got.shape == g.shape
    want = _jacobian_paths(g, p)
    _assert_within(got, want, _tolerance(dtype, g, p, want))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_log_override_equals_the_generic_formula(dtype):
    """Log's override and the generic formula it replaces (Semiring.softmax_backward on
    Log's ⊕, ⊗ and lift) agree within 16 ulp of the rows' scale, on 128 keys with the
    operands' specials, and on a dim that is not the last (the torch formula)."""
    g, p = _operands(dtype, 128)
    S = sa.Log()
    (generic,) = Semiring.softmax_backward(S, (g,), p, -1)
    (got,) = S.softmax_backward((g,), p, -1)
    _assert_within(got, generic.double(), _tolerance(dtype, g, p, generic.double()))
    gt, pt = g.transpose(-1, -2).contiguous(), p.transpose(-1, -2).contiguous()
    (got_t,) = S.softmax_backward((gt,), pt, -2)
    _assert_within(got_t.transpose(-1, -2), generic.double(), _tolerance(dtype, g, p, generic))


@pytest.mark.parametrize("value", [NAN, INF])
def test_nan_and_inf_messages_take_the_torch_formula(value):
    """A row whose message holds NaN or +inf: the kernel declines, and the override's
    torch formula gives what the generic formula gives (NaN and infinities where it does),
    every other row unchanged."""
    g, p = _operands(torch.float64, 37)
    g[1, 4, 5] = value
    S = sa.Log()
    if kernels.available():
        assert log_entries.softmax_backward(g, p, -1) is None
    (got,) = S.softmax_backward((g,), p, -1)
    (generic,) = Semiring.softmax_backward(S, (g,), p, -1)
    torch.testing.assert_close(got, generic, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert torch.isnan(got[1, 4]).any() or torch.isposinf(got[1, 4]).any()


def test_the_kernel_declines_what_it_does_not_take():
    g, p = _operands(torch.float32, 16)
    assert log_entries.softmax_backward(g, p.double(), -1) is None  # two dtypes
    assert log_entries.softmax_backward(g, p, 1) is None  # not the last dim
    assert log_entries.softmax_backward(g[..., ::2], p[..., ::2], -1) is None  # strided
    assert log_entries.softmax_backward(g, p[:1], -1) is None  # broadcast
    assert log_entries.softmax_backward(g[..., :0], p[..., :0], -1) is None  # empty


def test_half_probabilities_in_message_precision():
    """bfloat16 probabilities with float32 messages (a bfloat16 model): the torch formula
    in float32, within float32 rounding of the path sums of those probabilities."""
    g, p = _operands(torch.float32, 37)
    p = p.to(torch.bfloat16)
    (got,) = sa.Log().softmax_backward((g,), p, -1)
    assert got.dtype == torch.float32
    want = _jacobian_paths(g, p.float())
    _assert_within(got, want, _tolerance(torch.float32, g, p.float(), want))


def test_counting_keeps_the_generic_formula():
    """Counting (a subclass of Log, lift(w) = [w ≠ 0]) counts the Jacobian's non-zero
    paths: the generic formula, bit for bit, and the enumeration in float64."""
    g, p = _operands(torch.float64, 37)
    S = sa.Counting()
    (got,) = S.softmax_backward((g,), p, -1)
    (generic,) = Semiring.softmax_backward(S, (g,), p, -1)
    assert torch.equal(got, generic)
    want = _jacobian_paths(g, p, keep=lambda j: (j != 0).double())
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_attention_backward_with_and_without_the_kernel(monkeypatch):
    """Log's backward through F.scaled_dot_product_attention (float32, 128 keys, causal:
    rows of p = 0 and a row of p = 1) with the kernels equals the torch formulas' (kernels
    off) within float32 rounding."""
    if not kernels.available():
        pytest.skip("the CPU kernels are switched off or could not be built here")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=gen) for _ in range(3))
    model = _CausalAttention(k, v)

    def message():
        leaf = q.clone().requires_grad_(True)
        with sa.patch(model, sa.Log()):
            out = model(leaf)
        return sa.grad(out[0, :, -1].sum(), leaf)

    fused = message()
    monkeypatch.setenv(ENV, "off")
    plain = message()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


class _CausalAttention(torch.nn.Module):
    """Causal attention of a query over a fixed key and value."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor):
        super().__init__()
        self.key, self.value = key, value

    def forward(self, query: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            query, self.key, self.value, is_causal=True
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_log_override_reads_lift_of_signed_probabilities(dtype):
    """p not a softmax (entries of either sign, as ``softmax_backward``'s contract allows):
    the kernel's rows (in the largest term's frame and in log space) read |p| as lift(p)
    does, within 16 ulp of the Jacobian's path sums."""
    gen = torch.Generator().manual_seed(11)
    p = (torch.randn(2, 6, 37, generator=gen, dtype=torch.float64) * 0.3).to(dtype)
    g = (torch.randn(2, 6, 37, generator=gen, dtype=torch.float64) * 5).to(dtype)
    g[1, 2, 0] = 300.0  # a gap past the shared frame: the log-space path
    (got,) = sa.Log().softmax_backward((g,), p, -1)
    want = _jacobian_paths(g, p)
    _assert_within(got, want, _tolerance(dtype, g, p, want))
