"""benchmarks/gpu_check.sh fails loudly: on a machine without a GPU driver it names what is missing
and exits non-zero before any step runs (it used to echo each failure and exit 0)."""

import os
import shutil
import subprocess
import sys
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
