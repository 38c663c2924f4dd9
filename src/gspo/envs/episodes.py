"""Multi-turn rollouts with any :class:`~gspo.data.RolloutEngine` (HF, vLLM).

Each trajectory is one token sequence after its prompt: model turn, observation, model turn, ...
``response_mask_BT`` marks the model's tokens (each turn's final EOS included), ``obs_mask_BT`` the
observation tokens; the sampler's log-probs are there on the model's tokens only. An engine with a
``play`` method takes every turn of the batch in one call, each trajectory going on as its
environment answers (HF: each one's KV cache kept across its turns; vLLM: each turn a request to
its continuously batching engine); the environment's steps run in a pool of ``tool_concurrency``
threads beside the decoding, a trajectory going on at the first tick after its turn
(:mod:`gspo.rollout.turns`: its tokens do not depend on how long a step took). Any other engine,
and vLLM with ``tool_concurrency=0``, gets one ``engine.generate`` call per turn over the live
trajectories. A turn's context is the whole trajectory so far (prompt, earlier turns and
observations, as token ids: nothing is re-tokenized). Deterministic given the engine's generator:
exact resume holds as for single-turn rollouts. The trajectories are scored with the single-turn
responses, by :func:`gspo.training.scoring.score_rollout`.

With ``--chat-template`` (and a tokenizer that has one) the trajectory is a chat conversation
(:mod:`gspo.envs.chat`): the prompt declares the environment's tools, each observation is the
template's rendering of the environment's messages (a ``tool`` message), and the model's turns stay
the tokens it sampled. Without it, observations are tokenized as plain text after the turn.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from gspo.data import RolloutEngine, SampleBatch
from gspo.envs.base import Env, Limits, Step
from gspo.envs.chat import Conversation
from gspo.envs.load import EnvFailure, EnvSpec, env_spec, make_env, reset, step
from gspo.errors import GspoError
from gspo.plans import EnvPlan
from gspo.tasks.datasets import Example, Prompt


@dataclass
class EnvSampleBatch(SampleBatch):
    """A :class:`SampleBatch` of trajectories: ``response_*`` hold model turns and observations."""

    obs_mask_BT: torch.Tensor | None = None  # [B, T] 1 on observation tokens
    reward_B: torch.Tensor | None = None  # [B] the environment's reward (sum over steps)
    truncated_B: torch.Tensor | None = None  # [B] 1 where a limit, not the environment, ended it
    turns_B: torch.Tensor | None = None  # [B] model turns
    n_errors: int = 0  # trajectories ended by a failing environment (reward_on_error zero) ...
    failed_B: torch.Tensor | None = None  # [B] ... 1 on each of them (a share of rows counts its own)
    # R3 (an engine that returns its routing, vLLM): per row, the experts of each position of
    # ``prompt_ids[i] + response`` that was fed to the engine, [n, moe_layers, k], and the layers' names
    routed_experts: list[torch.Tensor] | None = None
    routed_layers: list[str] | None = None

    def routing_rows(self) -> dict[str, torch.Tensor] | None:
        """The sampler's routing in the trainer's ``rows`` layout (prompt, model turns and
        observations from column 0), as :func:`gspo.rollout.vllm_batch.routing_rows_layout` lays out
        a single-turn batch; positions the engine never fed (each row's last token) hold ``0..k-1``,
        which causal attention keeps from every earlier position."""
        if self.routed_experts is None or self.routed_layers is None:
            return None
        real = (
            (self.response_mask_BT | self.obs_mask_BT)
            if self.obs_mask_BT is not None
            else self.response_mask_BT
        )
        lens = [len(p) + int(n) for p, n in zip(self.prompt_ids, real.sum(-1).tolist(), strict=True)]
        B, L = len(lens), max(lens + [1])
        n_layers, k = self.routed_experts[0].shape[1:]
        out = torch.arange(k, dtype=torch.long).expand(B, L, n_layers, k).clone()
        for i, r in enumerate(self.routed_experts):
            out[i, : r.shape[0]] = r
        return {name: out[:, :, j].contiguous() for j, name in enumerate(self.routed_layers)}


def limits_of(plan: EnvPlan) -> Limits:
    return Limits(plan.max_turns, plan.max_new_tokens, plan.max_trajectory_tokens)


class Encoder:
    """A prompt from ``env.reset`` -> token ids, as the trainer encodes prompts (template, limits).
    A prompt with more characters than ``max_prompt_tokens`` of the tokenizer's longest tokens could
    hold is refused before it is tokenized (a 10 MB prompt would take seconds to tokenize).
    ``chat``: the chat format of a ``--chat-template`` run whose tokenizer has a template (None:
    observations are plain text)."""

    def __init__(self, tokenizer: Any, plan: EnvPlan) -> None:
        from gspo.envs.chat import ChatFormat

        self.tokenizer, self.plan = tokenizer, plan
        self.longest = 0  # the longest token's characters, found once, when first needed
        templated = plan.prompt.chat_template and getattr(tokenizer, "chat_template", None)
        self.chat = ChatFormat(tokenizer, plan.prompt.system_prompt) if templated else None

    def check_size(self, prompt: Prompt) -> None:
        n = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        if n > self.plan.max_prompt_tokens:  # else it may fit whatever the tokenizer
            self.longest = self.longest or _longest_token_chars(self.tokenizer)
            if n > self.plan.max_prompt_tokens * self.longest:
                raise GspoError(
                    f"returned a prompt of {n:,} characters, more than max_prompt_tokens="
                    f"{self.plan.max_prompt_tokens} tokens of at most {self.longest} characters can hold"
                )

    def __call__(self, prompt: Prompt) -> list[int]:
        from gspo.tasks.prompts import encode_prompts

        self.check_size(prompt)
        return encode_prompts(self.tokenizer, [Example(prompt, "")], self.plan.prompt)[0]

    def start_chat(
        self, prompt: Prompt, tools: list[dict[str, Any]] | None
    ) -> tuple[Conversation, list[int]]:
        """The conversation of ``prompt`` with ``tools`` declared, and its token ids (limits checked)."""
        assert self.chat is not None
        try:
            self.check_size(prompt)
        except GspoError as e:
            raise GspoError(f"reset() {e}") from None
        conv = self.chat.start(prompt, tools)
        ids = conv.prompt_ids()
        if not ids or len(ids) > self.plan.max_prompt_tokens:
            raise GspoError(
                f"reset() returned a prompt of {len(ids)} tokens with the chat template, not in 1.."
                f"max_prompt_tokens={self.plan.max_prompt_tokens}"
            )
        return conv, ids


def encoder(tokenizer: Any, plan: EnvPlan) -> Encoder:
    return Encoder(tokenizer, plan)


def _longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token covers (byte-level vocabularies: bytes, more than
    characters); doubled for normalizers that merge characters."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 (a tokenizer without a vocabulary to list: a generous bound)
        return 1024
    return 2 * max((len(t) for t in vocab), default=512)


def spec_of(plan: EnvPlan, task: Any) -> EnvSpec:
    spec = env_spec(
        plan.spec,
        task.reward,
        plan.reward_timeout_s or None,
        plan.reward_on_error,
        getattr(task, "reward_name", None),
    )
    # ``task``: one step, the task's reward on the answer (no tool to wait for): in the loop, so its
    # rollout is the single-turn one
    spec.workers, spec.tick_steps = (
        (plan.tool_concurrency if plan.spec != "task" else 0),
        plan.tool_tick_steps,
    )
    return spec


@dataclass
class _Traj:
    env: Env | None  # None: it failed before its first turn (reward_on_error zero)
    context: list[int]  # prompt + everything after it so far
    ids: list[int]
    model: list[int]  # 1 on model tokens
    logp: list[float]
    reward: float = 0.0
    turns: int = 0
    truncated: bool = False
    failed: bool = False
    chat: Conversation | None = None  # the conversation so far, under a chat template
    routed: torch.Tensor | None = None  # R3: the engine's experts of each position fed so far


def _add_routing(t: _Traj, routed_LK: torch.Tensor, n: int) -> None:
    """Extend ``t``'s R3 routing with a turn's: the call fed the context and the turn's first
    ``n - 1`` kept tokens. Positions routed by an earlier call keep that routing (the forward that
    sampled the tokens after them); the new ones are the context's observations (this call's
    prefill) and the positions whose forward sampled this turn's tokens."""
    have = 0 if t.routed is None else t.routed.shape[0]
    new = routed_LK[have : len(t.context) + n - 1]
    t.routed = new.clone() if t.routed is None else torch.cat([t.routed, new])


