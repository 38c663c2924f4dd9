"""Each rank reads its own shards of an FSDP2-sharded model from the HF folder's safetensors files.

No rank holds the whole model: the weights are read one decoder layer at a time (the layer's tensors
as stored), laid out as the model keeps them in memory (transformers 5 fuses MoE experts that the
files store one by one), and each rank copies its own rows into its shards; a stored tensor none of
whose elements this rank holds (another rank's expert) is not read at all. The layout is found
without knowing any conversion: the save-time conversion (``revert_weight_conversion``, which the HF
export and the vLLM sync already use) is run once per layer on tensors that hold their own flat
index, so the stored tensors say, element by element, where in memory each of their values goes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gspo.compat import transformers_model
from gspo.errors import GspoError
from gspo.model.export import layer_groups


def stored_tensors(folder: Path) -> dict[str, tuple[Path, list[int]]]:
    """Every tensor of the folder's safetensors files: name -> (file, shape), from the headers only."""
    out: dict[str, tuple[Path, list[int]]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        out |= {k: (f, v["shape"]) for k, v in header.items() if k != "__metadata__"}
    return out


def _as_stored(model: nn.Module, sd: dict[str, Any], names: list[str]) -> dict[str, torch.Tensor]:
    """The stored tensors (names and shapes, on the meta device) the save-time conversion makes of
    the in-memory tensors ``names`` (one layer's)."""
    meta = {k: torch.empty(tuple(sd[k].shape), device="meta") for k in names}
    return transformers_model.revert_weight_conversion(model, meta)


def layout_of(model: nn.Module, sd: dict[str, Any], names: list[str]) -> dict[str, torch.Tensor]:
    """For the in-memory tensors ``names`` (one layer's, of ``sd``): each stored tensor the save-time
    conversion makes of them, holding for every element its flat index in those tensors laid end to end."""
    return transformers_model.revert_weight_conversion(model, _flat_indices(sd, names))


def _flat_indices(sd: dict[str, Any], names: list[str]) -> dict[str, torch.Tensor]:
    """Each tensor of ``names`` shaped as itself, holding its elements' flat indices in the tensors laid
    end to end (integers: exact past 2^24 elements, where float32 is not)."""
    index, offset = {}, 0
    for k in names:
        n = sd[k].numel()
        dtype = torch.int32 if offset + n < 2**31 else torch.int64
        index[k] = torch.arange(offset, offset + n, dtype=dtype).view(tuple(sd[k].shape))
        offset += n
    return index


def readable(model: nn.Module, folder: Path) -> str:
    """Why ``folder`` cannot feed :func:`load_own_shards` ("" when it can): every stored tensor the
    model's weights need must be there with its shape (the model on the meta device is enough)."""
    stored = stored_tensors(folder)
    if not stored:
        return f"{folder} has no safetensors files"
    sd = transformers_model.save_state_dict(model)
    for group in layer_groups(sd):
        for name, t in _as_stored(model, sd, group).items():
            if name not in stored:
                return f"{folder} has no tensor {name!r}"
            if list(t.shape) != stored[name][1]:
                return f"{folder}: {name!r} is {stored[name][1]}, the model needs {list(t.shape)}"
    return ""


@torch.no_grad()
def load_own_shards(model: nn.Module, folder: Path) -> None:
    """Fill ``model``'s parameters (FSDP2 shards after ``to_empty``, or whole tensors) from ``folder``:
    each rank reads one layer's stored tensors at a time and keeps its own rows (no collective);
    a stored tensor holding none of them (another rank's expert) is not read."""
    stored = stored_tensors(folder)
    sd = transformers_model.save_state_dict(model)
    for group in layer_groups(sd):
        as_stored = _as_stored(model, sd, group)
        if as_stored.keys() == set(group) and all(as_stored[k].shape == sd[k].shape for k in group):
            for k in group:  # stored as kept in memory: read this rank's rows alone
                _read_own_rows(sd[k], stored[k][0], k)
            continue
        _read_own_elements(model, sd, group, stored, folder)


def _own_flat(sd: dict[str, Any], group: list[str]) -> list[torch.Tensor]:
    """For each in-memory tensor of ``group`` (one layer's), the flat indices (into the group's
    tensors laid end to end) of the elements this rank holds, in its local shard's order: a DTensor's
    placement applied to an index tensor (``src_data_rank=None``: no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = []
    for k, index in _flat_indices(sd, group).items():
        if isinstance(sd[k], DTensor):
            own = distribute_tensor(index, sd[k].device_mesh, sd[k].placements, src_data_rank=None)
            index = own.to_local().cpu()
        out.append(index)
    return out


def _read_own_elements(
    model: nn.Module, sd: dict[str, Any], group: list[str], stored: dict[str, Any], folder: Path
) -> None:
    """One layer stored otherwise than kept in memory (experts one tensor each, fused in memory): the
    stored tensors holding none of this rank's elements are never read (under FSDP2 or expert
    parallelism: the other ranks' experts); of the others, this rank keeps its own elements."""
    from safetensors import safe_open

    total = sum(sd[k].numel() for k in group)
    pos = torch.full((total,), -1, dtype=torch.int32 if total < 2**31 else torch.int64)
    shapes, count = [], 0  # pos: for each element of the layer, its place among this rank's (-1: not its)
    for own in _own_flat(sd, group):  # (int32/int64 indices throughout: no int64 copy of the layer)
        pos[own.flatten()] = torch.arange(count, count + own.numel(), dtype=pos.dtype)
        shapes.append(tuple(own.shape))
        count += own.numel()
    local = torch.empty(count, dtype=sd[group[0]].dtype)
    filled = torch.zeros(count, dtype=torch.bool)
    for name, where in layout_of(model, sd, group).items():
        at = pos[where.flatten()]
        mine = at >= 0
        if not bool(mine.any()):
            continue  # none of this rank's elements: not read
        with safe_open(str(stored[name][0]), "pt") as f:
            value = f.get_tensor(name).flatten()
        local[at[mine]] = value[mine].to(local.dtype)
        filled[at[mine]] = True
    if not bool(filled.all()):
        raise GspoError(f"{folder}: the stored tensors do not cover {group[0]!r}'s layer")
    offset = 0
    for k, shape in zip(group, shapes, strict=True):
        n = math.prod(shape)
        _local(sd[k]).copy_(local[offset : offset + n].view(shape))
        offset += n


def _local(param: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def _read_own_rows(param: Any, file: Path, name: str) -> None:
    """Read ``param``'s rows of tensor ``name`` from ``file``: a dim-0 shard (FSDP2's, in
    ``torch.chunk``'s split) reads only its rows; anything else the whole tensor."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, Shard

    with safe_open(str(file), "pt") as f:
        part = f.get_slice(name)
        if not isinstance(param, DTensor):
            return param.copy_(part[:])
        mesh, local = param.device_mesh, param.to_local()
        if mesh.ndim != 1 or tuple(param.placements) != (Shard(0),) or param.dim() == 0:
            return _copy_own_rows(param, part[:])
        rows, parts = param.shape[0], mesh.size()
        chunk = -(-rows // parts)
        start = min(mesh.get_local_rank() * chunk, rows)
        if local.shape[0]:
            local.copy_(part[start : start + local.shape[0]])


def _copy_own_rows(param: Any, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``param`` (a DTensor shard: distributed from the local
    ``full`` with ``src_data_rank=None``, which communicates nothing)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        own = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(own.to_local())
    else:
        param.copy_(full)
