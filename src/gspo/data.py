"""The data an RL step passes from stage to stage, and the interfaces of its stages: an engine's
sampled responses (:class:`SampleBatch`), a sampler's output (:class:`SamplerOutput`), the scored batch
the update trains on (:class:`TrainBatch`). The ground floor: every layer may import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from itertools import chain
from typing import Any, Protocol

import torch


@dataclass
class SampleBatch:
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
    # async partial rollouts (gspo.rollout.partial): the policy version that drew each token, -1 on
    # padding; None where one version drew the whole batch
    sampler_version_BT: torch.Tensor | None = None

    @property
    def lengths_B(self) -> torch.Tensor:
        return self.response_mask_BT.sum(-1)

    def routing_rows(self) -> dict[str, torch.Tensor] | None:
        """R3: the experts the sampler routed every real token to, per MoE layer, in the trainer's
        ``rows`` layout (``TrainBatch.sampler_routing``); None from an engine that does not say."""
        return None


class RolloutEngine(Protocol):
    """Generates responses for token-id prompts. Engines own nothing else (no rewards, no loss)."""

    def generate(
        self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float, greedy: bool = False
    ) -> SampleBatch: ...

    def sync_weights(self) -> None:
        """Push the trainer's current weights into the engine (no-op when it shares the module)."""
        ...

    def reseed(self, seed: int) -> None:
        """Restart the engine's sampling randomness from ``seed`` (the async sampler seeds each step's
        batch by its step, so a batch depends on its step and policy version only)."""
        ...

    def sleep(self) -> None:
        """Release the engine's accelerator memory for the policy update (vLLM sleep mode on GPU; a
        no-op elsewhere). ``sync_weights`` and ``generate`` wake it."""
        ...

    def close(self) -> None:
        """Release what the engine holds (vLLM: its engine core and parallel groups); idempotent."""
        ...


@dataclass
class SamplerOutput:
    """What a :class:`Sampler` hands the trainer for one RL step."""

    batch: SampleBatch  # G rows per prompt, groups contiguous (trajectories with an environment)
    gen_s: float  # seconds spent generating it (in the sampler, wherever that ran)
    info: dict[str, float]  # the sampler's own metrics (e.g. async staleness and queue wait)


@dataclass
class StepBatch:
    """What a :class:`Sampler` hands the trainer for one RL step: this rank's scored batch."""

    data: TrainBatch  # G rows per prompt, groups contiguous
    metrics: dict[str, float]  # the rollout's metrics (rewards, lengths, the sampler's own)
    data_end: int  # the data position after the step: every prompt drawn for it consumed


