"""Environment by config (``env`` field) and the guarded calls the rollout makes into it.

``tools`` (calculator + Python), ``tools:calc`` / ``tools:python`` (one of them), ``task`` (the
single-turn task as a one-step environment), or a user factory ``pkg.mod:Name`` /
``path/file.py:Name``: a class or function called with no arguments that returns a fresh
environment (``reset(example)``, ``step(model_turn)``, :mod:`gspo.envs.base`), or a package's
environment, ``verifiers:NAME``, ``openenv:pkg.module:Class``, ``skyrl-gym:NAME``
(:mod:`gspo.envs.packages`), called as user environments are. User environments get
``reward_timeout_s`` per call (their module's import or the package's load, the constructor, ``reset``
and ``step``); past it, or when they raise
or return a wrong type, the run stops with one line naming the environment (``reward_on_error zero``:
the trajectory ends with reward 0 and is counted, except for time-outs, which always stop, and a bad
prompt from ``reset``, which leaves nothing to roll out). The task's reward inside ``task`` and
``tools`` is checked as in single-turn rollouts (one finite number per sample).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gspo.envs.base import Env, Step, TaskEnv, check_prompt, check_step
from gspo.errors import GspoError, one_line
from gspo.tasks.datasets import Prompt
from gspo.tasks.rewards import is_instant_reward

TOOLS = ("calc", "python")


@dataclass
class EnvSpec:
    """How to make one trajectory's environment, and how to call it."""

    factory: Callable[[], Env]
    name: str
    timeout_s: float | None  # per reset/step call (user environments only)
    on_error: str = "error"  # "error" or "zero" (the config's reward_on_error)
    builtin: bool = False  # task / tools: a GspoError inside is gspo's own (a reward's setup error)
    workers: int = 0  # steps run in a pool of this many threads beside the decoding (0: in the loop)
    tick_steps: int = 1  # a pooled step's trajectory goes on at the next tick (every so many decode steps)
    instant: bool = False  # its steps return at once (declared): the HF engine runs them in its loop


def env_spec(
    spec: str,
    reward: Callable[..., list[float]],
    timeout_s: float | None,
    on_error: str,
    reward_name: str | None = None,
) -> EnvSpec:
    """The :class:`EnvSpec` of a config's ``env`` value; ``reward`` is the task's reward (named
    ``reward_name`` in errors)."""
    from gspo.envs.tools import ToolEnv

    if spec == "task":
        return EnvSpec(lambda: TaskEnv(reward, reward_name), spec, None, on_error, builtin=True)
    if spec == "tools" or spec.startswith("tools:"):
        names = tuple(spec.partition(":")[2].split(",")) if ":" in spec else TOOLS
        bad = [n for n in names if n not in TOOLS]
        if bad:
            raise GspoError(
                f"config field 'env': unknown tool {bad[0]!r} in {spec!r} (tools: {', '.join(TOOLS)})"
            )
        if "python" in names:
            _check_sandbox()
        # the calculator and a built-in reward answer in microseconds: a pool would only add idle steps
        instant = "python" not in names and is_instant_reward(reward_name)
        factory = lambda: ToolEnv(reward, names, reward_name)  # noqa: E731
        return EnvSpec(factory, spec, None, on_error, builtin=True, instant=instant)
    factory = _bounded_load(spec, timeout_s, _user_factory)
    return EnvSpec(
        factory, spec, timeout_s or None, on_error, instant=getattr(factory, "instant", False) is True
    )


def _user_factory(spec: str) -> Callable[[], Env]:
    """The factory of a user's or a package's environment (its module imported, the package's
    environment loaded)."""
    from gspo.envs.packages import package_factory

    packaged = package_factory(spec, _import)
    if packaged is not None:
        return packaged
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise GspoError(
            f"config field 'env': unknown environment {spec!r} (tools, tools:calc, tools:python, task, "
            "pkg.module:Factory, path/file.py:Factory, verifiers:NAME, openenv:pkg.module:Class or "
            "skyrl-gym:NAME)"
        )
    module = _import(spec, target)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise GspoError(f"config field 'env': {target} has no callable {attr!r}")
    return factory


