"""Fourth hostile sweep (issues 44 and 49): environment packages that run model code, environment
modules that exit or hang at import, more than one line after an error, and options that were ignored.
Each check goes through the ``gspo`` command (in process where it cannot hang, else a subprocess with a
time limit); hostile code only ever aims at decoy files under tmp_path."""

import os
import sys
import textwrap
import time

import pytest
from cli_helpers import gspo, one_line

from gspo.errors import GspoError

FAST = [
    "--sft-steps", "0", "--steps", "1", "--eval-size", "2", "--prompts-per-step", "2", "--group-size", "2",
    "--num-minibatches", "1", "--max-new-tokens", "4", "--eval-every", "0", "--threads", "1", "--no-progress",
    "--model", "embedded:tiny-dense",
]  # fmt: skip
TINY = [
    "--steps", "1", "--sft-steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--eval-size", "2",
    "--max-new-tokens", "8", "--threads", "1", "--no-progress",
]  # fmt: skip


def _write(folder, name, body):
    f = folder / name
    f.write_text(textwrap.dedent(body))
    return f


# ------------------------------------------------------------------------------------------------
# issue 49 item 4: skyrl-gym environments whose tools run the model's output on the host are refused


def test_skyrl_gym_environments_that_run_model_code_are_refused_and_the_decoy_stays_unwritten(
    tmp_path, capsys, monkeypatch
):
    """Through gspo's adapter, searchcode's python tool ran the model's code on the host (it wrote the
    decoy). Now the environment is refused in one line, before any weight is read (the model path
    does not exist: its error would come first if it were read first); gsm8k, text only, still loads."""
    pytest.importorskip("skyrl_gym")
    from gspo.envs.load import env_spec, make_env, reset, step
    from gspo.tasks.datasets import Example

    decoy = tmp_path / "decoy.txt"
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    turn = f"<tool><python>open({str(decoy)!r}, 'w').write('pwned')</python></tool>"
    try:  # what the model's turn would do through the adapter
        spec = env_spec("skyrl-gym:searchcode", lambda *a: [0.0], 30.0, "error")
        env = make_env(spec)
        reset(spec, env, Example("what is 2+2?", "4"))
        step(spec, env, turn)
        err = ""
    except GspoError as e:
        err = str(e)
    assert not decoy.exists()
    assert "skyrl-gym:searchcode is refused" in err and "\n" not in err
    out = ["--output-dir", str(tmp_path / "runs"), "--model", str(tmp_path / "no-model")]
    for name in ("searchcode", "lcb", "text2sql", "search"):
        one_line(capsys, ["train", *FAST, *out, "--env", f"skyrl-gym:{name}"], f"skyrl-gym:{name} is refused")
    env_spec("skyrl-gym:gsm8k", lambda *a: [0.0], 30.0, "error")  # allowed: scores text alone


def test_a_skyrl_gym_environment_registered_under_another_name_is_still_refused():
    """The allowlist is of entry points, not names: lcb's code under a new id is lcb."""
    gym = pytest.importorskip("skyrl_gym")
    gym.register(id="gspo_test_renamed_lcb", entry_point="skyrl_gym.envs.lcb.env:LCBEnv")
    try:
        from gspo.envs.load import env_spec

        with pytest.raises(GspoError, match="skyrl-gym:gspo_test_renamed_lcb is refused"):
            env_spec("skyrl-gym:gspo_test_renamed_lcb", lambda *a: [0.0], 30.0, "error")
    finally:
        gym.envs.registration.deregister("gspo_test_renamed_lcb")


# ------------------------------------------------------------------------------------------------
# issue 44: a verifiers environment module raising SystemExit at import; issue 49 item 9: an
# environment module whose import never returns


def test_a_verifiers_module_that_exits_at_import_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("verifiers.v1")
    _write(tmp_path, "gspo_vf_exits4.py", "raise SystemExit(4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    one_line(
        capsys,
        ["train", *FAST, "--output-dir", str(tmp_path / "runs"), "--env", "verifiers:gspo_vf_exits4"],
        "config field 'env': verifiers:gspo_vf_exits4: loading the verifiers environment failed: SystemExit: 4",
    )


def test_an_environment_module_whose_import_hangs_is_bounded_by_the_reward_time_limit(tmp_path):
    f = _write(tmp_path, "envs.py", "import time\ntime.sleep(3600)\nclass T:\n    pass\n")
    t0 = time.time()
    p = gspo("train", *FAST, "--output-dir", str(tmp_path / "runs"), "--env", f"{f}:T", "--reward-timeout-s", "1",
             timeout=120)  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip() == (
        f"gspo: error: config field 'env': loading '{f}:T' (importing its module) did not finish within 1 s "
        "(reward_timeout_s)"
    )
    assert time.time() - t0 < 100


# ------------------------------------------------------------------------------------------------
# issue 49 item 6: one line after an error, nothing more


