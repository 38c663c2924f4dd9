"""Multi-turn rollouts with tools (gspo.envs): the interface, tools, masks, losses over the model's
tokens only, budgets, bad environments, and a task the tiny model learns with the calculator."""

import copy
import itertools
import json
import random
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from cli_helpers import kill_9_after_checkpoint, one_line

from gspo.config import Config
from gspo.data import SampleBatch
from gspo.envs import tools as T
from gspo.envs.base import Limits, Step
from gspo.envs.episodes import run_episodes
from gspo.envs.load import EnvSpec, env_spec
from gspo.envs.tools import ToolEnv, calculator, parse_tool_call
from gspo.errors import GspoError
from gspo.loss_prologue import loss_inputs
from gspo.losses import LOSSES, gspo_loss
from gspo.tasks.datasets import Example

TINY = dict(
    model="embedded:tiny-dense", task="add_long", env="tools:calc", max_new_tokens=20, max_turns=2,
    max_trajectory_tokens=40, sft_steps=20, sft_batch_size=16, steps=2, prompts_per_step=4, group_size=4,
    eval_size=8, eval_every=0, threads=1, progress=False,
)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# tools


def run_tool_call(call: T.ToolCall | str, tools: tuple[str, ...]) -> str:
    """The observation text a tool environment answers a parsed call with."""
    return T._wrap(call, T.tool_output(call, tools))


