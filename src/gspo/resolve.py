"""The config, resolved once into the plans every stage runs (:mod:`gspo.plans`).

This is where config fields are read: ``gspo.train(cfg)`` (:mod:`gspo.launch`) takes
:func:`resolve`'s one :class:`~gspo.plans.RunPlan`; ``gspo compare``, ``gspo plan`` and the study
runner take the sections they need from the functions below, and hand each stage its plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from gspo.config import Config
from gspo.config.algorithm import loss_params, rollout_device_list
from gspo.errors import GspoError
from gspo.losses import LOSSES
from gspo.model.logprobs import attn_implementation, lm_head_is_plain, shared_prefix_is_exact
from gspo.model.unwrap import unwrap
from gspo.plans import (
    ENGINES,
    CapacityPlan,
    CheckpointPlan,
    DistPlan,
    EnginePlan,
    EnvPlan,
    LayoutPlan,
    LoadPlan,
    LoopPlan,
    ModelPlan,
    OptimPlan,
    PromptPlan,
    RunPlan,
    SamplePlan,
    ScorePlan,
    SftPlan,
    TaskPlan,
    UpdatePlan,
)
from gspo.plans import pi_old_source as _pi_old_source


def prompt_plan(cfg: Config) -> PromptPlan:
    return PromptPlan(
        chat_template=cfg.chat_template,
        system_prompt=cfg.system_prompt,
        max_prompt_tokens=cfg.max_prompt_tokens,
    )


def task_plan(cfg: Config) -> TaskPlan:
    return TaskPlan(
        task=cfg.task, reward=cfg.reward, seed=cfg.seed, eval_size=cfg.eval_size, eval_task=cfg.eval_task,
        prompt_field=cfg.prompt_field, answer_field=cfg.answer_field, reward_timeout_s=cfg.reward_timeout_s,
    )  # fmt: skip


def env_plan(cfg: Config, prompt: PromptPlan | None = None) -> EnvPlan | None:
    if not cfg.env:
        return None
    return EnvPlan(
        spec=cfg.env, max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
        max_trajectory_tokens=cfg.max_trajectory_tokens, max_prompt_tokens=cfg.max_prompt_tokens,
        reward_timeout_s=cfg.reward_timeout_s, reward_on_error=cfg.reward_on_error,
        prompt=prompt or prompt_plan(cfg), tool_concurrency=cfg.tool_concurrency,
        tool_tick_steps=cfg.tool_tick_steps,
    )  # fmt: skip


def _parts(cfg: Config) -> dict[str, Any]:
    """The sub-plans several sections share, each built once."""
    prompt = prompt_plan(cfg)
    return dict(prompt=prompt, task=task_plan(cfg), env=env_plan(cfg, prompt))


def engine_plan(cfg: Config) -> EnginePlan:
    return EnginePlan(
        rollout_engine=cfg.rollout_engine, model=cfg.model, dtype=cfg.dtype, rollout_dtype=cfg.rollout_dtype,
        mixed_precision=cfg.mixed_precision, seed=cfg.seed, top_k=cfg.top_k, top_p=cfg.top_p,
        max_prompt_tokens=cfg.max_prompt_tokens, max_new_tokens=cfg.max_new_tokens,
        max_trajectory_tokens=cfg.max_trajectory_tokens, multi_turn=bool(cfg.env),
        return_routing=cfg.routing_replay_source == "rollout",
        vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        vllm_tensor_parallel_size=cfg.vllm_tensor_parallel_size, dist_timeout_min=cfg.dist_timeout_min,
    )  # fmt: skip


def sample_plan(cfg: Config, parts: dict[str, Any] | None = None) -> SamplePlan:
    p = parts or _parts(cfg)
    return SamplePlan(
        group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
        async_staleness=cfg.async_staleness, prompts_per_step=cfg.prompts_per_step, seed=cfg.seed,
        dtype=cfg.dtype, engine=engine_plan(cfg), task=p["task"], env=p["env"],
        dynamic_sampling=cfg.dynamic_sampling, dynamic_sampling_max_rounds=cfg.dynamic_sampling_max_rounds,
        rollout_devices=rollout_device_list(cfg.rollout_devices),
        partial_rollout_tokens=cfg.partial_rollout_tokens,
    )  # fmt: skip


def score_plan(cfg: Config, parts: dict[str, Any] | None = None) -> ScorePlan:
    return ScorePlan(
        group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
        max_trajectory_tokens=cfg.max_trajectory_tokens, overlong_buffer=cfg.overlong_buffer,
        overlong_penalty=cfg.overlong_penalty, overlong_filter=cfg.overlong_filter, adv_scale=cfg.adv_scale,
        reward_on_error=cfg.reward_on_error, env=(parts or _parts(cfg))["env"],
    )  # fmt: skip


def load_plan(cfg: Config, dtype: str | None = None, parts: dict[str, Any] | None = None) -> LoadPlan:
    """``dtype`` overrides the config's (``gspo compare`` warm-starts in float32)."""
    p = parts or _parts(cfg)
    return LoadPlan(
        model=cfg.model, tokenizer=cfg.tokenizer, dtype=dtype or cfg.dtype, seed=cfg.seed,
        keep_dropout=cfg.keep_dropout, max_prompt_tokens=cfg.max_prompt_tokens,
        max_new_tokens=cfg.max_new_tokens, task=p["task"], prompt=p["prompt"], env=p["env"],
    )  # fmt: skip


