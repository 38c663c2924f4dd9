"""`gspo plan` past one node (issue 32 item 4): the bytes each rank sends per micro-batch and per
step and their seconds (gspo.capacity_comm), checked against sums worked out by hand for a tiny MoE;
expert parallelism in the memory model; the printed table, the torchrun command it gives past one
node, and the set-ups it refuses (one line naming the field or flag, exit 2)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import shlex
from pathlib import Path

import pytest

from gspo.capacity import Shape, estimate, shape_of
from gspo.capacity_comm import (
    Link,
    all_to_all_seconds,
    link_of,
    micro_batch_moves,
    recomputes_pi_old,
    suggested_ep,
    traffic,
)
from gspo.cli import main
from gspo.config import Config
from gspo.errors import GspoError
from gspo.resolve import capacity_plan

# a tiny MoE: q 2x4 = 8 and kv 1x4 = 4 wide; per layer attention h*q + 2h*kv + q*h + 2h norms + 2
# head-dim norms = 64 + 64 + 64 + 16 + 8 = 216, experts 4 x 3 x 8 x 3 = 288, router 4 x 8 = 32: 536;
# outside the layers 2 x 100 x 8 + 8 = 1608; in all 1608 + 2 x 536 = 2680
TINY = dict(
    vocab_size=100, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=3,
)  # fmt: skip
# 2 nodes x 2 GPUs; 8e9 bytes/s within a node, 1e9 across
LINK = Link(nodes=2, gpus_per_node=2, intra=8e9, inter=1e9)
ROOT = Path(__file__).resolve().parents[1]


def _moves(ep: int, backward: bool = True, recompute: bool = True, tokens: int = 10) -> dict[str, tuple]:
    shape = Shape.from_config(TINY)
    ms = micro_batch_moves(shape, LINK, ep, tokens, 2, 4, backward, recompute)
    return {m.what: (m.nbytes, m.seconds, m.via) for m in ms}


def test_the_tiny_shape_counts_as_worked_out():
    s = Shape.from_config(TINY)
    assert (s.layer_params(), s.expert_params(), s.root_params(), s.params()) == (536, 288, 1608, 2680)


def test_fsdp2_micro_batch_without_ep():
    """Over 4 ranks a rank sends 3/4 of each gathered or reduced tensor: the root gathered once
    (3/4 x 1608 x 2 bytes = 2412), both layers twice (4 x 3/4 x 536 x 2 = 3216), the gradients
    reduce-scattered in float32 (3/4 x 2680 x 4 = 8040); the ranks span 2 nodes: IB, 1e9 bytes/s."""
    assert _moves(1) == {
        "FSDP2 all-gather": (5628, 5628e-9, "IB"),
        "FSDP2 reduce-scatter": (8040, 8040e-9, "IB"),
    }
    assert _moves(1, backward=False) == {"FSDP2 all-gather": (2412 + 1608, 4020e-9, "IB")}


def test_ep_within_a_node():
    """EP 2 on nodes of 2: the dense layer (536 - 288 = 248) over all 4 ranks (2412 + 4 x 3/4 x 496
    = 3900; gradients 3/4 x (2680 - 2 x 288) x 4 = 6312); each rank's 2 experts (144 parameters)
    gathered twice per layer and reduced once over the 2 ranks holding the same ones (4 x 1/2 x 288
    = 576, 2 x 1/2 x 576 = 576), across nodes; tokens: 10 x top-2 x 8 wide x 2 bytes = 320 per
    exchange, half of it leaving, 6 exchanges (dispatch + combine in forward, backward, recompute)
    in each of 2 layers = 1920 over NVLink (8e9 bytes/s)."""
    assert _moves(2) == {
        "FSDP2 all-gather": (3900, 3900e-9, "IB"),
        "FSDP2 reduce-scatter": (6312, 6312e-9, "IB"),
        "experts all-gather": (576, 576e-9, "IB"),
        "experts reduce-scatter": (576, 576e-9, "IB"),
        "tokens all-to-all": (1920, 1920 / 8e9, "NVLink"),
    }
    assert _moves(2, recompute=False)["tokens all-to-all"][0] == 1280  # 4 exchanges
    assert _moves(2, backward=False)["tokens all-to-all"][0] == 640  # forward: 2
    assert "experts reduce-scatter" not in _moves(2, backward=False)


def test_ep_across_nodes():
    """EP 4 = the world: every expert lives whole on one rank (nothing gathered for them); 3/4 of
    each exchange leaves (6 x 2 x 3/4 x 320 = 2880), a third of it to the rank on the same node
    (960 at 8e9 bytes/s) and two thirds over IB at once (1920 at 1e9): the slower, 1.92e-6 s."""
    m = _moves(4)
    assert set(m) == {"FSDP2 all-gather", "FSDP2 reduce-scatter", "tokens all-to-all"}
    assert m["tokens all-to-all"] == (2880, pytest.approx(1.92e-6, rel=1e-12), "IB+NVLink")
    assert all_to_all_seconds(2880, 4, LINK) == pytest.approx(max(960 / 8e9, 1920 / 1e9), rel=1e-12)
    assert all_to_all_seconds(2880, 1, LINK) == 0.0


def test_one_node_runs_on_nvlink():
    """On one node every move is NVLink's, EP's too: EP 2 of 4 ranks gathers and reduces each rank's
    experts over the 2 ranks holding the same ones (on this node, at 8e9 bytes/s), and its tokens'
    all-to-all stays within the node."""
    one = Link(nodes=1, gpus_per_node=4, intra=8e9, inter=1e9)
    ms = micro_batch_moves(Shape.from_config(TINY), one, 1, 10, 2, 4, True, True)
    assert {m.via for m in ms} == {"NVLink"} and ms[0].seconds == ms[0].nbytes / 8e9
    ep = {m.what: m for m in micro_batch_moves(Shape.from_config(TINY), one, 2, 10, 2, 4, True, True)}
    assert {"experts all-gather", "experts reduce-scatter", "tokens all-to-all"} <= set(ep)
    assert {m.via for m in ep.values()} == {"NVLink"}
    assert all(m.seconds == pytest.approx(m.nbytes / 8e9, rel=1e-12) for m in ep.values()), ep


def _cfg(**kw) -> Config:
    base = dict(
        nproc=4, prompts_per_step=4, group_size=4, num_minibatches=2, micro_batch_size=1, max_prompt_tokens=3,
        max_new_tokens=2, packing="off", prefix_sharing="off", mixed_precision="bf16", activation_checkpointing=True,
    )  # fmt: skip
    return Config(**{**base, **kw}).validate()


def test_a_step_is_its_micro_batches_and_one_sync():
    """16 sequences over 4 ranks, 2 minibatches of 2, one sequence per forward: 4 update
    micro-batches (13668 bytes each), 2 forward-only ones (4020) for minibatch 1's pi_old and its
    routing (the volatility's; minibatch 0's training forward is pi_old's), and one gather of the
    whole model for the HF sampler (3/4 x 2680 x 2 = 4020). With the sampler's pi_old the volatility
    still needs minibatch 1's routing; without volatility nothing."""
    shape = Shape.from_config(TINY)
    t = traffic(capacity_plan(_cfg(old_logp="recompute")), shape, LINK)
    assert (t.ep, t.update_batches, t.forward_batches) == (1, 4, 2)
    assert t.step() == pytest.approx((4 * 13668 + 2 * 4020 + 4020, (4 * 13668 + 2 * 4020 + 4020) / 1e9))
    assert traffic(capacity_plan(_cfg(old_logp="rollout")), shape, LINK).forward_batches == 2
    assert (
        traffic(capacity_plan(_cfg(old_logp="rollout", log_volatility=False)), shape, LINK).forward_batches
        == 0
    )
    ddp = traffic(
        capacity_plan(_cfg(parallel="ddp", mixed_precision="none")), shape, LINK
    )  # float32 all-reduce
    assert [m.nbytes for m in ddp.update] == [2 * 3 / 4 * 2680 * 4] and ddp.sync == ()
    one = traffic(capacity_plan(_cfg(nproc=1, mixed_precision="none")), shape, Link(1, 1, 8e9, 1e9))
    assert one.step() == (0, 0)


def test_ep_in_the_step_uses_the_micro_batch_tokens():
    """EP 2: tokens of a micro-batch = 1 row x (3 + 2) = 5; the all-to-all scales with them."""
    shape = Shape.from_config(TINY)
    t = traffic(capacity_plan(_cfg(expert_parallel_size=2)), shape, LINK)
    a2a = {m.what: m.nbytes for m in t.update}["tokens all-to-all"]
    assert t.ep == 2 and a2a == 6 * 2 * 1 / 2 * 5 * 2 * 8 * 2


def test_gloo_reduce_scatters_send_as_an_all_reduce():
    """On the CPU (gloo) a reduce-scatter of T bytes sends 2 (n-1)/n T per rank, an all-reduce's
    volume (counted on the wire by benchmarks/bench_ep.py at 2 and 3 ranks): EP 2 on 4 ranks, the
    dense gradients 2 x 6312 and the experts' 2 x 576; the gathers and all-to-alls as on NCCL."""
    shape = Shape.from_config(TINY)
    gpu, cpu = (
        {
            m.what: m.nbytes
            for m in traffic(
                capacity_plan(_cfg(expert_parallel_size=2, mixed_precision="none", device=d)), shape, LINK
            ).update
        }
        for d in ("cuda", "cpu")
    )
    assert (gpu["FSDP2 reduce-scatter"], gpu["experts reduce-scatter"]) == (6312, 576)
    assert (cpu["FSDP2 reduce-scatter"], cpu["experts reduce-scatter"]) == (2 * 6312, 2 * 576)
    same = ("FSDP2 all-gather", "experts all-gather", "tokens all-to-all")
    assert [cpu[k] for k in same] == [gpu[k] for k in same]


def _update_forwards(p, n: int) -> int:
    """Forward-only passes per micro-batch position of an update under UpdatePlan ``p`` with ``n``
    minibatches, as gspo.training.update runs them (record_pi_old, measure_volatility)."""
    count = 0
    for i in range(n):
        own = p.own_routing[i]
        count += int(p.replays_sampler and own) + int(
            i > 0 and (p.trainer_pi_old or (own and not p.replays_sampler))
        )
    return count + int(p.volatility == "forward")


def test_forward_only_rule_matches_the_update_plan():
    """forward_only_batches restates the update's forward-only passes from the config; the plan
    gspo.resolve builds (on a real tiny MoE) gives the same count in every combination."""
    from step_helpers import plan_update
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo.capacity_comm import forward_only_batches
    from gspo.model.logprobs import PolicyLogprobs

    # (experts 4 wide: grouped_mm wants 16-byte strides; the count depends on nothing but MoE or not)
    policy = PolicyLogprobs(Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY, "moe_intermediate_size": 4})))
    shape = Shape.from_config(TINY)
    replays = [
        dict(routing_replay=False),
        dict(routing_replay=True),
        dict(routing_replay=True, routing_replay_source="rollout", rollout_engine="vllm"),
    ]
    for n, replay, vol, old, corr in itertools.product(
        (1, 2), replays, (True, False), ("rollout", "recompute"), ("none", "seq_tis")
    ):
        cfg = _cfg(num_minibatches=n, log_volatility=vol, old_logp=old, mismatch_correction=corr, **replay)
        p = plan_update(cfg, policy, True)
        assert forward_only_batches(capacity_plan(cfg), shape, 3) == 3 * _update_forwards(p, n), (
            n,
            replay,
            vol,
            old,
            corr,
        )
    dense = _cfg(num_minibatches=2, routing_replay=False)
    assert (
        forward_only_batches(capacity_plan(dense), dataclasses.replace(shape, experts=0), 1) == 0
    )  # no routing to record


def test_pi_old_rule_matches_the_trainers():
    """recomputes_pi_old restates gspo.resolve.pi_old_source without a model: the two agree."""
    from gspo.resolve import pi_old_source

    grid = itertools.product(
        ("auto", "recompute", "rollout"), ("hf", "vllm"), ("float32", "bfloat16"), (None, "bfloat16"), (0, 1)
    )
    checked = 0
    for old, engine, dtype, rdtype, stale in grid:
        try:
            cfg = Config(
                old_logp=old, rollout_engine=engine, dtype=dtype, rollout_dtype=rdtype, async_staleness=stale
            ).validate()
        except GspoError:
            continue
        assert recomputes_pi_old(capacity_plan(cfg)) == (pi_old_source(cfg) == "recompute"), cfg
        checked += 1
    assert checked >= 20


def test_ep_shrinks_the_gathered_layer_by_the_experts_it_leaves_out():
    """A gathered layer under EP 2 holds half its experts: FSDP2's working set shrinks by
    288 / 2 parameters x (4 x 2 + 2 x 4) bytes per layer gathered, and gains the all-to-all
    buffers (2 x 5 tokens x top-2 x 8 x 2 bytes); the states stay sharded over every rank."""
    shape = Shape.from_config(TINY)
    one, two = (estimate(capacity_plan(_cfg(expert_parallel_size=e)), shape, 4) for e in (1, 2))
    assert two.fsdp_unsharded - one.fsdp_unsharded == pytest.approx(-144 * 16 + 2 * 5 * 2 * 8 * 2)
    assert (two.weights, two.optimizer) == (one.weights, one.optimizer)


def test_hf_sampling_under_ep_counts_this_ranks_unsharded_experts_beside_the_whole_ones():
    """Sampling from the trainer's module under EP 2 holds the whole model (whole_experts) and, in
    FSDP2's unshard buffers, this rank's half of each layer's experts: 2 layers x 288 / 2 parameters
    x 2 bytes (bf16 compute) more than without EP; nothing else in the rollout changes."""
    shape = Shape.from_config(TINY)
    one, two = (
        estimate(capacity_plan(_cfg(expert_parallel_size=e, rollout_engine="hf")), shape, 4) for e in (1, 2)
    )
    assert two.sampler - one.sampler == pytest.approx(2 * 288 / 2 * 2)
    assert two.rollout_peak - one.rollout_peak == pytest.approx(2 * 288 / 2 * 2)


def test_suggested_ep_is_the_largest_within_a_node():
    qwen = shape_of("Qwen/Qwen3-30B-A3B")
    assert suggested_ep(qwen, Link(4, 8, 1.0, 1.0)) == 8
    assert suggested_ep(qwen, Link(1, 6, 1.0, 1.0)) == 2  # gcd(128, 6) = 2
    assert suggested_ep(shape_of("Qwen/Qwen3-8B"), Link(4, 8, 1.0, 1.0)) == 1


