"""Multi-turn trajectories through the path the update uses (issue 37): trajectories played by the HF
engine against an environment, scored, and trained on by ``policy_update``. The trainer's log-probs
of the model's tokens equal the sampler's (the model's later turns see the observations), the loss
mask is exactly the model's tokens, and a long observation is cut before it is tokenised."""

from __future__ import annotations

import copy

import pytest
import torch
from fixture_observe_env import Observer
from step_helpers import plan_update

from gspo.config import Config
from gspo.data import SampleBatch, SamplerOutput
from gspo.envs.base import Limits, Step
from gspo.envs.episodes import EnvSampleBatch, run_episodes
from gspo.envs.load import EnvSpec
from gspo.resolve import score_plan
from gspo.rollout.hf import HFRolloutEngine
from gspo.tasks.datasets import Example
from gspo.training import update as U
from gspo.training.scoring import score_rollout
from gspo.training.update import policy_update, split_minibatches

G = 8


@pytest.fixture(scope="module")
def trajectories(tiny_moe) -> EnvSampleBatch:
    """2 prompts x 8 trajectories of the tiny MoE (seed 0: five of them have model tokens after an
    observation, one has three turns)."""
    model, tok = tiny_moe
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
    ex = [Example("rev:12=", "21")] * G + [Example("rev:345=", "543")] * G
    ids = [tok(e.prompt, add_special_tokens=False).input_ids for e in ex]
    eb = run_episodes(eng, tok, EnvSpec(Observer, "observer", None), ex, ids, Limits(3, 8, 40), 1.0)
    after_obs_B = (eb.response_mask_BT * (eb.obs_mask_BT.cumsum(-1) > 0)).sum(-1)
    assert int((after_obs_B > 0).sum()) >= 3 and int(eb.turns_B.max()) == 3  # the case this file needs
    return eb


