"""Embedded synthetic tasks with verifiable answers: no download, variable-length answers.

Each task maps a ``random.Random`` to ``(prompt, answer)``; the reward is exact match of the
completion (up to EOS) with the answer.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from gspo.tasks.datasets import Example


def _digits(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi)))


def reverse_task(rng: random.Random) -> tuple[str, str]:
    """``rev:3812=`` -> ``2183``: reverse 1-8 digits."""
    s = _digits(rng, 1, 8)
    return f"rev:{s}=", s[::-1]


def add_task(rng: random.Random) -> tuple[str, str]:
    """``add:37+485=`` -> ``522``: add two numbers of 1-3 digits."""
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    return f"add:{a}+{b}=", str(a + b)


def sort_task(rng: random.Random) -> tuple[str, str]:
    """``sort:3812=`` -> ``1238``: sort 1-8 digits ascending."""
    s = _digits(rng, 1, 8)
    return f"sort:{s}=", "".join(sorted(s))


def add_long_task(rng: random.Random) -> tuple[str, str]:
    """``add:5729+8003=`` -> ``13732``: add two 4-digit numbers (5000-9999, so every sum has 5 digits),
    more than a tiny model adds in its head; with ``env: tools`` it can call ``calc(...)``
    (gspo.envs)."""
    a, b = rng.randint(5_000, 9_999), rng.randint(5_000, 9_999)
    return f"add:{a}+{b}=", str(a + b)


SYNTHETIC_TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "reverse": reverse_task,
    "add": add_task,
    "sort": sort_task,
    "add_long": add_long_task,
}


def synthetic_examples(task: str, n: int, seed: int) -> list[Example]:
    """``n`` examples of an embedded task, reproducible from ``seed``."""
    rng = random.Random(seed)
    gen = SYNTHETIC_TASKS[task]
    return [Example(*gen(rng)) for _ in range(n)]
