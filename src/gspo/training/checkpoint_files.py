"""The files of a checkpoint (what :class:`gspo.training.checkpoints.CheckpointManager` writes and reads):
atomic, verified checkpoints: HF-layout weights (safetensors) + optimizer, step, data position, RNG.

Layout under ``<run_dir>/checkpoints``::

    step-000050/          model.safetensors, config.json, tokenizer files  (from_pretrained-able)
                          trainer_state.pt (optimizer, scheduler, step, data position, RNG states)
                          manifest.json (size and sha256 of every other file; written last)
    step-000050/          sharded (FSDP2 on N ranks): dcp/ (each rank's model and optimizer shards,
                          torch.distributed.checkpoint), config.json, tokenizer, trainer_state.pt
                          (no optimizer), manifest.json; ``gspo export`` makes it an HF folder
    latest                text file naming the newest complete checkpoint

A checkpoint is written to ``step-N.tmp`` and renamed when complete; ``latest`` is replaced with
``os.replace``. A ``kill -9`` at any moment leaves either the old or the new checkpoint, never half.

Nothing in a checkpoint is executed: ``trainer_state.pt`` holds only tensors, numbers, strings, lists
and dicts and is read with ``torch.load(weights_only=True)`` (which refuses anything else, a planted
pickle payload included); RNG states are stored as tensors. :func:`newest_complete` picks the newest
checkpoint whose files match its manifest and whose state has every entry a resume needs.

Sharded checkpoints (FSDP2 over several ranks, without LoRA): ``dcp/`` holds each rank's model and
optimizer shards (``__<rank>_0.distcp``) and ``.metadata``. DCP reshards on load, so such a checkpoint
resumes at the world size it was written at (bit-exact) and at another one. Torch's reader unpickles
``.metadata`` with plain ``pickle``; :func:`load_shards` reads it through gspo.compat.torch_dcp's
allowlist instead. :func:`gspo.model.export.check_dcp` finds a damaged shard folder whose manifest was
rewritten to match.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import random
import re
import shutil
import stat
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from filelock import Timeout, UnixFileLock
from torch import nn

from gspo.compat.torch_dcp import SafePlanner, SafeReader
from gspo.errors import GspoError
from gspo.model.export import DCP_DIR, DCP_MODEL_KEY, failure, write_failure

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
# what a resume reads from trainer_state.pt (a state without one of these cannot continue exactly)
REQUIRED = ("optimizer", "scheduler", "step", "data_pos", "sample_gen", "rng", "config")


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states as tensors and numbers (loadable with ``weights_only``)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "mt": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["mt"].tolist()), py["gauss"]))
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def file_entry(path: Path) -> dict[str, Any]:
    """A file's manifest entry (size and sha256), fsynced first."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def shard_files(folder: Path) -> list[str]:
    """The shard files of a sharded checkpoint (``dcp/*.distcp``), as manifest names, in order."""
    return sorted(p.relative_to(folder).as_posix() for p in (folder / DCP_DIR).glob("*.distcp"))


def share(names: list[str], rank: int, world: int) -> list[str]:
    """The files of ``names`` rank ``rank`` of ``world`` checksums (every world-th one: a checkpoint
    written on any number of ranks is verified by the ranks resuming it, each its share)."""
    return names[rank::world]


def write_manifest(folder: Path, known: dict[str, dict[str, Any]] | None = None) -> None:
    """``manifest.json``: size and sha256 of every file under ``folder`` (fsynced, then itself);
    ``known``: entries the ranks that wrote those files computed (each rank its own shards)."""
    entries = {}
    for f in _files(folder):
        name = f.relative_to(folder).as_posix()
        entry = (known or {}).get(name)
        ok = entry is not None and entry["size"] == f.stat().st_size
        entries[name] = entry if ok else file_entry(f)
    path = folder / MANIFEST
    path.write_text(json.dumps({"files": entries}, indent=1))
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _remove(path: Path) -> None:
    """Delete what is at ``path`` (a folder, a file or a symlink, never followed), if anything."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def begin_checkpoint(run_dir: Path, step: int) -> Path:
    """The empty ``step-N.tmp`` folder checkpoint ``step`` is written into."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"step-{step:06d}.tmp"
    _remove(tmp)
    tmp.mkdir()
    return tmp


