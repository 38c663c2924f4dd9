"""Environment packages through gspo's multi-turn rollout (gspo.envs.packages): ``skyrl-gym:NAME`` on
the package's own ``gsm8k_multi_turn``, ``openenv:MOD:CLS`` and ``verifiers:NAME`` on small
environments built here (a digit-guessing game). Each trajectory equals the package's own play of
the same turns (observations, rewards, turns), a group's samples share one problem, ``gspo train``
runs each end to end, and the package's failures are one line naming the environment (exit 2 at
load; at run time the run stops, or the trajectory scores 0 under ``--reward-on-error zero``).
Each test skips when its package is not installed."""

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from cli_helpers import one_line

from gspo.data import SampleBatch
from gspo.envs.base import Limits
from gspo.envs.episodes import run_episodes
from gspo.envs.load import env_spec
from gspo.errors import GspoError
from gspo.tasks.datasets import Example

PACKAGES = {
    "skyrl-gym": "skyrl_gym",
    "openenv": "openenv.core.env_server.interfaces",
    "verifiers": "verifiers.v1",
}

OPENENV_GUESS = '''
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

LOG = []  # per environment made: [(action, observation text, reward, done), ...]


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    text: str = ""


class GuessEnv(Environment):
    """Guess a digit: "higher" / "lower" after a wrong guess, reward 1 and done on the right one."""

    def __init__(self):
        super().__init__()
        self._state, self.secret, self.log = State(step_count=0), 0, []
        LOG.append(self.log)

    def reset(self, seed=None, episode_id=None, **kw):
        self.secret = (seed or 0) % 10
        return GuessObservation(text="guess a digit")

    def step(self, action: GuessAction, timeout_s=None, **kw):
        g = action.guess
        if g == str(self.secret):
            obs = GuessObservation(text="right", done=True, reward=1.0)
        else:
            hint = "higher" if not g.isdigit() or int(g) < self.secret else "lower"
            obs = GuessObservation(text=hint, reward=0.0)
        self.log.append((g, obs.text, obs.reward, obs.done))
        return obs

    @property
    def state(self):
        return self._state


class Raises(GuessEnv):
    def step(self, action: GuessAction, timeout_s=None, **kw):
        raise RuntimeError("boom")


class Hangs(GuessEnv):
    def step(self, action: GuessAction, timeout_s=None, **kw):
        import time

        time.sleep(60)


class WrongType(GuessEnv):
    def step(self, action: GuessAction, timeout_s=None, **kw):
        return {"text": "not an observation"}
'''

VERIFIERS_GUESS = '''
import verifiers.v1 as vf

LOG = []  # per episode: (secret, [(user message or None, reply), ...])


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def solved(self, trace) -> float:
        return float(trace.last_reply == str(self.data.secret))


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for s in range(10):
            yield GuessTask(GuessData(prompt="guess a digit", secret=s), self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    """The game engine as the user: "higher" / "lower" until the reply is the secret (3 tries);
    a -0.1 reward per model turn on top of the task's own."""

    async def run(self, task, agents):
        log = []
        LOG.append((task.data.secret, log))
        async with agents.player.interaction(task) as x:
            seg, message = await x.turn(), None
            for _ in range(3):
                log.append((message, seg.last_reply))
                if seg.last_reply == str(task.data.secret):
                    break
                g = seg.last_reply
                message = "higher" if not g.isdigit() or int(g) < task.data.secret else "lower"
                seg = await x.turn(message)
            else:
                log.append((message, seg.last_reply))
        x.trace.record_reward("turns", -0.1 * x.trace.num_turns, 1.0)


__all__ = ["GuessTaskset", "GuessEnv"]
'''

VERIFIERS_RAISES = VERIFIERS_GUESS.replace("log = []", "raise ValueError('no board')")


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory):
    """The test's environments as importable modules (``gspo_oe_guess``, ``gspo_vf_guess``)."""
    d = tmp_path_factory.mktemp("pkg_envs")
    (d / "gspo_oe_guess.py").write_text(OPENENV_GUESS)
    (d / "gspo_vf_guess.py").write_text(VERIFIERS_GUESS)
    (d / "gspo_vf_raises.py").write_text(VERIFIERS_RAISES)
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))


def _need(pkg):
    pytest.importorskip(PACKAGES[pkg], reason=f"the {pkg} package is not installed (pip install {pkg})")


