"""Hostile-sweep findings in environments, rewards, eval, signals and messages (issue 37), one regression
test (or a few) per finding, in the issue's order. Environments and rewards are decoy files under
tmp_path; the rollouts use a scripted engine unless a finding needs the real command."""

import os
import re
import shutil
import signal
import textwrap
import time
import warnings

import pytest
import torch
from cli_helpers import one_line

from gspo.cli import main
from gspo.config import Config, save_yaml
from gspo.data import SampleBatch
from gspo.envs.base import Limits
from gspo.envs.episodes import encoder, run_episodes
from gspo.envs.load import env_spec
from gspo.envs.tools import ToolError, calculator
from gspo.errors import GspoError
from gspo.resolve import env_plan
from gspo.tasks.datasets import Example

FAST = [
    "--sft-steps", "0", "--steps", "1", "--eval-size", "2", "--prompts-per-step", "2", "--group-size", "2",
    "--num-minibatches", "1", "--max-new-tokens", "4", "--eval-every", "0", "--threads", "1", "--no-progress",
    "--model", "embedded:tiny-dense",
]  # fmt: skip


def _write(tmp_path, name, body):
    f = tmp_path / name
    f.write_text(textwrap.dedent(body))
    return f


class _Engine:
    """Answers every row with tokens 2, 3 then EOS (1); sampler log-prob -0.5 each."""

    def generate(self, prompt_ids, max_new_tokens, temperature=1.0, greedy=False):
        seq = [2, 3, 1][:max_new_tokens]
        B, T = len(prompt_ids), len(seq)
        ids = torch.tensor([seq] * B)
        return SampleBatch(prompt_ids, ids, torch.ones(B, T, dtype=torch.long), torch.full((B, T), -0.5))


class _Tok:
    eos_token_id, pad_token_id = 1, 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids if i > 1)

    def __call__(self, text, add_special_tokens=False):
        class R:
            input_ids = [ord(c) - 96 for c in text]

        return R()


def _play(spec, n=4, encode=None):
    ex = [Example("p", "bc")] * n
    return run_episodes(_Engine(), _Tok(), spec, ex, [[5, 6]] * n, Limits(2, 4, 16), 1.0, encode=encode)


# ------------------------------------------------------------------------------------------------
# 1. gspo eval runs the run's own environment file, never another one of the same name


ENV_SCORING = "class Env:\n    def reset(self, ex):\n        return ex.prompt\n    def step(self, turn):\n        return None, {r}\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gspo.model.load import load_model_and_tokenizer, save_pretrained

    d = tmp_path_factory.mktemp("model") / "final"
    save_pretrained(*load_model_and_tokenizer("embedded:tiny-dense"), d)
    return d


def test_eval_imports_the_runs_relative_env_file_not_the_current_folders(
    tmp_path, monkeypatch, capsys, model_dir
):
    """A run started in ``work/`` with ``--env env.py:Env --output-dir runs``; gspo eval from a folder
    holding another env.py. Before: that env.py was imported (another score); the run's one gone, the
    error called the environment a reward."""
    from gspo.checkpoint_eval import evaluate_checkpoint

    work = tmp_path / "work"
    run = work / "runs" / "r"
    run.mkdir(parents=True)
    (work / "env.py").write_text(ENV_SCORING.format(r=1.0))
    (tmp_path / "env.py").write_text(ENV_SCORING.format(r=0.25))  # the decoy where gspo eval runs
    cfg = Config(env="env.py:Env", output_dir="runs", name="r", eval_size=2, max_new_tokens=2)
    save_yaml(cfg, run / "config.yaml")
    (run / "metrics.jsonl").write_text("")
    shutil.copytree(model_dir, run / "final")
    monkeypatch.chdir(tmp_path)
    out = evaluate_checkpoint(str(run / "final"))
    assert out["eval/reward_mean"] == 1.0
    capsys.readouterr()
    later = (run / "config.yaml").stat().st_mtime + 60  # edited after the run: said, still evaluated
    os.utime(work / "env.py", (later, later))
    assert evaluate_checkpoint(str(run / "final"))["eval/reward_mean"] == 1.0
    assert f"env file {work / 'env.py'} was modified after the run's config.yaml" in capsys.readouterr().err
    (work / "env.py").unlink()  # the run's file is gone: refused, the decoy is not used instead
    line = one_line(capsys, ["eval", str(run / "final")], "config.yaml: env 'env.py:Env' is relative to")
    assert f"({work})" in line and "--env" in line and "reward" not in line


