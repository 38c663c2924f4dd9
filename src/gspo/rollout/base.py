"""The rollout interface every engine implements (HF on CPU/GPU, vLLM on GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class RolloutBatch:
    """Sampled responses, right-padded. Row ``i`` answers ``prompt_ids[i]``.

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
