"""Group-relative advantages (pure tensor functions)."""

from __future__ import annotations

import torch

SCALES = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, scale: str = "group", eps: float = 1e-6) -> torch.Tensor:
    """A_ij = (r_ij - mean_j r_ij) / (std + eps) for ``rewards`` of shape ``[num_groups, G]``.

    scale:
        ``"group"``: divide by each group's std (GRPO/GSPO, paper eq. 6).
        ``"batch"``: divide by the std of the whole batch (less noisy for small G; Dr.GRPO-style
        centering is kept per group).
        ``"none"``: center only.
    std is the population std (correction 0), so G = 1 gives A = 0, not NaN. A group whose rewards
    are all equal has zero centered rewards and therefore A = 0 exactly for every scale.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    rewards_NG = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    centered_NG = rewards_NG - rewards_NG.mean(dim=1, keepdim=True)
    if scale == "none":
        return centered_NG
    if scale == "group":
        std = rewards_NG.std(dim=1, keepdim=True, correction=0)
    else:
        std = rewards_NG.std(correction=0)
    return centered_NG / (std + eps)