def run_episodes(
    engine: RolloutEngine,
    tokenizer: Any,
    spec: EnvSpec,
    examples: list[Example],
    prompt_ids: list[list[int]],
    limits: Limits,
    temperature: float,
    greedy: bool = False,
    encode: Callable[[Prompt], list[int]] | None = None,
) -> EnvSampleBatch:
    """One trajectory per example (repeat an example G times for a group), played to its end.
    ``prompt_ids`` are the examples' prompts encoded; a different prompt from ``env.reset`` is
    encoded with ``encode`` (the trainer's :func:`~gspo.tasks.prompts.encode_prompts`); an
    :class:`Encoder` with a chat format renders every trajectory as a conversation."""
    trajs = [_start(spec, ex, ids, encode) for ex, ids in zip(examples, prompt_ids, strict=True)]
    prompt_ids = [list(t.context) for t in trajs]
    live = [i for i, t in enumerate(trajs) if not t.failed]
    layers = None
    if live and _plays(engine, spec):  # one play call: caches kept, each trajectory on its own
        layers = _play(engine, trajs, live, tokenizer, spec, limits, temperature, greedy)
        live = []
    while live:
        budget = [_budget(trajs[i], limits) for i in live]
        rb = engine.generate([trajs[i].context for i in live], max(budget), temperature, greedy)
        lens = rb.response_mask_BT.sum(-1).tolist()
        ids_BT, logp_BT = rb.response_ids_BT.tolist(), rb.sampler_logp_BT.float().tolist()
        routed = getattr(rb, "routed_experts", None)  # R3 (vLLM with return_routing)
        if routed is not None:
            layers = rb.routed_layers
            for j, i in enumerate(live):
                _add_routing(trajs[i], routed[j], min(lens[j], budget[j]))
        live = [
            i
            for j, i in enumerate(live)
            if _turn(trajs[i], ids_BT[j], logp_BT[j], min(lens[j], budget[j]), tokenizer, spec, limits)
            is not None
        ]
    n_bad = sum(t.failed for t in trajs)
    if n_bad and n_bad == len(trajs):
        raise GspoError(f"environment {spec.name} failed on all {n_bad} trajectories of the batch")
    eb = _to_batch(trajs, prompt_ids, tokenizer.pad_token_id, n_bad)
    if layers is not None:  # a trajectory that failed before its first turn was never fed
        k = next(t.routed for t in trajs if t.routed is not None).shape[1:]
        eb.routed_experts = [
            t.routed if t.routed is not None else torch.zeros((0, *k), dtype=torch.long) for t in trajs
        ]
        eb.routed_layers = list(layers)
    return eb


