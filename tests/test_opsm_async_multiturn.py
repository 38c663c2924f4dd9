"""OPSM (``--opsm-threshold``) beside async rollouts and multi-turn trajectories: end-to-end runs on the
tiny model log ``mismatch/opsm_frac_seq`` in [0, 1], and on trajectories the divergence D_i is the
mean over the model's tokens only (observations excluded), checked in closed form through the
update path (``policy_update``)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from step_helpers import plan_update
from test_multiturn import TINY as MULTI_TURN
from test_multiturn_logprobs import G, trajectories  # noqa: F401  (a fixture: HF-engine trajectories)

from gspo import Config, train
from gspo.resolve import score_plan
from gspo.training import update as U
from gspo.training.scoring import score_rollout
from gspo.training.update import policy_update

# exact match plus noise: rewards differ within every group, so there are A < 0 sequences to mask
NOISY = str(Path(__file__).parent / "fixture_rewards.py") + ":noisy"
SINGLE_TURN = dict(
    model="embedded:tiny-moe", reward=NOISY, sft_steps=20, eval_size=8, prompts_per_step=4, group_size=4, max_new_tokens=8,
    eval_every=0, save_every=0, threads=1, progress=False,
)  # fmt: skip


def _rl_rows(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]


def _check_opsm_logged(rows: list[dict], steps: int) -> list[float]:
    assert len(rows) == steps
    fracs = [r["mismatch/opsm_frac_seq"] for r in rows]
    assert all(0 <= f <= 1 for f in fracs), fracs
    assert all(0 <= r["mismatch/opsm_frac_tok"] <= 1 for r in rows)
    for r in rows:
        for k, v in r.items():
            if isinstance(v, float):
                assert math.isfinite(v), (k, v)
    return fracs


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["gspo", "vespo"])
def test_opsm_with_async_rollouts(tmp_path, algo):
    """async_staleness 1: the sampler is a step behind, so pi_sampler != pi_theta and OPSM at delta 0
    (drop every A < 0 sequence the policy has moved away from) masks some; the fraction is logged."""
    cfg = Config(**SINGLE_TURN, algo=algo, steps=3, async_staleness=1, num_minibatches=2, opsm_threshold=0.0,
                 output_dir=str(tmp_path), name=algo)  # fmt: skip
    rows = _rl_rows(train(cfg).run_dir)
    fracs = _check_opsm_logged(rows, 3)
    assert all(r["async/staleness"] >= 0 for r in rows)
    assert max(fracs) > 0, fracs  # delta 0 under staleness: OPSM does drop sequences


@pytest.mark.slow
@pytest.mark.parametrize("algo, staleness", [("luspo", 0), ("vespo", 1)])
def test_opsm_with_multi_turn_trajectories(tmp_path, algo, staleness):
    """Multi-turn (tools:calc, the noisy task reward), sync and async: runs, logs the masked fraction in
    [0, 1], and masks some sequences at delta 0."""
    cfg = Config(**{**MULTI_TURN, "model": "embedded:tiny-moe", "reward": NOISY}, algo=algo,
                 async_staleness=staleness, opsm_threshold=0.0, output_dir=str(tmp_path), name=algo)  # fmt: skip
    rows = _rl_rows(train(cfg).run_dir)
    fracs = _check_opsm_logged(rows, MULTI_TURN["steps"])
    assert all(r["env/turns_mean"] >= 1 for r in rows)
    assert max(fracs) > 0, fracs


SHIFT = 0.6  # nats per model token added to the sampler's log-probs of the shifted rows
GARBAGE = 5.0  # added on observation positions: a D that reads them jumps past the threshold
DELTA = 0.5


@pytest.mark.parametrize("algo", ["gspo", "vespo"])
def test_opsm_divergence_is_over_the_models_tokens_only(tiny_moe, trajectories, monkeypatch, algo):  # noqa: F811
    """Trajectories (model turn, observation, model turn) scored and given to ``policy_update`` with
    --opsm-threshold 0.5; the sampler log-probs are the engine's plus 0.6 on the model tokens of every
    other row and plus 5 on every observation position. Closed form, D_i = (1/|model tokens of i|)
    sum over them of (sampler - pi_theta) = 0.6 or 0 (pi_theta is the sampler's policy to 2e-5), so the
    loss's weight drops exactly the shifted rows with A < 0; an average that counted observation
    positions would dilute the 0.6 (rows with many observations kept) or read the 5 (unshifted
    rows dropped)."""
    model, tok = tiny_moe
    eb = trajectories
    cfg = Config(env="tools:calc", prompts_per_step=2, group_size=G, num_minibatches=1, log_volatility=False,
                 max_trajectory_tokens=40, algo=algo, opsm_threshold=DELTA).validate()  # fmt: skip
    data, _ = score_rollout(eb, tok, None, [], score_plan(cfg), 0.0)
    model_BT, obs_BT = data.response_mask_BT.float(), data.obs_mask_BT.float()
    B = model_BT.shape[0]
    has_tok_B = model_BT.sum(-1) > 0
    has_obs_B = (obs_BT.sum(-1) > 0) & has_tok_B
    # the env's rewards give every row with observations A > 0 (more turns, more reward): set A by
    # hand, -1 but on every 4th row, and shift every other row with observations and of the rest
    data.adv_B = torch.where(torch.arange(B) % 4 == 1, 1.0, -1.0)
    alternate = lambda sel_B: sel_B & (sel_B.cumsum(0) % 2 == 1)  # noqa: E731
    shifted_B = alternate(has_obs_B) | alternate(~has_obs_B)
    bad_obs_B = (data.adv_B < 0) & has_obs_B
    data.sampler_logp_BT = data.sampler_logp_BT + SHIFT * shifted_B[:, None] * model_BT + GARBAGE * obs_BT
    want_drop_B = shifted_B & (data.adv_B < 0) & has_tok_B
    assert (want_drop_B & has_obs_B).any() and (~shifted_B & bad_obs_B).any()
    assert (shifted_B & (data.adv_B >= 0)).any()

    real, seen = U.loss_inputs, []

    def spy(logp_BT, old_BT, mask_BT, *a, **k):  # what the update hands the loss
        seen.append((logp_BT.detach().clone(), mask_BT.clone(), k.get("weight")))
        return real(logp_BT, old_BT, mask_BT, *a, **k)

    monkeypatch.setattr(U, "loss_inputs", spy)
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    plan = plan_update(cfg, m, True)
    out = policy_update(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), data, plan, 1)
    (logp_BT, mask_BT, weight_B), *_ = seen
    T = mask_BT.shape[1]
    assert torch.equal(mask_BT.bool(), model_BT[:, :T].bool())  # the rows in their order, not repacked
    d_BT = (data.sampler_logp_BT[:, :T] - logp_BT) * model_BT[:, :T]
    D_B = d_BT.sum(-1) / model_BT.sum(-1).clamp(min=1)
    assert torch.allclose(D_B, SHIFT * shifted_B * has_tok_B, atol=1e-4), D_B  # the closed form
    assert weight_B is not None and weight_B.shape == (B,)
    assert torch.equal(weight_B == 0, want_drop_B), (weight_B, want_drop_B)
    want_frac = float(want_drop_B.sum() / has_tok_B.sum())
    assert abs(out["mismatch/opsm_frac_seq"] - want_frac) < 1e-6
