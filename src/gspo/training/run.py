"""A training run, split by job: what a checkpoint holds (:class:`RunState`), the trainer
(:class:`Trainer`), the sampler (:class:`SamplerSide`) and the checkpoints
(:class:`gspo.training.checkpoints.CheckpointManager`, which also holds the run folder's lock);
:class:`Run` holds one of each. :func:`gspo.launch.open_run` builds it, fresh or resumed, from the config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from gspo.data import RolloutEngine, Sampler, TrainBatch
from gspo.model.unwrap import unwrap
from gspo.plans import OptimPlan, ScorePlan, UpdatePlan
from gspo.tasks import Task
from gspo.training import distributed as dist_utils
from gspo.training.logger import MetricsLogger
from gspo.training.scoring import eval_metrics, eval_scores
from gspo.training.update import policy_update


@dataclass
class RunState:
    """Where the run is, besides its weights and optimizer: what a checkpoint holds to resume exactly."""

    sample_gen: torch.Generator  # this rank's sampling randomness
    step: int = 0  # last finished RL step
    data_pos: int = 0  # prompts consumed (epoch-wise shuffled order)
    last_saved: int = -1
    initial: dict[str, Any] = field(default_factory=dict)  # held-out metrics before RL


@dataclass
class Trainer:
    """The trainer side: the policy's forward, its optimizer and what every update does."""

    policy: nn.Module  # PolicyLogprobs, DDP/FSDP-wrapped when distributed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    plan: UpdatePlan
    is_moe: bool

    @property
    def hf(self) -> nn.Module:
        """The Hugging Face model being trained (its PEFT wrapper with LoRA)."""
        return unwrap(self.policy, "model")

    def update(self, data: TrainBatch, world_size: int) -> dict[str, float]:
        """The step's optimizer steps over ``data`` (this rank's rows); returns their metrics."""
        return policy_update(self.policy, self.optimizer, self.scheduler, data, self.plan, world_size)


@dataclass
class SamplerSide:
    """The sampler side: the engine (the RL step's responses through ``sampler``, and the eval's),
    the module it samples from (the trainer's own, or a synced copy)."""

    engine: RolloutEngine
    module: nn.Module
    sampler: Sampler  # each RL step's responses (synchronous, or a process running ahead)
    gathers: bool  # an HF engine sampling the trainer's own FSDP2-sharded module: its weights are gathered
    tp: int  # ranks one engine spans (vLLM tensor parallelism; 1 otherwise)

    def sampling(self, policy: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Hold this around the engine's use (every rank)."""
        return dist_utils.gathered(policy) if self.gathers else contextlib.nullcontext()

    def close(self) -> None:
        try:
            self.sampler.close()
        finally:
            self.engine.close()


class Checkpoints(Protocol):
    """What the run asks of its checkpoints (:class:`gspo.training.checkpoints.CheckpointManager`,
    which imports this module for the run it saves)."""

    saving: bool  # writing a checkpoint (a stop lets it finish)

    def save(self, run: Run) -> None: ...
    def write_final(self, run: Run, save_dtype: str | None) -> Path | None: ...
    def release(self) -> None: ...


@dataclass
class Run:
    dctx: dist_utils.DistContext
    state: RunState
    trainer: Trainer
    sampler: SamplerSide
    checkpoints: Checkpoints  # saves, restores and prunes checkpoints, writes final/; the folder's lock
    tokenizer: Any
    task: Task
    train_ids: list[list[int]]  # token ids of every training prompt
    eval_ids: list[list[int]]  # ... and of every held-out prompt
    score: ScorePlan  # rewards -> advantages, and the held-out evaluation
    logger: MetricsLogger | None = None  # rank 0 only
    updating: bool = False  # inside the policy update of a step (weights may have changed)
    should_stop: Callable[[], bool] = lambda: False  # a Ctrl-C / SIGTERM came (long phases poll it)

    @property
    def rank(self) -> int:
        return self.dctx.rank

    @property
    def world(self) -> int:
        return self.dctx.world_size

    def evaluate(self) -> dict[str, float]:
        """Held-out greedy accuracy, the prompts split over the engines (every rank calls it; rank 0
        returns the metrics of all of them, as one process would score them; the others nothing)."""
        tp = self.sampler.tp  # ranks one engine spans (vLLM's tensor parallelism): they run its requests
        engines, mine = self.world // tp, self.rank // tp
        n = len(self.eval_ids)
        rows = slice(mine * n // engines, (mine + 1) * n // engines)
        scores = None
        if self.sampler.sampler.staleness:  # the sampler runs elsewhere: nothing synced this engine
            self.sampler.engine.sync_weights()
        with self.sampler.sampling(self.trainer.policy):  # (collective: every rank, prompts or not)
            if rows.stop > rows.start:
                ids, examples = self.eval_ids[rows], self.task.eval[rows]
                scores = eval_scores(
                    self.sampler.engine, self.tokenizer, self.task, examples, ids, self.score
                )
        parts = dist_utils.gather_objects(scores if self.rank % tp == 0 else None, self.dctx)
        if self.rank != 0:
            return {}
        parts = [p for p in parts if p is not None]  # one per engine, in the order of the prompts
        return eval_metrics({k: [v for p in parts for v in p[k]] for k in parts[0]})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)

    def close(self) -> None:
        """End the sampler process (if any) and release the run folder."""
        try:
            self.sampler.close()
        finally:
            self.checkpoints.release()


def make_optimizer(
    model: nn.Module, plan: OptimPlan
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters and a linear-warmup LR schedule."""
    # fused AdamW at every world size: one kernel for all parameters instead of a Python loop (5% of a
    # tiny-model step); FSDP2's sharded parameters (DTensors) take it as plain tensors do
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=plan.lr,
        betas=(plan.adam_beta1, plan.adam_beta2),
        weight_decay=plan.weight_decay,
        fused=True,
    )
    warm = max(plan.warmup_steps, 1)  # lr x (s + 1) / warm over the first warm steps, then lr
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1 / warm, 1.0, total_iters=warm - 1)
    return optimizer, scheduler