def _budget(t: _Traj, limits: Limits) -> int:
    """The tokens ``t``'s next model turn may have."""
    return min(limits.max_turn_tokens, limits.max_tokens - len(t.ids))


def _plays(engine: Any, spec: EnvSpec) -> bool:
    """Whether ``engine`` plays the trajectories in one call (:meth:`~gspo.rollout.hf.HFRolloutEngine.play`):
    with a worker pool (``spec.workers``) where it can, and the HF engine with steps in its loop too."""
    if getattr(engine, "play", None) is None:
        return False
    return getattr(engine, "plays_inline", False) or (spec.workers > 0 and getattr(engine, "can_play", True))


def _play(
    engine: Any,
    trajs: list[_Traj],
    live: list[int],
    tokenizer: Any,
    spec: EnvSpec,
    limits: Limits,
    temperature: float,
    greedy: bool,
) -> list[str] | None:
    """Every turn of the ``live`` trajectories in one call of an engine's ``play``: the HF engine
    keeps each one's KV cache across turns; vLLM takes each turn as its own request. With
    ``spec.workers`` the environment's steps run in a pool of that many threads while the engine
    decodes the other trajectories; a trajectory goes on at the first tick (every ``spec.tick_steps``
    decode steps) after its turn ended (:class:`~gspo.rollout.turns.Ticks`: the results do not
    depend on when a step returns). Without (or for an environment declared instant, on the HF
    engine), each step runs in the loop. The engine's R3 routing layers, if it records them."""
    # an instant environment's steps run in the HF engine's loop: with nothing to wait for, a pool's
    # ticks only leave finished turns idle (~10-15% slower); vLLM keeps the pool, its continuously
    # batching engine gaining from each trajectory going on by itself even then
    pooled = spec.workers > 0 and not (spec.instant and getattr(engine, "plays_inline", False))
    pool = ThreadPoolExecutor(spec.workers, "gspo-env") if pooled else None

    def turn_end(j: int, ids: list[int], logp: list[float]) -> tuple[list[int], int] | _Answer | None:
        t = trajs[live[j]]
        if pool is None:
            obs = _turn(t, ids, logp, len(ids), tokenizer, spec, limits)
            return None if obs is None else (obs, _budget(t, limits))
        text, ended = _turn_start(t, ids, logp, len(ids), tokenizer)
        assert t.env is not None  # live trajectories have one
        return _Answer(pool.submit(_step, spec, t.env, text), t, (text, ended, len(ids)), tokenizer, limits)

    kw: dict[str, Any] = {"tick": spec.tick_steps} if pool is not None else {}
    layers = getattr(engine, "routed_layers", None) if getattr(engine, "return_routing", False) else None
    if layers is not None:  # R3: each turn's request routed its context and the turn's tokens but the last
        kw["routed"] = lambda j, routed_LK, n: _add_routing(trajs[live[j]], routed_LK, n)
    contexts, budgets = [trajs[i].context for i in live], [_budget(trajs[i], limits) for i in live]
    try:
        engine.play(contexts, budgets, limits.max_tokens, turn_end, temperature, greedy, **kw)
    finally:
        if pool is not None:  # after an error, steps still running finish on their own
            pool.shutdown(wait=False, cancel_futures=True)
    return layers


