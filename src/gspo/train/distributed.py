"""Process-group setup and model wrapping for data-parallel training (single process: no-ops)."""

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
    return model


def unwrap(model: Any) -> Any:
    return getattr(model, "module", model)


def full_state_dict(model: Any, ctx: DistContext) -> dict[str, torch.Tensor] | None:
    return None


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    return [obj]


def mean_metrics(metrics: dict[str, float], ctx: DistContext) -> dict[str, float]:
    return metrics


def cleanup(ctx: DistContext) -> None:
    return None
