"""Checks that catch seeded bugs the rest of the suite let through (issue 37): where the update's pi_old
comes from, the AdamW betas a run uses, FSDP2's mixed-precision policy, and the weight sync's memory."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from step_helpers import plan_update

from gspo.config import Config
from gspo.data import TrainBatch, left_pad
from gspo.model.logprobs import response_logprobs
from gspo.resolve import capacity_plan, dist_plan
from gspo.rollout.hf import HFRolloutEngine
from gspo.training import update as U
from gspo.training.update import policy_update

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------
# pi_old from the sampler, in every minibatch


@pytest.fixture(scope="module")
def sampled(tiny_moe):
    """16 sampled rows of the tiny MoE (2 prompts x 8) and the trainer's own log-probs of them."""
    model, tok = tiny_moe
    prompts = [tok(f"rev:{n}=").input_ids for n in [12, 3456]]
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(1))
    rep = [p for p in prompts for _ in range(8)]
    rb = eng.generate(rep, 8, temperature=1.0)
    ids, mask = left_pad(rep, tok.pad_token_id)
    with torch.no_grad():
        own = response_logprobs(model, ids, mask, rb.response_ids_BT, rb.response_mask_BT)
    return ids, mask, rb.response_ids_BT, rb.response_mask_BT, own


# per-row offset c_i of the sampler's log-probs below the trainer's: s_i = exp(c_i) exactly. Minibatch 0
# (rows 0-7) holds the extremes, so a minibatch 0 that takes the trainer's own pi_old (s_i = 1) shows.
OFFSETS = torch.tensor([0.4, -0.3, 0.2, -0.25, 0.35, -0.1, 0.05, -0.2] + [0.1, -0.05, 0.02, -0.08] * 2)


@pytest.mark.parametrize(
    "kw",
    [
        dict(async_staleness=2),
        dict(old_logp="rollout"),
        dict(old_logp="rollout", mismatch_correction="seq_tis"),
    ],
    ids=["async", "rollout", "rollout-seq_tis"],
)
def test_pi_old_is_the_samplers_in_every_minibatch(tiny_moe, sampled, kw, monkeypatch):
    """When the plan takes pi_old from the sampler (async runs: the batch's own, older policy), every
    minibatch's loss gets the sampler's log-probs as pi_old, minibatch 0 included (it must not take
    its own first forward): with sampler = trainer - c_i the sequence ratios are exp(c_i)."""
    model, _ = tiny_moe
    ids, mask, r_ids, r_mask, own_BT = sampled
    sampler_BT = (own_BT - OFFSETS[:, None]) * r_mask
    data = TrainBatch(ids, mask, r_ids, r_mask, sampler_BT, torch.linspace(-1.5, 1.5, 16).roll(3))
    cfg = Config(prompts_per_step=2, group_size=8, num_minibatches=2, log_volatility=False, **kw).validate()
    m = copy.deepcopy(model)
    plan = plan_update(cfg, m, True)
    assert plan.pi_old == "rollout"
    seen = []
    real = U.loss_inputs

    def spy(logp_BT, old_BT, mask_BT, *a, **k):  # what the update hands the loss
        seen.append((logp_BT.detach().clone(), old_BT.detach().clone(), mask_BT.clone()))
        return real(logp_BT, old_BT, mask_BT, *a, **k)

    monkeypatch.setattr(U, "loss_inputs", spy)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)  # the weights stay: the trainer's log-probs are own_BT
    out = policy_update(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), data, plan, 1)
    assert len(seen) == 2  # one micro-batch per minibatch, rows in order
    for i, (logp, old, mb_mask) in enumerate(seen):
        rows = slice(8 * i, 8 * i + 8)
        T = old.shape[1]
        assert torch.equal(mb_mask, r_mask[rows, :T])
        torch.testing.assert_close(logp, own_BT[rows, :T], atol=2e-5, rtol=0)
        torch.testing.assert_close(old, sampler_BT[rows, :T], atol=0, rtol=0, msg=f"minibatch {i}: pi_old")
    s_B = torch.exp(OFFSETS)
    assert out["loss/ratio_max"] == pytest.approx(float(s_B.max()), rel=1e-4)
    assert out["loss/ratio_min"] == pytest.approx(float(s_B.min()), rel=1e-4)
    assert out["loss/ratio_mean"] == pytest.approx(float(s_B.mean()), rel=1e-4)


