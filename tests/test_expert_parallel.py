"""Expert parallelism (``--ep 2``, transformers' all-to-all experts) on 2 gloo ranks makes the update
FSDP2 without EP makes, in float32, on the tiny Qwen3-MoE.

One torchrun launch of tests/dist_worker.py runs each case with ``expert_parallel_size`` 1 and 2 on
the same rows. SGD (no clipping) makes the step ``lr x gradient``, so comparing the updates compares
the gradients; AdamW with clipping goes through the gradient norm over the experts' and the dense
parameters' meshes. Bad ``--ep`` values are refused in one line naming the field, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from gspo.config import Config
from gspo.errors import GspoError
from gspo.model.load import build_char_tokenizer, build_tiny_dense, build_tiny_moe
from gspo.model.routing import find_routers
from tests.cli_helpers import one_line, rank_env, wait_proc
from tests.test_distributed import ROOT, synthetic_rollout

pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")

NPROC = 2
REL = 1e-5  # the bound on the relative difference of gradients and of the update
BASE = {
    "num_minibatches": 2,
    "prompts_per_step": 2,
    "group_size": 8,
    "log_volatility": True,
    "old_logp": "recompute",
    "threads": 1,
}
CASES = {
    "sgd-gspo": ("sgd", 0.1, {"algo": "gspo", "max_grad_norm": 0.0}),
    "sgd-grpo-r2": ("sgd", 0.1, {"algo": "grpo", "routing_replay": True, "max_grad_norm": 0.0}),
    "sgd-grpo-r3": (
        "sgd",
        0.1,
        {
            "algo": "grpo",
            "routing_replay": True,
            "routing_replay_source": "rollout",
            "rollout_engine": "vllm",  # (the plan alone: the worker feeds the sampler's routing itself)
            "max_grad_norm": 0.0,
        },
    ),
    "adamw-gspo-clip": ("adamw", 1e-3, {"algo": "gspo", "max_grad_norm": 0.5}),
}
RUNS = [
    {
        "name": f"ep{ep}-{case}",
        "opt": opt,
        "lr": lr,
        "cfg": {**BASE, **extra, "expert_parallel_size": ep},
        "replay_check": "grpo" in case,
    }
    for case, (opt, lr, extra) in CASES.items()
    for ep in (1, 2)
]


def _with_sampler_routing(vocab: int):
    """The synthetic rollout plus a sampler routing (R3): k distinct experts for every position of
    the trainer's ``rows`` layout ([B, P + T, k] per layer)."""
    data = synthetic_rollout(vocab)
    model = build_tiny_moe(vocab, seed=0)
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    B, L = data.adv_B.shape[0], data.prompt_ids_BP.shape[1] + data.response_ids_BT.shape[1]
    g = torch.Generator().manual_seed(5)
    data.sampler_routing = {
        name: torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B * L)]).view(B, L, k)
        for name in find_routers(model)
    }
    return data


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    vocab = len(build_char_tokenizer())
    data = _with_sampler_routing(vocab)
    tmp = tmp_path_factory.mktemp("ep")
    torch.save({"data": data, "runs": RUNS}, tmp / "in.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}"]
    cmd += [
        str(ROOT / "tests" / "dist_worker.py"),
        "--data",
        str(tmp / "in.pt"),
        "--out",
        str(tmp / "out.pt"),
    ]
    kw = {"env": rank_env(), "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "cwd": tmp}
    rc, out = wait_proc(subprocess.Popen(cmd, **kw), 600)
    assert rc == 0, out[-6000:]
    return vocab, torch.load(tmp / "out.pt", weights_only=False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (0 when both are 0)."""
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / scale if scale else float((a - b).abs().max())


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_update_equals_fsdp(results, case):
    """The gradients (per tensor, relative to its largest entry), SGD's update (relative to its largest
    entry), the loss, the gradient norm and the expert volatility with ``--ep 2`` equal FSDP2's without EP; the sampler's module (gathered,
    experts whole) holds the updated weights and runs a forward on rank 0 alone (no collective)
    with FSDP2's logits; the full optimizer state round-trips."""
    vocab, res = results
    ep1, ep2 = res[f"ep1-{case}"], res[f"ep2-{case}"]
    init = build_tiny_moe(vocab, seed=0).state_dict()
    assert set(ep2["params"]) == set(ep1["params"])
    assert len(ep2["grads"]) == len(ep1["grads"]) == BASE["num_minibatches"]  # one per optimizer step
    grad_rel = max(_rel(g2[n], g1[n]) for g1, g2 in zip(ep1["grads"], ep2["grads"], strict=True) for n in g1)
    assert grad_rel <= REL, grad_rel  # per tensor, relative to that tensor's largest gradient
    names = sorted(ep1["params"])  # the whole update, relative to its largest entry
    delta1 = torch.cat([(ep1["params"][n] - init[n]).flatten() for n in names])
    delta2 = torch.cat([(ep2["params"][n] - init[n]).flatten() for n in names])
    step_rel = _rel(delta2, delta1)
    # AdamW's first steps are lr g / (|g| + eps): a gradient entry near eps passes its own relative
    # error (not the tensor's) to its step, so only SGD's step (lr g) is held to the bound
    assert step_rel <= REL or CASES[case][0] != "sgd", step_rel
    print(f"{case}: gradients {grad_rel:.2e}, update {step_rel:.2e} (max relative difference)")
    experts = [n for n in ep1["params"] if ".experts." in n]
    assert experts and all(not torch.equal(ep2["params"][n], init[n]) for n in experts)  # they moved
    gn1, gn2 = ep1["metrics"]["loss/grad_norm"], ep2["metrics"]["loss/grad_norm"]
    assert abs(gn2 - gn1) <= REL * gn1, (gn1, gn2)
    # the loss sums terms of both signs to near 0 (~1e-3): absolute, as in tests/test_distributed.py
    assert abs(ep2["metrics"]["loss/loss"] - ep1["metrics"]["loss/loss"]) <= 1e-6
    vol = sorted(k for k in ep1["metrics"] if k.startswith("moe/"))
    assert vol and sorted(k for k in ep2["metrics"] if k.startswith("moe/")) == vol
    assert all(ep2["metrics"][k] == ep1["metrics"][k] for k in vol), {
        k: (ep1["metrics"][k], ep2["metrics"][k]) for k in vol
    }
    assert ep2["rollout_rel"] == 0.0 and ep2["rollout_tied"]
    torch.testing.assert_close(ep2["probe_logits"], ep1["probe_logits"], rtol=REL, atol=REL)
    assert ep2["opt_diff"] == 0.0 and ep2["opt_keys"] == ep1["opt_keys"]
    if CASES[case][2].get("routing_replay"):
        assert ep2["replay_ok"] and ep1["replay_ok"]  # the forced top-k is the top-k used, under EP too


@pytest.mark.parametrize(
    "extra,msg",
    [
        ({"parallel": "ddp"}, "needs parallel fsdp"),
        ({"lora_rank": 4}, "LoRA"),
        ({"nproc": 6, "prompts_per_step": 12, "expert_parallel_size": 4}, "must divide nproc (6)"),
    ],
)
def test_bad_expert_parallel_size_is_one_line(extra, msg):
    with pytest.raises(GspoError, match="expert_parallel_size") as e:
        Config(**{"expert_parallel_size": 2, "nproc": 2, **extra}).validate()
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_expert_parallel_refuses_what_it_cannot_split():
    """A dense model, or a number of ranks that does not split the experts, fails in one line naming
    the field before any collective (the model on the meta device is enough)."""
    from gspo.model.expert_parallel import check_divides

    vocab = len(build_char_tokenizer())
    with torch.device("meta"):
        dense, moe = build_tiny_dense(vocab), build_tiny_moe(vocab)
    with pytest.raises(GspoError, match="'expert_parallel_size': .*no routed experts"):
        check_divides(dense, 2, 2)
    with pytest.raises(GspoError, match=r"experts per layer \(8\) and the world size \(6\)"):
        check_divides(moe, 3, 6)
    check_divides(moe, 4, 8)


def test_cli_refuses_ep_without_enough_processes(tmp_path, capsys):
    """``gspo train --ep 2`` in one process (in-process: the command's code path without an
    interpreter start): exit 2, one line naming the field, no weight read."""
    one_line(
        capsys, ["train", "--ep", "2", "--output-dir", str(tmp_path), "--no-progress"], "expert_parallel_size"
    )
    assert not any(tmp_path.rglob("*.safetensors"))


def test_transformers_expert_parallel_names_exist():
    """The transformers names gspo.compat.transformers_ep relies on (version guard: 5.25)."""
    from gspo import compat
    from gspo.compat import transformers_ep

    assert transformers_ep.applies()
    for module, attr in transformers_ep.UPSTREAM:
        compat.resolve(module, attr)


def test_dense_model_or_indivisible_experts_refused_from_the_config():
    """The plan refuses, from the model's config alone (before any weight is read), EP on a dense
    model or over a number of ranks that does not split the experts."""
    from gspo.resolve import dist_plan

    for model, ep, msg in (
        ("embedded:tiny-dense", 2, "dense"),
        ("embedded:tiny-moe", 3, r"experts per layer \(8\)"),
    ):
        with pytest.raises(GspoError, match=f"'expert_parallel_size': .*{msg}"):
            dist_plan(Config(model=model, expert_parallel_size=ep).validate())
    assert dist_plan(Config(model="embedded:tiny-moe", expert_parallel_size=2)).expert_parallel_size == 2


# ------------------------------------------------------------------------------------------------
# through gspo train: HF weights in, sharded checkpoints, resume, final/ and gspo export out


EP_RUN = ("--nproc", "2", "--ep", "2", "--steps", "4")


@pytest.fixture(scope="module")
def ep_straight(tmp_path_factory):
    """A 4-step ``--nproc 2 --ep 2`` run from an HF folder (each rank reads its own experts)."""
    from gspo.model.load import save_pretrained
    from tests.test_sharded_checkpoints import _train

    tmp = tmp_path_factory.mktemp("ep-train")
    tok = build_char_tokenizer()
    save_pretrained(build_tiny_moe(len(tok), seed=3), tok, tmp / "model")
    return tmp, _train(tmp, "straight", *EP_RUN)


@pytest.fixture(scope="module")
def ep_runs(ep_straight):
    """The 4-step ``--ep 2`` run, the same run killed after its step-2 checkpoint and resumed, and a
    1-step run (its step-0 checkpoint)."""
    from tests.test_sharded_checkpoints import _killed_after_step_2, _train

    tmp, straight = ep_straight
    ep = EP_RUN
    part = _killed_after_step_2(straight, tmp / "part" / straight.name)
    _train(tmp, "part", *ep, "--resume")
    first = _train(tmp, "first", *ep[:4], "--steps", "1")  # keeps its step-0 checkpoint
    return tmp, straight, part, first


def test_expert_parallel_run_trains_its_experts(ep_straight):
    """Every step of an ``--ep 2`` run samples with the experts gathered whole (whole_experts), then
    trains them expert-parallel again: after 4 steps every expert of every MoE layer has moved from
    the folder's weights, as the dense weights have (a sampler that left its plain forward in place
    would train on detached copies: the experts frozen, the run still exit 0)."""
    from safetensors.torch import load_file

    from tests.test_sharded_checkpoints import _weights

    tmp, straight = ep_straight
    start, end = load_file(tmp / "model" / "model.safetensors"), _weights(straight / "final")
    assert end.keys() == start.keys()
    experts = sorted(k for k in start if ".experts." in k)
    assert experts, "no expert tensor in the folder"
    frozen = [k for k in experts if torch.equal(end[k], start[k])]
    assert not frozen, f"{len(frozen)} of {len(experts)} expert tensors never moved: {frozen[:4]}"
    assert any(not torch.equal(end[k], start[k]) for k in start if ".experts." not in k)


def test_expert_parallel_run_resumes_bit_for_bit(ep_runs):
    """Killed after step 2 and resumed with ``--ep 2``: final/ equals the uninterrupted run's bit for
    bit, and so do the rewards of every step; each rank wrote its own shard file."""
    from tests.test_sharded_checkpoints import _weights

    _, straight, part, _ = ep_runs
    a, b = _weights(straight / "final"), _weights(part / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    key = "rollout/reward_mean"
    assert [r[key] for r in rows if key in r] == [r[key] for r in want if key in r]
    shards = sorted(p.name for p in (straight / "checkpoints" / "step-000002" / "dcp").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_expert_parallel_checkpoints_hold_every_expert(ep_runs):
    """The step-0 checkpoint, exported by ``gspo export`` in one process, holds exactly the folder's
    weights (every expert of every rank read in place), and the step-4 export equals final/."""
    from safetensors.torch import load_file

    from tests.test_sharded_checkpoints import _export, _weights

    tmp, straight, _, first = ep_runs
    _export(first / "checkpoints" / "step-000000", tmp / "step0")
    want, got = load_file(tmp / "model" / "model.safetensors"), _weights(tmp / "step0")
    assert got.keys() == want.keys() and any(".experts." in k for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want)
    _export(straight / "checkpoints" / "step-000004", tmp / "step4")
    a, b = _weights(straight / "final"), _weights(tmp / "step4")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