# ------------------------------------------------------------------------------------------------
# 2. reward_on_error zero and an environment whose constructor or reset() raises


FLAKY_ENV = """\
class Env:
    made = 0

    def __init__(self):
        Env.made += 1
        self.i = Env.made
        if {ctor} and self.i % 2 == 0:
            raise ValueError("constructor boom")

    def reset(self, ex):
        if self.i % 2 == 0:
            raise RuntimeError("reset boom")
        return ex.prompt

    def step(self, turn):
        return None, 1.0
"""


@pytest.mark.parametrize("ctor", [False, True])
def test_reset_or_constructor_raising_under_reward_on_error_zero_scores_zero(tmp_path, ctor):
    f = _write(tmp_path, f"flaky{int(ctor)}.py", FLAKY_ENV.format(ctor=ctor))
    eb = _play(env_spec(f"{f}:Env", lambda *a: [0.0], 5.0, "zero"))
    assert eb.reward_B.tolist() == [1.0, 0.0, 1.0, 0.0] and eb.n_errors == 2
    assert eb.turns_B.tolist() == [1, 0, 1, 0] and eb.response_mask_BT[1].sum() == 0
    what = "its constructor raised ValueError: constructor boom" if ctor else "reset() raised RuntimeError"
    with pytest.raises(GspoError, match=re.escape(f"environment {f}:Env: {what}")):
        _play(env_spec(f"{f}:Env", lambda *a: [0.0], 5.0, "error"))


def test_reset_raising_under_reward_on_error_zero_through_train_and_eval(tmp_path, capsys):
    """Before: a traceback from the rollout and from the held-out evaluation."""
    f = _write(tmp_path, "flaky_cli.py", FLAKY_ENV.format(ctor=False))
    args = [
        "train",
        *FAST,
        "--output-dir",
        str(tmp_path / "o"),
        "--env",
        f"{f}:Env",
        "--reward-on-error",
        "zero",
    ]
    assert main([*args, "--max-trajectory-tokens", "4"]) == 0, capsys.readouterr().err[-2000:]
    err = capsys.readouterr().err
    assert "Traceback" not in err


# ------------------------------------------------------------------------------------------------
# 3. SystemExit at import time of a user environment or reward file


def test_systemexit_at_import_of_an_env_or_reward_file_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    f = _write(tmp_path, "exits.py", "raise SystemExit(3)\n")
    out = ["--output-dir", str(tmp_path / "o")]
    capsys.readouterr()
    one_line(
        capsys, ["train", *FAST, *out, "--env", f"{f}:Env"],
        f"environment '{f}:Env': importing {f} failed: SystemExit: 3",
    )  # fmt: skip
    one_line(
        capsys,
        ["train", *FAST, *out, "--reward", f"{f}:fn"],
        f"reward '{f}:fn': importing {f} failed: SystemExit: 3",
    )
    from gspo.tasks.rewards import load_reward

    monkeypatch.syspath_prepend(str(tmp_path))  # importable by module name, not only by file
    with pytest.raises(GspoError, match="reward 'exits:fn': cannot import module 'exits': SystemExit: 3"):
        load_reward("exits:fn")
    with pytest.raises(GspoError, match="config field 'env': importing 'exits' failed: SystemExit: 3"):
        env_spec("exits:Env", lambda *a: [0.0], None, "error")


# ------------------------------------------------------------------------------------------------
# 4. an environment's constructor runs under reward_timeout_s