def save_checkpoint(
    run_dir: Path,
    step: int,
    save_model: Any,
    trainer_state: dict[str, Any],
    keep: int = 2,
    tmp: Path | None = None,
    known: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically. ``save_model(path)`` writes the HF weights + tokenizer
    (or, for a sharded checkpoint whose shards are already in ``tmp``, the config and tokenizer;
    ``known``: their manifest entries, each computed by the rank that wrote the file)."""
    root = run_dir / "checkpoints"
    final = root / f"step-{step:06d}"
    try:
        tmp = tmp if tmp is not None else begin_checkpoint(run_dir, step)
        save_model(tmp)
        torch.save(trainer_state, tmp / TRAINER_STATE)
        write_manifest(tmp, known)  # last: a folder with a matching manifest is complete
    except BaseException:  # a full disk, Ctrl-C: no half checkpoint left behind (``latest`` is untouched)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove(final)
    os.replace(tmp, final)
    latest_tmp = root / "latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    prune(run_dir, keep, final)
    return final


FINAL = "final"
FINAL_TMP = ".final.tmp"  # final/ while it is written (renamed to final/ when complete)


def write_final(run_dir: Path, write: Any, kept: int) -> Path:
    """The run's ``final/`` folder: ``write(path)`` fills ``.final.tmp`` beside it, every file is
    fsynced and the folder renamed to ``final/`` (replacing an older one): a ``final/`` is always
    complete. A failed write (a full disk) removes the half-written folder and is one line naming the
    free space and the checkpoint kept (``kept``: its step), from which ``--resume`` writes it again."""
    final, tmp = run_dir / FINAL, run_dir / FINAL_TMP
    try:
        _remove(tmp)  # left by a kill while an earlier one was written
        tmp.mkdir()
        write(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        _remove(final)
        os.replace(tmp, final)
        _fsync_dir(run_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        why = write_failure(e)
        if why is None:
            raise
        where = f"step {kept}" if kept >= 0 else "none"
        raise GspoError(
            f"cannot write the final model {final} ({free_space(run_dir)}): {why}; the last complete "
            f"checkpoint is kept ({where}): make room and run again (gspo train: add --resume) to write it"
        ) from None
    return final


def final_complete(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` finished: ``final/`` holds its config and its weights,
    ``model.safetensors`` or an index whose every named shard is there (gspo renames ``final/`` into
    place complete; an older gspo wrote it in place, which a full disk could cut to config.json)."""
    final = run_dir / FINAL
    if not (final / "config.json").is_file():
        return False
    if (final / "model.safetensors").is_file():
        return True
    try:
        shards = set(json.loads((final / "model.safetensors.index.json").read_text())["weight_map"].values())
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return bool(shards) and all(isinstance(f, str) and (final / f).is_file() for f in shards)


def free_space(path: Path) -> str:
    """How much room the disk holding ``path`` has left, for a message."""
    try:
        return f"{shutil.disk_usage(path).free / 2**30:.1f} GiB free there"
    except OSError:
        return "free space unknown"


# stray step folders already reported by this process (one warning each, not one per checkpoint)
_warned_strays: set[Path] = set()


def prune(run_dir: Path, keep: int, newest: Path) -> None:
    """Delete all but the ``keep`` newest checkpoints gspo wrote (those with a manifest; never
    ``newest``). A ``step-N`` folder without one is not gspo's: it neither counts nor is deleted."""
    import sys

    folders = step_folders(run_dir)
    ours = [p for p in folders if (p / MANIFEST).is_file()]
    for old in ours[:-keep]:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)
    strays = [p for p in folders if p not in ours and p not in _warned_strays]
    if strays:
        _warned_strays.update(strays)
        names = ", ".join(p.name for p in strays)
        print(
            f"gspo: warning: {run_dir}/checkpoints holds {names} without {MANIFEST} (not a checkpoint gspo "
            "completed): not counted as a kept checkpoint and never deleted by gspo",
            file=sys.stderr,
            flush=True,
        )


