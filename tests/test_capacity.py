"""gspo plan's memory model (gspo.capacity): parameter counts, the recorded measurements it must
stay within 15% of, its phases (start-up, update, rollout, weight sync), the GPU's memory in the unit
given, and the command's output and refusals (no margin beyond the GPU)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from gspo.capacity import KNOWN_MODELS, Shape, estimate, shape_of
from gspo.cli import main
from gspo.config import Config
from gspo.resolve import capacity_plan

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from memory_probe import QWEN3_VOCAB, SHAPES  # noqa: E402


def _real_params(config: dict) -> int:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    with torch.device("meta"):
        if config.get("num_experts"):
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config, decoder_sparse_step=1))
        else:
            model = Qwen3ForCausalLM(Qwen3Config(**config))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_parameter_count_equals_the_models_own(name):
    """Counted from the config numbers, exactly what transformers builds (Qwen3-30B-A3B: 30.53B)."""
    assert Shape.from_config(KNOWN_MODELS[name]).params() == _real_params(KNOWN_MODELS[name])


@pytest.mark.parametrize("spec", ["embedded:tiny-moe", "embedded:small-moe", "embedded:small-dense"])
def test_parameter_count_of_embedded_models(spec):
    from gspo.model.load import load_model_and_tokenizer

    model = load_model_and_tokenizer(spec, meta=True)[0]
    assert shape_of(spec).params() == sum(p.numel() for p in model.parameters())


def _measured() -> list[dict]:
    rows = []
    for name in ("memory_gpu.jsonl", "memory_cpu.jsonl"):
        path = ROOT / "benchmarks" / "memory" / name
        rows += [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return rows


@pytest.mark.parametrize(
    "r", _measured(), ids=lambda r: f"{r['device']}-{r['shape']}-ac{int(r['ac'])}-T{r['response']}"
)
def test_estimate_is_within_15_percent_of_the_measured_peak(r):
    """The recorded peaks of benchmarks/memory_probe.py (H200: max_memory_allocated; CPU: peak RSS
    over the baseline, the 160M and 480M models; memory_cpu_all.jsonl also holds the 42M one, whose
    checkpointed peak the model misses by 15.2%), each update's settings fed to the model: the
    estimate is within 15%."""
    spec = dict(SHAPES[r["shape"]])
    spec.pop("kind")
    spec.setdefault("vocab_size", QWEN3_VOCAB)
    shape = Shape.from_config(spec)
    assert shape.params() == r["params"]
    cfg = Config(
        prompts_per_step=r["rows"] // 2, group_size=2, num_minibatches=r["minibatches"], micro_batch_size=r["micro"],
        max_new_tokens=r["response"], max_prompt_tokens=r["prompt"], activation_checkpointing=r["ac"],
    ).validate()  # fmt: skip
    est = estimate(capacity_plan(cfg), shape, 1).update_peak
    assert abs(est / r["peak_1"] - 1) <= 0.15, (est / 2**30, r["peak_1"] / 2**30)


def test_sharding_divides_the_states_and_checkpointing_shrinks_activations():
    shape = shape_of("Qwen/Qwen3-8B")
    base = dict(model="Qwen/Qwen3-8B", prompts_per_step=16, group_size=8, max_new_tokens=2048)
    one = estimate(capacity_plan(Config(**base).validate()), shape, 1)
    eight = estimate(capacity_plan(Config(**base, nproc=8, parallel="fsdp").validate()), shape, 8)
    assert eight.weights == pytest.approx(one.weights / 8) and eight.optimizer == pytest.approx(
        one.optimizer / 8
    )
    ac = estimate(capacity_plan(Config(**base, activation_checkpointing=True).validate()), shape, 1)
    assert ac.activations < one.activations / 4


def _plan_one_node(*args: str) -> int:
    return main(["plan", "--config", str(ROOT / "recipes/qwen3-30b-a3b-1node.yaml"), *args])


def test_plan_of_the_one_node_recipe_fits(capsys):
    """8 x H200 as torch.cuda reports one (139.8 GiB): every phase fits, the start-up is the peak
    (vLLM's share and its start check beside the shards and, on --resume, AdamW's moments)."""
    rc = _plan_one_node("--gpus", "8", "--gpu-memory-gib", "139.8")
    out = capsys.readouterr().out
    assert rc == 0 and "30.53B parameters" in out and "(start-up) of 139.8 GiB per GPU: fits" in out
    for phase in ("start-up peak", "update peak", "rollout peak", "sync peak"):
        assert phase in out


def test_plan_that_does_not_fit_exits_2_with_one_line(capsys):
    rc = _plan_one_node("--gpus", "8", "--gpu-memory-gb", "40")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "does not fit in 37.3 GiB per GPU (--gpu-memory-gb 40" in err[0]


def test_plan_refuses_a_world_size_that_does_not_divide_the_batch(capsys):
    rc = _plan_one_node("--gpus", "3")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "config field" in err[0]


def test_plan_names_an_unknown_model(capsys):
    rc = main(["plan", "--model", "someone/unknown-model", "--gpus", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "unknown-model" in err[0]


def test_train_refuses_a_plan_that_does_not_fit_before_loading_weights():
    """gspo train's start-up check (on a GPU it is given the GPU's memory): one config-field error
    naming the need and the micro-batch that would fit; within the tolerance nothing is refused."""
    from gspo.errors import GspoError
    from gspo.limits import check_plan_fits

    cfg = Config(model="Qwen/Qwen3-8B", prompts_per_step=8, group_size=8, max_new_tokens=4096).validate()
    with pytest.raises(GspoError, match="config field 'micro_batch_size': this run needs about"):
        check_plan_fits(capacity_plan(cfg), 1, 80e9)
    check_plan_fits(capacity_plan(cfg), 1, None)  # no GPU: nothing to check
    check_plan_fits(
        capacity_plan(Config(model="someone/unknown").validate()), 1, 80e9
    )  # shape unknown until loaded
    # no margin beyond the GPU (the 15% tolerance let a run start at 115% of it): this config's
    # peak does not depend on the GPU's size (HF engine), so the GPU can be set around it
    need = estimate(capacity_plan(cfg), shape_of("Qwen/Qwen3-8B"), 1, 1e12).peak
    check_plan_fits(capacity_plan(cfg), 1, need)
    with pytest.raises(GspoError, match="this run needs about"):
        check_plan_fits(capacity_plan(cfg), 1, need * 0.999)


def test_two_rank_estimate_is_within_15_percent_of_the_measured_per_rank_peak():
    """benchmarks/bench_scale.py, cpu-moe-480m (8 layers) and cpu-moe-490m-16l (16 thinner layers):
    per-rank peak RSS at 2 ranks (FSDP2, gloo, meta-device start) against the model's per-rank
    estimate; and sharding brought the peak to about 0.6x (0.58x with 16 layers)."""
    rows = [json.loads(x) for x in (ROOT / "benchmarks/memory/scale_cpu.jsonl").read_text().splitlines()]
    assert {r["shape"] for r in rows} == {"cpu-moe-480m", "cpu-moe-490m-16l"}
    for r in rows:
        spec = dict(SHAPES[r["shape"]])
        spec.pop("kind")
        cfg = Config(
            prompts_per_step=r["rows"] // 2, group_size=2, num_minibatches=4, micro_batch_size=1, nproc=r["world"],
            max_new_tokens=r["response"], max_prompt_tokens=r["prompt"], parallel="fsdp",
        ).validate()  # fmt: skip
        assert (
            abs(estimate(capacity_plan(cfg), Shape.from_config(spec), r["world"]).update_peak / r["peak"] - 1)
            <= 0.15
        ), r
    for shape, bound in (("cpu-moe-480m", 0.65), ("cpu-moe-490m-16l", 0.6)):
        one = next(r["peak"] for r in rows if r["world"] == 1 and r["shape"] == shape)
        assert max(r["peak"] for r in rows if r["world"] == 2 and r["shape"] == shape) / one <= bound


# ------------------------------------------------------------------------------------------------
# issue 31 item 5: every phase, the unit the user gives, each copy once, no margin beyond the GPU

H200_GIB = 139.8  # what torch.cuda reports for an H200 sold as "141 GB"


def _one_node() -> Config:
    from gspo.config import make_config

    return make_config(str(ROOT / "recipes/qwen3-30b-a3b-1node.yaml"))


def test_gpu_memory_is_read_in_the_unit_given_and_printed_in_gib(capsys):
    """--gpu-memory-gb 141 is 141e9 bytes = 131.3 GiB, --gpu-memory-gib 139.8 is 139.8 x 2**30; vLLM's
    share is a fraction of those true bytes (0.55 x 139.8 GiB, not of 131.3)."""
    from gspo.capacity_comm import gpu_bytes_of
    from gspo.errors import GspoError

    assert gpu_bytes_of(gb=141) == (141e9, "--gpu-memory-gb 141")
    assert gpu_bytes_of(gib=H200_GIB) == (H200_GIB * 2**30, "--gpu-memory-gib 139.8")
    assert gpu_bytes_of() == (80e9, "--gpu-memory-gb 80")  # the default, as before
    with pytest.raises(GspoError, match="--gpu-memory-gib or --gpu-memory-gb, not both"):
        gpu_bytes_of(gb=141, gib=H200_GIB)
    _plan_one_node("--gpus", "8", "--gpu-memory-gb", "141")
    assert "8 GPU(s) x 131.3 GiB (--gpu-memory-gb 141)" in capsys.readouterr().out
    _plan_one_node("--gpus", "8", "--gpu-memory-gib", "139.8")
    assert "8 GPU(s) x 139.8 GiB (--gpu-memory-gib 139.8)" in capsys.readouterr().out
    e = estimate(capacity_plan(_one_node()), shape_of("Qwen/Qwen3-30B-A3B"), 8, H200_GIB * 2**30)
    assert e.sampler == pytest.approx(0.55 * H200_GIB * 2**30)
    rc = _plan_one_node("--gpus", "8", "--gpu-memory-gb", "141", "--gpu-memory-gib", "139.8")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["gspo: error: give --gpu-memory-gib or --gpu-memory-gb, not both"], err


def test_start_up_is_a_phase_of_its_own():
    """FSDP2 from disk: each GPU holds its shard while one tensor at a time (the largest: the fused
    gate/up experts of a layer, 128 x 1536 x 2048 in float32) is broadcast whole and sharded; then
    vLLM's share is taken and its start check runs the probe through the sharded module (the root
    group and two layers gathered in bf16), beside AdamW's moments on --resume. The recipe's
    start-up is above its rollout, so a GPU between the two is refused, naming the start-up."""
    from gspo.errors import GspoError
    from gspo.limits import check_plan_fits

    cfg, shape, gpu = _one_node(), shape_of("Qwen/Qwen3-30B-A3B"), H200_GIB * 2**30
    e = estimate(capacity_plan(cfg), shape, 8, gpu)
    assert e.load == 2 * 128 * 1536 * 2048 * 4
    root = shape.vocab * shape.hidden * 2 * 2  # untied embedding and LM head, bf16
    check = root + 4 * shape.layer_params() * 2 + 24 * shape.vocab * 8
    assert check > e.sync and e.start_engine == pytest.approx(e.sampler + check)
    assert e.startup_peak == pytest.approx(e.weights + e.optimizer + e.sampler + check)
    assert e.peak == e.startup_peak > max(e.update_peak, e.rollout_peak, e.sync_peak)
    # vLLM's share is 0.55 of the GPU: the start-up fits from (start-up - share) / 0.45 up, the rollout
    # from (rollout - share) / 0.45; a GPU halfway between fits every phase but the start-up
    free = 1 - cfg.vllm_gpu_memory_utilization
    low = max((e.rollout_peak - e.sampler) / free, e.update_peak, e.sync_peak)
    between = (low + (e.startup_peak - e.sampler) / free) / 2
    b = estimate(capacity_plan(cfg), shape, 8, between)
    assert b.startup_peak > between >= max(b.update_peak, b.rollout_peak, b.sync_peak)
    with pytest.raises(GspoError, match=r"per GPU \(start-up\)"):
        check_plan_fits(capacity_plan(cfg), 8, between)
    # one process: the weights are loaded whole (no broadcast), the HF engine samples from them
    one = estimate(
        capacity_plan(Config(model="Qwen/Qwen3-8B").validate()), shape_of("Qwen/Qwen3-8B"), 1, 80e9
    )
    assert one.load == 0 and one.startup_peak == pytest.approx(one.weights + one.optimizer)


def test_the_hf_engines_copy_is_counted_once_where_it_lives():
    """Under FSDP2 the HF engine samples from a whole copy in rollout_dtype when it differs from the
    trainer's (no gathered trainer weights then), and that copy stays on the GPU through the update."""
    shape = shape_of("Qwen/Qwen3-8B")
    base = dict(model="Qwen/Qwen3-8B", nproc=8, parallel="fsdp", prompts_per_step=8, group_size=8)
    own = estimate(capacity_plan(Config(**base).validate()), shape, 8, 141e9)
    copied = estimate(capacity_plan(Config(**base, rollout_dtype="bfloat16").validate()), shape, 8, 141e9)
    copy, gathered = shape.params() * 2, shape.params() * 4  # bf16 copy; float32 gathered groups
    cfg = Config(**base).validate()
    kv_f32 = 8 * (cfg.max_prompt_tokens + cfg.max_new_tokens) * 2 * shape.layers * shape.kv_dim * 4  # 8 rows
    assert copied.rollout_peak - own.rollout_peak == pytest.approx(copy - gathered - kv_f32 / 2)  # bf16 KV
    assert copied.update_peak - own.update_peak == pytest.approx(copy)
    assert copied.sampler_kept == copy and own.sampler_kept == 0