def sft_plan(cfg: Config, parts: dict[str, Any] | None = None) -> SftPlan:
    return SftPlan(
        sft_steps=cfg.sft_steps, sft_lr=cfg.sft_lr, sft_batch_size=cfg.sft_batch_size, seed=cfg.seed,
        logp_chunk_size=cfg.logp_chunk_size, task=cfg.task, env=(parts or _parts(cfg))["env"],
        sft_tool_fraction=cfg.sft_tool_fraction,
    )  # fmt: skip


def checkpoint_plan(cfg: Config) -> CheckpointPlan:
    return CheckpointPlan(
        run_dir=cfg.run_dir,
        resume=cfg.resume,
        overwrite=cfg.overwrite,
        config=cfg.to_dict(),
        lora=bool(cfg.lora_rank),
        wandb=cfg.wandb,
    )


def resolve(cfg: Config) -> RunPlan:
    """The whole run's plan (``gspo.train``): every section, and every decision in it, made once."""
    parts = _parts(cfg)
    sections = dict(
        dist=dist_plan(cfg),
        load=load_plan(cfg, parts=parts),
        sft=sft_plan(cfg, parts),
        model=model_plan(cfg),
        optim=optim_plan(cfg),
        sampling=sample_plan(cfg, parts),
        scoring=score_plan(cfg, parts),
        update=update_plan(cfg),
        layout=layout_plan(cfg),
        loop=loop_plan(cfg),
        checkpoints=checkpoint_plan(cfg),
    )
    return RunPlan(**sections, capacity=capacity_from(**sections, nproc=cfg.nproc))


def capacity_plan(cfg: Config) -> CapacityPlan:
    """The capacity model's plan alone (``gspo plan``, ``gspo eval``), from the sections it reads."""
    parts = _parts(cfg)
    return capacity_from(
        dist=_dist_plan(cfg), load=load_plan(cfg, parts=parts), sft=sft_plan(cfg, parts), model=model_plan(cfg),
        sampling=sample_plan(cfg, parts), update=update_plan(cfg), layout=layout_plan(cfg), nproc=cfg.nproc,
    )  # fmt: skip


