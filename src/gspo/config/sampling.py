"""Config groups: rollouts (batch shape, sampling, engine) and multi-turn environments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from annotated_types import Ge, Gt
from pydantic import with_config

from gspo.config.checks import DOCUMENTED, Group, OneOf, bad
from gspo.config.run import DTYPES
from gspo.plans import ENGINES


@with_config(DOCUMENTED)
@dataclass
class Sampling(Group):
    steps: Annotated[int, Ge(1)] = 200
    """RL steps (one rollout batch each)."""
    prompts_per_step: Annotated[int, Ge(1)] = 32
    """Prompts per rollout batch."""
    group_size: Annotated[int, Ge(1)] = 8
    """Responses sampled per prompt (G)."""
    max_new_tokens: Annotated[int, Ge(1)] = 12
    """Generation limit per response."""
    temperature: Annotated[float, Gt(0)] = 1.0
    """Sampling temperature (also applied to the trainer's log-probs)."""
    top_k: Annotated[int, Ge(0)] = 0
    """Sample from the ``top_k`` most likely tokens only (0: off). The trainer's log-probs are then
    taken over the same truncated support, renormalized (DeepSeek-V3.2's "keep sampling mask"), so
    pi_theta and pi_old are one family of distributions; see ``top_p``."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of most likely tokens holding ``top_p`` of the probability
    (after ``top_k``; 1: off). The trainer rebuilds that support from its own logits with the same rule
    (the sampled token always kept) and renormalizes its log-probs over it."""
    rollout_dtype: Annotated[str | None, OneOf((None, *DTYPES))] = None
    """Weights dtype of the sampler (default: ``dtype``). ``bfloat16`` with a float32 trainer samples
    from a bf16 copy (HF engine) or a bf16 vLLM: the paper's precision mismatch between inference and
    training, whose log-probs ``old_logp=rollout`` then takes as pi_old."""
    rollout_engine: Annotated[str, OneOf(tuple(ENGINES))] = "hf"
    """``hf`` (the training model itself, KV cache) or ``vllm`` (GPU, ``pip install gspo[vllm]``)."""
    vllm_gpu_memory_utilization: Annotated[float, Gt(0)] = 0.3
    """vLLM (GPU): the share of each GPU's memory vLLM may take for its weights and KV cache (its
    ``gpu_memory_utilization``); the trainer keeps the rest. More than is free at start is refused."""
    vllm_tensor_parallel_size: Annotated[int, Ge(1)] = 1
    """vLLM: training ranks one vLLM instance spans (its ``tensor_parallel_size``). Under torchrun every
    rank runs vLLM in its own process (vLLM's ``external_launcher``); groups of this many consecutive
    ranks form one instance and sample their prompts together, so it must divide ``nproc`` and the
    model's attention heads (KV heads: one of the two divides the other). Tested on CPU with 1 and 2."""

    @staticmethod
    def _rules(cfg: Any) -> None:
        if cfg.group_size < 2:
            msg = "must be >= 2: a group of one response always has advantage 0 (nothing to learn)"
            raise bad(cfg, "group_size", msg)
        if not 0 < cfg.top_p <= 1:
            raise bad(cfg, "top_p", "must be in (0, 1] (the share of probability kept; 1: off)")
        if cfg.top_k > 2**31 - 1:
            raise bad(cfg, "top_k", "must be < 2**31 (0: off)")
        if cfg.vllm_gpu_memory_utilization > 1:
            raise bad(cfg, "vllm_gpu_memory_utilization", "must be <= 1 (a share of the GPU's memory)")
        if ENGINES[cfg.rollout_engine].tensor_parallel:
            _check_tensor_parallel(cfg)
        if cfg.prompts_per_step % cfg.nproc:
            raise bad(
                cfg, "prompts_per_step", f"must divide by nproc={cfg.nproc} (each rank samples its share)"
            )


def _check_tensor_parallel(cfg: Any) -> None:
    """``vllm_tensor_parallel_size`` against ``nproc`` and, where gspo can read the model's shape
    without its weights (embedded, a local folder, a model whose numbers it ships), its heads."""
    tp = cfg.vllm_tensor_parallel_size
    if cfg.nproc % tp:
        raise bad(
            cfg, "vllm_tensor_parallel_size", f"must divide nproc={cfg.nproc} (ranks per vLLM instance)"
        )
    if tp == 1:
        return
    if getattr(cfg, "env", None):  # a rank's trajectories end after their own number of turns
        msg = (
            "must be 1 with env (multi-turn): the ranks of one vLLM instance would sample turn by turn apart"
        )
        raise bad(cfg, "vllm_tensor_parallel_size", msg)
    from gspo.capacity import shape_of
    from gspo.errors import GspoError

    try:
        shape = shape_of(cfg.model)
    except GspoError:  # a hub id gspo has no numbers for: checked once the model is loaded
        return
    heads, kv = shape.heads, shape.kv_heads
    if heads % tp:
        raise bad(cfg, "vllm_tensor_parallel_size", f"must divide the model's {heads} attention heads")
    if kv % tp if kv >= tp else tp % kv:
        msg = f"and the model's {kv} KV heads must divide one another (vLLM slices or copies them)"
        raise bad(cfg, "vllm_tensor_parallel_size", msg)


@with_config(DOCUMENTED)
@dataclass
class MultiTurn(Group):
    env: str | None = None
    """Multi-turn environment (None: single-turn rollouts). ``tools`` (calculator and Python in the
    code sandbox, called from the model's turn: ``<calc>12+34</calc>``, ``<python>...</python>``, a
    chat-template ``<tool_call>{json}</tool_call>`` or ``calc(12+34)``; a turn without a call is the
    answer the task's reward scores), ``tools:calc``, ``tools:python``, ``task`` (the task as a
    one-step environment), or ``pkg.mod:Factory`` / ``file.py:Factory`` making an object with
    ``reset(example) -> prompt`` and ``step(model_turn) -> (observation | None, reward)`` (each call
    limited to ``reward_timeout_s``). Environment packages: ``skyrl-gym:NAME``,
    ``openenv:pkg.mod:Class`` (an in-process OpenEnv Environment) and ``verifiers:NAME`` (a
    verifiers taskset and its environment, gspo playing the agent). Turns end at EOS;
    ``max_new_tokens`` is the per-turn budget."""
    max_turns: Annotated[int, Ge(1)] = 4
    """Multi-turn (``env``): model turns per trajectory; a trajectory still going after them is
    truncated (its reward so far; ``overlong_filter`` drops it from the loss)."""
    max_trajectory_tokens: Annotated[int, Ge(1)] = 256
    """Multi-turn (``env``): tokens after the prompt per trajectory, model turns and observations
    together (the overlong penalty counts against it); past it the trajectory is truncated."""
    tool_concurrency: Annotated[int, Ge(0)] = 32
    """Multi-turn (``env``): the environment's steps (tool calls) run in a pool of this many threads
    while the rollout engine decodes the other trajectories, each trajectory going on by itself (HF:
    its kept KV cache; vLLM: each turn a request to its continuously batching engine). Results do not
    depend on it nor on how long a step takes (``tool_tick_steps``). 0: each step runs inside the
    decode loop, one at a time (vLLM: one ``generate`` call per turn; ``env=task`` always, its one
    step the task's reward; with the HF engine, an environment declared ``instant`` too, as the
    calculator ``tools:calc`` with a built-in reward is). With a pool, environments'
    steps run concurrently: what their instances share (a module's state, the task's reward function
    that ``tools`` and ``task`` call at the answer) must be thread-safe."""
    tool_tick_steps: Annotated[int, Ge(1)] = 8
    """Multi-turn with ``tool_concurrency``: every this many decode steps comes a tick; a trajectory
    whose turn ended goes on at the first tick after (its observation fed in one forward), where the
    engine waits for its step if it has not returned; between ticks the engine never waits for a
    tool (steps in which nothing decodes are skipped). Which trajectories share a decode step is then
    a function of the data, not of timing: every token and log-prob is the same whatever order the
    tools finish in. Larger: more decode steps for a slow tool to overlap, more idle steps after a
    fast one (1: every step is a tick)."""

    @staticmethod
    def _rules(cfg: Any) -> None:
        if cfg.env is not None and not cfg.env.strip():
            msg = "must name an environment (tools, tools:calc, task, pkg.mod:Factory) or be None"
            raise bad(cfg, "env", msg)
