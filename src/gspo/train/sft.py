"""Supervised warm start: a few steps of next-token loss on (prompt, answer + EOS) before RL."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gspo.config import Config
from gspo.data import left_pad
from gspo.errors import GspoError
from gspo.model.logprobs import response_logprobs
from gspo.tasks.datasets import Example
from gspo.train.logger import Progress
from gspo.train.nll import nll_step


@dataclass
class Start:
    """What a run begins from, before any training: the model (on its device, dropout off), its
    tokenizer, the task (reward under ``reward_timeout_s``) and the token ids of its prompts."""

    model: torch.nn.Module
    tokenizer: Any
    task: Any  # gspo.tasks.Task
    train_ids: list[list[int]]
    eval_ids: list[list[int]]


def load_start(cfg: Config, device: torch.device, dtype: str | None = None, meta: bool = False) -> Start:
    """Seed, load the model and tokenizer, load the task and check it fits the model's context: the
    one way ``gspo train`` (``Run.open``) and ``gspo compare``'s shared warm starts begin a run, so
    both see the same task with the same settings. ``dtype`` overrides ``cfg.dtype`` (compare warm
    starts in float32 whatever precision the RL runs use). ``meta``: the model's structure only, on
    the meta device (its weights come later from rank 0, see :func:`load_source`)."""
    import numpy as np

    from gspo.model.load import load_model_and_tokenizer
    from gspo.tasks import task_from_config
    from gspo.tasks.prompts import encode_prompts

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    model, tokenizer = load_model_and_tokenizer(cfg.model, cfg.tokenizer, dtype or cfg.dtype, cfg.seed, meta)
    if not meta:
        model.to(device)
    if not cfg.keep_dropout:
        disable_dropout(model)
    task = task_from_config(cfg)
    ctx_len = getattr(model.config, "max_position_embeddings", None)
    if ctx_len is not None and cfg.max_prompt_tokens + cfg.max_new_tokens > ctx_len:
        raise GspoError(
            f"config fields 'max_prompt_tokens' + 'max_new_tokens' = "
            f"{cfg.max_prompt_tokens + cfg.max_new_tokens} exceed the model's context of {ctx_len}"
        )
    if cfg.env:  # a bad environment spec fails now, not after the warm start
        from gspo.envs.rollout import spec_of

        spec_of(cfg, task)
    return Start(
        model,
        tokenizer,
        task,
        encode_prompts(tokenizer, task.train, cfg),
        encode_prompts(tokenizer, task.eval, cfg),
    )


def load_source(cfg: Config) -> torch.nn.Module:
    """The model's weights on the CPU (rank 0 of a sharded start, :func:`load_start` with ``meta``):
    the same weights :func:`load_start` would load, without touching the global RNG state."""
    from gspo.model.load import load_model_and_tokenizer

    with torch.random.fork_rng(devices=[]):
        return load_model_and_tokenizer(cfg.model, cfg.tokenizer, cfg.dtype, cfg.seed)[0]


def warm_start_run(
    start: Start,
    cfg: Config,
    device: torch.device,
    progress: bool,
    should_stop: Callable[[], bool] = lambda: False,
) -> float:
    """The supervised warm start of ``start`` on its task's training examples (see :func:`warm_start`)."""
    return warm_start(
        start.model, start.tokenizer, start.task.train, start.train_ids, cfg, device, progress, should_stop
    )


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout probability 0 everywhere: ``nn.Dropout`` modules and the attention modules' own
    ``attention_dropout`` / ``dropout`` rates (transformers applies those functionally in training)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for attr in ("attention_dropout", "attn_dropout", "dropout"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)


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
