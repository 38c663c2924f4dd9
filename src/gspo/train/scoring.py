"""Scoring sampled responses: rewards -> group advantages -> the training batch (``TrainBatch``).

The sampling itself is the sampler's (:mod:`gspo.rollout`); also here: the held-out evaluation
(greedy decoding, the same reward), which uses the run's engine.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gspo.advantages import check_finite_rewards, group_advantages, overlong_penalty
from gspo.config import Config
from gspo.data import RolloutEngine, SampleBatch, Sampler, TrainBatch, left_pad
from gspo.tasks import Task
from gspo.tasks.datasets import Example
from gspo.tasks.prompts import completion_texts
from gspo.tasks.rewards import safe_rewards


def collect_rollout(
    sampler: Sampler,
    tokenizer: Any,
    task: Task,
    examples: list[Example],
    prompt_ids: list[list[int]],
    cfg: Config,
    step: int = 1,
) -> tuple[TrainBatch, dict[str, float]]:
    """RL step ``step``: G samples (or trajectories) per prompt, rewards, group advantages ->
    TrainBatch (groups contiguous) and the rollout's metrics."""
    s = sampler.sample(step, examples, prompt_ids)
    data, metrics = score_rollout(s.batch, tokenizer, task, examples, cfg, s.gen_s)
    return data, metrics | s.info


def score_rollout(
    rb: SampleBatch, tokenizer: Any, task: Task, examples: list[Example], cfg: Config, t_gen: float
) -> tuple[TrainBatch, dict[str, float]]:
    """Rewards and group advantages of sampled responses (``rb``: G rows per example, in order)."""
    if getattr(rb, "obs_mask_BT", None) is not None:  # multi-turn trajectories, already scored by their env
        from gspo.envs.rollout import score_episodes

        return score_episodes(rb, tokenizer, len(examples), cfg, t_gen)
    G = cfg.group_size
    rep_ids = rb.prompt_ids
    completions = completion_texts(tokenizer, rb.response_ids_BT, rb.response_mask_BT)
    prompts = [e.prompt for e in examples for _ in range(G)]
    answers = [e.answer for e in examples for _ in range(G)]
    rewards, n_bad = safe_rewards(
        task.reward, prompts, completions, answers, on_error=cfg.reward_on_error, name=task.reward_name
    )
    lengths = rb.response_mask_BT.sum(-1).float()
    eos = (rb.response_ids_BT == tokenizer.eos_token_id).any(-1).float()
    penalty_B = overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
    rewards_NG = (torch.tensor(rewards, dtype=torch.float32) + penalty_B).view(len(examples), G)
    check_finite_rewards(rewards_NG.view(-1), penalty_B, task.reward_name, cfg.overlong_penalty)
    adv_B = group_advantages(rewards_NG, cfg.adv_scale).view(-1)
    if cfg.overlong_filter:  # a cut-off response says nothing about its (unseen) ending
        adv_B = torch.where(eos.bool(), adv_B, 0.0)
    p_ids, p_mask = left_pad(rep_ids, tokenizer.pad_token_id)
    metrics = {
        "rollout/reward_mean": float(rewards_NG.mean()),
        "rollout/reward_std": float(rewards_NG.std(correction=0)),
        "rollout/solved_groups": float((rewards_NG.std(1, correction=0) == 0).float().mean()),
        "rollout/response_len": float(lengths.mean()),
        "rollout/response_len_max": float(lengths.max()),
        "rollout/truncated_frac": float(1 - eos.mean()),
        "rollout/empty_completions": float(sum(1 for c in completions if not c.strip())),
        "rollout/reward_errors": float(n_bad),
        "rollout/overlong_penalty": float(penalty_B.mean()),
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
    )
    return data, metrics


@torch.no_grad()
def evaluate(
    engine: RolloutEngine, tokenizer: Any, task: Task, prompt_ids: list[list[int]], cfg: Config
) -> dict[str, float]:
    """Greedy decoding on the held-out set: mean reward and accuracy (reward >= 1)."""
    if cfg.env:  # with the same environment
        from gspo.envs.rollout import evaluate_env

        return evaluate_env(engine, tokenizer, task, prompt_ids, cfg)
    rb = engine.generate(prompt_ids, cfg.max_new_tokens, 1.0, greedy=True)
    completions = completion_texts(tokenizer, rb.response_ids_BT, rb.response_mask_BT)
    ex = task.eval
    rewards, _ = safe_rewards(
        task.reward,
        [e.prompt for e in ex],
        completions,
        [e.answer for e in ex],
        on_error=cfg.reward_on_error,
        name=task.reward_name,
    )
    r = np.asarray(rewards, dtype=np.float64)
    return {"eval/reward_mean": float(r.mean()), "eval/accuracy": float((r >= 1.0 - 1e-9).mean())}
