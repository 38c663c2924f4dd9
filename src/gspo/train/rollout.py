"""Rollout side of an RL step: prompts -> G responses each -> rewards -> group advantages.

Also the held-out evaluation (greedy decoding, the same reward), which uses the same engine.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from gspo.advantages import group_advantages, overlong_penalty
from gspo.config import Config
from gspo.errors import GspoError, warn
from gspo.rollout.base import RolloutBatch, RolloutEngine
from gspo.rollout.hf import left_pad
from gspo.tasks import Task
from gspo.tasks.datasets import Example
from gspo.tasks.rewards import safe_rewards
from gspo.train.batch import RolloutData


def completion_texts(tokenizer: Any, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> list[str]:
    """Decoded responses without their final EOS (one batched tokenizer call)."""
    from transformers import PreTrainedTokenizerFast

    seqs = []
    for ids, n in zip(ids_BT.tolist(), mask_BT.sum(-1).tolist(), strict=True):
        ids = ids[:n]
        seqs.append(ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids)
    # exactly transformers' fast tokenizer (no subclass that could change decoding) without clean-up:
    # decode the batch in one backend call (4x faster than its per-sequence loop, same strings)
    plain = type(tokenizer) is PreTrainedTokenizerFast
    if plain and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.backend_tokenizer.decode_batch(seqs, skip_special_tokens=True)
    return tokenizer.batch_decode(seqs, skip_special_tokens=True)


def encode_prompts(tokenizer: Any, examples: list[Example], cfg: Config) -> list[list[int]]:
    """Token ids per prompt (chat template if asked); too-long prompts are an error naming the prompt."""
    from gspo.tasks.datasets import apply_chat_template, is_chat, prompt_text

    out = []
    unk = getattr(tokenizer, "unk_token_id", None)
    with_unk: list[str] = []
    for ex in examples:
        templated = cfg.chat_template or is_chat(ex.prompt)  # a list of messages always needs it
        text = apply_chat_template(tokenizer, ex.prompt, cfg.system_prompt) if templated else ex.prompt
        ids = tokenizer(text, add_special_tokens=not templated).input_ids
        shown = prompt_text(ex.prompt)[:60]
        if not ids:
            raise GspoError(f"prompt is empty after tokenization: {shown!r}")
        if len(ids) > cfg.max_prompt_tokens:
            raise GspoError(
                f"prompt has {len(ids)} tokens > max_prompt_tokens={cfg.max_prompt_tokens}: {shown!r}"
            )
        if unk is not None and unk in ids:
            if all(t == unk or t in tokenizer.all_special_ids for t in ids):
                raise GspoError(f"prompt is only unknown tokens for this tokenizer: {shown!r}")
            with_unk.append(shown)
        out.append(ids)
    if with_unk:
        warn(
            f"{len(with_unk)} of {len(examples)} prompts hold characters the tokenizer maps to its unknown "
            f"token, which the policy cannot see (e.g. {with_unk[0][:60]!r})"
        )
    return out


def collect_rollout(
    engine: RolloutEngine,
    tokenizer: Any,
    task: Task,
    examples: list[Example],
    prompt_ids: list[list[int]],
    cfg: Config,
) -> tuple[RolloutData, dict[str, float]]:
    """G samples per prompt, rewards, group advantages -> RolloutData (groups contiguous)."""
    if cfg.env:  # multi-turn: G trajectories per prompt, the environment's rewards (gspo.envs)
        from gspo.envs.rollout import collect_env_rollout

        return collect_env_rollout(engine, tokenizer, task, examples, prompt_ids, cfg)
    rep_ids = [p for p in prompt_ids for _ in range(cfg.group_size)]
    t0 = time.time()
    rb = engine.generate(rep_ids, cfg.max_new_tokens, cfg.temperature)
    return score_rollout(rb, tokenizer, task, examples, cfg, time.time() - t0)


def score_rollout(
    rb: RolloutBatch, tokenizer: Any, task: Task, examples: list[Example], cfg: Config, t_gen: float
) -> tuple[RolloutData, dict[str, float]]:
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
    data = RolloutData(
        p_ids,
        p_mask,
        rb.response_ids_BT.cpu(),
        rb.response_mask_BT.cpu(),
        rb.sampler_logp_BT.float().cpu(),
        adv_B,
        rewards_NG.view(-1),
        _sampler_routing(rb),
    )
    return data, metrics


def check_finite_rewards(
    rewards_B: torch.Tensor, penalty_B: torch.Tensor, name: str, overlong_penalty: float
) -> None:
    """Rewards as trained (float32, overlong penalty added) must be finite: an inf would make every
    advantage NaN and every update be skipped, blaming the learning rate."""
    bad = (~rewards_B.isfinite()).nonzero()
    if len(bad):
        i = int(bad[0])
        raise GspoError(
            f"reward function {name}: sample {i}'s reward plus the overlong penalty ({float(penalty_B[i]):g}, "
            f"overlong_penalty={overlong_penalty:g}) is {float(rewards_B[i])} in float32, the rewards' "
            "training dtype"
        )


def _sampler_routing(rb: RolloutBatch) -> dict[str, torch.Tensor] | None:
    """R3 data of an engine that reports the experts it routed (vLLM), in the ``rows`` layout."""
    if getattr(rb, "routed_experts", None) is None:
        return None
    from gspo.rollout.vllm import routing_rows_layout

    return routing_rows_layout(rb)


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