def test_calculator_values_and_refusals():
    assert calculator("12+34") == "46"
    assert calculator(" (2+3)*4 - 10/4 ") == "17.5"
    assert calculator("2**10 // 3 % 7") == str(2**10 // 3 % 7)
    assert calculator("-7/2") == "-3.5" and calculator("1/3") == format(1 / 3, ".12g")
    assert calculator("123456789012+987654321098") == str(123456789012 + 987654321098)
    for bad in [
        "__import__('os').system('true')", "x+1", "[1]*3", "'a'*3", "2**10**10", "9**999", "10**100",
        "1/0", "1%0", "", "1+", "f(1)", "(lambda: 1)()", "1 if 1 else 2", "1e308*10",
        "1" * 300,
    ]:  # fmt: skip
        with pytest.raises(ValueError):
            calculator(bad)


def test_tool_call_formats_and_malformed_calls_never_raise():
    assert run_tool_call(parse_tool_call("let me: <calc>12+34</calc> ok"), ("calc",)) == "<output>46</output>"
    assert run_tool_call(parse_tool_call("calc(2*(3+4))"), ("calc",)) == "=14"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    assert run_tool_call(parse_tool_call(call), ("calc",)) == "<output>42</output>"
    assert parse_tool_call("the answer is 42") is None
    env = ToolEnv(lambda p, c, a: [float(c[0] == a[0])], ("calc",))
    env.reset(Example("add:1+2=", "3"))
    for turn in [
        "<calc>1+2", "<calc>os.system('x')</calc>", "<tool_call>{bad json</tool_call>",
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', '<tool_call>{"name": "calc"}</tool_call>',
        "calc(1+(2", "<python>print(1)</python>", "calc(1/0)", "<tool_call>[1]</tool_call>",
    ]:  # fmt: skip
        s = env.step(turn)
        assert s.observation is not None and "error:" in s.observation and s.reward == 0.0, turn
    assert env.step("3") == Step(None, 1.0) and env.step("4") == Step(None, 0.0)


def test_python_tool_runs_in_the_code_sandbox():
    from gspo.envs.tools import python_tool
    from gspo.tasks.sandbox import fs_available

    if not fs_available():
        pytest.skip("no Landlock: the sandbox refuses to run")
    assert run_tool_call(parse_tool_call("<python>print(6*7)</python>"), ("python",)) == "<output>42</output>"
    out = run_tool_call(parse_tool_call("<python>open('/etc/passwd').read()</python>"), ("python",))
    assert out.startswith("<output>error:")
    with pytest.raises(ValueError, match="timed out"):
        python_tool("while True: pass", timeout_s=1.0)


# ------------------------------------------------------------------------------------------------
# losses over the model's tokens only


def _trajectory_case(seed=0):
    """Two groups of two trajectories: model tokens and observation tokens interleaved (obs mask), and
    the same model tokens packed together (the observations removed)."""
    g = torch.Generator().manual_seed(seed)
    model_BT = torch.tensor(
        [
            [1, 1, 0, 0, 1, 1, 1, 0],
            [1, 0, 0, 0, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 1, 1],
        ]
    )
    obs_BT = torch.tensor(
        [
            [0, 0, 1, 1, 0, 0, 0, 0],
            [0, 1, 1, 1, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0],
            [0, 0, 1, 0, 1, 1, 0, 0],
        ]
    )
    old = -torch.rand(4, 8, generator=g) * 2
    logp = old + 0.3 * torch.randn(4, 8, generator=g)
    # observation positions hold garbage: no loss may read them
    old = torch.where(obs_BT.bool(), torch.tensor(123.0), old)
    logp = torch.where(obs_BT.bool(), torch.tensor(-77.0), logp)
    adv_B = torch.tensor([1.0, -1.0, 0.5, -0.5])
    T2 = int(model_BT.sum(-1).max())
    packed_logp, packed_old, packed_mask = torch.zeros(4, T2), torch.zeros(4, T2), torch.zeros(4, T2)
    for b in range(4):
        idx = model_BT[b].bool().nonzero().squeeze(-1)
        n = len(idx)
        packed_logp[b, :n], packed_old[b, :n], packed_mask[b, :n] = logp[b, idx], old[b, idx], 1
    return logp, old, adv_B, model_BT, obs_BT, packed_logp, packed_old, packed_mask


@pytest.mark.parametrize("algo", list(LOSSES))
def test_every_loss_sees_the_model_tokens_only(algo):
    """A trajectory's loss and gradient equal those of its model tokens with the observations
    removed; no gradient reaches an observation position."""
    logp, old, adv, model_BT, obs_BT, p_logp, p_old, p_mask = _trajectory_case()
    x = logp.clone().requires_grad_(True)
    loss = LOSSES[algo](loss_inputs(x, old, model_BT, adv)).loss  # its default parameters
    loss.backward()
    y = p_logp.clone().requires_grad_(True)
    loss_p = LOSSES[algo](loss_inputs(y, p_old, p_mask, adv)).loss
    loss_p.backward()
    torch.testing.assert_close(loss, loss_p, atol=1e-7, rtol=1e-6)
    assert (x.grad[obs_BT.bool()] == 0).all() and (x.grad[(model_BT + obs_BT) == 0] == 0).all()
    for b in range(4):
        idx = model_BT[b].bool().nonzero().squeeze(-1)
        torch.testing.assert_close(x.grad[b, idx], y.grad[b, : len(idx)], atol=1e-8, rtol=1e-6)


def test_gspo_trajectory_closed_form():
    """s_i = exp(mean over the model's tokens of logp - old_logp), |y_i| = the model's token count;
    the gradient at a model token is -(1/B) A_i s_i / |y_i| (unclipped), 0 when clipped or observed."""
    logp, old, adv, model_BT, obs_BT, *_ = _trajectory_case(1)
    n_B = model_BT.sum(-1).float()
    s_B = torch.exp(torch.where(model_BT.bool(), logp - old, 0.0).sum(-1) / n_B)
    eps_l, eps_h = 0.5, 0.5  # wide: nothing clipped here
    x = logp.clone().requires_grad_(True)
    loss = gspo_loss(loss_inputs(x, old, model_BT, adv), eps_low=eps_l, eps_high=eps_h).loss
    loss.backward()
    torch.testing.assert_close(loss, -(s_B * adv).mean())
    want = torch.where(model_BT.bool(), (-adv * s_B / n_B / 4)[:, None], 0.0)
    torch.testing.assert_close(x.grad, want)
    assert (x.grad[obs_BT.bool()] == 0).all()


@pytest.mark.parametrize("layout", ["rows", "packed", "shared_prefix"])
def test_training_forward_on_interleaved_trajectories(tiny_moe, layout):
    """Model-token log-probs of a trajectory equal a plain forward over its whole sequence (the model
    sees the observations), in every layout; observation positions get 0 and no gradient."""
    from gspo.model.logprobs import make_layout, response_logprobs

    model, _ = tiny_moe
    model.eval()
    p_ids = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 7], [8, 9, 10, 11]])
    p_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    r_ids = torch.tensor([[12, 13, 14, 15, 16, 0], [17, 18, 19, 20, 0, 0], [21, 22, 23, 24, 25, 26]])
    model_BT = torch.tensor([[1, 0, 0, 1, 1, 0], [1, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 1]])
    obs_BT = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 1, 0, 0, 0], [0, 1, 0, 1, 0, 0]])
    lay = make_layout(p_ids, p_mask, r_ids, model_BT, layout, torch.float32, obs_mask_BT=obs_BT)
    logp = response_logprobs(model, p_ids, p_mask, r_ids, model_BT, layout=lay)
    for b in range(3):
        real = torch.cat([p_ids[b][p_mask[b].bool()], r_ids[b][(model_BT[b] + obs_BT[b]).bool()]])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=real[None]).logits[0].float(), -1)
        P = int(p_mask[b].sum())
        k = 0
        for t in range(6):
            if model_BT[b, t] or obs_BT[b, t]:
                if model_BT[b, t]:
                    torch.testing.assert_close(logp[b, t], lp[P + k - 1, r_ids[b, t]], atol=2e-5, rtol=1e-5)
                k += 1
    assert (logp[~model_BT.bool()] == 0).all()
    # gradient: only model tokens' log-probs carry it
    model.zero_grad()
    logp2 = response_logprobs(model, p_ids, p_mask, r_ids, model_BT, layout=lay)
    loss = LOSSES["gspo"](loss_inputs(logp2, logp2.detach(), model_BT, torch.tensor([1.0, -1.0, 0.5]))).loss
    g = torch.autograd.grad(loss, logp2)[0]
    assert (g[~model_BT.bool()] == 0).all() and (g[model_BT.bool()] != 0).all()
    model.zero_grad()


# ------------------------------------------------------------------------------------------------
# rollout mechanics: masks, budgets, the one-step case


