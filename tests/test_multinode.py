"""Multi-node launch as far as one machine allows: two torchrun agents (``--nnodes 2``) meeting at a
c10d rendezvous on localhost, each starting its node's ranks; gloo between them.

HSDP (``dp_replicate_size`` = nodes: parameters replicated across the nodes, sharded within one),
expert parallelism across the nodes, and both at once (experts split within a node, dense parameters
replicated across nodes) make the single-process update on the same global batch (1e-6, as
tests/test_distributed.py holds plain FSDP2 to).
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from gspo.model.load import build_char_tokenizer
from tests.cli_helpers import rank_env, wait_proc
from tests.test_distributed import BASE_CFG, ROOT, _single, synthetic_rollout

pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")

NODES = 2
SGD = {"opt": "sgd", "lr": 0.1}
LAYOUTS = {  # ranks per node -> runs
    1: [
        {"name": "hsdp", **SGD, "cfg": {**BASE_CFG, "max_grad_norm": 0.0, "dp_replicate_size": 2}},
        {
            "name": "ep-across-nodes",
            **SGD,
            "cfg": {**BASE_CFG, "max_grad_norm": 0.0, "expert_parallel_size": 2},
        },
    ],
    2: [
        {  # EP within each node, the dense parameters replicated across the nodes (HSDP)
            "name": "hsdp-ep",
            **SGD,
            "cfg": {**BASE_CFG, "max_grad_norm": 0.0, "expert_parallel_size": 2, "dp_replicate_size": 2},
        }
    ],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(tmp, per_node: int, runs: list[dict]) -> dict:
    """``torchrun --nnodes 2 --nproc-per-node per_node`` started twice, as on two machines."""
    data = synthetic_rollout(len(build_char_tokenizer()))
    tag = f"n{per_node}"
    torch.save({"data": data, "runs": runs}, tmp / f"{tag}.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--nproc-per-node={per_node}"]
    cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{_free_port()}", f"--rdzv-id=gspo-{tag}"]
    cmd += [
        str(ROOT / "tests" / "dist_worker.py"),
        "--data",
        str(tmp / f"{tag}.pt"),
        "--out",
        str(tmp / f"{tag}-out.pt"),
    ]
    kw = {"env": rank_env(), "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "cwd": tmp}
    agents = [subprocess.Popen(cmd, **kw) for _ in range(NODES)]
    for rc, out in [wait_proc(a, 600) for a in agents]:
        assert rc == 0, out[-6000:]
    return torch.load(tmp / f"{tag}-out.pt", weights_only=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multinode")
    out = {}
    for per_node, runs in LAYOUTS.items():
        out |= _launch(tmp, per_node, runs)
    return out


@pytest.mark.slow  # the slow tier (multi-process, ~30-60 s here): CI runs it
@pytest.mark.parametrize("run", [r for rs in LAYOUTS.values() for r in rs], ids=lambda r: r["name"])
def test_two_nodes_make_the_single_process_update(results, run):
    vocab = len(build_char_tokenizer())
    got = results[run["name"]]
    plain = {k: v for k, v in run["cfg"].items() if k not in ("expert_parallel_size", "dp_replicate_size")}
    ref = _single({**run, "cfg": plain}, synthetic_rollout(vocab), vocab)[0].state_dict()
    assert set(got["params"]) == set(ref) - {"lm_head.weight"}  # (tied: saved once, as the embedding)
    for name, p in got["params"].items():
        torch.testing.assert_close(p, ref[name], atol=1e-6, rtol=0, msg=name)
    assert got["rollout_rel"] == 0.0  # the sampler's module holds the update, every expert included