class _Answer:
    """An environment step running in the pool; ``result()`` (in the engine's loop, when the
    trajectory is due) waits for it and finishes the turn: (observation ids, next budget) or None."""

    def __init__(
        self, fut: Future, t: _Traj, turn: tuple[str, bool, int], tokenizer: Any, limits: Limits
    ) -> None:
        self.fut, self.t, self.turn, self.tokenizer, self.limits = fut, t, turn, tokenizer, limits

    def result(self) -> tuple[list[int], int] | None:
        obs = _turn_end(self.t, self.fut.result(), *self.turn, self.tokenizer, self.limits)
        return None if obs is None else (obs, _budget(self.t, self.limits))


def _start(spec: EnvSpec, ex: Example, ids: list[int], encode: Callable[[Prompt], list[int]] | None) -> _Traj:
    """A trajectory's environment and prompt ids: ``ids`` (the example's prompt encoded) unless
    ``reset()`` changes the prompt or a chat template renders it (with the environment's tools)."""
    try:
        env = make_env(spec)
        prompt = reset(spec, env, ex)
    except EnvFailure:  # reward_on_error zero: no model turn, reward 0, counted
        return _Traj(None, list(ids), [], [], [], failed=True)
    chat = encode.chat if isinstance(encode, Encoder) else None
    if chat is None and prompt == ex.prompt:
        return _Traj(env, list(ids), [], [], [])
    if encode is None:
        raise GspoError(
            f"environment {spec.name}: reset() changed the prompt, which this caller cannot encode"
        )
    conv = None
    try:
        if isinstance(encode, Encoder) and chat is not None:
            conv, ids = encode.start_chat(prompt, _chat_tools(env))
        else:
            ids = encode(prompt)
    except GspoError as e:
        raise GspoError(f"environment {spec.name}: {e if conv or chat else f'reset() {e}'}") from None
    return _Traj(env, list(ids), [], [], [], chat=conv)


TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


def _chat_tools(env: Env) -> list[dict[str, Any]] | None:
    """The environment's optional ``chat_tools`` (JSON schemas for the template's ``tools=``)."""
    try:
        tools = getattr(env, "chat_tools", None)
    except Exception as e:  # noqa: BLE001 (a user environment's property may raise anything)
        raise GspoError(f"chat_tools raised {type(e).__name__}: {str(e)[:200]}") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(x, dict) for x in tools)):
        raise GspoError(f"chat_tools must be a list of JSON-schema dicts, got {type(tools).__name__}")
    for i, tool in enumerate(tools or []):
        fn = tool.get("function", tool)  # OpenAI's {"type": "function", "function": {...}}, or bare
        name = fn.get("name") if isinstance(fn, dict) else None
        if not (isinstance(name, str) and TOOL_NAME.fullmatch(name)):
            raise GspoError(
                f"chat_tools[{i}]: function name {name!r:.40} is not a name the model can call (letters, "
                "digits, _ . -, starting with a letter or _)"
            )
    return tools


def _chat_observation(s: Step, max_chars: int) -> list[dict[str, Any]]:
    """A step's observation as chat messages (its own, or one ``tool`` message), each cut to
    ``max_chars`` characters."""
    msgs = s.messages or [{"role": "tool", "content": s.observation}]
    return [dict(m, content=m["content"][:max_chars]) for m in msgs]


def _turn(
    t: _Traj, ids: list[int], logp: list[float], n: int, tokenizer: Any, spec: EnvSpec, limits: Limits
) -> list[int] | None:
    """Append one sampled model turn (its first ``n`` tokens) and the environment's answer to it;
    the observation's token ids when the trajectory goes on, else None."""
    text, ended = _turn_start(t, ids, logp, n, tokenizer)
    assert t.env is not None  # live trajectories have one
    return _turn_end(t, _step(spec, t.env, text), text, ended, n, tokenizer, limits)


def _turn_start(t: _Traj, ids: list[int], logp: list[float], n: int, tokenizer: Any) -> tuple[str, bool]:
    """Append a sampled model turn (its first ``n`` tokens): its text for the environment, and
    whether it ended at EOS."""
    ids, eos = ids[:n], tokenizer.eos_token_id
    t.ids += ids
    t.model += [1] * n
    t.logp += logp[:n]
    t.turns += 1
    ended = n > 0 and ids[-1] == eos
    return tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=True), ended


def _step(spec: EnvSpec, env: Env, text: str) -> Step | None:
    """The environment's answer to a turn; None when it failed under ``reward_on_error zero``
    (thread-safe: a pool's workers run it)."""
    try:
        return step(spec, env, text)
    except EnvFailure:
        return None


def _turn_end(
    t: _Traj, s: Step | None, text: str, ended: bool, n: int, tokenizer: Any, limits: Limits
) -> list[int] | None:
    """Append the environment's answer ``s`` to ``t``'s last turn (``n`` tokens, ``text``): the
    observation's token ids when the trajectory goes on, else None."""
    if s is None:
        t.failed, t.reward = True, 0.0
        return None
    t.reward += s.reward
    if s.observation is None:
        t.truncated = not ended  # cut off by the per-turn budget, yet scored (as a single-turn task)
        return None
    room = limits.max_tokens - len(t.ids)
    if not ended or t.turns >= limits.max_turns or room <= 0:
        t.truncated = True
        return None
    # cut the text first: tokenizing a 50 MB observation to keep `room` tokens would hang the step
    if t.chat is None:
        obs = tokenizer(s.observation[: 64 * room + 64], add_special_tokens=False).input_ids[:room]
    else:
        obs = t.chat.observe(text, _chat_observation(s, 64 * room + 64))[:room]
    turn = t.ids[len(t.ids) - n :]
    t.ids += obs
    t.model += [0] * len(obs)
    t.logp += [0.0] * len(obs)
    if len(t.ids) >= limits.max_tokens:  # no room left for a model token
        t.truncated = True
        return None
    t.context = t.context + turn + obs
    return obs


