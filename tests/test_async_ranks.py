"""Async rollouts with N trainer ranks (issue 34 item 2): 2 gloo ranks (FSDP2) and one sampler
process train as one process with its sampler does: the same batches (the sampler makes the whole
step's batch from the same version and seed; rank r takes the groups of the prompts the synchronous
path gives it) and the same update to 1e-6. A 2-rank run killed with batches in flight and resumed
ends bit for bit where the uninterrupted one does."""

import json
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
REWARD = f"{ROOT / 'tests' / 'fixture_rewards.py'}:length_parity"  # deterministic: no rank's generator


def _train(cwd: Path, out: str, *extra: str, here: bool = False) -> Path:
    """``gspo train`` of the folder ``cwd/model`` into ``cwd/out``: a process of its own, or with
    ``here`` (one process, no rank) through ``gspo.cli.main`` in this one (no interpreter start)."""
    args = tiny_train_args(cwd / "model")
    # one optimizer step per RL step: the ranks' rows together are the one process's minibatch (with
    # more, rank r's i-th slice of its own rows is its part of minibatch i, as in the synchronous path)
    args += ["--no-progress", "--save-every", "2", "--steps", "4", "--async-staleness", "2"]
    args += ["--num-minibatches", "1"]
    args += ["--reward", REWARD, "--lr", "1e-4", "--warmup-steps", "1", "--output-dir", str(cwd / out)]
    if here:
        from gspo.cli import main

        assert main([*args, *extra]) == 0, extra
        return next((cwd / out).iterdir())
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, "-m", "gspo", *args, *extra], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, (extra, p.stdout[-3000:], p.stderr[-6000:])
    return next((cwd / out).iterdir())


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][1:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process, 2 ranks, and 2 ranks killed after the step-2 checkpoint (2 batches in flight)
    and resumed."""
    tmp = tmp_path_factory.mktemp("async-ranks")
    tok = build_char_tokenizer()
    save_pretrained(build_tiny_moe(len(tok), seed=3), tok, tmp / "model")
    one = _train(tmp, "one", "--nproc", "1", here=True)
    two = _train(tmp, "two", "--nproc", "2")
    killed = tmp / "part" / two.name
    shutil.copytree(two, killed)
    shutil.rmtree(killed / "checkpoints" / "step-000004")
    shutil.rmtree(killed / "final")
    (killed / "checkpoints" / "latest").write_text("step-000002")
    _train(tmp, "part", "--nproc", "2", "--resume")
    return one, two, killed


def test_two_ranks_train_as_one_process(runs):
    one, two, _ = runs
    a, b = _rows(one), _rows(two)
    assert [r["async/staleness"] for r in b] == [0, 1, 2, 2]
    for key in ("rollout/reward_mean", "rollout/response_len", "rollout/response_len_max"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], abs=1e-6), key  # same batches
    assert max(abs(r["loss/grad_norm"]) for r in a) > 0  # the updates were not zero
    wa, wb = load_file(one / "final" / "model.safetensors"), load_file(two / "final" / "model.safetensors")
    start = load_file(one.parent.parent / "model" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - start[k]).abs().max()) for k in wa) > 2e-4  # the weights moved (4 x lr)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=0, msg=k)


def test_two_ranks_resume_with_batches_in_flight_is_exact(runs):
    _, two, resumed = runs
    state = torch.load(two / "checkpoints" / "step-000002" / "trainer_state.pt", weights_only=True)
    assert [b["step"] for b in state["in_flight"]] == [3, 4]  # whole batches, split on every resume
    wa = load_file(two / "final" / "model.safetensors")
    wb = load_file(resumed / "final" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["rollout/reward_mean"] for r in _rows(resumed)] == [
        r["rollout/reward_mean"] for r in _rows(two)
    ]


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_gets_the_rows_of_its_groups(world):
    """Rank 0 splits a step's batch by groups, G rows each, as the synchronous path splits its
    prompts: rank r's share is rows r P G / N .. (r + 1) P G / N (tokens, masks, log-probs, per-token
    versions, prompts) and the training prompts of its groups; the shares together are the batch.
    (The 2-rank runs above would also stop on a wrong share, but only through their own guard.)"""
    from gspo.rollout.async_sampler import _shares
    from gspo.rollout.async_state import from_wire
    from tests.test_async import _ahead

    P, G = 4, 3
    a = _ahead(step=5, P=P, G=G)
    shares = [from_wire(s) for s in _shares(a, world, G)]
    n = P // world  # groups per rank
    rb = a.out.batch
    for r, s in enumerate(shares):
        rows = slice(r * n * G, (r + 1) * n * G)
        assert (s.step, s.version, s.data_end) == (a.step, a.version, a.data_end)
        assert s.idx == a.idx[r * n : (r + 1) * n]
        assert s.out.batch.prompt_ids == rb.prompt_ids[rows]
        for name in ("response_ids_BT", "response_mask_BT", "sampler_logp_BT", "sampler_version_BT"):
            assert torch.equal(getattr(s.out.batch, name), getattr(rb, name)[rows]), (r, name)
    assert sum(len(s.out.batch.prompt_ids) for s in shares) == P * G