def step_folders(run_dir: Path) -> list[Path]:
    """Finished-looking ``step-N`` folders, oldest first (complete or not)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    # by step number, not name: step-2 is older than step-000010; a name that is no step is skipped
    steps = [p for p in root.glob("step-*") if p.is_dir() and re.fullmatch(r"step-\d+", p.name)]
    return sorted(steps, key=lambda p: int(p.name.split("-")[1]))


def check_manifest(path: Path, required: tuple[str, ...] = (), hashed: set[str] | None = None) -> str:
    """Why the files of ``path`` do not match its manifest ("" when they all do). ``hashed``: the
    only files whose checksum is compared (default: all; the sizes of all are compared)."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        entries = [(str(name), want.get("size"), want.get("sha256")) for name, want in files.items()]
    except FileNotFoundError:
        return f"no {MANIFEST} (written last: incomplete, or written by an older gspo)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__})"
    outside = next((name for name, _, _ in entries if not _inside(path, name)), None)
    if outside is not None:  # never stat, read or hash a file elsewhere (a planted or damaged manifest)
        return f"{MANIFEST} lists {outside!r:.80}: a path out of the checkpoint folder (damaged or planted)"
    missing = [r for r in required if r not in files]
    if missing:
        return f"{MANIFEST} lists no {missing[0]}"
    for name, size, sha in entries:
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {size} (truncated?)"
        if (hashed is None or name in hashed) and _sha256(f) != sha:
            return f"{name} does not match its checksum in the manifest (modified or damaged)"
    return ""


def _inside(folder: Path, name: str) -> bool:
    """Whether the manifest name ``name`` is a relative path to a file within ``folder`` (no ``..``,
    not absolute, no symlink out of it)."""
    parts = PurePosixPath(name).parts
    if not parts or PurePosixPath(name).is_absolute() or ".." in parts:
        return False
    try:
        return (folder / name).resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL in the name
        return False


def check_share(path: Path, rank: int, world: int) -> str:
    """Why this rank's share of ``path``'s shard files (:func:`share`) does not match the manifest."""
    return check_manifest(path, hashed=set(share(shard_files(path), rank, world)))


def _files_names(path: Path) -> list[str]:
    return [f.relative_to(path).as_posix() for f in _files(path)]


def _manifest_names(path: Path) -> list[str]:
    return list(json.loads((path / MANIFEST).read_text())["files"])


def verify(path: Path, shards: bool = True) -> tuple[dict[str, Any] | None, str]:
    """``(trainer state, "")`` for a complete checkpoint, else ``(None, why not)``. ``shards``:
    checksum the shard files too (else only their sizes: each rank checks its share, :func:`check_share`)."""
    hashed = None if shards else set(_files_names(path)) - set(shard_files(path))
    why = check_manifest(path, (TRAINER_STATE, "config.json"), hashed)
    names = [] if why else _manifest_names(path)
    if not why and not any(n.endswith(".safetensors") or n == f"{DCP_DIR}/.metadata" for n in names):
        why = f"{MANIFEST} lists no weights (*.safetensors, or {DCP_DIR}/ shards)"
    if not why and f"{DCP_DIR}/.metadata" in names:  # shards the manifest was rewritten to match
        from gspo.model.export import check_dcp

        why = check_dcp(path)
    if why:
        return None, why
    try:
        state = load_trainer_state(path)
    except Exception as e:  # noqa: BLE001 (an unreadable or unsafe file is a damaged checkpoint)
        return None, f"{TRAINER_STATE} cannot be read safely ({type(e).__name__})"
    if not isinstance(state, dict):
        return None, f"{TRAINER_STATE} is not a dict"
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        return None, f"{TRAINER_STATE} has no {missing[0]!r} entry"
    return state, ""


def newest_complete(
    run_dir: Path, shards: bool = True, below: int | None = None
) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """The newest complete checkpoint (of a step below ``below``, if given), its trainer state, and
    why each newer one was skipped; ``shards``: as :func:`verify`."""
    check_latest(run_dir)
    skipped = []
    for path in reversed(step_folders(run_dir)):
        if below is not None and int(path.name.removeprefix("step-")) >= below:
            continue
        state, why = verify(path, shards)
        if state is not None:
            return path, state, skipped
        skipped.append(f"{path.name}: {why}")
    return None, None, skipped


def check_latest(run_dir: Path) -> None:
    """Refuse, before a step is trained, a ``latest`` (or ``latest.tmp``) that every checkpoint would
    fail to replace: a folder, or anything else that is not a file or a symlink."""
    for name in ("latest", "latest.tmp"):
        p = run_dir / "checkpoints" / name
        if (p.exists() or p.is_symlink()) and not (p.is_symlink() or p.is_file()):
            kind = "a folder" if p.is_dir() else "not a file"
            raise GspoError(
                f"{p} is {kind}: gspo writes a file there naming the newest checkpoint after each one, "
                "so no checkpoint could be saved; move it away and run again"
            )


def load_trainer_state(path: Path) -> dict[str, Any]:
    # weights_only: tensors and plain containers only; a pickled object (code) is refused, not run
    return torch.load(path / TRAINER_STATE, weights_only=True)


# ------------------------------------------------------------------------------------------------
# the run folder: one writer, and nothing of an earlier run overwritten without asking

LOCK = ".gspo.lock"
# what a run writes into its folder: any of these means the folder holds (part of) a run
TRACES = ("config.yaml", "metrics.jsonl", "checkpoints", FINAL, FINAL_TMP, "tensorboard", "curves.png")


def lock_run_dir(run_dir: Path) -> UnixFileLock:
    """Take the run folder's lock (``flock`` on ``.gspo.lock`` through filelock; the OS drops it when
    the process ends, kill -9 included) and record our PID in it. Returns the lock: hold a reference
    until :func:`unlock_run_dir` (a collected lock is released)."""
    path = run_dir / LOCK
    # never soft (a marker file a crash would leave behind), one holder for every thread; the file
    # is opened without following a symlink (it would truncate the file it points to)
    own = functools.partial(_own_lock, run_dir)
    lock = UnixFileLock(
        path, mode=0o644, thread_local=False, blocking=False, fallback_to_soft=False, on_acquired=own
    )
    try:
        lock.acquire()
    except Timeout:
        raise GspoError(
            f"run folder {run_dir} is in use by another gspo process (PID {_lock_holder(path)}); wait for "
            "it to end or stop it, or pick another --name"
        ) from None
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
            raise GspoError(
                f"run folder {run_dir} cannot be written ({e.strerror}): a run keeps its lock, checkpoints "
                "and metrics there; make it writable (or copy the run to a folder that is) and run again"
            ) from None
        hint = "; it must be a plain file: remove it" if e.errno in (errno.ELOOP, errno.EISDIR) else ""
        raise GspoError(  # a folder, a symlink (never followed), a filesystem without flock
            f"run folder {run_dir}: cannot use {LOCK} as its lock file ({e.strerror}){hint}"
        ) from None
    return lock


def _own_lock(run_dir: Path, fd: int) -> None:
    """filelock's ``on_acquired``: refuse a FIFO or a device (raising releases the lock), then write
    our PID for the next run's message."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise GspoError(f"run folder {run_dir}: {LOCK} is not a plain file; remove it")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def _lock_holder(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return "unknown"
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)


def unlock_run_dir(lock: UnixFileLock | None) -> None:
    if lock is not None:
        try:
            lock.release()
        except OSError:
            pass


def run_traces(run_dir: Path) -> list[str]:
    """The names in ``run_dir`` an earlier run left (empty for a new folder)."""
    return [name for name in TRACES if (run_dir / name).exists()]


def remove_traces(run_dir: Path) -> None:
    """Delete what a run writes (the folder's other files, if any, are left alone)."""
    for name in TRACES:
        _remove(run_dir / name)


# ------------------------------------------------------------------------------------------------
# sharded checkpoints (FSDP2 on N ranks): each rank writes and reads its own shards with torch.distributed.checkpoint
#
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


def save_shards(policy: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> bool:
    """Write this rank's shards of the model and optimizer under ``folder/dcp`` (collective). An
    optimizer that has not stepped yet is not saved (torch's state-dict API would initialise it with
    a zero step, which shifts AdamW's bias correction). Returns whether the optimizer was saved."""
    with_optimizer = bool(optimizer.state)
    dcp.save(_states(policy, optimizer if with_optimizer else None), checkpoint_id=str(folder / DCP_DIR))
    return with_optimizer


def load_shards(
    policy: nn.Module, optimizer: torch.optim.Optimizer, folder: Path, with_optimizer: bool
) -> None:
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
