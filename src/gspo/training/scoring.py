"""Scoring sampled responses: rewards -> group advantages -> the training batch (``TrainBatch``).

One path for single-turn responses (the task's reward scores them here) and multi-turn trajectories
(their environment scored them while they were played, :mod:`gspo.envs.episodes`): the overlong
penalty, the group advantages, the overlong filter, the metrics and the batch are the same code.
The sampling itself is the sampler's (:mod:`gspo.rollout`); also here: the held-out evaluation
(greedy decoding, the same reward), which uses the run's engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gspo.advantages import check_finite_rewards, check_maxrl_rewards, group_advantages, overlong_penalty
from gspo.data import RolloutEngine, SampleBatch, TrainBatch, left_pad
from gspo.envs.episodes import EnvSampleBatch, env_eval_scores
from gspo.plans import ScorePlan
from gspo.tasks import Task
from gspo.tasks.datasets import Example
from gspo.tasks.prompts import completion_texts
from gspo.tasks.rewards import safe_rewards


@dataclass
class _Rewards:
    """A batch's rewards as their source gave them, and what the shared scoring needs with them."""

    reward_B: torch.Tensor  # [B] float32, before the overlong penalty
    len_B: torch.Tensor  # [B] the tokens the overlong penalty counts ...
    max_len: int  # ... against this limit
    cut_B: torch.Tensor  # [B] bool: a limit ended it, not the response itself (the overlong filter)
    name: str  # the rewards' source, in errors
    n_errors: int  # rewards (or trajectories) that failed under reward_on_error zero
    metrics: dict[str, float]  # the source's own, logged after rollout/response_len_max ...
    env_metrics: dict[str, float] = field(default_factory=dict)  # ... and after rollout/overlong_penalty


def score_rollout(
    rb: SampleBatch,
    tokenizer: Any,
    task: Task | None,
    examples: list[Example],
    plan: ScorePlan,
    t_gen: float,
) -> tuple[TrainBatch, dict[str, float]]:
    """Rewards and group advantages of sampled responses (``rb``: G rows per example, in order). The
    batch's type says where the rewards come from: the task's reward of the responses (``task`` and
    ``examples``), or an :class:`EnvSampleBatch`'s own (its environment's; ``task`` and ``examples``
    unused)."""
    if isinstance(rb, EnvSampleBatch):
        rw, obs_BT = _episode_rewards(rb, plan), rb.obs_mask_BT.cpu()
    else:
        assert task is not None, "single-turn responses are scored by the task's reward"
        rw, obs_BT = _response_rewards(rb, tokenizer, task, examples, plan), None
    penalty_B = overlong_penalty(rw.len_B, rw.max_len, plan.overlong_buffer, plan.overlong_penalty)
    rewards_NG = (rw.reward_B + penalty_B).view(-1, plan.group_size)
    check_finite_rewards(rewards_NG.view(-1), penalty_B, rw.name, plan.overlong_penalty)
    if plan.adv_scale == "maxrl":  # it divides by the group's mean: a negative reward stops the run
        check_maxrl_rewards(rewards_NG.view(-1), rw.name)
    adv_B = group_advantages(rewards_NG, plan.adv_scale).view(-1)
    if plan.overlong_filter:  # a cut-off response says nothing about its (unseen) ending
        adv_B = torch.where(rw.cut_B, 0.0, adv_B)
    p_ids, p_mask = left_pad(rb.prompt_ids, tokenizer.pad_token_id)
    model_len_B = rb.response_mask_BT.sum(-1).float()
    metrics = {
        "rollout/reward_mean": float(rewards_NG.mean()),
        "rollout/reward_std": float(rewards_NG.std(correction=0)),
        "rollout/solved_groups": float((rewards_NG.std(1, correction=0) == 0).float().mean()),
        "rollout/response_len": float(model_len_B.mean()),
        "rollout/response_len_max": float(model_len_B.max()),
        **rw.metrics,
        "rollout/reward_errors": float(rw.n_errors),
        "rollout/overlong_penalty": float(penalty_B.mean()),
        **rw.env_metrics,
        "time/generate_s": t_gen,
    }
    data = TrainBatch(
        p_ids,
        p_mask,
        rb.response_ids_BT.cpu(),
        rb.response_mask_BT.cpu(),
        rb.sampler_logp_BT.float().cpu(),
        adv_B,
        rewards_NG.view(-1),
        rb.routing_rows(),
        obs_BT,
    )
    return data, metrics


