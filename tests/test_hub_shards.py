"""A hub id under a sharded start (issue 47): each node's local rank 0 fetches the snapshot with
huggingface_hub's own client and cache, the other ranks wait (said), then every rank reads its own
shards from the snapshot as from a local folder (it used to fall back to rank 0 reading the whole
model in float32 and broadcasting it); a resume needs no hub cache (issue 57). Tested with a folder laid out as the hub's cache
(HF_HUB_CACHE, HF_HUB_OFFLINE=1: no network), 2 ranks on gloo, a MoE (experts stored one per tensor)
and a dense model: the step-0 checkpoint equals ``from_pretrained``'s weights."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from gspo.model.load import build_char_tokenizer, build_tiny_dense, build_tiny_moe, save_pretrained

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(tmp_path: Path, kind: str) -> tuple[Path, str, Path]:
    """(cache folder, repo id, snapshot folder): a tiny model saved where the hub's cache keeps it."""
    repo = f"gspo-test/tiny-{kind}"
    cache = tmp_path / "hub"
    entry = cache / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / COMMIT
    tok = build_char_tokenizer()
    build = build_tiny_moe if kind == "moe" else build_tiny_dense
    save_pretrained(build(len(tok), seed=3).to(torch.bfloat16), tok, snapshot)
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(COMMIT)
    return cache, repo, snapshot


def _gspo(cwd: Path, cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env |= {"HF_HUB_CACHE": str(cache), "HF_HOME": str(cwd / "hf-home")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, "-m", "gspo", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, (args, p.stdout[-3000:], p.stderr[-6000:])
    return p


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")
@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_two_ranks_read_their_own_shards_of_a_hub_snapshot(tmp_path, kind):
    cache, repo, snapshot = _hub_cache(tmp_path, kind)
    args = ["train", "--model", repo, "--nproc", "2", "--sft-steps", "0", "--steps", "1", "--save-every", "1"]
    args += ["--eval-size", "4", "--eval-every", "0", "--prompts-per-step", "4", "--group-size", "2"]
    args += ["--max-new-tokens", "4", "--threads", "1", "--no-progress", "--output-dir", "out", "--name", "r"]
    p = _gspo(tmp_path, cache, *args)
    assert "reads the whole model" not in p.stderr, p.stderr[-3000:]
    assert f"rank 0 fetches {repo}'s files into the hub cache, once on this node" in p.stderr
    assert "wait for local rank 0's download" in p.stderr and "dist_timeout_min = 120 min" in p.stderr
    run = tmp_path / "out" / "r" / "checkpoints"
    _gspo(tmp_path, cache, "export", str(run / "step-000000"), "--out", str(tmp_path / "step0"))
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "step0", dtype=torch.float32).state_dict()
    want = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # save_dtype auto: final/ in the snapshot's bf16, read from the snapshot (not the hub at plan time)
    assert AutoConfig.from_pretrained(run.parent / "final").dtype == torch.bfloat16
    # a resume of the sharded checkpoint reads no weights but its shards, and its config and tokenizer
    # from the checkpoint: the hub cache is gone, nothing is fetched
    shutil.rmtree(cache)
    p = _gspo(
        tmp_path,
        cache,
        *[a if a != "1" or args[i - 1] != "--steps" else "2" for i, a in enumerate(args)],
        "--resume",
    )
    assert "reads the whole model" not in p.stderr and "once on this node" not in p.stderr, p.stderr[-3000:]
    assert AutoConfig.from_pretrained(run.parent / "final").dtype == torch.bfloat16  # kept in the state
