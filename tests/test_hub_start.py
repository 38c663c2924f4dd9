"""A hub model's start and resume (issue 57): on several ranks only each node's local rank 0 asks the
hub (its snapshot, fetched under the cache's ``flock``), every other read is of the local snapshot;
``save_dtype auto`` reads the stored dtype from the snapshot, not the hub at plan time; a resume reads
the config, the tokenizer and the weights from the checkpoint, needing neither the hub nor its cache.
The cache lock is a kernel ``flock``: a second holder waits (bounded, said), a killed holder's lock
goes with it, a filesystem without ``flock`` is said in one line.

The hub is a folder laid out as huggingface_hub's cache (no network), the 2-rank contexts are one
process's view of a rank (no process group: the node's gather is the rank's own answer). Through
``gspo train --nproc 2`` on gloo: tests/test_hub_shards.py (slow)."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from gspo import launch, resolve
from gspo.config import make_config
from gspo.errors import GspoError
from gspo.model import hub_lock
from gspo.model.load import AUTO_DTYPE, build_char_tokenizer, build_tiny_dense, save_pretrained
from gspo.training.checkpoints import CheckpointManager
from gspo.training.distributed import DistContext
from gspo.training.sft import load_start

REPO = "gspo-test/tiny-dense"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """(cache, snapshot): a tiny bf16 model where huggingface_hub's cache keeps ``REPO``; the client
    offline and pointed at it (its constants are read at each call)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    entry = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = entry / "snapshots" / COMMIT
    tok = build_char_tokenizer()
    save_pretrained(build_tiny_dense(len(tok), seed=3).to(torch.bfloat16), tok, snapshot)
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache, snapshot


@pytest.fixture
def reads(monkeypatch):
    """Every ``from_pretrained`` of a config or tokenizer: what it was asked to read."""
    asked: list[str] = []
    for cls in (AutoConfig, AutoTokenizer):
        real = cls.from_pretrained.__func__

        def spy(klass, name, *a, _real=real, **kw):
            asked.append(str(name))
            return _real(klass, name, *a, **kw)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    return asked


def _plan(tmp_path: Path, **over):
    cfg = make_config(None, {"model": REPO, "output_dir": str(tmp_path / "runs"), "threads": 1, **over})
    return cfg, resolve.resolve(cfg)


def _ctx(local_rank: int) -> DistContext:
    return DistContext(rank=local_rank, world_size=2, local_rank=local_rank, device=torch.device("cpu"))


def test_the_plan_asks_no_hub_for_a_hub_models_dtype(tmp_path, hub, reads):
    _, plan = _plan(tmp_path)
    assert plan.loop.save_dtype == AUTO_DTYPE and reads == []  # read once the files are local


@pytest.mark.parametrize("local_rank", [0, 1])
def test_several_ranks_read_a_hub_model_from_the_node_snapshot(tmp_path, hub, reads, local_rank, capfd):
    """Local rank 0 fetches the snapshot under the cache's lock, the others find it; then every read
    (config, tokenizer, save_dtype auto's stored dtype) is of the snapshot folder, none of the hub id."""
    cache, snapshot = hub
    cfg, plan = _plan(tmp_path)
    manager = CheckpointManager(plan.checkpoints)
    load, from_checkpoint = launch._load_plan(plan, _ctx(local_rank), manager, None, None, True)
    start = load_start(load, torch.device("cpu"), meta=True)
    assert Path(load.model) == snapshot and not from_checkpoint
    assert reads and all(Path(r) == snapshot for r in reads), reads
    assert manager.source_dtype == "bfloat16" and len(start.tokenizer) == len(build_char_tokenizer())
    err = capfd.readouterr().err
    assert ("fetches" in err) == (local_rank == 0) and ("wait for local rank 0" in err) == (local_rank == 1)
    assert (hub_lock.lock_path(REPO, cache).is_file()) == (local_rank == 0)