def test_environment_constructor_is_bounded_by_the_time_limit(tmp_path):
    f = _write(
        tmp_path, "slow_ctor.py", "import time\nclass Env:\n    def __init__(self):\n        time.sleep(60)\n"
    )
    t0 = time.time()
    with pytest.raises(
        GspoError, match=re.escape(f"environment {f}:Env: its constructor did not return within 0.5 s")
    ):
        _play(env_spec(f"{f}:Env", lambda *a: [0.0], 0.5, "zero"))  # time-outs always stop
    assert time.time() - t0 < 10


# ------------------------------------------------------------------------------------------------
# 5. a huge prompt from reset() is refused by its length before it is tokenized, naming the environment


def test_huge_prompt_from_reset_is_refused_before_tokenizing_and_names_the_env(tmp_path, tiny_moe):
    _, tok = tiny_moe
    plan = env_plan(Config(env="task", max_prompt_tokens=16).validate())  # encoder() reads its prompt limits
    f = _write(
        tmp_path, "huge.py",
        "class Env:\n    def reset(self, ex):\n        return ex.answer\n    def step(self, t):\n        return None, 0.0\n",
    )  # fmt: skip
    spec = env_spec(f"{f}:Env", lambda *a: [0.0], None, "error")
    ex = [Example("rev:12=", "1" * 10_000_000)]
    calls = []
    real = type(tok).__call__

    def counting(self, text, *a, **k):
        calls.append(len(text))
        return real(self, text, *a, **k)

    eng, lim = _Engine(), Limits(2, 4, 16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(tok), "__call__", counting)
        with pytest.raises(
            GspoError, match=re.escape(f"environment {f}:Env: reset() returned a prompt of 10,000,000 ")
        ):
            run_episodes(eng, tok, spec, ex, [[5]], lim, 1.0, encode=encoder(tok, plan))
    assert not calls, "the 10 MB prompt was tokenized"
    # one just over the token limit is tokenized and refused by its tokens, naming the environment too
    with pytest.raises(
        GspoError,
        match=re.escape(f"environment {f}:Env: reset() prompt has ") + r"\d+ tokens > max_prompt_tokens=16",
    ):
        run_episodes(
            eng, tok, spec, [Example("rev:12=", "1" * 20)], [[5]], lim, 1.0, encode=encoder(tok, plan)
        )


# ------------------------------------------------------------------------------------------------
# 6. the task's reward inside an environment is checked as in single-turn rollouts


@pytest.mark.parametrize("env", ["task", "tools:calc"])
def test_wrong_shape_task_reward_in_an_environment_is_refused_as_in_single_turn(env):
    from gspo.tasks.rewards import safe_rewards

    def two(p, c, a):
        return [1.0, 1.0]

    with pytest.raises(GspoError) as single:
        safe_rewards(two, ["p"], ["bc"], ["bc"], name="two")
    with pytest.raises(GspoError) as multi:
        _play(env_spec(env, two, None, "error", "two"))
    assert str(single.value) in str(multi.value) and f"environment {env}" in str(multi.value)
    calls = []

    def every_other(p, c, a):  # reward_on_error zero: the bad ones score 0 and are counted
        calls.append(1)
        return [1.0] * (1 + len(calls) % 2)

    eb = _play(env_spec(env, every_other, None, "zero", "every_other"))
    assert eb.n_errors == 2 and sorted(eb.reward_B.tolist()) == [0.0, 0.0, 1.0, 1.0]


# ------------------------------------------------------------------------------------------------
# 7. environment import errors say "environment"


