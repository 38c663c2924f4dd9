"""Multi-turn rollouts (gspo.envs) with the vLLM engine against real vLLM (vllm-cpu, on a CPU).

Runs only where vllm imports, i.e. in the venv made by ``.ci/vllm_env.sh``::

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        .venv-vllm/bin/python -m pytest -q tests/test_vllm_multiturn.py
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

vllm = pytest.importorskip("vllm")

import functools  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from gspo.config import Config  # noqa: E402
from gspo.data import left_pad  # noqa: E402
from gspo.envs.base import Limits, Step  # noqa: E402
from gspo.envs.episodes import run_episodes  # noqa: E402
from gspo.envs.load import EnvSpec  # noqa: E402
from gspo.model.load import load_model_and_tokenizer  # noqa: E402
from gspo.model.logprobs import make_layout, response_logprobs  # noqa: E402
from gspo.resolve import engine_plan  # noqa: E402
from gspo.rollout.vllm import VLLMRolloutEngine  # noqa: E402
from gspo.tasks.datasets import Example  # noqa: E402

TOL = 1e-5


class _Observe:
    """Answers every turn with an observation (so every trajectory has several turns)."""

    def reset(self, example):
        return example.prompt

    def step(self, model_turn):
        return Step("=12 ", 0.5)


@pytest.mark.parametrize("layout", ["rows", "shared_prefix"])
def test_vllm_trajectories_masks_and_logprobs_equal_the_trainers(layout):
    model, tok = load_model_and_tokenizer("embedded:tiny-dense-h32", seed=0)
    model.eval()
    plan = engine_plan(
        Config(rollout_engine="vllm", model="embedded:tiny-dense-h32", dtype="float32", seed=0,
               max_prompt_tokens=16, max_new_tokens=12, env="x", max_trajectory_tokens=40)
    )  # fmt: skip
    eng = VLLMRolloutEngine.from_trainer(plan, model, tok, block_size=32)
    try:
        prompts = ["rev:123=", "rev:4567=", "rev:89="]  # a random model: some turns end at EOS
        ex = [Example(p, "") for p in prompts for _ in range(8)]
        ids = [tok(e.prompt, add_special_tokens=False).input_ids for e in ex]
        eb = run_episodes(eng, tok, EnvSpec(_Observe, "observe", None), ex, ids, Limits(3, 12, 40), 1.0)
    finally:
        eng.close()
    m, o = eb.response_mask_BT, eb.obs_mask_BT
    assert ((m + o) <= 1).all() and o.sum() > 0 and (eb.turns_B > 1).any()
    assert ((m + o).sum(-1) <= 40).all() and (eb.sampler_logp_BT[~m.bool()] == 0).all()
    p_ids, p_mask = left_pad(eb.prompt_ids, tok.pad_token_id)
    lay = make_layout(p_ids, p_mask, eb.response_ids_BT, m, layout, torch.float32, obs_mask_BT=o)
    with torch.no_grad():
        logp = response_logprobs(model, p_ids, p_mask, eb.response_ids_BT, m, layout=lay)
    assert (logp - eb.sampler_logp_BT).abs().max() < TOL


class _Latent:
    """Answers every turn after a latency drawn from its own generator, seeded by (``seed``, the
    trajectory's index, the turn); ``log`` gets (trajectory, turn) as each step finishes."""

    def __init__(self, index, seed, log):
        self.index, self.seed, self.log, self.turn = index, seed, log, 0

    def reset(self, example):
        return example.prompt

    def step(self, model_turn):
        self.turn += 1
        time.sleep(random.Random(f"{self.seed}/{self.index}/{self.turn}").random() * 0.03)
        self.log.append((self.index, self.turn))
        return Step("=12 ", 0.5)


@torch.no_grad()
def _likely_eos(model, tok, logit):
    """EOS's (tied) embedding row along the hidden states' mean direction: turns end at EOS."""
    ids = torch.randint(3, len(tok), (16, 16), generator=torch.Generator().manual_seed(1))
    h = model.model(input_ids=ids).last_hidden_state.mean((0, 1))
    model.get_output_embeddings().weight[tok.eos_token_id] = logit * h / h.norm() ** 2


class _Submissions:
    """vLLM's own LLMEngine, noting at each ``add_request`` whether other requests were running."""

    def __init__(self, engine):
        self.engine, self.while_running, self.real = engine, [], engine.add_request

    def __enter__(self):
        def add_request(*a, **k):
            self.while_running.append(self.engine.has_unfinished_requests())
            return self.real(*a, **k)

        self.engine.add_request = add_request
        return self

    def __exit__(self, *exc):
        del self.engine.add_request


@pytest.mark.parametrize("tick", [1, 4])
def test_vllm_turns_are_requests_and_tool_latencies_never_change_them(tick):
    """With the environment's steps in a pool, each turn is a request of its own to vLLM's engine,
    submitted while other trajectories' requests decode; with every tool latency re-drawn and with
    8 or 1 workers, the trajectories (ids, masks, log-probs, rewards, turns) are bit-identical though
    the steps finished in another order; the sampler's log-probs equal the trainer's."""
    model, tok = load_model_and_tokenizer("embedded:tiny-dense-h32", seed=0)
    model.eval()
    _likely_eos(model, tok, 2.5)
    plan = engine_plan(
        Config(rollout_engine="vllm", model="embedded:tiny-dense-h32", dtype="float32", seed=0,
               max_prompt_tokens=16, max_new_tokens=12, env="x", max_trajectory_tokens=40)
    )  # fmt: skip
    eng = VLLMRolloutEngine.from_trainer(plan, model, tok, block_size=32)
    ex = [Example(p, "") for p in ["rev:123=", "rev:4567=", "rev:89="] for _ in range(6)]
    ids = [tok(e.prompt, add_special_tokens=False).input_ids for e in ex]
    runs, logs = [], []
    try:
        with _Submissions(eng.llm.llm_engine) as subs:
            for workers, lat_seed in ((8, 1), (8, 2), (1, 3)):
                eng.reseed(5)
                logs.append([])
                make = functools.partial(_Latent, seed=lat_seed, log=logs[-1])
                index = itertools.count()
                spec = EnvSpec(
                    lambda m=make, i=index: m(next(i)), "latent", None, workers=workers, tick_steps=tick
                )
                runs.append(run_episodes(eng, tok, spec, ex, ids, Limits(4, 12, 40), 1.0))
    finally:
        eng.close()
    assert logs[0] != logs[1] and sorted(logs[0]) == sorted(logs[1])  # the same steps, in another order
    for f in ("response_ids_BT", "response_mask_BT", "obs_mask_BT", "sampler_logp_BT", "reward_B", "turns_B"):
        assert all(torch.equal(getattr(runs[0], f), getattr(r, f)) for r in runs[1:]), f
    eb = runs[0]
    m, o = eb.response_mask_BT, eb.obs_mask_BT
    assert (eb.turns_B >= 3).sum() >= 3 and o.sum() > 0
    assert len(subs.while_running) == 3 * (len(ex) + int(eb.turns_B.sum()) - len(ex))  # a request per turn
    assert sum(subs.while_running) >= 3 * 5  # later turns joined requests still decoding
    p_ids, p_mask = left_pad(eb.prompt_ids, tok.pad_token_id)
    lay = make_layout(p_ids, p_mask, eb.response_ids_BT, m, "rows", torch.float32, obs_mask_BT=o)
    with torch.no_grad():
        logp = response_logprobs(model, p_ids, p_mask, eb.response_ids_BT, m, layout=lay)
    assert (logp - eb.sampler_logp_BT).abs().max() < TOL


def test_gspo_train_multi_turn_with_vllm_end_to_end(tmp_path):
    from gspo import Config, train

    res = train(Config(
        model="embedded:tiny-dense-h32", rollout_engine="vllm", task="add_long", env="tools:calc",
        max_new_tokens=20, max_turns=2, max_trajectory_tokens=40, sft_steps=20, sft_batch_size=16, steps=2,
        prompts_per_step=4, group_size=4, eval_size=8, eval_every=0, threads=1, progress=False,
        output_dir=str(tmp_path), name="vllm-mt",
    ))  # fmt: skip
    rows = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and "env/turns_mean" in rows[-1]
    assert rows[-1]["mismatch/token_abs_logp_diff"] < TOL


# ------------------------------------------------------------------------------------------------
# R3 (routing replay from vLLM's routing) on multi-turn trajectories (issue 38 item 4)


class _Recorded:
    """The real engine, keeping what each ``generate`` call was given and returned."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompt_ids, *args, **kw):
        batch = self.engine.generate(prompt_ids, *args, **kw)
        self.calls.append(([list(p) for p in prompt_ids], batch))
        return batch


def _sets(x):
    return x.sort(-1).values


def test_r3_replays_the_experts_vllm_routed_for_every_turn():
    """A trajectory's R3 routing is, at every position, the experts vLLM routed it to in the first
    call that fed it: the call that sampled the turn's next token for the model's tokens, the next
    turn's prefill for an observation. In the trainer's rows-layout forward (observations in place)
    the replayed experts are exactly those, they agree with the trainer's own top-k (an off-by-one
    would not), and the replayed log-probs of the model's tokens equal vLLM's."""
    from gspo.model.routing import capture_routing, replay_routing

    model, tok = load_model_and_tokenizer("embedded:tiny-moe-h32", seed=0)
    model.eval()
    cfg = Config(
        rollout_engine="vllm", model="embedded:tiny-moe-h32", dtype="float32", seed=0, max_prompt_tokens=16,
        max_new_tokens=12, env="x", max_trajectory_tokens=40, routing_replay=True, routing_replay_source="rollout",
    )  # fmt: skip
    eng = VLLMRolloutEngine.from_trainer(engine_plan(cfg), model, tok)
    rec = _Recorded(eng)
    try:
        ex = [Example(p, "") for p in ["rev:123=", "rev:4567=", "rev:89="] for _ in range(6)]
        ids = [tok(e.prompt, add_special_tokens=False).input_ids for e in ex]
        eb = run_episodes(rec, tok, EnvSpec(_Observe, "observe", None), ex, ids, Limits(3, 12, 40), 1.0)
    finally:
        eng.close()
    m, o = eb.response_mask_BT, eb.obs_mask_BT
    assert (eb.turns_B > 1).sum() >= 3 and eb.routed_layers == ["layer0", "layer1"]
    # call c played the trajectories with at least c turns, in order; each position's first routing
    first = [{} for _ in ex]
    for c, (contexts, b) in enumerate(rec.calls, start=1):
        rows = [i for i in range(len(ex)) if int(eb.turns_B[i]) >= c]
        assert len(rows) == len(contexts)
        for j, i in enumerate(rows):
            fed = len(contexts[j]) + int(b.lengths_B[j]) - 1
            fed = min(fed, len(eb.prompt_ids[i]) + int((m[i] + o[i]).sum()) - 1)  # a turn cut by its budget
            for p in range(fed):
                first[i].setdefault(p, b.routed_experts[j][p])
    for i, r in enumerate(eb.routed_experts):
        want = torch.stack([first[i][p] for p in range(len(first[i]))])
        last_model = int(m[i].nonzero().max())  # positions up to the last model token's were fed
        assert r.shape[0] == len(eb.prompt_ids[i]) + last_model and torch.equal(r, want), i
    routing = eb.routing_rows()
    p_ids, p_mask = left_pad(eb.prompt_ids, tok.pad_token_id)
    lay = make_layout(p_ids, p_mask, eb.response_ids_BT, m, "rows", torch.float32, obs_mask_BT=o)
    with torch.no_grad(), capture_routing(model) as own:
        model(input_ids=lay.input_ids_RL, position_ids=lay.position_ids_RL)
    with torch.no_grad(), capture_routing(model) as forced, replay_routing(model, routing):
        logp = response_logprobs(model, p_ids, p_mask, eb.response_ids_BT, m, layout=lay)
    agree = total = 0
    for i, r in enumerate(eb.routed_experts):
        for j, name in enumerate(eb.routed_layers):
            assert torch.equal(_sets(forced[name][i, : r.shape[0]]), _sets(r[:, j]))  # replayed: vLLM's
            agree += int((_sets(own[name][i, : r.shape[0]]) == _sets(r[:, j])).all(-1).sum())
            total += r.shape[0]
    assert agree / total >= 0.98, agree / total
    assert float((logp - eb.sampler_logp_BT)[m.bool()].abs().max()) < TOL


ENV_FILE = Path(__file__).with_name("fixture_observe_env.py")  # a user's environment module


def test_gspo_train_r3_with_an_environment_end_to_end(tmp_path):
    """GRPO + R3 with vLLM and an environment (observations in every trajectory): trains, the
    trainer's replayed log-probs equal vLLM's on the model's tokens, and volatility is logged."""
    from gspo import train

    res = train(Config(
        model="embedded:tiny-moe-h32", rollout_engine="vllm", task="reverse", env=f"{ENV_FILE}:Observe",
        algo="grpo", routing_replay=True, routing_replay_source="rollout", old_logp="rollout",
        max_new_tokens=8, max_turns=3, max_trajectory_tokens=40, sft_steps=0, steps=2, prompts_per_step=4,
        group_size=4, eval_size=4, eval_every=0, threads=1, progress=False, output_dir=str(tmp_path), name="r3-mt",
    ))  # fmt: skip
    rows = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(rows) == 2
    for r in rows:
        assert (
            r["env/obs_len"] > 0 and r["mismatch/token_abs_logp_diff"] < TOL and 0 <= r["moe/volatility"] <= 1
        )
    assert max(r["loss/grad_norm"] for r in rows) > 0