class Sampler(Protocol):
    """Each RL step's scored batch, from an engine: G responses per prompt, or G trajectories per
    prompt played in an environment (:mod:`gspo.envs`), their rewards and group advantages. Built by
    :func:`gspo.rollout.factory.make_sampler`.

    ``staleness``: step ``t``'s responses come from the policy after ``max(t - 1 - staleness, 0)``
    updates; 0 is the synchronous loop, which samples from the weights of the last update."""

    staleness: int

    def next_batch(
        self, step: int, data_pos: int, short_anywhere: Callable[[bool], bool] = bool
    ) -> StepBatch:
        """This rank's share of step ``step``'s scored batch, its prompts drawn from ``data_pos`` on
        in the one shuffled order. Dynamic sampling (DAPO) keeps the informative groups, drawing
        more rounds while ``short_anywhere(short)`` (collective: every rank the same number of rounds;
        it may raise to stop the step between rounds)."""
        ...

    def sample(self, step: int, examples: list[Any], prompt_ids: list[list[int]]) -> SamplerOutput: ...

    def sync(self, version: int) -> None:
        """The trainer's weights after ``version`` updates are the ones to sample from next."""
        ...

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint after ``step`` must keep to resume exactly (empty when nothing)."""
        ...

    def close(self) -> None: ...


@dataclass
class TrainBatch:
    """One rollout batch on this rank: ``B = prompts x G`` rows, the G rows of a group contiguous."""

    prompt_ids_BP: torch.Tensor  # [B, P] left-padded prompt tokens
    prompt_mask_BP: torch.Tensor  # [B, P] 1 on real prompt tokens
    response_ids_BT: torch.Tensor  # [B, T] right-padded response tokens (final EOS included)
    response_mask_BT: torch.Tensor  # [B, T] 1 on response tokens
    sampler_logp_BT: torch.Tensor  # [B, T] log pi_sampler of each sampled token (0 on padding)
    adv_B: torch.Tensor  # [B] group-normalized advantage of each response
    reward_B: torch.Tensor | None = None  # [B] the reward each advantage came from
    # R3: experts the sampler routed each real token to, per MoE layer: [B, L, k] with row i's real
    # tokens (prompt, then response) from column 0, as the ``rows`` layout lays them out
    sampler_routing: dict[str, torch.Tensor] | None = None
    # multi-turn trajectories (gspo.envs): [B, T] 1 on observation tokens, which sit between the
    # model's tokens in the response columns; response_mask_BT marks the model's tokens only
    obs_mask_BT: torch.Tensor | None = None

    def rows(self, idx: slice | torch.Tensor) -> TrainBatch:
        """The rows ``idx`` (a slice or an index tensor), trimmed to their own longest prompt/response:
        without the prompt columns that are padding in all of them (left) nor the response columns."""
        d = TrainBatch(*(_take(getattr(self, f.name), idx) for f in fields(self)))
        keep_p, keep_t = d.prompt_mask_BP.any(0).nonzero(), d.real_mask_BT.any(0).nonzero()
        p0 = int(keep_p[0]) if len(keep_p) else d.prompt_mask_BP.shape[1] - 1
        t1 = int(keep_t[-1]) + 1 if len(keep_t) else 1
        # by the name's suffix: [B, P] prompt and [B, T] response columns; the rest as they are
        cols = {"_BP": (slice(None), slice(p0, None)), "_BT": (slice(None), slice(None, t1))}
        return TrainBatch(*(_take(getattr(d, f.name), cols.get(f.name[-3:])) for f in fields(d)))

    @staticmethod
    def cat(parts: list[TrainBatch]) -> TrainBatch:
        """Rows of all ``parts`` in order (prompts left-padded, responses right-padded to one width)."""
        P = max(d.prompt_ids_BP.shape[1] for d in parts)
        T = max(d.response_ids_BT.shape[1] for d in parts)

        def left(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(x, (P - x.shape[1], 0))

        def right(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, T - x.shape[1]))

        rewards = [d.reward_B for d in parts]
        routing = None
        if all(d.sampler_routing is not None for d in parts):
            L = max(v.shape[1] for d in parts for v in d.sampler_routing.values())
            routing = {
                k: torch.cat(
                    [
                        torch.nn.functional.pad(
                            d.sampler_routing[k], (0, 0, 0, L - d.sampler_routing[k].shape[1])
                        )
                        for d in parts
                    ]
                )
                for k in parts[0].sampler_routing
            }
        obs = None
        if any(d.obs_mask_BT is not None for d in parts):
            obs_parts = [
                torch.zeros_like(d.response_mask_BT) if d.obs_mask_BT is None else d.obs_mask_BT
                for d in parts
            ]
            obs = torch.cat([right(o) for o in obs_parts])
        return TrainBatch(
            torch.cat([left(d.prompt_ids_BP) for d in parts]),
            torch.cat([left(d.prompt_mask_BP) for d in parts]),
            torch.cat([right(d.response_ids_BT) for d in parts]),
            torch.cat([right(d.response_mask_BT) for d in parts]),
            torch.cat([right(d.sampler_logp_BT) for d in parts]),
            torch.cat([d.adv_B for d in parts]),
            None if any(r is None for r in rewards) else torch.cat(rewards),
            routing,
            obs,
        )

    @property
    def real_mask_BT(self) -> torch.Tensor:
        """1 on every token after the prompt: the model's and, in trajectories, the observations."""
        if self.obs_mask_BT is None:
            return self.response_mask_BT
        return self.response_mask_BT | self.obs_mask_BT

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(*(_take(getattr(self, f.name), None, device) for f in fields(self)))

    def __len__(self) -> int:
        return self.adv_B.shape[0]


def _take(x, idx: slice | torch.Tensor | None, device: torch.device | str | None = None):  # noqa: ANN001, ANN202
    """Rows ``idx`` of a tensor, or of each tensor of a dict (routing), moved to ``device``."""
    if x is None:
        return None
    if isinstance(x, dict):
        return {k: _take(v, idx, device) for k, v in x.items()}
    x = x if idx is None else x[idx]
    return x if device is None else x.to(device)


def left_pad(
    seqs: list[list[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> ``(ids_BP, mask_BP)`` so every prompt ends at the same column."""
    lens_B = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    P = int(lens_B.max()) if len(seqs) else 0
    mask = torch.arange(P) >= (P - lens_B)[:, None]  # row-major order of the real slots = token order
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    ids[mask] = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)
    return ids.to(device), mask.long().to(device)
