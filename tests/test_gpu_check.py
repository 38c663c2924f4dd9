"""benchmarks/gpu_check.sh fails loudly: on a machine without a GPU driver it names what is missing
and exits non-zero before any step runs (it used to echo each failure and exit 0). Issue 57: every
command that can hang is bounded with a kill after a grace period (its dependency check too, tested
with a python3 that hangs and ignores SIGTERM), measured memory fails past the plan by a stated
margin (the comparisons tested on recorded and constructed numbers), and the vLLM step's parts exist.
What the steps measure needs a GPU: this is a test of the script, not of a GPU."""

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.sh"
TOOLS = (
    "bash",
    "dirname",
    "mkdir",
    "date",
    "timeout",
    "tee",
    "ls",
    "cat",
    "cp",
    "tail",
    "head",
    "awk",
    "printf",
)


def _path_without_nvidia_smi(bin_dir: Path) -> str:
    """A PATH of symlinks to the tools the script uses, python3 being this interpreter, and no nvidia-smi."""
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    (bin_dir / "python3").symlink_to(sys.executable)
    return str(bin_dir)


def test_gpu_check_without_nvidia_smi_names_it_and_exits_non_zero(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    out, work = tmp_path / "out", tmp_path / "work"
    env = {
        "PATH": _path_without_nvidia_smi(tmp_path / "bin"), "OUT": str(out), "WORK": str(work),
        "HOME": str(tmp_path), **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ},
    }  # fmt: skip
    r = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "gpu_check: missing: nvidia-smi" in r.stderr
    assert "nothing was run" in r.stderr
    assert (out / "FAILED").read_text().startswith("gpu_check: missing: nvidia-smi")
    assert not (out / "memory_gpu.jsonl").exists() and not (work / "runs").exists()  # no step ran
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "out", "work"]  # wrote nothing else


