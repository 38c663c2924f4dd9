"""The synchronous sampler: each RL step's scored batch, sampled from the engine's current weights;
and dynamic sampling's group filter, which the async sampler's process uses too."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from gspo.data import RolloutEngine, SamplerOutput, StepBatch, TrainBatch
from gspo.plans import SamplePlan
from gspo.tasks.prompts import prompt_order

Group = TypeVar("Group")


class GroupFilter(Generic[Group]):
    """Dynamic sampling (DAPO): a group whose rewards are all equal carries no gradient. Rounds of
    groups are added until ``want`` are informative or ``max_rounds`` extra rounds were drawn; the
    batch is the informative groups, filled with dropped ones (zero advantage) when still short."""

    def __init__(self, want: int, G: int, max_rounds: int) -> None:
        self.want, self.G, self.max_rounds = want, G, max_rounds
        self.kept: list[Group] = []
        self.dropped: list[Group] = []
        self.rounds = self.n_dropped = 0

    def add(self, reward_B: Any, groups: list[Group]) -> None:
        """One round: ``groups[g]`` has the rewards ``reward_B[g*G : (g+1)*G]``."""
        informative_N = reward_B.view(-1, self.G).std(1, correction=0) > 0
        for group, ok in zip(groups, informative_N.tolist(), strict=True):
            (self.kept if ok else self.dropped).append(group)
        self.n_dropped += int((~informative_N).sum())
        self.rounds += 1

    @property
    def short(self) -> bool:
        return len(self.kept) < self.want

    def done(self, short_anywhere: Callable[[bool], bool] = bool) -> bool:
        """No round more: the rounds ran out (the same count on every rank, so every rank consumes
        the same prompts and resume stays exact) or no rank is short (``short_anywhere``: collective;
        it may also stop the step)."""
        return self.rounds > self.max_rounds or not short_anywhere(self.short)

    def chosen(self) -> list[Group]:
        return (self.kept + self.dropped)[: self.want]

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/filtered_groups": float(self.n_dropped),
            "rollout/filled_groups": float(max(0, self.want - len(self.kept))),
            "rollout/sampling_rounds": float(self.rounds),
        }


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def share(plan: SamplePlan, n_train: int, data_pos: int, rank: int, world: int) -> list[int]:
    """This rank's share of the ``prompts_per_step`` training prompts from ``data_pos`` on, in the
    one epoch-wise shuffled order."""
    local = plan.prompts_per_step // world
    return prompt_order(n_train, data_pos, plan.prompts_per_step, plan.seed)[
        rank * local : (rank + 1) * local
    ]


class SyncSampler:
    """G responses per prompt from ``engine`` (or G trajectories per prompt played in the planned
    environment, :mod:`gspo.envs`), sampled when asked: staleness 0. ``score``: rewards -> group
    advantages (the trainer's :func:`gspo.training.scoring.score_rollout` with its plan);
    ``train_ids``: the token ids of every training prompt of ``task``."""

    staleness = 0

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        task: Any,
        plan: SamplePlan,
        score: Callable[..., Any] | None = None,
        train_ids: list[list[int]] | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.task, self.plan = engine, tokenizer, task, plan
        self.score, self.train_ids = score, train_ids
        self.rank, self.world = rank_world()  # this rank's share of each step's prompts
        self.env = None
        if plan.env is not None:  # resolved now: a bad environment spec fails before any sampling
            from gspo.envs.episodes import encoder, limits_of, spec_of

            self.env = (spec_of(plan.env, task), limits_of(plan.env), encoder(tokenizer, plan.env))

    def next_batch(
        self, step: int, data_pos: int, short_anywhere: Callable[[bool], bool] = bool
    ) -> StepBatch:
        """This rank's share of step ``step``'s prompts from ``data_pos`` on, G responses each, their
        rewards and group advantages. Dynamic sampling draws more rounds of prompts while a rank is
        short of informative groups (``short_anywhere``; it may stop the step between rounds)."""
        assert self.score is not None and self.train_ids is not None, "a trainer's sampler scores"
        data, metrics = self._one(step, data_pos)
        if self.plan.dynamic_sampling:
            return self._more_rounds(step, data_pos, data, metrics, short_anywhere)
        return StepBatch(data, metrics, data_pos + self.plan.prompts_per_step)

    def _one(self, step: int, pos: int) -> tuple[TrainBatch, dict[str, float]]:
        """This rank's share of the prompts from ``pos`` on, sampled and scored (:meth:`next_batch`)."""
        idx = share(self.plan, len(self.train_ids), pos, self.rank, self.world)
        examples = [self.task.train[i] for i in idx]
        s = self.sample(step, examples, [self.train_ids[i] for i in idx])
        data, metrics = self.score(s.batch, self.tokenizer, self.task, examples, t_gen=s.gen_s)
        return data, metrics | s.info

    def _more_rounds(
        self,
        step: int,
        data_pos: int,
        data: TrainBatch,
        metrics: dict[str, float],
        short_anywhere: Callable[[bool], bool],
    ) -> StepBatch:
        """Dynamic sampling: rounds of the next prompts after the first (``data``) until no rank is
        short of informative groups or the rounds run out."""
        P, G = self.plan.prompts_per_step, self.plan.group_size
        pos = data_pos + P
        groups: GroupFilter[TrainBatch] = GroupFilter(
            len(data) // G, G, self.plan.dynamic_sampling_max_rounds
        )
        while True:
            groups.add(data.reward_B, [data.rows(slice(g * G, (g + 1) * G)) for g in range(len(data) // G)])
            if groups.done(short_anywhere):
                break
            data, more = self._one(step, pos)
            pos += P
            metrics["time/generate_s"] += more["time/generate_s"]
        return StepBatch(TrainBatch.cat(groups.chosen()), metrics | groups.metrics(), pos)

    def sample(self, step: int, examples: list[Any], prompt_ids: list[list[int]]) -> SamplerOutput:
        G, plan = self.plan.group_size, self.plan
        rep = [p for p in prompt_ids for _ in range(G)]
        t0 = time.time()
        if self.env is None:
            rb = self.engine.generate(rep, plan.max_new_tokens, plan.temperature)
        else:
            from gspo.envs.episodes import run_episodes

            spec, limits, encode = self.env
            examples_rep = [e for e in examples for _ in range(G)]
            rb = run_episodes(
                self.engine, self.tokenizer, spec, examples_rep, rep, limits, plan.temperature, encode=encode
            )
        return SamplerOutput(rb, time.time() - t0, {})

    def sync(self, version: int) -> None:
        self.engine.sync_weights()

    def state(self, step: int) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass
