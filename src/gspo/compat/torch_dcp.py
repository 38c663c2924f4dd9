"""A torch.distributed.checkpoint reader that never unpickles code (torch 2.13).

torch reads DCP's ``.metadata`` with plain ``pickle.load`` and the non-tensor entries of a shard
(the optimizer's param groups) with ``torch.load(weights_only=False)``: a planted checkpoint would
run its code on ``--resume`` or ``gspo export``. :class:`SafeReader` replaces
``FileSystemReader.read_metadata`` (an internal method: it reimplements what torch 2.13's does
after unpickling, setting ``storage_meta.load_id``) and reads the index through an allowlist of
DCP's own record types; :class:`SafePlanner` checks every non-tensor entry with ``weights_only``
first. ``UPSTREAM`` names what this relies on (tests/test_compat.py); ``applies()`` says whether the
installed torch is one it was written for.
"""

from __future__ import annotations

import copyreg
import dataclasses
import enum
import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from gspo.compat import installed_version

UPSTREAM: list[tuple[str, str]] = [
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader.read_metadata"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.default_planner", "DefaultLoadPlanner.load_bytes"),
]


def applies() -> bool:
    """Written for torch 2.13's DCP index format (the record modules below)."""
    v = installed_version("torch")
    return v is not None and v[:2] >= (2, 13)


# the modules whose record types (dataclasses, enums) a DCP index is made of
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
# how a torch.layout pickles (a function of torch's serialization module, found without naming it)
_LAYOUT_LOADER = copyreg.dispatch_table[torch.layout](torch.strided)[0]


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` from plain records only: DCP's dataclasses and enums, sizes,
    dtypes, layouts and paths. Anything else (a callable of any other module) is refused, not run."""

    def find_class(self, module: str, name: str) -> Any:
        obj = super().find_class(module, name)
        record = module in _DCP_MODULES and isinstance(obj, type)
        record = record and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
        if record or obj is torch.Size or isinstance(obj, torch.dtype) or obj is _LAYOUT_LOADER:
            return obj
        if obj in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath):
            return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


class SafeReader(dcp.FileSystemReader):
    """torch's file-system reader with ``.metadata`` read by :class:`_IndexUnpickler`."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.folder = Path(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        with open(self.folder / ".metadata", "rb") as fh:
            metadata = _IndexUnpickler(fh).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"the index holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class SafePlanner(dcp.DefaultLoadPlanner):
    """torch's load planner with every non-tensor entry checked by ``torch.load(weights_only=True)``
    before torch's own (unrestricted) load of the same bytes."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(io.BytesIO(value.getvalue()), weights_only=True)
        except pickle.UnpicklingError:
            raise pickle.UnpicklingError(
                f"entry {read_item.dest_index.fqn!r} is not plain data (a pickled callable?): refused"
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)
