"""Rollout engines: turn prompt token ids into sampled responses with the sampler's log-probs."""

from gspo.rollout.base import RolloutBatch, RolloutEngine

__all__ = ["RolloutBatch", "RolloutEngine"]
