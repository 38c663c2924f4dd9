"""vLLM's request outputs as gspo's :class:`~gspo.data.SampleBatch`, with the R3 routing the
engine captured, laid out for the trainer's ``rows`` forward. Imports no vLLM: tested without it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gspo.data import SampleBatch
from gspo.errors import GspoError


@dataclass
class VLLMSampleBatch(SampleBatch):
    """A :class:`SampleBatch` plus, when the engine was made with ``return_routing=True``, R3 data.

    ``routed_experts[i]`` (one per row) is a ``LongTensor[P_i + R_i - 1, num_moe_layers, top_k]``:
    row ``t`` holds the expert ids vLLM routed the token at position ``t`` of
    ``prompt_ids[i] + response_ids[i][:R_i]`` to, in every MoE layer, i.e. the routing of the forward
    whose output predicted token ``t + 1``. ``P_i = len(prompt_ids[i])``, ``R_i =
    response_mask_BT[i].sum()`` (the response including its EOS). All prompt tokens and every
    response token but the last are covered; the last sampled token is never fed to the model, so
    it has no routing. The top-k ids of a token are in the router's order (highest score first where
    the kernel sorts); compare them as sets. ``routed_layers`` names the MoE layer of each index of
    the layer axis as gspo's routing capture does (``"layer0"``, ... from the decoder layer index).
    Both are None without ``return_routing``.
    """

    routed_experts: list[torch.Tensor] | None = None
    routed_layers: list[str] | None = field(default=None)

    def routing_rows(self) -> dict[str, torch.Tensor] | None:
        return None if self.routed_experts is None else routing_rows_layout(self)


def outputs_to_batch(
    prompt_ids: Sequence[Sequence[int]], completions: Sequence[Any], eos_token_id: int, pad_token_id: int
) -> VLLMSampleBatch:
    """Convert vLLM ``CompletionOutput``-like objects (``token_ids``, ``logprobs``) to a batch.

    ``logprobs`` is a list, one entry per generated token, of ``{token_id: Logprob(logprob=...)}``
    (or plain floats); the sampled token's entry is used. Tokens after the first EOS are dropped,
    matching the HF engine's per-row stop.
    """
    rows: list[tuple[list[int], list[float]]] = []
    for c in completions:
        ids = list(c.token_ids)
        if c.logprobs is None:
            raise GspoError("vLLM returned no log-probs; SamplingParams(logprobs=0) is required")
        lps = []
        for tok, entry in zip(ids, c.logprobs, strict=True):
            v = entry[tok]
            lps.append(float(getattr(v, "logprob", v)))
        if eos_token_id in ids:
            cut = ids.index(eos_token_id) + 1
            ids, lps = ids[:cut], lps[:cut]
        rows.append((ids, lps))
    T = max([len(r[0]) for r in rows] + [1])
    ids_BT = torch.full((len(rows), T), pad_token_id, dtype=torch.long)
    mask_BT = torch.zeros((len(rows), T), dtype=torch.long)
    logp_BT = torch.zeros((len(rows), T), dtype=torch.float32)
    for i, (ids, lps) in enumerate(rows):
        n = len(ids)
        if n:
            ids_BT[i, :n] = torch.tensor(ids)
            mask_BT[i, :n] = 1
            logp_BT[i, :n] = torch.tensor(lps)
    return VLLMSampleBatch([list(p) for p in prompt_ids], ids_BT, mask_BT, logp_BT)


def routing_rows_layout(batch: VLLMSampleBatch) -> dict[str, torch.Tensor]:
    """R3 routing for the trainer's ``rows`` layout (:func:`gspo.model.logprobs.make_layout`):
    ``{"layer<N>": LongTensor[B, L, k]}`` where row ``i`` holds the real tokens ``prompt_ids[i] +
    response[:R_i]`` from column 0 (no left padding) and ``L = max_i(P_i + R_i)``, ready for
    :func:`gspo.model.routing.replay_routing` on that layout's forward.

    Columns without vLLM routing (each row's last response token, whose output predicts nothing, and
    the right padding) hold experts ``0..k-1``: any valid ids do, causal attention keeps them from
    affecting the real positions.
    """
    if batch.routed_experts is None or batch.routed_layers is None:
        raise GspoError("routing_rows_layout: the batch has no routed experts (engine return_routing=False)")
    B = len(batch.routed_experts)
    lens = [len(p) + int(n) for p, n in zip(batch.prompt_ids, batch.lengths_B.tolist(), strict=True)]
    L = max(lens + [1])
    n_layers, k = batch.routed_experts[0].shape[1:] if B else (len(batch.routed_layers), 1)
    out = torch.arange(k, dtype=torch.long).expand(B, L, n_layers, k).clone()
    for i, r in enumerate(batch.routed_experts):
        out[i, : r.shape[0]] = r
    return {name: out[:, :, j].contiguous() for j, name in enumerate(batch.routed_layers)}
