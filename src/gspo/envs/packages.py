"""Environments from the ecosystem's packages, played by gspo's multi-turn rollout.

``--env skyrl-gym:NAME``   a registered skyrl-gym environment (``skyrl_gym.make(NAME)``); each example's
                           answer is its ``reward_spec.ground_truth``, its prompt goes to ``init``
``--env openenv:MOD:CLS``  an OpenEnv ``Environment`` subclass, in process (``pkg.module:Class`` or
                           ``path/file.py:Class``); the model's turn fills the action's one text field
``--env verifiers:NAME``   a verifiers taskset played by its environment (``vf.load_environment``); gspo
                           plays the agent seat, in process, and the task's ``@vf.reward`` s score it

Each adapter is an :class:`~gspo.envs.base.Env` (``reset(example)``, ``step(model_turn)``), so the
package's environment runs under the same limits and one-line errors as a user's own: a call that
raises, returns a wrong type or hangs (``reward_timeout_s``) stops the run naming the environment, or
scores 0 under ``--reward-on-error zero``. OpenEnv and verifiers environments bring their own problems;
gspo's task only picks one per example (a stable hash of its prompt: a group's samples share it).
Packages are imported when the environment is loaded; a missing one is a one-line error.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import typing
import zlib
from collections.abc import Callable
from typing import Any

from gspo.envs.base import Env, Step
from gspo.errors import GspoError, one_line
from gspo.tasks.datasets import Example, Prompt

INFINITE_TASKS = 1024  # tasks read from an infinite verifiers taskset (a finite one is read whole)


def package_factory(spec: str, importer: Callable[[str, str], Any]) -> Callable[[], Env] | None:
    """The environment factory of ``spec`` when it names a package (``verifiers:``, ``openenv:``,
    ``skyrl-gym:``), else None. ``importer(spec, target)`` imports a user module or file."""
    kind, _, name = spec.partition(":")
    make = {"skyrl-gym": _skyrl_gym, "openenv": _openenv, "verifiers": _verifiers}.get(kind)
    if make is None:
        return None
    if not name:
        raise GspoError(f"config field 'env': {spec!r} names no environment ({kind}:NAME)")
    return make(spec, name, importer)


def _require(module: str, dist: str, spec: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise GspoError(
            f"config field 'env': {spec} needs the {dist} package (pip install {dist}): {e}"
        ) from None


def _seed(example: Example) -> int:
    """A stable number of an example (its prompt): every sample of a group gets the same problem."""
    text = example.prompt if isinstance(example.prompt, str) else json.dumps(example.prompt, sort_keys=True)
    return zlib.crc32(text.encode("utf-8", "replace"))


def _as_chat(messages: Any, what: str, role: str = "user") -> list[dict[str, str]]:
    """Chat messages (dicts or objects with ``role`` and ``content``) or a string (one ``role``
    message) -> ``{"role", "content"}`` dicts, what the chat template renders."""
    if isinstance(messages, str):
        return [{"role": role, "content": messages}]
    if not isinstance(messages, list):
        raise TypeError(f"{what} is {type(messages).__name__}, expected chat messages or a string")
    out = []
    for m in messages:
        get = m.get if isinstance(m, dict) else lambda k, m=m: getattr(m, k, None)
        content, r = get("content"), get("role")
        if not isinstance(content, str):
            raise TypeError(f"{what} has a message whose content is {type(content).__name__}, expected str")
        out.append({"role": r if isinstance(r, str) and r else role, "content": content})
    return out


def _message_text(messages: Any, what: str) -> str:
    """The text the model sees of chat messages or a string (plain text: the contents, one a line)."""
    return "\n".join(m["content"] for m in _as_chat(messages, what))


# ------------------------------------------------------------------------------------------------
# skyrl-gym: Env.init(prompt) -> (prompt, info); Env.step(action) -> {observations, reward, done}


#: skyrl-gym's own environments that only score text, by entry point: the others run what the model
#: writes on the host, as the user (lcb, searchcode: its Python; text2sql: its SQL) or send it to a
#: server gspo does not set up (search). An allowlist: an environment a new skyrl-gym release adds is
#: refused until checked. Environments a user registers from their own module are their code, trusted
#: as ``--env pkg.module:Factory`` is.
SKYRL_GYM_TEXT_ONLY = {
    "aime": "skyrl_gym.envs.aime.env:AIMEEnv",
    "gsm8k": "skyrl_gym.envs.gsm8k.env:GSM8kEnv",
    "gsm8k_multi_turn": "skyrl_gym.envs.gsm8k.multi_turn_env:GSM8kMultiTurnEnv",
}


def _skyrl_gym(spec: str, name: str, importer: Any) -> Callable[[], Env]:
    gym = _require("skyrl_gym", "skyrl-gym", spec)
    if name not in gym.registry:
        known = ", ".join(sorted(gym.registry))
        raise GspoError(
            f"config field 'env': {spec}: no skyrl-gym environment {name!r} (registered: {known})"
        )
    entry = gym.registry[name].entry_point
    if not isinstance(entry, str):  # a class or function: where its code lives
        entry = f"{getattr(entry, '__module__', '')}:{getattr(entry, '__qualname__', '')}"
    if entry.split(".")[0].split(":")[0] == "skyrl_gym" and entry not in SKYRL_GYM_TEXT_ONLY.values():
        raise GspoError(
            f"config field 'env': {spec} is refused: its tools act on the model's output outside gspo's "
            f"sandbox (code run on this host as you, or requests to a server); gspo plays the skyrl-gym "
            f"environments that score text alone ({', '.join(SKYRL_GYM_TEXT_ONLY)}); for Python tools "
            "use --env tools:python"
        )
    return lambda: SkyRLGymEnv(gym, name)


class SkyRLGymEnv:
    """One skyrl-gym environment per trajectory, made at ``reset`` with the example's answer as its
    ground truth; a step's observation messages are joined into one text, ``done`` ends it."""

    def __init__(self, gym: Any, name: str) -> None:
        self.gym, self.name, self.env = gym, name, None

    def reset(self, example: Example) -> Prompt:
        truth = {"ground_truth": example.answer}  # aime reads it from reward_model, the others reward_spec
        extras = {"reward_spec": truth, "reward_model": truth, "extra_info": {}}
        self.env = self.gym.make(self.name, env_config={}, extras=extras)
        messages = (
            example.prompt
            if isinstance(example.prompt, list)
            else [{"role": "user", "content": example.prompt}]
        )
        out = self.env.init(messages)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"init() returned {type(out).__name__}, expected (prompt, info)")
        return example.prompt if out[0] == messages else out[0]

    def step(self, model_turn: str) -> Step:
        out = self.env.step(model_turn)
        if not isinstance(out, dict) or not {"reward", "done"} <= out.keys():
            raise TypeError(f"step() returned {type(out).__name__}, expected a dict with reward and done")
        if out["done"]:
            return Step(None, out["reward"])
        chat = _as_chat(out.get("observations") or [], "step() observations")
        return Step("\n".join(m["content"] for m in chat), out["reward"], chat or None)