def test_the_235b_micro_batch_moves_what_the_issue_says():
    """Issue 32: at 235B-A22B (94 layers of 2.49B parameters) a micro-batch moves ~1.8-1.9 TB per
    rank under FSDP2 alone (every layer gathered twice in bf16, every gradient reduced in float32,
    31/32 of each); EP 8 cuts it below a third."""
    shape = shape_of("Qwen/Qwen3-235B-A22B")
    assert shape.layer_params() == pytest.approx(2.49e9, rel=0.01)
    link = Link(4, 8, 450e9, 50e9)
    total = lambda ep: sum(m.nbytes for m in micro_batch_moves(shape, link, ep, 9216, 2, 4, True, True))  # noqa: E731
    n = shape.params()
    assert total(1) == pytest.approx(
        31 / 32 * (shape.root_params() * 2 + 94 * 2 * shape.layer_params() * 2 + n * 4)
    )
    assert 1.8e12 < total(1) < 1.9e12 and total(8) < total(1) / 3


# ------------------------------------------------------------------------------------------------
# the command: its table, its launch line, its refusals


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err.strip()


def _refused(capsys, *args: str) -> str:
    rc, _, err = _plan(capsys, *args)
    assert rc == 2, err
    assert err.startswith("gspo: error:") and "\n" not in err and "Traceback" not in err, err
    return err


