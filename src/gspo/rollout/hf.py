"""Rollout with the training model itself (Hugging Face transformers), batched, with a KV cache."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from gspo.data import SampleBatch, left_pad
from gspo.model.lm_head import truncate_logits
from gspo.model.logprobs import (
    additive_mask,
    lm_head_is_plain,
    position_ids_from_mask,
    takes_additive_mask,
)
from gspo.model.unwrap import full_tensor, reshard, unwrap


@torch.no_grad()
def copy_tensors(dst: Mapping[str, torch.Tensor], src: Iterable[tuple[str, torch.Tensor]]) -> None:
    """``dst[name]`` takes each ``(name, tensor)`` of ``src``, cast to its dtype (a sharded DTensor is
    gathered whole first: collective under FSDP2). The one weight-copy loop: the HF engine's sync
    from the trainer, and the async sampler's published weights (both ways)."""
    for name, t in src:
        dst[name].copy_(full_tensor(t))


def _sample(logp_bV: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from ``exp(logp)`` by inverse CDF: one uniform per row (CPU multinomial
    costs ~10x more at small vocabularies). ``right=True`` never lands on a zero-probability token."""
    cdf_bV = logp_bV.exp().cumsum(-1)
    # uniforms come from the generator's own device (the trainer's generator is a CPU one)
    dev = generator.device if generator is not None else cdf_bV.device
    u_b1 = torch.rand(cdf_bV.shape[0], 1, generator=generator, device=dev).to(cdf_bV.device) * cdf_bV[:, -1:]
    return torch.searchsorted(cdf_bV, u_b1, right=True).squeeze(-1).clamp_(max=cdf_bV.shape[-1] - 1)


class HFRolloutEngine:
    """Samples from ``model`` token by token with a KV cache; stops each row at its EOS.

    The engine samples from the trainer's own module (then ``sync_weights`` has nothing to do) or,
    given ``trainer``, from a copy of it in another precision, which ``sync_weights`` refills from the
    trainer one tensor at a time (FSDP2 shards gathered per tensor). Sampler log-probs come from the
    same logits the token was drawn from (after temperature). With ``top_k`` / ``top_p`` the token is
    drawn from the truncated, renormalized distribution (:func:`~gspo.model.lm_head.truncation_mask`,
    the trainer's log-probs use the same rule over the same support) and that is its log-prob.

    Cost savers, none of which changes what is sampled: each distinct prompt is prefilled once and
    its KV cache copied to all of its samples (the G samples of a GRPO/GSPO group share a prompt);
    a row that emits EOS leaves the batch and the cache; and where it means the same thing
    (:func:`~gspo.model.logprobs.takes_additive_mask`), the attention mask is built once per call as a 4D additive
    mask and sliced each step, instead of transformers rebuilding it from the 2D mask every step.
    Where the logits are exactly ``hidden @ W^T`` (:func:`~gspo.model.logprobs.lm_head_is_plain`), the
    base model runs and the last position goes through the LM head weight directly, as the trainer's
    log-probs do (skips the causal-LM wrapper: ~3% of a decode step of a tiny model).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_id: int,
        pad_token_id: int,
        generator: torch.Generator | None = None,
        max_batch_size: int = 256,
        trainer: torch.nn.Module | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> None:
        self.model = unwrap(model, "hf")  # under PEFT, the transformers model with adapters in place
        # the trainer's module when this engine samples from a copy of it (synced, collective)
        self.trainer = trainer if trainer is not None and unwrap(trainer, "hf") is not self.model else None
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.generator = generator
        self.max_batch_size = max_batch_size
        self.top_k, self.top_p = top_k, top_p  # sampling truncation (greedy decoding ignores it)
        # transformers 5.x renamed ``past_key_values`` to ``cache``; support both
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._kept: list[_Kept | None] | None = None  # inside multi_turn(): the last call's row caches

    @torch.no_grad()
    def sync_weights(self) -> None:
        """The copy's weights and buffers become the trainer's (collective under FSDP2: every rank)."""
        if self.trainer is None:
            return None
        reshard(self.trainer)  # no-grad forwards can leave the root unsharded
        src = unwrap(self.trainer, "hf")
        copy_tensors(dict(self.model.named_parameters()), src.named_parameters())
        copy_tensors(dict(self.model.named_buffers()), src.named_buffers())
        if self._kept is not None:  # caches of the old weights
            self._kept = []
        return None

    def reseed(self, seed: int) -> None:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def sleep(self) -> None:  # shares the trainer's memory: nothing to release
        return None

    def close(self) -> None:
        return None

    @contextmanager
    def multi_turn(self) -> Iterator[None]:
        """Inside it, each row's KV cache outlives its ``generate`` call: a later call whose prompt
        extends a row's prompt and fed tokens (a trajectory's next turn: its last sampled token and
        the environment's observation after it) prefills only those new tokens, instead of the whole
        context again. Same tokens and positions, so the same math; float32 rounding may differ in
        the last bits (a chunk attends to a cache instead of one prefill). The kept caches are
        released on exit. Models with sliding-window or non-attention layers re-prefill as before."""
        self._kept = [] if _full_attention(self.model) else None
        try:
            yield
        finally:
            self._kept = None

    def generate(
        self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False
    ) -> SampleBatch:
        reuse = self._match(prompt_ids) if self._kept is not None else None
        parts, kept = [], []
        with torch.inference_mode():  # no autograd bookkeeping at all: ~10% off each decode step
            for i in range(0, len(prompt_ids), self.max_batch_size):
                chunk = None if reuse is None else reuse[i : i + self.max_batch_size]
                if reuse is not None:  # the chunk owns its kept caches now (freed once in its cache)
                    reuse[i : i + self.max_batch_size] = [None] * len(chunk)
                *part, k = self._generate(
                    prompt_ids[i : i + self.max_batch_size], max_new_tokens, temperature, greedy, chunk
                )
                parts.append(part)
                kept += k or []
        if self._kept is not None:
            self._kept = kept
        # plain CPU tensors (the SampleBatch contract), so scoring and the trainer may use them next to
        # autograd (sampler log-probs as pi_old); the update moves them to its device
        parts = [tuple(x.to("cpu", copy=True) for x in p) for p in parts]
        T = max(p[0].shape[1] for p in parts)
        pad = lambda x, v: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=v)  # noqa: E731
        return SampleBatch(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids_BT=torch.cat([pad(p[0], self.pad_token_id) for p in parts]),
            response_mask_BT=torch.cat([pad(p[1], 0) for p in parts]),
            sampler_logp_BT=torch.cat([pad(p[2], 0.0) for p in parts]),
        )

    def _match(self, prompts: list[list[int]]) -> list[_Kept | None]:
        """Each prompt's kept cache from the last call, if any: the next kept row (in that call's
        order, which the live trajectories keep) whose tokens the prompt extends. Unmatched ones go."""
        kept, j, out = self._kept or [], 0, []
        self._kept = []
        for p in prompts:
            k = next((k for k in range(j, len(kept)) if _extends(p, kept[k])), None)
            out.append(None if k is None else kept[k])
            j = j if k is None else k + 1
        return out

    def _last_logits(
        self, ids_BL: torch.Tensor, mask: torch.Tensor, pos_BL: torch.Tensor, cache: DynamicCache, plain: bool
    ) -> torch.Tensor:
        """Logits ``[B, V]`` at the last position of ``ids_BL``, appending its keys/values to ``cache``;
        ``plain``: the logits are ``hidden @ W^T`` (:func:`lm_head_is_plain`)."""
        model = self.model
        kw = dict(input_ids=ids_BL, attention_mask=mask, position_ids=pos_BL, use_cache=True)
        kw[self._cache_kw] = cache
        if plain:
            hidden = model.base_model(**kw).last_hidden_state
            return torch.nn.functional.linear(hidden[:, -1], model.get_output_embeddings().weight)
        return model(**kw, logits_to_keep=1).logits[:, -1]

    def _prefill(
        self, prompts: list[list[int]], max_new: int, plain: bool, additive: bool
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Prefill each distinct prompt once (U rows) and copy its cache to its samples -> (cache,
        last logits ``[B, V]``, which of the ``K = P + max_new`` cache columns are real ``[B, K]``,
        each row's last position ``[B, 1]``, P)."""
        device = next(self.model.parameters()).device
        first: dict[tuple[int, ...], int] = {}
        src = [first.setdefault(tuple(p), len(first)) for p in prompts]
        ids_UP, mask_UP = left_pad([list(k) for k in first], self.pad_token_id, device)
        src_B = torch.tensor(src, device=device)
        B, (U, P) = len(prompts), ids_UP.shape
        real_BK = torch.ones((B, P + max_new), dtype=torch.bool, device=device)
        real_BK[:, :P] = mask_UP.bool()[src_B]
        prefill_mask = mask_UP
        if additive:
            see_UPP = torch.ones((P, P), dtype=torch.bool, device=device).tril() & mask_UP.bool()[:, None, :]
            prefill_mask = additive_mask(see_UPP[:, None], self.model.dtype)
        cache = DynamicCache()
        pos_UP = position_ids_from_mask(mask_UP)
        logits_BV = self._last_logits(ids_UP, prefill_mask, pos_UP, cache, plain)
        if U < B:
            cache.reorder_cache(src_B)
            logits_BV = logits_BV[src_B]
        return cache, logits_BV, real_BK, pos_UP[src_B, -1:], P

    def _resume(
        self, prompts: list[list[int]], reuse: list[_Kept | None], max_new: int, plain: bool, additive: bool
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """:meth:`_prefill` of only what each row's kept cache (``c_b`` tokens) lacks: row b's columns
        are [padding, its kept cache, padding, its ``s_b`` new tokens], so every row's last token is in
        the last column and the decode steps run as after a prefill (``P = C + S``)."""
        device = next(self.model.parameters()).device
        c = [0 if r is None else len(r.tokens) for r in reuse]
        ids_BS, mask_BS = left_pad(
            [p[n:] for p, n in zip(prompts, c, strict=True)], self.pad_token_id, device
        )
        (B, S), C = ids_BS.shape, max(c)
        real_BK = torch.ones((B, C + S + max_new), dtype=torch.bool, device=device)
        real_BK[:, :C] = torch.arange(C, device=device) >= C - torch.tensor(c, device=device)[:, None]
        real_BK[:, C : C + S] = mask_BS.bool()
        cache = _assemble(reuse, real_BK[:, :C])
        reuse.clear()  # the kept caches live in ``cache`` now
        pos_BS = position_ids_from_mask(real_BK[:, : C + S])[:, C:]
        mask = real_BK[:, : C + S].long()
        if additive:  # new token q (column C + q) sees the real columns up to its own
            causal_SK = torch.arange(C + S, device=device) <= C + torch.arange(S, device=device)[:, None]
            mask = additive_mask((real_BK[:, None, : C + S] & causal_SK)[:, None], self.model.dtype)
        logits_BV = self._last_logits(ids_BS, mask, pos_BS, cache, plain)
        return cache, logits_BV, real_BK, pos_BS[:, -1:], C + S

    def _generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        greedy: bool,
        reuse: list[_Kept | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[_Kept | None] | None]:
        """Sample up to ``max_new_tokens``; a row that emits EOS leaves the batch (and the KV cache).
        ``reuse`` (inside :meth:`multi_turn`): each row's kept cache or None; then each row's cache is
        kept as it leaves the batch and returned."""
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        plain = lm_head_is_plain(model)  # probed once per model, then cached
        # the decode-step masks are slices of one [B, K] mask: additive (4D) where the model takes that
        additive = takes_additive_mask(model)
        if reuse is not None and any(r is not None for r in reuse):
            cache, logits_BV, real_BK, pos, P = self._resume(
                prompt_ids, reuse, max_new_tokens, plain, additive
            )
        else:
            cache, logits_BV, real_BK, pos, P = self._prefill(prompt_ids, max_new_tokens, plain, additive)
        mask_BK = additive_mask(real_BK, model.dtype) if additive else real_BK.long()
        B, stash = len(prompt_ids), None if reuse is None else _Stash(len(prompt_ids))
        out_ids = torch.full((B, max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
        out_logp = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
        out_mask = torch.zeros((B, max_new_tokens), dtype=torch.long, device=device)
        rows: slice | torch.Tensor = slice(None)  # original rows of the live batch entries: all, at first
        n_steps = 0
        for t in range(max_new_tokens):
            logits_BV = logits_BV.float()
            if greedy or temperature == 0:
                logp_bV = torch.log_softmax(logits_BV, -1)
                tok_b = logits_BV.argmax(-1)
            else:
                z_bV, _ = truncate_logits(logits_BV / temperature, self.top_k, self.top_p)
                logp_bV = torch.log_softmax(z_bV, -1)  # -inf outside the support: never drawn
                tok_b = _sample(logp_bV, self.generator)
            out_ids[rows, t] = tok_b
            out_logp[rows, t] = logp_bV.gather(-1, tok_b[:, None]).squeeze(-1)
            out_mask[rows, t] = 1
            n_steps = t + 1
            live = tok_b != self.eos_token_id
            n_live = int(live.sum())  # the one host sync per step
            last = t + 1 == max_new_tokens or n_live == 0
            if stash is not None and (last or n_live < len(tok_b)):  # rows leaving: keep their caches
                out = torch.arange(len(tok_b), device=device) if last else (~live).nonzero().squeeze(-1)
                stash.take(cache, out, real_BK[out, : P + t], _index(rows, B, device)[out].tolist(), t)
            if last:
                break
            if n_live < len(tok_b):  # drop finished rows so later steps spend nothing on them
                keep = live.nonzero().squeeze(-1)
                cache.reorder_cache(keep)
                rows = _index(rows, B, device)[keep]
                tok_b, pos, mask_BK = tok_b[keep], pos[keep], mask_BK[keep]
                real_BK = real_BK[keep] if stash is not None else real_BK
            pos = pos + 1
            cols = P + t + 1  # the cache holds the prompt and t + 1 generated tokens after this call
            step_mask = mask_BK[:, None, None, :cols] if additive else mask_BK[:, :cols]
            logits_BV = self._last_logits(tok_b[:, None], step_mask, pos, cache, plain)
        model.train(was_training)
        T = max(n_steps, 1)
        kept = None if stash is None else stash.kept(prompt_ids, out_ids)
        return out_ids[:, :T], out_mask[:, :T], out_logp[:, :T], kept


@dataclass
class _Kept:
    """A row's KV cache as it left a call: the tokens it holds (the prompt, then the sampled tokens
    fed back) and each layer's ``(keys, values)``, ``[tokens, heads, head_dim]`` (no padding)."""

    tokens: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]


class _Stash:
    """The rows' caches collected as they leave a call's batch (at EOS or at the token budget)."""

    def __init__(self, n_rows: int) -> None:
        self.kv: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None] * n_rows
        self.fed = [0] * n_rows
        self.off = False

    def take(
        self, cache: DynamicCache, idx_f: torch.Tensor, real_fK: torch.Tensor, rows: list[int], n_fed: int
    ) -> None:
        """Keep batch entries ``idx_f`` of ``cache`` (original rows ``rows``, ``n_fed`` sampled tokens
        fed back), their real columns ``real_fK`` alone."""
        if self.off:
            return
        lens = real_fK.sum(-1).tolist()
        layers = []
        for kv in cache:  # (keys, values, ...) per layer, [batch, heads, columns, head_dim]
            if any(x is None or x.dim() != 4 or x.shape[2] != real_fK.shape[1] for x in kv[:2]):
                self.off = True  # not one keys/values column per token: nothing kept, re-prefill
                self.kv = [None] * len(self.kv)
                return
            k, v = (x[idx_f].transpose(1, 2)[real_fK].split(lens) for x in kv[:2])
            layers.append((k, v))
        for i, r in enumerate(rows):
            self.kv[r] = [(k[i], v[i]) for k, v in layers]
            self.fed[r] = n_fed

    def kept(self, prompts: list[list[int]], out_ids_BT: torch.Tensor) -> list[_Kept | None]:
        ids = out_ids_BT.tolist()
        return [
            None if kv is None else _Kept(list(p) + ids[r][: self.fed[r]], kv)
            for r, (p, kv) in enumerate(zip(prompts, self.kv, strict=True))
        ]


def _index(rows: slice | torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device) if isinstance(rows, slice) else rows


def _extends(prompt: list[int], kept: _Kept) -> bool:
    """``prompt`` starts with ``kept``'s tokens and has at least one more (its logits are needed)."""
    n = len(kept.tokens)
    return n < len(prompt) and prompt[:n] == kept.tokens


def _assemble(reuse: list[_Kept | None], real_BC: torch.Tensor) -> DynamicCache:
    """One cache of the rows' kept caches, each right-aligned in ``C`` columns (``real_BC``: where
    each row's tokens go, in order; a row without one is all padding)."""
    have = [r for r in reuse if r is not None]
    B, C = real_BC.shape
    layers = []
    for i in range(len(have[0].kv)):
        pair = []
        for j in (0, 1):  # keys, values
            flat = torch.cat([r.kv[i][j] for r in have])  # [tokens, heads, head_dim], row-major
            out = flat.new_zeros((B, C, *flat.shape[1:]))
            out[real_BC] = flat
            pair.append(out.transpose(1, 2).contiguous())
        layers.append((pair[0], pair[1]))
    return DynamicCache(layers)


def _full_attention(model: PreTrainedModel) -> bool:
    """Every layer is full attention (a kept cache is then a plain keys/values per token, which
    :func:`_assemble` may lay out with padding between rows' parts): no sliding window, no
    linear-attention or state-space layer."""
    cfg = model.config.get_text_config(decoder=True)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return getattr(cfg, "sliding_window", None) is None