def _to_batch(trajs: list[_Traj], prompt_ids: list[list[int]], pad_id: int, n_bad: int) -> EnvSampleBatch:
    B, T = len(trajs), max([len(t.ids) for t in trajs] + [1])
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    model = torch.zeros((B, T), dtype=torch.long)
    real = torch.zeros((B, T), dtype=torch.long)
    logp = torch.zeros((B, T), dtype=torch.float32)
    for b, t in enumerate(trajs):
        n = len(t.ids)
        ids[b, :n], model[b, :n], real[b, :n] = (
            torch.tensor(t.ids, dtype=torch.long),
            torch.tensor(t.model),
            1,
        )
        logp[b, :n] = torch.tensor(t.logp, dtype=torch.float32)
    return EnvSampleBatch(
        [list(p) for p in prompt_ids],
        ids,
        model,
        logp,
        obs_mask_BT=real - model,
        reward_B=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        truncated_B=torch.tensor([t.truncated for t in trajs], dtype=torch.float32),
        turns_B=torch.tensor([t.turns for t in trajs], dtype=torch.float32),
        n_errors=n_bad,
        failed_B=torch.tensor([t.failed for t in trajs], dtype=torch.float32),
    )


@torch.no_grad()
def env_eval_scores(
    engine: RolloutEngine,
    tokenizer: Any,
    task: Any,
    examples: list[Any],
    prompt_ids: list[list[int]],
    plan: EnvPlan,
) -> dict[str, list[float]]:
    """Greedy held-out trajectories of ``examples`` with the same environment: each one's reward and
    number of turns."""
    spec, lim = spec_of(plan, task), limits_of(plan)
    eb = run_episodes(engine, tokenizer, spec, examples, prompt_ids, lim, 1.0, True, encoder(tokenizer, plan))
    return {"reward": eb.reward_B.tolist(), "turns": eb.turns_B.tolist()}


# ------------------------------------------------------------------------------------------------
# async rollouts (gspo.rollout.async_sampler): trajectories cross a process boundary

ENV_FIELDS = ("obs_mask_BT", "reward_B", "truncated_B", "turns_B", "failed_B")


def env_fields(rb: SampleBatch, rows: slice | None = None) -> dict[str, Any] | None:
    """What a trajectory batch carries beyond a :class:`SampleBatch` (numpy arrays and ``n_errors``),
    to cross a process boundary or go into a checkpoint; None for a single-turn batch. ``rows``:
    those rows alone (a rank's share of the groups), with their own error count."""
    if not isinstance(rb, EnvSampleBatch):
        return None
    sel = slice(None) if rows is None else rows
    out = {f: getattr(rb, f)[sel].numpy() for f in ENV_FIELDS if getattr(rb, f) is not None}
    # a batch read back from a checkpoint without failed_B keeps its whole count (never split)
    return out | {"n_errors": int(out["failed_B"].sum()) if "failed_B" in out else rb.n_errors}


def with_env_fields(rb: SampleBatch, fields: dict[str, Any] | None) -> SampleBatch:
    """``rb`` as an :class:`EnvSampleBatch` again (inverse of :func:`env_fields`)."""
    if fields is None:
        return rb
    # a checkpoint written before failed_B was carried has n_errors alone
    arrays = {f: torch.as_tensor(fields[f]) if f in fields else None for f in ENV_FIELDS}
    out = EnvSampleBatch(
        rb.prompt_ids, rb.response_ids_BT, rb.response_mask_BT, rb.sampler_logp_BT,
        **arrays, n_errors=int(fields["n_errors"]),
    )  # fmt: skip
    return out