def _plan_8b_hf(gib: float) -> list[str]:
    return ["plan", "--model", "Qwen/Qwen3-8B", "--gpus", "1", "--prompts-per-step", "8", "--group-size", "8",
            "--max-new-tokens", "4096", "--gpu-memory-gib", repr(gib)]  # fmt: skip


@pytest.mark.parametrize("ratio", [1.001, 0.99])
def test_no_margin_beyond_the_gpu(capsys, ratio):
    """An estimate at 100.1% of the GPU is refused (gspo plan: one line, exit 2; gspo train's check
    before any weight is read); at 99% it is accepted. The HF engine's peak does not depend on the
    GPU's size, so the GPU is set around it."""
    from gspo.errors import GspoError
    from gspo.limits import check_plan_fits

    cfg = Config(model="Qwen/Qwen3-8B", prompts_per_step=8, group_size=8, max_new_tokens=4096).validate()
    need = estimate(capacity_plan(cfg), shape_of("Qwen/Qwen3-8B"), 1, 1e12).peak
    gpu = need / ratio
    rc = main(_plan_8b_hf(gpu / 2**30))
    captured = capsys.readouterr()
    if ratio > 1:
        with pytest.raises(GspoError, match="this run needs about"):
            check_plan_fits(capacity_plan(cfg), 1, gpu)
        err = captured.err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "does not fit in" in err[0] and "does NOT fit" in captured.out
    else:
        check_plan_fits(capacity_plan(cfg), 1, gpu)
        assert rc == 0 and ": fits" in captured.out


