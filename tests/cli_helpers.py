"""Running the real ``gspo`` command, and finding what it left running, from tests (a module, not a
test file: pytest does not collect it)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# a run that finishes in seconds: a short warm start, small batches, one thread, no progress bar
TINY = [
    "--sft-steps", "5", "--eval-size", "8", "--prompts-per-step", "4", "--group-size", "4",
    "--max-new-tokens", "8", "--eval-every", "0", "--threads", "1", "--no-progress",
]  # fmt: skip


def tiny_train_args(model: Path) -> list[str]:
    """``gspo train`` of the model folder ``model`` at the tests' tiny size: no warm start, 4 held-out
    prompts evaluated at the end only, 4 prompts x 4 samples of at most 6 tokens, one thread."""
    args = ["train", "--model", str(model), "--sft-steps", "0", "--eval-size", "4", "--eval-every", "0"]
    return args + ["--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "6", "--threads", "1"]


def rank_env() -> dict[str, str]:
    """The environment of a torchrun launch from a test: one thread per rank, this checkout's gspo."""
    root = Path(__file__).resolve().parents[1]
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(root / "src"), str(root), os.environ.get("PYTHONPATH", "")]),
    )


def wait_proc(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """(return code, output) of ``proc``; killed and -9 after ``timeout`` seconds."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return -9, out
    return proc.returncode, out


def kill_9_after_checkpoint(proc: subprocess.Popen, run: Path, step: int, timeout: float) -> None:
    """kill -9 ``proc`` (a ``gspo train`` of the run folder ``run``) once its latest checkpoint is at
    ``step`` or later, before it ends; asserts it was still running and left no ``final/``."""
    latest, deadline = run / "checkpoints" / "latest", time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        if latest.exists() and latest.read_text().strip() >= f"step-{step:06d}":
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "final").exists()


def gspo_at_once(runs: dict[str, list[str]], cwd: Path, timeout: float) -> dict[str, tuple[int, str]]:
    """``gspo ARGS`` for each named argument list, all started at once (their start-ups overlap), in
    the torchrun environment of :func:`rank_env`: each run's (return code, output)."""
    kw = {"env": rank_env(), "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "cwd": cwd}
    procs = {n: subprocess.Popen([sys.executable, "-m", "gspo", *a], **kw) for n, a in runs.items()}
    return {n: wait_proc(p, timeout) for n, p in procs.items()}


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def gspo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gspo", *args], capture_output=True, text=True, env=env(), timeout=timeout
    )


def popen(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gspo", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env(), **kw,
    )  # fmt: skip


def procs_with(token: str) -> list[int]:
    """PIDs (host view) whose command line contains ``token``: what a test left running."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def one_line(capsys, args: list[str], want: str, rc: int = 2) -> str:
    """Run ``gspo ARGS`` in-process; assert exit ``rc`` and exactly one stderr line containing ``want``."""
    from gspo.cli import main

    try:
        code = main(args)
    except SystemExit as e:  # argparse, or a user file's SystemExit that got through
        code = e.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == rc, err[-2000:]
    assert "Traceback" not in err
    assert len(lines) == 1 and want in lines[0], err[-2000:]
    return lines[0]