# ------------------------------------------------------------------------------------------------
# OpenEnv: Environment.reset(seed=...) -> Observation; Environment.step(Action) -> Observation


def _openenv(spec: str, target: str, importer: Callable[[str, str], Any]) -> Callable[[], Env]:
    interfaces = _require("openenv.core.env_server.interfaces", "openenv-core", spec)
    module_name, _, attr = target.rpartition(":")
    if not module_name or not attr:
        raise GspoError(
            f"config field 'env': {spec}: expected openenv:pkg.module:Class or openenv:file.py:Class"
        )
    cls = getattr(importer(spec, module_name), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, interfaces.Environment)):
        raise GspoError(f"config field 'env': {spec}: {attr!r} is not an openenv Environment subclass")
    action_cls, field = _text_action(cls, spec)
    return lambda: OpenEnvEnv(cls(), action_cls, field)


def _text_action(cls: type, spec: str) -> tuple[type, str]:
    """The environment's action class (``step``'s annotation, else its ``Environment[Act, ...]``
    parameter) and the action's one ``str`` field, which carries the model's turn."""
    from openenv.core.env_server.types import Action

    try:
        action = typing.get_type_hints(cls.step).get("action")
    except Exception:  # noqa: BLE001 (an unresolvable annotation: fall back to the generic parameter)
        action = None
    if not (isinstance(action, type) and issubclass(action, Action) and action is not Action):
        params = [a for b in getattr(cls, "__orig_bases__", ()) for a in typing.get_args(b)]
        action = next((a for a in params if isinstance(a, type) and issubclass(a, Action)), None)
    if action is None:
        raise GspoError(
            f"config field 'env': {spec}: cannot tell its action class (annotate step(action: MyAction))"
        )
    fields = [n for n, f in action.model_fields.items() if f.annotation is str]
    if len(fields) != 1:
        raise GspoError(
            f"config field 'env': {spec}: action {action.__name__} needs exactly one str field for the "
            f"model's turn, has {fields or 'none'}"
        )
    return action, fields[0]


