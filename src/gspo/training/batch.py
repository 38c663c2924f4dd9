"""What flows through an RL step: a rollout batch, and the micro-batches the update cuts it into."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gspo.data import TrainBatch
from gspo.model.logprobs import Layout, make_layout
from gspo.model.routing import Routing


@dataclass(frozen=True)
class MicroBatch:
    """The rows of one forward/backward and everything the loss needs for them, frozen once
    ``update.record_pi_old`` has recorded the trainer's pi_old (before any optimizer step)."""

    data: TrainBatch
    layout: Layout  # model inputs, built once for every forward of these rows
    old_logp_BT: torch.Tensor | None = None  # trainer's pi_old log-probs [B, T] (None: not recorded)
    old_routing: Routing | None = None  # pi_old's experts per MoE layer (R2 replay, volatility)
    replay: Routing | None = None  # experts forced in the training forward (None: the router chooses)
    on_policy: bool = False  # no update yet (minibatch 0): its own first training forward is pi_old

    @property
    def mask_BT(self) -> torch.Tensor:
        return self.data.response_mask_BT

    @property
    def n_tokens(self) -> torch.Tensor:
        return self.mask_BT.sum()

    @property
    def n_sequences(self) -> torch.Tensor:
        return (self.mask_BT.sum(-1) > 0).sum()


def split_minibatches(
    data: TrainBatch, n_minibatches: int, micro_size: int, layout: str, mask_dtype: torch.dtype
) -> list[list[MicroBatch]]:
    """``n_minibatches`` contiguous slices of ``data`` (the paper's minibatches), each cut into
    micro-batches of at most ``micro_size`` rows of similar length (length bucketing, so little
    compute goes to padding), each with its model inputs laid out as ``layout``."""
    size = len(data) // n_minibatches
    out = []
    for i in range(n_minibatches):
        mb = data.rows(slice(i * size, (i + 1) * size))
        if micro_size >= size:
            parts = [mb]
        else:
            order = torch.argsort(mb.prompt_mask_BP.sum(-1) + mb.real_mask_BT.sum(-1), stable=True)
            parts = [mb.rows(order[j : j + micro_size]) for j in range(0, size, micro_size)]
        out.append([MicroBatch(p, make_layout(
            p.prompt_ids_BP, p.prompt_mask_BP, p.response_ids_BT, p.response_mask_BT, layout, mask_dtype,
            p.obs_mask_BT,
        )) for p in parts])  # fmt: skip
    return out
