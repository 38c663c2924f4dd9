"""The config, resolved once into the plans every stage runs (:mod:`gspo.plans`).

This is where config fields are read: ``gspo.train(cfg)`` (:mod:`gspo.launch`), ``gspo compare`` and
the study runner resolve here, and hand each stage its plan.
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
    DistPlan,
    EnginePlan,
    EnvPlan,
    LoadPlan,
    LoopPlan,
    ModelPlan,
    OptimPlan,
    PromptPlan,
    SamplePlan,
    ScorePlan,
    SftPlan,
    TaskPlan,
    UpdatePlan,
)

P = TypeVar("P")


def _take(plan: type[P], cfg: Config, **resolved: Any) -> P:
    """``plan`` with the config's same-named fields, and ``resolved`` for the rest."""
    names = {f.name for f in dataclasses.fields(plan)}  # type: ignore[arg-type]
    return plan(**{n: getattr(cfg, n) for n in names - resolved.keys()}, **resolved)


def prompt_plan(cfg: Config) -> PromptPlan:
    return _take(PromptPlan, cfg)


def task_plan(cfg: Config) -> TaskPlan:
    return _take(TaskPlan, cfg)


def env_plan(cfg: Config) -> EnvPlan | None:
    return _take(EnvPlan, cfg, prompt=prompt_plan(cfg)) if cfg.env else None


def engine_plan(cfg: Config) -> EnginePlan:
    return _take(EnginePlan, cfg, return_routing=cfg.routing_replay_source == "rollout")


def sample_plan(cfg: Config) -> SamplePlan:
    plans = dict(engine=engine_plan(cfg), task=task_plan(cfg), env=env_plan(cfg))
    return _take(SamplePlan, cfg, **plans, rollout_devices=rollout_device_list(cfg.rollout_devices))


def score_plan(cfg: Config) -> ScorePlan:
    return _take(ScorePlan, cfg, env=env_plan(cfg))


def load_plan(cfg: Config, dtype: str | None = None) -> LoadPlan:
    """``dtype`` overrides the config's (``gspo compare`` warm-starts in float32)."""
    return _take(
        LoadPlan,
        cfg,
        dtype=dtype or cfg.dtype,
        task=task_plan(cfg),
        prompt=prompt_plan(cfg),
        env=env_plan(cfg),
    )


def sft_plan(cfg: Config) -> SftPlan:
    return _take(SftPlan, cfg, env=env_plan(cfg))


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
    copy = cfg.rollout_engine == "hf" and cfg.rollout_dtype not in (None, cfg.dtype)
    return _take(ModelPlan, cfg, rollout_copy_dtype=cfg.rollout_dtype if copy else None)


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
    default_aggregation = LOSSES[cfg.algo].aggregation  # None: the loss takes none
    aggregation = (cfg.aggregation or default_aggregation) if default_aggregation else None
    replay = None
    if is_moe and cfg.routing_replay:
        replay = "R3" if cfg.routing_replay_source == "rollout" else "R2"
    vol_i = (1 if cfg.num_minibatches > 1 else 0) if is_moe and cfg.log_volatility else None
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
        layout=choose_layout(policy, cfg),
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
        loss_params=tuple(loss_params(cfg).items()),
    )


def pi_old_source(cfg: Config) -> str:
    """Where the loss's pi_old comes from: ``rollout`` (the sampler's log-probs) or ``recompute`` (the
    trainer's own forward); ``old_logp = auto`` takes the sampler's wherever they are the trainer's
    numerics (the HF engine in float32 is the trainer itself) or the batch's own policy (async)."""
    if cfg.old_logp != "auto":
        return cfg.old_logp
    if cfg.async_staleness:  # sampled from an older version: its log-probs are that policy's
        return "rollout"
    same_numerics = (
        cfg.rollout_engine == "hf" and cfg.dtype == "float32" and cfg.rollout_dtype in (None, "float32")
    )
    return "rollout" if same_numerics else "recompute"


def choose_layout(policy: nn.Module, cfg: Config) -> str:
    """Training forward layout (see :mod:`gspo.model.logprobs`). Packing removes padding compute, but
    with dense-mask attention (sdpa/eager) its attention cost grows with the packed length squared,
    so ``auto`` packs only with flash attention; prefix sharing needs a model that takes 4D masks.
    The one-time model probes run here, outside any routing capture or replay that would record them."""
    hf = unwrap(policy, "hf")
    lm_head_is_plain(hf)
    impl = attn_implementation(hf)
    if cfg.routing_replay and cfg.routing_replay_source == "rollout":
        return "rows"  # R3's routing comes per row (gspo.rollout.vllm.routing_rows_layout)
    if cfg.packing == "on" or (cfg.packing == "auto" and impl.startswith("flash")):
        return "packed"
    if cfg.prefix_sharing == "off":
        return "rows"
    if shared_prefix_is_exact(hf):
        return "shared_prefix"
    if cfg.prefix_sharing == "on":
        raise GspoError(
            "config field 'prefix_sharing': 'on' needs a model that takes a 4D attention mask (sdpa or "
            f"eager attention, no sliding window, positions from position_ids); this one ({impl!r}) "
            "does not (use 'auto' or 'off')"
        )
    return "rows"
