"""Every rollout engine and sampler is built here: the trainer, the evaluation, the async sampler's
process and ``gspo compare`` ask for them by plan, never by class."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gspo.data import RolloutEngine, Sampler
from gspo.plans import EnginePlan, SamplePlan


def make_engine(
    plan: EnginePlan,
    model: nn.Module,
    tokenizer: Any,
    generator: torch.Generator | None = None,
    trainer: nn.Module | None = None,
) -> RolloutEngine:
    """The planned engine over ``model``, built by its registry entry's builder
    (:data:`gspo.plans.ENGINES`; vLLM is imported only when selected). ``trainer``: the trainer's
    module, where the HF engine samples from a copy of it in another precision (``model``): the engine
    takes its weights with every ``sync_weights``, the first now; vLLM's start check runs its probe
    through it (one FSDP2 layer gathered at a time)."""
    module, name = plan.spec.build.split(":")
    build = getattr(importlib.import_module(module), name)
    return build(plan, model, tokenizer, generator, trainer)


def build_hf(
    plan: EnginePlan,
    model: nn.Module,
    tokenizer: Any,
    generator: torch.Generator | None,
    trainer: nn.Module | None,
) -> RolloutEngine:
    from gspo.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(
        model, tokenizer.eos_token_id, tokenizer.pad_token_id, generator, trainer=trainer,
        top_k=plan.top_k, top_p=plan.top_p,
    )  # fmt: skip
    engine.sync_weights()
    return engine


def build_vllm(
    plan: EnginePlan,
    model: nn.Module,
    tokenizer: Any,
    generator: torch.Generator | None,
    trainer: nn.Module | None,
) -> RolloutEngine:
    from gspo.rollout.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine.from_trainer(plan, model, tokenizer, trainer=trainer)


def make_sampler(
    plan: SamplePlan,
    engine: RolloutEngine,
    tokenizer: Any,
    task: Any,
    *,
    model: nn.Module,
    train_ids: list[list[int]],
    version: int,
    state: dict[str, Any] | None = None,
    score: Callable[..., Any] | None = None,
) -> Sampler:
    """Each RL step's scored batch: sampled from ``engine`` when asked (synchronous), or by a process
    that runs ``async_staleness`` steps ahead on ``model``'s published weights. ``version``: updates
    made so far; ``state``: what a resumed checkpoint kept (:meth:`Sampler.state`); ``score``: the
    trainer's scoring (rewards -> advantages; an async process keeps dynamic sampling's informative
    groups with it); ``train_ids``: the token ids of every training prompt of ``task``."""
    if plan.async_staleness:
        from gspo.rollout.async_sampler import AsyncSampler

        return AsyncSampler(model, tokenizer, train_ids, plan, version, state, make_engine, score, task)
    from gspo.rollout.sampler import SyncSampler

    return SyncSampler(engine, tokenizer, task, plan, score, train_ids)
