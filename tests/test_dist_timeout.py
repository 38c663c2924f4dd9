"""The process group's timeout is a config field (dist_timeout_min, default 120 minutes: a cold-cache
start of the 235B recipe), passed to init_process_group; it was never passed (torch's 10 minutes)."""

import json
from datetime import timedelta
from pathlib import Path

import pytest

from gspo.config import make_config
from gspo.errors import GspoError
from gspo.resolve import dist_plan
from gspo.training import distributed as D


def _init_kwargs(monkeypatch, cfg):
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(D, "die_with_parent", lambda: None)
    monkeypatch.setattr(D.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(D.dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    monkeypatch.setattr(D, "_TIMEOUT", None)
    D.setup(dist_plan(cfg))
    return seen


def test_process_group_timeout_default_and_override(monkeypatch):
    cfg = make_config(None, {"device": "cpu", "threads": 1})
    assert cfg.dist_timeout_min == 120
    seen = _init_kwargs(monkeypatch, cfg)
    assert seen == {"backend": "gloo", "timeout": timedelta(minutes=120)}
    assert D._TIMEOUT == timedelta(minutes=120) and "dist_timeout_min = 120 min" in D.timeout_note()
    seen = _init_kwargs(
        monkeypatch, make_config(None, {"device": "cpu", "threads": 1, "dist_timeout_min": 7})
    )
    assert seen["timeout"] == timedelta(minutes=7)


@pytest.mark.parametrize("bad", [0, -5, 10081])
def test_process_group_timeout_out_of_range_is_one_line(bad):
    with pytest.raises(GspoError, match="dist_timeout_min"):
        make_config(None, {"dist_timeout_min": bad})


def test_the_engine_plan_carries_the_timeout_for_vllms_groups():
    from gspo.resolve import engine_plan

    assert engine_plan(make_config(None, {"dist_timeout_min": 7})).dist_timeout_min == 7
    assert engine_plan(make_config(None, {})).dist_timeout_min == 120


# ------------------------------------------------------------------------------------------------
# every group a run makes waits dist_timeout_min (torch gives a group made without a timeout its
# default: 10 minutes on NCCL, 30 on gloo, whatever init_process_group was given)

MINUTES = 7  # not a default anywhere (torch: 10 and 30, gspo: 120), so only a passed timeout matches


def _spy(monkeypatch_targets: list[tuple[object, str]], seen: list) -> None:
    """Record the timeout of every group made through ``torch.distributed``'s public group makers
    (the names ``new_subgroups_by_enumeration`` and ``DeviceMesh`` call, too), then make it."""
    import inspect

    for owner, name in monkeypatch_targets:
        real = getattr(owner, name)
        params = list(inspect.signature(real).parameters)

        def spy(*args, _real=real, _name=name, _params=params, **kwargs):
            bound = dict(zip(_params, args, strict=False)) | kwargs
            t = bound.get("timeout")
            seen.append((_name, t.total_seconds() if t is not None else None))
            return _real(*args, **kwargs)

        setattr(owner, name, spy)


def _rank_main(rank: int, port: int, out: str) -> None:
    """One of 2 gloo ranks: the world group, then HSDP's mesh and expert parallelism's meshes made by
    :func:`gspo.training.distributed.wrap` (a dense and a MoE tiny model), and vLLM's tensor-parallel
    subgroup; the timeout each group was made with written to ``out``."""
    import os

    import torch
    import torch.distributed as dist
    import torch.distributed.device_mesh as dm
    from torch.distributed import distributed_c10d as c10d

    from gspo.model.load import build_char_tokenizer, build_tiny_dense, build_tiny_moe
    from gspo.model.logprobs import PolicyLogprobs
    from gspo.plans import DistPlan
    from gspo.rollout import vllm_colocate

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    seen: list = []
    targets = [(c10d, "new_group"), (c10d, "split_group"), (dm, "new_group"), (dm, "split_group")]
    _spy([*targets, (dist, "init_process_group")], seen)
    D.die_with_parent = lambda: None  # (this child's parent is the test)
    base = dict(device="cpu", parallel="fsdp", mixed_precision="none", lora=False, threads=1)
    ctx = D.setup(DistPlan(**base, dist_timeout_min=MINUTES))
    stages = {"world": list(seen)}
    vocab = len(build_char_tokenizer())
    for name, build, extra in (
        ("hsdp", build_tiny_dense, {"dp_replicate_size": 2}),
        ("ep", build_tiny_moe, {"expert_parallel_size": 2}),
    ):
        del seen[:]
        D.wrap(PolicyLogprobs(build(vocab, seed=0)), DistPlan(**base, **extra), ctx)
        stages[name] = list(seen)
    del seen[:]
    vllm_colocate.tp_subgroup(2, D._TIMEOUT)
    stages["vllm_tp"] = list(seen)
    Path(f"{out}.{rank}").write_text(json.dumps(stages))
    D.cleanup(ctx)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not D.dist.is_gloo_available(), reason="needs the gloo backend")
def test_every_group_of_a_two_rank_start_waits_dist_timeout_min(tmp_path):
    """The world group, HSDP's (dp, fsdp) mesh, expert parallelism's (efsdp, ep, tp) meshes and vLLM's
    tensor-parallel subgroup, made by the real code on 2 gloo ranks: every group with dist_timeout_min.
    HSDP's and EP's meshes came from init_device_mesh (and transformers' initialize_distributed_mesh),
    whose groups get torch's default."""
    import multiprocessing as mp

    ctx, port, out = mp.get_context("spawn"), _free_port(), str(tmp_path / "seen")
    procs = [ctx.Process(target=_rank_main, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    want = MINUTES * 60.0
    for rank in range(2):
        stages = json.loads(Path(f"{out}.{rank}").read_text())
        assert stages["world"] == [["init_process_group", want]]
        for stage in ("hsdp", "ep", "vllm_tp"):
            assert stages[stage], f"rank {rank}: no group made for {stage}"  # the spy saw them
            late = [(name, t) for name, t in stages[stage] if t != want]  # seconds (None: not given)
            assert not late, f"rank {rank}, {stage}: groups without dist_timeout_min: {late}"
        # HSDP (2 x 1): a dp group and 2 one-rank fsdp groups; EP (1 x 2 x 1): efsdp, ep and tp groups
        assert len(stages["hsdp"]) == 3 and len(stages["ep"]) == 2 + 1 + 2


def test_vllms_own_groups_under_torchrun_wait_dist_timeout_min(monkeypatch):
    """Under torchrun vLLM (external_launcher) builds its groups itself: its public EngineArgs
    ``distributed_timeout_seconds`` (device groups) and ``cpu_distributed_timeout_seconds`` (its gloo
    groups) carry dist_timeout_min; without them vLLM passes none and torch's defaults apply."""
    from gspo.resolve import engine_plan
    from gspo.rollout import vllm_colocate as vc

    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="x", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(D.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(D.dist, "get_world_size", lambda group=None: 2)
    config = type("C", (), {"num_attention_heads": 4, "num_key_value_heads": 2})()
    plan = engine_plan(make_config(None, {"rollout_engine": "vllm", "dist_timeout_min": MINUTES}))
    kw = vc.colocation(plan, config, "m")
    assert kw["distributed_timeout_seconds"] == kw["cpu_distributed_timeout_seconds"] == MINUTES * 60


def test_the_weight_transfer_group_waits_its_timeout_on_both_backends(monkeypatch):
    """The async sampler's weight-transfer group (rollout devices): gloo and NCCL both get the
    transfer's timeout (NCCL was made without one: its 10 minutes). The backends' constructors are
    recorded, not run (NCCL needs GPUs; a 2-member gloo group waits for its peer)."""
    from gspo.rollout import weight_transfer as wt

    made = []
    for backend in ("ProcessGroupGloo", "ProcessGroupNCCL"):
        monkeypatch.setattr(wt.dist, backend, lambda *a, _b=backend: made.append((_b, a[3:])), raising=False)
    store = D.dist.HashStore()
    for backend in ("gloo", "nccl"):
        wt._group(store, 0, backend, 42.0)
    assert made == [(b, (timedelta(seconds=42),)) for b in ("ProcessGroupGloo", "ProcessGroupNCCL")]