def _async_round_trip(eb: EnvSampleBatch) -> SampleBatch:
    """``eb`` as the async trainer receives it (the sampler process's wire format), then as a resumed
    run reads it back from a checkpoint's batches in flight."""
    from gspo.rollout.async_state import (
        Ahead,
        from_wire,
        in_flight_from_state,
        in_flight_to_state,
        to_wire,
    )

    idx = list(range(len(eb.prompt_ids) // G))
    got = from_wire(to_wire(Ahead(3, 1, SamplerOutput(eb, 0.0, {}), idx, len(idx))))
    return in_flight_from_state(in_flight_to_state([got]), len(idx))[0].out.batch


def _update(model, eb: EnvSampleBatch, tok, monkeypatch, rb: SampleBatch | None = None, **kw):
    """One ``policy_update`` (lr 0) on the trajectories ``eb`` (or ``rb``: the same after a trip through
    the async path) scored, recording what the loss is given: (the micro-batch's log-probs, pi_old,
    loss mask), and the update's metrics."""
    cfg = Config(env="tools:calc", prompts_per_step=2, group_size=G, num_minibatches=1, log_volatility=False,
                 max_trajectory_tokens=40, **kw).validate()  # fmt: skip
    data, _ = score_rollout(eb if rb is None else rb, tok, None, [], score_plan(cfg), 0.0)
    m = copy.deepcopy(model)
    plan = plan_update(cfg, m, True)
    # the micro-batches the update cuts the batch into: their masks are the model's tokens only
    (mb,) = split_minibatches(data, 1, len(data), plan.layout, torch.float32)[0]
    n_model = int(eb.response_mask_BT.sum())
    assert int(mb.n_tokens) == n_model, (
        f"micro-batch counts {int(mb.n_tokens)} tokens, the model made {n_model}"
    )
    on_obs = int((mb.mask_BT.bool() & eb.obs_mask_BT[:, : mb.mask_BT.shape[1]].bool()).sum())
    assert on_obs == 0, f"the micro-batch's mask covers {on_obs} observation tokens"
    real, seen = U.loss_inputs, []

    def spy(logp_BT, old_BT, mask_BT, *a, **k):  # what the update hands the loss
        seen.append((logp_BT.detach().clone(), old_BT.clone(), mask_BT.clone()))
        return real(logp_BT, old_BT, mask_BT, *a, **k)

    monkeypatch.setattr(U, "loss_inputs", spy)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    out = policy_update(m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), data, plan, 1)
    assert len(seen) == 1  # one minibatch, one micro-batch: rows in their order
    return plan, seen[0], out


@pytest.mark.parametrize(
    "kw, layout",
    [(dict(prefix_sharing="off"), "rows"), (dict(packing="on"), "packed"), ({}, "shared_prefix")],
)
def test_trainer_logprobs_of_a_trajectory_equal_the_samplers(tiny_moe, trajectories, monkeypatch, kw, layout):
    """The update's forward of a trajectory (model turn, observation, model turn, ...) gives the model's
    tokens the log-probs the HF engine sampled them with (to float tolerance), in every layout: the
    later turns are conditioned on the observations as they were when sampled."""
    model, tok = tiny_moe
    eb = trajectories
    plan, (logp, _, mask), out = _update(model, eb, tok, monkeypatch, old_logp="recompute", **kw)
    assert plan.layout == layout
    T = logp.shape[1]
    model_BT = eb.response_mask_BT[:, :T].bool()
    assert int(model_BT.sum()) == int(eb.response_mask_BT.sum())  # nothing cut off
    later_BT = model_BT & (eb.obs_mask_BT[:, :T].cumsum(-1) > 0)  # model tokens after an observation
    diff_BT = (logp - eb.sampler_logp_BT[:, :T]).abs()
    worst_later, worst = float(diff_BT[later_BT].max()), float(diff_BT[model_BT].max())
    assert worst_later < 2e-5, (
        f"model tokens after an observation: |trainer - sampler| up to {worst_later:.3g}"
    )
    assert worst < 2e-5, f"|trainer - sampler| up to {worst:.3g}"
    assert (logp[~model_BT] == 0).all()  # observations and padding carry no log-prob
    assert out["mismatch/token_abs_logp_diff"] < 2e-6  # the update's own train/rollout mismatch


@pytest.mark.parametrize("path", ["sync", "async"])
def test_loss_mask_of_a_trajectory_is_exactly_the_models_tokens(tiny_moe, trajectories, monkeypatch, path):
    """The mask the loss gets (and its normalizer's token count) is the model-token mask of the
    trajectories, observations excluded, whether the batch was played in this process or came from
    the async sampler (its wire format, and a checkpoint's batches in flight)."""
    model, tok = tiny_moe
    eb = trajectories
    rb = eb if path == "sync" else _async_round_trip(eb)
    assert isinstance(rb, EnvSampleBatch)
    _, (logp, old, mask), out = _update(model, eb, tok, monkeypatch, rb=rb)
    T = mask.shape[1]
    want = eb.response_mask_BT[:, :T]
    assert int(want.sum()) == int(eb.response_mask_BT.sum()) and int(eb.obs_mask_BT.sum()) > 0
    wrong = int((mask.long() != want.long()).sum())
    on_obs = int((mask.bool() & eb.obs_mask_BT[:, :T].bool()).sum())
    assert wrong == 0, (
        f"the loss mask differs from the model-token mask at {wrong} positions ({on_obs} observed)"
    )
    # pi_old (the sampler's, by default here) and the log-probs are 0 wherever the mask is
    assert (old[~want.bool()] == 0).all() and (logp[~want.bool()] == 0).all()


# ------------------------------------------------------------------------------------------------
# a long observation is cut before it is tokenised

OBS_HEAD = "out 123456789 "
OBS_SIZE = 2_000_000  # characters: far past the cut (64 characters per token of room, + 64)


class _Flood:
    """Answers the first turn with a 2 MB observation."""

    def reset(self, example: Example) -> str:
        return example.prompt

    def step(self, model_turn: str) -> Step:
        return Step(OBS_HEAD + "9" * (OBS_SIZE - len(OBS_HEAD)), 0.0)


class _OneTurnEngine:
    """Every row's turn: tokens 5, 6 then EOS (sampler log-prob -0.5 each)."""

    def __init__(self, eos: int) -> None:
        self.turn = [5, 6, eos]

    def generate(self, prompt_ids, max_new_tokens, temperature=1.0, greedy=False):
        B, T = len(prompt_ids), len(self.turn)
        ids = torch.tensor([self.turn] * B)
        return SampleBatch(prompt_ids, ids, torch.ones(B, T, dtype=torch.long), torch.full((B, T), -0.5))


class _Recording:
    """The tokenizer, recording the length of every text it is asked to tokenise."""

    def __init__(self, tok) -> None:
        self.tok, self.lengths = tok, []

    def __call__(self, text, **kw):
        self.lengths.append(len(text))
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_long_observation_is_cut_before_tokenising_and_kept_to_the_budget(tiny_moe):
    """The environment's 2 MB observation is tokenised (the turn before it ended with EOS): only its
    head (64 characters per token of room left, + 64) reaches the tokenizer, and the trajectory holds
    its first ``room`` tokens as observation tokens, then ends (no room left for a model token)."""
    _, tok = tiny_moe
    rec = _Recording(tok)
    max_tokens = 12
    eb = run_episodes(_OneTurnEngine(tok.eos_token_id), rec, EnvSpec(_Flood, "flood", None),
                      [Example("rev:1=", "1")], [[5, 6]], Limits(3, 8, max_tokens), 1.0)  # fmt: skip
    room = max_tokens - 3  # after the 3-token turn
    head = tok(OBS_HEAD + "9" * 64, add_special_tokens=False).input_ids[:room]
    assert len(head) == room
    assert rec.lengths and max(rec.lengths) <= 64 * room + 64, f"tokenised {max(rec.lengths)} characters"
    assert eb.response_ids_BT[0].tolist() == [5, 6, tok.eos_token_id] + head
    assert eb.response_mask_BT[0].tolist() == [1] * 3 + [0] * room
    assert eb.obs_mask_BT[0].tolist() == [0] * 3 + [1] * room
    assert eb.turns_B.tolist() == [1.0] and eb.truncated_B.tolist() == [1.0]
