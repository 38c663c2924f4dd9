"""One default RL step stays small enough to read in one sitting: ``benchmarks/step_lines.py``
counts the lines of every gspo function it runs (called more often in a 3-step run than in a 2-step
one). Issue 45 took it from 1,881 lines in 27 files; these bounds keep it from regrowing unnoticed,
with the MoE's volatility metric on (the default) and off (what it costs: its observer and the
routing capture, attached from outside the step)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# the README's Layout section quotes the measured numbers; lower these as the step shrinks
# 1,431 until the HF engine's one decode loop took multi-turn turns too (kept KV cache): 1,464; then
# decisions made once instead of each step (the update plan's, the gathering, the rank, the LM head;
# the HF engine's probes at its first prefill, once its weights are real): 1,359 (1,225 without
# volatility). During issue 60, other issues' work: the HF engine's turn loop with a worker pool
# (+84), the trackers' store checks after each call (+37), the divergence rule (+26), MaxRL's checks
# (+5); issue 60's own: +36 with volatility on, +10 off (its observers and adjustments, less the
# step's stop and held-out evaluation taken out of the step). Then paths a default step never takes
# left its functions (the divergence stop, dynamic sampling's rounds, the HF engine's batches past
# max_batch_size): 1,482 (1,322).
BOUNDS = {  # extra config -> (lines, files); issue 60 asks for <= 1,150 in 16 and <= 1,000
    "default": ({}, 1482, 22),
    "no volatility": ({"log_volatility": False}, 1322, 21),
}


def _step_lines():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "step_lines.py"
    spec = importlib.util.spec_from_file_location("step_lines", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("case", list(BOUNDS))
def test_one_default_step_stays_under_its_bound(case):
    extra, max_lines, max_files = BOUNDS[case]
    # a smaller batch runs the same functions (the count is of code, not of calls)
    got = _step_lines().measure(
        {"prompts_per_step": 4, "group_size": 4, "eval_size": 4, "threads": 1, **extra}
    )
    table = "\n".join(f"{n:5d} {p}" for p, n in got["files"].items())
    assert got["lines"] <= max_lines and len(got["files"]) <= max_files, f"{got['lines']} lines:\n{table}"