class _ScriptEngine:
    """Returns ``turn`` tokens (then EOS) for every row; sampler log-prob -0.5 on each."""

    def __init__(self, turn, eos=1, pad=0):
        self.turn, self.eos, self.pad, self.calls = turn, eos, pad, []

    def generate(self, prompt_ids, max_new_tokens, temperature=1.0, greedy=False):
        self.calls.append((len(prompt_ids), max_new_tokens, [len(p) for p in prompt_ids]))
        seq = (self.turn + [self.eos])[:max_new_tokens]
        B, T = len(prompt_ids), len(seq)
        ids = torch.tensor([seq] * B)
        return SampleBatch(prompt_ids, ids, torch.ones(B, T, dtype=torch.long), torch.full((B, T), -0.5))


class _CharTok:
    eos_token_id, pad_token_id = 1, 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids if i > 1)

    def __call__(self, text, add_special_tokens=False):
        class R:
            input_ids = [ord(c) - 96 for c in text]

        return R()


class _EchoEnv:
    """Observes 'xyz' after every turn, forever (a never-ending environment)."""

    def reset(self, example):
        return example.prompt

    def step(self, model_turn):
        return Step("xyz", 0.25)


@pytest.mark.parametrize("max_tokens", list(range(1, 22)))
@pytest.mark.parametrize("turn_tokens", [1, 2, 4])
def test_budgets_truncate_and_keep_masks_right(max_tokens, turn_tokens):
    spec = EnvSpec(_EchoEnv, "echo", None)
    eng = _ScriptEngine([2, 3, 4])  # "bcd" + EOS: 4 tokens per whole turn
    lim = Limits(max_turns=3, max_turn_tokens=turn_tokens, max_tokens=max_tokens)
    eb = run_episodes(eng, _CharTok(), spec, [Example("p", "")] * 2, [[5, 6]] * 2, lim, 1.0)
    m, o = eb.response_mask_BT, eb.obs_mask_BT
    assert ((m + o) <= 1).all() and (eb.truncated_B == 1).all()  # it never ends on its own
    n = int((m + o)[0].sum())
    assert n <= max_tokens and ((m + o)[:, :n] == 1).all() and ((m + o)[:, n:] == 0).all()
    assert (eb.sampler_logp_BT[m.bool()] == -0.5).all() and (eb.sampler_logp_BT[~m.bool()] == 0).all()
    # the sequence is turn, observation, turn, ... each cut to its budget, in order
    want_ids, want_m, turns = [], [], 0
    while len(want_ids) < max_tokens and turns < 3:
        turn = ([2, 3, 4, 1])[: min(turn_tokens, max_tokens - len(want_ids))]
        want_ids += turn
        want_m += [1] * len(turn)
        turns += 1
        if turn[-1] != 1 or turns == 3:
            break
        obs = [24, 25, 26][: max_tokens - len(want_ids)]
        want_ids += obs
        want_m += [0] * len(obs)
    assert eb.response_ids_BT[0, :n].tolist() == want_ids and m[0, :n].tolist() == want_m
    assert eb.turns_B[0] == turns and eb.reward_B[0] == pytest.approx(0.25 * turns)
    # every generate call got the whole context so far and at most the remaining budget
    for _, budget, lens in eng.calls:
        assert budget <= turn_tokens and all(L - 2 + budget <= max_tokens for L in lens)


class _PerTurn:
    """The HF engine without ``play``: one ``generate`` call per turn, each prefilling its context."""

    def __init__(self, engine):
        self.generate = engine.generate


class _Answers:
    def reset(self, example):
        return example.prompt

    def step(self, model_turn):
        return Step(" ok=", 0.5)


def _eos_likely(tiny_moe, bias: float):
    """A copy of the tiny MoE whose LM head favours EOS by ``bias`` (turns that end at EOS)."""
    model, tok = tiny_moe
    model = copy.deepcopy(model)
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.zeros(head.weight.shape[0]), requires_grad=False)
    head.bias.data[tok.eos_token_id] = bias
    return model