def test_gpu_check_rejects_an_unknown_part(tmp_path):
    r = subprocess.run(
        ["bash", str(SCRIPT), "everything"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work")},
    )  # fmt: skip
    assert r.returncode == 2 and "unknown part 'everything'" in r.stderr


# ------------------------------------------------------------------------------------------------
# issue 57: every wait bounded (a kill after a grace period), the dependency check too, memory against
# the plan, a vLLM step with the log-prob check after a sleep/wake cycle


def _logical_lines(text: str) -> list[str]:
    """The script's commands: continuation lines joined, comments and here-document bodies dropped."""
    out, cur, heredoc = [], "", None
    for raw in text.splitlines():
        if heredoc is not None:
            heredoc = None if raw.strip() == heredoc else heredoc
            continue
        line = raw.split(" #", 1)[0] if not raw.lstrip().startswith("#") else ""
        cur += line.rstrip().removesuffix("\\") + " "
        if line.rstrip().endswith(("\\", "|", "||", "&&")):
            continue
        m = re.search(r"<<'?(\w+)'?", cur)
        heredoc = m.group(1) if m else None
        out.append(cur.strip())
        cur = ""
    return [x for x in out if x]


def test_every_command_that_can_hang_runs_bounded_with_a_kill_after_a_grace():
    """python3, nvidia-smi and pip (the dependency check's included) run only through ``bounded`` (or
    ``step``, which calls it), and ``timeout`` only as ``timeout -k GRACE``: a process that handles
    SIGTERM gracefully is killed GRACE seconds after its budget (``timeout`` without ``-k`` waits)."""
    text = SCRIPT.read_text()
    lines = _logical_lines(text)
    unquoted = [re.sub(r'"[^"]*"', '""', x) for x in lines]  # a command word in a message runs nothing
    runs = [
        x for x in unquoted if re.search(r"(^|[\s({$])(python3|nvidia-smi)\s", x) and "command -v" not in x
    ]
    assert len(runs) >= 10, runs  # the dependency probes and every step
    unbounded = [x for x in runs if not re.search(r"(^|[\s({$])(bounded|step)\s", x)]
    assert not unbounded, unbounded
    timeouts = [
        x
        for x, u in zip(lines, unquoted, strict=True)
        if re.search(r"\btimeout\b", u) and "command -v" not in u
    ]
    assert timeouts == ['timeout -k "$GRACE" "$secs" "$@"'], timeouts  # bounded(): the only one
    assert "step()" in text and re.search(r"step\(\) \{[^}]*\bbounded \"\$budget\"", text)
    for part in ("memory", "train", "phases", "vllm"):  # each part named in the usage and reachable
        assert f"wants {part}" in text


def _fake_bin(bin_dir: Path, tools: dict[str, str]) -> str:
    """A PATH of the real tools the script needs, plus ``tools`` (name -> bash body) written as scripts."""
    _path_without_nvidia_smi(bin_dir)
    for name, body in tools.items():
        (bin_dir / name).unlink(missing_ok=True)
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return str(bin_dir)


def test_a_hanging_dependency_check_is_killed_and_named(tmp_path):
    """A dependency check that hangs and ignores SIGTERM (a python3 stuck on a driver call) is killed
    GRACE seconds after DEPS_S: one line naming it, exit 2, no step run; every ``timeout`` the script
    ran had ``-k`` (a ``timeout`` on PATH records its arguments, then runs the real one)."""
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("no bash or timeout")
    real_timeout, log = shutil.which("timeout"), tmp_path / "timeout.log"
    tools = {
        "timeout": f'echo "$*" >> {log}\nexec {real_timeout} "$@"',
        "python3": "trap '' TERM\nwhile :; do sleep 0.1; done",  # hangs, deaf to SIGTERM
        "nvidia-smi": 'echo "name, memory.total [MiB], driver_version"; echo "Fake GPU, 81559 MiB, 1.0"',
    }
    out = tmp_path / "out"
    env = {"PATH": _fake_bin(tmp_path / "bin", tools), "OUT": str(out), "WORK": str(tmp_path / "work")}
    env |= {"HOME": str(tmp_path), "DEPS_S": "2", "GRACE": "1"}
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - t0
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "the dependency check itself: python3 did not finish within DEPS_S = 2 s" in r.stderr
    assert "nothing was run" in r.stderr and took < 20, took  # 2 s, then SIGKILL 1 s later
    calls = log.read_text().splitlines()
    assert calls and all(c.startswith("-k 1 ") for c in calls), calls
    assert not (out / "memory_gpu.jsonl").exists()


def test_the_parts_are_named_and_checked(tmp_path):
    r = subprocess.run(
        ["bash", str(SCRIPT), "memory", "vllm", "nope"], cwd=tmp_path, capture_output=True, text=True,
        timeout=60, env={**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work")},
    )  # fmt: skip
    assert r.returncode == 2 and "unknown part 'nope' (memory, train, phases, vllm, all)" in r.stderr


def _bench(name: str):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_the_memory_step_fails_a_peak_above_the_plan_by_more_than_the_margin():
    """memory_probe --plan-margin: the recorded H200 peaks (benchmarks/memory/memory_gpu.jsonl) are
    within 15% of the plan's estimate; the same record 20% above the estimate fails in one line."""
    probe = _bench("memory_probe")
    recorded = (SCRIPT.parent / "memory" / "memory_gpu.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in recorded if x.strip()]
    assert rows
    for r in rows:
        r["plan_peak"] = probe.planned_peak(r)
        assert probe.over_plan(r, 0.15) is None, (r["shape"], r["peak_1"] / r["plan_peak"])
    hot = dict(rows[0], peak_1=rows[0]["plan_peak"] * 1.2)
    why = probe.over_plan(hot, 0.15)
    assert why and "+20.0% over gspo plan's" in why and "(allowed 15%)" in why


def test_the_phase_summary_fails_a_phase_above_the_plan():
    summary = _bench("gpu_phase_summary")
    plan = "  start-up peak, fresh      10.0 GiB\n  rollout peak      20.0 GiB\n  update peak      30.0 GiB\n"
    rows = [{"step": 0, "memory/startup_peak_gib": 10.5}]
    rows += [{"step": s, "time/step_s": 1.0, "memory/rollout_peak_gib": 19.0, "memory/update_peak_gib": u}
             for s, u in ((1, 99.0), (2, 34.0), (3, 36.0), (4, 35.0))]  # fmt: skip
    assert summary.measured_peaks(rows) == {"start-up": 10.5, "rollout": 19.0, "update": 35.0}
    bad = summary.over_plan(rows, plan, 0.15)  # update 35 > 30 x 1.15; the first step is left out
    assert len(bad) == 1 and bad[0].startswith("update: measured 35.00 GiB is +16.7% over the plan's 30.00")
    assert summary.over_plan(rows, plan, 0.2) == []
    assert summary.over_plan(rows, "", 0.15)[0].startswith("no phase to compare")  # a plan that failed
