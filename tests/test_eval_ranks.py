"""The held-out evaluation is split over the ranks (each scores its share of the prompts) and gives
the metrics one process gives for the same weights: ``gspo train --nproc 2`` against ``--nproc 1``,
step 0 (after the same warm start, before any RL update)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")


def _step0(tmp: Path, nproc: int, *extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    reward = (
        f"{ROOT / 'tests' / 'fixture_rewards.py'}:length_parity"  # partial accuracy, any completion moves it
    )
    args = ["train", "--nproc", str(nproc), "--sft-steps", "20", "--steps", "1", "--eval-size", "33"]
    args += ["--reward", reward]
    args += ["--eval-every", "0", "--prompts-per-step", "4", "--group-size", "2", "--threads", "1"]
    args += ["--no-progress", "--output-dir", str(tmp), "--name", f"n{nproc}", *extra]
    if nproc == 1:  # one process: through gspo.cli.main in this one (no interpreter start)
        from gspo.cli import main

        assert main(args) == 0
    else:
        p = subprocess.run(
            [sys.executable, "-m", "gspo", *args], env=env, capture_output=True, text=True, timeout=900
        )
        assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-6000:])
    return json.loads((tmp / f"n{nproc}" / "metrics.jsonl").read_text().splitlines()[0])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """The one-process run both cases compare with: ``--parallel`` wraps nothing on one process."""
    return _step0(tmp_path_factory.mktemp("eval-one"), 1)


@pytest.mark.slow  # the slow tier (multi-process, ~30-60 s here): CI runs it
@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
def test_two_ranks_evaluate_as_one_process_does(tmp_path, parallel, one_process):
    one = one_process
    two = _step0(tmp_path, 2, "--parallel", parallel)
    assert one["step"] == two["step"] == 0
    assert 0 < one["eval/accuracy"] < 1  # a score that could differ (33 prompts: 17 on rank 0, 16 on rank 1)
    assert two["eval/accuracy"] == one["eval/accuracy"]
    assert two["eval/reward_mean"] == pytest.approx(one["eval/reward_mean"], abs=1e-12)
