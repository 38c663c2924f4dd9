"""The one way to get at what the trainer's wrappers hold, and at a possibly sharded tensor.

The trainer's model is nested, outermost first (each layer optional):

    DistributedDataParallel -> PolicyLogprobs (the trainer's forward) -> PEFT LoRA -> transformers model

FSDP2 shards modules in place (no wrapper object), so it needs no unwrapping; its parameters and the
gradient norm are ``DTensor``s, which :func:`full_tensor` gathers.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

Level = Literal["policy", "model", "transformers"]


class ModelWrapper(nn.Module):
    """A module whose ``model`` attribute is the Hugging Face model it runs (the trainer's forward,
    :class:`~gspo.model.logprobs.PolicyLogprobs`, derives from it: this module imports no gspo module)."""

    model: nn.Module


LEVELS: tuple[Level, ...] = ("policy", "model", "transformers")
#: what the trainer's forward puts before the HF model's parameter names (it holds it as ``.model``)
POLICY_PREFIX = "model."


def is_peft(model: Any) -> bool:
    """A PEFT wrapper (peft is optional, so recognised by its interface rather than its class)."""
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def unwrap(model: Any, to: Level = "transformers") -> Any:
    """Peel ``model``'s wrappers (absent ones skipped) down to ``to``: ``"policy"``, the trainer's
    forward inside DDP; ``"model"``, the HF causal LM or its PEFT wrapper (trained, saved, sampled);
    ``"transformers"``, the transformers model itself (under LoRA, its adapters injected in place)."""
    if to not in LEVELS:
        raise ValueError(f"unwrap: to must be one of {LEVELS}, got {to!r}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    if to != "policy" and isinstance(model, ModelWrapper):
        model = model.model
    return model.get_base_model() if to not in ("policy", "model") and is_peft(model) else model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` gathered whole when it is a (sharded or replicated) ``DTensor`` (FSDP2), else ``t``."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def reshard(model: nn.Module) -> None:
    """Put every FSDP group back to its sharded parameters (no-grad forwards leave the root unsharded)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