def test_a_float16_run_that_fails_prints_exactly_one_line(tmp_path, monkeypatch):
    """float16 weights overflow at step 0 and the new run folder is removed: TensorBoard's writer
    thread, writing the step's scalars into it, printed a traceback after the error. A race, so also
    checked where it is sure to show: 20 run folders removed right after their first row (half of
    them lost it before the fix)."""
    import shutil
    import threading

    from gspo.training.logger import MetricsLogger

    p = gspo("train", *TINY, "--dtype", "float16", "--output-dir", str(tmp_path / "runs"), timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gspo: error: weights are not finite"), p.stderr[-3000:]
    died = []
    monkeypatch.setattr(threading, "excepthook", lambda a: died.append(a.exc_value))
    for i in range(20):
        run = tmp_path / "race" / str(i)
        run.mkdir(parents=True)
        MetricsLogger(run).log(0, {"rollout/reward_mean": 0.5, "loss/total": 1.0})
        shutil.rmtree(run)
    time.sleep(1.0)  # what is still queued is written (or fails) by now
    assert died == []


@pytest.mark.slow  # the slow tier (multi-process, ~30-60 s here): CI runs it
def test_torchrun_prints_no_banner_around_a_ranks_one_line_error(tmp_path):
    """Without OMP_NUM_THREADS in the environment torchrun set it and printed a banner of stars
    before the rank's error line; gspo now sets it to torchrun's own value."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), env.get("PYTHONPATH", "")])
    args = ["--nproc", "2", "--output-dir", str(tmp_path / "runs"), "--model", str(tmp_path / "no-model")]
    p = subprocess.run(
        [sys.executable, "-m", "gspo", "train", *FAST, *args],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gspo: error:"), p.stderr[-3000:]


# ------------------------------------------------------------------------------------------------
# issue 49 item 7: options that were ignored, or nonsense that was accepted, refused in one line


def test_ignored_prompt_and_warm_start_options_are_refused(tmp_path, capsys):
    out = ["--output-dir", str(tmp_path / "runs")]
    cases = [
        (["--chat-template"], "config field 'chat_template': the embedded tokenizer has no chat template"),
        (
            ["--system-prompt", "Be brief."],
            "config field 'system_prompt': the embedded tokenizer has no chat",
        ),
        (
            ["--system-prompt", "Be brief.", "--tokenizer", str(tmp_path / "tok")],
            "config field 'system_prompt': is used only with chat_template: true (task reverse's prompts",
        ),
        (
            ["--env", "tools", "--sft-tool-fraction", "0.5"],
            "config field 'sft_tool_fraction': below 1 needs a task with tool-using demonstrations (add_long)",
        ),
    ]
    for extra, want in cases:
        one_line(capsys, ["train", *FAST, *out, *extra], want)


ROLE_ENV = """
class Env:
    def reset(self, ex):
        return [{"role": "martian", "content": ex.prompt}]

    def step(self, turn):
        return None, 0.0
"""

TOOL_ENV = """
class Env:
    chat_tools = [{"type": "function", "function": {"name": "5", "description": "d", "parameters": {}}}]

    def reset(self, ex):
        return ex.prompt

    def step(self, turn):
        return None, 0.0
"""


def test_a_message_role_or_a_tool_name_that_is_no_name_is_refused(tmp_path, capsys):
    """Under a chat template (tiny Qwen3, the Qwen2.5 tool template, which renders any role) a
    'martian' message and a tool named '5' were rendered and trained on."""
    from test_chat_tools import make_tokenizer, tiny_qwen

    from gspo.envs.base import Step, check_step

    tok = make_tokenizer()
    tiny_qwen(tok, max_position_embeddings=1024).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    capsys.readouterr()  # (transformers' own bar while saving)
    chat = ["--model", str(tmp_path / "m"), "--chat-template", "--task", "add", "--max-prompt-tokens", "600"]
    out = ["--output-dir", str(tmp_path / "runs")]
    f = _write(tmp_path, "roles.py", ROLE_ENV)
    one_line(
        capsys, ["train", *FAST, *out, *chat, "--env", f"{f}:Env", "--name", "roles"],
        f"environment {f}:Env: reset() message 0 has role 'martian', not a chat role (system, developer, user",
    )  # fmt: skip
    with pytest.raises(GspoError, match="step\\(\\) message 0 has role 'martian'"):
        check_step(Step("hi", 0.0, [{"role": "martian", "content": "hi"}]), "e")
    g = _write(tmp_path, "tools5.py", TOOL_ENV)
    one_line(
        capsys, ["train", *FAST, *out, *chat, "--env", f"{g}:Env", "--name", "t5"],
        f"environment {g}:Env: chat_tools[0]: function name '5' is not a name the model can call",
    )  # fmt: skip


def test_export_of_a_path_too_long_to_look_at_is_one_line(tmp_path, capsys):
    """A file name over the system's 255 bytes made ``gspo export`` a traceback (OSError from stat)."""
    long = str(tmp_path / ("c" * 300))
    one_line(capsys, ["export", long, "--out", str(tmp_path / "o")], "File name too long")


def test_a_chat_template_or_system_prompt_on_a_tokenizer_without_a_template_is_refused(tiny_moe):
    """Any tokenizer without a chat template (the config check knows only the embedded one): asking for
    the template or a system prompt is one line naming the field, never silently plain text."""
    from gspo.plans import PromptPlan
    from gspo.tasks.datasets import Example
    from gspo.tasks.prompts import encode_prompts

    _, tok = tiny_moe
    assert not getattr(tok, "chat_template", None)
    ex = [Example("123", "321")]
    assert encode_prompts(tok, ex, PromptPlan(False, None, 64))  # plain text: fine
    for plan, field in [
        (PromptPlan(True, None, 64), "chat_template"),
        (PromptPlan(False, "Be brief.", 64), "system_prompt"),
    ]:
        with pytest.raises(GspoError, match=f"config field '{field}': the tokenizer has no chat template"):
            encode_prompts(tok, ex, plan)
