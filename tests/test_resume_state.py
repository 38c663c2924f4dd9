"""Exact resume, one piece of state at a time.

A run stopped after step 3 and resumed must end with the weights of an uninterrupted run. That check is
only as strong as its settings: here every step moves the weights (a reward with noise from every
global generator), the learning rate is still warming up, and step 4 samples, draws prompts and scores
with state that lives in the checkpoint. Each test then resumes once more with one piece of that state
left at what a fresh run would have (a mutant of ``CheckpointManager.restore``) and asserts the result differs: the
resume check would catch a resume that forgot that piece.
"""

import copy
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gspo import Config, train
from gspo.errors import GspoError
from gspo.training.checkpoints import CheckpointManager
from gspo.training.run import RunState, Trainer

REWARD = f"{Path(__file__).parent / 'fixture_rewards.py'}:noisy"
BASE = dict(
    sft_steps=5, eval_size=4, prompts_per_step=4, group_size=4, max_new_tokens=6, eval_every=0, save_every=1,
    threads=1, progress=False, warmup_steps=64, reward=REWARD,
)  # fmt: skip
SYNC = dict(BASE, steps=4)
ASYNC = dict(BASE, steps=4, async_staleness=2)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _Runs:
    """An uninterrupted run, and its folder as a kill -9 right after checkpoint ``stop_at`` leaves it."""

    def __init__(self, root: Path, settings: dict, stop_at: int) -> None:
        self.root, self.settings = root, settings
        res = train(Config(name="run", output_dir=str(root), **settings))
        self.straight = _params(res.model)
        self.saved = root / "killed"
        shutil.copytree(res.run_dir, self.saved)
        ckpts = self.saved / "checkpoints"
        for later in (p for p in ckpts.glob("step-*") if int(p.name.split("-")[1]) > stop_at):
            shutil.rmtree(later)
        (ckpts / "latest").write_text(f"step-{stop_at:06d}")
        shutil.rmtree(self.saved / "final")
        self.at_stop = _params(AutoModelForCausalLM.from_pretrained(ckpts / f"step-{stop_at:06d}"))

    def resume(self) -> dict[str, torch.Tensor]:
        """Resume the killed run (from the same files every time) to the end."""
        run_dir = self.root / "run"
        shutil.rmtree(run_dir)
        shutil.copytree(self.saved, run_dir)
        res = train(Config(name="run", output_dir=str(self.root), resume=True, **self.settings))
        return _params(res.model)


@pytest.fixture(scope="module")
def sync_runs(tmp_path_factory) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("sync"), SYNC, stop_at=3)


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory) -> _Runs:
    return _Runs(tmp_path_factory.mktemp("async"), ASYNC, stop_at=3)


def _forget(piece: str) -> Callable[..., None]:
    """``CheckpointManager.restore`` that leaves ``piece`` as a fresh (not resumed) run has it."""
    restore = CheckpointManager.restore

    def mutant(manager: CheckpointManager, state: dict, *args, **kw) -> None:
        trainer = next(p for p in manager.parts if isinstance(p, Trainer))
        run_state = next(p for p in manager.parts if isinstance(p, RunState))
        fresh = {
            "sample_gen": run_state.sample_gen.get_state(),
            "scheduler": copy.deepcopy(trainer.scheduler.state_dict()),
            "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state(),
            "torch_rng": torch.get_rng_state(),
        }
        restore(manager, state, *args, **kw)
        if piece == "optimizer":
            manager.optimizer.state.clear()  # AdamW's moments, as a fresh optimizer has them
        elif piece == "scheduler":
            trainer.scheduler.load_state_dict(fresh["scheduler"])
        elif piece == "sample_gen":
            run_state.sample_gen.set_state(fresh["sample_gen"])
        elif piece == "data_pos":
            run_state.data_pos = 0
        elif piece == "python_rng":
            random.setstate(fresh["python_rng"])
        elif piece == "numpy_rng":
            np.random.set_state(fresh["numpy_rng"])
        elif piece == "torch_rng":
            torch.set_rng_state(fresh["torch_rng"])

    return mutant


def test_resumed_run_equals_the_uninterrupted_one_and_every_step_moves_the_weights(sync_runs):
    """The check the mutants below must fail: resumed == straight, bit for bit, and the step after the
    stop changed the weights (a resume check on weights that never move proves nothing)."""
    assert not _equal(sync_runs.at_stop, sync_runs.straight)
    assert _equal(sync_runs.resume(), sync_runs.straight)
    rows = [r for r in _metrics(sync_runs.saved) if r["step"] > 0]
    assert len(rows) == 4 and all(r["loss/grad_norm"] > 0 for r in rows)


@pytest.mark.parametrize(
    "piece", ["optimizer", "scheduler", "sample_gen", "data_pos", "python_rng", "numpy_rng", "torch_rng"]
)
def test_resume_that_forgets_a_piece_of_state_is_caught(sync_runs, monkeypatch, piece):
    monkeypatch.setattr(CheckpointManager, "restore", _forget(piece))
    assert not _equal(sync_runs.resume(), sync_runs.straight), f"resume without {piece} went unnoticed"


def test_async_resume_is_exact_and_needs_the_batches_in_flight(async_runs, monkeypatch):
    """Stopped at step 3 with two batches in flight (sampled from versions 1 and 2, which no checkpoint
    holds): the resumed run equals the uninterrupted one only with those batches restored."""
    assert _equal(async_runs.resume(), async_runs.straight)
    from gspo import launch as run_mod

    make = run_mod.make_sampler

    def forgetful(*a, state=None, **kw):  # the sampler is handed the checkpoint without its batches
        return make(
            *a, state=None if state is None else {k: v for k, v in state.items() if k != "in_flight"}, **kw
        )

    monkeypatch.setattr(run_mod, "make_sampler", forgetful)
    try:
        forgot = async_runs.resume()
    except GspoError:  # the sampler refuses to serve a step it never sampled: caught as well
        return
    assert not _equal(forgot, async_runs.straight)


def _metrics(run_dir: Path) -> list[dict]:
    from gspo.training.logger import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")
