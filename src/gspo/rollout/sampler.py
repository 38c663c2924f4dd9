"""The synchronous sampler: each RL step's responses from the engine's current weights."""

from __future__ import annotations

import time
from typing import Any

from gspo.data import RolloutEngine, SamplerOutput
from gspo.plans import SamplePlan


class SyncSampler:
    """G responses per prompt from ``engine`` (or G trajectories per prompt played in the planned
    environment, :mod:`gspo.envs`), sampled when asked: staleness 0."""

    staleness = 0

    def __init__(self, engine: RolloutEngine, tokenizer: Any, task: Any, plan: SamplePlan) -> None:
        self.engine, self.tokenizer, self.plan = engine, tokenizer, plan
        self.env = None
        if plan.env is not None:  # resolved now: a bad environment spec fails before any sampling
            from gspo.envs.rollout import encoder, limits_of, spec_of

            self.env = (spec_of(plan.env, task), limits_of(plan.env), encoder(tokenizer, plan.env))

    def sample(self, step: int, examples: list[Any], prompt_ids: list[list[int]]) -> SamplerOutput:
        G, plan = self.plan.group_size, self.plan
        rep = [p for p in prompt_ids for _ in range(G)]
        t0 = time.time()
        if self.env is None:
            rb = self.engine.generate(rep, plan.max_new_tokens, plan.temperature)
        else:
            from gspo.envs.rollout import run_episodes

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
