"""The environment interface of multi-turn rollouts (one screen), its limits, and the one-step case.

An environment plays one trajectory::

    prompt = env.reset(example)          # str, or chat messages [{"role": ..., "content": ...}]
    step = env.step(model_turn)          # Step(observation, reward): observation None = done
    step = env.step(next_model_turn)     # ... while the observation is text and the limits allow

A model turn ends at the tokenizer's EOS (the chat template's end-of-turn token for instruct models)
or at the per-turn budget. The observation's tokens follow the turn in the same token sequence; the
next model turn continues after them. The trajectory's reward is the sum of its steps' rewards.
:class:`Limits` end a trajectory that goes on too long (``truncated``): the turn limit, the per-turn
token budget and the per-trajectory budget (model and observation tokens after the prompt).
A plain single-turn task is :class:`TaskEnv`: one step, scored by the task's reward, done.

Under ``--chat-template`` (:mod:`gspo.envs.chat`) an observation goes back as chat messages: the
step's ``messages`` when it gives them (e.g. ``[{"role": "tool", "content": "46"}]``), else one
``tool`` message holding ``observation``. An environment with tools may declare them as an attribute
``chat_tools`` (a list of OpenAI-style JSON function schemas, passed to the template as ``tools=``).
Both are optional: an environment without them works unchanged. So is ``instant = True`` on an
environment's class (its steps return at once: no subprocess, no request): the HF engine then runs its
steps inside the decode loop instead of a pool of ``tool_concurrency`` threads, whose ticks would only
leave finished turns idle. gspo's calculator (``tools:calc`` with a built-in reward) is instant.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gspo.errors import GspoError
from gspo.tasks.datasets import Example, Prompt
from gspo.tasks.rewards import reward_value


@dataclass
class Step:
    """What the environment answers to one model turn."""

    observation: str | None  # text the model sees next; None: the trajectory is over
    reward: float = 0.0  # added to the trajectory's reward
    # the observation as chat messages ({"role", "content"}), rendered by the chat template under
    # --chat-template; None: one "tool" message holding `observation`. Ignored without a template.
    messages: list[dict[str, Any]] | None = None


class Env(Protocol):
    """One trajectory's environment; a fresh one per trajectory (``factory()``)."""

    def reset(self, example: Example) -> Prompt: ...

    def step(self, model_turn: str) -> Step: ...


@dataclass(frozen=True)
class Limits:
    """Budgets of one trajectory: turns, tokens per model turn, tokens after the prompt (all turns
    and observations)."""

    max_turns: int
    max_turn_tokens: int
    max_tokens: int


EnvFactory = Callable[[], Env]


class TaskEnv:
    """A single-turn task as an environment: the one model turn is scored by ``reward`` (a
    :data:`gspo.tasks.rewards.RewardFn`) and the trajectory is done."""

    def __init__(self, reward: Callable[..., list[float]], reward_name: str | None = None) -> None:
        self.reward, self.reward_name = reward, reward_name
        self.example: Example | None = None

    def reset(self, example: Example) -> Prompt:
        self.example = example
        return example.prompt

    def step(self, model_turn: str) -> Step:
        ex = self.example
        assert ex is not None, "step before reset"
        return Step(None, score_turn(self.reward, self.reward_name, ex, model_turn))


def score_turn(reward: Callable[..., list[float]], name: str | None, ex: Example, model_turn: str) -> float:
    """The task's reward of one final model turn, checked as in single-turn rollouts (one finite number;
    anything else is a :class:`~gspo.tasks.rewards.RewardFailure` naming the reward)."""
    from gspo.tasks.rewards import safe_rewards

    label = name or getattr(reward, "__name__", None) or type(reward).__name__
    return safe_rewards(reward, [ex.prompt], [model_turn], [ex.answer], "error", label)[0][0]


def check_step(out: Any, name: str) -> Step:
    """``out`` of ``env.step`` as a :class:`Step` (a ``(observation | None, reward)`` pair is accepted);
    a wrong type or a non-finite reward is a one-line :class:`GspoError` naming the environment."""
    if isinstance(out, tuple) and len(out) == 2:
        out = Step(*out)
    if not isinstance(out, Step):
        raise GspoError(
            f"environment {name}: step() returned {type(out).__name__}, expected Step(observation, reward) "
            "or an (observation | None, reward) pair"
        )
    if out.observation is not None and not isinstance(out.observation, str):
        raise GspoError(
            f"environment {name}: step() observation is {type(out.observation).__name__}, expected str or None"
        )
    r = out.reward
    # any real number (numpy's float32 included), never a bool; checked as a reward function's values
    # are (10**400 is no float, 1e39 no float32)
    real = isinstance(r, numbers.Real) and not isinstance(r, bool | np.bool_)
    value = reward_value(r) if real else f"{r!r:.60}"
    if isinstance(value, str):
        raise GspoError(f"environment {name}: step() reward must be a finite number, got {value}")
    obs = out.observation
    if obs is not None:  # a lone surrogate cannot be tokenized: replaced, as invalid bytes are
        obs = _valid_text(obs)
    msgs = out.messages
    if obs is not None and msgs is not None:
        msgs = _check_messages(msgs, name)
    return Step(obs, value, msgs if obs is not None else None)


def _valid_text(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")


#: the roles chat templates render (a template renders any string as a role: a typo would train)
ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")


def _check_roles(msgs: list[dict[str, Any]], name: str, what: str) -> None:
    for i, m in enumerate(msgs):
        if m.get("role") not in ROLES:
            raise GspoError(
                f"environment {name}: {what} message {i} has role {m.get('role')!r:.40}, not a chat role "
                f"({', '.join(ROLES)})"
            )


def _check_messages(msgs: Any, name: str) -> list[dict[str, Any]]:
    """``Step.messages``: a non-empty list of ``{"role": str, "content": str, ...}`` (copied, text made
    valid UTF-8); anything else is a one-line :class:`GspoError` naming the environment."""
    ok = isinstance(msgs, list) and bool(msgs)
    ok = ok and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in msgs
    )
    if not ok:
        raise GspoError(
            f"environment {name}: step() messages must be a non-empty list of "
            f'{{"role": str, "content": str}} dicts, got {str(msgs)[:60]!r}'
        )
    _check_roles(msgs, name, "step()")
    return [dict(m, content=_valid_text(m["content"])) for m in msgs]


def check_prompt(out: Any, name: str) -> Prompt:
    """``out`` of ``env.reset``: a non-empty string or a list of ``{"role", "content"}`` messages."""
    ok = isinstance(out, str) and out != ""
    if isinstance(out, list):
        ok = bool(out) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in out)
    if not ok:
        raise GspoError(
            f"environment {name}: reset() returned {type(out).__name__} {str(out)[:40]!r}, expected a "
            "non-empty prompt string or chat messages"
        )
    if isinstance(out, list):
        _check_roles(out, name, "reset()")
    return out
