"""MoE routing capture, routing replay and expert volatility (GSPO, arXiv 2507.18071, section 4.3).

Supported routers (transformers 5): the ``*TopKRouter`` modules of Qwen3-MoE, Qwen2-MoE, OLMoE and
Mixtral. Each is the ``.gate`` of its sparse MoE block and has the contract::

    forward(hidden [N, H]) -> (router_logits [N, E], router_scores [N, k], router_indices [N, k])

with ``N = B * L`` (the block flattens the batch). Replay forces ``router_indices`` and recomputes
``router_scores`` with the router's *own* formula (softmax in float32, gather at the forced indices,
``norm_topk_prob`` renormalisation where that router renormalises, its output dtype), so gradients
still reach ``router.weight``; ``router_logits`` are returned unchanged.

A :data:`Routing` is ``dict[str, LongTensor[B, L, k]]`` keyed by short layer names (``"layer0"``...).

Caveat: hooks live only inside the context managers. A backward pass that *recomputes* the forward
(gradient checkpointing) after the context has exited recomputes with the router's own routing.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from gspo.errors import GspoError

Routing = dict[str, torch.Tensor]


# ------------------------------------------------------------------------------------------------
# registry of supported router classes


def _scores_softmax_then_optional_norm(
    router: nn.Module, logits: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    """Qwen3-MoE / Qwen2-MoE / OLMoE: float softmax, optional renorm, cast back to the logits dtype."""
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top = probs.gather(-1, idx)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


def _scores_mixtral(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Mixtral: softmax of float logits, always renormalised, returned in float32 (no cast back)."""
    probs = F.softmax(logits.float(), dim=-1)
    top = probs.gather(-1, idx)
    return top / top.sum(dim=-1, keepdim=True)


_ROUTER_SPECS: tuple[tuple[str, str, Callable], ...] = (
    (
        "transformers.models.qwen3_moe.modeling_qwen3_moe",
        "Qwen3MoeTopKRouter",
        _scores_softmax_then_optional_norm,
    ),
    (
        "transformers.models.qwen2_moe.modeling_qwen2_moe",
        "Qwen2MoeTopKRouter",
        _scores_softmax_then_optional_norm,
    ),
    ("transformers.models.olmoe.modeling_olmoe", "OlmoeTopKRouter", _scores_softmax_then_optional_norm),
    ("transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter", _scores_mixtral),
)
_registry_cache: dict[type, Callable] | None = None


def _registry() -> dict[type, Callable]:
    """``{router class: forced-index score function}`` for the router classes importable here."""
    global _registry_cache
    if _registry_cache is None:
        import importlib

        reg: dict[type, Callable] = {}
        for mod_name, cls_name, fn in _ROUTER_SPECS:
            try:
                reg[getattr(importlib.import_module(mod_name), cls_name)] = fn
            except (ImportError, AttributeError):  # older/newer transformers without this class
                continue
        _registry_cache = reg
    return _registry_cache


SUPPORTED_ROUTERS = tuple(cls_name for _, cls_name, _ in _ROUTER_SPECS)


def _looks_like_router(module: nn.Module) -> bool:
    name = type(module).__name__
    return "Router" in name or name.endswith("TopKGate") or name.endswith("MoEGate")


def _short_name(qualified: str) -> str:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", qualified)
    return f"layer{m.group(1)}" if m else qualified.replace(".", "_")


def _scan(model: nn.Module) -> tuple[dict[str, nn.Module], list[str]]:
    reg = _registry()
    found: dict[str, nn.Module] = {}
    unsupported: list[str] = []
    for qname, mod in model.named_modules():
        if type(mod) in reg:
            short = _short_name(qname)
            if short in found:  # two routers in one layer: fall back to the full path
                short = qname.replace(".", "_")
            found[short] = mod
        elif _looks_like_router(mod):
            unsupported.append(f"{qname} ({type(mod).__name__})")
    return found, unsupported