QWEN30 = (
    "--model",
    "Qwen/Qwen3-30B-A3B",
    "--prompts-per-step",
    "64",
    "--group-size",
    "2",
    "--num-minibatches",
    "1",
)


def test_two_nodes_print_both_columns_and_the_rendezvous(capsys, tmp_path):
    """The 30B MoE on 2 x 8: FSDP2 and EP 8 side by side; the gathers cross nodes (IB), EP 8's
    all-to-all stays on the node (NVLink); the torchrun command with a c10d rendezvous."""
    run = tmp_path / "x.yaml"
    run.write_text("steps: 1\n")
    rc, out, _ = _plan(
        capsys,
        *QWEN30,
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--gpu-memory-gib",
        "1000",
        "--config",
        str(run),
    )
    assert rc == 0
    assert "2 nodes x 8 GPUs" in out and "FSDP2 (this run)" in out and "EP 8 + FSDP2" in out
    assert re.search(r"FSDP2 all-gather .* IB .* IB", out)
    assert re.search(r"tokens all-to-all +- +[\d.]+ GB +[\d.]+ s NVLink", out)
    assert (
        "torchrun --nnodes 2 --nproc_per_node 8 --node_rank $i --rdzv_backend c10d --rdzv_endpoint "
        f"$MASTER:29500 --rdzv_id gspo -m gspo train --config {run}" in out
    )


def test_the_printed_all_gather_is_the_closed_form(capsys):
    """One node of 8, FSDP2, bf16 compute: the all-gather cell of a micro-batch equals 7/8 x (the
    root once + 48 layers twice) x 2 bytes, at 450 GB/s, counted from Qwen3-30B-A3B's numbers."""
    rc, out, _ = _plan(
        capsys, *QWEN30, "--gpus", "8", "--mixed-precision", "bf16", "--gpu-memory-gib", "1000"
    )
    assert rc == 0
    h, v, q, kv, e, mi = 2048, 151936, 32 * 128, 4 * 128, 128, 768
    layer = h * q + 2 * h * kv + q * h + 2 * h + 2 * 128 + e * (3 * h * mi + h)
    root = 2 * v * h + h
    want = 7 / 8 * (root + 2 * 48 * layer) * 2
    got = re.search(r"FSDP2 all-gather +([\d.]+) GB +([\d.]+) s NVLink", out)
    assert float(got[1]) == pytest.approx(want / 1e9, abs=0.006)
    assert float(got[2]) == pytest.approx(want / 450e9, abs=0.0006)


def test_the_235b_recipe_layout_fits_and_copies_kv_heads(capsys):
    """vLLM's tensor parallel 8 over Qwen3-235B's 4 KV heads: vLLM copies each on 2 ranks (not refused)."""
    rc, out, _ = _plan(
        capsys, "--config", str(ROOT / "recipes" / "qwen3-235b-a22b-4node.yaml"), "--nodes", "4", "--gpus-per-node", "8",
        "--gpu-memory-gib", "139.8",
    )  # fmt: skip
    assert rc == 0 and "over 4 KV heads: each on 2 ranks" in out and ": fits" in out


