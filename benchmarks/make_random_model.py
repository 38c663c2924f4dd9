"""A randomly initialised Hugging Face folder of a published Qwen3 shape, with gspo's character
tokenizer, for `gspo train --model DIR` where no weights can be downloaded (the GPU check).

    python benchmarks/make_random_model.py --shape dense-0.6b --out /tmp/qwen3-0.6b-random

Shapes are memory_probe.py's (the Qwen3 family's own config numbers, vocabulary 151,936). The
weights are random, so the run measures memory and speed, not learning.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_probe import QWEN3_VOCAB, SHAPES  # noqa: E402

from gspo.model.load import build_char_tokenizer, save_pretrained  # noqa: E402


def build(shape: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    spec = dict(SHAPES[shape])
    kind = spec.pop("kind")
    spec.setdefault("vocab_size", QWEN3_VOCAB)
    torch.manual_seed(0)
    if kind == "moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**spec, torch_dtype=dtype)).to(dtype)
    return Qwen3ForCausalLM(Qwen3Config(**spec, torch_dtype=dtype)).to(dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="dense-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    model = build(a.shape, getattr(torch, a.dtype))
    save_pretrained(model, build_char_tokenizer(), a.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{a.shape}: {n / 1e6:.0f}M parameters -> {a.out}")


if __name__ == "__main__":
    main()
