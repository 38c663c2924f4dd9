"""Weight sync into vLLM (VLLMRolloutEngine.sync_weights) vs model size, on real vLLM.

Per model: parameter count and float32 size, the median wall time of ``sync_weights`` (HF-format
streaming, vLLM's in-place reload, the CPU repack workaround, prefix-cache reset) and of its first two
parts (``reload``: streaming + vLLM's reload; ``fixes``: the CPU repack workaround), of the HF-format
conversion alone (iterating ``hf_checkpoint_weights``) and, as the baseline the engine replaced, of
a sync through the disk (``save_pretrained`` to a temporary folder, tensors read back, then the same
reload, workaround and reset); ``ratio`` = via disk / in memory. After the timed syncs it checks
that vLLM's log-probs still equal the trainer's. ``peak MB`` is the sync's peak above the resting
state (the process's high-water mark, reset through ``/proc/self/clear_refs`` just before one sync,
minus the resident size then), ``layer MB`` the largest decoder layer's float32 size, ``embed MB`` the
embedding's, and ``peak/unit`` the peak over the larger of the two (the largest piece the sync
streams at once; the issue's target: <= 1.5 x the largest decoder layer).

Run in the vLLM venv (``bash .ci/vllm_env.sh``)::

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/bench_vllm_sync.py [--repeats 5] [--sizes S,M,L,MoE-M]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

from gspo.compat import vllm_cpu_reload  # noqa: E402
from gspo.config import Config  # noqa: E402
from gspo.model.export import hf_checkpoint_weights  # noqa: E402
from gspo.model.load import build_char_tokenizer  # noqa: E402
from gspo.resolve import engine_plan  # noqa: E402
from gspo.rollout.vllm import VLLMRolloutEngine  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gspo.memory import proc_status_mib, reset_peak_rss  # noqa: E402  (VmRSS/VmHWM in MiB, VmHWM reset)

SIZES = {
    # name: (kind, hidden, layers, intermediate, heads, kv heads, vocab, experts)
    "S": ("dense", 256, 4, 1024, 8, 4, 8192, 0),
    "M": ("dense", 512, 8, 2048, 16, 8, 16384, 0),
    "L": ("dense", 1024, 12, 4096, 32, 8, 32768, 0),
    "MoE-M": ("moe", 512, 8, 512, 16, 8, 16384, 16),
    # decoder layers larger than the embedding, as in Qwen3-30B-A3B (float32: a layer 2.4 GB, the
    # embedding 1.2 GB); in dense Qwen3 models the embedding is the larger (Qwen3-8B: 2.5 GB, a layer 0.7 GB)
    "W": ("dense", 1024, 4, 8192, 16, 8, 4096, 0),
}


def build(kind: str, h: int, layers: int, inter: int, heads: int, kv: int, vocab: int, experts: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=vocab,
        hidden_size=h,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=h // heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(0)
    if kind == "moe":
        cfg = Qwen3MoeConfig(
            moe_intermediate_size=inter,
            num_experts=experts,
            num_experts_per_tok=2,
            intermediate_size=inter,
            **common,
        )
        return Qwen3MoeForCausalLM(cfg).eval()
    return Qwen3ForCausalLM(Qwen3Config(intermediate_size=inter, **common)).eval()


def sync_peak_mb(engine) -> float:
    """MB above the resting state at the peak of one ``sync_weights`` (Linux: VmHWM reset to VmRSS)."""
    import gc

    gc.collect()
    if not reset_peak_rss():  # the high-water mark starts again from now
        raise SystemExit("peak memory: /proc/self/clear_refs is not writable here (Linux >= 4.0 needed)")
    rest = proc_status_mib()["VmRSS"]
    engine.sync_weights()
    return proc_status_mib()["VmHWM"] - rest


def largest_layer_mb(model) -> float:
    return (
        max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.model.layers)
        / 2**20
    )


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sync_through_disk(engine) -> None:
    """The baseline: what a sync costs when the weights go through a folder (``save_pretrained``,
    read back, then the same in-place reload, repack workaround and cache reset)."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        engine.trainer_model.save_pretrained(d, safe_serialization=True)
        weights = [kv for f in sorted(Path(d).glob("*.safetensors")) for kv in load_file(str(f)).items()]
    with torch.no_grad():
        engine.llm.collective_rpc(
            "reload_weights", kwargs=dict(weights_iterator=iter(weights), is_checkpoint_format=True)
        )
        if engine._cpu_fixes:
            engine.llm.apply_model(vllm_cpu_reload.post_reload_fixes)
    engine.llm.reset_prefix_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default=",".join(SIZES))
    args = ap.parse_args()
    tok = build_char_tokenizer()
    print(f"torch threads {torch.get_num_threads()}, repeats {args.repeats} (median)")
    print(
        f"{'model':>6} {'params':>8} {'MB fp32':>8} {'sync ms':>8} {'reload ms':>9} {'fixes ms':>8} "
        f"{'convert ms':>10} {'via disk ms':>11} {'ratio':>6} {'|dlogp| after':>13} {'ms/Mparam':>9} "
        f"{'peak MB':>8} {'layer MB':>8} {'embed MB':>8} {'peak/unit':>9}"
    )
    for name in args.sizes.split(","):
        model = build(*SIZES[name])
        n = sum(p.numel() for p in model.parameters())
        plan = engine_plan(Config(rollout_engine="vllm", model=name, dtype="float32", seed=0))
        engine = VLLMRolloutEngine.from_trainer(plan, model, tok, max_model_len=256)
        try:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
            engine.sync_weights()  # warm-up
            parts = []
            sync = median_time(
                lambda e=engine, ps=parts: (e.sync_weights(), ps.append(e.last_sync_parts)), args.repeats
            )
            med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
            convert = median_time(lambda m=model: sum(1 for _ in hf_checkpoint_weights(m)), args.repeats)
            disk = median_time(lambda e=engine: sync_through_disk(e), args.repeats)
            diff = engine.check_logprobs()
            peak = statistics.median(sync_peak_mb(engine) for _ in range(3))
            layer = largest_layer_mb(model)
            embed = model.get_input_embeddings().weight.numel() * 4 / 2**20
        finally:
            engine.close()
        print(
            f"{name:>6} {n / 1e6:7.1f}M {n * 4 / 2**20:8.0f} {sync * 1e3:8.1f} {med['stream_reload_s'] * 1e3:9.1f} "
            f"{med['cpu_fixes_s'] * 1e3:8.1f} {convert * 1e3:10.1f} {disk * 1e3:11.1f} {disk / sync:6.2f} {diff:13.1e} "
            f"{sync * 1e9 / n:9.2f} {peak:8.1f} {layer:8.1f} {embed:8.1f} {peak / max(layer, embed):9.2f}",
            flush=True,
        )
        del model


if __name__ == "__main__":
    main()
