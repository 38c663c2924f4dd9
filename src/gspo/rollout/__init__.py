"""Rollout engines: turn prompt token ids into sampled responses with the sampler's log-probs."""

from gspo.data import RolloutEngine, SampleBatch

__all__ = ["SampleBatch", "RolloutEngine"]