@pytest.mark.parametrize(
    "args, want",
    [
        (("--nodes", "2"), "--nodes 2 needs --gpus-per-node"),
        (("--nodes", "0"), "--nodes must be >= 1"),
        (("--gpus", "0"), "--gpus must be >= 1"),
        (("--nodes", "2", "--gpus-per-node", "0"), "--gpus-per-node must be >= 1"),
        (
            ("--gpus", "8", "--nodes", "2", "--gpus-per-node", "8"),
            "--gpus 8 is not --nodes x --gpus-per-node",
        ),
        (("--nodes", "200", "--gpus-per-node", "8"), "--nodes x --gpus-per-node must be <= 1024"),
        (("--intra-gbps", "nan"), "--intra-gbps must be a positive finite number"),
        (("--intra-gbps", "0"), "--intra-gbps must be a positive finite number"),
        (("--inter-gbps", "inf"), "--inter-gbps must be a positive finite number"),
        (("--inter-gbps", "-400"), "--inter-gbps must be a positive finite number"),
    ],
)
def test_refuses_a_layout_it_cannot_launch_or_time(capsys, args, want):
    assert want in _refused(capsys, "--model", "Qwen/Qwen3-0.6B", *args)


@pytest.mark.parametrize(
    "args, want",
    [
        # vLLM's tensor-parallel group: consecutive ranks, on one node
        (("--nodes", "2", "--gpus-per-node", "8", "--tp", "16"), "greater than --gpus-per-node 8"),
        (("--nodes", "2", "--gpus-per-node", "6", "--tp", "4"), "does not divide --gpus-per-node 6"),
        (("--gpus", "8", "--tp", "3"), "must divide nproc=8"),
        # expert parallelism: divides the experts and the world, an MoE, FSDP2
        (("--gpus", "6", "--ep", "3", "--prompts-per-step", "48"), "must divide the model's 128 experts"),
        (("--gpus", "8", "--ep", "16"), "expert_parallel_size"),
        (("--gpus", "8", "--ep", "2", "--parallel", "ddp"), "expert_parallel_size"),
    ],
)
def test_refuses_what_the_code_cannot_run(capsys, args, want):
    base = ("--model", "Qwen/Qwen3-30B-A3B", "--rollout-engine", "vllm", "--prompts-per-step", "96")
    err = _refused(capsys, *base, *args)
    field = "vllm_tensor_parallel_size" if "--tp" in args else "expert_parallel_size"
    assert f"config field '{field}'" in err and want in err, err


def test_refuses_ep_on_a_dense_model_and_tp_against_the_kv_heads(capsys, tmp_path):
    err = _refused(capsys, "--model", "Qwen/Qwen3-8B", "--gpus", "8", "--ep", "2")
    assert "config field 'expert_parallel_size': must be 1 for a dense model" in err
    model = tmp_path / "m"
    model.mkdir()
    dense = dict(vocab_size=100, hidden_size=96, intermediate_size=64, num_hidden_layers=2)
    (model / "config.json").write_text(
        json.dumps({**dense, "num_attention_heads": 12, "num_key_value_heads": 6})
    )
    err = _refused(capsys, "--model", str(model), "--gpus", "4", "--rollout-engine", "vllm", "--tp", "4")
    assert "config field 'vllm_tensor_parallel_size'" in err and "6 KV heads" in err


def test_link_of_keeps_one_node_as_before():
    assert link_of(1, None, None, 3600, 400) == Link(1, 8, 450e9, 50e9)  # --gpus' old default
    assert link_of(1, None, 4, 3600, 400).world == 4
    assert link_of(3, 4, 12, 3600, 400).world == 12
    with pytest.raises(GspoError, match="--gpus-per-node"):
        link_of(2, None, 16, 3600, 400)
    assert dataclasses.is_dataclass(Link)


