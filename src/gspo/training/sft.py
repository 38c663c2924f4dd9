"""Supervised warm start: a few steps of next-token loss before RL, on (prompt, answer + EOS) or, for a
multi-turn task with demonstrations (:mod:`gspo.envs.sft`), on the model's turns of those. One loop
(:func:`_sft_steps`) for both: they differ only in the rows they feed it."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gspo.data import left_pad
from gspo.errors import GspoError
from gspo.model.logprobs import make_layout, response_logprobs
from gspo.plans import LoadPlan, SftPlan
from gspo.tasks.datasets import Example
from gspo.training.logger import Progress


@dataclass
class Start:
    """What a run begins from, before any training: the model (on its device, dropout off), its
    tokenizer, the task (reward under ``reward_timeout_s``) and the token ids of its prompts."""

    model: torch.nn.Module
    tokenizer: Any
    task: Any  # gspo.tasks.Task
    train_ids: list[list[int]]
    eval_ids: list[list[int]]


def load_start(plan: LoadPlan, device: torch.device, meta: bool = False) -> Start:
    """Seed, load the model and tokenizer, load the task and check it fits the model's context: the
    one way ``gspo train`` (``gspo.launch.open_run``) and ``gspo compare``'s shared warm starts begin a
    run, so both see the same task with the same settings (compare's plan warm-starts in float32
    whatever precision the RL runs use: :func:`gspo.resolve.load_plan`). ``meta``: the model's
    structure only, on the meta device (its weights come later from rank 0, see :func:`load_source`)."""
    import numpy as np

    from gspo.model.load import load_model_and_tokenizer
    from gspo.tasks import task_from_config
    from gspo.tasks.prompts import encode_prompts

    torch.manual_seed(plan.seed)
    random.seed(plan.seed)
    np.random.seed(plan.seed)
    task = task_from_config(plan.task)  # (tasks draw from their own generators, not the global ones)
    if plan.env is not None:  # a bad environment spec fails before any weight is read
        from gspo.envs.episodes import spec_of

        spec_of(plan.env, task)
    model, tokenizer = load_model_and_tokenizer(plan.model, plan.tokenizer, plan.dtype, plan.seed, meta)
    if not meta:
        model.to(device)
    if not plan.keep_dropout:
        disable_dropout(model)
    ctx_len = getattr(model.config, "max_position_embeddings", None)
    if ctx_len is not None and plan.max_prompt_tokens + plan.max_new_tokens > ctx_len:
        raise GspoError(
            f"config fields 'max_prompt_tokens' + 'max_new_tokens' = "
            f"{plan.max_prompt_tokens + plan.max_new_tokens} exceed the model's context of {ctx_len}"
        )
    return Start(
        model,
        tokenizer,
        task,
        encode_prompts(tokenizer, task.train, plan.prompt),
        encode_prompts(tokenizer, task.eval, plan.prompt),
    )


def load_source(plan: LoadPlan) -> torch.nn.Module:
    """The model's weights on the CPU (rank 0 of a sharded start, :func:`load_start` with ``meta``):
    the same weights :func:`load_start` would load, without touching the global RNG state."""
    from gspo.model.load import load_model_and_tokenizer

    with torch.random.fork_rng(devices=[]):
        return load_model_and_tokenizer(plan.model, plan.tokenizer, plan.dtype, plan.seed)[0]


def warm_start_run(
    start: Start,
    plan: SftPlan,
    device: torch.device,
    progress: bool,
    should_stop: Callable[[], bool] = lambda: False,
) -> float:
    """The supervised warm start of ``start`` on its task's training examples (see :func:`warm_start`)."""
    return warm_start(
        start.model, start.tokenizer, start.task.train, start.train_ids, plan, device, progress, should_stop
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


# the rows of the examples at some indices: each one's (prompt_ids, ids, model_mask, obs_mask), its
# prompt and the tokens after it (a chat-template demonstration's prompt declares the tools, so it is
# not the trainer's encoding of the example)
Rows = Callable[[list[int], random.Random], list[tuple[list[int], list[int], list[int], list[int]]]]


def warm_start(
    model: Any,
    tokenizer: Any,
    examples: list[Example],
    prompt_ids: list[list[int]],
    plan: SftPlan,
    device: torch.device,
    progress: bool,
    should_stop: Callable[[], bool] = lambda: False,
) -> float:
    """Supervised steps so RL starts from partial accuracy: on (prompt, answer + EOS), or on the
    demonstrations of a multi-turn task that has them (tool calls, :mod:`gspo.envs.sft`). Returns
    the last loss. ``should_stop()`` true (a Ctrl-C / SIGTERM) ends it with KeyboardInterrupt: a
    partial warm start is not a state a run can resume from."""
    rows = None
    if plan.env is not None:
        from gspo.envs.sft import demonstrations

        rows = demonstrations(tokenizer, examples, prompt_ids, plan.task, plan.env, plan.sft_tool_fraction)
    if rows is None:
        rows = _answer_rows(model, tokenizer, examples, prompt_ids)
    return _sft_steps(model, tokenizer, len(examples), rows, plan, device, progress, should_stop)


def _answer_rows(
    model: torch.nn.Module, tokenizer: Any, examples: list[Example], prompt_ids: list[list[int]]
) -> Rows:
    """Single-turn rows: the answer + EOS, all of it the model's."""
    answers = [
        tokenizer(e.answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for e in examples
    ]
    _check_lengths(model, prompt_ids, answers, examples)
    return lambda idx, rng: [
        (prompt_ids[i], answers[i], [1] * len(answers[i]), [0] * len(answers[i])) for i in idx
    ]


def _sft_steps(
    model: Any,
    tokenizer: Any,
    n_examples: int,
    rows: Rows,
    plan: SftPlan,
    device: torch.device,
    progress: bool,
    should_stop: Callable[[], bool],
) -> float:
    """``plan.sft_steps`` steps of next-token loss on the model's tokens of ``rows`` of random
    examples (observation tokens are seen, not predicted). Returns the last loss."""
    rng = random.Random(plan.seed + 7)
    opt = torch.optim.AdamW(model.parameters(), lr=plan.sft_lr, weight_decay=0.0)
    bar = Progress(plan.sft_steps, "warm start", enabled=progress)
    pad = tokenizer.pad_token_id
    loss_v = float("nan")
    model.train()
    for step in range(plan.sft_steps):
        if should_stop():
            bar.close()
            raise KeyboardInterrupt(
                f"stopped during the warm start (step {step} of {plan.sft_steps}); no RL step had finished, "
                "so nothing was saved: run the same command again to start over"
            )
        idx = [rng.randrange(n_examples) for _ in range(plan.sft_batch_size)]
        seqs = rows(idx, rng)
        p_ids, p_mask = left_pad([p for p, _, _, _ in seqs], pad, device)
        T = max(len(ids) for _, ids, _, _ in seqs)
        r = torch.full((len(idx), T), pad, dtype=torch.long)
        m, o = torch.zeros((len(idx), T), dtype=torch.long), torch.zeros((len(idx), T), dtype=torch.long)
        for k, (_, ids, mm, oo) in enumerate(seqs):
            r[k, : len(ids)], m[k, : len(ids)], o[k, : len(ids)] = (
                torch.tensor(ids),
                torch.tensor(mm),
                torch.tensor(oo),
            )
        r, m, o = r.to(device), m.to(device), o.to(device)
        lay = make_layout(p_ids, p_mask, r, m, "rows", obs_mask_BT=o)
        logp = response_logprobs(model, p_ids, p_mask, r, m, 1.0, plan.logp_chunk_size, layout=lay)
        loss = _nll_step(model, opt, logp, m)
        if step % 10 == 0 or step == plan.sft_steps - 1:
            loss_v = float(loss.detach())
        bar.update(step + 1, f"nll {loss_v:.3f}")
    bar.close()
    opt.zero_grad(set_to_none=True)  # no warm-start gradient may outlive it (e.g. on a LoRA-frozen base)
    return loss_v


def _nll_step(
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
