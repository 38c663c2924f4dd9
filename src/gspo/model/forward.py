"""Token log-probs of responses under a causal LM, computed only at response positions."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from gspo.model.logprobs import logprobs_from_hidden


def position_ids_from_mask(attention_mask_BL: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a left-padded prompt sees the same RoPE as an unpadded one."""
    return (attention_mask_BL.long().cumsum(-1) - 1).clamp(min=0)


def response_logprobs(
    model: PreTrainedModel,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    response_ids_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t | x, y_<t) for every response token -> ``[B, T]`` float32 (0 on padding).

    Prompts are left-padded, responses right-padded. The LM head runs only on the ``N`` real response
    positions (chunked, see :func:`logprobs_from_hidden`), never on prompt or padding positions.
    """
    B, P = prompt_ids_BP.shape
    T = response_ids_BT.shape[1]
    input_ids_BL = torch.cat([prompt_ids_BP, response_ids_BT], dim=1)
    attn_BL = torch.cat([prompt_mask_BP, response_mask_BT], dim=1).long()
    base = getattr(model, model.base_model_prefix)
    out = base(input_ids=input_ids_BL, attention_mask=attn_BL, position_ids=position_ids_from_mask(attn_BL),
               use_cache=False)
    hidden_BTH = out.last_hidden_state[:, P - 1 : P + T - 1]  # position P-1+t predicts response token t
    sel_BT = response_mask_BT.bool()
    hidden_NH = hidden_BTH[sel_BT]
    weight_VH = model.get_output_embeddings().weight
    res = logprobs_from_hidden(hidden_NH, weight_VH, response_ids_BT[sel_BT], chunk_size, temperature,
                               return_entropy)
    logp_N, ent_N = res if return_entropy else (res, None)
    logp_BT = torch.zeros(B, T, dtype=torch.float32, device=hidden_NH.device).masked_scatter(sel_BT, logp_N)
    if not return_entropy:
        return logp_BT
    ent_BT = torch.zeros(B, T, dtype=torch.float32, device=hidden_NH.device).masked_scatter(sel_BT, ent_N)
    return logp_BT, ent_BT