def find_routers(model: nn.Module) -> dict[str, nn.Module]:
    """Supported routers as ``{"layer0": router, ...}`` (model order); ``{}`` for a dense model.

    Raises :class:`GspoError` if the model has router-like modules of an unsupported class, since
    replaying only some layers' routing would be silently wrong.
    """
    found, unsupported = _scan(model)
    if unsupported:
        raise GspoError(
            f"unsupported MoE router class(es): {', '.join(unsupported[:3])}"
            f"{' ...' if len(unsupported) > 3 else ''}; routing capture/replay supports {', '.join(SUPPORTED_ROUTERS)}"
        )
    return found


def is_moe(model: nn.Module) -> bool:
    """True iff the model has supported MoE routers (warns and returns False for unsupported ones)."""
    found, unsupported = _scan(model)
    if unsupported:
        warnings.warn(
            f"MoE routers of unsupported class ({unsupported[0]}); routing replay/volatility disabled. "
            f"Supported: {', '.join(SUPPORTED_ROUTERS)}",
            stacklevel=2,
        )
        return False
    return bool(found)


def _routers_or_raise(model: nn.Module, what: str) -> dict[str, nn.Module]:
    routers = find_routers(model)
    if not routers:
        raise GspoError(
            f"{what}: model {type(model).__name__} has no MoE routers ({', '.join(SUPPORTED_ROUTERS)})"
        )
    return routers


def _entry_module(model: nn.Module) -> nn.Module:
    """The module whose forward sees ``[B, L]`` inputs: the base model (the CausalLM calls it too)."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    return base if isinstance(base, nn.Module) else model


# ------------------------------------------------------------------------------------------------
# capture


@dataclass
class RoutingRecorder:
    """What :func:`capture_routing` saw: the input shapes of each base-model forward, and per router
    the ``[N, k]`` indices of each of its calls (in call order)."""

    shapes: list[tuple[int, int]] = field(default_factory=list)
    indices: dict[str, list[torch.Tensor]] = field(default_factory=dict)


@contextlib.contextmanager
def capture_routing(model: nn.Module) -> Iterator[RoutingRecorder]:
    """Record the top-k expert indices every router uses during the forwards run inside the context.

    Inside :func:`replay_routing` the recorded indices are the forced ones (replay hooks run first).
    Turn the recorder into a :data:`Routing` with :func:`routing_snapshot`.
    """
    routers = _routers_or_raise(model, "capture_routing")
    rec = RoutingRecorder(indices={name: [] for name in routers})

    def pre_hook(_mod, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args:
            x = args[0]
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            rec.shapes.append((int(x.shape[0]), int(x.shape[1])))

    def make_hook(name: str):
        def hook(_mod, _args, output):
            rec.indices[name].append(output[2].detach())

        return hook

    handles = [_entry_module(model).register_forward_pre_hook(pre_hook, with_kwargs=True)]
    try:
        for name, router in routers.items():
            handles.append(router.register_forward_hook(make_hook(name)))
        yield rec
    finally:
        for h in handles:
            h.remove()


def routing_snapshot(rec: RoutingRecorder) -> Routing:
    """``{name: LongTensor[B, L, k]}`` from a recorder.

    Several forwards inside one context are concatenated along ``B`` (in call order); they must then
    share ``L`` (so e.g. a cached ``generate`` loop cannot be snapshotted).
    """
    out: Routing = {}
    for name, calls in rec.indices.items():
        if len(calls) != len(rec.shapes):
            raise GspoError(
                f"routing_snapshot: router {name} ran {len(calls)} time(s) but the base model {len(rec.shapes)} "
                "time(s); call the model (or its base model) with input_ids/inputs_embeds inside capture_routing"
            )
        if not calls:
            raise GspoError("routing_snapshot: no forward ran inside capture_routing")
        parts = []
        for idx, (b, seq) in zip(calls, rec.shapes, strict=True):
            if idx.shape[0] != b * seq:
                raise GspoError(
                    f"routing_snapshot: router {name} saw {idx.shape[0]} tokens, input was [{b}, {seq}]"
                )
            parts.append(idx.reshape(b, seq, idx.shape[-1]))
        if len({p.shape[1] for p in parts}) > 1:
            raise GspoError(
                f"routing_snapshot: forwards of different lengths {[p.shape[1] for p in parts]} cannot be "
                "concatenated along B"
            )
        out[name] = torch.cat(parts, 0) if len(parts) > 1 else parts[0]
    return out


# ------------------------------------------------------------------------------------------------
# replay


@contextlib.contextmanager
def replay_routing(model: nn.Module, routing: Routing) -> Iterator[None]:
    """Force every router to use ``routing[name]`` (``[B, L, k]``, flattened to ``[B*L, k]``).

    Each router returns its own probabilities gathered at the forced indices (renormalised iff the
    router renormalises), so ``router.weight`` still gets gradients; ``router_logits`` are unchanged.
    Every forward inside the context must have the same ``B * L`` tokens as ``routing``.
    """
    routers = _routers_or_raise(model, "replay_routing")
    missing = sorted(set(routers) - set(routing))
    if missing:
        raise GspoError(
            f"replay_routing: routing has no entry for router(s) {missing} (has {sorted(routing)})"
        )
    reg = _registry()

    def make_hook(name: str, router: nn.Module):
        forced_BLk = routing[name]
        score_fn = reg[type(router)]

        def hook(_mod, _args, output):
            logits, _scores, idx = output
            if forced_BLk.shape[-1] != idx.shape[-1] or forced_BLk[..., 0].numel() != idx.shape[0]:
                raise GspoError(
                    f"replay_routing: router {name} got {idx.shape[0]} tokens with top-{idx.shape[-1]}, forced "
                    f"routing has shape {list(forced_BLk.shape)}"
                )
            forced = forced_BLk.reshape(idx.shape).to(device=idx.device, dtype=idx.dtype)
            return logits, score_fn(router, logits, forced), forced

        return hook

    handles = []
    try:
        for name, router in routers.items():
            # prepend: run before any capture hook (and transformers' own output recorders)
            handles.append(router.register_forward_hook(make_hook(name, router), prepend=True))
        yield
    finally:
        for h in handles:
            h.remove()


def slice_routing(routing: Routing, sl: slice) -> Routing:
    """Rows ``sl`` (along ``B``) of every layer's routing."""
    return {name: idx[sl] for name, idx in routing.items()}