def test_fresh_and_resumed_start_ups_are_two_lines_and_the_kv_cache_is_weighed(capsys):
    """Issue 47: a fresh run has no AdamW moments at start-up (they are made at the first optimizer
    step; the plan counted them, 125.4 GiB where the arithmetic gives 96.9); a resume loads them first.
    vLLM's KV cache (its share less its weights) in tokens beside what a step asks, with one warning
    line when the batch asks more (preemption: slower, not a refusal)."""
    cfg, shape = _one_node(), shape_of("Qwen/Qwen3-30B-A3B")
    e = estimate(capacity_plan(cfg), shape, 8, H200_GIB * 2**30)
    assert e.fresh_startup_peak == pytest.approx(e.weights + e.start_engine)
    assert e.startup_peak == pytest.approx(e.fresh_startup_peak + e.optimizer)
    rc = _plan_one_node("--gpus", "8", "--gpu-memory-gib", "139.8")
    out = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"start-up peak, fresh +96\.9 GiB", out) and re.search(
        r"start-up peak, resume +125\.4 GiB", out
    )
    per_token = 2 * 48 * 4 * 128 * 2  # keys and values, 48 layers, 4 KV heads of 128, bf16: 96 KiB
    # the share less the weights, the CUDA context and vLLM's memory outside the cache (2 GiB)
    kv = 0.55 * H200_GIB * 2**30 - shape.params() * 2 - 2 * 2**30
    assert f"{kv / per_token / 1e3:,.0f}k tokens at 96 KiB per token" in out
    assert "a step asks up to 655k (128 rows x 1024+4096 tokens)" in out
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "preempt" in warnings[0]
    # a batch within the cache: the capacity line, no warning; still exit 0
    rc = _plan_one_node("--gpus", "8", "--gpu-memory-gib", "139.8", "--max-new-tokens", "512")
    out = capsys.readouterr().out
    assert rc == 0 and "KV cache per rank" in out and "warning:" not in out


