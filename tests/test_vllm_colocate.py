"""vLLM colocated per rank (issue 31, items 1-3), without vLLM or a GPU: the tensor-parallel checks,
the placement under torchrun (external_launcher), the GPU memory order (empty_cache before every
wake-up, weights before the KV cache, the share checked after the trainer is sharded, before vLLM
starts) and the start check's tolerance from the compute dtype.

A fake ``vllm`` records calls here only to pin their order and arguments; sampling and the weight
sync themselves are tested against real vLLM in tests/test_vllm_real.py (1 and 2 ranks, tp 1 and 2).
"""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import gspo.rollout.vllm as gv
from gspo.config import Config
from gspo.errors import GspoError
from gspo.resolve import engine_plan
from gspo.rollout import vllm_colocate as vc

GIB = 2**30


def _one_line_error(match, fn, *args, **kwargs):
    with pytest.raises(GspoError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value)
    return str(e.value)


# ------------------------------------------------------------------------------------------------
# tensor parallelism: bad input


def test_tensor_parallel_size_must_divide_the_world_and_the_heads(tmp_path):
    """vllm_tensor_parallel_size: divides nproc, the attention heads, and with the KV heads one divides
    the other; not with multi-turn envs. One line naming the field, before any weight is read (the
    heads come from the config alone: embedded, a local folder)."""
    ok = Config(rollout_engine="vllm", nproc=2, vllm_tensor_parallel_size=2).validate()
    assert ok.vllm_tensor_parallel_size == 2
    Config(rollout_engine="hf", nproc=2, vllm_tensor_parallel_size=3).validate()  # not used by hf
    field = "config field 'vllm_tensor_parallel_size'"
    msg = _one_line_error(field, Config(rollout_engine="vllm", nproc=4, vllm_tensor_parallel_size=3).validate)
    assert "nproc=4" in msg
    # embedded:tiny-moe has 4 attention heads
    msg = _one_line_error(field, Config(rollout_engine="vllm", nproc=8, vllm_tensor_parallel_size=8).validate)
    assert "4 attention heads" in msg
    from gspo.model.load import load_model_and_tokenizer

    config = load_model_and_tokenizer("embedded:tiny-moe", meta=True)[0].config.to_dict()
    config.update(num_attention_heads=12, num_key_value_heads=6, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(config))
    bad_kv = Config(rollout_engine="vllm", model=str(tmp_path), nproc=4, vllm_tensor_parallel_size=4)
    assert "6 KV heads" in _one_line_error(field, bad_kv.validate)
    config.update(num_key_value_heads=2)  # fewer KV heads than ranks: vLLM copies them
    (tmp_path / "config.json").write_text(json.dumps(config))
    Config(rollout_engine="vllm", model=str(tmp_path), nproc=4, vllm_tensor_parallel_size=4).validate()
    multi = Config(rollout_engine="vllm", nproc=2, vllm_tensor_parallel_size=2, env="tools")
    assert "env" in _one_line_error(field, multi.validate)