@pytest.mark.parametrize("turn_tokens, max_tokens", [(6, 40), (3, 17), (8, 9), (1, 5)])
@pytest.mark.parametrize("workers, tick", [(0, 1), (4, 1), (4, 3)])
def test_kept_kv_cache_plays_the_turns_of_one_generate_per_turn(
    tiny_moe, turn_tokens, max_tokens, workers, tick
):
    """The HF engine's ``play`` (one decode loop, each trajectory's KV cache kept across turns)
    makes exactly the greedy trajectories of one ``generate`` call per turn: ids, masks, turns,
    rewards, truncation; log-probs to float32 noise. Both ways: the steps in the loop, each
    observation fed one token per step beside the other rows' tokens; and the steps in a pool
    (``workers``), each trajectory going on at the next tick (every ``tick`` steps: waiting rows hold
    masked columns) with its observation fed in one forward (the step's other rows left-padded)."""
    from gspo.rollout.hf import HFRolloutEngine

    _, tok = tiny_moe
    model = _eos_likely(tiny_moe, 1.2)  # EOS the greedy choice at some positions, not all
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
    ex = [Example(f"rev:{n}=", "") for n in [12, 345, 6789, 1, 12, 90, 4321]]
    ids = [tok(e.prompt).input_ids for e in ex]
    lim = Limits(max_turns=3, max_turn_tokens=turn_tokens, max_tokens=max_tokens)
    spec = EnvSpec(_Answers, "answers", None, workers=workers, tick_steps=tick)
    prefills, real = [], eng._prefill
    eng._prefill = lambda *a: prefills.append(1) or real(*a)  # the engine's own, counted
    a = run_episodes(eng, tok, spec, ex, ids, lim, 1.0, greedy=True)
    assert len(prefills) == 1  # one play call: each trajectory's cache kept across its turns
    b = run_episodes(_PerTurn(eng), tok, spec, ex, ids, lim, 1.0, greedy=True)
    for f in ("response_ids_BT", "response_mask_BT", "obs_mask_BT", "turns_B", "reward_B", "truncated_B"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    torch.testing.assert_close(a.sampler_logp_BT, b.sampler_logp_BT, atol=1e-5, rtol=0)
    if max_tokens >= 17:  # observations fed mid-loop, and trajectories of different lengths
        assert (a.turns_B > 1).any() and a.obs_mask_BT.sum() > 0 and len(set(a.turns_B.tolist())) > 1


INSTANT_ENV = """
import threading

from gspo.envs.base import Step

THREADS = []


class Env:
    instant = {flag}

    def reset(self, example):
        return example.prompt

    def step(self, model_turn):
        THREADS.append(threading.current_thread().name)
        return Step(" ok=", 0.5)
"""


@pytest.mark.parametrize("flag, in_loop", [("True", True), ("False", False), ("1", False)])
def test_an_environment_declared_instant_steps_in_the_loop(tiny_moe, tmp_path, flag, in_loop):
    """An environment whose class says ``instant = True`` runs its steps inside the HF engine's decode
    loop, on the caller's thread (a pool's ticks would only leave its finished turns idle: ~10-15%
    slower with an instant tool, benchmarks/RESULTS.md); undeclared, or a value that is not ``True``:
    in the pool. (vLLM keeps the pool either way: tests/test_vllm_multiturn.py.)"""
    import importlib
    import sys

    from gspo.envs.episodes import spec_of
    from gspo.resolve import env_plan
    from gspo.rollout.hf import HFRolloutEngine

    (tmp_path / f"instant_{flag}.py").write_text(INSTANT_ENV.format(flag=flag))
    sys.path.insert(0, str(tmp_path))
    try:
        mod = importlib.import_module(f"instant_{flag}")
        task = type("Task", (), {"reward": None, "reward_name": "exact_match"})()
        spec = spec_of(env_plan(Config(env=f"instant_{flag}:Env", max_turns=3)), task)
        assert spec.instant is in_loop and spec.workers == Config().tool_concurrency
        _, tok = tiny_moe
        eng = HFRolloutEngine(
            _eos_likely(tiny_moe, 1.2), tok.eos_token_id, tok.pad_token_id, torch.Generator()
        )
        ex = [Example(f"rev:{n}=", "") for n in [12, 345, 6789]]
        run_episodes(eng, tok, spec, ex, [tok(e.prompt).input_ids for e in ex], Limits(3, 6, 40), 1.0, True)
        assert mod.THREADS and all((t == threading.current_thread().name) is in_loop for t in mod.THREADS)
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.parametrize(
    "env, reward, in_loop",
    [("tools:calc", "exact_match", True), ("tools:calc", "format:^a", True), ("tools:calc", "x.py:f", False),
     ("task", "x.py:f", True)],
)  # fmt: skip
def test_the_calculator_with_a_built_in_reward_is_instant(env, reward, in_loop):
    """gspo's calculator answers in microseconds, as the built-in rewards score the answer: instant
    (its steps in the HF engine's loop); a user's reward (it may call out, or run code) keeps them in
    the pool. (``task`` is one step: always in the loop.)"""
    from gspo.envs.episodes import spec_of
    from gspo.resolve import env_plan

    task = type("Task", (), {"reward": None, "reward_name": reward})()
    spec = spec_of(env_plan(Config(env=env)), task)
    assert (spec.workers == 0) is (env == "task") and spec.instant is (env != "task" and in_loop)


class _Latent:
    """Answers every turn (an empty observation every third), after a latency drawn from its own
    generator, seeded by (``seed``, the trajectory's index, the turn): the order in which steps
    finish follows the seed. ``log`` gets (trajectory, turn) as each step finishes."""

    def __init__(self, index: int, seed: int, log: list, scale: float = 0.02) -> None:
        self.index, self.seed, self.log, self.scale, self.turn = index, seed, log, scale, 0

    def reset(self, example):
        return example.prompt

    def step(self, model_turn):
        self.turn += 1
        time.sleep(random.Random(f"{self.seed}/{self.index}/{self.turn}").random() * self.scale)
        self.log.append((self.index, self.turn))
        return Step("" if self.turn % 3 == 0 else " ok=", 0.25 * self.turn)


def _latent(seed: int, log: list, workers: int, tick: int, scale: float = 0.02) -> EnvSpec:
    index = itertools.count()  # environments are made in trajectory order, before the first turn
    return EnvSpec(
        lambda: _Latent(next(index), seed, log, scale), "latent", None, workers=workers, tick_steps=tick
    )


TRAJ_FIELDS = ("response_ids_BT", "response_mask_BT", "obs_mask_BT", "sampler_logp_BT", "reward_B", "turns_B",
               "truncated_B")  # fmt: skip


@pytest.mark.parametrize("tick", [1, 4])
def test_tool_latencies_never_change_the_trajectories(tiny_moe, tick):
    """Environment steps in a pool beside the decoding: with every tool latency re-drawn (a seed of
    its own) and with 8 or 1 workers, the sampled trajectories (ids, masks, log-probs, rewards,
    turns) are bit-identical, though the steps finished in another order."""
    from gspo.rollout.hf import HFRolloutEngine

    _, tok = tiny_moe
    eng = HFRolloutEngine(_eos_likely(tiny_moe, 2.5), tok.eos_token_id, tok.pad_token_id, torch.Generator())
    ex = [Example(f"rev:{n}=", "") for n in [12, 345, 6789, 1]] * 4
    ids = [tok(e.prompt).input_ids for e in ex]
    runs, logs = [], []
    for workers, lat_seed in ((8, 1), (8, 2), (1, 3)):
        eng.reseed(7)
        logs.append([])
        runs.append(
            run_episodes(eng, tok, _latent(lat_seed, logs[-1], workers, tick), ex, ids, Limits(4, 6, 40), 1.0)
        )
    assert logs[0] != logs[1] and sorted(logs[0]) == sorted(logs[1])  # the same steps, in another order
    for f in TRAJ_FIELDS:
        for other in runs[1:]:
            assert torch.equal(getattr(runs[0], f), getattr(other, f)), f
    eb = runs[0]
    assert (eb.turns_B >= 3).sum() >= 2 and eb.obs_mask_BT.sum() > 0  # an empty observation went by, too


@pytest.mark.parametrize("tick", [1, 4])
def test_pooled_trajectories_logprobs_equal_the_trainers(tiny_moe, tick):
    """Sampled trajectories of the pooled path (observations fed in one forward, waiting rows holding
    masked columns): the trainer's log-probs of the model's tokens, in a forward over each whole
    trajectory, equal the sampler's."""
    from gspo.data import left_pad
    from gspo.model.logprobs import make_layout, response_logprobs
    from gspo.rollout.hf import HFRolloutEngine

    _, tok = tiny_moe
    model = _eos_likely(tiny_moe, 2.5)
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(3))
    ex = [Example(f"rev:{n}=", "") for n in [12, 345, 6789, 1]] * 4
    ids = [tok(e.prompt).input_ids for e in ex]
    eb = run_episodes(eng, tok, _latent(0, [], 4, tick, 0.005), ex, ids, Limits(4, 6, 40), 1.0)
    m, o = eb.response_mask_BT, eb.obs_mask_BT
    assert (eb.turns_B >= 3).any() and o.sum() > 0
    p_ids, p_mask = left_pad(eb.prompt_ids, tok.pad_token_id)
    lay = make_layout(p_ids, p_mask, eb.response_ids_BT, m, "rows", torch.float32, obs_mask_BT=o)
    with torch.no_grad():
        logp = response_logprobs(model.eval(), p_ids, p_mask, eb.response_ids_BT, m, layout=lay)
    torch.testing.assert_close(logp[m.bool()], eb.sampler_logp_BT[m.bool()], atol=1e-5, rtol=0)