# ------------------------------------------------------------------------------------------------
# AdamW's betas: the config's, in the optimizer a run builds and in the one a resume rebuilds

BETAS = (0.8, 0.95)  # far from the defaults (0.9, 0.99) and from each other


def test_adamw_uses_the_configs_betas_fresh_and_after_resume(tmp_path):
    """A one-step run's checkpoint holds AdamW's betas as configured, and its moments after the one
    step are m = (1 - b1) g and v = (1 - b2) g^2 (so m^2 / v = (1 - b1)^2 / (1 - b2) wherever g != 0:
    the betas the step used, whatever g was); the optimizer a resumed run builds has them too."""
    from gspo import train
    from gspo.launch import open_run
    from gspo.training import checkpoint_files as ckpt

    reward = f"{ROOT / 'tests' / 'fixture_rewards.py'}:noisy"  # every sample scores differently
    cfg = dict(name="betas", output_dir=str(tmp_path), sft_steps=0, steps=1, num_minibatches=1, eval_size=4,
               prompts_per_step=2, group_size=4, max_new_tokens=6, eval_every=0, threads=1, progress=False,
               reward=reward, adam_beta1=BETAS[0], adam_beta2=BETAS[1])  # fmt: skip
    res = train(Config(**cfg))
    state = ckpt.load_trainer_state(ckpt.step_folders(res.run_dir)[-1])
    assert state["step"] == 1
    groups = state["optimizer"]["param_groups"]
    assert groups and all(tuple(g["betas"]) == BETAS for g in groups), [g["betas"] for g in groups]
    m = torch.cat([s["exp_avg"].flatten() for s in state["optimizer"]["state"].values()])
    v = torch.cat([s["exp_avg_sq"].flatten() for s in state["optimizer"]["state"].values()])
    used = v > 1e-20
    assert int(used.sum()) > 1000  # the step had a gradient
    want = (1 - BETAS[0]) ** 2 / (1 - BETAS[1])
    torch.testing.assert_close((m[used] ** 2 / v[used]).median(), torch.tensor(want), rtol=1e-3, atol=0)
    run = open_run(Config(**{**cfg, "steps": 2, "resume": True}))
    try:
        assert run.state.step == 1
        got = [tuple(g["betas"]) for g in run.trainer.optimizer.param_groups]
        assert got and all(b == BETAS for b in got), got
    finally:
        run.close()


# ------------------------------------------------------------------------------------------------
# FSDP2 mixed precision: bf16 compute, float32 gradient reduction


