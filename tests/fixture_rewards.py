"""Rewards for end-to-end tests (``--reward tests/fixture_rewards.py:noisy``), kept out of test modules so
that pytest does not collect them."""

import random

import numpy as np
import torch


def noisy(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Exact match plus noise drawn from python's, numpy's and torch's global generators: every sample
    gets a different reward (so the weights move at every step), and a resumed run scores like an
    uninterrupted one only when each of the three generators was restored."""
    return [
        float(c == a) + random.random() + float(np.random.rand()) + float(torch.rand(()))
        for c, a in zip(completions, answers, strict=True)
    ]


def length_parity(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1 when completion and answer lengths have the same parity: partial accuracy even for an untrained
    model's greedy completions, and a number that changes with any completion."""
    return [float(len(c) % 2 == len(a) % 2) for c, a in zip(completions, answers, strict=True)]