class _Tok:
    """Characters as tokens (id = code point + 2; EOS 1, pad 0)."""

    eos_token_id, pad_token_id = 1, 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 2) for i in ids if i > 1)

    def __call__(self, text, add_special_tokens=False):
        class R:
            input_ids = [ord(c) + 2 for c in text]

        return R()


class _Policy:
    """A scripted engine: a row's k-th turn is ``turns(prompt_text, k)`` then EOS (k = EOS tokens in
    its context so far); sampler log-prob -0.5 per token."""

    def __init__(self, turns):
        self.turns, self.tok = turns, _Tok()

    def generate(self, prompt_ids, max_new_tokens, temperature=1.0, greedy=False):
        rows = []
        for ctx in prompt_ids:
            k = sum(1 for t in ctx if t == 1)
            rows.append((self.tok(self.turns(self.tok.decode(ctx), k)).input_ids + [1])[:max_new_tokens])
        T = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
        return SampleBatch(prompt_ids, ids, mask, torch.full(ids.shape, -0.5))


def _segments(ids, model, real):
    """A trajectory's runs of model tokens and of observation tokens, decoded, in order."""
    out, cur, kind = [], [], None
    for t, m, r in zip(ids, model, real, strict=True):
        if not r:
            break
        if kind is not None and m != kind:
            out.append((kind, _Tok().decode(cur)))
            cur = []
        kind = m
        cur.append(t)
    if cur:
        out.append((kind, _Tok().decode(cur)))
    return out


def _play(spec_s, examples, turns, on_error="error", timeout_s=5.0, limits=None):
    spec = env_spec(spec_s, lambda *a: [0.0], timeout_s, on_error)
    tok, limits = _Tok(), limits or Limits(6, 16, 1000)
    prompt_ids = [tok(ex.prompt).input_ids for ex in examples]
    return run_episodes(
        _Policy(turns), tok, spec, examples, prompt_ids, limits, 1.0, encode=lambda p: tok(p).input_ids
    )


def _guess_in_order(prompt, k):
    return str(k)  # 0, 1, 2, ... until the game says "right"


# ------------------------------------------------------------------------------------------------
# each package's trajectories equal the package's own play of the same turns


def test_skyrl_gym_gsm8k_multi_turn_equals_the_package():
    _need("skyrl-gym")
    import skyrl_gym

    answers = {"a": "5", "b": "12", "c": "7"}
    scripts = {"a": ["#### 4", "#### 5"], "b": ["so #### 12"], "c": ["no idea", "#### 7.0", "#### 8", "7"]}
    examples = [Example(f"{k}: sum?", v) for k, v in answers.items() for _ in range(2)]
    eb = _play("skyrl-gym:gsm8k_multi_turn", examples, lambda p, k: scripts[p[0]][k % len(scripts[p[0]])])
    real = (eb.obs_mask_BT + eb.response_mask_BT).tolist()
    for b, ex in enumerate(examples):
        segs = _segments(eb.response_ids_BT[b].tolist(), eb.response_mask_BT[b].tolist(), real[b])
        env = skyrl_gym.make(
            "gsm8k_multi_turn",
            env_config={},
            extras={"reward_spec": {"ground_truth": ex.answer}, "extra_info": {}},
        )
        env.init([{"role": "user", "content": ex.prompt}])
        want_segs, reward, turns = [], 0.0, 0
        for k in range(6):
            turn = scripts[ex.prompt[0]][k % len(scripts[ex.prompt[0]])]
            out = env.step(turn)
            want_segs.append((1, turn))
            reward, turns = reward + out["reward"], turns + 1
            if out["done"]:
                break
            want_segs.append((0, "\n".join(m["content"] for m in out["observations"])))
        assert segs == want_segs
        assert eb.reward_B[b].item() == pytest.approx(reward) and eb.turns_B[b].item() == turns
    assert eb.reward_B.tolist()[::2] == eb.reward_B.tolist()[1::2]  # same example, same trajectory
    assert eb.truncated_B.sum().item() == 0 and eb.reward_B.max().item() >= 1.0  # done by the package


