"""Issue 57, "the sweep's problems": each input of the hostile sweep, through the command or
``gspo.train(gspo.Config(...))``, now ends in one line naming its cause (or is accepted):

- two ``gspo.train`` calls at once in two threads: the second refused (one run per process);
- a diverged run (VESPO's kernel at 3e38: NaN losses, some updates skipped each step) stops in one
  line, non-zero, without ``final/`` and keeping its checkpoints; ``--lr 1e10`` refused up front;
- a tracker package whose import calls ``sys.exit(3)``: one line naming the tracker;
- a script without an ``if __name__ == "__main__":`` guard under ``async_staleness=1``: one line
  naming the guard, no second training in the sampler's process;
- ``gspo compare`` does not reuse a ``final/model.safetensors`` cut to 1,000 bytes;
- misleading lines: a file-size limit, ``gspo eval`` of a run folder or a folder without a model,
  ``train(None)``, ``Config(output_dir=Path)``, ``--report-to ''``, ``gspo plan``'s launch line.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_helpers import TINY, env, one_line

import gspo as gspo_api
from gspo.cli import main
from gspo.errors import GspoError

LENGTH_REWARD = "def length(prompts, completions, answers):\n    return [len(c) / 10 for c in completions]\n"


def _reward(tmp_path: Path, text: str = LENGTH_REWARD, name: str = "length") -> str:
    path = tmp_path / "reward_fn.py"
    path.write_text(text)
    return f"{path}:{name}"


# ------------------------------------------------------------------------------------------------
# one run per process


GATED = """import time
from pathlib import Path

HERE = Path(__file__).parent


def gated(prompts, completions, answers):
    # the first call says it is inside the run, then waits for the test to let it go on
    (HERE / "inside").touch()
    for _ in range(6000):
        if (HERE / "go").exists():
            break
        time.sleep(0.01)
    return [len(c) / 10 for c in completions]
"""


def test_a_second_train_in_another_thread_is_refused_and_the_first_finishes(tmp_path):
    """Two ``gspo.train`` calls at once (a second thread while the first is inside its step-0
    evaluation): the second is refused in one line, the first finishes as if alone. A ``Path`` as
    ``output_dir`` is taken as the string it spells."""
    small = dict(
        steps=1, sft_steps=0, prompts_per_step=2, group_size=2, eval_size=2, max_new_tokens=4,
        eval_every=0, threads=1, progress=False, report_to="none", output_dir=tmp_path / "runs",
    )  # fmt: skip
    cfg = gspo_api.Config(name="a", reward=_reward(tmp_path, GATED, "gated"), **small)
    assert cfg.output_dir == str(tmp_path / "runs")
    result: dict = {}
    first = threading.Thread(target=lambda: result.update(r=gspo_api.train(cfg)))
    first.start()
    for _ in range(6000):
        if (tmp_path / "inside").exists() or not first.is_alive():
            break
        time.sleep(0.01)
    assert (tmp_path / "inside").exists()
    with pytest.raises(GspoError) as e:
        gspo_api.train(gspo_api.Config(name="b", **small))
    assert str(e.value).startswith("gspo.train is already running in this process (another thread)")
    (tmp_path / "go").touch()
    first.join(timeout=600)
    assert not first.is_alive() and result["r"].final_dir == tmp_path / "runs" / "a" / "final"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["a"]  # b never started


def test_train_takes_a_config_and_names_it(tmp_path):
    for bad in (None, {"steps": 1}):
        with pytest.raises(TypeError, match=r"^gspo.train takes a gspo.Config, got (NoneType|dict) "):
            gspo_api.train(bad)


# ------------------------------------------------------------------------------------------------
# a diverged run is never "done"

VESPO_AT_3E38 = ["--algo", "vespo", "--vespo-k-pos", "3e38", "--vespo-lambda-pos", "1"]
VESPO_AT_3E38 += ["--vespo-k-neg", "3e38", "--vespo-lambda-neg", "1"]


def test_a_diverged_run_stops_in_one_line_without_final_keeping_its_checkpoints(tmp_path, capsys):
    """VESPO with its kernel's power at 3e38 on a reward with signal: every step has NaN losses and
    skipped updates (not all of them: the rule that waited for all-skipped steps never stopped it).
    After 3 such steps the run stops: exit 2, one line, no final/, its checkpoints kept. A run of one
    step whose last step is such a step stops too (it never ends "done")."""
    out = tmp_path / "runs"
    args = ["train", *TINY, *VESPO_AT_3E38, "--reward", _reward(tmp_path), "--sft-steps", "2"]
    args += ["--save-every", "1", "--output-dir", str(out)]
    line = one_line(capsys, [*args, "--steps", "5", "--name", "five"], "gspo: error: diverged: steps 1-3 had")
    assert "lower 'lr'" in line and "the newest is step 2" in line, line
    run = out / "five"
    assert not (run / "final").exists()
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-000001", "step-000002"]
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # the step that stopped it is logged
    assert all(r["loss/skipped_updates"] > 0 for r in rows[1:])

    one_line(capsys, [*args, "--steps", "1", "--name", "one"], "gspo: error: diverged: step 1 had")
    assert not (out / "one" / "final").exists() and (out / "one" / "checkpoints" / "step-000000").is_dir()


def test_an_absurd_learning_rate_is_refused_before_anything_runs(tmp_path, capsys):
    one_line(
        capsys,
        ["train", "--lr", "1e10", "--output-dir", str(tmp_path)],
        "config field 'lr': must be in (0, 1]",
    )
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# trackers, the main guard


def test_a_tracker_whose_import_exits_is_one_line_naming_it(tmp_path):
    """A ``trackio`` package (a decoy first on PYTHONPATH) whose import calls ``sys.exit(3)``: one
    line naming the tracker and what its import did, exit 2 (was: exit 3, nothing said)."""
    decoy = tmp_path / "decoy" / "trackio"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("import sys\n\nsys.exit(3)\n")
    res = subprocess.run(
        [sys.executable, "-m", "gspo", "train", "--report-to", "trackio", "--output-dir", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=dict(env(), PYTHONPATH=os.pathsep.join([str(tmp_path / "decoy"), os.environ.get("PYTHONPATH", "")])),
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr == (
        "gspo: error: config field 'report_to': trackio cannot be imported (its import called sys.exit(3); "
        "pip install 'gspo[trackio]') (got 'trackio')\n"
    )
    assert not (tmp_path / "runs").exists()


def test_report_to_empty_is_refused(tmp_path, capsys):
    for value in ("", " , "):
        one_line(
            capsys, ["train", "--report-to", value, "--output-dir", str(tmp_path)], "'report_to': is empty"
        )


NO_GUARD = """import gspo

