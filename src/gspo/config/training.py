"""Config groups: optimization (minibatches, AdamW, the training forward's layout), LoRA,
evaluation / logging / checkpoints, and data-parallel training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from annotated_types import Ge, Gt, Interval
from pydantic import with_config

from gspo.config.checks import DOCUMENTED, Group, OneOf, bad

LAYOUT = ("auto", "on", "off")


@with_config(DOCUMENTED)
@dataclass
class Optimization(Group):
    num_minibatches: Annotated[int, Ge(1)] = 4
    """Optimizer steps per rollout batch (the paper splits each batch into 4)."""
    micro_batch_size: Annotated[int, Ge(0)] = 0
    """Sequences per forward/backward inside a minibatch (0: whole minibatch at once)."""
    lr: Annotated[float, Interval(gt=0, le=1)] = 3e-4
    """AdamW learning rate for RL (at most 1: AdamW moves each weight by about ``lr`` per step, and
    a larger one only diverges)."""
    weight_decay: Annotated[float, Ge(0)] = 0.0
    """AdamW weight decay."""
    adam_beta1: Annotated[float, Interval(ge=0, lt=1)] = 0.9
    """AdamW beta1."""
    adam_beta2: Annotated[float, Interval(ge=0, lt=1)] = 0.99
    """AdamW beta2."""
    max_grad_norm: Annotated[float, Ge(0)] = 1.0
    """Gradient clipping by global norm (0 disables)."""
    warmup_steps: Annotated[int, Ge(0)] = 0
    """Linear learning-rate warmup in optimizer steps."""
    packing: Annotated[str, OneOf(LAYOUT)] = "auto"
    """Training forward layout: ``on`` packs all sequences of a micro-batch into one row (no padding
    compute), ``off`` keeps one row per sequence (or per group, see ``prefix_sharing``), ``auto`` packs
    only with flash attention (dense-mask attention makes packing cost more than the padding it saves)."""
    prefix_sharing: Annotated[str, OneOf(LAYOUT)] = "auto"
    """Training forward layout for rows that share a prompt (a group's G samples): ``on`` computes
    each prompt once and lets its G responses attend to it through a 4D mask (the same log-probs and
    gradients for less compute), ``off`` gives every row its own copy, ``auto`` shares when the model
    takes a 4D mask (sdpa or eager attention, no sliding window) and ``packing`` is off; large
    sequences fall back to separate rows (the shared mask is dense)."""
    logp_chunk_size: Annotated[int, Ge(1)] = 512
    """Positions per LM-head chunk when computing log-probs (memory vs speed)."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input in the training forward and recompute the layer in the
    backward (torch's non-reentrant checkpointing, through transformers' per-layer switch): less
    activation memory for about one more forward (measured in benchmarks/RESULTS.md). Exact, Routing
    Replay included: the recomputed forward is forced to the same experts."""

    @staticmethod
    def _rules(cfg: Any) -> None:
        batch, parts = cfg.prompts_per_step * cfg.group_size, cfg.num_minibatches * cfg.nproc
        if batch % parts:
            raise bad(
                cfg,
                "num_minibatches",
                f"prompts_per_step*group_size = {batch} must divide evenly into num_minibatches x nproc = {parts}",
            )


@with_config(DOCUMENTED)
@dataclass
class LoRA(Group):
    lora_rank: Annotated[int, Ge(0)] = 0
    """LoRA rank via PEFT (0: train all weights). MoE routers are never adapted."""
    lora_alpha: Annotated[float, Gt(0)] = 16.0
    """LoRA scaling alpha."""
    lora_target_modules: str = "all-linear"
    """Modules that get adapters: ``all-linear`` or comma-separated names (e.g. ``q_proj,v_proj``)."""


@with_config(DOCUMENTED)
@dataclass
class Evaluation(Group):
    eval_every: Annotated[int, Ge(0)] = 10
    """Held-out greedy accuracy every N RL steps (0: only at start and end)."""
    eval_size: Annotated[int, Ge(1)] = 200
    """Held-out examples."""
    save_every: Annotated[int, Ge(0)] = 50
    """Checkpoint every N RL steps (always at the end)."""
    report_to: str = "tensorboard"
    """Experiment trackers that get every logged scalar, the resolved config and the curves,
    comma-separated: ``tensorboard`` (in the run folder), ``wandb``, ``trackio``, ``mlflow`` (each the
    ``gspo[...]`` extra of its name), or ``none`` (metrics.jsonl only, which is always written). All
    work offline: docs/guides/tracking.md."""
    wandb: bool = False
    """Also log to Weights & Biases: the same as adding ``wandb`` to ``report_to``."""
    progress: bool = True
    """Show a progress line on stderr."""

    @staticmethod
    def _rules(cfg: Any) -> None:
        # every tracker's package is imported now: a missing one is named before any weight is read
        from gspo.training.trackers import missing_package, tracker_names

        try:
            names = tracker_names(cfg.report_to, cfg.wandb)
        except ValueError as e:
            raise bad(cfg, "report_to", str(e)) from None
        for name in names:
            why = missing_package(name)
            if why:
                by_switch = name == "wandb" and name not in tracker_names(cfg.report_to)
                raise bad(cfg, "wandb" if by_switch else "report_to", why)


@with_config(DOCUMENTED)
@dataclass
class Distributed(Group):
    nproc: Annotated[int, Ge(1)] = 1
    """Processes for data-parallel training (``gspo train --nproc N`` launches torchrun)."""
    parallel: Annotated[str, OneOf(("fsdp", "ddp"))] = "fsdp"
    """Data-parallel wrapper when more than one process: ``fsdp`` (FSDP2) or ``ddp``."""
    mixed_precision: Annotated[str, OneOf(("none", "bf16"))] = "none"
    """``bf16``: FSDP2's mixed precision: parameters gathered and layers run in bfloat16, float32 master
    weights, optimizer state and gradient reduction (log-probs and losses stay float32). Needs FSDP2
    (``nproc`` > 1, ``parallel fsdp``) and ``dtype float32``; one process can use ``dtype bfloat16``."""
    expert_parallel_size: Annotated[int, Ge(1)] = 1
    """``--ep N``: an MoE's routed experts sharded over groups of N ranks (each rank holds
    num_experts / N of them; tokens reach their experts by all-to-all); dense parameters stay
    FSDP2-sharded within each group of N ranks (over every rank when N = nproc) and replicated over
    the groups. 1: no expert parallelism (FSDP2 shards the experts too). docs/scaling.md."""
    dp_replicate_size: Annotated[int, Ge(1)] = 1
    """HSDP: parameters FSDP2-sharded within groups of ``world / N`` ranks and replicated over the N
    groups (gradients reduce-scattered within a group, then all-reduced across groups). Set N to the
    number of nodes so that only the gradient all-reduce crosses nodes. 1: sharded over every rank.
    Under ``expert_parallel_size E`` the dense parameters are replicated over the ``world / E``
    groups of E ranks already, so N is 1 or ``world / E`` there."""

    dist_timeout_min: Annotated[int, Interval(ge=1, le=10080)] = 120
    """Minutes a rank waits in one collective before the job is stopped (``init_process_group``'s
    timeout: NCCL's watchdog, gloo's). 120, not torch's 10: on a cold cache each node's local rank 0
    downloads the weights from the hub while its other ranks wait (the 235B recipe's 470 GB take ~80
    minutes at 100 MB/s), then rank 0 may read them for all. A rank that really hangs is found this
    late: lower it once the weights are cached. Every group over part of the world waits as long:
    HSDP's and expert parallelism's meshes, vLLM's groups under torchrun (its
    ``distributed_timeout_seconds`` and ``cpu_distributed_timeout_seconds``) and gspo's own
    tensor-parallel subgroup, and the async sampler's weight-transfer group (rollout devices)."""

    @staticmethod
    def _rules(cfg: Any) -> None:
        if cfg.mixed_precision != "none":
            if cfg.nproc < 2 or cfg.parallel != "fsdp":
                raise bad(
                    cfg,
                    "mixed_precision",
                    "needs FSDP2: nproc > 1 and parallel fsdp (one process: dtype bfloat16)",
                )
            if cfg.dtype != "float32":
                raise bad(cfg, "mixed_precision", "needs dtype float32 (the master weights it keeps)")
        ep = cfg.expert_parallel_size
        if ep > 1:
            if cfg.parallel != "fsdp":
                raise bad(
                    cfg, "expert_parallel_size", "needs parallel fsdp (DDP keeps every expert on every rank)"
                )
            if cfg.lora_rank:
                raise bad(cfg, "expert_parallel_size", "is not supported with LoRA (lora_rank > 0)")
            if cfg.nproc > 1 and cfg.nproc % ep:
                raise bad(cfg, "expert_parallel_size", f"must divide nproc ({cfg.nproc})")
        reps = cfg.dp_replicate_size
        if reps > 1:
            if cfg.parallel != "fsdp":
                raise bad(cfg, "dp_replicate_size", "needs parallel fsdp (HSDP is FSDP2 over a 2-D mesh)")
            if cfg.nproc > 1 and (cfg.nproc % reps or (ep > 1 and reps != cfg.nproc // ep)):
                want = f"1 or nproc / expert_parallel_size = {cfg.nproc // ep}" if ep > 1 else "a divisor"
                raise bad(cfg, "dp_replicate_size", f"must be {want} of nproc ({cfg.nproc})")
