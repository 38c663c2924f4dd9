"""Plans: what each stage of a run does, resolved once from the config (:mod:`gspo.resolve`).

The config stops at the top (``gspo.train(cfg)``, the CLI, ``gspo compare``); below it every stage
takes only its own frozen plan. A plan's fields keep the config's names where they mean the same
thing, so a field's documentation is the config field's (``gspo train --help``).

This module imports nothing of gspo: every layer may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


# ------------------------------------------------------------------------------------------------
# rollout engines: what the plan, the capacity model and the limits know of each, in one place. Adding
# an engine: its entry here, its builder in gspo.rollout.factory, and its module.
@dataclass(frozen=True)
class EngineSpec:
    """What gspo needs to know about a rollout engine besides its code."""

    name: str  # the ``rollout_engine`` value
    build: str  # "module:function" building it (gspo.rollout.factory), imported only when selected
    in_trainer: bool  # samples with the trainer's own module and forward (its numerics, its KV cache)
    gpu_share: bool  # takes ``vllm_gpu_memory_utilization`` of the GPU, its own weights inside
    records_routing: bool  # can return the experts it routed to (R3)
    tensor_parallel: bool  # one instance spans ``vllm_tensor_parallel_size`` ranks

    def copies_weights(self, dtype: str, rollout_dtype: str | None) -> bool:
        """Whether the sampler holds a weight copy of its own (the in-trainer engine only when it
        samples in another precision)."""
        return not self.in_trainer or rollout_dtype not in (None, dtype)

    def trainer_numerics(self, dtype: str, rollout_dtype: str | None) -> bool:
        """Whether its log-probs are the trainer's own numbers (the trainer's forward in float32)."""
        return self.in_trainer and dtype == "float32" and rollout_dtype in (None, "float32")


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec("hf", "gspo.rollout.factory:build_hf", True, False, False, False),
        EngineSpec("vllm", "gspo.rollout.factory:build_vllm", False, True, True, True),
    )
}


def pi_old_source(
    old_logp: str, async_staleness: int, engine: EngineSpec, dtype: str, rollout_dtype: str | None
) -> str:
    """Where the loss's pi_old comes from: ``rollout`` (the sampler's log-probs) or ``recompute`` (the
    trainer's own forward); ``old_logp = auto`` takes the sampler's wherever they are the trainer's
    numerics (the in-trainer engine in float32) or the batch's own policy (async). The one place this
    is decided: the update's plan and the capacity model read it."""
    if old_logp != "auto":
        return old_logp
    if async_staleness:  # sampled from an older version: its log-probs are that policy's
        return "rollout"
    return "rollout" if engine.trainer_numerics(dtype, rollout_dtype) else "recompute"


#: plan field -> the config field it comes from, where the names differ (a plan's other fields keep
#: the config's names): a bad value found on a plan is said in one line naming its config field
CONFIG_FIELDS = {
    "spec": "env",
    "rollout_copy_dtype": "rollout_dtype",
    "engine_spec": "rollout_engine",
    "multi_turn": "env",
    "pi_old": "old_logp",
}


def config_field(plan_field: str) -> str:
    return CONFIG_FIELDS.get(plan_field, plan_field)


@dataclass(frozen=True)
class PromptPlan:
    """How a prompt becomes token ids (:func:`gspo.tasks.prompts.encode_prompts`)."""

    chat_template: bool
    system_prompt: str | None
    max_prompt_tokens: int


@dataclass(frozen=True)
class TaskPlan:
    """Which task, its reward and its splits (:func:`gspo.tasks.task_from_config`; the async sampler's
    process loads it again from this)."""

    task: str
    reward: str
    seed: int
    eval_size: int
    eval_task: str | None
    prompt_field: str
    answer_field: str
    reward_timeout_s: float


@dataclass(frozen=True)
class EnvPlan:
    """Multi-turn episodes in an environment (:mod:`gspo.envs`)."""

    spec: str  # the environment (config field ``env``): ``tools:calc``, ``FILE:Class``, a package's
    max_turns: int
    max_new_tokens: int  # per model turn
    max_trajectory_tokens: int  # all turns of one trajectory, tool output included
    max_prompt_tokens: int
    reward_timeout_s: float
    reward_on_error: str
    prompt: PromptPlan
    tool_concurrency: int = 0  # steps in a pool of threads beside the decoding (0: in the decode loop)
    tool_tick_steps: int = 8  # a pooled step's trajectory goes on at the next tick (every so many steps)


@dataclass(frozen=True)
class EnginePlan:
    """How a rollout engine is built and samples (:func:`gspo.rollout.factory.make_engine`)."""

    rollout_engine: str  # a key of ENGINES
    model: str  # the model's name, for messages
    dtype: str  # the trainer's weights
    rollout_dtype: str | None  # the sampler's (None: the trainer's)
    mixed_precision: str  # "bf16": the trainer computes in bf16 (the start check's precision)
    seed: int
    top_k: int  # 0: off
    top_p: float  # 1.0: off
    max_prompt_tokens: int
    max_new_tokens: int
    max_trajectory_tokens: int
    multi_turn: bool  # an environment plays trajectories: a turn's prompt holds the trajectory so far
    return_routing: bool  # the engine records the experts it routed to (R3)
    vllm_gpu_memory_utilization: float
    vllm_tensor_parallel_size: int
    dist_timeout_min: int = 120  # vLLM's tensor-parallel group waits as long as the world group

    @property
    def spec(self) -> EngineSpec:
        return ENGINES[self.rollout_engine]


@dataclass(frozen=True)
class SamplePlan:
    """Each RL step's responses (:func:`gspo.rollout.factory.make_sampler`)."""

    group_size: int
    max_new_tokens: int
    temperature: float
    async_staleness: int  # 0: sampled when asked; K: a process running up to K updates ahead
    prompts_per_step: int
    seed: int
    dtype: str
    engine: EnginePlan  # the async process builds its own engine from this
    task: TaskPlan  # ... and loads the task from this
    env: EnvPlan | None = None  # multi-turn
    dynamic_sampling: bool = False  # async: the process draws rounds until the batch is informative
    dynamic_sampling_max_rounds: int = 4  # ... at most this many extra rounds
    rollout_devices: tuple[str, ...] = ()  # async: the sampler's device, weights over a process group
    partial_rollout_tokens: int = 0  # async: tokens under version t-1-K, the rest under t-K


@dataclass(frozen=True)
class ScorePlan:
    """Rewards -> group advantages (:mod:`gspo.training.scoring`), and the held-out evaluation."""

    group_size: int
    max_new_tokens: int  # single-turn: the overlong penalty's limit
    max_trajectory_tokens: int  # multi-turn: the overlong penalty's limit
    overlong_buffer: int
    overlong_penalty: float
    overlong_filter: bool
    adv_scale: str
    reward_on_error: str
    env: EnvPlan | None = None  # multi-turn: trajectories scored (and evaluated) by their environment


@dataclass(frozen=True)
class LoadPlan:
    """The model, tokenizer and task a run starts from (:func:`gspo.training.sft.load_start`)."""

    model: str
    tokenizer: str | None
    dtype: str
    seed: int
    keep_dropout: bool
    max_prompt_tokens: int
    max_new_tokens: int
    task: TaskPlan
    prompt: PromptPlan
    env: EnvPlan | None = None


@dataclass(frozen=True)
class SftPlan:
    """The supervised warm start (:func:`gspo.training.sft.warm_start`)."""

    sft_steps: int
    sft_lr: float
    sft_batch_size: int
    seed: int
    logp_chunk_size: int
    task: str  # multi-turn tasks with demonstrations warm-start on them (gspo.envs.sft)
    env: EnvPlan | None = None
    sft_tool_fraction: float = 1.0  # share of those demonstrations that call the tool


@dataclass(frozen=True)
class DistPlan:
    """Devices and data parallelism (:mod:`gspo.training.distributed`)."""

    device: str
    parallel: str  # "ddp" or "fsdp"
    mixed_precision: str  # "none" or "bf16"
    lora: bool
    threads: int
    expert_parallel_size: int = 1  # ranks an MoE's routed experts are split over (1: none)
    dp_replicate_size: int = 1  # HSDP: replicas of the sharded parameters (1: sharded over all ranks)
    dist_timeout_min: int = 120  # the process group's timeout (minutes): see the config field
    reproducible: bool = False  # kernels pinned and one thread (gspo.repro.pin, called by gspo.train)


@dataclass(frozen=True)
class ModelPlan:
    """What is done to the loaded model before it is wrapped: LoRA, activation checkpointing, a copy
    in the sampler's precision (read by gspo.launch; LoRA's settings by gspo.model.lora)."""

    lora_rank: int
    lora_alpha: float
    lora_target_modules: str
    activation_checkpointing: bool
    rollout_copy_dtype: str | None  # the in-trainer sampler samples from a copy in this dtype (None: no copy)
    routing_replay: bool = False  # the model must be an MoE (checked once it is loaded)


@dataclass(frozen=True)
class LayoutPlan:
    """The settings the training forward's layout is chosen from, once the model is loaded
    (:func:`gspo.resolve.choose_layout`)."""

    packing: str
    prefix_sharing: str
    replay_rows: bool  # R3: the routing comes per row


@dataclass(frozen=True)
class CheckpointPlan:
    """The run folder, what its checkpoints and logs record, and whether it resumes
    (:class:`gspo.training.checkpoints.CheckpointManager`)."""

    run_dir: Path
    resume: bool
    overwrite: bool
    config: dict[str, Any]  # the config as recorded in checkpoints and metrics (config.yaml)
    lora: bool  # checkpoints hold the adapters; the frozen base is saved once (lora-base/)
    wandb: bool
    keep: int = 2  # complete checkpoints kept


@dataclass(frozen=True)
class OptimPlan:
    """AdamW and its warm-up (:func:`gspo.training.run.make_optimizer`)."""

    lr: float
    adam_beta1: float
    adam_beta2: float
    weight_decay: float
    warmup_steps: int


@dataclass(frozen=True)
class LoopPlan:
    """The loop around the RL steps (:mod:`gspo.training.loop`)."""

    steps: int
    eval_every: int
    save_every: int
    progress: bool
    num_minibatches: int
    prompts_per_step: int
    group_size: int
    seed: int
    dynamic_sampling: bool
    dynamic_sampling_max_rounds: int
    run_dir: Path
    title: str  # the curves' title: "<algo> on <task> (<model>)"
    algo: str
    save_dtype: str | None = None  # final/'s weights in this dtype (None: as trained; "auto": a hub
    # model's stored dtype, read once its files are local: gspo.model.load.AUTO_DTYPE)
    #: what only watches each step (gspo.training.loop.STEP_OBSERVERS): its phases' times and peak
    #: memory; with a sampler running ahead, how long the trainer waited for it
    observers: tuple[str, ...] = ("timings", "memory")


@dataclass(frozen=True)
class UpdatePlan:
    """What one policy update does (:func:`gspo.resolve.update_plan` builds it from the config and
    :func:`gspo.resolve.for_model` settles it for the loaded model; the fields are its decisions;
    :func:`gspo.training.update.policy_update` runs it, testing no config field)."""

    algo: str  # key of gspo.losses.LOSSES
    aggregation: str | None  # for the losses that take one (None: the loss takes no aggregation)
    num_minibatches: int  # optimizer steps per rollout batch
    micro_batch_size: int  # rows per forward/backward (0: the whole minibatch)
    max_grad_norm: float  # inf: no clipping
    temperature: float
    top_k: int  # the sampler's truncation, applied to the trainer's log-probs too (0 / 1.0: off)
    top_p: float
    logp_chunk_size: int
    layout: str  # rows / packed / shared_prefix (gspo.model.logprobs)
    pi_old: str  # "rollout": the sampler's log-probs; "recompute": the trainer's
    trainer_pi_old: bool  # the trainer's pi_old of minibatches 1.. is computed (loss or correction)
    replay: str | None  # None, "R2" or "R3"
    volatility: str | None  # None, "free" (a training forward shows it) or "forward" (an extra one)
    volatility_minibatch: int | None  # which minibatch volatility is measured on
    correction: str  # "none" or a key of gspo.correction's registry
    mismatch_low: float
    mismatch_high: float
    mismatch_cap: float
    #: the logits are exactly hidden @ W^T (gspo.model.logprobs.lm_head_is_plain, probed once for the
    #: loaded model); None: the trainer's forward asks the probe's cache itself
    plain_head: bool | None = None
    opsm_threshold: float | None = None  # off-policy sequence masking (gspo.correction.with_opsm)
    random_seq_drop: float = 0.0  # share of sequences dropped at random (gspo.correction.with_random_drop)
    #: every keyword of the loss's function, resolved once (gspo.losses.LossSpec.resolve): its own
    #: parameters (the config's over the papers' defaults: a clip range, SAPO's temperatures, VESPO's
    #: kernel) and, for a loss that takes one, the aggregation
    loss_kwargs: tuple[tuple[str, float | str], ...] = ()

    # the decisions the update tests, derived from the fields above once, when the plan is built
    # (dataclasses.replace rebuilds them): read as plain attributes in every step
    #: the loss divides by the minibatch's tokens (DAPO's token_mean), else by its sequences
    token_normalizer: bool = field(init=False)
    #: the loss's pi_old is the sampler's log-probs, else the trainer's own
    sampler_pi_old: bool = field(init=False)
    #: R3: the sampler's experts forced in every forward of the rows
    replays_sampler: bool = field(init=False)
    #: R2: pi_old's experts forced in the training forwards of minibatches 1..
    replays_pi_old: bool = field(init=False)
    #: volatility read off its minibatch's training forwards (no extra forward)
    volatility_free: bool = field(init=False)
    #: volatility costs one no-grad forward of its minibatch after the first optimizer step
    volatility_forward: bool = field(init=False)
    #: per minibatch: it needs pi_old's own choice of experts (R2 forces it in 1..; volatility compares)
    own_routing: tuple[bool, ...] = field(init=False)
    #: what changes the loss's weight or mask, in this order (gspo.training.update.ADJUSTMENTS): the
    #: mismatch correction, OPSM, the random drop; none by default
    adjustments: tuple[str, ...] = field(init=False)
    #: what only watches the update (gspo.training.update.OBSERVERS): the routing's volatility (an
    #: MoE's, on by default), the train/rollout mismatch where no correction reports it
    observers: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        r2 = self.replay == "R2"
        derived = dict(
            token_normalizer=self.aggregation == "token_mean",
            sampler_pi_old=self.pi_old == "rollout",
            replays_sampler=self.replay == "R3",
            replays_pi_old=r2,
            volatility_free=self.volatility == "free",
            volatility_forward=self.volatility == "forward",
            own_routing=tuple(
                i == self.volatility_minibatch or (r2 and i > 0) for i in range(self.num_minibatches)
            ),
            adjustments=_chosen(
                correction=self.correction != "none",
                opsm=self.opsm_threshold is not None,
                random_drop=bool(self.random_seq_drop),
            ),
            observers=_chosen(volatility=self.volatility is not None, mismatch=self.correction == "none"),
        )
        for k, v in derived.items():
            object.__setattr__(self, k, v)  # frozen: set once, here


def _chosen(**on: bool) -> tuple[str, ...]:
    return tuple(name for name, chosen in on.items() if chosen)


@dataclass(frozen=True)
class CapacityPlan:
    """What the capacity model and the limits (:mod:`gspo.capacity`, :mod:`gspo.capacity_comm`,
    :mod:`gspo.limits`) read: the run's sizes and layout, copied by name from its plan's typed
    sections once (:func:`gspo.resolve.capacity_plan`), under the config's names where they are the
    config's values, with the engine's facts and the update's decisions resolved."""

    model: str
    task: str
    multi_turn: bool  # an environment plays trajectories (``max_trajectory_tokens`` after the prompt)
    device: str
    nproc: int
    prompts_per_step: int
    group_size: int
    eval_size: int
    sft_steps: int
    sft_batch_size: int
    micro_batch_size: int
    num_minibatches: int
    max_new_tokens: int
    max_prompt_tokens: int
    max_trajectory_tokens: int
    logp_chunk_size: int
    lora_rank: int
    async_staleness: int
    dtype: str
    rollout_dtype: str | None
    rollout_devices: tuple[str, ...]  # async: the sampler's own device (empty: shared memory)
    mixed_precision: str
    parallel: str
    expert_parallel_size: int
    activation_checkpointing: bool
    packing: str
    prefix_sharing: str
    vllm_gpu_memory_utilization: float
    vllm_tensor_parallel_size: int
    engine_spec: EngineSpec
    pi_old: str  # "rollout" or "recompute" (pi_old_source)
    trainer_pi_old: bool  # the trainer's pi_old of minibatches 1.. is computed (UpdatePlan's)
    replay: str | None  # None, "R2" or "R3" (UpdatePlan's, for an MoE)
    volatility: bool  # the routing's volatility is measured (for an MoE)


@dataclass(frozen=True)
class RunPlan:
    """A whole run, resolved once from the config (:func:`gspo.resolve.resolve`): each section is
    handed whole to the stage that uses it."""

    dist: DistPlan
    load: LoadPlan
    sft: SftPlan
    model: ModelPlan
    optim: OptimPlan
    sampling: SamplePlan
    scoring: ScorePlan
    update: UpdatePlan  # its layout, routing replay and volatility settled once the model is loaded
    layout: LayoutPlan
    loop: LoopPlan
    checkpoints: CheckpointPlan
    capacity: CapacityPlan
