"""``gspo eval``: greedy held-out evaluation of a saved Hugging Face model folder.

A folder inside a run (``runs/NAME/final``, ``runs/NAME/checkpoints/step-N``) is evaluated on the
run's own task settings, read from ``runs/NAME/config.yaml``; flags override them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, load_yaml
from gspo.errors import GspoError

# the config fields that decide what a held-out evaluation measures
EVAL_FIELDS = (
    "task", "eval_task", "reward", "prompt_field", "answer_field", "eval_size", "max_new_tokens", "seed",
    "chat_template", "system_prompt", "max_prompt_tokens", "reward_on_error", "reward_timeout_s",
)  # fmt: skip


def run_config_of(path: Path) -> Path | None:
    """``config.yaml`` of the run a model folder belongs to, if any."""
    for d in (path.parent, path.parent.parent):
        if (d / "config.yaml").is_file() and (d / "metrics.jsonl").exists():
            return d / "config.yaml"
    return None


def evaluate_checkpoint(path: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load ``path`` with ``from_pretrained`` and report held-out reward / accuracy (greedy decoding)."""
    from gspo.model.load import load_model_and_tokenizer
    from gspo.rollout.hf import HFRolloutEngine
    from gspo.tasks import task_from_config
    from gspo.train.rollout import encode_prompts, evaluate

    folder = Path(path)
    if not folder.is_dir():
        raise GspoError(f"checkpoint folder not found: {path}")
    run_yaml = run_config_of(folder.resolve())
    values = {k: v for k, v in (load_yaml(str(run_yaml)) if run_yaml else {}).items() if k in EVAL_FIELDS}
    values.update(overrides or {})
    cfg = Config(model=path, **values).validate()
    model, tokenizer = load_model_and_tokenizer(path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    t = task_from_config(cfg)
    engine = HFRolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    out = evaluate(engine, tokenizer, t, encode_prompts(tokenizer, t.eval, cfg), cfg)
    settings = str(run_yaml) if run_yaml else "defaults"
    return {"checkpoint": path, "task": cfg.task, "n": len(t.eval), "settings": settings, **out}
