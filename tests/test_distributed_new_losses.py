"""LUSPO, VESPO and OPSM on 2 ranks (gloo, CPU): the global normalizers make the 2-rank update equal to
the single-process one (SGD without clipping, which keeps the gradient's scale: a normalizer off by
the world size, or its square as in verl #5798, fails). Reuses tests/test_distributed.py's rollout and
reference and tests/dist_worker.py's launch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from cli_helpers import rank_env, wait_proc
from test_distributed import BASE_CFG, NPROC, ROOT, _single, synthetic_rollout

from gspo.model.load import build_char_tokenizer

pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")

SGD = {**BASE_CFG, "max_grad_norm": 0.0, "routing_replay": False}
RUNS = [
    {"name": "ddp-sgd-luspo", "opt": "sgd", "lr": 0.1, "cfg": {**SGD, "parallel": "ddp", "algo": "luspo"}},
    # token_mean: the normalizer counts both ranks' tokens
    {"name": "fsdp-sgd-vespo", "opt": "sgd", "lr": 0.1, "cfg": {**SGD, "parallel": "fsdp", "algo": "vespo"}},
    {
        "name": "ddp-sgd-vespo-seq",
        "opt": "sgd",
        "lr": 0.1,
        "cfg": {**SGD, "parallel": "ddp", "algo": "vespo", "aggregation": "seq_mean_token_mean"},
    },
    {  # OPSM drops sequences; the dropped ones still count in the global normalizer
        "name": "ddp-sgd-gspo-opsm",
        "opt": "sgd",
        "lr": 0.1,
        "cfg": {**SGD, "parallel": "ddp", "opsm_threshold": 2.5, "eps_low": 0.2, "eps_high": 0.2},
    },
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    vocab = len(build_char_tokenizer())
    data = synthetic_rollout(vocab, seed=1)
    tmp = tmp_path_factory.mktemp("dist_new")
    torch.save({"data": data, "runs": RUNS}, tmp / "in.pt")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
        str(ROOT / "tests" / "dist_worker.py"), "--data", str(tmp / "in.pt"), "--out", str(tmp / "out.pt"),
    ]  # fmt: skip
    kw = {"env": rank_env(), "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "cwd": tmp}
    rc, out = wait_proc(subprocess.Popen(cmd, **kw), 300)
    assert rc == 0, out[-6000:]
    return data, vocab, torch.load(tmp / "out.pt", weights_only=False)


@pytest.mark.parametrize("run", RUNS, ids=[r["name"] for r in RUNS])
def test_two_rank_update_equals_single_process(two_ranks, run):
    data, vocab, results = two_ranks
    got = results[run["name"]]
    ref, ref_m = _single(run, data, vocab)
    init = _single({**run, "lr": 0.0}, data, vocab)[0].state_dict()
    ref_sd, moved = ref.state_dict(), 0.0
    assert set(got["params"]) >= {n for n, _ in ref.named_parameters()}
    for name, p in got["params"].items():
        torch.testing.assert_close(p, ref_sd[name], atol=1e-6, rtol=0, msg=name)
        moved = max(moved, float((ref_sd[name] - init[name]).abs().max()))
    assert moved > 1e-5  # the update did something
    assert abs(got["metrics"]["loss/loss"] - ref_m["loss/loss"]) <= 1e-5
    if "opsm_threshold" in run["cfg"]:  # some sequences were dropped, not all
        assert 0 < ref_m["mismatch/opsm_frac_seq"] < 1
