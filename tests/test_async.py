"""Asynchronous rollouts (``async_staleness``): staleness as configured, timing-independent results,
and no sampler process outliving the trainer (exact resume with batches in flight:
tests/test_resume_state.py)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from gspo import Config, train

TINY = dict(
    steps=6, sft_steps=60, eval_size=8, prompts_per_step=8, group_size=4, max_new_tokens=10, eval_every=0,
    save_every=3, threads=1, progress=False, async_staleness=2,
)  # fmt: skip


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]


def _record_versions_and_batches(monkeypatch) -> tuple[dict[int, dict], dict[int, object]]:
    """The weights the trainer hands the sampler process as each version, and the batch it gets back
    for each step (the sampler's own log-probs included)."""
    from gspo.rollout.async_sampler import AsyncSampler

    weights, batches = {}, {}
    publish, filled = AsyncSampler._publish, AsyncSampler.filled

    def recording_publish(self, version, **k):
        weights[version] = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        return publish(self, version, **k)

    def recording_filled(self, step):
        out = filled(self, step)
        batches[step] = out[0].batch
        return out

    monkeypatch.setattr(AsyncSampler, "_publish", recording_publish)
    monkeypatch.setattr(AsyncSampler, "filled", recording_filled)
    return weights, batches


def _sampled_by(model, weights: dict[int, dict], batch, tol: float = 1e-4) -> list[int]:
    """The versions whose weights give ``batch``'s responses the sampler's log-probs (to ``tol``: a
    float32 forward at another batch shape moves a log-prob by up to ~1e-5, measured 1.03e-5 on this
    test's step 5; every other version is more than 1 nat away)."""
    from gspo.data import left_pad
    from gspo.model.logprobs import response_logprobs

    p_ids, p_mask = left_pad(batch.prompt_ids, 0)
    m = batch.response_mask_BT.bool()
    found = []
    for v, sd in sorted(weights.items()):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(sd[n])
            lp = response_logprobs(model, p_ids, p_mask, batch.response_ids_BT, batch.response_mask_BT)
        gap = float((lp - batch.sampler_logp_BT)[m].abs().max())
        if gap < tol:
            found.append(v)
    return found


def test_async_run_is_stale_as_configured_and_timing_free(tmp_path, monkeypatch):
    """Step t learns from a batch that version max(t-1-K, 0) sampled (staleness min(t-1, K)): its
    sampler log-probs are that version's and no other's, and two uninterrupted runs agree exactly
    whatever the timing of the two processes. (Exact resume with batches in flight, and that its
    check fails without them: tests/test_resume_state.py.)"""
    import copy

    with monkeypatch.context() as mp:
        weights, batches = _record_versions_and_batches(mp)
        full = train(Config(name="full", output_dir=str(tmp_path), **TINY))
    rows = _rows(full.run_dir)
    assert [r["async/staleness"] for r in rows] == [0, 1, 2, 2, 2, 2]
    K, model = TINY["async_staleness"], copy.deepcopy(full.model)
    assert sorted(batches) == list(range(1, 7)) and set(range(6)) <= set(weights)
    for t, batch in batches.items():  # which weights really sampled each batch
        found, want = _sampled_by(model, weights, batch), max(t - 1 - K, 0)
        assert found == [want], f"step {t}: its batch was sampled by version(s) {found}, not {want}"
    assert all(0 <= r["async/trainer_idle_frac"] <= 1 for r in rows)
    assert max(r["loss/grad_norm"] for r in rows) > 0 and max(r["loss/ratio_max"] for r in rows) > 1
    again = train(Config(name="again", output_dir=str(tmp_path), **TINY))
    for (k, v), w in zip(full.model.state_dict().items(), again.model.state_dict().values(), strict=True):
        torch.testing.assert_close(v, w, atol=0, rtol=0, msg=k)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_sampler_process_dies_with_the_trainer(tmp_path):
    cmd = [sys.executable, "-m", "gspo", "train", "--async-staleness", "1", "--steps", "1000", "--sft-steps", "5",
           "--eval-size", "8", "--prompts-per-step", "4", "--group-size", "4", "--threads", "1", "--no-progress",
           "--output-dir", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    metrics = tmp_path / "gspo-reverse-s0" / "metrics.jsonl"
    t0 = time.time()
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.time() - t0 < 180, proc.stderr.read()
        time.sleep(0.2)
    kids = _children(proc.pid)
    assert kids, "no sampler process"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.time()
    while (
        any(os.path.exists(f"/proc/{k}") and "zombie" not in _state(k) for k in kids)
        and time.time() - t0 < 30
    ):
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{k}") and "zombie" not in _state(k) for k in kids)


SCRIPT = """
import os, sys, tempfile
from gspo import Config, train
if __name__ == "__main__":
    if sys.argv[1:] == ["remove-yourself"]:
        os.remove(__file__)  # the sampler process cannot re-run this script now: it dies at start
    out = tempfile.mkdtemp(dir=".")
    train(Config(async_staleness=1, steps=2, sft_steps=0, eval_every=0, save_every=0, threads=1,
                 progress=False, output_dir=out))
"""


@pytest.mark.parametrize(
    "how, says",
    [
        ("stdin", "a script read from <stdin> cannot be re-run: save it to a file, or use python -c"),
        ("remove-yourself", "the async sampler process died (exit code 1)"),
    ],
)
def test_a_sampler_process_that_cannot_start_stops_the_run_in_one_line(tmp_path, how, says):
    """A script on standard input (``python - <<EOF``) has no file for the spawned sampler to re-run:
    refused before the spawn. A sampler that dies at start for any reason (here its script is gone)
    is reported, and the run ends: before, the trainer blocked for ever writing the sampler's
    arguments to a child that was dead (CPython writes them to a pipe only the child reads)."""
    if how == "stdin":
        cmd, stdin = [sys.executable, "-"], SCRIPT
    else:
        (tmp_path / "run.py").write_text(SCRIPT)
        cmd, stdin = [sys.executable, "run.py", how], None
    p = subprocess.run(cmd, input=stdin, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and last.startswith("gspo.errors.GspoError: ") and last.endswith(says), p.stderr


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/status").read().split("State:")[1].split("\n")[0].lower()
    except OSError:
        return "zombie"


def test_async_takes_the_vllm_engine_and_r3_but_not_r3_with_partial_rollouts():
    """vLLM samples in the async process, R3's routing crosses with each batch (tests/test_vllm_async.py
    runs both); R3 with partial rollouts or dynamic sampling is refused naming the field."""
    from gspo.config import Config
    from gspo.errors import GspoError

    r3 = dict(async_staleness=1, rollout_engine="vllm", model="embedded:tiny-moe-h32", routing_replay=True,
              routing_replay_source="rollout")  # fmt: skip
    Config(async_staleness=1, rollout_engine="vllm", model="embedded:tiny-moe-h32").validate()
    Config(**r3).validate()
    for extra in (dict(partial_rollout_tokens=3), dict(dynamic_sampling=True)):
        with pytest.raises(
            GspoError, match=r"config field 'routing_replay_source': is not supported with async"
        ) as e:
            Config(**r3, **extra).validate()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("rollout_dtype", [None, "bfloat16"])
def test_async_samples_in_the_rollout_dtype(tmp_path, rollout_dtype):
    """``rollout_dtype bfloat16``: the sampler's copy is bf16, so at step 1 (sampled by the current
    weights, version 0) its log-probs differ from the float32 trainer's by bf16 rounding alone; a
    float32 sampler's equal the trainer's (the correction logs the gap)."""
    cfg = dict(TINY, steps=1, sft_steps=10, async_staleness=1, mismatch_correction="seq_tis", save_every=0)
    res = train(
        Config(name=f"d{rollout_dtype}", output_dir=str(tmp_path), rollout_dtype=rollout_dtype, **cfg)
    )
    gap = _rows(res.run_dir)[0]["mismatch/token_abs_logp_diff"]
    if rollout_dtype is None:
        assert gap < 1e-5
    else:
        assert 1e-4 < gap < 0.5  # bf16's rounding of logits (u = 2^-8 relative), not a stale policy


def test_async_lora_samples_from_the_merged_adapters(tmp_path, monkeypatch):
    """LoRA: the sampler's plain model receives merged weights (W + scaling B A per adapted layer), so
    step t's sampler log-probs are those of the trainer's adapter forward at version t-1-K, and of no
    other version (the adapters move at every step)."""
    import copy

    reward = f"{os.path.dirname(__file__)}/fixture_rewards.py:length_parity"  # a gradient at every step
    cfg = dict(TINY, steps=4, save_every=0, async_staleness=1, lora_rank=4, lr=3e-3, reward=reward)
    with monkeypatch.context() as mp:
        weights, batches = _record_versions_and_batches(mp)
        res = train(Config(name="lora", output_dir=str(tmp_path), **cfg))
    rows = _rows(res.run_dir)
    assert [r["async/staleness"] for r in rows] == [0, 1, 1, 1] and min(r["loss/grad_norm"] for r in rows) > 0
    model = copy.deepcopy(res.model)  # the PEFT model: base + adapters, unmerged
    for t, batch in batches.items():
        # merged vs unmerged: 1e-5 apart (rounding of W x + s B A x); other versions: 1 and more
        assert _sampled_by(model, weights, batch, tol=1e-4) == [max(t - 2, 0)], f"step {t}"


def test_async_dynamic_sampling_fills_the_batch_ahead_and_resumes_exactly(tmp_path, monkeypatch):
    """Dynamic sampling with async: the sampler process scores its rounds and sends a batch of
    informative groups (all from version t-1-K: every row's log-probs are that version's), the
    data position moves past every prompt drawn, the overlong filter's cut responses have no
    advantage, and a run killed with 2 batches in flight and resumed ends bit for bit where the
    uninterrupted one does (batch t depends on its version and t only): the resumed run trains on
    the 2 batches of its checkpoint, then on its restarted sampler's first batch (step 5), drawn
    from the data position after the last of them."""
    import copy
    import shutil

    from gspo.model.load import build_char_tokenizer
    from gspo.training import checkpoint_files as checkpoint
    from gspo.training import run as run_module

    cfg = dict(
        TINY, steps=5, save_every=2, dynamic_sampling=True, overlong_filter=True,
        max_new_tokens=6, prompts_per_step=4, lr=3e-3,
    )  # fmt: skip
    trained, update = [], run_module.policy_update
    with monkeypatch.context() as mp:
        weights, batches = _record_versions_and_batches(mp)

        def recording_update(policy, opt, sched, data, *a):
            trained.append(data)
            return update(policy, opt, sched, data, *a)

        mp.setattr(run_module, "policy_update", recording_update)  # Trainer.update calls it
        mp.setattr(checkpoint, "prune", lambda *a: None)  # keep step 2's checkpoint past steps 4 and 5
        full = train(Config(name="dyn", output_dir=str(tmp_path), **cfg))
    rows = _rows(full.run_dir)
    rounds = [r["rollout/sampling_rounds"] for r in rows]
    assert max(rounds) > 1, rounds  # some step drew more prompts
    state = torch.load(full.run_dir / "checkpoints" / "step-000004" / "trainer_state.pt", weights_only=True)
    assert state["data_pos"] == 4 * sum(rounds[:4])
    model, K = copy.deepcopy(full.model), TINY["async_staleness"]
    eos, n_cut = build_char_tokenizer().eos_token_id, 0
    for t, data in enumerate(trained, start=1):
        r = rows[t - 1]
        informative = data.reward_B.view(-1, 4).std(1, correction=0) > 0
        assert int(informative.sum()) == 4 - r["rollout/filled_groups"]  # informative groups first
        cut_B = ~((data.response_ids_BT == eos) & data.response_mask_BT.bool()).any(1)
        n_cut += int(cut_B.sum())
        assert (data.adv_B[cut_B] == 0).all()
        assert _sampled_by(model, weights, batches[t]) == [max(t - 1 - K, 0)], f"step {t}"
    assert n_cut > 0  # the filter had responses to drop
    killed = tmp_path / "part" / "dyn"
    shutil.copytree(full.run_dir, killed)
    later = sorted(c.name for c in (killed / "checkpoints").glob("step-*") if c.name > "step-000002")
    assert later == ["step-000004", "step-000005"]
    for name in later:
        shutil.rmtree(killed / "checkpoints" / name)
    shutil.rmtree(killed / "final")
    (killed / "checkpoints" / "latest").write_text("step-000002")
    again = train(Config(name="dyn", output_dir=str(tmp_path / "part"), resume=True, **cfg))
    resumed = _rows(again.run_dir)[-3:]  # steps 3 and 4 from the checkpoint, 5 from the new sampler
    assert [r["step"] for r in resumed] == [3, 4, 5]
    assert [r["rollout/sampling_rounds"] for r in resumed] == rounds[2:5]
    for (k, v), w in zip(full.model.state_dict().items(), again.model.state_dict().values(), strict=True):
        torch.testing.assert_close(v, w, atol=0, rtol=0, msg=k)


def test_async_batches_are_seeded_by_their_step_not_their_version(tmp_path, monkeypatch):
    """Issue 57 gap 6: with K = 2 the batches of steps 1-3 are all sampled by version 0; on a dataset
    of one prompt repeated, the same weights and prompts would give the same responses if their seed
    were the version's. Seeded by the step, each batch draws its own."""
    rows = [json.dumps({"prompt": "rev:1234=", "answer": "4321"})] * 40  # 4 held out
    (tmp_path / "same.jsonl").write_text("\n".join(rows) + "\n")
    cfg = dict(TINY, steps=3, sft_steps=0, eval_size=4, prompts_per_step=2, group_size=4, save_every=0)
    with monkeypatch.context() as mp:
        _, batches = _record_versions_and_batches(mp)
        train(Config(name="same", output_dir=str(tmp_path), task=str(tmp_path / "same.jsonl"), **cfg))
    assert sorted(batches) == [1, 2, 3]
    assert all(b.prompt_ids == batches[1].prompt_ids for b in batches.values())
    ids = {t: (b.response_ids_BT * b.response_mask_BT).tolist() for t, b in batches.items()}
    assert ids[1] != ids[2] and ids[2] != ids[3] and ids[1] != ids[3], ids


@pytest.mark.parametrize(
    "extra, field",
    [
        (dict(dynamic_sampling=True, env="calculator"), "dynamic_sampling"),
        (dict(old_logp="recompute"), "old_logp"),
    ],
)
def test_what_async_still_refuses_says_why_in_one_line(extra, field):
    """N ranks (with an environment or vLLM too: tests/test_vllm_async.py), LoRA, dynamic sampling and the overlong filter run async (tests above,
    tests/test_async_ranks.py); what cannot follow is refused naming the field, with why."""
    from gspo.config import Config
    from gspo.errors import GspoError

    oks = (dict(nproc=2), dict(lora_rank=4), dict(dynamic_sampling=True, overlong_filter=True),
           dict(nproc=2, env="calculator"), dict(nproc=2, rollout_engine="vllm"))  # fmt: skip
    for ok in oks:
        Config(async_staleness=1, **ok).validate()
    with pytest.raises(GspoError, match=rf"config field '{field}': is not supported with async.*\(.+\)") as e:
        Config(async_staleness=1, **extra).validate()
    assert "\n" not in str(e.value)


def _ahead(step: int = 3, P: int = 4, G: int = 2, T: int = 5):
    """A batch sampled ahead with partial rollouts' per-token versions (-1 on padding): P groups of G
    rows, every tensor distinct per row, so a row moved or dropped shows."""
    from gspo.data import SampleBatch, SamplerOutput
    from gspo.rollout.async_state import Ahead

    B = P * G
    mask_BT = (torch.arange(T)[None, :] < torch.arange(B)[:, None] % T + 1).long()
    ids_BT = (torch.arange(B * T).view(B, T) + 3) * mask_BT
    logp_BT = -torch.rand(B, T, generator=torch.Generator().manual_seed(0)) * mask_BT
    ver_BT = torch.where(mask_BT.bool(), (torch.arange(T) >= 2).long() + step - 3, -1)
    rb = SampleBatch([[7, b] for b in range(B)], ids_BT, mask_BT, logp_BT, ver_BT)
    return Ahead(step, step - 3, SamplerOutput(rb, 0.25, {"rollout/x": 1.0}), [10 + i for i in range(P)], 40)


def _same_batch(a, b) -> None:
    x, y = a.out.batch, b.out.batch
    fields = lambda c: (c.step, c.version, c.idx, c.data_end, c.out.gen_s, c.out.info)  # noqa: E731
    assert fields(a) == fields(b)
    assert x.prompt_ids == y.prompt_ids
    for name in ("response_ids_BT", "response_mask_BT", "sampler_logp_BT", "sampler_version_BT"):
        u, v = getattr(x, name), getattr(y, name)
        assert v is not None and torch.equal(u, v), name


def test_in_flight_batches_round_trip_through_a_checkpoint(tmp_path):
    """A checkpoint's batches in flight (read back with ``weights_only``, as a resume reads them) are
    the batches that were in flight: tokens, masks, sampler log-probs and partial rollouts' per-token
    versions, whose loss would drop ``async/token_staleness`` and the tokens' own versions of a
    resumed run; the wire between the processes carries the same."""
    from gspo.rollout.async_state import from_wire, in_flight_from_state, in_flight_to_state, to_wire

    pending = [_ahead(3), _ahead(4)]
    torch.save({"in_flight": in_flight_to_state(pending)}, tmp_path / "trainer_state.pt")
    state = torch.load(tmp_path / "trainer_state.pt", weights_only=True)
    back = in_flight_from_state(state["in_flight"], 4)
    assert len(back) == 2
    for a, b in zip(pending, back, strict=True):
        _same_batch(a, b)
        _same_batch(a, from_wire(to_wire(a)))
