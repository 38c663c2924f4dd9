"""Multi-turn demonstrations for the warm start (:func:`gspo.training.sft.warm_start`), whose next-token
loss covers the model's turns only.

A demonstration is a list of ``(text, is_model_turn)`` segments after the prompt, made as the rollout
would make that trajectory. Without a chat template: model turns are tokenized and end with EOS,
observations are tokenized as the rollout does (``add_special_tokens=False``), after the prompt the
trainer encodes. Under ``--chat-template`` (a tokenizer with a template): the row is
:func:`gspo.envs.chat.demo_tokens` of the conversation, its prompt declaring the environment's tools
and its calls in the template's own tool-call format, so each row carries its own prompt ids.

``sft_tool_fraction`` below 1 makes that share of the demonstrations call the tool and the rest
answer directly (drawn per row), so the warm start leaves a model that can use the tool but calls
it only on some prompts: the choice RL then learns.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gspo.plans import EnvPlan
from gspo.tasks.datasets import Example

Demo = list[tuple[str, bool]]
# (prompt_ids, ids, model_mask, obs_mask) of one warm-start row: its prompt, then the tokens after it
Row = tuple[list[int], list[int], list[int], list[int]]


@dataclass(frozen=True)
class CallFormat:
    """How a demonstration writes a tool call and its output: ``turn(tool, argument)`` is the model's
    turn, ``output(text)`` the observation text (plain: after the turn; chat: the tool message)."""

    turn: Callable[[str, str], str]
    output: Callable[[str], str]


PLAIN_CALLS = CallFormat(lambda tool, arg: f"{tool}({arg})", lambda out: f"={out}")


def add_long_demo(
    example: Example, rng: random.Random, calls: CallFormat = PLAIN_CALLS, use_tool: bool = True
) -> Demo:
    """``add_long``: call the calculator, then answer with its result (``calc(a+b)``, ``=s``, ``s``);
    without the tool, the answer alone."""
    if not use_tool:
        return [(example.answer, True)]
    expr = example.prompt.removeprefix("add:").removesuffix("=")
    return [(calls.turn("calc", expr), True), (calls.output(example.answer), False), (example.answer, True)]


# task -> demonstration maker (example, rng, calls, use_tool)
DEMONSTRATIONS: dict[str, Callable[..., Demo]] = {"add_long": add_long_demo}


def demo_tokens(tokenizer: Any, demo: Demo) -> tuple[list[int], list[int], list[int]]:
    """``(ids, model_mask, obs_mask)`` of a plain-text demonstration's tokens after the prompt."""
    ids: list[int] = []
    model: list[int] = []
    for text, is_model in demo:
        t = tokenizer(text, add_special_tokens=False).input_ids + (
            [tokenizer.eos_token_id] if is_model else []
        )
        ids += t
        model += [int(is_model)] * len(t)
    return ids, model, [1 - m for m in model]


def _chat_rows(tokenizer: Any, plan: EnvPlan, examples: list[Example]) -> Callable[[int, Demo], Row] | None:
    """Row makers for a chat-template rollout (None without one): the prompt from the environment's
    ``reset`` with its ``chat_tools`` declared, as :mod:`gspo.envs.episodes` starts a trajectory."""
    if not (plan.prompt.chat_template and getattr(tokenizer, "chat_template", None)):
        return None
    from gspo.envs.chat import ChatFormat
    from gspo.envs.chat import demo_tokens as chat_demo_tokens
    from gspo.envs.load import env_spec, make_env

    fmt = ChatFormat(tokenizer, plan.prompt.system_prompt)
    env = make_env(env_spec(plan.spec, lambda *a: [], None, "error"))
    tools = getattr(env, "chat_tools", None)
    return lambda i, demo: chat_demo_tokens(fmt, env.reset(examples[i]), tools, demo)


def chat_calls(tokenizer: Any) -> CallFormat:
    """Calls as the tokenizer's template writes a ``tool_calls`` entry; outputs as bare tool messages."""
    from gspo.envs.chat import tool_call_text

    key = {"calc": "expression", "python": "code"}
    return CallFormat(lambda tool, arg: tool_call_text(tokenizer, tool, {key[tool]: arg}), lambda out: out)


def demonstrations(
    tokenizer: Any, examples: list[Example], prompt_ids: list[list[int]], task: str, plan: EnvPlan,
    tool_fraction: float = 1.0,
) -> Callable[[list[int], random.Random], list[Row]] | None:  # fmt: skip
    """The warm start's rows (:func:`gspo.training.sft.warm_start`) on ``task``'s demonstrations: for the
    examples at some indices, each one's :data:`Row` (``prompt_ids``: the trainer's encoding, used
    without a chat template), a share ``tool_fraction`` of them calling the tool (drawn per row from
    the warm start's ``rng``); None for a task without demonstrations."""
    make = DEMONSTRATIONS.get(task)
    if make is None:
        return None
    chat = _chat_rows(tokenizer, plan, examples)
    calls = PLAIN_CALLS if chat is None else chat_calls(tokenizer)

    def row(i: int, rng: random.Random) -> Row:
        # no draw at 1.0, so an all-tool warm start sees the same batches as before the option
        use_tool = tool_fraction >= 1.0 or rng.random() < tool_fraction
        demo = make(examples[i], rng, calls, use_tool)
        return (prompt_ids[i], *demo_tokens(tokenizer, demo)) if chat is None else chat(i, demo)

    return lambda idx, rng: [row(i, rng) for i in idx]