gspo.train(gspo.Config(
    async_staleness=1, steps=1, sft_steps=0, prompts_per_step=2, group_size=2, eval_size=2, max_new_tokens=4,
    eval_every=0, threads=1, progress=False, report_to="none", output_dir="runs",
))
"""


POOL_JOB = """import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import gspo


def job():
    try:
        gspo.train(gspo.Config(steps=-1))
    except Exception as e:
        return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        print(pool.submit(job).result())
"""


def test_a_guarded_scripts_function_may_train_in_a_spawned_worker(tmp_path):
    """The other side of the main-guard check: a guarded script's own function, run in a spawned
    process pool's worker (its globals are ``__mp_main__``'s too), trains there as anywhere: here it
    gets the config's own refusal, not the guard's."""
    (tmp_path / "pool.py").write_text(POOL_JOB)
    res = subprocess.run(
        [sys.executable, "pool.py"], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env()
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("GspoError: config field 'steps'"), res.stdout + res.stderr[-2000:]


def test_a_script_without_a_main_guard_is_one_line_naming_it_not_a_second_training(tmp_path):
    """The sampler process of ``async_staleness=1`` re-runs the main script; without a guard that
    called gspo.train a second time there (two tracebacks, then a line naming nothing). Now that
    process stops at once, and the trainer's error names the guard: one traceback (the script's own
    uncaught error), whose line says what to do, and one run folder."""
    script = tmp_path / "noguard.py"
    script.write_text(NO_GUARD)
    res = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env()
    )
    assert res.returncode == 1 and res.stderr.count("Traceback") == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"gspo.errors.GspoError: the async sampler process could not start: {script} calls"
    )
    assert 'put the call under `if __name__ == "__main__":`' in last
    assert "gspo: error:" not in res.stderr  # the sampler's process said nothing itself
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["gspo-reverse-s0"]


# ------------------------------------------------------------------------------------------------
# compare, eval, plan, the file-size limit

FAST = ["--seeds", "0", "--variants", "gspo", "--workers", "1", "--sft-steps", "0", "--steps", "1"]
FAST += ["--eval-size", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4"]
FAST += ["--no-progress", "--threads", "1"]


@pytest.mark.slow
def test_compare_does_not_reuse_a_truncated_final_model(tmp_path, capsys):
    """A finished arm whose final/model.safetensors was cut to 1,000 bytes: gspo compare refuses it
    in one line naming the file (was: "done already", reused). (test_compare_folders checks the same
    in the default tier through plan_run, and that --overwrite trains it again.) Both commands
    in-process: their code paths without an interpreter start each."""
    out = tmp_path / "cmp"
    assert main(["compare", *FAST, "--out", str(out)]) == 0
    capsys.readouterr()
    weights = out / "gspo-s0" / "final" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    rc = main(["compare", *FAST, "--out", str(out)])
    again = capsys.readouterr()
    assert rc == 2 and "done already" not in again.out, again.out + again.err[-3000:]
    assert again.err.strip().splitlines() == [
        f"gspo: error: {out / 'gspo-s0'} is a finished run whose final model is damaged (model.safetensors: "
        "1,000 bytes, shorter than its header says); pass --overwrite to train it again (its checkpoints "
        "and metrics are deleted), or another --out"
    ]


def test_a_file_size_limit_is_named_not_torchs_zip_writer(tmp_path):
    """``ulimit -f`` below a checkpoint's size: torch's zip writer says only "enforce fail at
    inline_container.cc ... unexpected pos"; the line names the file-size limit instead."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, resource.RLIM_INFINITY))

    args = [sys.executable, "-m", "gspo", "train", *TINY, "--sft-steps", "0", "--steps", "1"]
    args += ["--output-dir", str(tmp_path), "--name", "r", "--report-to", "none"]
    res = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env(), preexec_fn=limit)
    assert res.returncode == 2, res.stderr[-3000:]
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(
        f"gspo: error: cannot write checkpoint step 1 under {tmp_path / 'r' / 'checkpoints'} ("
    )
    assert (
        "a file reached the file-size limit of 1,000,000 bytes (ulimit -f; raise it: ulimit -f unlimited)"
        in line
    )
    assert "inline_container" not in line and line.endswith("the last complete checkpoint is kept (step 0)")