def _fsdp_bf16_worker(rank: int, folder: str) -> None:
    """One of 2 gloo ranks: wrap the tiny MoE as a ``--mixed-precision bf16`` run does (recording the
    policy each ``fully_shard`` call is given), one backward on rows that differ by rank, then the
    sharded gradients' dtypes and how many of their values bf16 can represent -> ``rank<r>.pt``."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    from gspo.model.load import build_char_tokenizer, build_tiny_moe
    from gspo.model.logprobs import PolicyLogprobs, make_layout
    from gspo.training import distributed as D

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    real, policies = fsdp.fully_shard, []

    def recording(module, **kw):
        policies.append(kw.get("mp_policy"))
        return real(module, **kw)

    fsdp.fully_shard = recording
    try:
        cfg = Config(nproc=2, parallel="fsdp", mixed_precision="bf16").validate()
        vocab = len(build_char_tokenizer())
        policy = D.wrap(
            PolicyLogprobs(build_tiny_moe(vocab, seed=0)),
            dist_plan(cfg),
            D.DistContext(rank, 2, rank, torch.device("cpu")),
        )
    finally:
        fsdp.fully_shard = real
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own rows
    p_ids, r_ids = torch.randint(4, vocab, (4, 5), generator=g), torch.randint(4, vocab, (4, 6), generator=g)
    ones_p, ones_r = torch.ones_like(p_ids), torch.ones_like(r_ids)
    logp = policy(make_layout(p_ids, ones_p, r_ids, ones_r, "rows"), r_ids, ones_r)
    (logp * torch.randn(4, 6, generator=g)).sum().backward()
    grads = [p.grad.to_local() for p in policy.parameters() if p.grad is not None]
    flat = torch.cat([x.flatten() for x in grads])
    out = {
        "policies": [(p.param_dtype, p.reduce_dtype) if p is not None else None for p in policies],
        "grad_dtypes": sorted({str(x.dtype) for x in grads}),
        "param_dtypes": sorted({str(p.dtype) for p in policy.parameters()}),
        "n": int((flat != 0).sum()),
        "not_bf16": int((flat != flat.to(torch.bfloat16).float()).sum()),
    }
    torch.save(out, f"{folder}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp2_bf16_computes_in_bf16_and_reduces_gradients_in_float32(tmp_path):
    """Under ``--mixed-precision bf16`` every ``fully_shard`` call (each decoder layer, the root) gets
    param_dtype bf16 and reduce_dtype float32, and it shows in the gradients: the sharded gradients
    are float32 averages of the two ranks' bf16 gradients, which bf16 mostly cannot represent (a
    reduction in bf16 leaves only bf16 values)."""
    torch.multiprocessing.spawn(_fsdp_bf16_worker, args=(str(tmp_path),), nprocs=2, join=True)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert len(got["policies"]) >= 3, got["policies"]  # 2 decoder layers and the root
        for pol in got["policies"]:
            assert pol == (torch.bfloat16, torch.float32), f"fully_shard got (param, reduce) dtypes {pol}"
        assert got["param_dtypes"] == got["grad_dtypes"] == ["torch.float32"]  # float32 master weights
        assert got["n"] > 1000 and got["not_bf16"] > 0.2 * got["n"], (got["not_bf16"], got["n"])


# ------------------------------------------------------------------------------------------------
# the weight sync's memory in gspo plan: twice the largest piece streamed, covering the measured peaks


def _sync_bench() -> dict:
    """``SIZES`` and ``build`` of benchmarks/bench_vllm_sync.py, the models it measured (read from the
    file: importing it would set its vLLM environment and need its helpers)."""
    import ast

    path = ROOT / "benchmarks" / "bench_vllm_sync.py"
    tree = ast.parse(path.read_text())
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build"]
    keep += [n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "SIZES"]
    assert len(keep) == 2, "bench_vllm_sync.py: SIZES or build() not found"
    ns: dict = {"torch": torch}
    exec(compile(ast.Module(keep, type_ignores=[]), str(path), "exec"), ns)
    return ns


def _measured_sync_peaks_mib() -> dict[str, float]:
    """``sync peak MB`` (MiB) per model of benchmarks/RESULTS_scale.md section 4's table."""
    text = (ROOT / "benchmarks" / "RESULTS_scale.md").read_text()
    section = text.split("## 4.")[1].split("\n## ")[0]
    header = next(ln for ln in section.splitlines() if ln.startswith("| model |"))
    col = [c.strip() for c in header.split("|")].index("sync peak MB")
    rows = [ln.split("|") for ln in section.splitlines() if ln.startswith("| ") and ln != header]
    return {r[1].split()[0]: float(r[col]) for r in rows if not r[1].strip().startswith("-")}


def test_weight_sync_estimate_is_twice_the_largest_piece_and_covers_the_measured_peaks():
    """gspo plan's weight-sync term for each model benchmarks/bench_vllm_sync.py measured on real vLLM
    is 2x the larger of the model's largest decoder layer and its embedding (counted on the model
    itself, float32), and it is at least the measured peak (0.94-2.0x that piece) and not far above it."""
    from gspo.capacity import Shape, estimate

    bench = _sync_bench()
    sizes, build = bench["SIZES"], bench["build"]
    measured = _measured_sync_peaks_mib()
    assert set(measured) == set(sizes), measured
    cfg = Config(rollout_engine="vllm").validate()
    for name, size in sizes.items():
        with torch.device("meta"):
            model = build(*size)
        layer = max(sum(p.numel() for p in block.parameters()) for block in model.model.layers) * 4
        embed = model.get_input_embeddings().weight.numel() * 4
        sync = estimate(capacity_plan(cfg), Shape.from_config(model.config.to_dict()), 1).sync
        assert sync == 2 * max(layer, embed), (
            f"{name}: sync {sync} B, not 2 x max(layer {layer}, embedding {embed})"
        )
        ratio = sync / 2**20 / measured[name]
        assert 0.99 <= ratio <= 2.5, f"{name}: the estimate is {ratio:.2f}x the measured sync peak"
