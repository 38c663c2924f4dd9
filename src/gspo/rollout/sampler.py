"""The synchronous sampler: each RL step's responses from the engine's current weights."""

from __future__ import annotations

import time
from typing import Any

from gspo.data import RolloutEngine, SamplerOutput


class SyncSampler:
    """G responses per prompt from ``engine`` (or G trajectories per prompt played in the configured
    environment, :mod:`gspo.envs`), sampled when asked: staleness 0."""

    staleness = 0

    def __init__(self, engine: RolloutEngine, tokenizer: Any, task: Any, cfg: Any) -> None:
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.env = None
        if cfg.env:  # resolved now: a bad environment spec fails before any sampling
            from gspo.envs.rollout import encoder, limits_of, spec_of

            self.env = (spec_of(cfg, task), limits_of(cfg), encoder(tokenizer, cfg))

    def sample(self, step: int, examples: list[Any], prompt_ids: list[list[int]]) -> SamplerOutput:
        G, cfg = self.cfg.group_size, self.cfg
        rep = [p for p in prompt_ids for _ in range(G)]
        t0 = time.time()
        if self.env is None:
            rb = self.engine.generate(rep, cfg.max_new_tokens, cfg.temperature)
        else:
            from gspo.envs.rollout import run_episodes

            spec, limits, encode = self.env
            examples_rep = [e for e in examples for _ in range(G)]
            rb = run_episodes(
                self.engine, self.tokenizer, spec, examples_rep, rep, limits, cfg.temperature, encode=encode
            )
        return SamplerOutput(rb, time.time() - t0, {})

    def sync(self, version: int) -> None:
        self.engine.sync_weights()

    def state(self, step: int) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass
