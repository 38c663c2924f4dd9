"""Rollout with the training model itself (Hugging Face transformers), batched, with a KV cache."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
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
from gspo.rollout.turns import Pending, Ticks, TurnEnd, is_pending


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
    a row that emits EOS leaves the batch and the cache; a multi-turn trajectory keeps its cache
    across turns (:meth:`play`: one decode loop for single- and multi-turn); and where it means the same thing
    (:func:`~gspo.model.logprobs.takes_additive_mask`), the attention mask is built once per call as a 4D additive
    mask and sliced each step, instead of transformers rebuilding it from the 2D mask every step.
    Where the logits are exactly ``hidden @ W^T`` (:func:`~gspo.model.logprobs.lm_head_is_plain`), the
    base model runs and the last position goes through the LM head weight directly, as the trainer's
    log-probs do (skips the causal-LM wrapper: ~3% of a decode step of a tiny model).
    """

    plays_inline = True  # its play also takes answers given at once (tool_concurrency=0: steps in the loop)

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
        self.model = unwrap(
            model, "transformers"
        )  # under PEFT, the transformers model with adapters in place
        # the trainer's module when this engine samples from a copy of it (synced, collective)
        self.trainer = (
            trainer if trainer is not None and unwrap(trainer, "transformers") is not self.model else None
        )
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.generator = generator
        self.max_batch_size = max_batch_size
        self.top_k, self.top_p = top_k, top_p  # sampling truncation (greedy decoding ignores it)
        # transformers 5.x renamed ``past_key_values`` to ``cache``; support both
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # how the model is called: probed at the first prefill, once its weights are real (an async
        # sampler builds its model from the config and loads the trainer's weights later; a probe on
        # random weights can miss a soft-capped head), then kept (the probes cache answers per model)
        self.plain: bool | None = None  # the logits are hidden @ W^T
        self.additive: bool | None = None  # a 4D additive mask means what the 2D one does

    @torch.no_grad()
    def sync_weights(self) -> None:
        """The copy's weights and buffers become the trainer's (collective under FSDP2: every rank)."""
        if self.trainer is None:
            return None
        reshard(self.trainer)  # no-grad forwards can leave the root unsharded
        src = unwrap(self.trainer, "transformers")
        copy_tensors(dict(self.model.named_parameters()), src.named_parameters())
        copy_tensors(dict(self.model.named_buffers()), src.named_buffers())
        return None

    def reseed(self, seed: int) -> None:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def sleep(self) -> None:  # shares the trainer's memory: nothing to release
        return None

    def close(self) -> None:
        return None

    def generate(
        self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False
    ) -> SampleBatch:
        """Up to ``max_new_tokens`` per prompt, each row ending at its EOS: :meth:`play` with one turn."""
        out: list[tuple[list[int], list[float]]] = [([], [])] * len(prompt_ids)

        def done(row: int, ids: list[int], logps: list[float]) -> None:
            out[row] = (ids, logps)

        budgets = [max_new_tokens] * len(prompt_ids)
        self.play(prompt_ids, budgets, max_new_tokens, done, temperature, greedy)
        # plain CPU tensors (the SampleBatch contract): float32 log-probs round-trip Python floats exactly
        T = max([len(ids) for ids, _ in out] + [1])
        return SampleBatch(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids_BT=torch.tensor([ids + [self.pad_token_id] * (T - len(ids)) for ids, _ in out]),
            response_mask_BT=torch.tensor([[1] * len(ids) + [0] * (T - len(ids)) for ids, _ in out]),
            sampler_logp_BT=torch.tensor([lp + [0.0] * (T - len(lp)) for _, lp in out], dtype=torch.float32),
        )

    def _last_logits(
        self, ids_BL: torch.Tensor, mask: torch.Tensor, pos_BL: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """Logits ``[B, V]`` at the last position of ``ids_BL``, appending its keys/values to ``cache``."""
        model = self.model
        kw = dict(input_ids=ids_BL, attention_mask=mask, position_ids=pos_BL, use_cache=True)
        kw[self._cache_kw] = cache
        if self.plain:
            hidden = model.base_model(**kw).last_hidden_state
            return torch.nn.functional.linear(hidden[:, -1], model.get_output_embeddings().weight)
        return model(**kw, logits_to_keep=1).logits[:, -1]

    def _prefill(self, prompt_ids: list[list[int]], steps: int) -> _Decode:
        """Prefill each distinct prompt once (U rows) and copy its cache to its samples (B rows): the
        decode state for up to ``steps`` more tokens per row."""
        model = self.model
        device = next(model.parameters()).device
        if self.plain is None:
            self.plain, self.additive = lm_head_is_plain(model), takes_additive_mask(model)
        first: dict[tuple[int, ...], int] = {}
        src = [first.setdefault(tuple(p), len(first)) for p in prompt_ids]
        ids_UP, mask_UP = left_pad([list(k) for k in first], self.pad_token_id, device)
        src_B = torch.tensor(src, device=device)
        B, (U, P) = len(prompt_ids), ids_UP.shape
        real_BK = torch.ones((B, P + steps), dtype=torch.bool, device=device)  # which cache columns are real
        real_BK[:, :P] = mask_UP.bool()[src_B]
        # the decode-step masks are slices of one [B, K] mask: additive (4D) where the model takes that
        if self.additive:
            mask_BK = additive_mask(real_BK, model.dtype)
            see_UPP = torch.ones((P, P), dtype=torch.bool, device=device).tril() & mask_UP.bool()[:, None, :]
            prefill_mask = additive_mask(see_UPP[:, None], model.dtype)
        else:
            mask_BK, prefill_mask = real_BK.long(), mask_UP
        cache = DynamicCache()
        pos_UP = position_ids_from_mask(mask_UP)
        logits_BV = self._last_logits(ids_UP, prefill_mask, pos_UP, cache)
        if U < B:
            cache.reorder_cache(src_B)
            logits_BV = logits_BV[src_B]
        return _Decode(logits_BV, cache, mask_BK, pos_UP[src_B, -1:], P)

    @torch.inference_mode()  # no autograd bookkeeping at all: ~10% off each decode step
    def play(
        self,
        contexts: list[list[int]],
        budgets: list[int],
        max_tokens: int,
        turn_end: TurnEnd,
        temperature: float = 1.0,
        greedy: bool = False,
        tick: int = 1,
    ) -> None:
        """Trajectories in one decode loop that keeps each one's KV cache across its turns.

        Row ``i`` starts after ``contexts[i]`` with a turn of at most ``budgets[i]`` tokens. When a
        turn ends (EOS, or its budget) ``turn_end(i, ids, logps)`` answers ``(observation ids, next
        budget)``, None (the row ends), or a pending answer (``result()``: a step in a worker pool)
        whose row goes on at the first tick after (every ``tick`` steps,
        :class:`~gspo.rollout.turns.Ticks`), holding masked columns meanwhile. A pending answer's
        observation is fed in one forward (the step's other rows left-padded to its width), one
        given at once a token per step. A row holds at most ``max_tokens`` tokens after its context."""
        if len(contexts) > self.max_batch_size:
            return self._play_in_parts(contexts, budgets, max_tokens, turn_end, temperature, greedy, tick)
        was_training = self.model.training
        self.model.eval()
        try:
            _Play(self, self._prefill(contexts, max_tokens), budgets, turn_end, Ticks(tick)).run(
                temperature, greedy
            )
        finally:
            self.model.train(was_training)

    def _play_in_parts(
        self,
        contexts: list[list[int]],
        budgets: list[int],
        max_tokens: int,
        turn_end: TurnEnd,
        temperature: float,
        greedy: bool,
        tick: int,
    ) -> None:
        """:meth:`play` of more rows than ``max_batch_size``: a batch of them at a time."""
        for i in range(0, len(contexts), self.max_batch_size):
            part, end = slice(i, i + self.max_batch_size), lambda j, ids, lp, i=i: turn_end(i + j, ids, lp)
            self.play(contexts[part], budgets[part], max_tokens, end, temperature, greedy, tick)

    def _draw(
        self, logits_BV: torch.Tensor, temperature: float, greedy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row and the log-probs it was drawn from (``[B]``, ``[B, V]``)."""
        logits_BV = logits_BV.float()
        if greedy or temperature == 0:
            return logits_BV.argmax(-1), torch.log_softmax(logits_BV, -1)
        z_bV, _ = truncate_logits(logits_BV / temperature, self.top_k, self.top_p)
        logp_bV = torch.log_softmax(z_bV, -1)  # -inf outside the support: never drawn
        return _sample(logp_bV, self.generator), logp_bV


@dataclass
class _Decode:
    """The state of one batched decode loop: the next logits, the KV cache, each row's mask over the
    cache's columns (its capacity grows) and the position of its last token fed."""

    logits_BV: torch.Tensor
    cache: DynamicCache
    mask_BK: torch.Tensor
    pos: torch.Tensor
    P: int  # prompt columns (left-padded)
    cols: int = 0  # columns the cache holds

    def select(self, idx: torch.Tensor) -> None:
        """Keep the rows ``idx`` (the others left the batch and the cache)."""
        self.cache.reorder_cache(idx)
        self.logits_BV, self.pos, self.mask_BK = self.logits_BV[idx], self.pos[idx], self.mask_BK[idx]

    def extend(self, real_Bw: torch.Tensor, additive: bool) -> torch.Tensor:
        """Mark the step's ``w`` new columns (``real_Bw``: which hold a token) and return the step's
        attention mask over all columns (4D additive where the model takes that)."""
        w = real_Bw.shape[1]
        if self.cols + w > self.mask_BK.shape[1]:  # waiting rows and whole observations take columns
            self.mask_BK = torch.cat([self.mask_BK, torch.zeros_like(self.mask_BK)], 1)
        cols, self.cols = self.cols, self.cols + w
        if not additive:
            self.mask_BK[:, cols : self.cols] = real_Bw.long()
            return self.mask_BK[:, : self.cols]
        self.mask_BK[:, cols : self.cols] = additive_mask(real_Bw, self.mask_BK.dtype)
        mask = self.mask_BK[:, None, None, : self.cols]
        return mask if w == 1 else _causal_tail(mask, w)


def _causal_tail(mask_B11K: torch.Tensor, w: int) -> torch.Tensor:
    """``mask_B11K`` for ``w`` queries, each of the last ``w`` columns hidden from the earlier ones."""
    later_ww = torch.ones((w, w), dtype=torch.bool, device=mask_B11K.device).triu(1)
    mask = mask_B11K.expand(-1, -1, w, -1).clone()
    mask[..., -w:].masked_fill_(later_ww, torch.finfo(mask.dtype).min)
    return mask


class _Play:
    """One :meth:`HFRolloutEngine.play` loop: per row its turn so far, its budget, the observation
    tokens still to feed and, in ``ticks``, the rows waiting for a pending answer."""

    def __init__(
        self, eng: HFRolloutEngine, d: _Decode, budgets: list[int], turn_end: TurnEnd, ticks: Ticks
    ) -> None:
        self.eng, self.d, self.turn_end, self.ticks = eng, d, turn_end, ticks
        self.budget, self.rows = list(budgets), list(range(len(budgets)))  # rows: original row of each entry
        self.turn: list[tuple[list[int], list[float]]] = [([], []) for _ in budgets]
        self.queue: dict[int, list[int]] = {}  # observation tokens still to feed, per row
        self.whole: set[int] = set()  # rows whose queue is fed in one forward
        self.stash: dict[int, torch.Tensor] = {}  # a waiting row's logits after its turn's last token
        d.cols = d.P

    def run(self, temperature: float, greedy: bool) -> None:
        step = 0
        while self.rows:
            if self.ticks.parked:
                self._rejoin(step)
                if all(
                    r in self.ticks.parked for r in self.rows
                ):  # nothing to decode: skip to the next due step
                    step = self.ticks.next_due() if self.rows else step
                    continue
            tok_b, logp_bV = self.eng._draw(self.d.logits_BV, temperature, greedy)
            feeds = self._advance(step, tok_b, logp_bV)
            if self.rows:
                self._forward(feeds)
            step += 1

    def _advance(self, step: int, tok_b: torch.Tensor, logp_bV: torch.Tensor) -> list[list[int]]:
        """Each row's tokens to feed this step: its drawn token (its turn goes on or ends here), its
        observation's next tokens, or none (waiting). Rows that end leave the batch."""
        if forced := [k for k, r in enumerate(self.rows) if r in self.queue and r not in self.whole]:
            # an observation's next token, instead of what was drawn (one host read below)
            tok_b[forced] = torch.tensor([self.queue[self.rows[k]][0] for k in forced], device=tok_b.device)
        logp_b = logp_bV.gather(-1, tok_b[:, None]).squeeze(-1)  # one host read: both exact in float64
        toks, logps = torch.stack([tok_b.double(), logp_b.double()]).tolist()
        keep, feeds, eos = [], [], self.eng.eos_token_id
        for k, r in enumerate(self.rows):
            if r in self.queue or r in self.ticks.parked:
                feeds.append(self._waiting(k, r))
            else:
                ids, lps = self.turn[r]
                ids.append(int(toks[k]))
                lps.append(logps[k])
                feeds.append(ids[-1:])
                if ids[-1] == eos or len(ids) >= self.budget[r]:
                    self.turn[r] = ([], [])
                    if (nxt := self.turn_end(r, ids, lps)) is None:
                        feeds.pop()
                        continue  # the row leaves the batch and the KV cache
                    self._next(r, step, nxt)
            keep.append(k)
        self._keep(keep)
        return feeds

    def _waiting(self, k: int, r: int) -> list[int]:
        """What a row between two turns feeds: its observation's next tokens (all of a pending
        answer's), or nothing while its answer is pending (its logits after its turn kept)."""
        if r in self.ticks.parked:
            self.stash.setdefault(r, self.d.logits_BV[k].clone())
            return []
        q = self.queue[r]
        n = len(q) if r in self.whole else 1
        feed, q[:n] = q[:n], []
        if not q:
            del self.queue[r]
            self.whole.discard(r)
        return feed

    def _next(self, r: int, step: int, nxt: tuple[list[int], int] | Pending) -> None:
        if is_pending(nxt):
            self.ticks.park(r, step, nxt)  # type: ignore[arg-type]
        else:
            self._answer(r, nxt)  # type: ignore[arg-type]

    def _answer(self, r: int, nxt: tuple[list[int], int], whole: bool = False) -> None:
        obs, self.budget[r] = nxt
        if obs:
            self.queue[r] = list(obs)
            if whole:
                self.whole.add(r)

    def _rejoin(self, step: int) -> None:
        """The rows due at ``step`` take their answers: an observation to feed, or they leave."""
        done = []
        for r, nxt in self.ticks.due(step):
            stashed = self.stash.pop(r, None)
            if nxt is None:
                done.append(r)
                continue
            self._answer(r, nxt, whole=True)
            if r not in self.queue and stashed is not None:  # nothing to feed: sample after the turn
                self.d.logits_BV[self.rows.index(r)] = stashed
        if done:
            self._keep([k for k, r in enumerate(self.rows) if r not in done])

    def _keep(self, keep: list[int]) -> None:
        if len(keep) < len(self.rows):  # finished rows leave: later steps spend nothing on them
            if keep:
                self.d.select(torch.tensor(keep, device=self.d.pos.device))
            self.rows = [self.rows[k] for k in keep]

    def _forward(self, feeds: list[list[int]]) -> None:
        """Feed each row's tokens, left-padded to the step's width (a row with none holds a masked
        column), and keep the logits after each row's last real token."""
        d, w, dev = self.d, max(len(f) for f in feeds), self.d.pos.device
        n_B = torch.tensor([len(f) for f in feeds], device=dev)
        ids_Bw = torch.tensor([[self.eng.pad_token_id] * (w - len(f)) + f for f in feeds], device=dev)
        pos_Bw = d.pos + (torch.arange(1, w + 1, device=dev) - (w - n_B)[:, None]).clamp(min=1)
        d.pos = d.pos + n_B[:, None]
        mask = d.extend(torch.arange(w, device=dev) >= (w - n_B)[:, None], bool(self.eng.additive))
        d.logits_BV = self.eng._last_logits(ids_Bw, mask, pos_Bw, d.cache)