class OpenEnvEnv:
    """An OpenEnv environment in process: reset with a seed from the example, the observation's text
    fields as the prompt / next observation, ``done`` ends it, ``reward`` (None: 0) is the step's."""

    def __init__(self, env: Any, action_cls: type, field: str) -> None:
        self.env, self.action_cls, self.field = env, action_cls, field

    def reset(self, example: Example) -> Prompt:
        params = inspect.signature(self.env.reset).parameters
        takes_seed = "seed" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        obs = self.env.reset(seed=_seed(example)) if takes_seed else self.env.reset()
        return _observation_text(obs, "reset()") or example.prompt

    def step(self, model_turn: str) -> Step:
        obs = self.env.step(self.action_cls(**{self.field: model_turn}))
        text = _observation_text(obs, "step()")
        r = obs.reward
        reward = 0.0 if r is None else float(r) if isinstance(r, bool) else r
        return Step(None if obs.done else text, reward)


def _observation_text(obs: Any, what: str) -> str:
    """An Observation's own fields (not done/reward/metadata) as text: the one string field itself,
    else ``name: value`` lines."""
    from openenv.core.env_server.types import Observation

    if not isinstance(obs, Observation):
        raise TypeError(f"{what} returned {type(obs).__name__}, expected an openenv Observation")
    fields = obs.model_dump(exclude={"done", "reward", "metadata"})
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return next(iter(fields.values()))
    return "\n".join(f"{k}: {v}" for k, v in fields.items())


# ------------------------------------------------------------------------------------------------
# verifiers (v1): an Env's run(task, agents) drives the agents' interactions; gspo is every seat


def _verifiers(spec: str, name: str, importer: Any) -> Callable[[], Env]:
    vf = _require("verifiers.v1", "verifiers", spec)
    try:
        venv = vf.load_environment(vf.resolve_env_config({"taskset": {"id": name}}))
        taskset = venv.taskset
        tasks = list(taskset if taskset.bounded else taskset.take(INFINITE_TASKS))
    except BaseException as e:  # noqa: BLE001 (the package's or module's failure, a SystemExit too)
        from gspo.tasks.rewards import is_interrupt

        if is_interrupt(e):  # a real Ctrl-C, or the load's time limit
            raise
        raise GspoError(
            f"config field 'env': {spec}: loading the verifiers environment failed: {one_line(e)}"
        ) from None
    if not tasks:
        raise GspoError(f"config field 'env': {spec}: the verifiers taskset has no tasks")
    unsupported = _needs_runtime(type(taskset), taskset.config, tasks[0])
    if unsupported:
        raise GspoError(
            f"config field 'env': {spec}: {unsupported}, which gspo's in-process play does not provide"
        )
    return lambda: VerifiersEnv(vf, venv, tasks)


def _needs_runtime(taskset_cls: type, config: Any, task: Any) -> str | None:
    """What a verifiers taskset needs beyond a conversation (a sandbox, tool servers, a reward that
    reads the runtime), said as the reason it cannot run here; None when it needs nothing more.
    Scored without a runtime, verifiers would skip such a reward: a silently wrong reward."""
    if getattr(task, "NEEDS_CONTAINER", False):
        return "its tasks need a container"
    if taskset_cls.toolsets(config) or type(task).toolsets(task.config):
        return "it serves tools (MCP toolsets)"
    for fn in task.hooks("reward"):
        param = inspect.signature(fn).parameters.get("runtime")
        if param is not None and param.default is inspect.Parameter.empty:
            return f"its reward {fn.__name__!r} reads the task's runtime"
    return None