def test_openenv_in_process_equals_the_environments_own_log(env_dir):
    _need("openenv")
    import gspo_oe_guess as mod

    mod.LOG.clear()
    examples = [Example(f"seed {i}", "") for i in range(5) for _ in range(2)]
    eb = _play("openenv:gspo_oe_guess:GuessEnv", examples, _guess_in_order, limits=Limits(10, 4, 200))
    real = (eb.obs_mask_BT + eb.response_mask_BT).tolist()
    assert len(mod.LOG) == len(examples)  # one environment per trajectory, made in order
    secrets = []
    for b, log in enumerate(mod.LOG):
        segs = _segments(eb.response_ids_BT[b].tolist(), eb.response_mask_BT[b].tolist(), real[b])
        want = [s for g, text, _, done in log for s in [(1, g)] + ([] if done else [(0, text)])]
        assert segs == want
        assert eb.reward_B[b].item() == sum(r for *_, r, _ in log) == 1.0  # found the digit
        assert eb.turns_B[b].item() == len(log) and log[-1][0] == str(len(log) - 1)
        secrets.append(len(log) - 1)
    # the environment's prompt, not the example's, opens each trajectory
    assert all(_Tok().decode(p) == "guess a digit" for p in eb.prompt_ids)
    assert secrets[::2] == secrets[1::2] and len(set(secrets)) > 1  # a group shares its problem


def test_verifiers_environment_equals_its_own_log_and_rewards(env_dir):
    _need("verifiers")
    import gspo_vf_guess as mod

    mod.LOG.clear()
    examples = [Example(f"seed {i}", "") for i in range(10) for _ in range(2)]
    eb = _play("verifiers:gspo_vf_guess", examples, _guess_in_order, limits=Limits(10, 4, 200))
    real = (eb.obs_mask_BT + eb.response_mask_BT).tolist()
    assert len(mod.LOG) == len(examples)
    for b, (secret, log) in enumerate(mod.LOG):
        segs = _segments(eb.response_ids_BT[b].tolist(), eb.response_mask_BT[b].tolist(), real[b])
        want = [s for msg, reply in log for s in ([(0, msg)] if msg else []) + [(1, reply)]]
        assert segs == want
        # the task's @vf.reward (1 when the last reply is the secret) plus the environment's -0.1 a turn
        solved = float(log[-1][1] == str(secret))
        assert eb.reward_B[b].item() == pytest.approx(solved - 0.1 * len(log))
        assert eb.turns_B[b].item() == len(log)
    assert _Tok().decode(eb.prompt_ids[0]) == "guess a digit"
    secrets = [secret for secret, _ in mod.LOG]
    assert secrets[::2] == secrets[1::2] and eb.reward_B.tolist()[::2] == eb.reward_B.tolist()[1::2]
    assert len(set(eb.reward_B.tolist())) > 1  # some games solved within 3 tries, some not


def test_verifiers_plain_taskset_is_one_turn_scored_by_its_rewards(env_dir):
    """A taskset without its own environment plays verifiers' single-agent case: one model turn."""
    _need("verifiers")
    (env_dir / "gspo_vf_plain.py").write_text(
        VERIFIERS_GUESS.replace('__all__ = ["GuessTaskset", "GuessEnv"]', '__all__ = ["GuessTaskset"]')
    )
    examples = [Example(f"seed {i}", "") for i in range(10)]
    eb = _play("verifiers:gspo_vf_plain", examples, lambda p, k: "3")
    assert eb.turns_B.tolist() == [1.0] * 10
    assert set(eb.reward_B.tolist()) == {0.0, 1.0}  # right for the tasks whose secret is 3 only


# ------------------------------------------------------------------------------------------------
# gspo train, end to end, on the tiny model

RUN = [
    "--model", "embedded:tiny-dense", "--sft-steps", "0", "--steps", "2", "--eval-size", "4",
    "--prompts-per-step", "2", "--group-size", "2", "--num-minibatches", "1", "--max-new-tokens", "4",
    "--max-turns", "3", "--max-trajectory-tokens", "24", "--eval-every", "0", "--threads", "1", "--no-progress",
]  # fmt: skip

SPECS = {
    "skyrl-gym": "skyrl-gym:gsm8k_multi_turn",
    "openenv": "openenv:gspo_oe_guess:GuessEnv",
    "verifiers": "verifiers:gspo_vf_guess",
}


def _gspo(env_dir, *args):
    env = {**__import__("os").environ, "PYTHONPATH": str(env_dir), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "gspo", "train", *args], capture_output=True, text=True, timeout=600, env=env
    )


