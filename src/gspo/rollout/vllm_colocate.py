"""vLLM colocated with the trainer, one engine per training rank: its placement under torchrun, its
tensor-parallel groups, the GPU memory it may take, and the start check's reference side. Imports no
vLLM (tested without it: tests/test_vllm_colocate.py; with real vLLM: tests/test_vllm_real.py).

Under torchrun each rank runs vLLM in its own process with vLLM's ``external_launcher`` executor, as
TRL's colocate mode, verl and torchtitan do: its worker is on ``cuda:LOCAL_RANK`` (vLLM's uni-process
executor puts every rank on device 0), and its tensor-parallel groups are ``tp`` consecutive ranks of
torchrun's world (vLLM carves them itself); the data-parallel size is ``world / tp``. The ranks of one
group run the same requests (they gather their prompts, :meth:`VLLMRolloutEngine._group_prompts`) with
the same seeds, and each streams the full weights into its own worker, whose loaders keep its slice.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from gspo.errors import GspoError
from gspo.model.unwrap import reshard, unwrap
from gspo.plans import EnginePlan


def check_tensor_parallel(tp: int, world: int, config: Any, name: str) -> None:
    """vLLM's tensor parallelism under torchrun: ``tp`` consecutive ranks form one vLLM instance, so
    ``tp`` divides the world; each holds a slice of the attention heads, so ``tp`` divides the heads,
    and the KV heads (or, with fewer KV heads than ranks, they divide ``tp``: vLLM replicates them)."""
    field = "config field 'vllm_tensor_parallel_size'"
    if tp < 1 or world % tp:
        raise GspoError(f"{field}: {tp} does not divide the world size {world} (nproc)")
    text = getattr(config, "get_text_config", lambda: config)()
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if heads and heads % tp:
        raise GspoError(f"{field}: {tp} does not divide {name}'s {heads} attention heads")
    if kv and (kv % tp if kv >= tp else tp % kv):
        raise GspoError(
            f"{field}: {tp} and {name}'s {kv} KV heads: one must divide the other (each rank holds "
            "a slice of them, or a copy when there are fewer KV heads than ranks)"
        )


def colocation(plan: EnginePlan, config: Any, name: str) -> dict[str, Any]:
    """``vllm.LLM`` arguments that place one vLLM per training rank under torchrun: vLLM's
    ``external_launcher`` executor (as TRL's colocate mode, verl and torchtitan use it) runs in this
    process on ``cuda:LOCAL_RANK`` (its uni-process executor would put every rank on device 0), and
    carves its tensor-parallel groups of ``vllm_tensor_parallel_size`` consecutive ranks from
    torchrun's world, every group it makes waiting ``dist_timeout_min`` (its public
    ``distributed_timeout_seconds`` and ``cpu_distributed_timeout_seconds``). One process: nothing
    (vLLM's own single-process executor)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return {}
    world = torch.distributed.get_world_size()
    if world == 1:  # one rank (or a group vLLM's own executor set up in this process): no launcher
        return {}
    tp = plan.vllm_tensor_parallel_size
    check_tensor_parallel(tp, world, config, name)
    missing = [
        k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise GspoError(
            "config field 'rollout_engine': vLLM on several ranks needs torchrun's environment "
            f"({', '.join(missing)} unset); start with gspo train --nproc N or torchrun"
        )
    # vLLM builds its own groups on torchrun's world (its world, tensor-, pipeline-, data- and
    # expert-parallel coordinators: a device group and a gloo group each); without these EngineArgs
    # they get torch's default timeouts (10 minutes on NCCL, 30 on gloo), not dist_timeout_min
    seconds = 60 * plan.dist_timeout_min
    return dict(
        distributed_executor_backend="external_launcher", tensor_parallel_size=tp,
        distributed_timeout_seconds=seconds, cpu_distributed_timeout_seconds=seconds,
    )  # fmt: skip


def tp_subgroup(tp: int, timeout: Any = None) -> Any:
    """This rank's group of ``tp`` consecutive ranks (vLLM's tensor-parallel group; collective: every
    rank calls it). None for ``tp`` 1."""
    if tp <= 1:
        return None
    world = torch.distributed.get_world_size()
    groups = [list(range(i, i + tp)) for i in range(0, world, tp)]
    # ``timeout``: the world group's (dist_timeout_min); None gives torch's default (10 minutes, NCCL)
    return torch.distributed.new_subgroups_by_enumeration(groups, timeout=timeout)[0]


def compute_dtype(trainer_dtype: torch.dtype, mixed_precision: str | None, vllm_dtype: str) -> torch.dtype:
    """The precision the sync check compares in: the lower of the trainer's compute dtype (FSDP2's
    bf16 parameters under ``mixed_precision``, else its weights') and vLLM's."""
    trainer = torch.bfloat16 if mixed_precision == "bf16" else trainer_dtype
    sampler = getattr(torch, str(vllm_dtype).removeprefix("torch."), trainer)
    return trainer if trainer.itemsize <= sampler.itemsize else sampler


# a start check in 16-bit stops the run from this mean |gap| (nats) over the probe: measured on the
# CPU (benchmarks/sync_check_gap.py, RESULTS_scale.md section 7), a correct sync of SmolLM2-135M in
# bf16 against float32 is off by 0.32 on average (5.5 at worst on one token), a broken one (other
# weights, one layer left random, the probe shifted by a token) by 3.1 to 16: the bound sits between
# the two (their geometric middle is 1.0), below the ~1 nat a gross mismatch gives
GROSS_GAP_16BIT = 0.9


def sync_tolerance(dtype: torch.dtype) -> tuple[str, float]:
    """(statistic, bound) of ``|vLLM - trainer|`` over the probe's log-probs above which the start
    check stops the run. float32: max 1e-3 (measured ~1e-6). 16-bit: mean :data:`GROSS_GAP_16BIT`
    (0.9 nats): bf16 rounding alone reaches 0.32 on a real model, so only a gross mismatch (wrong
    weights, layout or tokenizer, >= ~1 nat) stops it; a gap below is logged (:func:`sync_gap_line`)."""
    return ("max", 1e-3) if dtype.itemsize >= 4 else ("mean", GROSS_GAP_16BIT)


def sync_gap_line(diff: float, dtype: torch.dtype) -> str:
    """The line a start check that passed logs: the gap it measured, beside the bound that would stop
    the run (a precision-level gap in 16-bit is expected, and said with its number)."""
    stat, bound = sync_tolerance(dtype)
    name = str(dtype).removeprefix("torch.")
    why = "bf16/fp16 rounding, expected" if dtype.itemsize < 4 else "float32"
    return (
        f"gspo: vLLM start check: log-probs within {diff:.3g} nats of the trainer's ({stat} over the probe "
        f"in {name}: {why}; the run stops from {bound:g})"
    )


@torch.no_grad()
def trainer_logprobs(policy: Any, model: Any, probe: list[int]) -> torch.Tensor:
    """log p(probe[t] | probe[:t]) for t >= 1 from the trainer's forward module (float32, CPU)."""
    from gspo.model.logprobs import as_policy, make_layout

    policy = unwrap(as_policy(model) if policy is None else policy, "policy")  # DDP: its module
    hf = unwrap(policy, "transformers")
    was_training = hf.training
    hf.eval()
    try:
        device = next(iter(hf.parameters())).device
        ids = torch.tensor([probe], device=device)
        ones = torch.ones_like(ids)
        resp, resp_mask = ids[:, 1:], ones[:, 1:]
        lp = policy(make_layout(ids[:, :1], ones[:, :1], resp, resp_mask, "rows"), resp, resp_mask)
    finally:
        hf.train(was_training)
        reshard(policy)  # a no-grad forward leaves the FSDP2 root's own group unsharded
    return lp[0].float().cpu()


def param_dtype(model: Any) -> torch.dtype:
    return next(iter(model.parameters())).dtype


def empty_cache() -> None:
    """Hand PyTorch's cached, unused GPU memory back to the driver (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_share(plan: EnginePlan, share: float) -> None:
    """vLLM's share of the GPU against what is free now (the trainer sharded, its cache emptied)."""
    from gspo.limits import check_vllm_share

    empty_cache()
    check_vllm_share(plan, torch.device("cuda", torch.cuda.current_device()), share)