def test_tools_run_beside_the_decoding(tiny_moe):
    """A step that has started waits (up to 20 s) for the engine's next two forwards: they come, so
    the other trajectories decode while it runs; and steps run side by side."""
    from gspo.rollout.hf import HFRolloutEngine

    _, tok = tiny_moe
    eng = HFRolloutEngine(_eos_likely(tiny_moe, 2.5), tok.eos_token_id, tok.pad_token_id, torch.Generator())
    forwards, running, seen = [0], [0], {"during": 0, "side_by_side": 0}  # "first": a step has started
    lock, real = threading.Lock(), eng._last_logits

    def counted(*a, **k):  # the engine's own forward, counted
        forwards[0] += 1
        return real(*a, **k)

    eng._last_logits = counted

    class Watch(_EchoEnv):
        def step(self, model_turn):
            with lock:
                running[0] += 1
                seen["side_by_side"] = max(seen["side_by_side"], running[0])
                first, seen["first"] = "first" not in seen, True
            start, t0 = forwards[0], time.monotonic()
            while first and forwards[0] < start + 2 and time.monotonic() - t0 < 20:  # the first step waits
                time.sleep(0.001)
            if first:
                seen["during"] = forwards[0] - start
            time.sleep(0.05)
            with lock:
                running[0] -= 1
            return super().step(model_turn)

    ex = [Example(f"rev:{n}=", "") for n in [12, 345, 6789, 1]] * 4
    ids = [tok(e.prompt).input_ids for e in ex]
    eng.reseed(0)
    run_episodes(
        eng, tok, EnvSpec(Watch, "watch", None, workers=8, tick_steps=8), ex, ids, Limits(3, 12, 40), 1.0
    )
    assert seen["during"] >= 2 and seen["side_by_side"] >= 2, seen  # the steps' pool: 8 threads


