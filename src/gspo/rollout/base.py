"""The rollout interface every engine implements (HF on CPU/GPU, vLLM on GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class RolloutBatch:
    """Sampled responses, right-padded, as CPU tensors. Row ``i`` answers ``prompt_ids[i]``.

    ``response_mask_BT`` is 1 on generated tokens including the final EOS, 0 after it.
    ``sampler_logp_BT`` is log pi_sampler(y_t) of the distribution the token was drawn from
    (temperature applied), 0 on padding. Multi-turn trajectories (:mod:`gspo.envs`) extend it: there
    the response columns also hold observation tokens, which ``response_mask_BT`` leaves out.
    """

    prompt_ids: list[list[int]]
    response_ids_BT: torch.Tensor
    response_mask_BT: torch.Tensor
    sampler_logp_BT: torch.Tensor

    @property
    def lengths_B(self) -> torch.Tensor:
        return self.response_mask_BT.sum(-1)

    def routing_rows(self) -> dict[str, torch.Tensor] | None:
        """R3: the experts the sampler routed every real token to, per MoE layer, in the trainer's
        ``rows`` layout (``RolloutData.sampler_routing``); None from an engine that does not say."""
        return None


class RolloutEngine(Protocol):
    """Generates responses for token-id prompts. Engines own nothing else (no rewards, no loss)."""

    def generate(
        self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float, greedy: bool = False
    ) -> RolloutBatch: ...

    def sync_weights(self) -> None:
        """Push the trainer's current weights into the engine (no-op when it shares the module)."""
        ...

    def sleep(self) -> None:
        """Release the engine's accelerator memory for the policy update (vLLM sleep mode on GPU; a
        no-op elsewhere). ``sync_weights`` and ``generate`` wake it."""
        ...

    def close(self) -> None:
        """Release what the engine holds (vLLM: its engine core and parallel groups); idempotent."""
        ...


@dataclass
class Sampled:
    """What a :class:`Sampler` hands the trainer for one RL step."""

    batch: RolloutBatch  # G rows per prompt, groups contiguous (trajectories with an environment)
    gen_s: float  # seconds spent generating it (in the sampler, wherever that ran)
    info: dict[str, float]  # the sampler's own metrics (e.g. async staleness and queue wait)


class Sampler(Protocol):
    """The responses of each RL step, from an engine: G per prompt, or G trajectories per prompt
    played in an environment (:mod:`gspo.envs`). Built by :func:`gspo.rollout.factory.make_sampler`.

    ``staleness``: step ``t``'s responses come from the policy after ``max(t - 1 - staleness, 0)``
    updates; 0 is the synchronous loop, which samples from the weights of the last update."""

    staleness: int

    def sample(self, step: int, examples: list[Any], prompt_ids: list[list[int]]) -> Sampled: ...

    def sync(self, version: int) -> None:
        """The trainer's weights after ``version`` updates are the ones to sample from next."""
        ...

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint after ``step`` must keep to resume exactly (empty when nothing)."""
        ...

    def close(self) -> None: ...
