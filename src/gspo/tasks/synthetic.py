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


def progression_task(rng: random.Random) -> tuple[str, str]:
    """``seq:347+2>357=`` -> ``347,349,351,353,355,357``: the arithmetic progression from a 3-digit
    number in steps of 1 or 2 up to a given end, 17-64 terms, so the answer is 67-255 characters (one
    token each with the embedded tokenizer; 256 with EOS) from a 14-character prompt. A long response
    made of many small checkable steps: :func:`position_credit` rewards the share of terms right."""
    step, n = rng.randint(1, 2), rng.randint(17, 64)
    start = rng.randint(100, 999 - (n - 1) * step)
    terms = [start + i * step for i in range(n)]
    return f"seq:{start}+{step}>{terms[-1]}=", ",".join(map(str, terms))


def copy_task(rng: random.Random) -> tuple[str, str]:
    """``Copy this list exactly: 63,15,43,...`` -> ``63,15,43,...``: 22-30 random two-digit numbers, for a
    real instruction-tuned model with ``--chat-template`` (its tokenizer makes the answer 64-90 tokens).
    SmolLM2-135M-Instruct starts at ~12% exact (greedy): it often prefixes "The list is:" or drifts into
    repeating a stretch; :func:`position_credit` rewards the share of numbers right in place."""
    nums = ",".join(str(rng.randint(10, 99)) for _ in range(rng.randint(22, 30)))
    return f"Copy this list exactly: {nums}", nums


SYNTHETIC_TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "reverse": reverse_task,
    "add": add_task,
    "sort": sort_task,
    "add_long": add_long_task,
    "progression": progression_task,
    "copy": copy_task,
}


def position_credit(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Partial credit for a comma-separated answer (``reward: gspo.tasks.synthetic:position_credit``):
    the number of items the completion has right *at their position*, over the larger of the two item
    counts, so a missing item and an extra one cost the same; 1.0 exactly for the exact answer (which
    held-out accuracy counts), and a completion right up to its first slip keeps the credit of its
    right prefix."""
    out = []
    for c, a in zip(completions, answers, strict=True):
        got, want = c.strip().split(","), a.strip().split(",")
        right = sum(g.strip() == w for g, w in zip(got, want, strict=False))
        out.append(right / max(len(got), len(want)))
    return out


def synthetic_examples(task: str, n: int, seed: int) -> list[Example]:
    """``n`` examples of an embedded task, reproducible from ``seed``."""
    rng = random.Random(seed)
    gen = SYNTHETIC_TASKS[task]
    return [Example(*gen(rng)) for _ in range(n)]
