"""Upper bounds of the numeric config fields: what the machine can hold, and sensible hard limits.

:func:`check_config` runs in :meth:`gspo.config.Config.validate` (no model needed): hard bounds that
keep absurd values (``1e50`` prompts, a 10**9 held-out set) from hanging or exhausting memory, and a
lower-bound memory estimate of the batches against the available memory. :func:`check_resources`
refines it once the model is loaded (KV cache, logits, activations, async weight copies, file
descriptors). Both raise a one-line :class:`GspoError` naming the field.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping
from typing import Any

from gspo import memory
from gspo.capacity import response_tokens
from gspo.errors import GspoError
from gspo.plans import CapacityPlan, EnginePlan, config_field
from gspo.tasks.timelimit import MAX_TIMEOUT_S

# hard bounds: far above any real use, low enough that nothing downstream overflows or hangs on them
MAX_COUNT = 10**9  # steps, warm-start steps, intervals
MAX_BATCH = 10**6  # sequences of one batch (prompts x G, held-out set, warm-start batch)
MAX_TOKENS = 10**6  # prompt / response tokens (longer than any model's context)
INT_LIMITS = {
    "seed": 2**32 - 1,  # numpy's seed range
    "steps": MAX_COUNT, "sft_steps": MAX_COUNT, "warmup_steps": MAX_COUNT, "eval_every": MAX_COUNT,
    "save_every": MAX_COUNT,
    "prompts_per_step": MAX_BATCH, "group_size": MAX_BATCH, "eval_size": MAX_BATCH, "sft_batch_size": MAX_BATCH,
    "micro_batch_size": MAX_BATCH, "num_minibatches": MAX_BATCH,
    "max_new_tokens": MAX_TOKENS, "max_prompt_tokens": MAX_TOKENS, "overlong_buffer": MAX_TOKENS,
    "logp_chunk_size": MAX_TOKENS,
    "threads": 1024, "nproc": 1024, "lora_rank": 65536,
    "dynamic_sampling_max_rounds": 1000, "max_turns": 1000, "max_trajectory_tokens": MAX_TOKENS,
    "async_staleness": 64,  # K+1 weight copies in shared memory: more is never useful
}  # fmt: skip
FLOAT_LIMITS = {
    # threading's timeouts overflow past ~9e9 s; a week is already "no limit" for one reward call
    "reward_timeout_s": MAX_TIMEOUT_S,
    # rewards are float32 in training: a penalty near its max (3.4e38) already sums to inf
    "overlong_penalty": 1e30,
    "temperature": 1e4,
}
MIN_TEMPERATURE = 1e-3  # logits / T overflow float32 to inf below about this (NaN probabilities)
BYTES_PER_SEQUENCE = 1024  # at least: the Example, its token-id list and its row of the batch tensors
BYTES_PER_RESPONSE_TOKEN = 24  # response ids + mask (int64) + sampler log-prob (float32)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _bad(plan: CapacityPlan, field: str, msg: str) -> GspoError:
    return GspoError(f"config field '{config_field(field)}': {msg} (got {getattr(plan, field)!r})")


def check_config(values: Mapping[str, Any]) -> None:
    """Hard upper bounds of every numeric config field (``values``: the config's fields by name,
    checked before any relation between them is computed), then the batches' least memory against
    what is free."""

    def bad(f: str, msg: str) -> GspoError:
        return GspoError(f"config field '{f}': {msg} (got {values[f]!r})")

    for f, hi in INT_LIMITS.items():
        if values[f] > hi:
            raise bad(f, f"must be <= {hi:,}")
    if values["seed"] < 0:
        raise bad("seed", "must be >= 0")
    for f, hi in FLOAT_LIMITS.items():
        if values[f] > hi:
            raise bad(f, f"must be <= {hi:g}")
    if values["temperature"] < MIN_TEMPERATURE:
        raise bad("temperature", f"must be >= {MIN_TEMPERATURE:g} (smaller overflows the logits)")
    rows = values["prompts_per_step"] * values["group_size"]
    if rows > MAX_BATCH:
        raise bad("prompts_per_step", f"prompts_per_step x group_size must be <= {MAX_BATCH:,}")
    free = memory.available_memory()
    if free is None:
        return
    # a sampled sequence after its prompt: one response, or a multi-turn run's whole trajectory
    after_prompt = values["max_trajectory_tokens"] if values["env"] else values["max_new_tokens"]
    per_seq = BYTES_PER_SEQUENCE + after_prompt * BYTES_PER_RESPONSE_TOKEN
    for field, seqs in (
        ("prompts_per_step", rows),
        ("eval_size", values["eval_size"] * _eval_draws(values["task"])),
        ("sft_batch_size", values["sft_batch_size"]),
    ):
        need = seqs * per_seq
        if need > free:
            raise bad(field, f"needs at least {_gib(need)} of memory, {_gib(free)} is available")


def _eval_draws(task: str) -> int:
    """Examples drawn per held-out one: embedded and reasoning-gym tasks draw 4x to skip training ones."""
    from gspo.tasks.synthetic import SYNTHETIC_TASKS

    return 4 if task in SYNTHETIC_TASKS or task.startswith("rg:") else 1


def _device_memory(device: Any) -> int | None:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # noqa: BLE001 (no driver, or a device index that does not exist)
            return None
    return memory.available_memory()


def check_resources(plan: CapacityPlan, model: Any) -> None:
    """Memory of the largest batches with this model (KV cache of a generation chunk, logits and
    activations of a training micro-batch and of a warm-start batch), the async sampler's weight
    copies and their file descriptors, against what the model's device has free. Call after loading
    the model, before any work."""
    params = [p for p in model.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    c = model.config
    get = lambda *names, default=1: next((getattr(c, n) for n in names if getattr(c, n, None)), default)  # noqa: E731
    layers, hidden = get("num_hidden_layers", "n_layer"), get("hidden_size", "n_embd")
    heads = get("num_attention_heads", "n_head")
    kv_heads, head_dim = get("num_key_value_heads", default=heads), get("head_dim", default=hidden // heads)
    vocab, elem = get("vocab_size"), params[0].element_size() if params else 4
    T = plan.max_prompt_tokens + response_tokens(plan)  # a multi-turn run: its whole trajectory
    per_token_kv = layers * 2 * kv_heads * head_dim * elem
    per_token_act = layers * hidden * elem * 4  # a lower bound of what backward keeps per token
    chunk = min(256, max(plan.eval_size, plan.prompts_per_step * plan.group_size // plan.nproc))  # HF engine
    mb = plan.micro_batch_size or max(
        1, plan.prompts_per_step * plan.group_size // plan.nproc // plan.num_minibatches
    )
    logits = min(T, plan.logp_chunk_size) * vocab * 4 * 2  # float32 log-softmax of one LM-head chunk
    needs = {
        "prompts_per_step": chunk * (T * per_token_kv + vocab * 4 * 2),
        "micro_batch_size" if plan.micro_batch_size else "num_minibatches": mb * (T * per_token_act + logits),
        "sft_batch_size": (plan.sft_batch_size * (T * per_token_act + logits)) if plan.sft_steps else 0,
        # K+1 received weight copies: in shared memory, or on the sampler's own device (not this one)
        "async_staleness": (plan.async_staleness + 1) * param_bytes if _copies_here(plan) else 0,
    }
    if plan.lora_rank > hidden:  # a rank past the hidden size adds parameters and no expressiveness
        raise _bad(plan, "lora_rank", f"must be <= the model's hidden size {hidden}")
    device = next((p.device for p in params), None)
    free = _device_memory(device)
    for field, need in needs.items():
        if free is not None and need > free:
            raise _bad(
                plan, field, f"needs about {_gib(need)} of memory with this model, {_gib(free)} is free"
            )
    check_vllm_share(plan)
    if plan.async_staleness and not plan.rollout_devices:  # one descriptor per shared tensor per copy
        fds = (plan.async_staleness + 1) * len(params) + 256
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY and fds > soft:
            raise _bad(
                plan, "async_staleness",
                f"needs about {fds} open files ({len(params)} tensors x {plan.async_staleness + 1} weight copies), "
                f"the limit is {soft} (ulimit -n)",
            )  # fmt: skip


def check_local_ranks(nproc: int) -> None:
    """``gspo train --nproc N`` starts N processes on this machine, each with its own model: at most
    4 per CPU core (or one per GPU). Checked where they are launched, not in the config: a config may
    describe a multi-node world size (torchrun launches it, e.g. a recipe for 4 nodes)."""
    cpus = os.cpu_count() or 1
    if nproc > 4 * cpus:
        import torch

        if nproc > torch.cuda.device_count():
            raise GspoError(
                f"config field 'nproc': must be <= 4 x the {cpus} CPU cores (or the GPUs) of this machine "
                f"to launch here (got {nproc}); for several machines start torchrun on each"
            )


def check_vllm_share(plan: CapacityPlan | EnginePlan, device: Any = None, share: float | None = None) -> None:
    """vLLM on a GPU takes ``share`` (default ``vllm_gpu_memory_utilization``) of the GPU's total memory
    at start and refuses to start when that is more than is free: refused here first, in one line
    naming the field. The vLLM engine calls it on ``device`` after the trainer is sharded and
    PyTorch's cache emptied, just before vLLM starts, where "free" is true; :func:`check_resources`
    calls it earlier (on the sharded path nothing is allocated yet then, so it only catches a share
    larger than the whole free GPU)."""
    import torch

    spec = plan.spec if isinstance(plan, EnginePlan) else plan.engine_spec
    if not spec.gpu_share or not torch.cuda.is_available():
        return
    share = plan.vllm_gpu_memory_utilization if share is None else share
    free, total = torch.cuda.mem_get_info(device)
    want = share * total
    if want > free:
        raise _bad(
            plan, "vllm_gpu_memory_utilization",
            f"{share:g} of this GPU is {_gib(want)}, only {_gib(free)} is free after the trainer took its "
            "share (lower it, or shard the trainer over more GPUs)",
        )  # fmt: skip


def check_plan_fits(plan: CapacityPlan, world: int, gpu_bytes: float | None) -> None:
    """Refuse, before any weight is loaded, a run whose per-GPU peak (``gspo plan``'s model) exceeds
    the GPU's memory, with no margin beyond the GPU (the model's estimates measured so far were at or
    below the measured peaks, benchmarks/RESULTS_scale.md, so a margin could only go the other way).
    ``gpu_bytes`` None (no GPU) or a model whose
    shape cannot be read without loading it: nothing to check."""
    from gspo.capacity import estimate, largest_micro_batch, shape_of

    if gpu_bytes is None:
        return
    try:
        shape = shape_of(plan.model)
    except GspoError:  # a hub id whose numbers gspo does not ship: found out when it loads
        return
    e = estimate(plan, shape, world, gpu_bytes)
    peak = e.peak
    if peak > gpu_bytes:
        phase = max(e.phases().items(), key=lambda kv: kv[1])[0]
        best = largest_micro_batch(plan, shape, world, gpu_bytes)
        hint = f"micro_batch_size {best} fits" if best else "see `gspo plan` for where the memory goes"
        raise _bad(
            plan, "micro_batch_size",
            f"this run needs about {_gib(peak)} per GPU ({phase}), the GPU has {_gib(gpu_bytes)} ({hint})",
        )  # fmt: skip


def gpu_total_memory(device: Any) -> float | None:
    import torch

    if getattr(device, "type", None) != "cuda":
        return None
    return float(torch.cuda.get_device_properties(device).total_memory)


def _copies_here(plan: CapacityPlan) -> bool:
    """Whether async's K+1 weight copies take this device's memory: shared memory, or a sampler whose
    own device is the CPU (a sampler on a GPU of its own holds them there)."""
    return bool(plan.async_staleness) and plan.rollout_devices in ((), ("cpu",))