def capacity_from(
    dist: DistPlan, load: LoadPlan, sft: SftPlan, model: ModelPlan, sampling: SamplePlan, update: UpdatePlan,
    layout: LayoutPlan, nproc: int, **_other_sections: Any,
) -> CapacityPlan:  # fmt: skip
    """What the capacity model reads, copied by name from the plan's typed sections."""
    engine = sampling.engine
    return CapacityPlan(
        model=load.model, task=load.task.task, multi_turn=sampling.env is not None, device=dist.device,
        nproc=nproc, prompts_per_step=sampling.prompts_per_step, group_size=sampling.group_size,
        eval_size=load.task.eval_size, sft_steps=sft.sft_steps, sft_batch_size=sft.sft_batch_size,
        micro_batch_size=update.micro_batch_size, num_minibatches=update.num_minibatches,
        max_new_tokens=sampling.max_new_tokens, max_prompt_tokens=load.max_prompt_tokens,
        max_trajectory_tokens=engine.max_trajectory_tokens, logp_chunk_size=update.logp_chunk_size,
        lora_rank=model.lora_rank, async_staleness=sampling.async_staleness, dtype=sampling.dtype,
        rollout_dtype=engine.rollout_dtype, rollout_devices=sampling.rollout_devices,
        mixed_precision=dist.mixed_precision, parallel=dist.parallel,
        expert_parallel_size=dist.expert_parallel_size, activation_checkpointing=model.activation_checkpointing,
        packing=layout.packing, prefix_sharing=layout.prefix_sharing,
        vllm_gpu_memory_utilization=engine.vllm_gpu_memory_utilization,
        vllm_tensor_parallel_size=engine.vllm_tensor_parallel_size, engine_spec=engine.spec,
        pi_old=update.pi_old, trainer_pi_old=update.trainer_pi_old, replay=update.replay,
        volatility=update.volatility is not None,
    )  # fmt: skip


def dist_plan(cfg: Config) -> DistPlan:
    if cfg.expert_parallel_size > 1:
        _check_experts(cfg)
    return _dist_plan(cfg)


def _dist_plan(cfg: Config) -> DistPlan:
    return DistPlan(
        device=cfg.device, parallel=cfg.parallel, mixed_precision=cfg.mixed_precision, lora=bool(cfg.lora_rank),
        threads=1 if cfg.reproducible else cfg.threads, expert_parallel_size=cfg.expert_parallel_size,
        dp_replicate_size=cfg.dp_replicate_size, dist_timeout_min=cfg.dist_timeout_min,
        reproducible=cfg.reproducible,
    )  # fmt: skip


def _check_experts(cfg: Config) -> None:
    """``expert_parallel_size`` must split the model's routed experts: checked from its config alone,
    before any weight is read (a hub id whose numbers gspo does not ship: when the model is wrapped)."""
    from gspo.capacity import shape_of

    try:
        experts = shape_of(cfg.model).experts
    except GspoError:
        return
    ep = cfg.expert_parallel_size
    if not experts or experts % ep:
        why = f"must divide its experts per layer ({experts})" if experts else "is a dense model (no experts)"
        raise GspoError(f"config field 'expert_parallel_size': {cfg.model} {why} (got {ep})")


def model_plan(cfg: Config) -> ModelPlan:
    copy = ENGINES[cfg.rollout_engine].in_trainer and cfg.rollout_dtype not in (None, cfg.dtype)
    return ModelPlan(
        lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_target_modules=cfg.lora_target_modules,
        activation_checkpointing=cfg.activation_checkpointing,
        rollout_copy_dtype=cfg.rollout_dtype if copy else None, routing_replay=cfg.routing_replay,
    )  # fmt: skip


def optim_plan(cfg: Config) -> OptimPlan:
    return OptimPlan(
        lr=cfg.lr, adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, weight_decay=cfg.weight_decay,
        warmup_steps=cfg.warmup_steps,
    )  # fmt: skip


