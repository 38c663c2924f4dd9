"""Process-group setup and model wrapping for data-parallel training (single process: no-ops).

The loop calls only the functions here, so one process and N processes run the same code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from gspo.config import Config


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _device(cfg: Config, local_rank: int) -> torch.device:
    if cfg.device == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(cfg.device)


def setup(cfg: Config) -> DistContext:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return DistContext(rank, world, local_rank, _device(cfg, local_rank))


def wrap(model: Any, cfg: Config, ctx: DistContext) -> Any:
    """Data-parallel wrapper (FSDP2 or DDP) when world_size > 1."""
    return model


def unwrap(model: Any) -> Any:
    """The plain HF module inside a DDP wrapper (FSDP2 modules are the HF module itself)."""
    return getattr(model, "module", model)


def rollout_model(model: Any, ctx: DistContext) -> Any:
    """The module the rollout engine samples from: the training module itself in one process."""
    return unwrap(model)


def sync_rollout_model(model: Any, rollout: Any, ctx: DistContext) -> None:
    """Copy updated weights into the rollout module when it is a separate copy."""
    return None


def full_state_dict(model: Any, ctx: DistContext) -> dict[str, torch.Tensor] | None:
    """Unsharded model state on rank 0 (collective; every rank must call). None: use the module's own."""
    return None


def optimizer_state_dict(model: Any, optimizer: torch.optim.Optimizer, ctx: DistContext) -> dict[str, Any]:
    return optimizer.state_dict()


def load_optimizer_state_dict(model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                              ctx: DistContext) -> None:
    optimizer.load_state_dict(state)


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    return [obj]


def mean_metrics(metrics: dict[str, float], ctx: DistContext) -> dict[str, float]:
    return metrics


def cleanup(ctx: DistContext) -> None:
    return None