def test_environment_import_errors_say_environment(tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(GspoError, match=re.escape(f"environment '{missing}:Env': file not found: {missing}")):
        env_spec(f"{missing}:Env", lambda *a: [0.0], None, "error")
    broken = _write(tmp_path, "broken_env.py", "import no_such_module_xyz\n")
    with pytest.raises(
        GspoError, match=re.escape(f"environment '{broken}:Env': importing {broken} failed: ModuleNotFound")
    ):
        env_spec(f"{broken}:Env", lambda *a: [0.0], None, "error")


# ------------------------------------------------------------------------------------------------
# 8. a real time-out is told from an error whose text says "timed out" by its type


@pytest.mark.parametrize(
    "raise_,want",
    [
        ("raise GspoError('db timed out')", "step() raised GspoError: db timed out"),
        ("raise TimeoutError('request timed out')", "step() raised TimeoutError: request timed out"),
        ("time.sleep(60)", "step() did not return within 0.5 s"),
    ],
)
def test_timed_out_in_an_environments_message_is_not_a_time_out(tmp_path, raise_, want):
    f = _write(
        tmp_path, "said.py",
        "import time\nfrom gspo.errors import GspoError\nclass Env:\n    def reset(self, ex):\n        return ex.prompt\n"
        f"    def step(self, t):\n        {raise_}\n",
    )  # fmt: skip
    with pytest.raises(GspoError) as e:
        _play(env_spec(f"{f}:Env", lambda *a: [0.0], 0.5, "error"))
    assert str(e.value) == f"environment {f}:Env: {want}" + (
        " (reward_timeout_s)" if "within" in want else ""
    )


def test_a_rewards_time_out_inside_the_tools_env_names_the_reward():
    """Before: a TypeError traceback (the tools env has no time limit of its own to print)."""
    from gspo.tasks.rewards import with_timeout

    def slow(p, c, a):
        time.sleep(60)

    with pytest.raises(GspoError, match="reward function slow timed out after 0.3 s"):
        _play(env_spec("tools", with_timeout(slow, "slow", 0.3), None, "zero", "slow"), n=1)


# ------------------------------------------------------------------------------------------------
# 9. the calculator says what was wrong with a number


@pytest.mark.parametrize(
    "expr,want",
    [
        ("(-1)**0.5", "complex result"),
        ("(-8)**(1/3)", "complex result"),
        ("1e-300*1e-300", "underflow"),
        ("10**-1000", "underflow"),
        ("5e-324/2", "underflow"),
        ("0.5**5000", "underflow"),
        ("9**999", "number too large (limit 10^100)"),
        ("10**99*10", "number too large (limit 10^100)"),
        ("1e308*10", "number too large for a float"),
        ("1e200**2", "number too large for a float"),
        ("1/0", "division by zero"),
    ],
)
def test_calculator_names_what_was_wrong_with_a_number(expr, want):
    with pytest.raises(ToolError) as e:
        calculator(expr)
    assert want in str(e.value)


def test_calculator_keeps_small_and_unit_powers():
    assert calculator("1**1000") == "1" and calculator("(-1)**1001") == "-1" and calculator("0**5") == "0"
    assert calculator("2**0.5") == format(2**0.5, ".12g") and calculator("10**-5") == "1e-05"


# ------------------------------------------------------------------------------------------------
# 10. the SIGTERM notice is a notice: stderr, not stdout


def test_sigterm_notice_goes_to_stderr(capsys):
    from gspo.training.loop import deferred_signals

    with deferred_signals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        t0 = time.time()
        while not stop.requested and time.time() - t0 < 5:
            time.sleep(0.01)
    out, err = capsys.readouterr()
    assert stop.requested and "gspo: SIGTERM: stopping" in err and out == ""


# ------------------------------------------------------------------------------------------------
# 11. gspo eval prints its JSON line and nothing else


def test_eval_prints_no_progress_bar_or_upstream_warning(model_dir, capsys):
    import transformers

    transformers.utils.logging.enable_progress_bar()  # as in a fresh process (train() disables it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["eval", str(model_dir), "--eval-size", "2", "--max-new-tokens", "2"]) == 0
        # what DCP says when gspo export reads a sharded checkpoint in one process (cmd_export)
        warnings.warn(
            "torch.distributed is disabled, unavailable or uninitialized, assuming ...", stacklevel=1
        )
    out, err = capsys.readouterr()
    assert err == "" and len(out.strip().splitlines()) == 1, err[-2000:]
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]


def test_a_bad_environment_is_refused_before_any_weight_is_read(tmp_path):
    """The environment is resolved before the model loads: with a model path that does not exist,
    the error is the environment's (the model's would come first if it were read first)."""
    from gspo.config import make_config
    from gspo.launch import train

    cfg = make_config(None, dict(model=str(tmp_path / "no-model"), env="no_such_module:Env", sft_steps=0))
    with pytest.raises(GspoError, match="config field 'env'"):
        train(cfg)
