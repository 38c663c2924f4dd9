"""Bit-for-bit check of a refactor: run a set of short configurations through ``gspo train`` and
write (or compare against) every step's metrics, minus the ones that measure time or memory.

    python benchmarks/metrics_identity.py --write ref.json            # before the change
    python benchmarks/metrics_identity.py --compare ref.json          # after it: identical or exit 1
    python benchmarks/metrics_identity.py --only vllm --python .venv-vllm/bin/python --write vllm.json

Each configuration runs in a temporary folder; floats are compared exactly (JSON round-trips them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SHORT = ["--no-progress", "--eval-every", "2"]
CONFIGS: dict[str, list[str]] = {
    "default": ["--steps", "4"],
    "async": ["--steps", "4", "--async-staleness", "1"],
    "dynamic": ["--steps", "3", "--dynamic-sampling"],
    "grpo-r3": ["--steps", "3", "--algo", "grpo", "--routing-replay"],
    "env": [
        "--steps",
        "3",
        "--model",
        "embedded:tiny-dense",
        "--task",
        "add_long",
        "--env",
        "tools:calc",
        "--max-turns",
        "2",
        "--max-new-tokens",
        "20",
        "--sft-steps",
        "20",
    ],  # fmt: skip
    "fsdp2": ["--steps", "2", "--nproc", "2", "--sft-steps", "20"],
    "vllm": [
        "--steps",
        "2",
        "--rollout-engine",
        "vllm",
        "--sft-steps",
        "20",
        "--model",
        "embedded:tiny-moe-h32",
    ],
}
# what measures the machine, not the math
VOLATILE = ("time/", "memory/", "throughput/", "async/queue_wait_s", "async/trainer_idle_frac", "perf/")


def run(name: str, python: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [python, "-m", "gspo", "train", *SHORT, *CONFIGS[name], "--output-dir", tmp, "--name", "r"]
        done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "r" / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path)
    ap.add_argument("--compare", type=Path)
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--python", default=sys.executable)  # made absolute: each run has its own cwd
    args = ap.parse_args()
    names = args.only.split(",") if args.only else [n for n in CONFIGS if n != "vllm"]
    got = {}
    for n in names:
        got[n] = run(n, str(Path(args.python).absolute()))
        print(f"{n}: {len(got[n])} rows", flush=True)
    if args.write:
        args.write.write_text(json.dumps(got, indent=1, sort_keys=True))
    if args.compare:
        ref = json.loads(args.compare.read_text())
        bad = []
        for n in names:
            for i, (a, b) in enumerate(zip(ref[n], got[n], strict=True)):
                diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                if diff:
                    bad.append(
                        f"{n} row {i}: " + ", ".join(f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in diff[:4])
                    )
        print("\n".join(bad) or f"identical: {', '.join(names)}")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