@pytest.mark.parametrize("pkg", list(SPECS))
def test_gspo_train_runs_each_package(tmp_path, env_dir, pkg):
    _need(pkg)
    p = _gspo(env_dir, "--env", SPECS[pkg], "--output-dir", str(tmp_path), *RUN)
    assert p.returncode == 0, p.stderr[-2000:]
    (metrics,) = tmp_path.glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r][-1] == 2
    turns = [r["env/turns_mean"] for r in rows if "env/turns_mean" in r]
    assert turns and all(1 <= t <= 3 for t in turns)


# ------------------------------------------------------------------------------------------------
# the package's failures: one line naming the environment


@pytest.mark.parametrize(
    "spec_s, msg",
    [
        ("skyrl-gym:no_such_env", "no skyrl-gym environment 'no_such_env' (registered: aime"),
        ("openenv:gspo_oe_guess:GuessAction", "'GuessAction' is not an openenv Environment subclass"),
        ("openenv:gspo_oe_guess", "expected openenv:pkg.module:Class"),
        ("verifiers:gspo_no_such_taskset", "loading the verifiers environment failed: ModuleNotFoundError"),
        ("verifiers:", "names no environment"),
    ],
)
def test_bad_package_environment_at_load_is_one_line(env_dir, spec_s, msg):
    _need(spec_s.partition(":")[0])
    with pytest.raises(GspoError, match=re.escape(msg)) as e:
        env_spec(spec_s, lambda *a: [0.0], 5.0, "error")
    assert "\n" not in str(e.value) and spec_s in str(e.value) and "config field 'env'" in str(e.value)


def test_missing_package_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # import fails as if not installed
    with pytest.raises(GspoError, match=re.escape("needs the skyrl-gym package (pip install skyrl-gym)")):
        env_spec("skyrl-gym:gsm8k", lambda *a: [0.0], 5.0, "error")


def test_cli_unknown_package_environment_exits_2(tmp_path, env_dir, capsys):
    """``gspo train --env skyrl-gym:nope`` (in-process: the command's code path without an interpreter
    start): exit 2, one line naming the environment."""
    _need("skyrl-gym")
    args = ["train", "--env", "skyrl-gym:nope", "--output-dir", str(tmp_path), *RUN]
    line = one_line(capsys, args, "no skyrl-gym environment")
    assert line.startswith("gspo: error") and "skyrl-gym:nope" in line


BAD_RUNTIME = {
    "raises": ("openenv:gspo_oe_guess:Raises", "step() raised RuntimeError: boom"),
    "hangs": ("openenv:gspo_oe_guess:Hangs", "step() did not return within 0.5 s"),
    "wrong_type": ("openenv:gspo_oe_guess:WrongType", "step() raised TypeError: step() returned dict"),
    "vf_raises": ("verifiers:gspo_vf_raises", "reset() raised ValueError: no board"),
}


@pytest.mark.parametrize("kind", list(BAD_RUNTIME))
def test_package_environment_failing_at_run_time(env_dir, kind):
    spec_s, msg = BAD_RUNTIME[kind]
    _need(spec_s.partition(":")[0])
    examples = [Example("seed 1", "")] * 2
    with pytest.raises(GspoError, match=re.escape(msg)) as e:
        _play(spec_s, examples, _guess_in_order, timeout_s=0.5)
    assert "\n" not in str(e.value) and f"environment {spec_s}" in str(e.value)
    if kind != "hangs":  # reward_on_error zero: each trajectory scores 0; a batch where all fail stops
        with pytest.raises(GspoError, match="failed on all 2 trajectories"):
            _play(spec_s, examples, _guess_in_order, on_error="zero", timeout_s=0.5)


def test_skyrl_gym_wrong_step_output_is_one_line(env_dir):
    _need("skyrl-gym")
    import skyrl_gym

    (env_dir / "gspo_sk_bad.py").write_text(
        textwrap.dedent("""
        from skyrl_gym.envs.base_text_env import BaseTextEnv

        class Bad(BaseTextEnv):
            def __init__(self, env_config=None, extras={}):
                super().__init__()

            def step(self, action):
                return {"observations": [{"role": "user", "content": 3}], "reward": 0.5, "done": False}
        """)
    )
    skyrl_gym.register(id="gspo_test_bad", entry_point="gspo_sk_bad:Bad")
    try:
        with pytest.raises(
            GspoError, match=re.escape("step() raised TypeError: step() observations has a message")
        ):
            _play("skyrl-gym:gspo_test_bad", [Example("q", "1")], _guess_in_order)
        with pytest.raises(GspoError, match="failed on all 2 trajectories"):  # each scored 0: the batch stops
            _play("skyrl-gym:gspo_test_bad", [Example("q", "1"), Example("r", "1")], _guess_in_order, "zero")
    finally:
        skyrl_gym.envs.registration.deregister("gspo_test_bad")


