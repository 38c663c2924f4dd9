"""MoE routing capture, routing replay and expert volatility (GSPO, arXiv 2507.18071, section 4.3).

In transformers 5 every supported MoE block delegates routing to a router module (its ``.gate``, or
``.router`` for Granite) with the contract::

    forward(hidden [N, H] or [B, T, H]) -> (router_logits [N, E], router_scores [N, k], router_indices [N, k])

and the block feeds ``router_scores``/``router_indices`` straight to its experts. So capture is a
forward hook that reads ``router_indices``, and replay is a forward hook that replaces the output with
the forced indices plus scores recomputed by the router's *own* formula at those indices (see
:data:`gspo.compat.transformers_moe.SCORE_FNS`, the one place that knows transformers' router
classes), so gradients still reach ``router.weight``; ``router_logits`` pass through.

The ``[B, T]`` shape of each call comes from a forward pre-hook on the router's parent MoE block (which
always sees ``[B, T, H]``), so capture and replay work for any caller: the CausalLM, its base model,
packed rows, ``generate``.

A :data:`Routing` is ``dict[str, LongTensor[B, T, k]]`` keyed by short layer names (``"layer0"``...).

Caveat: hooks live only inside the context managers. With activation checkpointing, call backward
inside :func:`replay_routing` (the recompute then replays too); a backward after it has exited
recomputes unreplayed, so :func:`replay_routing` warns when checkpointing is enabled.
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from gspo.compat.transformers_moe import SUPPORTED_ROUTERS, score_fn
from gspo.errors import GspoError

Routing = dict[str, torch.Tensor]


def _looks_like_moe(module: nn.Module) -> bool:
    """Router-like by name, or an MoE block (has ``experts``), e.g. transformers 4.x blocks that route
    inline through an ``nn.Linear`` gate, which capture/replay would otherwise silently skip."""
    name = type(module).__name__
    named_like_router = "Router" in name or name.endswith(("TopKGate", "MoEGate", "MoeGate"))
    return named_like_router or isinstance(getattr(module, "experts", None), nn.Module)


def _short_name(qualified: str) -> str:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", qualified)
    return f"layer{m.group(1)}" if m else qualified.replace(".", "_")


def _scan(model: nn.Module) -> tuple[dict[str, tuple[str, nn.Module]], list[str]]:
    """``({short name: (qualified name, router)}, [unsupported MoE-like modules])``."""
    found: dict[str, tuple[str, nn.Module]] = {}
    unsupported: list[str] = []
    for qname, mod in model.named_modules():
        if score_fn(mod) is not None:
            short = _short_name(qname)
            if short in found:  # two routers in one layer (e.g. thinker and talker): use the full path
                short = qname.replace(".", "_")
            found[short] = (qname, mod)
        elif _looks_like_moe(mod) and not any(score_fn(c) is not None for c in mod.children()):
            unsupported.append(f"{qname} ({type(mod).__name__})")
    return found, unsupported


def _checked_scan(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    found, unsupported = _scan(model)
    if unsupported:
        raise GspoError(
            f"unsupported MoE router/block class(es): {', '.join(unsupported[:3])}"
            f"{' ...' if len(unsupported) > 3 else ''}; routing capture/replay supports the transformers>=5 "
            f"routers {', '.join(SUPPORTED_ROUTERS)}"
        )
    return found


def find_routers(model: nn.Module) -> dict[str, nn.Module]:
    """Supported routers as ``{"layer0": router, ...}`` (model order); ``{}`` for a dense model.

    Raises :class:`GspoError` if the model has MoE modules of an unsupported class, since replaying
    only some layers' routing (or none) would be silently wrong.
    """
    return {short: router for short, (_, router) in _checked_scan(model).items()}


def is_moe(model: nn.Module) -> bool:
    """True iff the model has supported MoE routers (warns and returns False for unsupported ones)."""
    found, unsupported = _scan(model)
    if unsupported:
        warnings.warn(
            f"MoE modules of unsupported class ({unsupported[0]}); routing replay/volatility disabled. "
            f"Supported routers: {', '.join(SUPPORTED_ROUTERS)}",
            stacklevel=2,
        )
        return False
    return bool(found)


# each model's routers and their parent MoE blocks, scanned at its first capture or replay (the
# trainer's model keeps its modules from then on); entries go with the model
_ROUTERS: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[nn.Module, nn.Module]]] = (
    weakref.WeakKeyDictionary()
)


def _routers_with_parents(model: nn.Module, what: str) -> dict[str, tuple[nn.Module, nn.Module]]:
    """``{short name: (router, parent MoE block)}``, scanned once per model (:data:`_ROUTERS`)."""
    if model not in _ROUTERS:
        _ROUTERS[model] = _scan_with_parents(model, what)
    return _ROUTERS[model]


def _scan_with_parents(model: nn.Module, what: str) -> dict[str, tuple[nn.Module, nn.Module]]:
    """:func:`_routers_with_parents`, uncached; raises if there are no (supported) routers."""
    found = _checked_scan(model)
    if not found:
        raise GspoError(
            f"{what}: model {type(model).__name__} has no MoE routers ({', '.join(SUPPORTED_ROUTERS)})"
        )
    out = {}
    for short, (qname, router) in found.items():
        parent = model.get_submodule(qname.rpartition(".")[0]) if "." in qname else model
        out[short] = (router, parent)
    return out


def _bt(x: object) -> tuple[int, int] | None:
    """``(B, T)`` of a ``[B, T, H]`` tensor (None for anything else)."""
    return (int(x.shape[0]), int(x.shape[1])) if isinstance(x, torch.Tensor) and x.dim() == 3 else None


def _shape_tracking_hooks(
    parent: nn.Module, router: nn.Module, on_router_output: Callable, prepend: bool
) -> list[torch.utils.hooks.RemovableHandle]:
    """A pre-hook on ``parent`` remembering the ``(B, T)`` of its input, and a forward hook on
    ``router`` calling ``on_router_output(output, (B, T))`` (its return value, if not None, replaces
    the router's output). Replay prepends, capture appends: whatever the nesting order, capture hooks
    and transformers' own output recorders run after replay and so see the forced routing."""
    current: list[tuple[int, int] | None] = [None]

    def pre_hook(_mod, args, kwargs):
        current[0] = _bt(args[0] if args else kwargs.get("hidden_states"))

    def hook(_mod, args, output):
        bt, current[0] = current[0], None  # consume, so a later lone router call cannot reuse it
        if bt is None:  # router called outside its block: its own input if it is [B, T, H], else one row
            bt = _bt(args[0] if args else None) or (1, int(output[2].shape[0]))
        return on_router_output(output, bt)

    return [
        parent.register_forward_pre_hook(pre_hook, with_kwargs=True),
        router.register_forward_hook(hook, prepend=prepend),
    ]


@contextlib.contextmanager
def _hooked(
    routers: dict[str, tuple[nn.Module, nn.Module]],
    on_output: Callable[[str, nn.Module], Callable],
    prepend: bool,
) -> Iterator[None]:
    """Every router's :func:`_shape_tracking_hooks` (with ``on_output(name, router)``) while held."""
    handles: list[torch.utils.hooks.RemovableHandle] = []
    try:
        for name, (router, parent) in routers.items():
            handles += _shape_tracking_hooks(parent, router, on_output(name, router), prepend)
        yield
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------------------------------------
# capture


class RoutingRecorder(Mapping[str, torch.Tensor]):
    """What :func:`capture_routing` saw.

    ``calls[name]`` lists the ``LongTensor[B, T, k]`` indices of each call of router ``name``, in call
    order. As a mapping, ``rec[name]`` is those calls concatenated along ``B`` (the rule of
    :func:`routing_snapshot` with ``dim=0``), so after a single forward ``rec[name]`` is its routing.
    """

    def __init__(self, names: list[str]) -> None:
        self.calls: dict[str, list[torch.Tensor]] = {name: [] for name in names}

    def record(self, name: str, output: tuple[torch.Tensor, ...], bt: tuple[int, int]) -> None:
        self.calls[name].append(output[2].detach().reshape(*bt, output[2].shape[-1]))

    def __getitem__(self, name: str) -> torch.Tensor:
        return _join(name, self.calls[name], dim=0)

    def __iter__(self) -> Iterator[str]:
        return iter(self.calls)

    def __len__(self) -> int:
        return len(self.calls)

    def __contains__(self, name: object) -> bool:
        return name in self.calls

    def __repr__(self) -> str:
        return f"RoutingRecorder({ {n: [list(c.shape) for c in cs] for n, cs in self.calls.items()} })"


@contextlib.contextmanager
def capture_routing(model: nn.Module) -> Iterator[RoutingRecorder]:
    """Record the top-k expert indices ``[B, T, k]`` every router uses in the forwards run inside
    (inside :func:`replay_routing`, either nesting order, the forced ones)."""
    routers = _routers_with_parents(model, "capture_routing")
    rec = RoutingRecorder(list(routers))
    with _hooked(routers, lambda name, _router: functools.partial(rec.record, name), prepend=False):
        yield rec


def _join(name: str, calls: list[torch.Tensor], dim: int) -> torch.Tensor:
    if not calls:
        raise GspoError(f"routing: router {name} recorded no forward inside capture_routing")
    other = 1 - dim
    if len({c.shape[other] for c in calls}) > 1:
        raise GspoError(
            f"routing: router {name}: calls of shapes {[list(c.shape[:2]) for c in calls]} cannot be "
            f"concatenated along dim {dim} (use dim={other}, e.g. for cached generate steps, or rec.calls)"
        )
    return torch.cat(calls, dim) if len(calls) > 1 else calls[0]


def routing_snapshot(rec: RoutingRecorder, dim: int = 0) -> Routing:
    """``{name: LongTensor[B, T, k]}`` from a recorder, several forwards joined along ``dim``: ``0``
    stacks micro-batches along ``B`` (same ``T``), ``1`` a KV-cached ``generate``'s steps along ``T``."""
    if dim not in (0, 1):
        raise GspoError(f"routing_snapshot: dim must be 0 (batch) or 1 (time), got {dim}")
    return {name: _join(name, calls, dim) for name, calls in rec.calls.items()}


# ------------------------------------------------------------------------------------------------
# replay


def _checkpointing(model: nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


@contextlib.contextmanager
def replay_routing(model: nn.Module, routing: Routing, backward_inside: bool = False) -> Iterator[None]:
    """Force every router to use ``routing[name]`` (``[B, T, k]``) in the forwards run inside.

    With activation checkpointing the backward recomputes each layer's forward, and the hooks must
    still be there: run the backward inside too and say so (``backward_inside``), or get a warning.

    Each router returns its own probabilities gathered at the forced indices (renormalised iff the
    router renormalises, same dtype), so ``router.weight`` still gets gradients; ``router_logits``
    are unchanged. Every forward inside must have the ``[B, T]`` of ``routing``.
    """
    routers = _routers_with_parents(model, "replay_routing")
    missing = sorted(set(routers) - set(routing))
    if missing:
        raise GspoError(
            f"replay_routing: routing has no entry for router(s) {missing} (has {sorted(routing)})"
        )
    if _checkpointing(model) and torch.is_grad_enabled() and not backward_inside:
        warnings.warn(
            "replay_routing with activation checkpointing: a backward after the context exits recomputes "
            "without the replay hooks (non-reentrant checkpointing then raises CheckpointError, reentrant "
            "silently uses the router's own routing); call backward inside the context",
            stacklevel=3,  # past contextlib's __enter__
        )

    def make_replacer(name: str, router: nn.Module):
        forced_BTk = routing[name]
        router_score_fn = score_fn(router)
        assert router_score_fn is not None

        def replace(output, bt):
            logits, scores, idx = output
            if tuple(forced_BTk.shape) != (*bt, idx.shape[-1]):
                raise GspoError(
                    f"replay_routing: router {name} got input [B, T] = {list(bt)} with top-{idx.shape[-1]}, "
                    f"forced routing has shape {list(forced_BTk.shape)}"
                )
            forced_Nk = forced_BTk.reshape(idx.shape).to(device=idx.device, dtype=idx.dtype)
            return logits, router_score_fn(router, logits, forced_Nk).to(scores.dtype), forced_Nk

        return replace

    with _hooked(routers, make_replacer, prepend=True):
        yield


# ------------------------------------------------------------------------------------------------
# volatility


def _matching(
    what: str, old_idx_BTk: torch.Tensor, new_idx_BTk: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """``new_idx_BTk`` on ``old_idx_BTk``'s device, once the three shapes are checked to match."""
    if old_idx_BTk.shape != new_idx_BTk.shape or old_idx_BTk.shape[:2] != mask_BT.shape:
        raise GspoError(
            f"{what}: shapes {list(old_idx_BTk.shape)}, {list(new_idx_BTk.shape)}, mask "
            f"{list(mask_BT.shape)} do not match"
        )
    return new_idx_BTk.to(old_idx_BTk.device)


def expert_volatility(
    old_idx_BTk: torch.Tensor, new_idx_BTk: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """0-dim float32: fraction of masked positions whose top-k expert *set* changed (order-insensitive);
    0 if the mask is empty. No host sync."""
    new = _matching("expert_volatility", old_idx_BTk, new_idx_BTk, mask_BT)
    # sorting makes the comparison order-insensitive (top-k sets have distinct entries)
    changed_BT = (old_idx_BTk.sort(-1).values != new.sort(-1).values).any(-1)
    m_BT = mask_BT.to(old_idx_BTk.device).bool()
    return (changed_BT & m_BT).sum().float() / m_BT.sum().clamp(min=1).float()


def expert_share_changed(
    old_idx_BTk: torch.Tensor, new_idx_BTk: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """0-dim float32: the paper's unit (GSPO, sec. 4.3: ~10% of the activated experts change): over
    masked positions, the mean share of the ``k`` experts activated under ``new`` that were not
    activated under ``old``, ``|new \\ old| / k``. A position whose set changed by one of its k
    experts counts 1/k here and 1 in :func:`expert_volatility`. 0 if the mask is empty."""
    new = _matching("expert_share_changed", old_idx_BTk, new_idx_BTk, mask_BT)
    kept_BTk = (new.unsqueeze(-1) == old_idx_BTk.unsqueeze(-2)).any(-1)  # new expert also in old's set
    share_BT = (~kept_BTk).float().mean(-1)
    m_BT = mask_BT.to(old_idx_BTk.device).float()
    return (share_BT * m_BT).sum() / m_BT.sum().clamp(min=1)


def routing_volatility(
    old: Routing, new: Routing, mask_BT: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(mean over layers, {layer: volatility})`` of :func:`expert_volatility` between two routings."""
    if set(old) != set(new):
        raise GspoError(f"routing_volatility: layer names differ: {sorted(old)} vs {sorted(new)}")
    per_layer = {name: expert_volatility(old[name], new[name], mask_BT) for name in old}
    if not per_layer:
        return torch.zeros((), device=mask_BT.device), per_layer
    return torch.stack([v.to(mask_BT.device) for v in per_layer.values()]).mean(), per_layer


def routing_share_changed(old: Routing, new: Routing, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean over layers of :func:`expert_share_changed` (the paper's volatility unit)."""
    shares = [expert_share_changed(old[name], new[name], mask_BT).to(mask_BT.device) for name in old]
    return torch.stack(shares).mean() if shares else torch.zeros((), device=mask_BT.device)
