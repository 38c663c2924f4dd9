"""A training run's parts, one job each: where the run is (:class:`RunState`), the trainer
(:class:`Trainer`) and the rollout side (:class:`Rollout`, which also runs the held-out evaluation).
Each keeps its own piece of a checkpoint (``state_dict`` / ``load_state_dict``, the protocol
:class:`gspo.training.checkpoints.Stateful`), so the checkpoint manager saves and restores them
without knowing what they are. :func:`gspo.launch.open_run` builds them, fresh or resumed, and
:class:`gspo.training.loop.Loop` holds them side by side with the checkpoint manager.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gspo.data import RolloutEngine, Sampler, TrainBatch
from gspo.model.unwrap import unwrap
from gspo.plans import OptimPlan, ScorePlan, UpdatePlan
from gspo.tasks import Task
from gspo.training import checkpoint_files as files
from gspo.training import distributed as dist_utils
from gspo.training.scoring import eval_metrics, eval_scores
from gspo.training.update import policy_update


@dataclass
class RunState:
    """Where the run is, besides its weights and optimizer: what a checkpoint holds to resume exactly."""

    dctx: dist_utils.DistContext
    sample_gen: torch.Generator  # this rank's sampling randomness
    step: int = 0  # last finished RL step
    data_pos: int = 0  # prompts consumed (epoch-wise shuffled order)
    initial: dict[str, Any] = field(default_factory=dict)  # held-out metrics before RL

    def state_dict(self) -> dict[str, Any]:
        """Collective: every rank's sampling generator, and each rank's global generators (rewards
        draw from them) taken last, after the checkpoint's other collectives, which may draw."""
        gens = dist_utils.gather_objects(self.sample_gen.get_state(), self.dctx)
        rngs = dist_utils.gather_objects(files.rng_state(), self.dctx)
        return {
            "step": self.step, "data_pos": self.data_pos, "sample_gen": gens, "rng": rngs[0],
            "rng_ranks": rngs, "initial": self.initial,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The run's position, this rank's generators (a rank the saved run did not have keeps its
        fresh seed) and, last, the global ones."""
        rank = self.dctx.rank
        self.step, self.data_pos = state["step"], state["data_pos"]
        self.initial = state.get("initial") or {}
        gens = state["sample_gen"]
        if rank < len(gens):
            self.sample_gen.set_state(gens[rank])
        rngs = state.get("rng_ranks") or [state["rng"]]
        files.set_rng_state(rngs[rank] if rank < len(rngs) else state["rng"])


@dataclass
class Trainer:
    """The trainer side: the policy's forward, its optimizer and what every update does. The
    checkpoint manager saves the policy's weights and the optimizer (their files depend on how they
    are sharded); the trainer's own piece of a checkpoint is its learning-rate schedule."""

    policy: nn.Module  # PolicyLogprobs, DDP/FSDP-wrapped when distributed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    plan: UpdatePlan
    is_moe: bool
    world_size: int = 1
    updating: bool = False  # inside the policy update of a step (weights may have changed)

    @property
    def model(self) -> nn.Module:
        """The Hugging Face model being trained (its PEFT wrapper with LoRA)."""
        return unwrap(self.policy, "model")

    def update(self, data: TrainBatch) -> dict[str, float]:
        """The step's optimizer steps over ``data`` (this rank's rows); returns their metrics."""
        return policy_update(self.policy, self.optimizer, self.scheduler, data, self.plan, self.world_size)

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])


@dataclass(frozen=True)
class HeldOut:
    """The held-out set the rollout side evaluates on, and how its responses are scored."""

    task: Task
    tokenizer: Any
    prompt_ids: list[list[int]]  # token ids of every held-out prompt
    plan: ScorePlan


@dataclass
class Rollout:
    """The rollout side: the engine (each RL step's responses through ``sampler``, and the held-out
    evaluation's), the module it samples from (the trainer's own, or a synced copy)."""

    engine: RolloutEngine
    module: nn.Module
    sampler: Sampler  # each RL step's responses (synchronous, or a process running ahead)
    gathers: bool  # an HF engine sampling the trainer's own FSDP2-sharded module: its weights are gathered
    tp: int  # ranks one engine spans (vLLM tensor parallelism; 1 otherwise)
    dctx: dist_utils.DistContext
    version: int = 0  # updates whose weights the sampler has taken

    def sampling(self, policy: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Hold this around the engine's use (every rank)."""
        return dist_utils.gathered(policy) if self.gathers else contextlib.nullcontext()

    def sync(self, version: int) -> None:
        """The trainer's weights after ``version`` updates are the ones to sample from next."""
        self.sampler.sync(version)
        self.version = version

    def evaluate(self, policy: nn.Module, held_out: HeldOut) -> dict[str, float]:
        """Held-out greedy accuracy, the prompts split over the engines (every rank calls it; rank 0
        returns the metrics of all of them, as one process would score them; the others nothing)."""
        rank, world, tp = self.dctx.rank, self.dctx.world_size, self.tp  # tp ranks run one engine's requests
        engines, mine = world // tp, rank // tp
        n = len(held_out.prompt_ids)
        rows = slice(mine * n // engines, (mine + 1) * n // engines)
        scores = None
        if self.sampler.staleness:  # the sampler runs elsewhere: nothing synced this engine
            self.engine.sync_weights()
        with self.sampling(policy):  # (collective: every rank, prompts or not)
            if rows.stop > rows.start:
                ids, examples = held_out.prompt_ids[rows], held_out.task.eval[rows]
                scores = eval_scores(
                    self.engine, held_out.tokenizer, held_out.task, examples, ids, held_out.plan
                )
        parts = dist_utils.gather_objects(scores if rank % tp == 0 else None, self.dctx)
        if rank != 0:
            return {}
        parts = [p for p in parts if p is not None]  # one per engine, in the order of the prompts
        return eval_metrics({k: [v for p in parts for v in p[k]] for k in parts[0]})

    def state_dict(self) -> dict[str, Any]:
        """Rank 0: what the sampler must keep to resume exactly (e.g. batches sampled ahead, from
        versions no checkpoint holds)."""
        return self.sampler.state(self.version) if self.dctx.rank == 0 else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing here: the sampler takes a checkpoint's batches in flight when it is built
        (:func:`gspo.rollout.factory.make_sampler`), before its process starts drawing."""

    def close(self) -> None:
        try:
            self.sampler.close()
        finally:
            self.engine.close()


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