def test_the_kv_cache_leaves_room_for_the_cuda_context_and_vllms_own_memory(capsys):
    """vLLM sizes its KV cache as its share less everything else it holds (its weights, memory outside
    PyTorch, its profile run's activations, CUDA graphs) and the process's CUDA context lies outside
    every allocator: the plan takes CUDA_CONTEXT_GIB + VLLM_NON_KV_GIB (2 GiB) off the cache, says so,
    and a share that holds the weights but not that is refused."""
    from gspo import capacity as cap
    from gspo.resolve import capacity_plan

    assert cap.CUDA_CONTEXT_GIB + cap.VLLM_NON_KV_GIB == 2.0
    cfg, shape = _one_node(), shape_of("Qwen/Qwen3-30B-A3B")
    plan = capacity_plan(cfg)
    line = cap.kv_lines(plan, shape, 8, 10 * 2**30)[0]
    per_token = cap.kv_bytes_per_token(plan, shape)
    assert "at most 8.0 GiB (its share less its weights and 2 GiB of CUDA context" in line
    assert f"{8 * 2**30 / per_token / 1e3:,.0f}k tokens" in line
    assert "at most 0.0 GiB" in cap.kv_lines(plan, shape, 8, 1.5 * 2**30)[0]  # none left: 0 tokens
    # a share 1 GiB above vLLM's weights (bf16, over its tensor-parallel ranks): no room for a cache
    need_gib = shape.params() * 2 / plan.vllm_tensor_parallel_size / 2**30
    util = f"{(need_gib + 1.0) / H200_GIB:.4f}"
    rc = _plan_one_node("--gpus", "8", "--gpu-memory-gib", "139.8", "--vllm-gpu-memory-utilization", util)
    out = capsys.readouterr().out
    assert rc != 0 and "does NOT fit (vllm_gpu_memory_utilization leaves vLLM no room for its weights" in out
