"""Token log-probs from final hidden states through the LM head."""

from __future__ import annotations

import torch


def logprobs_from_hidden(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ W^T / temperature)[target] for N flattened positions -> ``[N]`` float32.

    With ``return_entropy`` also returns the per-position entropy ``[N]`` (detached).
    """
    logits_NV = (hidden_NH @ weight_VH.T).float() / temperature
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    logp_N = logp_NV.gather(-1, targets_N[:, None]).squeeze(-1)
    if not return_entropy:
        return logp_N
    ent_N = -(logp_NV.exp() * logp_NV).sum(-1).detach()
    return logp_N, ent_N
