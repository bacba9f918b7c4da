"""Models dispatched by Hugging Face ``accelerate`` with their weights offloaded (to CPU
memory or to disk, loaded into each module by its hook for its forward) under ``sa.patch``.

A tiny random-weight Llama in float64, offloaded four ways: ``cpu_offload``,
``disk_offload``, ``dispatch_model`` with a device map that splits the layers between "cpu"
and "disk", and ``from_pretrained(device_map=infer_auto_device_map(...), offload_folder=...)``
from a saved copy. Against the same model not offloaded (the same weights), per semiring:

* the patched forward equals the unpatched one and the readout of one logit with respect to
  ``inputs_embeds`` equals the non-offloaded model's; under Real also ``torch.autograd``'s;
* the readouts of all semirings satisfy the identities that tie them together;
* after the ``with`` block the model is as it was: every module's ``forward``, accelerate
  hook and attributes the same objects, offloaded parameters still on the meta device, and
  its native forward equals the non-offloaded model's;
* ``sa.top_path`` finds the same path, naming the offloaded parameters it crosses, with the
  hooks' moves to the execution device as extra steps of weight 1; ``sa.attribute`` gives
  the same scores and paths.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import accelerate  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as tf  # noqa: E402
from model_zoo import llama_config  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import semiring_autograd as sa  # noqa: E402

tf.logging.set_verbosity_error()

HIDDEN = 32
TARGET = (0, 2, 7)  # batch row, position, logit: positions 3 and 4 have no path to it

SEMIRINGS = [
    sa.Real(),
    sa.Real(formulas=True),
    sa.MaxProduct(),
    sa.Log(),
    sa.Entropy(),
    sa.SignedMaxProduct(),
    sa.Counting(),
    sa.Boolean(),
]

#: dispatch_model's map: layer 0 on disk, layer 1 split between CPU memory and disk
DEVICE_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "disk",
    "model.layers.1.input_layernorm": "cpu",
    "model.layers.1.self_attn": "disk",
    "model.layers.1.post_attention_layernorm": "disk",
    "model.layers.1.mlp": "cpu",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = llama_config(vocab_size=100, hidden_size=HIDDEN, intermediate_size=64)
    return tf.LlamaForCausalLM(config).to(torch.float64).eval()


def _cpu_offload(tmp: Path) -> tuple[nn.Module, nn.Module, dict[str, str]]:
    reference = _llama()
    model = accelerate.cpu_offload(copy.deepcopy(reference), execution_device=torch.device("cpu"))
    return model, reference, {"": "cpu-offload"}


def _disk_offload(tmp: Path) -> tuple[nn.Module, nn.Module, dict[str, str]]:
    reference = _llama()
    model = accelerate.disk_offload(
        copy.deepcopy(reference), offload_dir=tmp / "offload", execution_device="cpu"
    )
    return model, reference, {"": "disk"}


def _dispatch(tmp: Path) -> tuple[nn.Module, nn.Module, dict[str, str]]:
    reference = _llama()
    model = accelerate.dispatch_model(
        copy.deepcopy(reference), device_map=DEVICE_MAP, offload_dir=tmp / "offload"
    )
    return model, reference, DEVICE_MAP


def _from_pretrained(tmp: Path) -> tuple[nn.Module, nn.Module, dict[str, str]]:
    _llama().save_pretrained(tmp / "saved")
    reference = tf.LlamaForCausalLM.from_pretrained(tmp / "saved", dtype=torch.float64).eval()
    with accelerate.init_empty_weights():
        empty = tf.LlamaForCausalLM(reference.config).to(torch.float64)
    sizes = accelerate.utils.compute_module_sizes(empty)
    device_map = accelerate.infer_auto_device_map(
        empty,
        max_memory={"cpu": sizes["model.embed_tokens"] + sizes["model.layers.0"]},
        no_split_module_classes=["LlamaDecoderLayer"],
    )
    assert "disk" in device_map.values() and "cpu" in device_map.values(), device_map
    model = tf.LlamaForCausalLM.from_pretrained(
        tmp / "saved", dtype=torch.float64, device_map=device_map, offload_folder=tmp / "offload"
    ).eval()
    return model, reference, dict(device_map)


STYLES: dict[str, Callable[[Path], tuple[nn.Module, nn.Module, dict[str, str]]]] = {
    "cpu_offload": _cpu_offload,
    "disk_offload": _disk_offload,
    "dispatch_model": _dispatch,
    "from_pretrained": _from_pretrained,
}


def _offloaded(model: nn.Module, device_map: dict[str, str]) -> dict[str, bool]:
    """Per parameter: whether the device map offloads it, i.e. the entry of the longest
    prefix of its name is "disk" or "cpu-offload" (this file's name for ``cpu_offload``,
    whose weights wait in a CPU state dict); under "cpu" the module keeps its weights."""
    result = {}
    for name, _ in model.named_parameters():
        prefixes = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
        result[name] = device_map[max(prefixes, key=len)] in ("disk", "cpu-offload")
    return result


def _snapshot(model: nn.Module) -> dict[str, Any]:
    """What the patch must leave as it found it: each module's attributes (the objects:
    accelerate's ``forward``, ``_hf_hook``, ``_old_forward``, …) and each parameter's and
    buffer's device, dtype and shape (an offloading hook puts new parameter objects in
    place at each forward, so not the objects)."""
    return {
        "modules": {
            name: {k: id(v) for k, v in vars(m).items() if not k.startswith("_parameters")}
            for name, m in model.named_modules()
        },
        "forwards": {name: m.__dict__.get("forward") for name, m in model.named_modules()},
        "tensors": {
            name: (t.device.type, t.dtype, t.shape)
            for name, t in [*model.named_parameters(), *model.named_buffers()]
        },
    }


def _embeddings() -> Tensor:
    return torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1)).double()


def _readout(model: nn.Module, semiring: sa.Semiring, emb: Tensor) -> tuple[Tensor, Tensor]:
    """(the logits of the patched forward, the readout of the target logit w.r.t. emb)."""
    x = emb.clone().requires_grad_()
    with sa.patch(model, semiring):
        logits = model(inputs_embeds=x).logits
    return logits.detach(), sa.grad(logits[TARGET], x)


@pytest.fixture(params=list(STYLES))
def offloaded(request, tmp_path: Path) -> tuple[nn.Module, nn.Module, dict[str, str]]:
    """(offloaded model, the same weights not offloaded, its device map)."""
    model, reference, device_map = STYLES[request.param](tmp_path)
    # the model really is offloaded: its offloaded parameters wait on the meta device
    where = _offloaded(model, device_map)
    assert any(where.values()), device_map
    for name, p in model.named_parameters():
        assert p.device.type == ("meta" if where[name] else "cpu"), name
    assert set(dict(model.named_parameters())) == set(dict(reference.named_parameters()))
    return model, reference, device_map


@pytest.mark.parametrize("semiring", SEMIRINGS, ids=repr)
def test_offloaded_model_gives_the_readouts_of_the_model_on_one_device(offloaded, semiring):
    model, reference, device_map = offloaded
    emb = _embeddings()
    before = _snapshot(model)
    assert any(hasattr(m, "_hf_hook") for m in model.modules())

    logits, got = _readout(model, semiring, emb)
    want_logits, want = _readout(reference, semiring, emb)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if isinstance(semiring, sa.Real):
        x = emb.clone().requires_grad_()
        (autograd,) = torch.autograd.grad(reference(inputs_embeds=x).logits[TARGET], x)
        assert autograd.abs().max() > 0
        torch.testing.assert_close(got, autograd, rtol=1e-7, atol=1e-10)

    # the patch left the model as it was: hooks, forwards, attributes, offloaded parameters
    after = _snapshot(model)
    assert after["tensors"] == before["tensors"]
    assert after["modules"] == before["modules"]
    for name, forward in after["forwards"].items():
        assert forward is before["forwards"][name], name
        assert not hasattr(forward, "__semiring_autograd_patch__"), name
    if device_map is DEVICE_MAP:
        assert isinstance(model.model.layers[0]._hf_hook, accelerate.hooks.AlignDevicesHook)
        assert model.model.layers[0].mlp.up_proj.weight.device.type == "meta"
    with torch.no_grad():
        native = model(inputs_embeds=emb).logits
        torch.testing.assert_close(native, reference(inputs_embeds=emb).logits, rtol=0, atol=0)


def test_readouts_on_an_offloaded_model_satisfy_the_semiring_identities(offloaded):
    """Identities between the semirings' readouts, on the offloaded model alone."""
    model = offloaded[0]
    emb = _embeddings()
    r = {type(S).__name__: _readout(model, S, emb)[1] for S in SEMIRINGS[1:]}
    real, best, log, entropy = r["Real"], r["MaxProduct"], r["Log"], r["Entropy"]
    signed, count, boolean = r["SignedMaxProduct"], r["Counting"], r["Boolean"]
    assert boolean.dtype == torch.bool
    assert boolean.any() and not boolean.all(), "the test needs elements with and without paths"
    assert not boolean[:, 3:].any() and not boolean[1].any()  # causal: no path from there
    assert torch.equal(boolean, best > 0)
    assert torch.equal(boolean, torch.isfinite(log))
    assert torch.equal(boolean, torch.isfinite(count))
    assert boolean[real != 0].all(), "a non-zero gradient without a path"
    b = boolean
    slack = 1e-9 * (1 + log[b].abs())
    assert (best[b].log() <= log[b] + slack).all(), "MaxProduct > exp(Log)"
    assert (real[b].abs().log() <= log[b] + slack).all(), "|Real| > exp(Log)"
    assert (log[b] <= count[b] + best[b].log() + slack).all(), "exp(Log) > #paths · MaxProduct"
    torch.testing.assert_close(
        torch.maximum(signed[0].abs(), signed[1].abs()), best, rtol=1e-12, atol=0.0
    )
    assert (entropy >= 0).all() and (entropy[~b] == 0).all()
    assert (entropy[b] <= count[b] + 1e-9 * (1 + count[b].abs())).all(), "Entropy > log(#paths)"


def _top_path(model: nn.Module, emb: Tensor) -> tuple[Any, Tensor]:
    x = emb.clone().requires_grad_()
    with sa.patch(model, sa.MaxProduct(), paths=True):
        logits = model(inputs_embeds=x).logits
    return sa.top_path(logits[TARGET], x), sa.grad(logits[TARGET], x, retain_graph=True)


def _key(step) -> tuple:
    return (step.module, step.op, step.shape, step.index, step.local_derivative, step.note)


def test_top_path_on_an_offloaded_model_is_the_path_on_one_device(offloaded):
    model, reference, _ = offloaded
    emb = _embeddings()
    got, got_readout = _top_path(model, emb)
    want, readout = _top_path(reference, emb)
    torch.testing.assert_close(got_readout, readout, rtol=1e-12, atol=0.0)
    assert got.weight == pytest.approx(want.weight, rel=1e-12)
    assert want.weight == pytest.approx(float(readout.max()), rel=1e-12)
    # the same steps, named alike (offloaded parameters too: `linear — weight[o, i]`), with
    # the hooks' moves of a module's inputs to the execution device as extra steps of weight 1
    extra = list(got.steps)
    for step in want.steps:
        while extra and _key(extra[0]) != _key(step):
            moved = extra.pop(0)
            assert moved.op == "to" and moved.local_derivative == 1.0, moved
        assert extra, f"step {step} of the path on one device is missing"
        extra.pop(0)
    assert not extra
    # a linear step names the weight element it multiplies by: the reference module's own
    modules = dict(reference.named_modules())
    linear = [(a, b) for a, b in zip(got.steps, got.steps[1:]) if b.op == "linear"]
    assert linear
    for before, step in linear:
        o, i = step.index[-1], before.index[-1]
        assert step.note == f"weight[{o}, {i}]"
        assert step.local_derivative == float(modules[step.module].weight.detach()[o, i])


@pytest.mark.parametrize("semiring", ["max-product", "entropy"])
def test_attribute_on_an_offloaded_model(tmp_path: Path, semiring: str):
    model, reference, _ = _dispatch(tmp_path)
    ids = {"input_ids": torch.tensor([[3, 14, 15, 92, 65]])}
    got = sa.attribute(model, ids, 7, semiring, progress=False)
    want = sa.attribute(reference, ids, 7, semiring, progress=False)
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-12, atol=1e-12)
    assert got.prediction == want.prediction
    assert len(got.paths) == len(want.paths) == (5 if semiring == "max-product" else 0)
    for a, b in zip(got.paths, want.paths):
        assert a.weight == pytest.approx(b.weight, rel=1e-12)
        assert [_key(s) for s in a.steps if s.op != "to"] == [
            _key(s) for s in b.steps if s.op != "to"
        ]
