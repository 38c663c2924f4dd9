"""The config, resolved once into the plans every stage runs (:mod:`gspo.plans`).

This is where config fields are read: ``gspo.train(cfg)`` (:mod:`gspo.launch`) takes
:func:`resolve`'s one :class:`~gspo.plans.RunPlan`; ``gspo compare``, ``gspo plan`` and the study
runner take the sections they need from the functions below, and hand each stage its plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

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

P = TypeVar("P")


def _take(plan: type[P], cfg: Config, **resolved: Any) -> P:
    """``plan`` with the config's same-named fields, and ``resolved`` for the rest."""
    names = {f.name for f in dataclasses.fields(plan)}  # type: ignore[arg-type]
    return plan(**{n: getattr(cfg, n) for n in names - resolved.keys()}, **resolved)


def prompt_plan(cfg: Config) -> PromptPlan:
    return _take(PromptPlan, cfg)


def task_plan(cfg: Config) -> TaskPlan:
    return _take(TaskPlan, cfg)


def env_plan(cfg: Config, prompt: PromptPlan | None = None) -> EnvPlan | None:
    return _take(EnvPlan, cfg, spec=cfg.env, prompt=prompt or prompt_plan(cfg)) if cfg.env else None


def _parts(cfg: Config) -> dict[str, Any]:
    """The sub-plans several sections share, each built once."""
    prompt = prompt_plan(cfg)
    return dict(prompt=prompt, task=task_plan(cfg), env=env_plan(cfg, prompt))


def engine_plan(cfg: Config) -> EnginePlan:
    return _take(EnginePlan, cfg, return_routing=cfg.routing_replay_source == "rollout")


def sample_plan(cfg: Config, parts: dict[str, Any] | None = None) -> SamplePlan:
    p = parts or _parts(cfg)
    return _take(
        SamplePlan, cfg, engine=engine_plan(cfg), task=p["task"], env=p["env"],
        rollout_devices=rollout_device_list(cfg.rollout_devices),
    )  # fmt: skip


def score_plan(cfg: Config, parts: dict[str, Any] | None = None) -> ScorePlan:
    return _take(ScorePlan, cfg, env=(parts or _parts(cfg))["env"])


def load_plan(cfg: Config, dtype: str | None = None, parts: dict[str, Any] | None = None) -> LoadPlan:
    """``dtype`` overrides the config's (``gspo compare`` warm-starts in float32)."""
    p = parts or _parts(cfg)
    return _take(LoadPlan, cfg, dtype=dtype or cfg.dtype, task=p["task"], prompt=p["prompt"], env=p["env"])


def sft_plan(cfg: Config, parts: dict[str, Any] | None = None) -> SftPlan:
    return _take(SftPlan, cfg, env=(parts or _parts(cfg))["env"])


def capacity_plan(cfg: Config) -> CapacityPlan:
    return CapacityPlan.of(cfg)


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
    parts, capacity = _parts(cfg), capacity_plan(cfg)
    return RunPlan(
        dist=dist_plan(cfg),
        load=load_plan(cfg, parts=parts),
        sft=sft_plan(cfg, parts),
        model=model_plan(cfg),
        optim=optim_plan(cfg),
        sampling=sample_plan(cfg, parts),
        scoring=score_plan(cfg, parts),
        update=update_plan(cfg, capacity.pi_old),
        layout=layout_plan(cfg),
        loop=loop_plan(cfg),
        checkpoints=checkpoint_plan(cfg),
        capacity=capacity,
    )


def dist_plan(cfg: Config) -> DistPlan:
    if cfg.expert_parallel_size > 1:
        _check_experts(cfg)
    return _take(DistPlan, cfg, lora=bool(cfg.lora_rank))


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
    return _take(
        ModelPlan,
        cfg,
        rollout_copy_dtype=cfg.rollout_dtype if copy else None,
        routing_replay=cfg.routing_replay,
    )


def optim_plan(cfg: Config) -> OptimPlan:
    return _take(OptimPlan, cfg)


def loop_plan(cfg: Config) -> LoopPlan:
    from gspo.model.load import stored_dtype

    save = stored_dtype(cfg.model) if cfg.save_dtype == "auto" else cfg.save_dtype
    title = f"{cfg.algo} on {cfg.task} ({cfg.model})"
    return _take(LoopPlan, cfg, run_dir=cfg.run_dir, title=title, save_dtype=save)


# ------------------------------------------------------------------------------------------------
# the update


def plan_update(cfg: Config, policy: nn.Module, is_moe: bool) -> UpdatePlan:
    """The plan of every update of this run (probing ``policy`` once for its layout)."""
    return for_model(update_plan(cfg), layout_plan(cfg), policy, is_moe)


def update_plan(cfg: Config, pi_old: str | None = None) -> UpdatePlan:
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
    pi_old = pi_old or pi_old_source(cfg)
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
    layout_name = _choose_layout(policy, layout)  # (runs the model's probes, once)
    plain = lm_head_is_plain(unwrap(policy, "hf"))
    return dataclasses.replace(plan, layout=layout_name, plain_head=plain, **routing)


def layout_plan(cfg: Config) -> LayoutPlan:
    replay_rows = cfg.routing_replay and cfg.routing_replay_source == "rollout"
    return _take(LayoutPlan, cfg, replay_rows=replay_rows)


def pi_old_source(cfg: Config) -> str:
    """Where the loss's pi_old comes from (:func:`gspo.plans.pi_old_source`)."""
    engine = ENGINES[cfg.rollout_engine]
    return _pi_old_source(cfg.old_logp, cfg.async_staleness, engine, cfg.dtype, cfg.rollout_dtype)


def choose_layout(policy: nn.Module, cfg: Config) -> str:
    return _choose_layout(policy, layout_plan(cfg))


def _choose_layout(policy: nn.Module, plan: LayoutPlan) -> str:
    """Training forward layout (see :mod:`gspo.model.logprobs`). Packing removes padding compute, but
    with dense-mask attention (sdpa/eager) its attention cost grows with the packed length squared,
    so ``auto`` packs only with flash attention; prefix sharing needs a model that takes 4D masks.
    The one-time model probes run here, outside any routing capture or replay that would record them."""
    hf = unwrap(policy, "hf")
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
