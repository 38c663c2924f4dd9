"""Partial rollouts (async): a generation that outlives a weight update goes on under the new weights.

slime and AReaL interrupt long generations when new weights arrive, keep their tokens and continue
them under the new policy (re-reading the kept prefix with it), so the long tail of a batch is
sampled from a fresher policy than its head. gspo pins the interruption to a token count instead of
a moment, so runs stay deterministic: step ``t``'s responses are sampled under version ``v0 = t-1-K``
up to ``split`` tokens; the rows that have not ended by then wait for version ``v1 = t-K`` (the next
one; for ``t <= K`` there is none yet and one version draws the whole batch) and continue under it up
to ``max_new_tokens`` in all. A checkpoint after step ``s`` holds batches ``s+1 .. s+K``, whose
versions are all at most ``s``. Every token
keeps the log-prob of the version that drew it (``sampler_logp_BT``, pi_old under async) and that
version (``sampler_version_BT``), so GSPO's sequence ratio compares the policy with the one that
drew each token.

Engine-agnostic: the continuation is ``engine.generate`` on the prompt followed by the kept tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from gspo.data import RolloutEngine, SampleBatch


def unfinished(rb: SampleBatch, split: int, eos_token_id: int) -> torch.Tensor:
    """Rows of a batch generated up to ``split`` tokens that used them all without an EOS [B] bool."""
    n_B = rb.lengths_B
    if rb.response_ids_BT.shape[1] < split:
        return torch.zeros_like(n_B, dtype=torch.bool)
    return (n_B == split) & (rb.response_ids_BT[:, split - 1] != eos_token_id)


def generate_partial(
    engine: RolloutEngine,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    split: int,
    special: tuple[int, int],
    versions: tuple[int, int],
    load_next: Callable[[], None],
) -> SampleBatch:
    """Responses whose first ``split`` tokens come from ``engine``'s current weights (version
    ``versions[0]``) and whose rest, for rows still going, from the weights ``load_next()`` puts in it
    (version ``versions[1]``), each token's sampler log-prob and version recorded. ``special``: the
    EOS and pad token ids."""
    (v0, v1), (eos, pad) = versions, special
    head = engine.generate(
        prompt_ids, max_new_tokens if v1 == v0 else min(split, max_new_tokens), temperature
    )
    go_B = unfinished(head, split, eos) & (split < max_new_tokens)
    version_BT = torch.where(head.response_mask_BT.bool(), v0, -1)
    if v1 == v0 or not bool(go_B.any()):  # no newer version yet, or every row ended in time
        return dataclasses.replace(head, sampler_version_BT=version_BT)
    load_next()
    rows = go_B.nonzero().squeeze(-1).tolist()
    tail = engine.generate(
        [prompt_ids[i] + head.response_ids_BT[i, :split].tolist() for i in rows],
        max_new_tokens - split,
        temperature,
    )
    return _joined(head, tail, rows, split, (version_BT, v1), pad)


def _joined(
    head: SampleBatch,
    tail: SampleBatch,
    rows: list[int],
    split: int,
    versions: tuple[torch.Tensor, int],
    pad: int,
) -> SampleBatch:
    """``head`` with ``tail``'s rows after column ``split`` of rows ``rows``; ``versions``: the
    head's per-token versions and the tail's version."""
    (version_BT, v1), B, T = versions, len(head.prompt_ids), split + tail.response_ids_BT.shape[1]

    def widen(x: torch.Tensor, fill: float | int) -> torch.Tensor:
        out = torch.full((B, T), fill, dtype=x.dtype)
        out[:, : x.shape[1]] = x
        return out

    ids, mask = widen(head.response_ids_BT, pad), widen(head.response_mask_BT, 0)
    logp, ver = widen(head.sampler_logp_BT, 0.0), widen(version_BT, -1)
    r = torch.tensor(rows)
    ids[r, split:] = tail.response_ids_BT
    mask[r, split:], logp[r, split:] = tail.response_mask_BT, tail.sampler_logp_BT
    ver[r, split:] = torch.where(tail.response_mask_BT.bool(), v1, -1)
    return SampleBatch(head.prompt_ids, ids, mask, logp, sampler_version_BT=ver)
