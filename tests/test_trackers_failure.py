"""Trackers whose store fills up mid-run (issue 57, "trackers under failure"): each tracker is one
line naming it when it stops taking data and is not called again; the run and metrics.jsonl go on,
stdout stays gspo's, and the trackers' own noise stays out of stderr (TensorBoard's writer-thread
traceback, MLflow's logged database tracebacks, W&B's "--- Logging error ---" records and console
capture, trackio's flush warning). The real packages of the test extra, and a real full filesystem:
small tmpfs mounts in a private mount namespace (``unshare -m``; CI runs as root)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import env

CHILD = Path(__file__).with_name("tracker_store_child.py")
ALL = ("tensorboard", "wandb", "trackio", "mlflow")


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True
    )
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(
    not _can_mount(), reason="filling a real disk needs unshare -m and mount (root; CI runs as root)"
)


def _stores_env(store: Path) -> dict[str, str]:
    return dict(
        env(),
        WANDB_MODE="offline",
        WANDB_DIR=str(store),
        TRACKIO_DIR=str(store / "trackio"),
        MLFLOW_TRACKING_URI=f"sqlite:///{store}/mlflow.db",
    )


def _in_namespace(mounts: list[Path], cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """``cmd`` in a private mount namespace where each folder of ``mounts`` is a fresh 4 MiB tmpfs."""
    mount = " && ".join(f"mount -t tmpfs -o size=4m tmpfs '{m}'" for m in mounts)
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", f'{mount} && exec "$@"', "sh", *cmd],
        capture_output=True, text=True, timeout=600, **kw,
    )  # fmt: skip


def _after_fill(err: str, names: tuple[str, ...], next_step: str) -> list[str]:
    """stderr after the disks filled: one gspo line per tracker naming it, each before ``next_step``
    (said when the tracker stops taking data, not when the run ends), nothing of theirs that is a
    traceback or a warning. Returns the gspo lines."""
    assert "FILLED" in err and next_step in err, err[-3000:]
    after = err.split("FILLED", 1)[1].strip().splitlines()
    prompt = err.split("FILLED", 1)[1].split(next_step, 1)[0]
    mine = [ln for ln in after if ln.startswith("gspo: report_to ")]
    assert all(ln in prompt for ln in mine), (next_step, after)
    for name in names:
        said = [ln for ln in mine if ln.startswith(f"gspo: report_to {name}: ")]
        assert len(said) == 1 and said[0].endswith("; no longer logging to it"), (name, after)
        # its store full (gspo's check), or its own error (TensorBoard's writer, trackio's flush)
        assert any(w in said[0] for w in ("full", "No space left", "disk I/O error")), said[0]
    assert len(mine) == len(names), after
    noise = [ln for ln in after if not ln.startswith(("gspo: ", "CLOSED", "LOGGED", "NEXT STEP"))]
    # trackio's notice that it finishes its run is the only line of theirs left
    assert all(ln.startswith("* Run finished.") for ln in noise), after
    for word in ("Traceback", "Error", "Warning", "Exception"):
        assert word not in "\n".join(noise), after
    return mine


@needs_mounts
def test_trackers_whose_store_fills_stop_in_one_line_each_and_the_log_goes_on(tmp_path):
    """TensorBoard (its folder in the run), trackio and MLflow (one store folder) log 8 steps; before
    step 2 both disks fill. Each is dropped with one line naming it (MLflow's database error by its
    root cause, the others their full store), no tracker is left open, metrics.jsonl has every step."""
    names = ("tensorboard", "trackio", "mlflow")
    store, run = tmp_path / "store", tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    store.mkdir()
    cmd = [sys.executable, str(CHILD), ",".join(names), str(run), str(store), str(run / "tensorboard")]
    res = _in_namespace([store, run / "tensorboard"], cmd, env=_stores_env(store), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout == ""  # the trackers' notices go to stderr
    lines = _after_fill(res.stderr, names, "LOGGED 2")
    # TensorBoard's writer thread met the full disk (its traceback left out): the flush raised it
    assert (
        lines[0] == "gspo: report_to tensorboard: [Errno 28] No space left on device; no longer logging to it"
    )
    assert res.stderr.strip().endswith("CLOSED")  # every tracker dropped, none left to close
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(8)) and rows[7]["m/19"] == 26.0


@pytest.mark.slow
@needs_mounts
def test_gspo_train_goes_on_when_every_trackers_store_fills(tmp_path):
    """`gspo train --report-to tensorboard,wandb,trackio,mlflow`, resumed from step 1 with its
    ``tensorboard/`` folder and the other trackers' store on small disks that its reward fills at
    step 3: exit 0, stdout gspo's two lines, one line per tracker, metrics.jsonl whole (steps 0-5),
    final/ written. (W&B's offline writer loses data silently: only gspo's check of its store finds
    it; its console capture and summary are off, its notices on stderr.)"""
    runs, store = tmp_path / "runs", tmp_path / "store"
    run = runs / "r"
    args = [sys.executable, "-m", "gspo", "train", "--output-dir", str(runs), "--name", "r"]
    args += ["--sft-steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--eval-size", "2"]
    args += ["--max-new-tokens", "8", "--eval-every", "0", "--threads", "1", "--no-progress"]
    args += ["--reward", f"{CHILD}:fill_on_second_call"]  # the same in both runs: a resume keeps it
    first = subprocess.run(
        [*args, "--steps", "1", "--report-to", "none"], capture_output=True, text=True, env=env(), timeout=600
    )
    assert first.returncode == 0, first.stderr[-3000:]
    (run / "tensorboard").mkdir()
    store.mkdir()
    cmd = [*args, "--steps", "5", "--resume", "--report-to", ",".join(ALL)]
    environ = dict(_stores_env(store), GSPO_TEST_FILL=f"{store}:{run / 'tensorboard'}")
    res = _in_namespace([store, run / "tensorboard"], cmd, env=environ, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    out = res.stdout.strip().splitlines()
    assert len(out) == 2 and out[1].startswith("run folder: "), res.stdout
    _after_fill(res.stderr, ALL, "NEXT STEP")
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    assert (run / "final" / "model.safetensors").is_file()