# ------------------------------------------------------------------------------------------------
# --chat-template: the package's messages go back in their own roles, rendered by the template


def _chat_play(spec_s, examples, turns):
    from test_chat_tools import _limits, _plan, _Turns, make_tokenizer

    from gspo.envs.episodes import encoder

    tok = make_tokenizer()
    plan = _plan(env=spec_s, max_turns=6, max_trajectory_tokens=2000)
    enc = encoder(tok, plan)
    spec = env_spec(spec_s, lambda *a: [0.0], 5.0, "error")
    eb = run_episodes(_Turns(tok, turns), tok, spec, examples, [enc(e.prompt) for e in examples], _limits(plan), 1.0,
                      encode=enc)  # fmt: skip
    return tok, eb


def test_skyrl_gym_observations_keep_their_role_under_the_chat_template():
    _need("skyrl-gym")
    from test_chat_tools import _check_against_template

    tok, eb = _chat_play("skyrl-gym:gsm8k_multi_turn", [Example("a: sum?", "5")] * 2, ["#### 4", "#### 5"])
    hint = skyrl_gym_hint()
    conversation = [
        {"role": "user", "content": "a: sum?"},
        {"role": "assistant", "content": "#### 4"},
        {"role": "user", "content": hint},
        {"role": "assistant", "content": "#### 5"},
    ]
    _check_against_template(tok, eb, conversation, None)
    assert eb.reward_B.tolist() == pytest.approx([1.04, 1.04])


def skyrl_gym_hint():
    import skyrl_gym

    env = skyrl_gym.make(
        "gsm8k_multi_turn", env_config={}, extras={"reward_spec": {"ground_truth": "5"}, "extra_info": {}}
    )
    env.init([])
    return env.step("#### 4")["observations"][0]["content"]


def test_verifiers_messages_are_the_users_under_the_chat_template(env_dir):
    _need("verifiers")
    import gspo_vf_guess as mod
    from test_chat_tools import _check_against_template

    mod.LOG.clear()
    tok, eb = _chat_play("verifiers:gspo_vf_guess", [Example("seed 9", "")] * 2, ["0", "1", "2", "3"])
    secret, log = mod.LOG[0]
    conversation = [{"role": "user", "content": "guess a digit"}]
    for message, reply in log:
        conversation += ([{"role": "user", "content": message}] if message else []) + [
            {"role": "assistant", "content": reply}
        ]
    _check_against_template(tok, eb, conversation, None)
    assert eb.reward_B[0].item() == pytest.approx(float(log[-1][1] == str(secret)) - 0.1 * len(log))


def test_verifiers_taskset_that_needs_a_runtime_is_refused_at_load(env_dir):
    """A reward that reads the runtime would be skipped by verifiers without one: refused, not 0."""
    _need("verifiers")
    (env_dir / "gspo_vf_runtime.py").write_text(
        VERIFIERS_GUESS.replace("async def solved(self, trace)", "async def solved(self, trace, runtime)")
    )
    with pytest.raises(GspoError, match=re.escape("its reward 'solved' reads the task's runtime")) as e:
        env_spec("verifiers:gspo_vf_runtime", lambda *a: [0.0], 5.0, "error")
    assert "\n" not in str(e.value) and "verifiers:gspo_vf_runtime" in str(e.value)


# ------------------------------------------------------------------------------------------------
# an environment that answers with several messages: every one reaches the model and the trace

SKYRL_HINTS = '''
from skyrl_gym.envs.base_text_env import BaseTextEnv


class Hints(BaseTextEnv):
    """Two observation messages after a wrong answer: the answer, then "try again"; reward 1 and
    done on the right answer, done after 3 turns."""

    def __init__(self, env_config=None, extras={}):
        super().__init__()
        self.answer, self.n = extras["reward_spec"]["ground_truth"], 0

    def step(self, action):
        self.n += 1
        if action == self.answer:
            return {"observations": [], "reward": 1.0, "done": True}
        hints = [{"role": "user", "content": f"the answer is {self.answer}"}, {"role": "user", "content": "try again"}]
        return {"observations": hints, "reward": 0.0, "done": self.n >= 3}
'''


