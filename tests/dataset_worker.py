"""A dataset attribution run in its own process, for tests/test_dataset_runs.py: the tiny
float64 Llama of :func:`model`, over :data:`RECORDS`, into the folder argv[1].

    python tests/dataset_worker.py OUT [--resume] [--slow] [--format jsonl]
    torchrun --standalone --nproc_per_node 2 tests/dataset_worker.py OUT

``--slow`` sleeps 0.2 s before each forward, so a test can kill the run midway.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from model_zoo import llama_config, minilm  # noqa: E402

from semiring_autograd.explain.dataset import attribute_dataset  # noqa: E402

WORDS = "the keys to the cabinet are on a table near the door of our house".split()
#: texts of 1 to 14 words, targets as ids or strings, read positions, and bad records
RECORDS = [
    {"text": " ".join(WORDS[: 1 + i % 14]), "target": [7, "table", 11][i % 3], "id": f"r{i}"}
    for i in range(24)
]
RECORDS[4] = {"text": "", "target": 3}
RECORDS[9] = {"text": "a cat", "target": "tablecloths"}
RECORDS[13] = {"text": "a cat", "target": 5, "position": 7}
RECORDS[17]["position"] = -2
SEMIRINGS = ("max-product", "log")


def model():
    """The tiny random float64 Llama over MiniLM's vocabulary, and that tokenizer."""
    _, tokenizer = minilm()
    torch.manual_seed(0)
    config = llama_config(vocab_size=tokenizer.vocab_size)
    return transformers.LlamaForCausalLM(config).double().eval(), tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--slow", action="store_true")
    parser.add_argument("--format", default="parquet")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lm, tokenizer = model()
    if args.slow:
        lm.register_forward_pre_hook(lambda *_: time.sleep(0.2))
    attribute_dataset(
        lm,
        RECORDS,
        args.out,
        tokenizer=tokenizer,
        semirings=SEMIRINGS,
        batch_size=4,
        part_size=4,
        format=args.format,
        resume=args.resume,
        progress=False,
    )


if __name__ == "__main__":
    main()
