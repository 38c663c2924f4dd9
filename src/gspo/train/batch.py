"""What flows through an RL step: a rollout batch, and the micro-batches the update cuts it into."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from gspo.model.logprobs import Layout, make_layout
from gspo.model.routing import Routing


@dataclass
class RolloutData:
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

    def rows(self, idx: slice | torch.Tensor) -> RolloutData:
        """The rows ``idx`` (a slice or an index tensor), trimmed to their own longest prompt/response."""
        return RolloutData(*(_take(getattr(self, f.name), idx) for f in fields(self))).trim()

    @staticmethod
    def cat(parts: list[RolloutData]) -> RolloutData:
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
        return RolloutData(
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

    def trim(self) -> RolloutData:
        """Drop prompt columns that are padding in every row (left) and response columns (right)."""
        keep_p = self.prompt_mask_BP.any(0).nonzero()
        keep_t = self.real_mask_BT.any(0).nonzero()
        p0 = int(keep_p[0]) if len(keep_p) else self.prompt_mask_BP.shape[1] - 1
        t1 = int(keep_t[-1]) + 1 if len(keep_t) else 1
        return RolloutData(
            self.prompt_ids_BP[:, p0:],
            self.prompt_mask_BP[:, p0:],
            self.response_ids_BT[:, :t1],
            self.response_mask_BT[:, :t1],
            self.sampler_logp_BT[:, :t1],
            self.adv_B,
            self.reward_B,
            self.sampler_routing,
            None if self.obs_mask_BT is None else self.obs_mask_BT[:, :t1],
        )

    @property
    def real_mask_BT(self) -> torch.Tensor:
        """1 on every token after the prompt: the model's and, in trajectories, the observations."""
        if self.obs_mask_BT is None:
            return self.response_mask_BT
        return self.response_mask_BT | self.obs_mask_BT

    def to(self, device: torch.device | str) -> RolloutData:
        return RolloutData(*(_take(getattr(self, f.name), None, device) for f in fields(self)))

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


@dataclass(frozen=True)
class MicroBatch:
    """The rows of one forward/backward and everything the loss needs for them, frozen once
    ``update.with_pi_old`` has attached pi_old (before any optimizer step)."""

    data: RolloutData
    layout: Layout  # model inputs, built once for every forward of these rows
    old_logp_BT: torch.Tensor | None = None  # trainer's pi_old log-probs [B, T] (None: not computed)
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
    data: RolloutData, n_minibatches: int, micro_size: int, layout: str, mask_dtype: torch.dtype
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
        out.append([MicroBatch(p, _layout_of(p, layout, mask_dtype)) for p in parts])
    return out


def _layout_of(d: RolloutData, layout: str, mask_dtype: torch.dtype) -> Layout:
    return make_layout(
        d.prompt_ids_BP, d.prompt_mask_BP, d.response_ids_BT, d.response_mask_BT, layout, mask_dtype,
        d.obs_mask_BT,
    )  # fmt: skip
