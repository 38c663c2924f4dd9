"""Environments (multi-turn trajectories, gspo.envs) everywhere the single-turn path runs (issue 38
item 4): 2 gloo ranks (FSDP2, DDP, LoRA) make one process's update on the same trajectories, to 1e-6;
``gspo train --nproc 2 --env ...`` trains and its held-out trajectories score as one process's; LoRA
trains on trajectories with the loss on the model's tokens alone and only adapters moving; and async
with an environment on 2 ranks trains as one process. R3 with vLLM: tests/test_vllm_multiturn.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import gspo_at_once, rank_env, wait_proc
from fixture_observe_env import Observer
from step_helpers import plan_update

from gspo.config import Config
from gspo.data import TrainBatch
from gspo.envs.base import Limits, Step
from gspo.envs.episodes import run_episodes
from gspo.envs.load import EnvSpec
from gspo.model.load import build_char_tokenizer, build_tiny_moe
from gspo.resolve import score_plan
from gspo.rollout.hf import HFRolloutEngine
from gspo.tasks.datasets import Example
from gspo.training import update as U
from gspo.training.scoring import score_rollout
from gspo.training.update import policy_update

pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")

ROOT = Path(__file__).resolve().parents[1]
G, PROMPTS, NPROC = 4, 4, 2
ENV_CFG = {"env": "tools:calc", "max_trajectory_tokens": 40, "prompts_per_step": PROMPTS, "group_size": G}
BASE = {**ENV_CFG, "num_minibatches": 2, "log_volatility": False, "old_logp": "recompute", "threads": 1}
# (name, optimizer, lr, config): each run is one update on 2 ranks (tests/dist_worker.py) against one
# process on the same trajectories; SGD without clipping keeps the loss's normalizer visible
RUNS = [
    {"name": f"{par}-sgd-{algo}", "opt": "sgd", "lr": 0.1,
     "cfg": {**BASE, "parallel": par, "max_grad_norm": 0.0, "algo": algo, "routing_replay": algo == "gspo",
             **({"aggregation": "token_mean"} if algo == "grpo" else {})}}
    for par in ("fsdp", "ddp") for algo in ("gspo", "grpo")
] + [
    {"name": f"{par}-adamw-lora", "opt": "adamw", "lr": 1e-3, "cfg": {**BASE, "parallel": par, "lora_rank": 4}}
    for par in ("fsdp", "ddp")
]  # fmt: skip


def _trajectories() -> TrainBatch:
    """4 prompts x G trajectories of the tiny MoE (seed 0), scored: the model's tokens, then
    observations, then the model's again (checked)."""
    tok = build_char_tokenizer()
    model = build_tiny_moe(len(tok), seed=0).eval()
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
    ex = [Example(p, "") for p in ("rev:12=", "rev:345=", "rev:6789=", "rev:01=") for _ in range(G)]
    ids = [tok(e.prompt, add_special_tokens=False).input_ids for e in ex]
    with torch.no_grad():
        eb = run_episodes(eng, tok, EnvSpec(Observer, "observer", None), ex, ids, Limits(3, 8, 40), 1.0)
    data, _ = score_rollout(eb, tok, None, [], score_plan(Config(**ENV_CFG).validate()), 0.0)
    after_obs_B = (data.response_mask_BT * (data.obs_mask_BT.cumsum(-1) > 0)).sum(-1)
    assert int((after_obs_B > 0).sum()) >= 4 and (data.adv_B != 0).any()  # what this file needs
    # each rank's rows (tests/dist_worker.py: 4r..4r+3 of minibatch 0..7 and of 8..15) have some
    for r in (0, 1):
        assert after_obs_B[
            torch.cat([torch.arange(4 * r, 4 * r + 4), torch.arange(8 + 4 * r, 12 + 4 * r)])
        ].any()
    return data


ENV_FILE = Path(__file__).with_name("fixture_observe_env.py")  # a user's environment module


ENV_ARGS = ["--task", "reverse", "--max-new-tokens", "8", "--max-turns", "3", "--max-trajectory-tokens", "40"]


GSPO = [sys.executable, "-m", "gspo"]  # the command, as a process of its own


def _args(tmp: Path, name: str, model: str, nproc: int, *extra: str) -> list[str]:
    """``gspo train``'s arguments (after ``gspo``) for the run ``name`` with the environment."""
    return [
        "train", "--model", model, *ENV_ARGS, "--env",
        f"{ENV_FILE}:Observe", "--steps", "2", "--eval-size", "8", "--prompts-per-step", "4",
        "--group-size", "4", "--threads", "1", "--no-progress", "--nproc", str(nproc), "--output-dir",
        str(tmp / name), "--save-every", "0", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The 2-rank worker on the trajectories, and ``gspo train`` with an environment on 2 ranks and on
    one process, all started at once (their start-ups overlap); the one-process runs (the warm start
    and "one") through ``gspo.cli.main`` in this process (no interpreter start of their own)."""
    from gspo.cli import main

    data = _trajectories()
    tmp = tmp_path_factory.mktemp("env-ranks")
    torch.save({"data": data, "runs": RUNS}, tmp / "in.pt")
    worker = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
        str(ROOT / "tests" / "dist_worker.py"), "--data", str(tmp / "in.pt"), "--out", str(tmp / "out.pt"),
    ]  # fmt: skip
    kw = {"env": rank_env(), "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "cwd": tmp}
    procs = {"worker": subprocess.Popen(worker, **kw)}
    # a warm start (one process) that ends its turns with EOS, so greedy held-out trajectories go on
    # after an observation; both runs below start from its final/ without one of their own
    assert main(_args(tmp, "warm", "embedded:tiny-moe", 1, "--sft-steps", "40")) == 0
    model = str(next((tmp / "warm").iterdir()) / "final")
    procs["two"] = subprocess.Popen([*GSPO, *_args(tmp, "two", model, NPROC, "--sft-steps", "0")], **kw)
    procs["lora"] = subprocess.Popen(
        [*GSPO, *_args(tmp, "lora", model, NPROC, "--sft-steps", "0", "--lora-rank", "4")], **kw
    )
    one = main(_args(tmp, "one", model, 1, "--sft-steps", "0"))
    done = {name: wait_proc(p, 600) for name, p in procs.items()}
    done["one"] = (one, "(in-process: its output is the test's captured output)")
    return {"data": data, "tmp": tmp, "done": done}


def _strip(name: str) -> str:
    """A wrapped module's parameter name as the plain model's (DDP's ``module.``, the trainer's
    forward module's ``model.``)."""
    return name.removeprefix("module.").removeprefix("model.")


def _single(run: dict, data: TrainBatch) -> tuple[torch.nn.Module, dict, list[dict]]:
    """One process: the same update on the same trajectories, and the gradients each step applied."""
    from tests.dist_worker import _record_gradients, make_optimizer

    cfg = Config(**run["cfg"]).validate()
    model = build_tiny_moe(len(build_char_tokenizer()), seed=0)
    if cfg.lora_rank:
        from gspo.model.lora import apply_lora

        model = apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules)
    opt = make_optimizer(run["opt"], [p for p in model.parameters() if p.requires_grad], run["lr"])
    grads = _record_gradients(model, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    metrics = policy_update(model, opt, sched, data, plan_update(cfg, model, True), 1)
    return model, metrics, grads


@pytest.mark.parametrize("run", RUNS, ids=[r["name"] for r in RUNS])
def test_two_ranks_update_on_trajectories_equals_one_process(launches, run):
    """Rank r takes its groups of each minibatch (trimmed to its own longest prompt and trajectory, as
    a rank's own rollout is): the gradients of every optimizer step, the loss, the gradient norm and
    the updated weights equal one process's on all the trajectories, to 1e-6."""
    rc, out = launches["done"]["worker"]
    assert rc == 0, out[-6000:]
    got = torch.load(launches["tmp"] / "out.pt", weights_only=False)[run["name"]]
    ref, ref_m, ref_grads = _single(run, launches["data"])
    assert len(got["grads"]) == len(ref_grads) == 2  # one optimizer step per minibatch
    for mine, want in zip(got["grads"], ref_grads, strict=True):
        mine = {_strip(k): v for k, v in mine.items()}
        assert set(mine) == set(want) and want
        for k, g in want.items():
            torch.testing.assert_close(mine[k], g, atol=1e-6, rtol=0, msg=k)
    ref_sd, moved = ref.state_dict(), 0.0
    init = build_tiny_moe(len(build_char_tokenizer()), seed=0).state_dict()
    for name, p in got["params"].items():
        torch.testing.assert_close(p, ref_sd[name], atol=1e-6, rtol=0, msg=name)
        base = name.replace("base_model.model.", "").replace(".base_layer", "")
        if base in init:
            moved = max(moved, float((p - init[base]).abs().max()))
    for k in ("loss/loss", "loss/grad_norm"):
        assert abs(got["metrics"][k] - ref_m[k]) <= 1e-5, (k, got["metrics"][k], ref_m[k])
    if run["cfg"].get("lora_rank"):  # the frozen base stays as it was, the adapters moved
        assert moved == 0.0
        lora = [n for n in got["params"] if ".lora_B." in n]
        assert lora and max(float(got["params"][n].abs().max()) for n in lora) > 1e-5
    else:
        assert moved > 1e-5


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_gspo_train_two_ranks_with_an_environment(launches):
    """``gspo train --nproc 2 --env FILE:Class`` trains on multi-turn trajectories and writes final/;
    the step-0 held-out trajectories (greedy, split over the ranks, rank 0 joining the rewards) score
    exactly as one process's (the same weights: a folder, no warm start of their own)."""
    tmp = launches["tmp"]
    for name in ("two", "one"):
        rc, out = launches["done"][name]
        assert rc == 0, (name, out[-6000:])
    runs = {n: next((tmp / n).iterdir()) for n in ("two", "one")}
    rows = {n: _rows(r) for n, r in runs.items()}
    for k in ("eval/reward_mean", "eval/accuracy", "eval/multi_turn_frac"):
        assert rows["two"][0][k] == rows["one"][0][k], k
    assert rows["two"][0]["eval/multi_turn_frac"] > 0  # the held-out trajectories have several turns
    for r in rows["two"][1:]:
        assert r["env/obs_len"] > 0 and r["env/turns_mean"] > 1 and r["loss/grad_norm"] > 0
    assert (runs["two"] / "final" / "model.safetensors").exists()


def test_gspo_train_two_ranks_lora_with_an_environment(launches):
    """``gspo train --nproc 2 --lora-rank 4 --env FILE:Class`` trains (FSDP2) on multi-turn trajectories
    (the update itself: the LoRA runs above) and final/ is the base with the adapters merged, from
    the sharded model (it used to deepcopy the FSDP2 module and fail at the step-0 checkpoint):
    W + (alpha / r) B A of final/adapter/, every other weight the base's, bit for bit."""
    from safetensors.torch import load_file

    rc, out = launches["done"]["lora"]
    assert rc == 0, out[-6000:]
    run = next((launches["tmp"] / "lora").iterdir())
    for r in _rows(run)[1:]:
        assert r["env/obs_len"] > 0 and r["loss/grad_norm"] > 0
    base = load_file(run / "checkpoints" / "lora-base" / "model.safetensors")
    final = load_file(run / "final" / "model.safetensors")
    adapter = load_file(run / "final" / "adapter" / "adapter_model.safetensors")
    assert set(final) == set(base)
    merged = 0
    for k, w in base.items():
        pre = "base_model.model." + k.removesuffix(".weight")
        if pre + ".lora_A.weight" in adapter:
            w = w + 16.0 / 4 * adapter[pre + ".lora_B.weight"] @ adapter[pre + ".lora_A.weight"]
            merged += 1
        torch.testing.assert_close(final[k], w, atol=1e-7, rtol=0, msg=k)
    assert merged and max(float(v.abs().max()) for k, v in adapter.items() if ".lora_B." in k) > 0


# ------------------------------------------------------------------------------------------------
# LoRA, one process


def test_lora_update_on_trajectories_trains_adapters_on_the_models_tokens(monkeypatch):
    """LoRA on trajectories: the loss sees the model's tokens alone (the mask it is given is the
    model's, never an observation's), the adapters move, every base weight stays bit for bit."""
    from gspo.model.lora import apply_lora

    data = _trajectories()
    cfg = Config(**{**BASE, "lora_rank": 4}).validate()
    model = apply_lora(build_tiny_moe(len(build_char_tokenizer()), seed=0), 4, 16.0, "all-linear")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    real, seen = U.loss_inputs, []

    def spy(logp_BT, old_BT, mask_BT, *a, **k):  # what the update hands the loss
        seen.append(mask_BT.clone())
        return real(logp_BT, old_BT, mask_BT, *a, **k)

    monkeypatch.setattr(U, "loss_inputs", spy)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    policy_update(
        model,
        opt,
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        data,
        plan_update(cfg, model, True),
        1,
    )
    assert len(seen) == 2
    for i, mask_BT in enumerate(seen):  # minibatch i: rows 8i..8i+7, trimmed to their own length
        rows = data.rows(slice(8 * i, 8 * (i + 1)))
        assert torch.equal(mask_BT.bool(), rows.response_mask_BT.bool())
        assert not (mask_BT.bool() & rows.obs_mask_BT.bool()).any() and rows.obs_mask_BT.any()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".lora_" in n for n in moved)
    assert {n for n, p in model.named_parameters() if p.requires_grad} >= moved


def test_gspo_train_lora_with_an_environment(tmp_path):
    """``gspo train --lora-rank 4 --env FILE:Class`` end to end: trains on multi-turn trajectories
    (observations in them, non-zero gradients), and what moved is the adapters alone: every base
    weight of the trained PEFT model is the initial model's, bit for bit (no warm start: it trains the
    whole model before the adapters are added)."""
    from gspo import train
    from gspo.model.load import load_model_and_tokenizer

    res = train(Config(
        model="embedded:tiny-moe", task="reverse", env=f"{ENV_FILE}:Observe", max_new_tokens=8,
        max_turns=3, max_trajectory_tokens=40, sft_steps=0, steps=2, prompts_per_step=4, group_size=4, eval_size=4,
        eval_every=0, threads=1, progress=False, lora_rank=4, lr=1e-3, output_dir=str(tmp_path),
    ))  # fmt: skip
    rows = _rows(res.run_dir)[1:]
    assert all(r["env/obs_len"] > 0 and r["loss/grad_norm"] > 0 for r in rows), rows
    init = load_model_and_tokenizer("embedded:tiny-moe", seed=0)[0].state_dict()
    lora, base = 0.0, 0
    for name, p in res.model.named_parameters():
        plain = name.replace("base_model.model.", "").replace(".base_layer", "")
        if ".lora_" in name:
            lora = max(lora, float(p.abs().max())) if ".lora_B." in name else lora
        else:
            assert torch.equal(p.detach(), init[plain]), name
            base += 1
    assert lora > 0 and base == len(init) - ("lm_head.weight" in init)  # (tied to the embedding)
    assert res.final_dir is not None and (res.final_dir / "model.safetensors").exists()


# ------------------------------------------------------------------------------------------------
# what stays refused


class _Flaky:
    """Raises on the first turn of every prompt holding a '3' (reward_on_error zero: reward 0)."""

    def reset(self, example: Example) -> str:
        self.bad = "3" in example.prompt
        return example.prompt

    def step(self, model_turn: str) -> Step:
        if self.bad:
            raise RuntimeError("flaky")
        return Step(None, 1.0)


def test_a_share_of_trajectories_counts_its_own_errors():
    """What async would send each rank (``env_fields(batch, rows)``): a share of the groups carries
    its own rows' failures, so the shares' error counts add up to the batch's (a whole-batch count
    sent to each rank would count each failure N times). The round trip keeps them."""
    from gspo.envs.episodes import env_fields, with_env_fields

    tok = build_char_tokenizer()
    eng = HFRolloutEngine(build_tiny_moe(len(tok), seed=0).eval(), tok.eos_token_id, tok.pad_token_id,
                          torch.Generator().manual_seed(0))  # fmt: skip
    ex = [Example(p, "") for p in ("rev:12=", "rev:345=", "rev:33=", "rev:01=") for _ in range(2)]
    ids = [tok(e.prompt, add_special_tokens=False).input_ids for e in ex]
    spec = EnvSpec(_Flaky, "flaky", None, on_error="zero")
    with torch.no_grad():
        eb = run_episodes(eng, tok, spec, ex, ids, Limits(2, 4, 20), 1.0)
    assert eb.n_errors == 4 and eb.failed_B.tolist() == [0, 0, 1, 1, 1, 1, 0, 0]
    shares = [env_fields(eb, slice(0, 4)), env_fields(eb, slice(4, 8))]
    assert [f["n_errors"] for f in shares] == [2, 2] and env_fields(eb)["n_errors"] == 4
    back = with_env_fields(eb, env_fields(eb))
    assert back.n_errors == 4 and torch.equal(back.failed_B, eb.failed_B)


@pytest.mark.slow  # the slow tier (multi-process, ~25 s here): CI runs it
def test_async_with_an_environment_on_two_ranks_trains_as_one_process(tmp_path):
    """Async rollouts with an environment on 2 ranks (FSDP2): the sampler process plays each step's
    trajectories, every rank takes its groups (with their own error count), and the run ends where
    the one-process async run does: the same batches and final weights to 1e-6."""
    from safetensors.torch import load_file

    from gspo.model.load import save_pretrained

    tok = build_char_tokenizer()
    save_pretrained(build_tiny_moe(len(tok), seed=3), tok, tmp_path / "model")
    args = ["train", "--model", "model", *ENV_ARGS, "--env", f"{ENV_FILE}:Observer", "--sft-steps", "0",
            "--eval-size", "4", "--eval-every", "0", "--prompts-per-step", "4", "--group-size", "4",
            "--threads", "1", "--no-progress", "--save-every", "0",
            "--steps", "3", "--async-staleness", "1", "--num-minibatches", "1", "--lr", "1e-4",
            "--warmup-steps", "1", "--max-grad-norm", "0"]  # fmt: skip
    runs = {n: [*args, "--nproc", str(k), "--output-dir", n] for n, k in (("one", 1), ("two", NPROC))}
    done = gspo_at_once(runs, tmp_path, 600)
    for n, (rc, out) in done.items():
        assert rc == 0, (n, out[-6000:])
    one, two = (next((tmp_path / n).iterdir()) for n in ("one", "two"))
    rows = {n: [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()][1:]
            for n, r in (("one", one), ("two", two))}  # fmt: skip
    assert [r["async/staleness"] for r in rows["two"]] == [0, 1, 1]
    for key in ("rollout/reward_mean", "rollout/response_len"):
        assert [r[key] for r in rows["one"]] == pytest.approx([r[key] for r in rows["two"]], abs=1e-6), key
    wa, wb = (load_file(r / "final" / "model.safetensors") for r in (one, two))
    start = load_file(tmp_path / "model" / "model.safetensors")
    assert max(float((wa[k] - start[k]).abs().max()) for k in wa) > 1e-4  # the weights moved (3 x lr)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=0, msg=k)
