"""Sharded checkpoints (FSDP2 on 2 gloo ranks, torch.distributed.checkpoint), through ``gspo train``.

Every step moves the weights (a reward with noise, a learning rate still warming up), so a resume that
lost the optimizer's moments, a shard, or the weights would end elsewhere than the uninterrupted run.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import tiny_train_args
from safetensors.torch import load_file

from gspo.model.load import build_char_tokenizer, build_tiny_moe, save_pretrained

pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")

ROOT = Path(__file__).resolve().parents[1]
REWARD = f"{ROOT / 'tests' / 'fixture_rewards.py'}:noisy"


def _gspo(cwd: Path, *args: str, timeout: float = 300) -> str:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    p = subprocess.run(
        [sys.executable, "-m", "gspo", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert p.returncode == 0, (args, p.stdout[-3000:], p.stderr[-6000:])
    return p.stdout + p.stderr


def _train(cwd: Path, out: str, *extra: str, here: bool = False) -> Path:
    """``gspo train`` of ``cwd/model`` into ``cwd/out``: a process of its own, or with ``here`` (one
    process, no rank) through ``gspo.cli.main`` in this one (no interpreter start)."""
    args = tiny_train_args(cwd / "model")
    args += ["--no-progress", "--save-every", "2", "--warmup-steps", "64", "--reward", REWARD]
    if here:
        from gspo.cli import main

        assert main([*args, "--output-dir", str(cwd / out), *extra]) == 0, extra
    else:
        _gspo(cwd, *args, "--output-dir", str(cwd / out), *extra)
    return next((cwd / out).iterdir())


def _export(step: Path, out: Path) -> None:
    """``gspo export STEP --out OUT``, in-process (one process is what the command runs anyway)."""
    from gspo.cli import main

    assert main(["export", str(step), "--out", str(out)]) == 0


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _killed_after_step_2(run: Path, dest: Path) -> Path:
    """``run`` as a kill -9 right after its step-2 checkpoint would have left it."""
    shutil.copytree(run, dest)
    shutil.rmtree(dest / "checkpoints" / "step-000004")
    shutil.rmtree(dest / "final")
    (dest / "checkpoints" / "latest").write_text("step-000002")
    return dest


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """A 4-step run on 2 ranks (and a copy as a kill after step 2 leaves it): all the slow tests need."""
    tmp = tmp_path_factory.mktemp("sharded")
    tok = build_char_tokenizer()
    save_pretrained(build_tiny_moe(len(tok), seed=3), tok, tmp / "model")
    straight = _train(tmp, "straight", "--nproc", "2", "--steps", "4")
    _killed_after_step_2(straight, tmp / "at-step-2")
    return tmp, straight


@pytest.fixture(scope="module")
def runs(straight_run):
    """The 4-step run on 2 ranks, and the same run killed after step 2 and resumed on 2 ranks."""
    tmp, straight = straight_run
    part = _killed_after_step_2(straight, tmp / "part" / straight.name)
    _train(tmp, "part", "--nproc", "2", "--steps", "4", "--resume")
    return tmp, straight, part


def test_each_rank_writes_its_shard_and_no_full_weights(runs):
    _, straight, _ = runs
    step = straight / "checkpoints" / "step-000002"
    shards = sorted(p.name for p in (step / "dcp").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not list(step.glob("*.safetensors"))  # nothing gathered on rank 0
    state = torch.load(step / "trainer_state.pt", weights_only=True)
    assert state["optimizer"] == {"dcp": True} and state["step"] == 2
    # AdamW's step count: 2 RL steps x 4 minibatches (the step-0 checkpoint did not add torch's
    # zero-step initialisation, which would shift the bias correction of every later update)
    import torch.distributed.checkpoint as dcp

    name = "model.model.embed_tokens.weight"
    got = {"optimizer": {"state": {name: {"step": torch.zeros(())}}}}
    dcp.load(got, storage_reader=dcp.FileSystemReader(str(step / "dcp")), no_dist=True)
    assert got["optimizer"]["state"][name]["step"].item() == 8


def test_resume_on_the_same_ranks_is_exact(runs):
    _, straight, part = runs
    a, b = _weights(straight / "final"), _weights(part / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    key = "rollout/reward_mean"
    assert [r[key] for r in rows if key in r] == [r[key] for r in want if key in r]


def test_export_streams_the_same_weights_as_the_final_folder(runs):
    """``gspo export`` (one process, one layer at a time) of the last checkpoint gives final/'s
    weights, which were gathered from the live shards one layer at a time; from_pretrained loads it."""
    from transformers import AutoModelForCausalLM

    tmp, straight, _ = runs
    _export(straight / "checkpoints" / "step-000004", tmp / "exported")
    a, b = _weights(straight / "final"), _weights(tmp / "exported")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = AutoModelForCausalLM.from_pretrained(tmp / "exported")
    want = AutoModelForCausalLM.from_pretrained(tmp / "model")
    assert model.state_dict().keys() == want.state_dict().keys()


@pytest.mark.slow  # the slow tier (multi-process, ~25 s here): CI runs it
def test_a_sharded_checkpoint_resumes_in_one_process(straight_run):
    """DCP reshards on load: the 2-rank step-2 checkpoint resumed by one process holds its weights
    (final/ written at once equals the checkpoint's export), and trains on from there."""
    tmp, straight = straight_run
    _export(tmp / "at-step-2" / "checkpoints" / "step-000002", tmp / "exported-2")
    run = _killed_after_step_2(straight, tmp / "one" / straight.name)
    _train(tmp, "one", "--nproc", "1", "--steps", "2", "--resume", here=True)  # one process: in this one
    a, b = _weights(run / "final"), _weights(tmp / "exported-2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    _train(tmp, "one", "--nproc", "1", "--steps", "3", "--resume", here=True)
    rows = (run / "metrics.jsonl").read_text().splitlines()
    last = json.loads(rows[-1])
    assert last["step"] == 3
    # it trained: step 3's update moved the weights away from the checkpoint's, and every number it
    # logged is finite (a resume whose optimizer lost its parameters would leave the weights as loaded)
    c = _weights(run / "final")
    assert c.keys() == b.keys() and any(not torch.equal(c[k], b[k]) for k in b)
    assert all(torch.isfinite(v).all() for v in c.values())
    numbers = {k: v for k, v in last.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert numbers["loss/skipped_updates"] == 0 and "loss/approx_kl" in numbers, sorted(numbers)
    assert all(math.isfinite(v) for v in numbers.values()), numbers


@pytest.mark.slow  # the slow tier (an end-to-end run of ~20 s here): CI runs it
def test_eval_and_export_name_the_problem(straight_run, tmp_path, capsys):
    """(In-process: the commands' code paths without an interpreter start.)"""
    from gspo.cli import main

    tmp, straight = straight_run
    step = straight / "checkpoints" / "step-000002"
    for args, words in (
        (["eval", str(step)], "gspo export"),
        (["export", str(tmp / "model"), "--out", str(tmp_path / "x")], "not a sharded checkpoint"),
        (["export", str(step), "--out", str(tmp / "model")], "already exists"),
    ):
        rc = main(args)
        err = capsys.readouterr().err
        assert rc == 2 and words in err and "Traceback" not in err, err