def test_a_resume_of_a_hub_model_needs_no_hub_nor_cache(tmp_path, hub, reads):
    """The checkpoint being resumed holds the config, the tokenizer and the weights: read from it (the
    cache deleted first), the stored dtype from the checkpoint's state; with LoRA, the frozen base."""
    cache, snapshot = hub
    cfg, plan = _plan(tmp_path)
    step = cfg.run_dir / "checkpoints" / "step-000001"
    shutil.copytree(snapshot, step)
    shutil.rmtree(cache)
    manager = CheckpointManager(plan.checkpoints)
    state = {"source_dtype": "bfloat16"}
    load, from_checkpoint = launch._load_plan(plan, _ctx(1), manager, step, state, False)
    start = load_start(load, torch.device("cpu"))  # the weights too (one process, no shards)
    assert (Path(load.model), load.tokenizer, from_checkpoint) == (step, None, True)
    assert reads and all(Path(r) == step for r in reads) and manager.source_dtype == "bfloat16"
    want = AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32).state_dict()
    got = start.model.state_dict()  # the checkpoint's weights, in the run's dtype
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # LoRA: the weights come from checkpoints/lora-base, checked against its manifest
    _, lora = _plan(tmp_path, lora_rank=4)
    with pytest.raises(GspoError, match="lora-base"):
        launch._load_plan(lora, _ctx(0), CheckpointManager(lora.checkpoints), step, state, False)


def test_a_hub_tokenizer_on_several_ranks_is_read_from_its_snapshot(tmp_path, hub, reads):
    cache, snapshot = hub
    local = tmp_path / "local-model"
    shutil.copytree(snapshot, local)
    cfg, plan = _plan(tmp_path, model=str(local), tokenizer=REPO)
    load, _ = launch._load_plan(plan, _ctx(1), CheckpointManager(plan.checkpoints), None, None, False)
    assert Path(load.tokenizer) == snapshot and Path(load.model) == local


# ------------------------------------------------------------------------------------------------
# the cache's lock


def _holder(cache: Path) -> int:
    """Another process holding the cache's lock on ``REPO`` with gspo's own lock (as another job's
    download would): a fork, so that it starts at once; its pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: take the lock, say so, hold it until killed
        try:
            os.close(r)
            with hub_lock.cache_lock(REPO, None, cache):
                os.write(w, b"held")
                time.sleep(600)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 4) == b"held"
    os.close(r)
    return pid


def test_the_cache_lock_waits_bounded_and_a_killed_holders_lock_goes_with_it(tmp_path, capfd):
    cache = tmp_path / "hub"
    pid = _holder(cache)
    try:
        t0 = time.monotonic()
        with pytest.raises(GspoError, match="held the hub cache's lock") as e:
            with hub_lock.cache_lock(REPO, 0.3, cache, poll_s=0.05):
                pass
        assert "\n" not in str(e.value) and time.monotonic() - t0 < 5
        assert "another node or job is downloading" in capfd.readouterr().err
        os.kill(pid, signal.SIGKILL)  # a job killed mid-download: the kernel drops its flock
        os.waitpid(pid, 0)
        pid = 0
        with hub_lock.cache_lock(REPO, 0.3, cache, poll_s=0.05) as held:
            assert held
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_filesystem_without_flock_is_said_and_the_download_goes_ahead(tmp_path, monkeypatch, capfd):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(hub_lock.fcntl, "flock", no_flock)  # what NFS without a lock manager answers
    ran = []
    with hub_lock.cache_lock(REPO, 1.0, tmp_path / "hub") as held:
        ran.append(held)
    assert ran == [False]
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "without flock" in err[0] and ".locks" in err[0], err


def test_the_node_snapshot_fetches_under_the_lock(tmp_path, hub, monkeypatch):
    """Local rank 0's download runs holding the lock (another job's download waits for it)."""
    from gspo.model import load as load_mod
    from gspo.training import distributed as D

    cache, snapshot = hub
    real, seen = load_mod.hub_snapshot, []

    def spy(repo_id, *a, **kw):
        probe = os.open(hub_lock.lock_path(repo_id, cache), os.O_RDWR)
        try:  # held by the caller: a second open file description cannot take it
            hub_lock.fcntl.flock(probe, hub_lock.fcntl.LOCK_EX | hub_lock.fcntl.LOCK_NB)
            seen.append("free")
        except BlockingIOError:
            seen.append("held")
        finally:
            os.close(probe)
        return real(repo_id, *a, **kw)

    monkeypatch.setattr(load_mod, "hub_snapshot", spy)
    assert D.node_snapshot(REPO, _ctx(0)) == snapshot and seen == ["held"]