def cat_routing(routings: list[Routing]) -> Routing:
    """Concatenate routings along ``B`` (all must have the same layers and ``L``)."""
    if not routings:
        return {}
    names = list(routings[0])
    for r in routings[1:]:
        if set(r) != set(names):
            raise GspoError(f"cat_routing: layer names differ: {sorted(names)} vs {sorted(r)}")
    return {name: torch.cat([r[name] for r in routings], 0) for name in names}


# ------------------------------------------------------------------------------------------------
# volatility


def expert_volatility(
    old_idx_BLk: torch.Tensor, new_idx_BLk: torch.Tensor, mask_BL: torch.Tensor
) -> torch.Tensor:
    """0-dim float: fraction of masked positions whose top-k expert *set* changed (order-insensitive).

    0 if the mask is empty.
    """
    if old_idx_BLk.shape != new_idx_BLk.shape or old_idx_BLk.shape[:2] != mask_BL.shape:
        raise GspoError(
            f"expert_volatility: shapes {list(old_idx_BLk.shape)}, {list(new_idx_BLk.shape)}, mask "
            f"{list(mask_BL.shape)} do not match"
        )
    new = new_idx_BLk.to(old_idx_BLk.device)
    changed_BL = (old_idx_BLk.sort(-1).values != new.sort(-1).values).any(-1)
    m = mask_BL.to(old_idx_BLk.device).bool()
    return (changed_BL & m).sum().float() / m.sum().clamp(min=1).float()


def routing_volatility(
    old: Routing, new: Routing, mask_BL: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(mean over layers, {layer: volatility})`` of :func:`expert_volatility` between two routings."""
    if set(old) != set(new):
        raise GspoError(f"routing_volatility: layer names differ: {sorted(old)} vs {sorted(new)}")
    per_layer = {name: expert_volatility(old[name], new[name], mask_BL) for name in old}
    if not per_layer:
        return torch.zeros(()), per_layer
    return torch.stack([v.to(mask_BL.device) for v in per_layer.values()]).mean(), per_layer
