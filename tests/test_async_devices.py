"""Rollouts on their own devices (``--rollout-devices``, issue 34 item 3): the async sampler takes each
version over a process group it joins with trainer rank 0 (gloo here, processes on the CPU), one
tensor at a time, and trains exactly as the shared-memory async run does (one process and 2 FSDP2
ranks); a trainer killed with -9
resumes exactly; a sampler killed mid-transfer stops the run in one line keeping the last finished
step; bad devices are refused in one line before any weight is read; ``gspo plan`` prints the
sampler side and the trainer side. NCCL on GPUs is not tested here."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import one_line
from safetensors.torch import load_file

from gspo import Config, train
from gspo.errors import GspoError
from gspo.resolve import capacity_plan

pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")

ROOT = Path(__file__).resolve().parents[1]
REWARD = f"{ROOT / 'tests' / 'fixture_rewards.py'}:length_parity"  # a gradient at every step
CFG = dict(
    steps=4, sft_steps=10, eval_size=8, prompts_per_step=8, group_size=4, max_new_tokens=8, eval_every=0,
    save_every=2, threads=1, progress=False, async_staleness=1, reward=REWARD, lr=3e-3,
)  # fmt: skip


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def pg_run(tmp_path_factory):
    """The process-group async run (all the slow tier's kill -9 test needs)."""
    tmp = tmp_path_factory.mktemp("async-devices")
    pg = train(Config(name="pg", output_dir=str(tmp), rollout_devices="cpu", **CFG))
    return tmp, pg.run_dir


@pytest.fixture(scope="module")
def runs(pg_run):
    """The shared-memory async run and the process-group one, same config."""
    tmp, pg = pg_run
    shm = train(Config(name="shm", output_dir=str(tmp), **CFG))
    return tmp, shm.run_dir, pg


def test_the_process_group_gives_the_shared_memory_batches_and_update(runs):
    """Same batches (rewards, lengths, staleness per step) and the same update, bit for bit."""
    _, shm, pg = runs
    a, b = _rows(shm), _rows(pg)
    assert [r["async/staleness"] for r in b] == [0, 1, 1, 1]
    for key in ("rollout/reward_mean", "rollout/response_len", "loss/grad_norm", "loss/ratio_max"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert min(r["loss/grad_norm"] for r in b) > 0  # every step moved the weights
    _same_weights(shm, pg)


def _cli(tmp: Path, *extra: str, name: str = "killed", devices: str | None = "cpu") -> subprocess.Popen:
    """``gspo train`` with CFG (``devices``: --rollout-devices, None: shared memory)."""
    args = [sys.executable, "-m", "gspo", "train", "--output-dir", str(tmp), "--name", name]
    for k, v in CFG.items():
        flag = "--" + k.replace("_", "-")
        args += [flag if v is not False else "--no-" + k.replace("_", "-")] + ([] if v is False else [str(v)])
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(
        [*args, *(["--rollout-devices", devices] if devices else []), *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow  # the slow tier (multi-process, ~25 s here): CI runs it
def test_a_trainer_killed_with_minus_9_resumes_exactly(pg_run):
    """kill -9 of the trainer once step 2 is saved (batch 3 in flight), then --resume: the same final
    weights as the uninterrupted run."""
    tmp, pg = pg_run
    proc = _cli(tmp)
    latest, t0 = tmp / "killed" / "checkpoints" / "latest", time.time()
    while not (latest.exists() and latest.read_text().strip() == "step-000002"):
        assert proc.poll() is None and time.time() - t0 < 600, proc.stderr.read().decode()[-3000:]
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp / "killed" / "final").exists()
    again = _cli(tmp, "--resume")
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err.decode()[-3000:]
    _same_weights(pg, tmp / "killed")


@pytest.mark.slow  # the slow tier (multi-process, ~30-60 s here): CI runs it
def test_two_ranks_over_the_process_group_equal_their_shared_memory_run(tmp_path):
    """2 gloo ranks (FSDP2): every rank gathers each tensor in turn, rank 0 broadcasts it to the
    sampler; the run ends on the shared-memory 2-rank run's weights, bit for bit."""
    procs = [_cli(tmp_path, "--nproc", "2", name=f"ranks-{d}", devices=d) for d in ("cpu", None)]
    for p in procs:
        _, err = p.communicate(timeout=900)
        assert p.returncode == 0, err.decode()[-3000:]
    _same_weights(tmp_path / "ranks-None", tmp_path / "ranks-cpu")


def test_a_sampler_killed_mid_transfer_stops_in_one_line_and_resumes_exactly(runs, monkeypatch):
    """The sampler process killed after 2 tensors of version 3 crossed: the run stops at once with
    one line naming the transfer and the last checkpoint (step 2), which --resume continues to the
    uninterrupted run's weights."""
    from gspo.rollout.async_sampler import AsyncSampler
    from gspo.rollout.weight_transfer import WeightSender

    tmp, _, pg = runs
    at = {"version": -1, "sent": 0}
    transfer, send_one = AsyncSampler._transfer, WeightSender.send_one

    def watched_transfer(self, version, stream):
        at["version"], at["sent"] = version, 0
        return transfer(self, version, stream)

    def killing_send_one(self, t, alive):
        if at["version"] == 3 and at["sent"] == 2:
            for p in multiprocessing.active_children():  # the sampler process
                os.kill(p.pid, signal.SIGKILL)
        at["sent"] += 1
        return send_one(self, t, alive)

    with monkeypatch.context() as mp:
        mp.setattr(AsyncSampler, "_transfer", watched_transfer)
        mp.setattr(WeightSender, "send_one", killing_send_one)
        t0 = time.time()
        with pytest.raises(GspoError) as e:
            train(Config(name="cut", output_dir=str(tmp), rollout_devices="cpu", **CFG))
    msg = str(e.value)
    assert time.time() - t0 < 300 and "\n" not in msg, msg
    assert "the async sampler process died during the weight transfer" in msg, msg
    assert "the last checkpoint is step 2" in msg, msg
    assert (tmp / "cut" / "checkpoints" / "latest").read_text().strip() == "step-000002"
    train(Config(name="cut", output_dir=str(tmp), rollout_devices="cpu", resume=True, **CFG))
    _same_weights(pg, tmp / "cut")


@pytest.mark.parametrize(
    "extra, says",
    [
        (dict(rollout_devices="cpu"), "needs async_staleness > 0"),
        (dict(async_staleness=1, rollout_devices="gpu1"), "each device is 'cpu' or 'cuda:N'"),
        (dict(async_staleness=1, rollout_devices="cuda:6,cuda:7"), "takes one device"),
        (dict(async_staleness=1, nproc=2, rollout_devices="cuda:1"), "cuda:1 is also a trainer device"),
        (
            dict(async_staleness=1, device="cuda:3", rollout_devices="cuda:3"),
            "cuda:3 is also a trainer device",
        ),
        (dict(async_staleness=1, device="cpu", rollout_devices="cuda:1"), "needs the trainer on a GPU"),
    ],
)
def test_bad_rollout_devices_are_refused_in_one_line(extra, says):
    with pytest.raises(GspoError, match=r"config field 'rollout_devices': ") as e:
        Config(**extra).validate()
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU that does not exist: this machine has none")
def test_a_missing_gpu_is_refused_before_any_weight_is_read(tmp_path, capsys):
    """``gspo train`` (in-process: the command's code path without an interpreter start): exit 2 with
    one line, before the model loads or the run folder holds a run."""
    args = ["train", "--async-staleness", "1", "--rollout-devices", "cuda:1", "--output-dir", str(tmp_path)]
    one_line(
        capsys, [*args, "--no-progress"], "config field 'rollout_devices': cuda:1 does not exist (0 GPUs)"
    )
    assert not any(tmp_path.rglob("*.safetensors"))


def test_plan_prints_the_sampler_side_and_the_trainer_side():
    """``gspo plan``: the sampler's GPU (its model, K+1 received versions, its engine) apart from the
    trainers' (no sampler there: one tensor crosses at a time), and the bytes rank 0 sends it per
    version (every parameter once, in the sampler's dtype)."""
    from gspo.capacity import estimate, report, shape_of
    from gspo.capacity_comm import comm_report, link_of

    kw = dict(model="Qwen/Qwen3-8B", dtype="bfloat16", prompts_per_step=32, nproc=4, async_staleness=2)
    cfg = Config(rollout_devices="cuda:7", **kw).validate()
    shape, gpu = shape_of(cfg.model), 139 * 2**30
    text, _ = report(capacity_plan(cfg), cfg.model, 4, gpu, shape=shape)
    assert "sampler side (cuda:7" in text and "trainer side" in text
    n = shape.params()
    assert f"received versions       {3 * n * 2 / 2**30:8.1f} GiB" in text  # K+1 = 3 bf16 copies
    beside = estimate(capacity_plan(Config(**kw).validate()), shape, 4, gpu)
    apart = estimate(capacity_plan(cfg), shape, 4, gpu)
    assert (
        apart.sampler == 0 and apart.rollout_peak < beside.rollout_peak
    )  # the trainers' GPUs hold no sampler
    comm = "\n".join(comm_report(capacity_plan(cfg), shape, link_of(1, None, 4, 3600, 400), gpu))
    assert f"{'to the sampler':<24}{n * 2 / 1e9:10.2f} GB" in comm
