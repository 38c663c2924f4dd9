"""Atomic checkpoints: HF-layout weights (safetensors) + optimizer, step, data position, RNG states.

Layout under ``<run_dir>/checkpoints``::

    step-000050/          model.safetensors, config.json, tokenizer files  (from_pretrained-able)
                          trainer_state.pt (optimizer, scheduler, step, data position, RNG states)
    latest                text file naming the newest complete checkpoint

A checkpoint is written to ``step-N.tmp`` and renamed when complete; ``latest`` is replaced with
``os.replace``. A ``kill -9`` at any moment leaves either the old or the new checkpoint, never half.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: Path, step: int, save_model: Any, trainer_state: dict[str, Any], keep: int = 2
) -> Path:
    """Write checkpoint ``step`` atomically. ``save_model(path)`` writes the HF weights + tokenizer."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f"step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_model(tmp)
        torch.save(trainer_state, tmp / "trainer_state.pt")
        for f in (p for p in tmp.rglob("*") if p.is_file()):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    except BaseException:  # a full disk, Ctrl-C: no half checkpoint left behind (``latest`` is untouched)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / "latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    return path if (path / "trainer_state.pt").exists() else None


def load_trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(path / "trainer_state.pt", weights_only=False)
