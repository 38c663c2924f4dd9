"""Process-group setup and model wrapping for data-parallel training.

The loop calls only the functions here, so one process and N processes run the same code: with
``WORLD_SIZE`` unset or 1 every function is a no-op; under ``torchrun`` (``WORLD_SIZE > 1``) they set up
the process group (gloo on CPU, NCCL on CUDA), wrap the model (FSDP2 or DDP), and gather / reduce.

What gets wrapped is the trainer's forward module, :class:`~gspo.model.logprobs.PolicyLogprobs`
(base model, then the LM head at response positions only), so both wrappers see the forward the
loop really calls, through public APIs only:

* FSDP2: ``fully_shard`` each decoder layer, then the :class:`PolicyLogprobs` root (which holds the
  embeddings, final norm and LM head -- tied or not -- in one group).
* DDP: ``DistributedDataParallel(policy)``.

Under FSDP2 each rank only ever holds its shard of the weights when the run starts from weights on
disk (no LoRA, no warm start to train first): every rank builds the model on the meta device, shards
it, and reads its own shards from the safetensors files (a hub id's snapshot fetched once per node
first: :func:`node_snapshot`); where the files cannot feed that, rank 0 alone reads the weights (on
the CPU) and broadcasts them through ``torch.distributed.checkpoint.state_dict`` (:func:`builds_sharded`).
The process group's timeout is the config's ``dist_timeout_min``, and every group made over part of the
world (HSDP's and expert parallelism's meshes, :func:`subgroup`) is given the same.

Each rank samples its own prompts and stops at EOS, so its generation forwards differ from the other
ranks'; nothing collective may run inside generation. DDP samples from the HF module inside the
wrapper (a full replica). FSDP samples from the same module with every group's parameters gathered
for the rollout and freed after it (:func:`gathered`); no second copy of the model is kept.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gspo.compat import transformers_model
from gspo.errors import GspoError
from gspo.model.logprobs import PolicyLogprobs
from gspo.model.unwrap import POLICY_PREFIX, reshard, unwrap
from gspo.plans import DistPlan
from gspo.procs import die_with_parent


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _device(plan: DistPlan, local_rank: int) -> torch.device:
    if plan.device == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(plan.device)
    except RuntimeError:
        raise GspoError(f"config field 'device': not a torch device: {plan.device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GspoError("config field 'device': CUDA is not available on this machine (use 'auto' or 'cpu')")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise GspoError(
            f"config field 'device': {plan.device} does not exist ({torch.cuda.device_count()} GPUs)"
        )
    return dev


def _distributed(ctx: DistContext) -> bool:
    return ctx.world_size > 1 and dist.is_available() and dist.is_initialized()


def _check_world(plan: DistPlan, world: int) -> None:
    ep, reps = plan.expert_parallel_size, plan.dp_replicate_size
    if world % ep:
        raise GspoError(
            f"config field 'expert_parallel_size': must divide the world size ({world} processes) (got {ep})"
        )
    if world % reps or (ep > 1 and reps not in (1, world // ep)):
        want = f"1 or world / expert_parallel_size = {world // ep}" if ep > 1 else "a divisor"
        raise GspoError(
            f"config field 'dp_replicate_size': must be {want} of the world size ({world} processes) "
            f"(got {reps})"
        )


def setup(plan: DistPlan) -> DistContext:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(plan, local_rank)
    _check_world(plan, world)  # before any weight is read
    if world > 1:
        die_with_parent()  # SIGTERM when the torchrun agent dies: a kill -9-ed launcher leaves no rank on
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif plan.threads == 0:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        if not dist.is_initialized():
            global _TIMEOUT
            _TIMEOUT = timedelta(minutes=plan.dist_timeout_min)  # config field dist_timeout_min: why 120
            if device.type == "cuda":
                dist.init_process_group("nccl", device_id=device, timeout=_TIMEOUT)
            else:
                dist.init_process_group("gloo", timeout=_TIMEOUT)
    return DistContext(rank, world, local_rank, device)


_TIMEOUT: timedelta | None = None  # the process group's, as set up here (None: torch's default)


def timeout_note() -> str:
    """How long a wait in a collective may last, for the lines that say what a rank waits for."""
    minutes = int(_TIMEOUT.total_seconds() // 60) if _TIMEOUT else None
    return f"up to dist_timeout_min = {minutes} min" if minutes else "up to the process group's timeout"


def subgroup(ranks: list[list[int]]) -> Any:
    """This rank's group among ``ranks`` (disjoint lists covering the world; collective: every rank
    calls it), waiting as long as the world group (``dist_timeout_min``): ``new_group`` without a
    timeout gives torch's default (10 minutes on NCCL), not the world group's."""
    return dist.new_subgroups_by_enumeration(ranks, timeout=_TIMEOUT)[0]


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Any:
    """A device mesh of ``shape`` over every rank (rank-major) whose groups all wait as long as the
    world group. A 1-D mesh is the world group itself (``init_device_mesh``); a mesh of several
    dimensions gets each dimension's groups from :func:`subgroup` and is assembled by
    ``DeviceMesh.from_group`` (``init_device_mesh`` would make them with torch's default timeout,
    10 minutes on NCCL, whatever ``init_process_group`` was given)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if len(shape) == 1:
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    ranks = torch.arange(math.prod(shape)).view(shape)
    groups = [subgroup(ranks.movedim(d, -1).reshape(-1, n).tolist()) for d, n in enumerate(shape)]
    return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names)


