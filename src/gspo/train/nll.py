"""The supervised step both warm starts take (single-turn: gspo.train.sft, tool use: gspo.envs.sft)."""

from __future__ import annotations

import torch


def nll_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, logp_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """One supervised step: the mean NLL of the masked tokens, a clipped gradient, an optimizer step.
    Returns the loss (not synced: the caller reads it only now and then)."""
    loss = -(logp_BT * mask_BT).sum() / mask_BT.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss
