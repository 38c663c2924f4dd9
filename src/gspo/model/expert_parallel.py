"""Expert parallelism (EP) of an MoE: its routed experts split over groups of ranks, tokens sent to
their experts' ranks by all-to-all (transformers' own EP, :mod:`gspo.compat.transformers_ep`).

The routers are untouched (each rank routes its own tokens, so routing capture and replay see the
same top-k as without EP); only the experts' weights and forward change. Generation runs no
collective (ranks sample different lengths), so the sampler runs every expert locally:
:func:`whole_experts` gathers each experts module's weights once and puts its own forward back.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gspo.compat import transformers_ep
from gspo.errors import GspoError


def num_experts(model: nn.Module) -> int:
    """Routed experts per MoE layer of ``model`` (0: a dense model)."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if config is not None else None
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = getattr(config, key, None)
        if isinstance(n, int):
            return n
    return 0


def check_divides(model: nn.Module, ep: int, world: int) -> None:
    """One line naming ``expert_parallel_size`` unless ``ep`` splits ``model``'s experts and ``world``."""
    n = num_experts(model)
    if not n or not transformers_ep.experts_modules(model):
        raise GspoError(
            f"config field 'expert_parallel_size': {type(model).__name__} has no routed experts to "
            f"split (got {ep})"
        )
    if n % ep or world % ep:
        raise GspoError(
            f"config field 'expert_parallel_size': must divide the experts per layer ({n}) and the "
            f"world size ({world}) (got {ep})"
        )


# every experts module shard_experts made expert-parallel (none: whole_experts has nothing to look for)
_SHARDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def shard_experts(model: nn.Module, meshes: dict[str, Any]) -> dict[str, nn.Module]:
    """Each rank keeps ``num_experts / ep`` whole experts of every MoE layer of ``model`` (in place;
    on the meta device too) and exchanges tokens with the other ranks of its EP group."""
    experts = transformers_ep.install(model, meshes["ep"], meshes["tp"])
    _SHARDED.update(experts.values())
    return experts


def _expert_parallel(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(
        isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())
        for p in module.parameters(recurse=False)
    )


@contextlib.contextmanager
@torch.no_grad()
def whole_experts(model: nn.Module) -> Iterator[None]:
    """While held, every expert-parallel experts module of ``model`` runs all its experts locally
    (no token exchange) on its weights gathered whole (collective on entry: every rank enters).
    Costs the experts' full weights per rank while held; nothing without EP (no module is looked at)."""
    swapped: list[tuple[nn.Module, Any]] = []
    try:
        for m in model.modules() if _SHARDED else ():
            if _expert_parallel(m):
                whole = {n: p.full_tensor() for n, p in m.named_parameters(recurse=False)}
                swapped.append((m, vars(m)["forward"]))
                m.forward = transformers_ep.plain_forward(m, whole)
        yield
    finally:
        for m, ep_forward in swapped:
            m.forward = ep_forward
