"""Every built-in semiring on CUDA against the same computation on the CPU (which the rest of
the suite checks against autograd and path enumeration): float64 models to float64
rounding, bfloat16 and float16 models to their own rounding, ``compile=True`` and
``compiled_step`` bit for bit against eager on CUDA, and the fused CUDA kernels passing
their first-use check. ``scripts/gpu-check`` runs these (``pytest -m cuda``); without a CUDA
device they skip.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf
from model_zoo import bert_config, llama_config
from torch import Tensor, nn

import semiring_autograd as sa
from semiring_autograd import kernels
from semiring_autograd.semirings import BUILTIN_SEMIRINGS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
tf.logging.set_verbosity_error()

SEMIRINGS = [cls() for cls in BUILTIN_SEMIRINGS] + [sa.Real(formulas=True), sa.KBest(3)]


def _grad(model: nn.Module, semiring, emb: Tensor, compile: bool = False) -> Tensor:
    """The semiring gradient of one output of ``model`` at ``emb`` (a fresh leaf)."""
    x = emb.detach().requires_grad_(True)
    with sa.patch(model, semiring):
        out = model(inputs_embeds=x)
    logits = out.logits
    return sa.grad(logits[0, -1, 2] if logits.dim() == 3 else logits[0, 1], x, compile=compile)


def _embeddings(model: nn.Module, length: int = 6) -> Tensor:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=gen)
    with torch.no_grad():
        return model.get_input_embeddings()(ids.to(model.device))


def _plain(result: Tensor) -> Tensor:
    """A comparable float64 tensor of a result (Boolean's bool, KBest's k values)."""
    return result.detach().cpu().to(torch.float64)


@pytest.mark.parametrize("semiring", SEMIRINGS, ids=repr)
def test_every_semiring_on_cuda_equals_cpu(semiring):
    """A BERT in float64 (no float32 tables inside): CUDA within float64 rounding of the
    CPU's result, which the rest of the suite checks against its oracles."""
    torch.manual_seed(0)
    model = tf.BertForSequenceClassification(bert_config(vocab_size=40)).eval().double()
    emb = _embeddings(model)
    on_cpu = _grad(model, semiring, emb)
    model.to("cuda")
    on_cuda = _grad(model, semiring, emb.to("cuda"))
    assert on_cuda.device.type == "cuda" and on_cuda.dtype == on_cpu.dtype
    torch.testing.assert_close(_plain(on_cuda), _plain(on_cpu), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("semiring", [cls() for cls in BUILTIN_SEMIRINGS], ids=repr)
def test_low_precision_model_on_cuda(semiring, dtype):
    """A Llama in bfloat16 or float16 on CUDA against the same model on the CPU: the two
    round differently (GEMM blocking, float32 rotary tables), so the results agree to a few
    units of the dtype's precision relative to the result's scale, and have the same entries
    without a path (Boolean: exactly the same)."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(llama_config(vocab_size=40)).eval().to(dtype)
    emb = _embeddings(model)
    on_cpu = _plain(_grad(model, semiring, emb))
    model.to("cuda")
    on_cuda = _plain(_grad(model, semiring, emb.to("cuda")))
    model.to("cpu")
    if isinstance(semiring, sa.Boolean):
        assert torch.equal(on_cuda, on_cpu)
        return
    assert torch.equal(torch.isfinite(on_cuda), torch.isfinite(on_cpu))
    finite = torch.isfinite(on_cpu)
    scale = on_cpu[finite].abs().max().clamp_min(torch.finfo(dtype).tiny)
    error = (on_cuda[finite] - on_cpu[finite]).abs().max() / scale
    assert error <= 32 * torch.finfo(dtype).eps, f"relative error {error:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("semiring", SEMIRINGS, ids=repr)
def test_compiled_on_cuda_equals_eager(semiring, dtype):
    """``compile=True`` and a compiled step replay the eager backward on CUDA: the same
    values bit for bit, in float32 and in bfloat16."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(llama_config(vocab_size=40)).eval().to("cuda", dtype)
    emb = _embeddings(model)
    eager = _grad(model, semiring, emb)
    same = lambda got: torch.equal(got.isnan(), eager.isnan()) and torch.equal(  # noqa: E731
        got.nan_to_num(), eager.nan_to_num()
    )
    assert same(_grad(model, semiring, emb, compile=True))
    assert same(_grad(model, semiring, emb, compile=True))  # the replay, warm
    step = sa.compiled_step(model, semiring, lambda m, x: m(inputs_embeds=x).logits[0, -1, 2])
    for _ in range(2):
        assert same(step(emb.detach().requires_grad_(True)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_cuda_kernels_pass_their_check(dtype):
    """The three Triton matmuls on this GPU: their first-use check passes (no warning) and
    they are used, with the broadcast formulas' values."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(2, 37, 29, generator=gen, dtype=dtype).cuda()
    b = torch.randn(2, 29, 11, generator=gen, dtype=dtype).cuda()
    w = torch.randn(1, 29, 11, generator=gen, dtype=dtype).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = kernels.max_times(a, b)
        top, bottom = kernels.signed_times(a, a - 1, b, None)
        lift_top, lift_bottom = kernels.pair_lift_matmul(a, a - 1, w)
    products = a[:, :, :, None] * b[:, None]
    torch.testing.assert_close(got, products.amax(2).clamp_min(0), rtol=0, atol=0)
    corners = torch.stack([products, (a - 1)[:, :, :, None] * b[:, None]])
    torch.testing.assert_close(top, corners.amax(0).amax(2), rtol=0, atol=0)
    torch.testing.assert_close(bottom, corners.amin(0).amin(2), rtol=0, atol=0)
    lifted = torch.stack([a[:, :, :, None] * w[:, None], (a - 1)[:, :, :, None] * w[:, None]])
    torch.testing.assert_close(lift_top, lifted.amax(0).amax(2), rtol=0, atol=0)
    torch.testing.assert_close(lift_bottom, lifted.amin(0).amin(2), rtol=0, atol=0)