def test_ticks_are_a_function_of_the_turns_end():
    from gspo.rollout.turns import Ticks

    class Ready:
        def __init__(self, v):
            self.v = v

        def result(self):
            return self.v

    t = Ticks(4)
    for row, step in ((2, 0), (0, 3), (1, 4), (3, 5)):
        t.park(row, step, Ready(([row], 9)))
    assert t.next_due() == 4 and t.due(3) == []
    assert t.due(4) == [
        (0, ([0], 9)),
        (2, ([2], 9)),
    ]  # ended in steps 0-3, due at the tick of step 4, in row order
    assert t.next_due() == 8 and t.due(100) == [(1, ([1], 9)), (3, ([3], 9))] and not t.parked
    with pytest.raises(ValueError):
        Ticks(0)


def test_single_turn_task_is_the_one_step_case(tiny_moe):
    """env='task' (the task as a one-step environment) on the engine-wide generator path
    (``tool_concurrency=0``) makes exactly the rollout data of the plain single-turn path from the
    same generator state (env='task' always plays in the decode loop; on the pooled path a finished row
    waits for its tick, so its draws follow another schedule)."""
    from step_helpers import collect_rollout

    from gspo.resolve import prompt_plan, sample_plan, score_plan
    from gspo.rollout.hf import HFRolloutEngine
    from gspo.rollout.sampler import SyncSampler
    from gspo.tasks import build_task
    from gspo.tasks.prompts import encode_prompts

    model, tok = tiny_moe
    task = build_task("reverse", "exact_match", 0, 8)
    ex = task.train[:6]
    out = []
    for env in (None, "task"):
        cfg = Config(
            env=env, max_new_tokens=8, max_trajectory_tokens=8, group_size=4, overlong_filter=True,
            tool_concurrency=0,
        )  # fmt: skip
        eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(3))
        sampler = SyncSampler(eng, tok, task, sample_plan(cfg))
        ids = encode_prompts(tok, ex, prompt_plan(cfg.validate()))
        out.append(collect_rollout(sampler, tok, task, ex, ids, score_plan(cfg)))
    (a, ma), (b, mb) = out
    for f in ("prompt_ids_BP", "response_ids_BT", "response_mask_BT", "sampler_logp_BT", "adv_B", "reward_B"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert a.obs_mask_BT is None and b.obs_mask_BT.sum() == 0
    for k in ("rollout/reward_mean", "rollout/truncated_frac", "rollout/response_len"):
        assert ma[k] == mb[k], k


# ------------------------------------------------------------------------------------------------
# bad environments


def _write_env(tmp_path, body):
    f = tmp_path / "myenv.py"
    f.write_text(textwrap.dedent(body))
    return f"{f}:Env"


BAD_ENVS = {
    "raises": (
        "def step(self, turn):\n        raise RuntimeError('boom')",
        "step() raised RuntimeError: boom",
    ),
    "wrong_type": ("def step(self, turn):\n        return 'done'", "step() returned str"),
    "nan_reward": ("def step(self, turn):\n        return None, float('nan')", "finite number"),
    "hangs": ("def step(self, turn):\n        import time; time.sleep(60)", "did not return within 0.5 s"),
    "system_exit": ("def step(self, turn):\n        raise SystemExit(3)", "step() raised SystemExit: 3"),
}


@pytest.mark.parametrize("workers", [0, 4])
@pytest.mark.parametrize("kind", list(BAD_ENVS))
def test_bad_environment_is_one_line_naming_it(tmp_path, tiny_moe, kind, workers):
    """The same one line whether the step runs in the decode loop or in the pool (raised in the
    loop when its trajectory is due; a hang still stops at reward_timeout_s)."""
    from gspo.rollout.hf import HFRolloutEngine

    body, msg = BAD_ENVS[kind]
    spec_s = _write_env(
        tmp_path, f"class Env:\n    def reset(self, ex):\n        return ex.prompt\n    {body}\n"
    )
    model, tok = tiny_moe
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
    ex = [Example("rev:12=", "21")] * 2
    ids = [tok("rev:12=", add_special_tokens=False).input_ids] * 2
    spec = env_spec(spec_s, lambda *a: [0.0], 0.5, "error")
    spec.workers, spec.tick_steps = workers, 2
    with pytest.raises(GspoError, match=re.escape(msg)) as e:
        run_episodes(eng, tok, spec, ex, ids, Limits(2, 4, 16), 1.0)
    assert "\n" not in str(e.value) and spec_s in str(e.value)
    if kind != "hangs":  # reward_on_error zero: the trajectory scores 0; a batch where all fail stops
        spec0 = env_spec(spec_s, lambda *a: [0.0], 0.5, "zero")
        spec0.workers, spec0.tick_steps = workers, 2
        with pytest.raises(GspoError, match="failed on all 2 trajectories"):
            run_episodes(eng, tok, spec0, ex, ids, Limits(2, 4, 16), 1.0)


def test_cli_bad_environment_exits_2(tmp_path, capsys):
    """``gspo train --env`` with a broken environment (in-process: the command's code path without an
    interpreter start): exit 2, one line naming the file and what reset() returned."""
    spec = _write_env(
        tmp_path,
        "class Env:\n    def reset(self, ex):\n        return 42\n    def step(self, t):\n        pass\n",
    )
    args = ["--env", spec, "--sft-steps", "0", "--steps", "1", "--model", "embedded:tiny-dense"]
    args += ["--output-dir", str(tmp_path), "--eval-size", "4", "--threads", "1", "--no-progress"]
    line = one_line(capsys, ["train", *args], "reset() returned int")
    assert line.startswith("gspo: error") and spec in line


def test_unknown_env_and_config_checks():
    with pytest.raises(GspoError, match="env"):
        env_spec("nonsense", lambda *a: [0.0], None, "error")
    with pytest.raises(GspoError, match="unknown tool"):
        env_spec("tools:abacus", lambda *a: [0.0], None, "error")
    with pytest.raises(GspoError, match="max_turns"):
        Config(env="tools", max_turns=0).validate()
    with pytest.raises(GspoError, match="tool_concurrency"):
        Config(env="tools", tool_concurrency=-1).validate()
    with pytest.raises(GspoError, match="tool_tick_steps"):
        Config(env="tools", tool_tick_steps=0).validate()


# ------------------------------------------------------------------------------------------------
# end to end: the calculator task


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_with_tools_dynamic_sampling_overlong_and_exact_resume(tmp_path):
    """A multi-turn run with dynamic sampling and the overlong filter resumes bit-identically from a
    checkpoint between its multi-turn batches; its trajectories do call the tool."""
    from gspo import train

    # 80 warm-start steps: the model calls the tool (multi-turn fraction 0.81 measured; after TINY's
    # 20 it never did, and this test resumed single-turn batches)
    cfg = dict(TINY, steps=3, sft_steps=80, dynamic_sampling=True, dynamic_sampling_max_rounds=1,
               overlong_filter=True, overlong_buffer=4, output_dir=str(tmp_path))  # fmt: skip
    full = train(Config(name="full", **cfg))
    rows = _rows(full.run_dir)
    # the tool was called: some trajectory has a second turn and an observation (a key's presence
    # would hold without a single call)
    assert max(r["env/multi_turn_frac"] for r in rows[1:]) > 0 and max(r["env/obs_len"] for r in rows[1:]) > 0
    part = train(Config(name="part", **{**cfg, "steps": 2}))
    assert part.final_dir is not None
    resumed = train(Config(name="part", resume=True, **cfg))
    for (k, v), w in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(v, w, atol=0, rtol=0, msg=k)


SLOW_CALC = """
import random, time

from gspo.envs.tools import ToolEnv
from gspo.tasks.rewards import load_reward


class SlowCalc(ToolEnv):
    \"\"\"tools:calc whose steps take 0-50 ms, unseeded: each run's steps finish in their own order.\"\"\"

    def __init__(self):
        super().__init__(load_reward("exact_match"), ("calc",))

    def step(self, model_turn):
        time.sleep(random.random() * 0.05)
        return super().step(model_turn)
"""


@pytest.mark.slow  # the slow tier (three end-to-end runs, ~65 CPU-seconds here): CI runs it
def test_kill_9_while_slow_tools_run_and_resume_is_exact(tmp_path):
    """``gspo train`` with the tool's steps in a pool and of random (unseeded) latency, killed with -9
    during a step after its checkpoint and resumed, ends with the uninterrupted run's weights bit for
    bit (its own tools finished in another order); the tool was called."""
    env_file = tmp_path / "slow_calc.py"
    env_file.write_text(SLOW_CALC)
    args = ["train", "--model", "embedded:tiny-dense", "--task", "add_long", "--env", f"{env_file}:SlowCalc",
            "--max-new-tokens", "20", "--max-turns", "2", "--max-trajectory-tokens", "40", "--sft-steps", "80",
            "--sft-batch-size", "16", "--steps", "4", "--prompts-per-step", "4", "--group-size", "4",
            "--eval-size", "8", "--eval-every", "0", "--threads", "1", "--no-progress", "--save-every", "1",
            "--tool-tick-steps", "3", "--output-dir", str(tmp_path)]  # fmt: skip

    def run(*a):
        return subprocess.run([sys.executable, "-m", "gspo", *a], capture_output=True, text=True, timeout=600)

    assert (r := run(*args, "--name", "full")).returncode == 0, r.stderr[-2000:]
    proc = subprocess.Popen([sys.executable, "-m", "gspo", *args, "--name", "killed"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    kill_9_after_checkpoint(proc, tmp_path / "killed", 2, timeout=600)
    assert (r := run(*args, "--name", "killed", "--resume")).returncode == 0, r.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    a, b = (
        AutoModelForCausalLM.from_pretrained(tmp_path / n / "final").state_dict() for n in ("full", "killed")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = _rows(tmp_path / "full")
    assert max(r["env/multi_turn_frac"] for r in rows[1:]) > 0 and max(r["env/obs_len"] for r in rows[1:]) > 0


@pytest.mark.slow  # the slow tier (an end-to-end run of ~20 s here): CI runs it
def test_async_multi_turn_rollouts_resume_exactly(tmp_path):
    """With async_staleness the sampler process plays the trajectories; a checkpoint holding an
    in-flight multi-turn batch resumes to the uninterrupted run's weights, bit for bit."""
    from gspo import train

    cfg = dict(TINY, steps=3, sft_steps=80, async_staleness=1, output_dir=str(tmp_path))  # calls the tool
    full = train(Config(name="full", **cfg))
    rows = _rows(full.run_dir)
    # step t samples with version max(t - 1 - K, 0): staleness 0, then K (``>= 0`` always held)
    assert [r["async/staleness"] for r in rows[1:]] == [0, 1, 1]
    assert max(r["env/multi_turn_frac"] for r in rows[1:]) > 0 and max(r["env/obs_len"] for r in rows[1:]) > 0
    train(Config(name="part", **{**cfg, "steps": 2}))
    resumed = train(Config(name="part", resume=True, **cfg))
    for (k, v), w in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(v, w, atol=0, rtol=0, msg=k)


def test_reset_may_change_the_prompt():
    class Hint(_EchoEnv):
        def reset(self, example):
            return example.prompt + "z"

    eng = _ScriptEngine([2])
    tok = _CharTok()
    enc = lambda p: tok(p).input_ids  # noqa: E731
    eb = run_episodes(eng, tok, EnvSpec(Hint, "hint", None), [Example("ab", "")], [[1, 2]], Limits(1, 4, 8), 1.0,
                      encode=enc)  # fmt: skip
    assert eb.prompt_ids == [[1, 2, 26]] and eng.calls[0][2] == [3]
    with pytest.raises(GspoError, match="changed the prompt"):
        run_episodes(
            eng, tok, EnvSpec(Hint, "hint", None), [Example("ab", "")], [[1, 2]], Limits(1, 4, 8), 1.0
        )


def test_overlong_penalty_and_filter_on_trajectories():
    """The soft penalty counts a trajectory's tokens (model and observations) against
    max_trajectory_tokens; the filter zeroes the advantage of trajectories a limit cut off."""
    from gspo.envs.episodes import EnvSampleBatch
    from gspo.resolve import score_plan
    from gspo.training.scoring import score_rollout

    model = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 0]])
    obs = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0]])
    eb = EnvSampleBatch(
        [[5]] * 4, torch.ones(4, 6, dtype=torch.long), model, torch.zeros(4, 6), obs_mask_BT=obs,
        reward_B=torch.tensor([1.0, 0.0, 1.0, 0.0]), truncated_B=torch.tensor([0.0, 1.0, 1.0, 0.0]),
        turns_B=torch.tensor([2.0, 1.0, 1.0, 2.0]),
    )  # fmt: skip
    for filt in (False, True):
        cfg = Config(
            env="tools", group_size=4, max_trajectory_tokens=6, overlong_buffer=2, overlong_filter=filt
        )
        data, m = score_rollout(eb, _CharTok(), None, [], score_plan(cfg.validate()), 0.0)
        # lengths 5, 6, 6, 4 of 6 with a buffer of 2: penalties -0.5, -1, -1, 0
        torch.testing.assert_close(data.reward_B, torch.tensor([0.5, -1.0, 0.0, 0.0]))
        assert torch.equal(data.obs_mask_BT, obs) and m["rollout/truncated_frac"] == 0.5
        assert (data.adv_B[[1, 2]] == 0).all() == filt and (data.adv_B[[0, 3]] != 0).all()