def _bounded_load(
    spec: str, timeout_s: float | None, load: Callable[[str], Callable[[], Env]]
) -> Callable[[], Env]:
    """``load(spec)`` under ``timeout_s`` (None or 0: no limit), as the environment's own calls are:
    a module whose import never returns would otherwise hang the run before its first step."""
    from gspo.tasks.timelimit import CallTimeout, call_with_timeout

    if not timeout_s:
        return load(spec)
    label = f"env {spec} (loading)"
    try:
        return call_with_timeout(load, (spec,), timeout_s, label)
    except CallTimeout as e:  # by type and name: the module's own limits keep their message
        if e.name != label:
            raise
        raise GspoError(
            f"config field 'env': loading {spec!r} (importing its module) did not finish within "
            f"{timeout_s:g} s (reward_timeout_s)"
        ) from None


def _import(spec: str, target: str) -> Any:
    from gspo.tasks.rewards import import_file, is_interrupt

    if target.endswith(".py"):
        return import_file(spec, target, "environment")
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError:
        file = target.replace(".", os.sep) + ".py"
        if os.path.isfile(file):
            return import_file(spec, file, "environment")
        raise GspoError(f"config field 'env': cannot import module {target!r} for {spec!r}") from None
    except BaseException as e:  # noqa: BLE001 (one line; a SystemExit at import too)
        if is_interrupt(e):
            raise
        raise GspoError(f"config field 'env': importing {target!r} failed: {one_line(e)}") from None


def _check_sandbox() -> None:
    from gspo.tasks.sandbox import REQUIRE_FS_ISOLATION, fs_available, unavailable_message

    if REQUIRE_FS_ISOLATION and not fs_available():
        raise GspoError(
            f"config field 'env': the python tool needs the code sandbox: {unavailable_message()}"
        )


class EnvFailure(Exception):
    """An environment call failed and ``on_error`` is ``zero``: the trajectory ends with reward 0."""


def _call(spec: EnvSpec, fn: Callable[..., Any], args: tuple, what: str) -> Any:
    """``fn(*args)`` of a user environment: its time limit, and its failures as one line naming it
    (:class:`EnvFailure` under ``on_error = zero``)."""
    from gspo.tasks.rewards import RewardFailure, is_interrupt
    from gspo.tasks.timelimit import CallTimeout, call_with_timeout

    label = f"env {spec.name}"
    try:
        if spec.timeout_s:
            return call_with_timeout(fn, args, spec.timeout_s, label)
        return fn(*args)
    except CallTimeout as e:  # by type: an environment's own message may say "timed out"
        if e.name != label:  # a reward's limit inside the environment: its own message
            raise
        raise GspoError(
            f"environment {spec.name}: {what} did not return within {spec.timeout_s:g} s (reward_timeout_s)"
        ) from None
    except RewardFailure as e:  # the task's reward inside task/tools: scored as in single-turn rollouts
        if spec.on_error == "zero":
            raise EnvFailure(str(e)) from None
        raise GspoError(f"environment {spec.name}: {what}: {e}") from None
    except BaseException as e:  # noqa: BLE001 (a user environment may raise anything, SystemExit too)
        if is_interrupt(e) or (spec.builtin and isinstance(e, GspoError)):  # a real Ctrl-C; gspo's own
            raise
        err = GspoError(f"environment {spec.name}: {what} raised {one_line(e)}")
        if spec.on_error == "zero":
            raise EnvFailure(str(err)) from None
        raise err from None


def make_env(spec: EnvSpec) -> Env:
    """A fresh environment from the factory (under the same time limit as its calls)."""
    env = _call(spec, spec.factory, (), "its constructor")
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise GspoError(f"environment {spec.name}: {type(env).__name__} has no reset()/step() methods")
    return env


def reset(spec: EnvSpec, env: Env, example: Any) -> Prompt:
    """``env.reset(example)``, checked (a bad prompt is always an error: nothing to roll out)."""
    return check_prompt(_call(spec, env.reset, (example,), "reset()"), spec.name)


def step(spec: EnvSpec, env: Env, model_turn: str) -> Step:
    """``env.step(model_turn)``, checked; :class:`EnvFailure` under ``on_error = zero``."""
    out = _call(spec, env.step, (model_turn,), "step()")
    try:
        return check_step(out, spec.name)
    except GspoError as e:
        if spec.on_error == "zero":
            raise EnvFailure(str(e)) from None
        raise