def _reads_the_answer(prompt, k):
    found = re.findall(r"the answer is (\d)", prompt)
    return found[-1] if found else "no idea"


def test_skyrl_gym_step_with_several_observations_shows_them_all(env_dir):
    """A skyrl-gym step that answers with two messages: the model sees both (one text, in order),
    and the scripted model, which can only answer from the first, solves every task on its second turn."""
    _need("skyrl-gym")
    import skyrl_gym

    (env_dir / "gspo_sk_hints.py").write_text(SKYRL_HINTS)
    skyrl_gym.register(id="gspo_test_hints", entry_point="gspo_sk_hints:Hints")
    try:
        examples = [Example("q", "7"), Example("q", "7"), Example("r", "3"), Example("r", "3")]
        eb = _play("skyrl-gym:gspo_test_hints", examples, _reads_the_answer)
        tok, chat = _chat_play("skyrl-gym:gspo_test_hints", [Example("q", "7")] * 2, ["no idea", "7"])
    finally:
        skyrl_gym.envs.registration.deregister("gspo_test_hints")
    real = (eb.obs_mask_BT + eb.response_mask_BT).tolist()
    for b, ex in enumerate(examples):
        segs = _segments(eb.response_ids_BT[b].tolist(), eb.response_mask_BT[b].tolist(), real[b])
        assert segs == [(1, "no idea"), (0, f"the answer is {ex.answer}\ntry again"), (1, ex.answer)]
    assert eb.reward_B.tolist() == [1.0] * 4 and eb.turns_B.tolist() == [2.0] * 4
    from test_chat_tools import _check_against_template

    conversation = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "no idea"},
        {"role": "user", "content": "the answer is 7"},  # --chat-template: each message in its own role
        {"role": "user", "content": "try again"},
        {"role": "assistant", "content": "7"},
    ]
    _check_against_template(tok, chat, conversation, None)


VERIFIERS_HEARD = """
import verifiers.v1 as vf

LOG = []  # per episode: the environment's messages, as sent


class HeardData(vf.TaskData):
    secret: int


class HeardTask(vf.Task[HeardData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def heard(self, trace) -> float:
        # 1 per line of the environment's messages in the trace: what the task scores is what was said
        said = [m.content for m in trace.messages if getattr(m, "role", None) == "user"]
        return float(sum(len(s.splitlines()) for s in said))


class HeardTaskset(vf.Taskset[HeardTask, vf.TasksetConfig]):
    def load(self):
        for s in range(10):
            yield HeardTask(HeardData(prompt="guess a digit", secret=s), self.config.task)


class HeardEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class HeardEnv(vf.Env[HeardEnvConfig]):
    # two messages after each of the model's first two turns: a hint, then "try again"
    async def run(self, task, agents):
        sent = []
        LOG.append(sent)
        async with agents.player.interaction(task) as x:
            seg = await x.turn()
            for _ in range(2):
                g = seg.last_reply
                hint = "higher" if not g.isdigit() or int(g) < task.data.secret else "lower"
                sent.append(hint + "\\ntry again")
                seg = await x.turn([vf.UserMessage(content=hint), vf.UserMessage(content="try again")])


__all__ = ["HeardTaskset", "HeardEnv"]
"""


def test_verifiers_trace_holds_the_environments_messages(env_dir):
    """The trace a verifiers task scores holds the environment's messages as the model saw them (two
    messages a turn, joined), in order between the model's turns: a reward that counts their lines
    gets 2 per message sent."""
    _need("verifiers")
    (env_dir / "gspo_vf_heard.py").write_text(VERIFIERS_HEARD)
    import gspo_vf_heard as mod

    mod.LOG.clear()
    examples = [Example(f"seed {i}", "") for i in range(3) for _ in range(2)]
    eb = _play("verifiers:gspo_vf_heard", examples, _guess_in_order, limits=Limits(10, 4, 200))
    real = (eb.obs_mask_BT + eb.response_mask_BT).tolist()
    assert len(mod.LOG) == len(examples)
    for b, sent in enumerate(mod.LOG):
        segs = _segments(eb.response_ids_BT[b].tolist(), eb.response_mask_BT[b].tolist(), real[b])
        assert segs == [(1, "0"), (0, sent[0]), (1, "1"), (0, sent[1]), (1, "2")]
        assert eb.turns_B[b].item() == 3
    assert eb.reward_B.tolist() == [4.0] * len(examples)  # 2 messages x 2 lines, all in the trace
