"""What ``--reproducible`` costs in speed: the default run's RL steps (embedded tiny MoE, 32 prompts x 8
samples, no warm start) under the default settings (torch's threads, the machine's kernels),
``--threads 1`` (the machine's kernels, one thread) and ``--reproducible`` (one thread, ATen's baseline
kernels, MKL's COMPATIBLE branch, deterministic algorithms). Each round runs the three arms in a
rotated order; per step the ratio of ``time/step_s`` to the default's (and to ``--threads 1``'s) is
paired by step (the first step, with its warm-up, left out), and the geometric mean over steps and
rounds is printed with its min and max over rounds. Measure on a quiet machine:

    python benchmarks/bench_reproducible.py --rounds 3 --steps 20
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ARMS = {"default": [], "threads1": ["--threads", "1"], "reproducible": ["--reproducible"]}


def step_times(flags: list[str], steps: int, out: Path) -> list[float]:
    """``time/step_s`` of each RL step of one ``gspo train`` run (the first left out)."""
    cmd = [sys.executable, "-m", "gspo", "train", "--name", "r", "--output-dir", str(out), "--sft-steps", "0"]
    cmd += ["--steps", str(steps), "--eval-every", "0", "--save-every", "100000", "--no-progress"]
    cmd += ["--report-to", "none", "--overwrite", *flags]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rows = [json.loads(x) for x in (out / "r" / "metrics.jsonl").read_text().splitlines()]
    return [r["time/step_s"] for r in rows if r.get("step", 0) > 1 and "time/step_s" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    logs: dict[str, list[list[float]]] = {a: [] for a in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            names = list(ARMS)[r % 3 :] + list(ARMS)[: r % 3]  # rotate who goes first
            for a in names:
                logs[a].append(step_times(ARMS[a], args.steps, Path(tmp) / a))
    for base in ("default", "threads1"):
        per_round = [
            math.exp(statistics.fmean(math.log(x / y) for x, y in zip(rep, ref, strict=True)))
            for rep, ref in zip(logs["reproducible"], logs[base], strict=True)
        ]
        every = [
            math.log(x / y)
            for rep, ref in zip(logs["reproducible"], logs[base], strict=True)
            for x, y in zip(rep, ref, strict=True)
        ]
        print(
            f"reproducible / {base}: step time x{math.exp(statistics.fmean(every)):.2f} "
            f"(rounds {min(per_round):.2f}-{max(per_round):.2f}; {len(every)} paired steps)"
        )
    for a, reps in logs.items():
        print(f"{a}: median step {statistics.median(x for rep in reps for x in rep):.3f} s")
    print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