def test_eval_names_what_is_missing_not_a_config_json(tmp_path, capsys):
    """``gspo eval`` of a run folder points at its final model (or newest checkpoint); of a folder
    holding no model, says it has no config.json (was: transformers' "Unrecognized model ... should
    have a model_type key in its config.json", of a file that does not exist)."""
    run = tmp_path / "runs" / "r"
    (run / "checkpoints" / "step-000004").mkdir(parents=True)
    (run / "config.yaml").write_text("steps: 4\n")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    one_line(
        capsys, ["eval", str(run)], f"{run} is a run folder, not a model folder: it has no final model yet"
    )
    final = run / "final"
    final.mkdir()
    (final / "config.json").write_text("{}")
    (final / "model.safetensors").write_bytes(b"x")
    one_line(capsys, ["eval", str(run)], f"evaluate its final model: gspo eval {final}")
    other = tmp_path / "etc"
    other.mkdir()
    (other / "passwd").write_text("root:x:0:0\n")
    one_line(
        capsys, ["eval", str(other)], f"{other} is not a Hugging Face model folder: it has no config.json"
    )


def test_plan_prints_no_launch_line_for_a_run_that_does_not_fit(capsys):
    rc = main(["plan", "--model", "Qwen/Qwen3-30B-A3B", "--gpus", "1", "--gpu-memory-gb", "40"])
    captured = capsys.readouterr()
    assert rc == 2 and "does not fit in" in captured.err
    assert "launch:" not in captured.out and "gspo train" not in captured.out
    assert main(["plan", "--gpus", "2"]) == 0
    assert "launch: gspo train --nproc 2" in capsys.readouterr().out


def test_config_takes_a_path_as_the_string_it_spells():
    cfg = gspo_api.Config(output_dir=Path("somewhere") / "runs", model=Path("embedded:tiny-moe")).validate()
    assert (cfg.output_dir, cfg.model) == (str(Path("somewhere") / "runs"), "embedded:tiny-moe")
    assert cfg.to_dict()["output_dir"] == "somewhere/runs"  # plain values: config.yaml stays YAML


def test_overwrite_that_cannot_delete_a_trace_is_one_line_and_releases_the_folder(tmp_path, monkeypatch):
    """``--overwrite`` over a run whose ``tensorboard/`` cannot be removed (a mount point: rmdir gives
    EBUSY, played here by the OS error itself) stops in one line naming that folder, not a traceback,
    and leaves the run folder unlocked for the next command."""
    import errno
    import shutil

    from gspo.config import Config
    from gspo.resolve import checkpoint_plan
    from gspo.training import checkpoint_files as ckpt
    from gspo.training.checkpoints import CheckpointManager

    run = tmp_path / "r"
    (run / "tensorboard").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    rmtree = shutil.rmtree

    def busy(path, *a, **kw):
        if Path(path).name == "tensorboard":
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
        rmtree(path, *a, **kw)

    monkeypatch.setattr(ckpt.shutil, "rmtree", busy)

    def claim():
        m = CheckpointManager(checkpoint_plan(Config(output_dir=str(tmp_path), name="r", overwrite=True)))
        try:
            return m.claim()
        finally:
            m.release()

    with pytest.raises(GspoError) as e:
        claim()
    assert str(e.value).startswith(f"--overwrite: cannot delete {run / 'tensorboard'}: ")
    assert "busy" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setattr(ckpt.shutil, "rmtree", rmtree)
    assert claim()[:2] == (None, None) and ckpt.run_traces(run) == []  # the lock was released