class VerifiersEnv:
    """One verifiers episode, stepped by gspo: the environment's ``run`` coroutine runs on this
    object's own event loop, in the caller's thread, until it asks a seat for a model turn (the
    prompt, or the next user message, goes back to gspo) or ends (the task's rewards score the trace
    and the sum is the trajectory's reward)."""

    def __init__(self, vf: Any, venv: Any, tasks: list[Any]) -> None:
        self.vf, self.venv, self.tasks = vf, venv, tasks
        self.loop = asyncio.new_event_loop()
        self.want: asyncio.Future | None = None  # set by a seat: the message the model answers
        self.reply: asyncio.Future | None = None  # the model's turn, set by step()
        self.episode: asyncio.Task | None = None
        self.trace: Any = None

    def __del__(self) -> None:
        # a trajectory the limits cut leaves its episode waiting for a turn: cancel it, quietly
        if self.loop.is_closed():
            return
        if self.episode is not None and not self.episode.done() and not self.loop.is_running():
            self.episode.cancel()
            with contextlib.suppress(BaseException):
                self.loop.run_until_complete(asyncio.gather(self.episode, return_exceptions=True))
        self.loop.close()

    def reset(self, example: Example) -> Prompt:
        task = self.tasks[_seed(example) % len(self.tasks)]
        vf = self.vf
        self.trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data),
            agent=vf.AgentInfo(config=vf.AgentConfig()),
        )
        self.episode = self.loop.create_task(self._play(task))
        kind, message = self._advance()
        if kind == "done":
            raise RuntimeError("the environment's run() asked for no model turn")
        if message is not None:  # a prompt-less task: the environment opens the conversation
            return _message_text(message, "the environment's message")
        data = task.data
        prompt = (
            data.prompt if isinstance(data.prompt, str) else _message_text(data.prompt, "the task's prompt")
        )
        return (
            [{"role": "system", "content": data.system_prompt}, {"role": "user", "content": prompt}]
            if (data.system_prompt)
            else prompt
        )

    def step(self, model_turn: str) -> Step:
        assert self.reply is not None, "step before reset"
        self.reply.set_result(model_turn)
        kind, value = self._advance()
        if kind == "done":
            return Step(None, value)
        chat = _as_chat(value, "the environment's message")  # the environment speaks as the user
        return Step("\n".join(m["content"] for m in chat), 0.0, chat)

    async def _play(self, task: Any) -> float:
        agents = _Agents(self)
        await self.venv.setup(agents)
        await self.venv.run(task, agents)
        await task.score(self.trace)
        return self.trace.reward

    def _advance(self) -> tuple[str, Any]:
        """Run the episode until a seat wants a model turn (``("turn", message)``) or it ends
        (``("done", reward)``; its exception, if it raised)."""
        self.want = self.loop.create_future()
        assert self.episode is not None
        self.loop.run_until_complete(
            asyncio.wait({self.episode, self.want}, return_when=asyncio.FIRST_COMPLETED)
        )
        if self.want.done():
            return "turn", self.want.result()
        self.loop.close()
        return "done", self.episode.result()

    async def model_turn(self, message: Any) -> str:
        """A seat's request: hand ``message`` (None: answer the task's prompt) to gspo, await the turn."""
        self.reply = self.loop.create_future()
        assert self.want is not None
        self.want.set_result(message)
        turn = await self.reply
        self._record(message, turn)
        return turn

    def _record(self, message: Any, turn: str) -> None:
        from verifiers.v1.graph import MessageNode

        nodes = self.trace.nodes
        if message is not None:
            message = _message_text(message, "the environment's message")
            nodes.append(
                MessageNode(
                    message=self.vf.UserMessage(content=message), parent=len(nodes) - 1 if nodes else None
                )
            )
        msg = self.vf.AssistantMessage(content=turn)
        nodes.append(MessageNode(message=msg, sampled=True, parent=len(nodes) - 1 if nodes else None))


class _Agents:
    """The episode's agents: every seat the environment names is gspo's model."""

    def __init__(self, owner: VerifiersEnv) -> None:
        self._seat = _Seat(owner)

    def __getattr__(self, name: str) -> _Seat:
        if name.startswith("_"):
            raise AttributeError(name)
        return self._seat


class _Seat:
    """An agent seat played by gspo: ``run(task)`` (one turn on the task's prompt) and
    ``interaction(task)`` (turn by turn, the environment as the user)."""

    trainable = True

    def __init__(self, owner: VerifiersEnv) -> None:
        self.owner = owner

    async def run(self, task: Any) -> Any:
        async with self.interaction(task) as exchange:
            await exchange.turn()
        return self.owner.trace

    def interaction(self, task: Any) -> _Exchange:
        return _Exchange(self.owner)


class _Exchange:
    """``async with seat.interaction(task) as x``: ``await x.turn(message)`` -> the model's reply as
    a verifiers ``Segment``; ``x.trace`` is the episode's trace."""

    def __init__(self, owner: VerifiersEnv) -> None:
        self.owner = owner
        self.trace = owner.trace

    async def __aenter__(self) -> _Exchange:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    async def turn(self, message: Any = None) -> Any:
        text = await self.owner.model_turn(message)
        return self.owner.vf.Segment(messages=[self.owner.vf.AssistantMessage(content=text)])