def test_tensor_parallel_refused_by_the_cli_in_one_line(tmp_path):
    """`gspo train --nproc 2 --rollout-engine vllm --vllm-tensor-parallel-size 3`: exit 2, one line, no
    traceback, nothing launched or written."""
    cmd = [
        sys.executable, "-m", "gspo", "train", "--nproc", "2", "--rollout-engine", "vllm",
        "--vllm-tensor-parallel-size", "3", "--output-dir", str(tmp_path / "runs"),
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "vllm_tensor_parallel_size" in lines[0] and "nproc=2" in lines[0], lines
    assert not (tmp_path / "runs").exists()


def test_check_tensor_parallel_on_the_loaded_config():
    """The engine's own guard (the model's config as loaded: hub ids gspo has no numbers for)."""
    config = SimpleNamespace(num_attention_heads=32, num_key_value_heads=4)
    vc.check_tensor_parallel(8, 8, config, "m")  # 4 KV heads copied over 8 ranks, as vLLM does
    vc.check_tensor_parallel(2, 8, config, "m")
    _one_line_error("does not divide the world size 8", vc.check_tensor_parallel, 3, 8, config, "m")
    _one_line_error("attention heads", vc.check_tensor_parallel, 3, 3, config, "m")
    _one_line_error(
        "KV heads",
        vc.check_tensor_parallel,
        8,
        8,
        SimpleNamespace(num_attention_heads=48, num_key_value_heads=6),
        "m",
    )


# ------------------------------------------------------------------------------------------------
# placement under torchrun


@pytest.fixture
def torchrun(monkeypatch):
    """This process as rank 1 of a 2-rank torchrun world (no process group is made)."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    for k, v in dict(
        RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
    ).items():
        monkeypatch.setenv(k, v)


def test_colocation_uses_the_external_launcher_under_torchrun(torchrun, monkeypatch):
    """Under torchrun: vLLM's external_launcher (its worker on cuda:LOCAL_RANK, tp groups from the world);
    torchrun's environment missing: one line; one process: vLLM's defaults."""
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    plan = engine_plan(Config(rollout_engine="vllm", vllm_tensor_parallel_size=2))
    assert vc.colocation(plan, config, "m") == {
        "distributed_executor_backend": "external_launcher",
        "tensor_parallel_size": 2,
        "distributed_timeout_seconds": 120 * 60,  # every group vLLM makes waits dist_timeout_min
        "cpu_distributed_timeout_seconds": 120 * 60,
    }
    monkeypatch.delenv("LOCAL_RANK")
    assert "LOCAL_RANK" in _one_line_error("torchrun", vc.colocation, plan, config, "m")
    # a one-rank group (vLLM's uni-process executor makes one in-process): vLLM's defaults, no launcher
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    assert vc.colocation(engine_plan(Config(rollout_engine="vllm")), config, "m") == {}
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert vc.colocation(plan, config, "m") == {}


# ------------------------------------------------------------------------------------------------
# a fake vLLM that records what is called, in order


class _Recorder:
    def __init__(self):
        self.calls = []


class _FakeLLM:
    rec: _Recorder

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.rec.calls.append(("LLM", kwargs.get("distributed_executor_backend")))
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=25))
        self.prompt_logprobs = None  # set by a test: what generate returns for the probe

    def collective_rpc(self, method, kwargs=None):
        if callable(method):
            return [True]
        if method == "reload_weights":
            n = sum(1 for _ in kwargs["weights_iterator"])  # the stream is consumed
            self.rec.calls.append(("reload_weights", n > 0))
        return [None]

    def reset_prefix_cache(self):
        self.rec.calls.append(("reset_prefix_cache",))

    def sleep(self, level):
        self.rec.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.rec.calls.append(("wake_up", tuple(tags)))

    def generate(self, prompts, params, use_tqdm=False):
        lps = [None] + [{t: SimpleNamespace(logprob=v)} for t, v in self.prompt_logprobs]
        return [SimpleNamespace(prompt_logprobs=lps)]


@pytest.fixture
def rec(monkeypatch):
    """A fake vllm module and a CUDA whose empty_cache / mem_get_info calls are recorded (80 of 140
    GiB free): the order of the calls is what is tested, not CUDA."""
    r = _Recorder()
    _FakeLLM.rec = r
    fake = SimpleNamespace(LLM=_FakeLLM, SamplingParams=lambda **kw: kw)
    monkeypatch.setattr(gv, "_import_vllm", lambda: fake)
    monkeypatch.setattr(gv, "_is_cpu_platform", lambda: False)
    monkeypatch.setattr(gv, "_check_runnable", lambda *a: None)
    monkeypatch.setattr(gv, "_vllm_version", lambda: "0.32.0")
    r.free = 80 * GIB

    def mem_get_info(device=None):
        r.calls.append(("mem_get_info", str(device)))
        return r.free, 140 * GIB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: r.calls.append(("empty_cache",)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: None)
    return r


def _plan(**kw):
    return engine_plan(Config(rollout_engine="vllm", model="embedded:tiny-moe-h32", **kw).validate())


@pytest.fixture(scope="module")
def h32():
    from gspo.model.load import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("embedded:tiny-moe-h32", seed=0)
    return model.eval(), tok


def test_share_checked_after_sharding_just_before_vllm_starts(rec, torchrun, h32):
    """GPU path under torchrun: PyTorch's cache emptied, then the share checked against this rank's
    GPU's free memory, then vLLM made with the external_launcher, the configured share and sleep mode;
    this rank's instance index (rank // tp) seeds its requests."""
    model, tok = h32
    plan = _plan(nproc=2, vllm_gpu_memory_utilization=0.5)
    engine = gv.VLLMRolloutEngine.from_trainer(plan, model, tok, check_sync=False)
    order = [c[0] for c in rec.calls]
    assert order[:3] == ["empty_cache", "mem_get_info", "LLM"], rec.calls
    assert rec.calls[1] == ("mem_get_info", "cuda:1")
    kw = engine.llm.kwargs
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["tensor_parallel_size"] == 1
    assert kw["gpu_memory_utilization"] == 0.5 and kw["enable_sleep_mode"] is True
    assert engine.dp_rank == 1 and engine.tp_group is None and engine._seed(0) != 0


def test_share_larger_than_what_is_free_is_refused_before_vllm_starts(rec, torchrun, h32):
    """0.5 of 140 GiB with 60 GiB free (the trainer's shards took the rest): one line naming the
    field, and vLLM never started."""
    model, tok = h32
    rec.free = 60 * GIB
    plan = _plan(nproc=2, vllm_gpu_memory_utilization=0.5)
    msg = _one_line_error(
        "config field 'vllm_gpu_memory_utilization'", gv.VLLMRolloutEngine.from_trainer, plan, model, tok
    )
    assert "60.0 GiB is free" in msg
    assert "LLM" not in [c[0] for c in rec.calls]


def test_wake_up_order_empty_cache_weights_then_kv_cache(rec, h32):
    """After an update: empty_cache, wake the weights, stream the new weights in, reset the prefix
    cache, empty_cache, wake the KV cache; generate() on a sleeping engine does the same."""
    model, tok = h32
    engine = gv.VLLMRolloutEngine(_FakeLLM(), model, tok.eos_token_id, tok.pad_token_id, sleep_mode=True)
    for wake in (engine.sync_weights, engine.wake_up):
        rec.calls.clear()
        engine.sleep()
        wake()
        assert rec.calls == [
            ("sleep", 2),
            ("empty_cache",),
            ("wake_up", ("weights",)),
            ("reload_weights", True),
            ("reset_prefix_cache",),
            ("empty_cache",),
            ("wake_up", ("kv_cache",)),
        ], rec.calls
    rec.calls.clear()
    engine.sync_weights()  # awake: no wake-up, nothing emptied
    assert rec.calls == [("reload_weights", True), ("reset_prefix_cache",)]


# ------------------------------------------------------------------------------------------------
# the start check


def test_compute_dtype_is_the_lower_precision_of_trainer_and_sampler():
    assert vc.compute_dtype(torch.float32, "bf16", "float32") == torch.bfloat16  # FSDP2 bf16 compute
    assert vc.compute_dtype(torch.float32, None, "bfloat16") == torch.bfloat16  # a bf16 vLLM
    assert vc.compute_dtype(torch.float32, None, "float32") == torch.float32
    assert vc.compute_dtype(torch.bfloat16, None, "bfloat16") == torch.bfloat16


def _true_logprobs(model, probe):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([probe])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(probe[1:])[:, None])[:, 0]


