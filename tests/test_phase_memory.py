"""Per-phase peak memory (gspo.memory.phase_peak): what `gspo plan` estimates per phase, logged every
step as memory/{rollout,update,sync}_peak_* (GPU: allocated and reserved; CPU: peak RSS)."""

import sys
from pathlib import Path

import pytest
import torch

from gspo import Config, train
from gspo.memory import phase_peak, proc_status_mib, reset_peak_rss

MiB = 2**20

linux_peak = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not reset_peak_rss(), reason="VmHWM cannot be reset here"
)


@linux_peak
def test_cpu_phase_peak_is_reset_at_each_phase():
    """A phase that touches 256 MiB peaks at least that far above where it started; the next phase,
    after the tensor is freed, does not carry that peak over (the high-water mark was reset). In a
    fresh process: one that freed memory before (the rest of the suite) reuses those resident pages,
    and its RSS need not grow at all."""
    import subprocess

    child = Path(__file__).parent / "phase_memory_child.py"
    out = subprocess.run(
        [sys.executable, str(child)], capture_output=True, text=True, timeout=120, check=True
    )
    start, big, small = map(float, out.stdout.split())
    assert big >= start + 250
    assert small < big - 200


def test_gpu_path_resets_then_reads_the_allocator_peaks(monkeypatch):
    """On a GPU (no GPU needed to check the calls): reset the peak stats when the phase starts,
    read allocated and reserved peaks on that device after it, in GiB."""
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls.append(("alloc", d)) or 3 * 2**30)
    monkeypatch.setattr(
        torch.cuda, "max_memory_reserved", lambda d: calls.append(("reserved", d)) or 4 * 2**30
    )
    peaks: dict[str, float] = {}
    dev = torch.device("cuda", 1)
    with phase_peak("update", peaks, dev):
        calls.append(("body", None))
    assert calls == [("reset", dev), ("body", None), ("alloc", dev), ("reserved", dev)]
    assert peaks == {"memory/update_peak_gib": 3.0, "memory/update_reserved_gib": 4.0}


@linux_peak
def test_every_step_logs_the_peak_of_each_phase(tmp_path):
    """Through `train`: every RL step logs the rollout, update and sync peaks of the process, each
    between the model's size and a few times the resident set at the end."""
    res = train(
        Config(output_dir=str(tmp_path), name="m", steps=2, sft_steps=2, eval_size=4, prompts_per_step=4,
               group_size=2, max_new_tokens=4, eval_every=2, save_every=2, threads=1, progress=False)
    )  # fmt: skip
    from gspo.training.logger import read_metrics

    rows = [r for r in read_metrics(res.run_dir / "metrics.jsonl") if r["step"] > 0]
    assert len(rows) == 2
    for r in rows:
        rss = proc_status_mib()["VmRSS"] / 1024
        vals = [r[f"memory/{p}_peak_rss_gib"] for p in ("rollout", "update", "sync")]
        assert all(0.1 < v < 4 * rss for v in vals), vals
