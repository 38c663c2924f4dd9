"""Pieces of one RL step assembled the way ``gspo train`` assembles them, for the tests that call
the pieces one at a time: the update's plan from a config, and a scored rollout of given prompts."""

from __future__ import annotations

from typing import Any

from torch import nn

from gspo.config import Config
from gspo.data import Sampler, TrainBatch
from gspo.plans import ScorePlan, UpdatePlan
from gspo.resolve import for_model, layout_plan, update_plan
from gspo.training.scoring import score_rollout


def plan_update(cfg: Config, policy: nn.Module, is_moe: bool) -> UpdatePlan:
    """Every update's plan of a run of ``cfg`` on ``policy`` (its layout probed once), as
    :func:`gspo.resolve.resolve` and the launch settle it."""
    return for_model(update_plan(cfg), layout_plan(cfg), policy, is_moe)


def collect_rollout(
    sampler: Sampler,
    tokenizer: Any,
    task: Any,
    examples: list[Any],
    prompt_ids: list[list[int]],
    plan: ScorePlan,
    step: int = 1,
) -> tuple[TrainBatch, dict[str, float]]:
    """RL step ``step`` for given prompts: G samples (or trajectories) each, their rewards and group
    advantages, and the rollout's metrics (the loop asks its sampler for ``next_batch`` instead)."""
    s = sampler.sample(step, examples, prompt_ids)
    data, metrics = score_rollout(s.batch, tokenizer, task, examples, plan, s.gen_s)
    return data, metrics | s.info