def node_snapshot(repo_id: str, ctx: DistContext, patterns: tuple[str, ...] | None = None) -> Path:
    """A hub model's snapshot folder on this rank's node (collective): local rank 0 of each node
    downloads its files (``patterns``, default: weights, config and tokenizer) into the hub's cache
    once, under the cache's ``flock`` (:func:`gspo.model.hub_lock.cache_lock`: nodes sharing one cache
    take turns), the node's other ranks wait for it in a gather (bounded by the process group's
    timeout, and said), then each rank finds the snapshot in the cache and reads it as a local
    folder: no rank but local rank 0 asks the hub anything. A failed download stops every rank with
    its one line."""
    from gspo.model.hub_lock import cache_lock
    from gspo.model.load import HUB_WEIGHT_FILES, hub_snapshot

    patterns = patterns or HUB_WEIGHT_FILES
    error, path = None, None
    if ctx.local_rank == 0:
        print(
            f"gspo: rank {ctx.rank} fetches {repo_id}'s files into the hub cache, once on this node "
            f"(the node's other ranks wait for it, {timeout_note()})",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        try:
            with cache_lock(repo_id, _TIMEOUT.total_seconds() if _TIMEOUT else None):
                path = hub_snapshot(repo_id, patterns=patterns)
        except GspoError as e:
            error = str(e)
    elif ctx.local_rank == 1:
        print(
            f"gspo: rank {ctx.rank} and the node's other ranks wait for local rank 0's download of "
            f"{repo_id} ({timeout_note()})",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    errors = [e for e in gather_objects(error, ctx) if e]  # every node's download done (or failed)
    if errors:
        raise GspoError(errors[0])
    return path if path is not None else hub_snapshot(repo_id, local_files_only=True, patterns=patterns)


# ------------------------------------------------------------------------------------------------
# wrapping


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks transformers itself never splits (its no-split modules)."""
    names = transformers_model.no_split_modules(model)
    return [m for m in model.modules() if type(m).__name__ in names]


def _broadcast_from_rank0(model: nn.Module) -> None:
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=0)


def builds_sharded(plan: DistPlan, world_size: int, warm_start: bool) -> bool:
    """True when each rank builds the model on the meta device and only ever materialises its shard:
    FSDP2 over several ranks, no LoRA (PEFT wraps a model with real weights) and no supervised warm
    start to run first (it trains the whole model on every rank before sharding)."""
    return world_size > 1 and plan.parallel == "fsdp" and not plan.lora and not warm_start


def share_probes(model: nn.Module, source: nn.Module | None) -> None:
    """A model on the meta device cannot run the model probes (plain forwards): rank 0 runs them on
    its ``source`` and every rank takes the answers (collective)."""
    from gspo.model.logprobs import adopt_probes, probe, probe_results

    if source is not None:
        probe(source)
    answers = [probe_results(source) if source is not None else None]
    dist.broadcast_object_list(answers, src=0)
    adopt_probes(model, answers[0])


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def wrap(
    policy: PolicyLogprobs,
    plan: DistPlan,
    ctx: DistContext,
    source: nn.Module | None = None,
    folder: Path | None = None,
    *,
    empty: bool = False,
) -> nn.Module:
    """Data-parallel wrapper (FSDP2 or DDP) of the trainer's forward when world_size > 1; else itself.
    A ``policy`` on the meta device (:func:`builds_sharded`) is sharded first, then filled: each rank
    reading its own shards from the safetensors of ``folder`` (:mod:`gspo.model.shard_load`), or
    from ``source``, the full model on rank 0's CPU (None on the other ranks); ``empty``: zeros, for
    a sharded checkpoint's shards to fill (a resume reads no other weights)."""
    if not _distributed(ctx):
        return policy
    from gspo.model.logprobs import probe

    meta = _on_meta(policy)
    if not meta:  # (a model on the meta device took rank 0's answers: share_probes)
        probe(unwrap(policy, "transformers"))  # the probes' plain forwards cannot run on sharded weights
        _broadcast_from_rank0(policy)  # identical replicas whatever happened before (init, warm start)
    if plan.parallel == "ddp":
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # buffers (rotary tables) never change; syncing them is a collective inside every forward
        return nn.parallel.DistributedDataParallel(policy, device_ids=ids, broadcast_buffers=False)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy()  # the parameters' own dtype throughout
    if plan.mixed_precision == "bf16":  # compute in bf16; float32 master weights and gradient reduction
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if plan.expert_parallel_size > 1:
        mesh = _shard_experts(policy, plan, ctx, mp)
    elif plan.dp_replicate_size > 1:  # HSDP: replicated over the first dim, sharded over the second
        reps = plan.dp_replicate_size
        mesh = device_mesh(ctx.device.type, (reps, ctx.world_size // reps), ("dp", "fsdp"))
    else:
        mesh = device_mesh(ctx.device.type, (ctx.world_size,))
    for layer in _decoder_layers(policy.model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(policy, mesh=mesh, mp_policy=mp)
    if meta and folder is not None:
        _load_own_shards(policy, folder, ctx)
    elif meta and empty:
        _allocate(policy, ctx)
    elif meta:
        _load_from_rank0(policy, source, ctx)
    _first_forward(policy, ctx.device)
    return policy


def _shard_experts(policy: nn.Module, plan: DistPlan, ctx: DistContext, mp: Any) -> Any:
    """Expert parallelism (``--ep N``): each rank keeps ``num_experts / N`` whole experts of every MoE
    layer and exchanges tokens by all-to-all within its group of N ranks; FSDP2 shards each experts
    module over the ``world / N`` ranks holding the same experts. Returns the mesh of the dense
    parameters: sharded over the N ranks of a group, replicated over the groups (one group, N =
    world: sharded over every rank), on the experts' (efsdp, ep) mesh so that every parameter lives
    on one mesh (the gradient norm and the optimizer need that)."""
    from torch.distributed.fsdp import fully_shard

    from gspo.compat.transformers_ep import meshes as ep_meshes
    from gspo.model.expert_parallel import check_divides, shard_experts

    hf = unwrap(policy, "transformers")
    ep = plan.expert_parallel_size
    check_divides(hf, ep, ctx.world_size)
    # transformers' expert mesh (its pp and dp_replicate of size 1), every group with our timeout
    root = device_mesh(ctx.device.type, (ctx.world_size // ep, ep, 1), ("efsdp", "ep", "tp"))
    meshes = ep_meshes(root)
    for experts in shard_experts(hf, meshes).values():
        fully_shard(experts, mesh=meshes["efsdp"], mp_policy=mp)
        # an expert's gradient sums the tokens of its N-rank group (the all-to-all's backward) and
        # FSDP2 sums over the world / N groups: divide by the world, as every other gradient is
        experts.set_gradient_divide_factor(float(ctx.world_size))
        if meshes["efsdp"].size() > 1:  # PREMUL_SUM (a divide factor other than the group size):
            experts.set_force_sum_reduction_for_comms(True)  # NCCL only; sum, then divide locally
    return meshes["dense"]


def _load_own_shards(policy: nn.Module, folder: Path, ctx: DistContext) -> None:
    """Allocate this rank's shards and read them from ``folder`` (no collective, no full copy)."""
    from gspo.model.shard_load import load_own_shards

    policy.to_empty(device=ctx.device)
    hf = unwrap(policy, "transformers")
    transformers_model.init_buffers(hf)  # rotary tables: to_empty left them uninitialised
    load_own_shards(hf, folder)


@torch.no_grad()
def _allocate(policy: nn.Module, ctx: DistContext) -> None:
    """Allocate this rank's shards as zeros (no weight read): a sharded checkpoint's resume fills them."""
    policy.to_empty(device=ctx.device)
    transformers_model.init_buffers(
        unwrap(policy, "transformers")
    )  # rotary tables: to_empty left them uninitialised
    for p in policy.parameters():
        p.zero_()


def probe_sharded(policy: nn.Module) -> None:
    """Run the model probes on the sharded model, every rank at once (collective: the same forwards
    everywhere, the root's weights gathered for them): a model whose ranks read their own shards has
    no full copy anywhere to probe."""
    from gspo.model.logprobs import probe

    if not is_fsdp(policy):
        return probe(unwrap(policy, "transformers"))
    policy.unshard()
    try:
        probe(unwrap(policy, "transformers"))
    finally:
        reshard(policy)


def _load_from_rank0(policy: nn.Module, source: nn.Module | None, ctx: DistContext) -> None:
    """Allocate this rank's shards and fill them from rank 0's ``source`` (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    policy.to_empty(device=ctx.device)
    full = {POLICY_PREFIX + k: v for k, v in source.state_dict().items()} if source is not None else {}
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(policy, full, options=opts)
    # buffers outside the state dict (rotary tables) are left uninitialised by to_empty
    own = dict(source.named_buffers()) if source is not None else {}
    for name, b in policy.named_buffers():
        if ctx.rank == 0:
            b.copy_(own[name.removeprefix(POLICY_PREFIX)])
        dist.broadcast(b, src=0)


@torch.no_grad()
def _first_forward(policy: nn.Module, device: torch.device) -> None:
    """FSDP2 takes the first module to run a forward as its root, and generation calls the decoder
    layers without the root: run the root once now (collective; two rows of two tokens)."""
    from gspo.model.logprobs import make_layout

    V = unwrap(policy, "transformers").config.vocab_size
    ids = (torch.arange(4, device=device).view(2, 2) + 5) % V
    ones = torch.ones_like(ids)
    policy(make_layout(ids, ones, ids, ones, "rows"), ids, ones)
    reshard(policy)


def rollout_model(model: nn.Module) -> nn.Module:
    """The module the rollout engine samples from: the trainer's own HF module (under FSDP, used
    inside :func:`gathered`)."""
    return unwrap(model, "model")


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Every FSDP2 group's parameters unsharded while held (collective on entry: every rank enters),
    so that the forwards inside run no collective: ranks sample different lengths, and rank 0
    evaluates alone. Costs one full model per rank while held (none outside FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    from gspo.model.expert_parallel import whole_experts

    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    layers = [m for m in groups if m is not model]  # generation never calls the root's forward
    for m in layers:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        for m in groups:
            m.unshard()
        with whole_experts(model):  # expert parallelism: every expert local, no all-to-all
            yield
    finally:
        for m in groups:
            m.reshard()
        for m in layers:
            m.set_reshard_after_forward(True, recurse=False)


def is_fsdp(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: Any, ctx: DistContext) -> dict[str, torch.Tensor] | None:
    """Unsharded HF-named model state on rank 0 (collective; every rank must call). None: use the
    module's own."""
    if not _distributed(ctx):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if is_fsdp(model):
        reshard(model)
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # a tied weight once (under its first name), as save_pretrained writes it from the module
    policy = unwrap(model, "policy")
    tied = {n for n, _ in policy.named_parameters(remove_duplicate=False)} - {
        n for n, _ in policy.named_parameters()
    }
    return (
        {k.removeprefix(POLICY_PREFIX): v for k, v in sd.items() if k not in tied} if ctx.rank == 0 else None
    )


# ------------------------------------------------------------------------------------------------
# optimizer state: ``optimizer.state_dict()`` (int keys) in one process, FQN-keyed full state in N


def _param_names(model: Any, optimizer: torch.optim.Optimizer) -> list[str]:
    """FQN of each optimizer parameter, in ``param_groups`` order (the int ids of ``state_dict()``)."""
    names = {id(p): n for n, p in unwrap(model, "policy").named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _int_to_fqn(model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    names = _param_names(model, optimizer)
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[i]: v for i, v in state["state"].items()}, "param_groups": groups}


def _fqn_to_int(model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    index = {n: i for i, n in enumerate(_param_names(model, optimizer))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
    return {"state": {index[n]: v for n, v in state["state"].items()}, "param_groups": groups}


def _int_keyed(state: dict[str, Any]) -> bool:
    return all(isinstance(p, int) for g in state.get("param_groups", []) for p in g["params"])


def optimizer_state_dict(model: Any, optimizer: torch.optim.Optimizer, ctx: DistContext) -> dict[str, Any]:
    """Full (unsharded) optimizer state, keyed by parameter name when distributed (collective)."""
    if not _distributed(ctx):
        return optimizer.state_dict()
    if not optimizer.state:  # not stepped yet: torch's API would initialise it with a zero step, which
        return _int_to_fqn(model, optimizer, optimizer.state_dict())  # shifts AdamW's bias correction
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=opts)


def load_optimizer_state_dict(
    model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any], ctx: DistContext
) -> None:
    """Load a state saved by :func:`optimizer_state_dict` with any process count (collective)."""
    if not _distributed(ctx):
        optimizer.load_state_dict(state if _int_keyed(state) else _fqn_to_int(model, optimizer, state))
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if _int_keyed(state):
        state = _int_to_fqn(model, optimizer, state)
    if not state["state"]:  # nothing stepped yet (or a stateless optimizer): hyper-parameters only
        for g, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
            g.update({k: v for k, v in saved.items() if k != "params"})
        return
    # every rank read the checkpoint, so each passes the full state (no rank-0 broadcast needed)
    opts = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, state, options=opts)


# ------------------------------------------------------------------------------------------------
# collectives on host values


def gather_objects(obj: Any, ctx: DistContext) -> list[Any]:
    if not _distributed(ctx):
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def global_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over ranks (``t`` itself in one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    t = t.clone()
    dist.all_reduce(t)
    return t


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """True on every rank when ``flag`` is true on any (collective)."""
    if not _distributed(ctx):
        return flag
    t = torch.tensor([float(flag)], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def mean_metrics(metrics: dict[str, float], ctx: DistContext) -> dict[str, float]:
    """Mean of each metric over ranks (keys must be identical on all ranks)."""
    if not _distributed(ctx) or not metrics:
        return metrics
    keys = sorted(metrics)
    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return dict(zip(keys, (t / ctx.world_size).tolist(), strict=True))


def cleanup(ctx: DistContext) -> None:
    if _distributed(ctx):
        dist.barrier()  # gloo teardown aborts intermittently without it
        dist.destroy_process_group()
    return None
