"""Hostile-user cases through the real command: signals, kill -9, resume changes, bad input.

Each bad input gets one line naming the problem and exit code 2, never a traceback; a signal saves
the last finished step; no process outlives the launcher.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import TINY, one_line
from cli_helpers import gspo as _gspo
from cli_helpers import popen as _popen


def _steps_logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return -1
    return max((json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()), default=-1)


def _wait_for_step(proc, run: Path, step: int, limit: float = 120) -> None:
    t0 = time.time()
    while _steps_logged(run) < step:
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < limit, "run did not reach the step in time"
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_the_finished_step_and_resume_continues(tmp_path, sig):
    """SIGTERM (job schedulers) and Ctrl-C finish the step in flight, checkpoint it and say how to
    resume; the resumed run (in-process: the signal is the real process's) continues from exactly
    that step."""
    run = tmp_path / "r"
    proc = _popen(
        "train", *TINY, "--steps", "1000", "--save-every", "0", "--output-dir", str(tmp_path), "--name", "r"
    )
    _wait_for_step(proc, run, 2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    last = _steps_logged(run)
    assert f"progress is saved at step {last}; continue with --resume" in err
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{last:06d}"
    from gspo.cli import main

    args = ["train", *TINY, "--steps", str(last + 1), "--output-dir", str(tmp_path), "--name", "r"]
    assert main([*args, "--resume"]) == 0
    assert _steps_logged(run) == last + 1


def test_signal_during_warm_start_says_nothing_was_saved(tmp_path):
    proc = _popen("train", *TINY[2:], "--sft-steps", "100000", "--steps", "2", "--output-dir", str(tmp_path))
    t0 = time.time()  # config.yaml is written after the handlers are installed, before the warm start
    while not (tmp_path / "gspo-reverse-s0" / "config.yaml").exists():
        assert proc.poll() is None and time.time() - t0 < 120
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "stopped during the warm start" in err and "run the same command again" in err
    assert "Traceback" not in err


def _alive_with(marker: str) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if marker in cmd and int(p.name) != os.getpid():
                pids.append(int(p.name))
    return pids


@pytest.mark.slow  # the slow tier (an end-to-end run of ~20 s here): CI runs it
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_kill_9_of_the_launcher_takes_torchrun_and_ranks_down(tmp_path):
    marker = str(tmp_path / "out")
    proc = _popen("train", "--nproc", "2", *TINY, "--steps", "1000", "--output-dir", marker)
    _wait_for_step(proc, Path(marker) / "gspo-reverse-s0", 1, limit=240)
    assert len(_alive_with(marker)) >= 3  # launcher, torchrun, 2 ranks
    proc.kill()
    proc.communicate()
    t0 = time.time()
    while _alive_with(marker) and time.time() - t0 < 90:
        time.sleep(0.5)
    left = _alive_with(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "processes outlived the launcher"


def test_resume_refuses_a_changed_setting_and_keeps_the_record(tmp_path, capsys):
    r = _gspo("train", *TINY, "--steps", "1", "--output-dir", str(tmp_path), "--name", "r")
    assert r.returncode == 0, r.stderr[-2000:]
    record = (tmp_path / "r" / "config.yaml").read_text()
    for flag in (["--lr", "1e-5"], ["--group-size", "8"]):  # refused in-process: no interpreter start
        args = [
            "train",
            *TINY,
            "--steps",
            "2",
            "--output-dir",
            str(tmp_path),
            "--name",
            "r",
            "--resume",
            *flag,
        ]
        field = flag[0][2:].replace("-", "_")
        line = one_line(capsys, args, f"--resume: config field '{field}' differs")
        assert line.startswith("gspo: error: --resume:")
        assert (tmp_path / "r" / "config.yaml").read_text() == record


def _corrupt_model(tmp_path: Path) -> str:
    from gspo.model.load import load_model_and_tokenizer, save_pretrained

    model, tok = load_model_and_tokenizer("embedded:tiny-dense")
    folder = tmp_path / "broken"
    save_pretrained(model, tok, folder)
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    return str(folder)


# bad values the config or the loader refuses: one line, exit 2, through ``gspo.cli.main`` in this
# process (one test, no interpreter start per case); the cases that go through the launcher, and the
# command as a user starts it, run as subprocesses below
BAD = {
    "device": (["--device", "cuda"], "config field 'device'"),
    "lr-inf": (["--lr", "inf"], "config field 'lr': must be a finite number"),
    "sft-lr-nan": (["--sft-lr", "nan"], "config field 'sft_lr'"),
    "beta": (["--adam-beta1", "1.5"], "config field 'adam_beta1'"),
    "wd": (["--weight-decay", "-1"], "config field 'weight_decay'"),
    "group-1": (["--group-size", "1"], "config field 'group_size'"),
    "missing-folder": (["--model", "./no/such/model"], "model folder not found"),
    "replay-dense": (["--model", "embedded:tiny-dense", "--routing-replay"], "config field 'routing_replay'"),
    "output-under-file": (["--output-dir", "{decoy}/x"], "config field 'output_dir'"),
}
BAD_LAUNCHED = {
    "nproc-missing-folder": (["--nproc", "2", "--model", "./no/such/model"], "model folder not found"),
    "nproc-divisible": (["--nproc", "2", "--prompts-per-step", "3"], "config field"),
}


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ./no/such/model: relative to a folder of the test's own
    decoy = tmp_path / "decoy"
    decoy.write_text("a file, not a folder\n")
    for case, (args, want) in BAD.items():
        args = [a.replace("{decoy}", str(decoy)) for a in args]
        line = one_line(
            capsys, ["train", *TINY, "--steps", "1", "--output-dir", str(tmp_path / "o"), *args], want
        )
        assert line.startswith("gspo: error:"), (case, line)
    assert decoy.read_text() == "a file, not a folder\n"


@pytest.mark.parametrize("case", [*BAD_LAUNCHED, "corrupt-weights"])
def test_bad_input_through_the_command_is_one_line_and_exit_2(tmp_path, case):
    args, want = (
        BAD_LAUNCHED[case] if case in BAD_LAUNCHED else (["--model", _corrupt_model(tmp_path)], "cannot load")
    )
    r = _gspo("train", *TINY, "--steps", "1", "--output-dir", str(tmp_path / "o"), *args)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("gspo: error:") and want in lines[0], r.stderr[-3000:]


@pytest.mark.slow  # the slow tier (multi-process, ~30-60 s here): CI runs it
def test_eval_reads_the_runs_own_task_settings_and_flags_override(tmp_path, capsys):
    """(The commands in-process: their code paths without an interpreter start each.)"""
    from gspo.cli import main

    assert (
        main(["train", *TINY, "--steps", "1", "--task", "sort", "--output-dir", str(tmp_path), "--name", "r"])
        == 0
    )
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "r" / "final")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["task"] == "sort" and out["n"] == 8 and out["settings"].endswith("r/config.yaml")
    assert main(["eval", str(tmp_path / "r" / "final"), "--eval-size", "4", "--task", "add"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["task"] == "add" and out["n"] == 4


def test_prompts_the_tokenizer_cannot_read_warn_or_refuse(capsys):
    from gspo.config import Config
    from gspo.errors import GspoError
    from gspo.model.load import build_char_tokenizer
    from gspo.resolve import prompt_plan
    from gspo.tasks.datasets import Example
    from gspo.tasks.prompts import encode_prompts

    tok = build_char_tokenizer()
    plan = prompt_plan(Config())
    encode_prompts(tok, [Example("rev:12=", "21"), Example("rev:\u00c4\u00d6=", "x")], plan)
    assert (
        "gspo: warning: 1 of 2 prompts hold characters the tokenizer maps to its unknown"
        in capsys.readouterr().err
    )
    with pytest.raises(GspoError, match="only unknown tokens"):
        encode_prompts(tok, [Example("\u00c4\u00d6", "x")], plan)
