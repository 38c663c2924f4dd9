"""Supervised warm start: a few steps of next-token loss on (prompt, answer + EOS) before RL."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from gspo.config import Config
from gspo.errors import GspoError
from gspo.model.forward import response_logprobs
from gspo.rollout.hf import left_pad
from gspo.tasks.datasets import Example
from gspo.train.logger import Progress


def warm_start(
    model: Any,
    tokenizer: Any,
    examples: list[Example],
    prompt_ids: list[list[int]],
    cfg: Config,
    device: torch.device,
    progress: bool,
    should_stop: Callable[[], bool] = lambda: False,
) -> float:
    """Supervised steps on (prompt, answer + EOS) so RL starts from partial accuracy. Returns last loss.
    ``should_stop()`` true (a Ctrl-C / SIGTERM) ends it with KeyboardInterrupt: a partial warm start is
    not a state a run can resume from."""
    if getattr(cfg, "env", None):  # a multi-turn task with demonstrations (tool calls): gspo.envs.sft
        from gspo.envs.sft import DEMONSTRATIONS, warm_start_env

        if cfg.task in DEMONSTRATIONS:
            return warm_start_env(model, tokenizer, examples, prompt_ids, cfg, device, progress, should_stop)
    rng = random.Random(cfg.seed + 7)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    bar = Progress(cfg.sft_steps, "warm start", enabled=progress)
    answers = [
        tokenizer(e.answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for e in examples
    ]
    _check_lengths(model, prompt_ids, answers, examples)
    loss_v = float("nan")
    model.train()
    for step in range(cfg.sft_steps):
        if should_stop():
            bar.close()
            raise KeyboardInterrupt(
                f"stopped during the warm start (step {step} of {cfg.sft_steps}); no RL step had finished, "
                "so nothing was saved: run the same command again to start over"
            )
        idx = [rng.randrange(len(examples)) for _ in range(cfg.sft_batch_size)]
        p_ids, p_mask = left_pad([prompt_ids[i] for i in idx], tokenizer.pad_token_id, device)
        resp = [answers[i] for i in idx]
        T = max(map(len, resp))
        r_ids = torch.full((len(idx), T), tokenizer.pad_token_id, dtype=torch.long)
        r_mask = torch.zeros((len(idx), T), dtype=torch.long)
        for k, a in enumerate(resp):
            r_ids[k, : len(a)], r_mask[k, : len(a)] = torch.tensor(a), 1
        r_ids, r_mask = r_ids.to(device), r_mask.to(device)
        logp = response_logprobs(model, p_ids, p_mask, r_ids, r_mask, 1.0, cfg.logp_chunk_size)
        loss = nll_step(model, opt, logp, r_mask)
        if step % 10 == 0 or step == cfg.sft_steps - 1:
            loss_v = float(loss.detach())
        bar.update(step + 1, f"nll {loss_v:.3f}")
    bar.close()
    opt.zero_grad(set_to_none=True)  # no warm-start gradient may outlive it (e.g. on a LoRA-frozen base)
    return loss_v


def nll_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, logp_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """One supervised step: the mean NLL of the masked tokens, a clipped gradient, an optimizer step.
    Returns the loss (not synced: the caller reads it only now and then)."""
    loss = -(logp_BT * mask_BT).sum() / mask_BT.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def _check_lengths(
    model: torch.nn.Module, prompt_ids: list[list[int]], answers: list[list[int]], examples: list[Example]
) -> None:
    """A prompt + answer longer than the model's context cannot be trained on (and a huge answer would
    exhaust memory in the first batch): refused before the first step, naming the example."""
    ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not ctx:
        return
    for i, (p, a) in enumerate(zip(prompt_ids, answers, strict=True)):
        if len(p) + len(a) > ctx:
            raise GspoError(
                f"warm start: training example {i} (answer {examples[i].answer[:40]!r}...) has {len(p)} prompt "
                f"+ {len(a)} answer tokens, more than the model's context of {ctx} (drop or shorten it, "
                "or use sft_steps=0)"
            )