@pytest.mark.parametrize("offset", [0.0, 0.05, 1.0])
def test_start_check_tolerance_follows_the_compute_dtype(rec, h32, offset):
    """vLLM's probe log-probs off by ``offset``: float32 compute accepts only ~0 (max 1e-3); bf16
    compute (FSDP2 bf16 or a bf16 vLLM beside a float32 master) accepts bf16 noise (mean 0.05) and
    still refuses a broken sync (1 nat). The reference runs through the trainer's forward module,
    never through the whole-model gather."""
    model, tok = h32
    engine = gv.VLLMRolloutEngine(_FakeLLM(), model, tok.eos_token_id, tok.pad_token_id)
    engine.gather = lambda: pytest.fail("the start check gathered the whole model")
    probe = [(7919 * i + 3) % model.config.vocab_size for i in range(24)]
    ref = _true_logprobs(model, probe)
    engine.llm.prompt_logprobs = list(zip(probe[1:], (ref + offset).tolist(), strict=True))
    for dtype, accepts in ((torch.float32, offset < 1e-3), (torch.bfloat16, offset < 0.1)):
        engine.compute_dtype = dtype
        if accepts:
            assert engine.check_logprobs() == pytest.approx(offset, abs=1e-5)
        else:
            _one_line_error("differ from the trainer's", engine.check_logprobs)


@pytest.mark.parametrize("offset, stops", [(0.32, False), (0.85, False), (1.0, True), (3.1, True)])
def test_start_check_in_bf16_stops_only_a_gross_mismatch(rec, h32, offset, stops):
    """Issue 47: the 16-bit bound was 0.1 nats, where a correct bf16 sync of a real model measures
    0.32 on average (benchmarks/sync_check_gap.py, SmolLM2-135M); a broken sync measures 3.1 and
    more. A precision-level gap passes and is said with its number; >= ~1 nat stops the run in one line."""
    model, tok = h32
    engine = gv.VLLMRolloutEngine(_FakeLLM(), model, tok.eos_token_id, tok.pad_token_id)
    probe = [(7919 * i + 3) % model.config.vocab_size for i in range(24)]
    ref = _true_logprobs(model, probe)
    engine.llm.prompt_logprobs = list(zip(probe[1:], (ref + offset).tolist(), strict=True))
    engine.compute_dtype = torch.bfloat16
    if stops:
        _one_line_error("differ from the trainer's", engine.check_logprobs)
    else:
        diff = engine.check_logprobs()
        assert diff == pytest.approx(offset, abs=1e-5)
        line = vc.sync_gap_line(diff, torch.bfloat16)
        assert "\n" not in line and f"within {offset:.3g} nats" in line and "stops from 0.9" in line
    assert vc.sync_tolerance(torch.float32) == ("max", 1e-3)  # float32 unchanged: ~0 or a broken sync
