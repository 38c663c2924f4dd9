"""Token log-probs of responses under a causal LM, computed only at response positions.

Two input layouts, same result:

- ``pack=True`` (default for training): the real tokens of every row are concatenated into one
  ``[1, N]`` row with position ids restarting at 0 per sequence and no attention mask;
  transformers then builds a block-diagonal causal mask from the position ids, so no layer spends
  compute on padding and sequences cannot attend to each other.
- ``pack=False``: rows stay ``[B, P+T]`` (prompt left-padded, response right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from gspo.model.logprobs import logprobs_from_hidden


def position_ids_from_mask(attention_mask_BL: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a left-padded prompt sees the same RoPE as an unpadded one."""
    return (attention_mask_BL.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class Layout:
    """Model inputs for one batch plus where its response tokens sit.

    ``pred_pos`` holds flat indices into the ``[R, L]`` hidden states of the positions that predict
    each response token (row-major over ``response_mask_BT``). ``response_pos_RL`` marks the response
    tokens' own positions (for per-token statistics such as MoE routing).
    """

    input_ids_RL: torch.Tensor
    position_ids_RL: torch.Tensor
    attention_mask_RL: torch.Tensor | None
    pred_pos: torch.Tensor
    response_pos_RL: torch.Tensor


def make_layout(
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    response_ids_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    pack: bool = True,
) -> Layout:
    B, P = prompt_ids_BP.shape
    T = response_ids_BT.shape[1]
    ids_BL = torch.cat([prompt_ids_BP, response_ids_BT], 1)
    mask_BL = torch.cat([prompt_mask_BP, response_mask_BT], 1).bool()
    resp_BL = torch.cat([torch.zeros_like(prompt_mask_BP), response_mask_BT], 1).bool()
    if not pack:
        L = P + T
        # hidden at p predicts token p+1: response token at column P+t is predicted from column P+t-1
        cols = torch.arange(L, device=ids_BL.device).expand(B, L)
        pred = (torch.arange(B, device=ids_BL.device)[:, None] * L + cols - 1)[resp_BL]
        return Layout(ids_BL, position_ids_from_mask(mask_BL), mask_BL.long(), pred, resp_BL)
    flat_ids = ids_BL[mask_BL][None]  # [1, N] real tokens, row after row
    pos = position_ids_from_mask(mask_BL)[mask_BL][None]
    resp_N = resp_BL[mask_BL]
    pred = resp_N.nonzero().squeeze(-1) - 1  # every response token has a prompt token before it
    return Layout(flat_ids, pos, None, pred, resp_N[None])


def response_logprobs(
    model: PreTrainedModel,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    response_ids_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 512,
    return_entropy: bool = False,
    pack: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t | x, y_<t) for every response token -> ``[B, T]`` float32 (0 on padding).

    Every row needs at least one prompt token. The LM head runs only on the ``N`` real response
    positions (chunked, see :func:`logprobs_from_hidden`), never on prompt or padding positions.
    """
    lay = make_layout(prompt_ids_BP, prompt_mask_BP, response_ids_BT, response_mask_BT, pack)
    from gspo.model.lora import hf_module

    model = hf_module(model)
    base = getattr(model, model.base_model_prefix)
    out = base(
        input_ids=lay.input_ids_RL,
        attention_mask=lay.attention_mask_RL,
        position_ids=lay.position_ids_RL,
        use_cache=False,
    )
    hidden = out.last_hidden_state
    hidden_NH = hidden.reshape(-1, hidden.shape[-1])[lay.pred_pos]
    sel_BT = response_mask_BT.bool()
    weight_VH = model.get_output_embeddings().weight
    res = logprobs_from_hidden(
        hidden_NH, weight_VH, response_ids_BT[sel_BT], chunk_size, temperature, return_entropy
    )
    logp_N, ent_N = res if return_entropy else (res, None)
    B, T = response_ids_BT.shape
    logp_BT = torch.zeros(B, T, dtype=torch.float32, device=hidden_NH.device).masked_scatter(sel_BT, logp_N)
    if not return_entropy:
        return logp_BT
    ent_BT = torch.zeros(B, T, dtype=torch.float32, device=hidden_NH.device).masked_scatter(sel_BT, ent_N)
    return logp_BT, ent_BT
