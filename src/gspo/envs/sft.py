"""Multi-turn demonstrations for the warm start (:func:`gspo.train.sft.warm_start`), whose next-token
loss covers the model's turns only.

A demonstration is a list of ``(text, is_model_turn)`` segments after the prompt. Model turns are
tokenized and end with EOS, observations are tokenized as the rollout does
(``add_special_tokens=False``), so a demonstration is the token sequence a rollout would make.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from gspo.tasks.datasets import Example

Demo = list[tuple[str, bool]]


def add_long_demo(example: Example, rng: random.Random) -> Demo:
    """``add_long``: call the calculator, then answer with its result (``calc(a+b)``, ``=s``, ``s``)."""
    expr = example.prompt.removeprefix("add:").removesuffix("=")
    return [(f"calc({expr})", True), (f"={example.answer}", False), (example.answer, True)]


DEMONSTRATIONS: dict[str, Callable[[Example, random.Random], Demo]] = {"add_long": add_long_demo}


def demo_tokens(tokenizer: Any, demo: Demo) -> tuple[list[int], list[int], list[int]]:
    """``(ids, model_mask, obs_mask)`` of a demonstration's tokens after the prompt."""
    ids: list[int] = []
    model: list[int] = []
    for text, is_model in demo:
        t = tokenizer(text, add_special_tokens=False).input_ids + (
            [tokenizer.eos_token_id] if is_model else []
        )
        ids += t
        model += [int(is_model)] * len(t)
    return ids, model, [1 - m for m in model]


def demonstrations(
    tokenizer: Any, examples: list[Example], task: str
) -> Callable[[list[int], random.Random], list[tuple[list[int], list[int], list[int]]]] | None:
    """The warm start's rows (:func:`gspo.train.sft.warm_start`) on ``task``'s demonstrations: for the
    examples at some indices, each one's :func:`demo_tokens`; None for a task without demonstrations."""
    make = DEMONSTRATIONS.get(task)
    if make is None:
        return None
    return lambda idx, rng: [demo_tokens(tokenizer, make(examples[i], rng)) for i in idx]
