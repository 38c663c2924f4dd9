"""Issue 59 step 4, runs to the same numbers: ``--reproducible`` pins what decides a CPU run's bits
(one thread, ATen's baseline kernels, MKL's COMPATIBLE branch, deterministic algorithms), so two
runs under different CPU capabilities give identical metrics and final weights; every run records
what decided its numbers (environment.json); the mode refuses a process whose kernels already ran."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo.cli import main
from gspo.repro import ENV_FILE, describe, read_environment
from gspo.training.logger import MetricsLogger

# a warm start and two RL steps: every kernel of a run (SFT, sampling, GSPO's update, AdamW)
RUN = [
    "--sft-steps", "12", "--steps", "2", "--eval-size", "8", "--prompts-per-step", "4", "--group-size",
    "4", "--max-new-tokens", "8", "--eval-every", "2", "--save-every", "1000", "--no-progress",
    "--report-to", "none",
]  # fmt: skip
WALL_CLOCK = ("time/", "memory/", "_s", "per_s")  # metrics that measure the machine, not the math


def _numbers(run: Path) -> tuple[list[dict], bytes]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [{k: v for k, v in r.items() if not any(w in k for w in WALL_CLOCK)} for r in rows]
    return rows, (run / "final" / "model.safetensors").read_bytes()


def test_two_cpu_capabilities_give_identical_numbers_in_reproducible_mode(tmp_path):
    """One run as on an older x86 (ATen's baseline kernels, glibc's maths without AVX2 / FMA), one as
    this machine picks (its own ATen ISA, MKL's automatic branch, oneDNN up to AVX2): with
    ``--reproducible`` their metrics and final weights are the same bits, and both record one thread,
    the baseline kernels and MKL's COMPATIBLE branch. (Without the mode each of the ISA, MKL's branch
    and the thread count changes every weight: docs/guides/reproducibility.md.)"""
    own = torch.backends.cpu.get_cpu_capability().lower()
    envs = {
        "old": {"ATEN_CPU_CAPABILITY": "default", "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2,-FMA"},
        "own": {"ATEN_CPU_CAPABILITY": own, "MKL_CBWR": "AUTO", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    }
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gspo",
                "train",
                "--name",
                name,
                "--output-dir",
                str(tmp_path),
                *RUN,
                "--reproducible",
            ],
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for name, env in envs.items()
    }
    for p in procs.values():
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, out[-3000:]
    (m_old, w_old), (m_own, w_own) = _numbers(tmp_path / "old"), _numbers(tmp_path / "own")
    assert len(m_old) == 3 and m_old == m_own
    assert w_old == w_own
    for name in envs:
        env = read_environment(tmp_path / name)
        assert env["reproducible"] is True and env["threads"] == 1 and env["cpu_capability"] == "DEFAULT"
        assert env["deterministic_algorithms"] is True and env["mkl_branch"] in ("COMPATIBLE", None)
        assert env["torch"] == torch.__version__ and env["env"]["MKL_CBWR"] == "COMPATIBLE,STRICT"
    assert "reproducible mode on; torch " in describe({n: read_environment(tmp_path / n) for n in envs})


def test_the_mode_refuses_a_process_whose_kernels_already_ran(tmp_path):
    """gspo.train(reproducible=True) after a torch operation started ATen and MKL with the machine's
    choice: one GspoError naming the variables to set before Python starts, nothing trained (the
    first test's runs are that call in fresh processes)."""
    if os.uname().machine != "x86_64":
        pytest.skip("torch without MKL (not x86-64): its baseline kernels may be the only ones")
    code = (
        "import sys, torch, gspo\n"
        "from gspo.errors import GspoError\n"
        "torch.ones(8).exp().sum()\n"  # ATen (and MKL's threads) start with the machine's choice
        "try:\n"
        f"    gspo.train(gspo.Config(reproducible=True, steps=1, sft_steps=0, output_dir={str(tmp_path)!r}))\n"
        "except GspoError as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr[-2000:]
    line = r.stdout.strip()
    assert "\n" not in line and line.startswith("config field 'reproducible': torch ran CPU kernels before")
    assert "ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE,STRICT" in line
    assert not (tmp_path / "gspo-reverse-s0").exists()


def test_reproducible_with_several_threads_is_one_line(capsys):
    assert main(["train", "--reproducible", "--threads", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "gspo: error: config field 'threads': reproducible runs use one thread (0 or 1) (got 2)"


def test_every_run_records_what_decides_its_numbers(tmp_path):
    """The metrics logger writes environment.json beside metrics.jsonl: versions, threads, the ISA ATen
    runs, MKL's branch, the kernel variables, the CPU; a resume adds an entry from its step (a run
    resumed on another machine shows both), dropping entries of steps the checkpoint lost."""
    for step in (None, 5, 3):
        MetricsLogger(tmp_path, step, config={"reproducible": False, "report_to": "none"}).close()
    entries = json.loads((tmp_path / ENV_FILE).read_text())
    assert [e["from_step"] for e in entries] == [0, 3]
    e = entries[-1]
    assert e["threads"] == torch.get_num_threads() and e["torch"] == torch.__version__
    assert e["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and e["reproducible"] is False
    assert e["python"] == ".".join(map(str, sys.version_info[:3])) and e["cpus"] == os.cpu_count()
    assert set(e["env"]) >= {"ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS"}
    assert e["cpu"]["model"] and isinstance(e["cpu"]["isa_flags"], list)
    assert describe({"a": e, "b": None}).endswith("1 run(s) recorded none.")


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="MKL: x86-64 torch")
def test_mkl_branch_is_read_from_torchs_own_mkl():
    """compat/mkl_cbwr reads the branch MKL runs: COMPATIBLE (3) when MKL_CBWR says so before MKL's
    first call, OFF (1) when unset."""
    code = "from gspo.compat import mkl_cbwr; print(mkl_cbwr.branch())"
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    got = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
        for e in (env, {**env, "MKL_CBWR": "COMPATIBLE,STRICT"})
    ]
    assert [g.stdout.strip() for g in got] == ["1", "3"], [g.stderr[-500:] for g in got]
