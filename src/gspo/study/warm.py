"""Warm starts of a study: one supervised warm start per seed (and per model), shared by every variant.

Through the same :func:`gspo.training.sft.load_start` and :func:`gspo.training.sft.warm_start_run` as
``gspo train``; kept under a folder keyed by the settings it depends on, so compares that need the
same one share it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from gspo.config import Config
from gspo.study.presets import WARM_CHECK_AFTER, WARM_CHECK_EVERY, WARM_CHECK_PROMPTS

# the fields a warm start depends on (its folder is reused only when they match)
WARM_FIELDS = (
    "model",
    "tokenizer",
    "task",
    "eval_task",
    "reward",
    "prompt_field",
    "answer_field",
    "eval_size",
    "chat_template",
    "system_prompt",
    "max_prompt_tokens",
    "sft_steps",
    "sft_lr",
    "sft_batch_size",
    "logp_chunk_size",
    "reproducible",  # the same warm start in other bits
)


def _warm_key(cfg: Config) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in WARM_FIELDS} | {"seed": cfg.seed}


def warm_start_folder(base: Config, seed: int, target: float | None, warm_dir: Path) -> Path:
    """Where the warm start of these settings and ``seed`` lives: ``<warm_dir>/<model>-<hash>/s<seed>``,
    so presets that differ only in their RL settings (staleness, lr...) share their warm starts."""
    key = _warm_key(dataclasses.replace(base, seed=0)) | {"target": target}
    h = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    name = Path(base.model.replace("embedded:", "")).name
    return warm_dir / f"{name}-{h}" / f"s{seed}"


def warm_start_job(
    base: Config, seed: int, out: Path, target: float | None = None, warm_dir: Path | None = None
) -> tuple[int, str | None, float]:
    """Run only the supervised warm start for ``seed`` (float32) and save it; returns
    ``(seed, model folder, seconds)``. Reused when a folder with the same warm-start settings exists
    (:func:`warm_start_folder`; ``warm_dir`` defaults to ``<out>/../warm-starts``).

    It begins as ``gspo train`` does (:func:`gspo.training.sft.load_start`: seeds, model, task with its
    reward limits, context checks) and trains with the same :func:`gspo.training.sft.warm_start_run`.
    With ``target`` it stops early, at the first check (every 10 steps from step 50) where greedy
    accuracy on 200 prompts like the held-out ones (:func:`_gate_examples`) reaches ``target``;
    ``sft_steps`` is then the most it runs. Accuracy jumps steeply during a warm start and where
    depends on the seed, so a fixed step count leaves some seeds near 0 and others near 1; a target
    starts every seed (and model) from partial accuracy."""
    t0 = time.time()
    if base.sft_steps == 0:
        return seed, None, 0.0
    import torch
    import transformers

    from gspo.model.load import save_pretrained
    from gspo.resolve import load_plan, sft_plan
    from gspo.training.sft import load_start, warm_start_run

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    cfg = dataclasses.replace(base, seed=seed)
    folder = warm_start_folder(base, seed, target, warm_dir or out.parent / "warm-starts")
    key = _warm_key(cfg) | {"target": target}
    if (folder / "config.json").exists():
        key_file = folder / "warm_start.json"
        if key_file.exists() and json.loads(key_file.read_text()).get("key") == key:
            return seed, str(folder), 0.0
        shutil.rmtree(folder)  # made with other settings (or by an older gspo): redo
    if cfg.reproducible:  # before the first kernel runs (gspo.repro)
        from gspo.repro import pin

        pin()
    elif cfg.threads:
        torch.set_num_threads(cfg.threads)
    start = load_start(load_plan(cfg, "float32"), torch.device("cpu"))
    gate = _Gate(start, cfg, target)
    try:
        warm_start_run(start, sft_plan(cfg), torch.device("cpu"), cfg.progress, gate)
    except KeyboardInterrupt:
        if not gate.reached:  # a real Ctrl-C
            raise
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")  # written whole, then renamed
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(start.model, start.tokenizer, tmp)
    from gspo.repro import run_environment

    info = {"key": key, "steps": gate.steps, "reached_target": gate.reached, "gate_acc": gate.last_acc}
    info["environment"] = run_environment()  # what decided its bits (threads, kernels, versions, CPU)
    (tmp / "warm_start.json").write_text(json.dumps(info))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return seed, str(folder), time.time() - t0


class _Gate:
    """Polled before every warm-start step (``warm_start``'s ``should_stop``): measures the gate's
    accuracy every ``WARM_CHECK_EVERY`` steps from ``WARM_CHECK_AFTER`` and ends the warm start (True)
    once it reaches the target."""

    def __init__(self, start: Any, cfg: Config, target: float | None) -> None:
        self.start, self.cfg, self.target = start, cfg, target
        self.examples = _gate_examples(cfg, start.task) if target is not None else []
        self.done, self.reached, self.last_acc = 0, False, None

    def __call__(self) -> bool:
        if self.target is not None and self.done >= WARM_CHECK_AFTER and self.done % WARM_CHECK_EVERY == 0:
            s = self.start
            self.last_acc = _gate_accuracy(s.model, s.tokenizer, s.task, self.examples, self.cfg)
            s.model.train()
            self.reached = self.last_acc >= self.target
        self.done += 1
        return self.reached

    @property
    def steps(self) -> int:
        return self.done - 1 if self.reached else self.done


def _gate_examples(cfg: Config, task: Any) -> list[Any]:
    """Prompts the warm start's gate measures: like the held-out set but disjoint from it. Embedded
    tasks: fresh prompts outside the training set (whose short prompts are all "seen", so the held-out
    set has none; measuring on training prompts would overstate accuracy); datasets: the first
    training examples (the held-out set is a random split of the same data)."""
    from gspo.tasks.synthetic import SYNTHETIC_TASKS, synthetic_examples

    n = WARM_CHECK_PROMPTS
    if cfg.task in SYNTHETIC_TASKS:
        taken = {e.prompt for e in task.train} | {e.prompt for e in task.eval}
        pool = synthetic_examples(cfg.task, 8 * n, cfg.seed + 2_000_003)
        fresh = [e for e in pool if e.prompt not in taken][:n]
        if len(fresh) >= n // 2:
            return fresh
    return task.train[:n]


def _gate_accuracy(model: Any, tok: Any, task: Any, examples: list[Any], cfg: Config) -> float:
    """Greedy accuracy on the gate's prompts."""
    import torch

    from gspo.resolve import engine_plan, prompt_plan, score_plan
    from gspo.rollout.factory import make_engine
    from gspo.tasks.prompts import encode_prompts
    from gspo.training.scoring import evaluate

    model.eval()  # the warm start's own model, sampled in place by the HF engine
    hf = dataclasses.replace(cfg, rollout_engine="hf")
    engine = make_engine(engine_plan(hf), model, tok, torch.Generator().manual_seed(0))
    sub = dataclasses.replace(task, eval=examples)
    ids = encode_prompts(tok, examples, prompt_plan(cfg))
    return evaluate(engine, tok, sub, ids, score_plan(cfg))["eval/accuracy"]
