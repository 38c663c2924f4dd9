"""Tasks: prompts with reference answers (embedded synthetic or user datasets) and reward functions."""

from __future__ import annotations

import random
from dataclasses import dataclass

from gspo.errors import GspoError
from gspo.tasks.datasets import Example, load_prompt_dataset
from gspo.tasks.rewards import RewardFn, load_reward
from gspo.tasks.synthetic import SYNTHETIC_TASKS, synthetic_examples

EMBEDDED_TRAIN_SIZE = 20_000


@dataclass
class Task:
    train: list[Example]
    eval: list[Example]
    reward: RewardFn
    reward_name: str


def build_task(
    task: str,
    reward: str,
    seed: int,
    eval_size: int,
    eval_task: str | None = None,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
) -> Task:
    """Train/held-out examples and the reward for a task spec (embedded name or dataset path)."""
    if task.startswith("rg:"):  # reasoning-gym: gspo/tasks/reasoning_gym.py
        from gspo.tasks.reasoning_gym import build_rg_task

        return build_rg_task(task, reward, seed, eval_size, eval_task)
    if task in SYNTHETIC_TASKS:
        train = synthetic_examples(task, EMBEDDED_TRAIN_SIZE, seed)
        seen = {e.prompt for e in train}
        pool = synthetic_examples(task, eval_size * 4, seed + 1_000_003)
        held_out = [e for e in pool if e.prompt not in seen][:eval_size]
    else:
        if "/" not in task and "." not in task:
            raise GspoError(
                f"config field 'task': unknown task {task!r} (embedded: {', '.join(SYNTHETIC_TASKS)};"
                " or a dataset path)"
            )
        train = load_prompt_dataset(task, prompt_field, answer_field)
        if eval_task:
            held_out = load_prompt_dataset(eval_task, prompt_field, answer_field)[:eval_size]
        else:
            if len(train) < 2:
                raise GspoError(f"{task}: need at least 2 examples to hold some out for evaluation")
            shuffled = train[:]
            random.Random(seed).shuffle(shuffled)
            n_eval = min(eval_size, max(1, len(train) // 10))
            held_out, train = shuffled[:n_eval], shuffled[n_eval:]
    return Task(train=train, eval=held_out, reward=load_reward(reward), reward_name=reward)
