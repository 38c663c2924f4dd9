"""Async batches across the process boundary and into checkpoints (:mod:`gspo.rollout.async_sampler`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gspo.data import SampleBatch, SamplerOutput


@dataclass
class Ahead:
    """A batch sampled ahead: step ``step``'s responses from ``version``'s weights."""

    step: int
    version: int
    out: SamplerOutput
    idx: list[int]  # the training prompt of each group, in order
    data_end: int  # the data position after every prompt drawn for it (dynamic sampling draws more)


# A batch crosses the process boundary as numpy arrays, pickled by value: torch tensors would go
# through shared-memory file descriptors, ~4 ms per batch on this CPU (a twentieth of a tiny step).
def to_wire(a: Ahead, groups: slice | None = None, G: int = 1) -> tuple[Any, ...]:
    """``a`` (its ``groups`` alone, G rows each) as plain values and numpy arrays."""
    from gspo.envs.episodes import env_fields

    rb, idx = a.out.batch, a.idx
    arrays = (rb.response_ids_BT, rb.response_mask_BT, rb.sampler_logp_BT.float(), rb.sampler_version_BT)
    prompts, rows = rb.prompt_ids, None
    if groups is not None:  # a rank's groups (a trajectory batch: with their own error count)
        rows = slice(groups.start * G, groups.stop * G)
        arrays, prompts, idx = tuple(x if x is None else x[rows] for x in arrays), prompts[rows], idx[groups]
    meta = (a.out.gen_s, a.out.info, idx, a.data_end)
    wire = tuple(x if x is None else x.cpu().numpy() for x in arrays)
    routing = routing_of(rb, rows)
    if routing is not None:  # expert ids fit 16 bits: a quarter of int64's bytes
        routing = ([r.to(torch.int16).numpy() for r in routing[0]], routing[1])
    return (a.step, a.version, prompts, wire, env_fields(rb, rows), routing, meta)


def from_wire(msg: tuple[Any, ...]) -> Ahead:
    from gspo.envs.episodes import with_env_fields

    t, version, prompt_ids, arrays, env, routing, (gen_s, info, idx, data_end) = msg
    rb = SampleBatch(prompt_ids, *(x if x is None else torch.from_numpy(x) for x in arrays))
    rb = with_env_fields(rb, env)  # multi-turn trajectories: gspo.envs
    if routing is not None:
        routing = ([torch.from_numpy(r).long() for r in routing[0]], routing[1])
    rb = with_routing(rb, routing)
    return Ahead(t, version, SamplerOutput(rb, gen_s, info), list(idx), data_end)


def routing_of(rb: SampleBatch, rows: slice | None = None) -> tuple[list[torch.Tensor], list[str]] | None:
    """R3: the experts the sampler's engine routed each row's tokens to, and the layers' names
    (``rows`` alone); None from an engine that does not say."""
    experts, layers = getattr(rb, "routed_experts", None), getattr(rb, "routed_layers", None)
    if experts is None or layers is None:
        return None
    return list(experts if rows is None else experts[rows]), list(layers)


def with_routing(rb: SampleBatch, routing: tuple[list[torch.Tensor], list[str]] | None) -> SampleBatch:
    """``rb`` carrying R3's routing again (inverse of :func:`routing_of`): a trajectory batch keeps its
    class, a single-turn one becomes the vLLM engine's batch, whose ``routing_rows`` lays it out."""
    from gspo.envs.episodes import EnvSampleBatch
    from gspo.rollout.vllm_batch import VLLMSampleBatch

    if routing is None:
        return rb
    if isinstance(rb, EnvSampleBatch):
        rb.routed_experts, rb.routed_layers = routing
        return rb
    return VLLMSampleBatch(
        rb.prompt_ids, rb.response_ids_BT, rb.response_mask_BT, rb.sampler_logp_BT, rb.sampler_version_BT,
        routed_experts=routing[0], routed_layers=routing[1],
    )  # fmt: skip


def in_flight_to_state(pending: list[Ahead]) -> list[dict[str, Any]]:
    """In-flight batches as tensors and plain values (a checkpoint is read with ``weights_only``)."""
    return [
        {
            "step": a.step,
            "version": a.version,
            "prompt_ids": a.out.batch.prompt_ids,
            "response_ids": a.out.batch.response_ids_BT,
            "response_mask": a.out.batch.response_mask_BT,
            "sampler_logp": a.out.batch.sampler_logp_BT,
            **(
                {}
                if a.out.batch.sampler_version_BT is None
                else {"sampler_version": a.out.batch.sampler_version_BT}
            ),
            "gen_s": float(a.out.gen_s),
            "info": dict(a.out.info),
            "prompt_idx": list(a.idx),
            "data_end": a.data_end,
            **_env_state(a.out.batch),
            **_routing_state(a.out.batch),
        }
        for a in pending
    ]


def _routing_state(rb: SampleBatch) -> dict[str, Any]:
    routing = routing_of(rb)
    return {} if routing is None else {"routed_experts": routing[0], "routed_layers": routing[1]}


def _env_state(rb: SampleBatch) -> dict[str, Any]:
    """A multi-turn batch's own fields (gspo.envs) as tensors and ints, for the checkpoint."""
    from gspo.envs.episodes import env_fields

    env = env_fields(rb)
    return {} if env is None else {"env": {k: torch.as_tensor(v) for k, v in env.items()}}


def in_flight_from_state(items: list[dict[str, Any]], P: int) -> list[Ahead]:
    """:func:`in_flight_to_state` undone (a checkpoint written before dynamic sampling could run
    async has no prompt indices: its step ``t`` drew prompts ``(t-1) P .. t P``)."""
    from gspo.envs.episodes import with_env_fields

    out = []
    for d in items:
        rb = SampleBatch(
            d["prompt_ids"],
            d["response_ids"],
            d["response_mask"],
            d["sampler_logp"],
            d.get("sampler_version"),
        )
        rb = with_env_fields(rb, d.get("env"))  # a multi-turn batch (gspo.envs)
        rb = with_routing(rb, (d["routed_experts"], d["routed_layers"]) if "routed_experts" in d else None)
        out_s = SamplerOutput(rb, d["gen_s"], dict(d.get("info", {})))
        idx, end = d.get("prompt_idx", []), d.get("data_end", d["step"] * P)
        out.append(Ahead(d["step"], d["version"], out_s, list(idx), end))
    return out
