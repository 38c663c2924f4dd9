"""Warm start on multi-turn demonstrations: next-token loss on the model's turns only.

A demonstration is a list of ``(text, is_model_turn)`` segments after the prompt. Model turns are
tokenized and end with EOS, observations are tokenized as the rollout does
(``add_special_tokens=False``), so a demonstration is the token sequence a rollout would make.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from gspo.tasks.datasets import Example

Demo = list[tuple[str, bool]]


def add_long_demo(example: Example, rng: random.Random) -> Demo:
    """``add_long``: call the calculator, then answer with its result (``calc(a+b)``, ``=s``, ``s``)."""
    expr = example.prompt.removeprefix("add:").removesuffix("=")
    return [(f"calc({expr})", True), (f"={example.answer}", False), (example.answer, True)]


DEMONSTRATIONS: dict[str, Callable[[Example, random.Random], Demo]] = {"add_long": add_long_demo}


def demo_tokens(tokenizer: Any, demo: Demo) -> tuple[list[int], list[int], list[int]]:
    """``(ids, model_mask, obs_mask)`` of a demonstration's tokens after the prompt."""
    ids: list[int] = []
    model: list[int] = []
    for text, is_model in demo:
        t = tokenizer(text, add_special_tokens=False).input_ids + (
            [tokenizer.eos_token_id] if is_model else []
        )
        ids += t
        model += [int(is_model)] * len(t)
    return ids, model, [1 - m for m in model]


def warm_start_env(
    model: Any,
    tokenizer: Any,
    examples: list[Example],
    prompt_ids: list[list[int]],
    cfg: Any,
    device: torch.device,
    progress: bool,
    should_stop: Callable[[], bool] = lambda: False,
) -> float:
    """``cfg.sft_steps`` supervised steps on demonstrations of ``cfg.task``. Returns the last loss."""
    from gspo.data import left_pad
    from gspo.model.logprobs import make_layout, response_logprobs
    from gspo.train.logger import Progress
    from gspo.train.nll import nll_step

    make = DEMONSTRATIONS[cfg.task]
    rng = random.Random(cfg.seed + 7)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    bar = Progress(cfg.sft_steps, "warm start", enabled=progress)
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
        seqs = [demo_tokens(tokenizer, make(examples[i], rng)) for i in idx]
        p_ids, p_mask = left_pad([prompt_ids[i] for i in idx], tokenizer.pad_token_id, device)
        T = max(len(s[0]) for s in seqs)
        r = torch.full((len(idx), T), tokenizer.pad_token_id, dtype=torch.long)
        m, o = torch.zeros((len(idx), T), dtype=torch.long), torch.zeros((len(idx), T), dtype=torch.long)
        for k, (ids, mm, oo) in enumerate(seqs):
            r[k, : len(ids)], m[k, : len(ids)], o[k, : len(ids)] = (
                torch.tensor(ids),
                torch.tensor(mm),
                torch.tensor(oo),
            )
        r, m, o = r.to(device), m.to(device), o.to(device)
        lay = make_layout(p_ids, p_mask, r, m, "rows", obs_mask_BT=o)
        logp = response_logprobs(model, p_ids, p_mask, r, m, 1.0, cfg.logp_chunk_size, layout=lay)
        loss = nll_step(model, opt, logp, m)
        if step % 10 == 0 or step == cfg.sft_steps - 1:
            loss_v = float(loss.detach())
        bar.update(step + 1, f"nll {loss_v:.3f}")
    bar.close()
    opt.zero_grad(set_to_none=True)
    return loss_v
