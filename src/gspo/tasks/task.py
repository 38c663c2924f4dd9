"""What a task is: training and held-out examples and the reward that scores responses."""

from __future__ import annotations

from dataclasses import dataclass

from gspo.tasks.datasets import Example
from gspo.tasks.rewards import RewardFn


@dataclass
class Task:
    train: list[Example]
    eval: list[Example]
    reward: RewardFn
    reward_name: str
