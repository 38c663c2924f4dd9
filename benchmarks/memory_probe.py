"""Measured peak memory of gspo's policy update, to check `gspo plan`'s memory model against (issue 20).

One measurement per process: build a Qwen3 (dense) or Qwen3-MoE model from config numbers with
random weights on the device, make a synthetic rollout batch, run two policy updates (the first
allocates AdamW's state) and report the memory at rest and the peak of the second update:

* CUDA: ``torch.cuda.max_memory_allocated`` (exact bytes of tensors; the caching allocator's
  reserve is reported beside it);
* CPU: the process's peak resident set (``ru_maxrss``) minus its resident set before the model was
  built (the Python and torch baseline).

    python benchmarks/memory_probe.py --shape dense-0.6b --rows 8 --prompt 128 --response 512 [--ac]
    python benchmarks/memory_probe.py --sweep cpu      # the CPU points, each in its own process

Prints one JSON line per measurement; with ``--plan-margin M`` also `gspo plan`'s estimate of the
same update (``plan_peak``), and exits 1 when the measured peak is more than M (a fraction) above it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

# config numbers (the Qwen3 family's own, some with fewer layers so they fit the machine)
QWEN3_VOCAB = 151_936
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3-0.6B and Qwen3-1.7B as published
    "dense-0.6b": dict(kind="dense", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "dense-1.7b": dict(kind="dense", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    # Qwen3-30B-A3B's layer (128 experts, top-8) with 4 of its 48 layers
    "moe-30b-a3b-4l": dict(kind="moe", hidden_size=2048, moe_intermediate_size=768, num_hidden_layers=4,
                           num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                           num_experts_per_tok=8, tie_word_embeddings=False),
    # CPU-sized: 42M, 160M and 480M parameters, small vocabulary so the layers hold most of the weights
    "cpu-dense-42m": dict(kind="dense", vocab_size=8192, hidden_size=512, intermediate_size=1536,
                          num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                          tie_word_embeddings=True),
    "cpu-dense-160m": dict(kind="dense", vocab_size=8192, hidden_size=1024, intermediate_size=3072,
                           num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                           tie_word_embeddings=True),
    "cpu-moe-480m": dict(kind="moe", vocab_size=8192, hidden_size=768, moe_intermediate_size=384,
                         num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                         num_experts=64, num_experts_per_tok=4, tie_word_embeddings=False),
    # the same size over 16 thinner layers (real models have 28-48): FSDP2's per-layer working set is
    # a smaller share of a rank's memory
    "cpu-moe-490m-16l": dict(kind="moe", vocab_size=8192, hidden_size=768, moe_intermediate_size=384,
                             num_hidden_layers=16, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                             num_experts=32, num_experts_per_tok=4, tie_word_embeddings=False),
}  # fmt: skip
CPU_SWEEP = [
    dict(shape="cpu-dense-42m", rows=8, prompt=64, response=256, ac=False),
    dict(shape="cpu-dense-42m", rows=8, prompt=64, response=256, ac=True),
    dict(shape="cpu-dense-160m", rows=8, prompt=64, response=256, ac=False),
    dict(shape="cpu-dense-160m", rows=8, prompt=64, response=256, ac=True),
    dict(shape="cpu-moe-480m", rows=8, prompt=64, response=256, ac=False),
    dict(shape="cpu-moe-480m", rows=8, prompt=64, response=256, ac=True),
]


def build(shape: str, device: str) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    spec = dict(SHAPES[shape])
    kind = spec.pop("kind")
    spec.setdefault("vocab_size", QWEN3_VOCAB)
    spec |= dict(max_position_embeddings=8192, attn_implementation="sdpa")
    with torch.device(device):
        if kind == "moe":
            cfg = Qwen3MoeConfig(
                **spec, decoder_sparse_step=1, norm_topk_prob=True, output_router_logits=False
            )
            return Qwen3MoeForCausalLM(cfg)
        return Qwen3ForCausalLM(Qwen3Config(**spec))


def measure(
    shape: str, rows: int, prompt: int, response: int, ac: bool, device: str, micro: int, minibatches: int
) -> dict[str, Any]:
    import resource

    import torch

    from gspo.config import Config
    from gspo.data import TrainBatch
    from gspo.model.load import enable_activation_checkpointing
    from gspo.model.routing import is_moe
    from gspo.resolve import for_model, layout_plan, update_plan
    from gspo.training.update import policy_update

    torch.set_num_threads(1 if device == "cpu" else torch.get_num_threads())
    cuda = device.startswith("cuda")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = build(shape, device)
    if ac:
        enable_activation_checkpointing(model)
    n_params = sum(p.numel() for p in model.parameters())
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, V, (rows, prompt + response), generator=g)
    ones_p = torch.ones(rows, prompt, dtype=torch.long)
    ones_t = torch.ones(rows, response, dtype=torch.long)
    data = TrainBatch(
        ids[:, :prompt], ones_p, ids[:, prompt:], ones_t, -torch.rand(rows, response, generator=g),
        torch.randn(rows, generator=g),
    ).to(torch.device(device))  # fmt: skip
    G = 2
    cfg = Config(
        prompts_per_step=rows // G, group_size=G, num_minibatches=minibatches, micro_batch_size=micro,
        max_new_tokens=response, max_prompt_tokens=prompt, routing_replay=False, log_volatility=False,
        old_logp="recompute", device=device,
    ).validate()  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    plan = for_model(update_plan(cfg), layout_plan(cfg), model, is_moe(model))
    out: dict[str, Any] = dict(shape=shape, rows=rows, prompt=prompt, response=response, ac=ac, micro=micro)
    out |= dict(minibatches=minibatches, device=device, params=n_params, layout=plan.layout)
    times = []
    for k in range(2):  # the first update allocates AdamW's state; the second is the steady state
        if cuda:
            torch.cuda.synchronize()
            out[f"rest_{k}"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        policy_update(model, opt, sched, data, plan, 1)
        if cuda:
            torch.cuda.synchronize()
            out[f"peak_{k}"] = torch.cuda.max_memory_allocated()
            out[f"reserved_{k}"] = torch.cuda.max_memory_reserved()
        else:
            out[f"peak_{k}"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
        times.append(time.perf_counter() - t0)
    out["update_s"] = times[-1]
    return out


def planned_peak(r: dict[str, Any]) -> float:
    """`gspo plan`'s update peak (bytes) for the update a measurement ran (its shape and settings,
    one process): what tests/test_capacity.py holds the recorded peaks to."""
    from gspo.capacity import Shape, estimate
    from gspo.config import Config
    from gspo.resolve import capacity_plan

    spec = dict(SHAPES[r["shape"]])
    spec.pop("kind")
    spec.setdefault("vocab_size", QWEN3_VOCAB)
    cfg = Config(
        prompts_per_step=r["rows"] // 2, group_size=2, num_minibatches=r["minibatches"], micro_batch_size=r["micro"],
        max_new_tokens=r["response"], max_prompt_tokens=r["prompt"], activation_checkpointing=r["ac"],
    ).validate()  # fmt: skip
    return estimate(capacity_plan(cfg), Shape.from_config(spec), 1).update_peak


def over_plan(r: dict[str, Any], margin: float) -> str | None:
    """Why the measured steady-state peak (``peak_1``) fails the plan: above its estimate by more than
    ``margin`` (a fraction); None when within."""
    plan = r["plan_peak"]
    if r["peak_1"] <= plan * (1 + margin):
        return None
    return (
        f"{r['shape']} (ac {r['ac']}): measured peak {r['peak_1'] / 2**30:.2f} GiB is "
        f"{r['peak_1'] / plan - 1:+.1%} over gspo plan's {plan / 2**30:.2f} GiB (allowed {margin:.0%})"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--micro", type=int, default=1, help="micro_batch_size (sequences per forward)")
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--ac", action="store_true", help="activation checkpointing")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sweep", choices=["cpu"], help="run the CPU points, each in a fresh process")
    ap.add_argument(
        "--plan-margin", type=float, default=None,
        help="beside the measurement, gspo plan's estimate (plan_peak); exit 1 when the measured peak "
        "exceeds it by more than this fraction (gpu_check.sh: 0.15)",
    )  # fmt: skip
    a = ap.parse_args()
    if a.sweep:
        for p in CPU_SWEEP:
            cmd = [sys.executable, __file__, "--shape", p["shape"], "--rows", str(p["rows"])]
            cmd += ["--prompt", str(p["prompt"]), "--response", str(p["response"])] + (
                ["--ac"] if p["ac"] else []
            )
            print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip(), flush=True)
        return
    res = measure(a.shape, a.rows, a.prompt, a.response, a.ac, a.device, a.micro, a.minibatches)
    why = None
    if a.plan_margin is not None:
        res["plan_peak"] = planned_peak(res)
        why = over_plan(res, a.plan_margin)
    print(json.dumps(res), flush=True)
    if why:
        print(f"memory_probe: {why}", file=sys.stderr, flush=True)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