def _response_rewards(
    rb: SampleBatch, tokenizer: Any, task: Task, examples: list[Example], plan: ScorePlan
) -> _Rewards:
    """Single-turn: the task's reward of each decoded response; the penalty counts its tokens against
    ``max_new_tokens``, the filter drops responses without an EOS."""
    G = plan.group_size
    completions = completion_texts(tokenizer, rb.response_ids_BT, rb.response_mask_BT)
    prompts = [e.prompt for e in examples for _ in range(G)]
    answers = [e.answer for e in examples for _ in range(G)]
    rewards, n_bad = safe_rewards(
        task.reward, prompts, completions, answers, on_error=plan.reward_on_error, name=task.reward_name
    )
    eos = (rb.response_ids_BT == tokenizer.eos_token_id).any(-1).float()
    return _Rewards(
        torch.tensor(rewards, dtype=torch.float32),
        rb.response_mask_BT.sum(-1).float(),
        plan.max_new_tokens,
        ~eos.bool(),
        task.reward_name,
        n_bad,
        {
            "rollout/truncated_frac": float(1 - eos.mean()),
            "rollout/empty_completions": float(sum(1 for c in completions if not c.strip())),
        },
    )


def _episode_rewards(eb: EnvSampleBatch, plan: ScorePlan) -> _Rewards:
    """Multi-turn: the environment's rewards; the penalty counts a trajectory's tokens (model turns and
    observations) against ``max_trajectory_tokens``, the filter drops trajectories a limit cut off."""
    assert eb.obs_mask_BT is not None and eb.reward_B is not None and eb.truncated_B is not None
    assert plan.env is not None, "trajectories are scored with their environment's plan"
    model_len_B = eb.response_mask_BT.sum(-1).float()
    obs_len_B = eb.obs_mask_BT.sum(-1).float()
    total_B = model_len_B + obs_len_B
    turns = eb.turns_B if eb.turns_B is not None else torch.ones_like(eb.reward_B)
    return _Rewards(
        eb.reward_B.float(),
        total_B,
        plan.max_trajectory_tokens,
        eb.truncated_B.bool(),
        f"of environment {plan.env.spec}",
        eb.n_errors,
        {"rollout/truncated_frac": float(eb.truncated_B.mean())},
        {
            "env/turns_mean": float(turns.mean()),
            "env/multi_turn_frac": float((turns > 1).float().mean()),
            "env/obs_len": float(obs_len_B.mean()),
            "env/trajectory_len_max": float(total_B.max()),
        },
    )


@torch.no_grad()
def evaluate(
    engine: RolloutEngine, tokenizer: Any, task: Task, prompt_ids: list[list[int]], plan: ScorePlan
) -> dict[str, float]:
    """Greedy decoding on the held-out set: mean reward and accuracy (reward >= 1)."""
    return eval_metrics(eval_scores(engine, tokenizer, task, task.eval, prompt_ids, plan))


def eval_scores(
    engine: RolloutEngine,
    tokenizer: Any,
    task: Task,
    examples: list[Example],
    prompt_ids: list[list[int]],
    plan: ScorePlan,
) -> dict[str, list[float]]:
    """Greedy decoding of held-out ``examples`` (token ids ``prompt_ids``): each one's reward (and, in
    an environment, its number of turns). Parts scored apart (ranks) concatenate to the whole."""
    if plan.env is not None:  # with the same environment
        return env_eval_scores(engine, tokenizer, task, examples, prompt_ids, plan.env)
    rb = engine.generate(prompt_ids, plan.max_new_tokens, 1.0, greedy=True)
    completions = completion_texts(tokenizer, rb.response_ids_BT, rb.response_mask_BT)
    rewards, _ = safe_rewards(
        task.reward,
        [e.prompt for e in examples],
        completions,
        [e.answer for e in examples],
        on_error=plan.reward_on_error,
        name=task.reward_name,
    )
    return {"reward": list(rewards)}


def eval_metrics(scores: dict[str, list[float]]) -> dict[str, float]:
    """Mean reward and accuracy (reward >= 1) of :func:`eval_scores` (and the share of multi-turn
    trajectories)."""
    r = np.asarray(scores["reward"], dtype=np.float64)
    out = {"eval/reward_mean": float(r.mean()), "eval/accuracy": float((r >= 1.0 - 1e-9).mean())}
    if "turns" in scores:
        out["eval/multi_turn_frac"] = float((np.asarray(scores["turns"]) > 1).mean())
    return out
