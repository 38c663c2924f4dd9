"""Sharded checkpoints: each rank writes and reads its own shard with ``torch.distributed.checkpoint``.

Used when the trainer is FSDP2-sharded over several ranks (without LoRA, whose adapters are small and
saved whole). A checkpoint folder then holds ``dcp/`` (one ``__<rank>_0.distcp`` file per rank and
``.metadata``) with the model and optimizer state, beside the usual ``trainer_state.pt`` (step, data
position, RNG states; no optimizer), ``config.json`` and the tokenizer. ``gspo export`` turns it into
a ``from_pretrained`` folder (:func:`gspo.model.export.export_dcp`).

DCP reshards on load, so a checkpoint resumes at the world size it was written at (bit-exact) and at
another one, one process included (the same numbers, up to the order of reductions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from gspo.model.export import DCP_DIR, DCP_MODEL_KEY

OPTIMIZER_KEY = "optimizer"


def uses_sharded_checkpoints(policy: nn.Module, lora: bool) -> bool:
    """Whether a run checkpoints with DCP: its trainer is FSDP2-sharded over more than one rank."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    return isinstance(policy, FSDPModule) and not lora and dist.is_initialized() and dist.get_world_size() > 1


def is_sharded(path: Path) -> bool:
    """Whether the checkpoint folder ``path`` is a sharded one."""
    return (path / DCP_DIR / ".metadata").is_file()


def _states(policy: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    states: dict[str, Any] = {DCP_MODEL_KEY: get_model_state_dict(policy)}
    if optimizer is not None:
        states[OPTIMIZER_KEY] = get_optimizer_state_dict(policy, optimizer)
    return states


def save(policy: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> bool:
    """Write this rank's shards of the model and optimizer under ``folder/dcp`` (collective). An
    optimizer that has not stepped yet is not saved (torch's state-dict API would initialise it with
    a zero step, which shifts AdamW's bias correction). Returns whether the optimizer was saved."""
    import torch.distributed.checkpoint as dcp

    with_optimizer = bool(optimizer.state)
    dcp.save(_states(policy, optimizer if with_optimizer else None), checkpoint_id=str(folder / DCP_DIR))
    return with_optimizer


def load(policy: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, with_optimizer: bool) -> None:
    """Load ``folder/dcp`` into this rank's shards (collective; in one process without a group)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    states = _states(policy, optimizer if with_optimizer else None)
    dcp.load(states, checkpoint_id=str(folder / DCP_DIR), no_dist=not dist.is_initialized())
    set_model_state_dict(policy, states[DCP_MODEL_KEY])
    if with_optimizer:
        set_optimizer_state_dict(policy, optimizer, states[OPTIMIZER_KEY])
