"""Tasks: prompts with reference answers (embedded synthetic or user datasets) and reward functions."""

from __future__ import annotations

import random
import warnings
from typing import Any

from gspo.errors import GspoError, warn
from gspo.plans import TaskPlan
from gspo.tasks.datasets import Example, load_prompt_dataset
from gspo.tasks.rewards import DEFAULT_REWARD_TIMEOUT_S, load_reward, with_timeout
from gspo.tasks.synthetic import SYNTHETIC_TASKS, synthetic_examples
from gspo.tasks.task import Task

EMBEDDED_TRAIN_SIZE = 20_000


def build_task(
    task: str,
    reward: str,
    seed: int,
    eval_size: int,
    eval_task: str | None = None,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    reward_timeout_s: float | None = DEFAULT_REWARD_TIMEOUT_S,
) -> Task:
    """Train/held-out examples and the reward for a task spec (embedded name or dataset path).

    ``reward_timeout_s`` limits each call of a user reward function (``load_reward(timeout_s=...)``).
    A held-out set smaller than ``eval_size`` is a warning (``warnings``, once per message)."""
    if task.startswith("rg:"):  # reasoning-gym: gspo/tasks/reasoning_gym.py
        from gspo.tasks.reasoning_gym import build_rg_task

        t = build_rg_task(task, reward, seed, eval_size, eval_task, timeout_s=reward_timeout_s)
        if reward.strip() in ("rg", "exact_match"):  # its own scorer: under the same limit as any reward
            t.reward = with_timeout(t.reward, t.reward_name, reward_timeout_s)
        return t
    if task in SYNTHETIC_TASKS:
        train = synthetic_examples(task, EMBEDDED_TRAIN_SIZE, seed)
        seen = {e.prompt for e in train}
        pool = synthetic_examples(task, eval_size * 4, seed + 1_000_003)
        held_out = [e for e in pool if e.prompt not in seen][:eval_size]
        why = f"task {task!r} has few prompts outside the {len(train)} training ones"
    else:
        if "/" not in task and "." not in task:
            raise GspoError(
                f"config field 'task': unknown task {task!r} (embedded: {', '.join(SYNTHETIC_TASKS)};"
                " or a dataset path)"
            )
        train = load_prompt_dataset(task, prompt_field, answer_field)
        if eval_task:
            held_out = load_prompt_dataset(eval_task, prompt_field, answer_field)[:eval_size]
            why = f"{eval_task} has only {len(held_out)} examples"
        else:
            if len(train) < 2:
                raise GspoError(f"{task}: need at least 2 examples to hold some out for evaluation")
            shuffled = train[:]
            random.Random(seed).shuffle(shuffled)
            n_eval = min(eval_size, max(1, len(train) // 10))
            held_out, train = shuffled[:n_eval], shuffled[n_eval:]
            why = f"10% of the {len(train) + n_eval} examples of {task} are held out; pass eval_task for more"
    _warn_overlap(train, held_out, eval_task or task)
    if len(held_out) < eval_size:
        warnings.warn(
            f"held-out set has {len(held_out)} examples, fewer than eval_size={eval_size} ({why}): "
            "eval accuracy is noisier than asked for",
            UserWarning,
            stacklevel=2,
        )
    fn = load_reward(reward, timeout_s=reward_timeout_s)
    return Task(train=train, eval=held_out, reward=fn, reward_name=reward)


def _prompt_key(e: Example) -> Any:
    p = e.prompt
    return p if isinstance(p, str) else tuple((m.get("role"), m.get("content")) for m in p)


def _warn_overlap(train: list[Example], held_out: list[Example], source: str) -> None:
    """One warning line when held-out prompts also occur in training (duplicate rows, or an eval
    set drawn from the training data): the held-out accuracy would then measure memorization."""
    seen = {_prompt_key(e) for e in train}
    both = [e for e in held_out if _prompt_key(e) in seen]
    if both:
        warn(
            f"{len(both)} of {len(held_out)} held-out prompts of {source} also occur in the training set "
            f"(duplicate rows?), so held-out accuracy partly measures memorization (e.g. {both[0].text[:60]!r})"
        )


def task_from_config(plan: TaskPlan) -> Task:
    """:func:`build_task` of a run's task fields (:func:`gspo.resolve.task_plan`)."""
    return build_task(
        plan.task, plan.reward, plan.seed, plan.eval_size, plan.eval_task, plan.prompt_field,
        plan.answer_field, plan.reward_timeout_s or None,
    )  # fmt: skip
