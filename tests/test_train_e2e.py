"""End-to-end: `gspo train` on tiny settings writes every artifact; resume after kill -9 is exact."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import kill_9_after_checkpoint, one_line

TINY = [
    "--steps",
    "4",
    "--sft-steps",
    "5",
    "--eval-size",
    "16",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
    "--max-new-tokens",
    "10",
    "--eval-every",
    "2",
    "--threads",
    "1",
    "--no-progress",
]


NOISY = f"{Path(__file__).parent / 'fixture_rewards.py'}:noisy"  # every step moves the weights
PARITY = f"{Path(__file__).parent / 'fixture_rewards.py'}:length_parity"  # partial accuracy untrained


def _gspo(*args, **kw):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "gspo", *args], capture_output=True, text=True, env=env, timeout=300, **kw
    )


@pytest.mark.parametrize("algo", ["gspo", "grpo"])
def test_train_writes_all_artifacts(tmp_path, algo):
    """A short run writes metrics.jsonl, TensorBoard events, a PNG and a from_pretrained-able model."""
    extra = ["--routing-replay"] if algo == "grpo" else []
    r = _gspo("train", *TINY, "--algo", algo, "--output-dir", str(tmp_path), "--name", "r", *extra)
    assert r.returncode == 0, r.stderr[-2000:]
    run = tmp_path / "r"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    for key in [
        "rollout/reward_mean",
        "loss/clip_frac_tok",
        "loss/clip_frac_seq",
        "loss/ratio_mean",
        "loss/approx_kl",
        "rollout/entropy",
        "rollout/response_len",
        "time/step_s",
        "moe/volatility",
        "mismatch/token_abs_logp_diff",
    ]:
        assert key in rows[1], key
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[4]
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").iterdir())
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tok = AutoTokenizer.from_pretrained(run / "final")
    assert tok.decode(tok("rev:12=").input_ids) == "rev:12="
    assert model.config.model_type == "qwen3_moe"
    assert "held-out accuracy:" in r.stdout


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    """Starting a run whose folder has checkpoints fails with one line instead of destroying work (both
    starts in-process: the command's code path without an interpreter start)."""
    from gspo.cli import main

    args = ["train", *TINY, "--steps", "1", "--output-dir", str(tmp_path), "--name", "r"]
    assert main(args) == 0
    capsys.readouterr()  # the first run's own output
    kept = (tmp_path / "r" / "metrics.jsonl").read_text()
    one_line(capsys, args, "already holds checkpoints; pass --resume")
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == kept


def _final_params(run: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(run / "final").state_dict()


def test_resume_after_kill_9_is_exact(tmp_path):
    """kill -9 mid-run, then --resume, gives bit-identical final parameters to an uninterrupted run, at
    settings where every step after the kill point moves the weights (rewards with noise from every
    global generator, so each piece of state exact resume needs is exercised: tests/test_resume_state.py
    takes them one by one)."""
    args = [*TINY, "--steps", "6", "--save-every", "1", "--reward", NOISY, "--output-dir", str(tmp_path)]
    assert _gspo("train", *args, "--name", "full").returncode == 0
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gspo", "train", *args, "--name", "killed"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    kill_9_after_checkpoint(proc, tmp_path / "killed", 3, timeout=240)
    latest = tmp_path / "killed" / "checkpoints" / "latest"
    resumed_from = latest.read_text().strip()
    kill_step = int(resumed_from.split("-")[1])
    assert kill_step < 6, resumed_from
    from transformers import AutoModelForCausalLM

    at_kill = AutoModelForCausalLM.from_pretrained(latest.parent / resumed_from).state_dict()
    r = _gspo("train", *args, "--name", "killed", "--resume")
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = _final_params(tmp_path / "full"), _final_params(tmp_path / "killed")
    assert a.keys() == b.keys() == at_kill.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(not torch.equal(b[k], at_kill[k]) for k in b), "the weights did not move after the kill"
    rows = [json.loads(x) for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(7))
    assert all(row["loss/grad_norm"] > 0 for row in rows[kill_step + 1 :]), rows


def test_reward_error_saves_progress_and_names_the_function(tmp_path):
    """A reward that raises mid-run stops with one line naming it; finished steps are checkpointed."""
    reward = tmp_path / "flaky.py"
    reward.write_text(
        "calls = 0\n"
        "def reward(prompts, completions, answers):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls == 3:  # 1: eval at step 0, 2: rollout of step 1, 3: rollout of step 2\n"
        "        raise ValueError('boom')\n"
        "    return [float(c == a) for c, a in zip(completions, answers)]\n"
    )
    r = _gspo("train", *TINY, "--output-dir", str(tmp_path), "--name", "r", "--reward", f"{reward}:reward")
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()[-1]
    assert "raised ValueError: boom" in err and "progress is saved at step 1" in err
    assert "Traceback" not in r.stderr
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text().strip() == "step-000001"


@pytest.mark.slow  # the slow tier (an end-to-end run of ~20 s here): CI runs it
def test_lora_run_merges_adapters_and_resumes_exactly(tmp_path):
    """LoRA: final/ is a merged from_pretrained model, adapters kept; a resumed run equals a straight one."""
    pytest.importorskip("peft")
    # a format reward gives mixed rewards even for an untrained model, so the adapters really move
    args = [
        *TINY,
        "--lora-rank",
        "4",
        "--lr",
        "1e-2",
        "--reward",
        "format:[0-9]+",
        "--output-dir",
        str(tmp_path),
    ]
    assert _gspo("train", *args, "--name", "straight").returncode == 0
    assert _gspo("train", *args, "--steps", "2", "--name", "split").returncode == 0
    r = _gspo("train", *args, "--name", "split", "--resume")
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = _final_params(tmp_path / "straight"), _final_params(tmp_path / "split")
    assert not any("lora" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (tmp_path / "straight" / "final" / "adapter" / "adapter_config.json").exists()
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        tmp_path / "straight" / "checkpoints" / "lora-base"
    ).state_dict()
    assert any(not torch.equal(a[k], base[k]) for k in a)  # the adapters changed the merged weights


def test_eval_command_scores_a_checkpoint(tmp_path, capsys):
    """`gspo eval` loads a saved folder with from_pretrained and prints held-out accuracy as JSON: the
    accuracy the run itself measured on the same held-out prompts at its last step (partial, so an
    evaluator that scores everything 0 or 1 fails)."""
    args = [*TINY, "--steps", "1", "--reward", PARITY, "--output-dir", str(tmp_path), "--name", "r"]
    assert _gspo("train", *args).returncode == 0
    logged = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[-1])["eval/accuracy"]
    assert 0 < logged < 1, logged
    r = _gspo("eval", str(tmp_path / "r" / "final"), "--eval-size", "16")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["n"] == 16 and out["eval/accuracy"] == logged
    one_line(capsys, ["eval", str(tmp_path / "nope")], "checkpoint folder not found")
