"""Rollout with the training model itself (Hugging Face transformers), batched, with a KV cache."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from gspo.model.forward import position_ids_from_mask
from gspo.rollout.base import RolloutBatch


def left_pad(
    seqs: list[list[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
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

    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_id: int,
        pad_token_id: int,
        generator: torch.Generator | None = None,
        max_batch_size: int = 256,
    ) -> None:
        from gspo.model.lora import hf_module

        self.model = hf_module(model)  # under PEFT, the transformers model with adapters in place
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
    def generate(
        self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False
    ) -> RolloutBatch:
        parts = [
            self._generate(prompt_ids[i : i + self.max_batch_size], max_new_tokens, temperature, greedy)
            for i in range(0, len(prompt_ids), self.max_batch_size)
        ]
        T = max(p[0].shape[1] for p in parts)
        pad = lambda x, v: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=v)  # noqa: E731
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids_BT=torch.cat([pad(p[0], self.pad_token_id) for p in parts]),
            response_mask_BT=torch.cat([pad(p[1], 0) for p in parts]),
            sampler_logp_BT=torch.cat([pad(p[2], 0.0) for p in parts]),
        )

    def _generate(
        self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float, greedy: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample up to ``max_new_tokens``; a row that emits EOS leaves the batch (and the KV cache)."""
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        ids_BP, mask_BP = left_pad(prompt_ids, self.pad_token_id, device)
        B = ids_BP.shape[0]
        out_ids = torch.full((B, max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
        out_logp = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
        out_mask = torch.zeros((B, max_new_tokens), dtype=torch.long, device=device)
        cache = DynamicCache()
        rows = torch.arange(B, device=device)  # original row of each live batch entry
        attn = mask_BP
        pos = position_ids_from_mask(mask_BP)
        step_ids = ids_BP
        n_steps = 0
        for t in range(max_new_tokens):
            out = self.model(
                input_ids=step_ids,
                attention_mask=attn,
                position_ids=pos,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kw: cache},
            )
            logits_bV = out.logits[:, -1].float()
            if greedy or temperature == 0:
                logp_bV = torch.log_softmax(logits_bV, -1)
                tok_b = logits_bV.argmax(-1)
            else:
                logp_bV = torch.log_softmax(logits_bV / temperature, -1)
                tok_b = torch.multinomial(logp_bV.exp(), 1, generator=self.generator).squeeze(-1)
            out_ids[rows, t] = tok_b
            out_logp[rows, t] = logp_bV.gather(-1, tok_b[:, None]).squeeze(-1)
            out_mask[rows, t] = 1
            n_steps = t + 1
            live = tok_b != self.eos_token_id
            if not bool(live.any()):
                break
            if not bool(live.all()):  # drop finished rows so later steps spend nothing on them
                keep = live.nonzero().squeeze(-1)
                cache.reorder_cache(keep)
                rows, tok_b, attn, pos = rows[keep], tok_b[keep], attn[keep], pos[keep]
            step_ids = tok_b[:, None]
            attn = torch.cat([attn, torch.ones((attn.shape[0], 1), dtype=attn.dtype, device=device)], dim=1)
            pos = pos[:, -1:] + 1
        self.model.train(was_training)
        T = max(n_steps, 1)
        return out_ids[:, :T], out_mask[:, :T], out_logp[:, :T]
