"""Runs that survive their own files: checkpoints that never execute code and are verified on resume,
run folders never overwritten without asking and written by one process at a time, children that die
with their parent, and a single Ctrl-C / SIGTERM that ends any phase within seconds.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import TINY, one_line
from cli_helpers import gspo as _gspo
from cli_helpers import popen as _popen

from gspo.config import Config
from gspo.errors import GspoError
from gspo.resolve import checkpoint_plan
from gspo.training import checkpoint_files as ckpt
from gspo.training.checkpoints import CheckpointManager


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A finished 2-step run with checkpoints step-000001 and step-000002 (copied by each test)."""
    out = tmp_path_factory.mktemp("base")
    r = _gspo("train", *TINY, "--steps", "2", "--save-every", "1", "--output-dir", str(out), "--name", "r")
    assert r.returncode == 0, r.stderr[-2000:]
    return out / "r"


def _copy(base_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "r"
    shutil.copytree(base_run, run, ignore=shutil.ignore_patterns(ckpt.LOCK))
    return run


def _claim(run: Path, **kw):
    cfg = Config(output_dir=str(run.parent), name=run.name, **kw)
    checkpoints = CheckpointManager(checkpoint_plan(cfg))
    try:
        return checkpoints.claim()
    finally:
        checkpoints.release()


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_planted_pickle_payload_does_not_run(base_run, tmp_path):
    """A trainer_state.pt carrying a pickled callable (with a manifest to match, as an attacker would
    write it) is refused unread: the payload never runs and the previous checkpoint is used."""
    run = _copy(base_run, tmp_path)
    marker = tmp_path / "pwned"
    bad = run / "checkpoints" / "step-000002"
    state = torch.load(bad / ckpt.TRAINER_STATE, weights_only=True)
    torch.save({**state, "initial": _Payload(str(marker))}, bad / ckpt.TRAINER_STATE)
    ckpt.write_manifest(bad)
    with pytest.raises(Exception):  # noqa: B017 (torch's UnpicklingError)
        ckpt.load_trainer_state(bad)
    path, state, note = _claim(run, resume=True)
    assert not marker.exists()
    assert path.name == "step-000001" and state["step"] == 1
    assert "skipped newer damaged checkpoints (step-000002: trainer_state.pt cannot be read safely" in note


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _drop_rng(folder: Path) -> None:
    state = torch.load(folder / ckpt.TRAINER_STATE, weights_only=True)
    del state["rng"]
    torch.save(state, folder / ckpt.TRAINER_STATE)
    ckpt.write_manifest(folder)  # consistent files: only the missing entry is wrong


def _flip_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _drop_weights_entry(folder: Path) -> None:
    """Weights deleted and their manifest entry with them: consistent files, but nothing to load."""
    (folder / "model.safetensors").unlink()
    ckpt.write_manifest(folder)


DAMAGE = {
    "truncated-trainer-state": (lambda f: _truncate(f / "trainer_state.pt"), "trainer_state.pt has"),
    "torn-trainer-state": (
        lambda f: (f / "trainer_state.pt").write_bytes(b"PK\x03\x04torn"),
        "trainer_state.pt has 8 bytes",
    ),
    "missing-rng": (_drop_rng, "trainer_state.pt has no 'rng' entry"),
    "missing-weights": (lambda f: (f / "model.safetensors").unlink(), "model.safetensors is missing"),
    "deleted-trainer-state": (lambda f: (f / "trainer_state.pt").unlink(), "trainer_state.pt is missing"),
    "changed-weights": (lambda f: _flip_byte(f / "model.safetensors"), "does not match its checksum"),
    "no-manifest": (lambda f: (f / "manifest.json").unlink(), "no manifest.json"),
    "deeply-nested-manifest": (
        lambda f: (f / "manifest.json").write_text("[" * 100_000 + "]" * 100_000),
        "manifest.json is unreadable (RecursionError)",
    ),
    "weights-missing-from-manifest-and-disk": (_drop_weights_entry, "manifest.json lists no weights"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_resume_falls_back_to_the_newest_complete_checkpoint(base_run, tmp_path, kind):
    run = _copy(base_run, tmp_path)
    damage, why = DAMAGE[kind]
    damage(run / "checkpoints" / "step-000002")
    path, state, note = _claim(run, resume=True)
    assert path.name == "step-000001" and state["step"] == 1
    assert note.startswith(f"resuming from {run}/checkpoints/step-000001; skipped newer damaged")
    assert why in note and "\n" not in note


def test_resume_with_no_complete_checkpoint_says_why_and_how(base_run, tmp_path):
    run = _copy(base_run, tmp_path)
    for step in ("step-000001", "step-000002"):
        (run / "checkpoints" / step / "trainer_state.pt").unlink()
    with pytest.raises(
        GspoError, match="no complete checkpoint found.*trainer_state.pt is missing.*--overwrite"
    ):
        _claim(run, resume=True)


def test_damaged_run_resumes_from_the_command_line_and_drops_a_torn_metrics_line(base_run, tmp_path, capsys):
    """Through `gspo train --resume` (in-process: the command's code path without an interpreter
    start): one line names the checkpoint and why the newer one was skipped; the metrics log, whose
    last line was torn by a kill, continues from the resumed step."""
    from gspo.cli import main

    run = _copy(base_run, tmp_path)
    _truncate(run / "checkpoints" / "step-000002" / "trainer_state.pt")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rollout/rew')  # a kill in the middle of a write
    capsys.readouterr()
    rc = main(["train", *TINY, "--steps", "3", "--output-dir", str(tmp_path), "--name", "r", "--resume"])
    err = capsys.readouterr().err
    assert rc == 0, err[-2000:]
    notes = [ln for ln in err.splitlines() if ln.startswith("gspo: resuming")]
    assert len(notes) == 1 and "step-000001; skipped newer damaged checkpoints (step-000002: " in notes[0]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]


def test_torn_metrics_line_is_dropped_on_read(tmp_path):
    from gspo.training.logger import read_metrics

    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "x"')
    assert [r["step"] for r in read_metrics(p)] == [0, 1]
    p.write_text('{"step": 0}\n{"ste\n{"step": 2}\n')
    with pytest.raises(GspoError, match="line 2 is not valid JSON"):
        read_metrics(p)


def test_a_run_folder_with_any_trace_is_refused_without_resume_or_overwrite(base_run, tmp_path, capsys):
    """A run whose only checkpoints lost trainer_state.pt is refused (not silently started over), and
    its metrics kept; a folder with only a metrics log too. --overwrite starts over."""
    run = _copy(base_run, tmp_path)
    for step in ("step-000001", "step-000002"):
        (run / "checkpoints" / step / "trainer_state.pt").unlink()
    metrics = (run / "metrics.jsonl").read_text()
    args = ["train", *TINY, "--steps", "2", "--output-dir", str(tmp_path), "--name", "r"]  # in-process
    one_line(capsys, args, "already holds checkpoints; pass --resume to continue it, --overwrite")
    assert (run / "metrics.jsonl").read_text() == metrics
    only_log = tmp_path / "log-only"
    only_log.mkdir()
    (only_log / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(GspoError, match=r"already holds a run \(metrics.jsonl\) that saved no checkpoint"):
        _claim(only_log)
    with pytest.raises(GspoError, match="exclude each other"):
        _claim(run, resume=True, overwrite=True)
    path, state, _ = _claim(run, overwrite=True)
    assert path is None and state is None and ckpt.run_traces(run) == []


HOLD_LOCK = (
    "import sys, time; from pathlib import Path; from gspo.training.checkpoint_files import lock_run_dir; "
    "lock = lock_run_dir(Path(sys.argv[1])); print('locked', flush=True); time.sleep(600)"
)


def test_second_writer_gets_the_holders_pid_and_exit_2(base_run, tmp_path, capsys):
    run = _copy(base_run, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        args = ["train", *TINY, "--steps", "3", "--output-dir", str(tmp_path), "--name", "r", "--resume"]
        one_line(capsys, args, f"is in use by another gspo process (PID {holder.pid})")
        with pytest.raises(GspoError, match=f"PID {holder.pid}"):
            _claim(run, resume=True)
    finally:
        holder.kill()
        holder.wait()
    path, _, _ = _claim(run, resume=True)  # the lock died with its process (kill -9)
    assert path.name == "step-000002"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return False
    return "zombie" not in state


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_compare_workers_and_resource_tracker_die_with_the_compare(tmp_path, sig):
    args = [
        "compare", "--preset", "tiny-moe", "--seeds", "0,1", "--variants", "gspo", "--workers", "2",
        "--out", str(tmp_path / "c"), "--warm-dir", str(tmp_path / "w"), "--sft-steps", "100000",
        "--warm-target", "1.0", "--eval-size", "8",
    ]  # fmt: skip
    proc = _popen(*args)
    t0 = time.time()
    while len(kids := _children(proc.pid)) < 3:  # 2 workers + the resource tracker
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < 60, "compare did not start its workers"
        time.sleep(0.2)
    time.sleep(1.0)  # the workers are inside their warm starts
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    t0 = time.time()
    while any(_alive(k) for k in kids) and time.time() - t0 < 10:
        time.sleep(0.2)
    left = [k for k in kids if _alive(k)]
    for k in left:
        os.kill(k, signal.SIGKILL)
    assert not left, "compare's children outlived it"
    if sig == signal.SIGTERM:
        assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
        # our line, wherever multiprocessing's resource tracker puts its own shutdown warnings
        line = next(ln for ln in _lines(err) if ln.startswith("gspo: interrupted"))
        assert "run the same command again" in line and "gspo compare" in line and "--resume" not in line


def test_one_sigterm_ends_an_endless_dynamic_sampling_step(tmp_path):
    """Every group scores the same, so dynamic sampling never fills its batch: one SIGTERM says at
    once that it stops, and the run ends within seconds with step 0 saved."""
    reward = tmp_path / "flat.py"
    reward.write_text("def reward(prompts, completions, answers):\n    return [0.0] * len(completions)\n")
    proc = _popen(
        "train", *TINY, "--steps", "5", "--dynamic-sampling", "--dynamic-sampling-max-rounds", "1000",
        "--reward", f"{reward}:reward", "--output-dir", str(tmp_path), "--name", "r",
    )  # fmt: skip
    latest = tmp_path / "r" / "checkpoints" / "latest"
    t0 = time.time()
    while not latest.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < 60
        time.sleep(0.1)
    time.sleep(1.0)  # inside step 1's sampling rounds
    t1 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    # seconds, not the 1000 rounds the flag allows (8 s held on a quiet machine; 12 s seen at load 4)
    assert time.time() - t1 < 25, "the stop took too long"
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert "gspo: SIGTERM: stopping" in err and "stopping" not in out  # a notice: stderr
    assert "progress is saved at step 0; continue with --resume" in err


def test_one_sigterm_abandons_a_stuck_step_after_the_grace_period(tmp_path):
    """A reward that never returns (no time limit set): the first SIGTERM says at once it will stop,
    the step is abandoned after the grace period and the last finished step kept; no second signal."""
    from gspo.training.loop import GRACE_S

    reward = tmp_path / "stuck.py"
    reward.write_text(
        "import time\ncalls = 0\n"
        "def reward(prompts, completions, answers):\n"
        "    global calls\n    calls += 1\n"
        "    if calls > 1:  # 1: the eval at step 0\n        time.sleep(3600)\n"
        "    return [0.0] * len(completions)\n"
    )
    proc = _popen(
        "train", *TINY, "--steps", "5", "--reward", f"{reward}:reward", "--reward-timeout-s", "0",
        "--output-dir", str(tmp_path), "--name", "r",
    )  # fmt: skip
    latest = tmp_path / "r" / "checkpoints" / "latest"
    t0 = time.time()
    while not latest.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < 60
        time.sleep(0.1)
    time.sleep(0.5)
    t1 = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert time.time() - t1 < GRACE_S + 8, "the stop took too long"
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert "gspo: SIGTERM: stopping" in err and "abandoning it" in err and "gspo:" not in out
    assert "progress is saved at step 0; continue with --resume" in err
    assert latest.read_text().strip() == "step-000000"


def test_compare_run_again_reuses_finished_runs_and_continues_unfinished_ones(base_run, tmp_path):
    """What the compare's interrupt message promises: running the same command again reuses a finished
    run, continues an unfinished one from its newest complete checkpoint, and redoes one without
    (gspo train's --overwrite removes what the run wrote; plan_run itself deletes nothing)."""
    import yaml

    from gspo.compare import plan_run

    run = _copy(base_run, tmp_path)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    cfg = Config(**{**saved, "output_dir": str(tmp_path), "name": "r"})
    assert plan_run(cfg) is None
    shutil.rmtree(run / "final")
    assert plan_run(cfg).resume
    for step in ckpt.step_folders(run):
        (step / "model.safetensors").unlink()
    planned = plan_run(cfg)
    assert planned.overwrite and not planned.resume and run.exists()


def test_step_folders_are_ordered_by_step_number(tmp_path):
    """step-2 is older than step-000010, and a folder that is no step is never taken as the newest."""
    for name in ("step-000010", "step-2", "step-abc", "step-000003.tmp"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert [p.name for p in ckpt.step_folders(tmp_path)] == ["step-2", "step-000010"]


@pytest.mark.parametrize("kind", ["symlink", "folder"])
def test_the_lock_file_is_never_followed_through_a_symlink_nor_a_folder(base_run, tmp_path, kind, capsys):
    """A `.gspo.lock` that is a symlink (to a file of someone else's) or a folder: one line, exit 2, and
    the file it points to is untouched (the command in-process: no interpreter start)."""
    run = _copy(base_run, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    if kind == "symlink":
        (run / ckpt.LOCK).symlink_to(victim)
    else:
        (run / ckpt.LOCK).mkdir()
    args = ["train", *TINY, "--steps", "3", "--output-dir", str(tmp_path), "--name", "r", "--resume"]
    line = one_line(capsys, args, ckpt.LOCK)
    assert line.startswith(f"gspo: error: run folder {run}: ")
    assert victim.read_text() == "precious"