@pytest.mark.parametrize(
    "turn",
    [
        "calc((((-1e300)**.5)**2*((-1e300)**.5)**2)**2)",  # overflow inside the power pre-check
        "<calc>((-1)**0.5)//1</calc>",  # a complex number reaching //
        "<calc>((-1)**0.5)%2</calc>",
        "calc((-1)**.5)",  # a complex result
        "<tool_call>" + "[" * 3000 + "</tool_call>",  # JSON nested too deep
        '<tool_call>{"name": "calc", "arguments": ' + "[" * 3000 + "}</tool_call>",
        "<tool_call>" + "9" * 5000 + "</tool_call>",  # past int's digit limit
    ],
)
def test_hostile_tool_calls_get_an_error_observation_never_an_exception(turn):
    """What a policy can write must never stop the run: every such call is answered with an error."""
    env = ToolEnv(lambda *a: [0.0])
    env.reset(Example("q", "a"))
    out = env.step(turn)
    assert out.observation is not None and "error" in out.observation and out.reward == 0.0, out


def test_environment_steps_accept_numpy_rewards_and_unencodable_text(tmp_path, tiny_moe):
    """A numpy float32 reward is a number; an observation with a lone surrogate is tokenized (replaced),
    and a 50 MB observation is cut before tokenizing (the step returns at once)."""
    import numpy as np

    from gspo.envs.base import check_step

    assert check_step((None, np.float32(1.0)), "e").reward == 1.0
    assert check_step(("a\ud800b", 0.0), "e").observation == "a?b"
    with pytest.raises(GspoError, match="finite number"):
        check_step((None, np.True_), "e")
    from gspo.rollout.hf import HFRolloutEngine

    spec_s = _write_env(
        tmp_path,
        "class Env:\n    def reset(self, ex):\n        self.n = 0\n        return ex.prompt\n"
        "    def step(self, turn):\n        self.n += 1\n"
        "        return ('9' * 50_000_000, 0.0) if self.n == 1 else (None, 1.0)\n",
    )
    model, tok = tiny_moe
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
    ids = [tok("rev:12=", add_special_tokens=False).input_ids]
    out = run_episodes(eng, tok, env_spec(spec_s, lambda *a: [0.0], 0, "error"), [Example("rev:12=", "21")],
                       ids, Limits(2, 4, 16), 1.0)  # fmt: skip
    assert out is not None
