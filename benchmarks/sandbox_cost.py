"""Per-call cost of the code sandbox: the module-per-file package vs. the single-file implementation it
replaced (issue 22), measured in the same run, call by call.

    python benchmarks/sandbox_cost.py                 # 150 pairs per mode, ~1 min on 2 busy cores
    python benchmarks/sandbox_cost.py --pairs 400 --baseline /tmp/old_sandbox.py

The baseline is the old ``src/gspo/tasks/sandbox.py``, read from git (``--rev``, read-only ``git
show``) or from ``--baseline``, and imported under another name; nothing of it lives in ``src/``.
Each pair times one call of each, in random order, back to back, so both see the same machine load;
the result is the median of the per-pair ratios (new / old), which a shared machine's drifting load
does not move the way it moves the medians of the two sides.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from gspo.tasks import sandbox

ROOT = Path(__file__).resolve().parents[1]
BASELINE_REV = "b19eaa310e8f9aa8520aec8cd51342cb0a6005a4"  # the last commit with the single-file sandbox
SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"


def load_baseline(path: str | None, rev: str) -> ModuleType:
    if path is None:
        src = subprocess.run(
            ["git", "show", f"{rev}:src/gspo/tasks/sandbox.py"], cwd=ROOT, check=True, capture_output=True
        ).stdout
        tmp = tempfile.NamedTemporaryFile("wb", suffix="_old_sandbox.py", delete=False)
        tmp.write(src)
        tmp.close()
        path = tmp.name
    spec = importlib.util.spec_from_file_location("gspo_old_sandbox", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def call(module: ModuleType, tests: str | None) -> float:
    t0 = time.perf_counter()
    r = module.run_untrusted(SOLUTION, tests=tests)
    dt = time.perf_counter() - t0
    assert r.ok and r.passed is (True if tests else None), r
    return dt


def measure(old: ModuleType, tests: str | None, pairs: int, rng: random.Random) -> dict[str, float]:
    for _ in range(5):  # warm-up: compile caches, probes
        call(old, tests)
        call(sandbox, tests)
    ratios, t_old, t_new = [], [], []
    for _ in range(pairs):
        first_new = rng.random() < 0.5
        a = call(sandbox if first_new else old, tests)
        b = call(old if first_new else sandbox, tests)
        new, base = (a, b) if first_new else (b, a)
        ratios.append(new / base)
        t_old.append(base)
        t_new.append(new)
    q = statistics.quantiles(ratios, n=4)
    return {
        "old_ms": statistics.median(t_old) * 1e3,
        "new_ms": statistics.median(t_new) * 1e3,
        "ratio": statistics.median(ratios),
        "q1": q[0],
        "q3": q[2],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=150)
    ap.add_argument("--baseline", help="path of the old sandbox.py (default: git show REV)")
    ap.add_argument("--rev", default=BASELINE_REV)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    old = load_baseline(args.baseline, args.rev)
    rng = random.Random(args.seed)
    print(f"{args.pairs} pairs per mode; per-call wall time, medians")
    for label, tests in (("scoring (run_untrusted + tests)", TESTS), ("plain run (no tests)", None)):
        m = measure(old, tests, args.pairs, rng)
        print(
            f"{label:34s} old {m['old_ms']:6.1f} ms  new {m['new_ms']:6.1f} ms  "
            f"new/old median of paired ratios {m['ratio']:.3f} (IQR {m['q1']:.3f}-{m['q3']:.3f})"
        )


if __name__ == "__main__":
    main()