def loop_plan(cfg: Config) -> LoopPlan:
    from gspo.model.load import AUTO_DTYPE, is_hub_id, stored_dtype

    save = cfg.save_dtype
    if save == "auto":  # a hub id's config is read once its files are local (gspo.launch), not here
        save = AUTO_DTYPE if is_hub_id(cfg.model) else stored_dtype(cfg.model)
    title = f"{cfg.algo} on {cfg.task} ({cfg.model})"
    return LoopPlan(
        steps=cfg.steps, eval_every=cfg.eval_every, save_every=cfg.save_every, progress=cfg.progress,
        num_minibatches=cfg.num_minibatches, prompts_per_step=cfg.prompts_per_step, group_size=cfg.group_size,
        seed=cfg.seed, dynamic_sampling=cfg.dynamic_sampling,
        dynamic_sampling_max_rounds=cfg.dynamic_sampling_max_rounds, run_dir=cfg.run_dir, title=title,
        algo=cfg.algo, save_dtype=save,
        observers=("timings", "memory", *(("async_idle",) if cfg.async_staleness else ())),
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# the update


def update_plan(cfg: Config) -> UpdatePlan:
    """Every update's plan as far as the config says it: :func:`for_model` settles the layout, routing
    replay and volatility once the model is loaded (here: as if it were an MoE)."""
    spec = LOSSES[cfg.algo]
    default_aggregation = spec.aggregation  # None: the loss takes none
    aggregation = (cfg.aggregation or default_aggregation) if default_aggregation else None
    replay = None
    if cfg.routing_replay:
        replay = "R3" if cfg.routing_replay_source == "rollout" else "R2"
    vol_i = (1 if cfg.num_minibatches > 1 else 0) if cfg.log_volatility else None
    # minibatch vol_i > 0 is next trained one step after pi_old, so its training forward shows the
    # new routing, unless replay forces the experts there
    volatility = None if vol_i is None else ("free" if vol_i > 0 and replay is None else "forward")
    pi_old = pi_old_source(cfg)
    return UpdatePlan(
        algo=cfg.algo,
        aggregation=aggregation,
        num_minibatches=cfg.num_minibatches,
        micro_batch_size=cfg.micro_batch_size,
        max_grad_norm=cfg.max_grad_norm or float("inf"),
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        logp_chunk_size=cfg.logp_chunk_size,
        layout="rows",
        pi_old=pi_old,
        trainer_pi_old=pi_old == "recompute" or cfg.mismatch_correction != "none",
        replay=replay,
        volatility=volatility,
        volatility_minibatch=vol_i,
        correction=cfg.mismatch_correction,
        mismatch_low=cfg.mismatch_low,
        mismatch_high=cfg.mismatch_high_resolved(),
        mismatch_cap=cfg.mismatch_cap,
        opsm_threshold=cfg.opsm_threshold,
        random_seq_drop=cfg.random_seq_drop,
        loss_kwargs=tuple(spec.resolve(aggregation, **loss_params(cfg)).items()),
    )


def for_model(plan: UpdatePlan, layout: LayoutPlan, policy: nn.Module, is_moe: bool) -> UpdatePlan:
    """``plan`` settled for the loaded model: its layout and LM head probed, and no routing replay or
    volatility for a dense model (no routers)."""
    routing = {} if is_moe else dict(replay=None, volatility=None, volatility_minibatch=None)
    layout_name = choose_layout(policy, layout)  # (runs the model's probes, once)
    plain = lm_head_is_plain(unwrap(policy, "transformers"))
    return dataclasses.replace(plan, layout=layout_name, plain_head=plain, **routing)


def layout_plan(cfg: Config) -> LayoutPlan:
    replay_rows = cfg.routing_replay and cfg.routing_replay_source == "rollout"
    return LayoutPlan(packing=cfg.packing, prefix_sharing=cfg.prefix_sharing, replay_rows=replay_rows)


def pi_old_source(cfg: Config) -> str:
    """Where the loss's pi_old comes from (:func:`gspo.plans.pi_old_source`)."""
    engine = ENGINES[cfg.rollout_engine]
    return _pi_old_source(cfg.old_logp, cfg.async_staleness, engine, cfg.dtype, cfg.rollout_dtype)


def choose_layout(policy: nn.Module, plan: LayoutPlan) -> str:
    """Training forward layout (see :mod:`gspo.model.logprobs`). Packing removes padding compute, but
    with dense-mask attention (sdpa/eager) its attention cost grows with the packed length squared,
    so ``auto`` packs only with flash attention; prefix sharing needs a model that takes 4D masks.
    The one-time model probes run here, outside any routing capture or replay that would record them."""
    hf = unwrap(policy, "transformers")
    lm_head_is_plain(hf)
    impl = attn_implementation(hf)
    if plan.replay_rows:
        return "rows"  # R3's routing comes per row (gspo.rollout.vllm.routing_rows_layout)
    if plan.packing == "on" or (plan.packing == "auto" and impl.startswith("flash")):
        return "packed"
    if plan.prefix_sharing == "off":
        return "rows"
    if shared_prefix_is_exact(hf):
        return "shared_prefix"
    if plan.prefix_sharing == "on":
        raise GspoError(
            "config field 'prefix_sharing': 'on' needs a model that takes a 4D attention mask (sdpa or "
            f"eager attention, no sliding window, positions from position_ids); this one ({impl!r}) "
            "does not (use 'auto' or 'off')"
        )
    return "rows"
