"""Sharded checkpoints: each rank writes and reads its own shard with ``torch.distributed.checkpoint``.

Used when the trainer is FSDP2-sharded over several ranks (without LoRA, whose adapters are small and
saved whole). A checkpoint folder then holds ``dcp/`` (one ``__<rank>_0.distcp`` file per rank and
``.metadata``) with the model and optimizer state, beside the usual ``trainer_state.pt`` (step, data
position, RNG states; no optimizer), ``config.json`` and the tokenizer. ``gspo export`` turns it into
a ``from_pretrained`` folder (:func:`gspo.model.export.export_dcp`).

DCP reshards on load, so a checkpoint resumes at the world size it was written at (bit-exact) and at
another one, one process included (the same numbers, up to the order of reductions).

Nothing in a sharded checkpoint is executed either: torch's reader unpickles ``.metadata`` and its
non-tensor entries with plain ``pickle``; :func:`reader` and :func:`planner` read the index through an
allowlist of DCP's own record types and those entries with ``torch.load(weights_only=True)``.
:func:`gspo.model.export.check_dcp` finds a damaged shard folder whose manifest was rewritten to match (a shard missing
or shorter than the index says, an index that is no DCP index).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from gspo.compat.torch_dcp import SafePlanner, SafeReader
from gspo.errors import GspoError
from gspo.model.export import DCP_DIR, DCP_MODEL_KEY, failure

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
    with_optimizer = bool(optimizer.state)
    dcp.save(_states(policy, optimizer if with_optimizer else None), checkpoint_id=str(folder / DCP_DIR))
    return with_optimizer


def load(policy: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, with_optimizer: bool) -> None:
    """Load ``folder/dcp`` into this rank's shards (collective; in one process without a group)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    states = _states(policy, optimizer if with_optimizer else None)
    try:
        dcp.load(
            states, storage_reader=SafeReader(folder / DCP_DIR), planner=SafePlanner(),
            no_dist=not dist.is_initialized(),
        )  # fmt: skip
    except (Exception, dcp.api.CheckpointException) as e:  # damaged shards matching the manifest
        raise GspoError(
            f"--resume: {folder}/{DCP_DIR} cannot be loaded ({failure(e)}); move that checkpoint folder "
            "away to resume from the one before it"
        ) from None
    set_model_state_dict(policy, states[DCP_MODEL_KEY])
    if with_optimizer:
        set_optimizer_state_dict(policy, optimizer, states[OPTIMIZER_KEY])
