"""Rollout with the training model itself (Hugging Face transformers), batched, with a KV cache."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from gspo.model.forward import position_ids_from_mask
from gspo.rollout.base import RolloutBatch


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> ``(ids_BP, mask_BP)`` so every prompt ends at the same column."""
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, P - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, P - len(s) :] = 1
    return ids.to(device), mask.to(device)


class HFRolloutEngine:
    """Samples from ``model`` token by token with a KV cache; stops each row at its EOS.

    The engine shares the module with the trainer, so ``sync_weights`` has nothing to do. Sampler
    log-probs come from the same logits the token was drawn from (after temperature).
    """

    def __init__(self, model: PreTrainedModel, eos_token_id: int, pad_token_id: int,
                 generator: torch.Generator | None = None, max_batch_size: int = 256) -> None:
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.generator = generator
        self.max_batch_size = max_batch_size
        # transformers 5.x renamed ``past_key_values`` to ``cache``; support both
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def sync_weights(self) -> None:
        return None

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 greedy: bool = False) -> RolloutBatch:
        parts = [self._generate(prompt_ids[i : i + self.max_batch_size], max_new_tokens, temperature, greedy)
                 for i in range(0, len(prompt_ids), self.max_batch_size)]
        T = max(p[0].shape[1] for p in parts)
        pad = lambda x, v: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=v)  # noqa: E731
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids_BT=torch.cat([pad(p[0], self.pad_token_id) for p in parts]),
            response_mask_BT=torch.cat([pad(p[1], 0) for p in parts]),
            sampler_logp_BT=torch.cat([pad(p[2], 0.0) for p in parts]),
        )

    def _generate(self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float,
                  greedy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        ids_BP, mask_BP = left_pad(prompt_ids, self.pad_token_id, device)
        B = ids_BP.shape[0]
        cache = DynamicCache()
        attn_BL = mask_BP
        pos_B1 = position_ids_from_mask(mask_BP)
        step_ids = ids_BP
        tokens, logps, alive = [], [], []
        done_B = torch.zeros(B, dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            out = self.model(input_ids=step_ids, attention_mask=attn_BL, position_ids=pos_B1,
                             use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
            logits_BV = out.logits[:, -1].float()
            if greedy or temperature == 0:
                tok_B = logits_BV.argmax(-1)
                logp_BV = torch.log_softmax(logits_BV, -1)
            else:
                logp_BV = torch.log_softmax(logits_BV / temperature, -1)
                tok_B = torch.multinomial(logp_BV.exp(), 1, generator=self.generator).squeeze(-1)
            tok_B = torch.where(done_B, torch.full_like(tok_B, self.pad_token_id), tok_B)
            alive.append(~done_B)
            tokens.append(tok_B)
            logps.append(logp_BV.gather(-1, tok_B[:, None]).squeeze(-1))
            done_B = done_B | (tok_B == self.eos_token_id)
            if bool(done_B.all()):
                break
            step_ids = tok_B[:, None]
            attn_BL = torch.cat([attn_BL, torch.ones((B, 1), dtype=attn_BL.dtype, device=device)], dim=1)
            pos_B1 = pos_B1[:, -1:] + 1
        self.model.train(was_training)
        mask_BT = torch.stack(alive, 1).long()
        ids_BT = torch.stack(tokens, 1)
        logp_BT = torch.stack(logps, 1) * mask_BT
        return ids_BT, mask_BT, logp_BT