def _pasted_plans() -> list[tuple[str, str]]:
    """(command, output) of every block in recipes/README.md that starts with ``$ gspo plan``."""
    text = (ROOT / "recipes" / "README.md").read_text()
    blocks = re.findall(r"```\n\$ (gspo plan [^\n]+)\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 3
    return blocks


@pytest.mark.parametrize(
    "command, output", _pasted_plans(), ids=lambda x: x.split()[3] if x.startswith("gspo") else ""
)
def test_the_outputs_pasted_in_the_recipes_readme_are_current(capsys, monkeypatch, command, output):
    monkeypatch.chdir(ROOT)
    rc, out, err = _plan(capsys, *shlex.split(command)[2:])
    assert rc == 0, err
    assert out == output


LAYOUT_FLAGS = {"--gpus": 1, "--nodes": 1, "--gpus-per-node": 1, "--gpu-memory-gib": 1, "--nproc": 1}


@pytest.mark.parametrize(
    "args",
    [
        ("--config", str(ROOT / "recipes" / "qwen3-0.6b-gsm8k.yaml"), "--gpus", "1", "--micro-batch-size", "4"),
        (*QWEN30, "--gpus", "8", "--ep", "8", "--tp", "2", "--max-new-tokens", "512", "--rollout-engine", "vllm",
         "--no-activation-checkpointing", "--chat-template", "--system-prompt", "it's $HOME"),
        (*QWEN30, "--nodes", "2", "--gpus-per-node", "8", "--ep", "8", "--mixed-precision", "bf16"),
    ],
    ids=["micro-batch", "ep-tp-tokens", "two-nodes"],
)  # fmt: skip
def test_the_printed_launch_carries_every_override_and_plans_the_same(capsys, args):
    """Issue 49 item 5: the launch command the plan prints ran another run than the one planned (it
    dropped --micro-batch-size, --ep, --tp, --max-new-tokens). Parsed back (shell words) and planned
    again on the same layout, it gives the same plan, word for word."""
    layout = [a for i, a in enumerate(args) if a in LAYOUT_FLAGS or (i and args[i - 1] in LAYOUT_FLAGS)]
    layout += ["--gpu-memory-gib", "1000"]
    rc, out, err = _plan(capsys, *args, "--gpu-memory-gib", "1000")
    assert rc == 0, err
    command = out[out.index("launch:") :].splitlines()
    command = command[0].removeprefix("launch: ") if len(command) == 1 else command[1].split(" -m ", 1)[1]
    words = shlex.split(command)
    assert words[:2] == ["gspo", "train"]
    if "--nproc" in words:  # one node: gspo train starts the ranks; the plan takes them as --gpus
        assert words[words.index("--nproc") + 1] == layout[layout.index("--gpus") + 1]
        del words[words.index("--nproc") : words.index("--nproc") + 2]
    rc, again, err = _plan(capsys, *words[2:], *layout)
    assert rc == 0, err
    assert again == out


def test_the_launch_line_quotes_each_word_for_the_shell():
    """Issue 57: each flag and the config path are quoted for the shell (a space, a quote, a ``$``),
    on one node and in the torchrun line of several; the words come back as given."""
    from gspo.capacity_comm import launch_lines

    flags = ("--system-prompt", "it's $HOME", "--model", "my model", "--lr", "3e-4")
    want = "gspo train --config 'a b.yaml' --system-prompt 'it'\"'\"'s $HOME' --model 'my model' --lr 3e-4"
    assert launch_lines(Link(1, 1, 450e9, 50e9), "a b.yaml", flags) == [f"launch: {want}"]
    assert launch_lines(Link(1, 4, 450e9, 50e9), "a b.yaml", flags) == [f"launch: {want} --nproc 4"]
    many = launch_lines(Link(2, 8, 450e9, 50e9), "a b.yaml", flags)
    assert many[1].endswith(f" -m {want}")
    assert shlex.split(want) == ["gspo", "train", "--config", "a b.yaml", *flags]


def test_refuses_a_bandwidth_no_link_has(capsys):
    """Issue 49 item 7: --inter-gbps 1e-320 was taken and timed as "inf s"; one line, exit 2."""
    for flag, value in (("--inter-gbps", "1e-320"), ("--intra-gbps", "1e9")):
        err = _refused(capsys, "--model", "Qwen/Qwen3-0.6B", flag, value)
        assert f"{flag} must be between 0.001 and 1e+06 Gb/s" in err
