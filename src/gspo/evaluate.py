"""``gspo eval``: greedy held-out evaluation of a saved Hugging Face model folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gspo.config import Config
from gspo.errors import GspoError


def evaluate_checkpoint(
    path: str,
    task: str,
    reward: str,
    eval_size: int,
    max_new_tokens: int,
    seed: int,
    chat_template: bool = False,
) -> dict[str, Any]:
    """Load ``path`` with ``from_pretrained`` and report held-out reward / accuracy (greedy decoding)."""
    from gspo.model.load import load_model_and_tokenizer
    from gspo.rollout.hf import HFRolloutEngine
    from gspo.tasks import build_task
    from gspo.train.rollout import encode_prompts, evaluate

    if not Path(path).is_dir():
        raise GspoError(f"checkpoint folder not found: {path}")
    cfg = Config(
        model=path,
        task=task,
        reward=reward,
        eval_size=eval_size,
        max_new_tokens=max_new_tokens,
        seed=seed,
        chat_template=chat_template,
    ).validate()
    model, tokenizer = load_model_and_tokenizer(path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    t = build_task(task, reward, seed, eval_size)
    engine = HFRolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    out = evaluate(engine, tokenizer, t, encode_prompts(tokenizer, t.eval, cfg), cfg)
    return {"checkpoint": path, "task": task, "n": len(t.eval), **out}
