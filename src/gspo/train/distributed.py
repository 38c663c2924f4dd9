"""Process-group setup and model wrapping for data-parallel training.

The loop calls only the functions here, so one process and N processes run the same code: with
``WORLD_SIZE`` unset or 1 every function is a no-op; under ``torchrun`` (``WORLD_SIZE > 1``) they set up
the process group (gloo on CPU, NCCL on CUDA), wrap the model (FSDP2 or DDP), and gather / reduce.

The loop computes log-probs as ``base(...)`` (``model.model``) followed by the LM head weight used
directly (no full-vocabulary logits on prompt positions), so the wrapper's *root* forward is never
called. Both wrappers are therefore hooked on the base model:

* FSDP2: ``fully_shard`` each decoder layer, then the root (the HF module, which keeps the LM head and,
  with ``tie_word_embeddings``, the shared embedding in one group); the root's forward hooks are moved
  from the HF module to its base model, so they run on the loop's ``base(...)`` call.
* DDP: a :class:`DistributedDataParallel` whose pre/post-forward bookkeeping runs as hooks on the base
  model (attribute access falls through to the HF module, so ``model.config`` etc. keep working).

Each rank samples its own prompts and stops at EOS, so its generation forwards differ from the other
ranks'; nothing collective may run inside generation. DDP samples from ``model.module`` (a full
replica). FSDP samples from an unsharded copy made before sharding, refreshed after every update by
:func:`sync_rollout_model` (collective). That copy costs one extra full model per rank.
"""

from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gspo.config import Config


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    rollout_copy: Any = field(default=None, repr=False)
    """FSDP with world > 1: the unsharded module generation runs on (set by :func:`wrap`)."""


def _device(cfg: Config, local_rank: int) -> torch.device:
    if cfg.device == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(cfg.device)


def _distributed(ctx: DistContext) -> bool:
    return ctx.world_size > 1 and dist.is_available() and dist.is_initialized()


def setup(cfg: Config) -> DistContext:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(cfg, local_rank)
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif cfg.threads == 0:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        if not dist.is_initialized():
            if device.type == "cuda":
                dist.init_process_group("nccl", device_id=device)
            else:
                dist.init_process_group("gloo")
    return DistContext(rank, world, local_rank, device)


# ------------------------------------------------------------------------------------------------
# wrapping


def _base(model: nn.Module) -> nn.Module:
    """The HF base model (``model.model``) the loop runs; the module itself if it has none."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    return base if isinstance(base, nn.Module) else model


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        layers = list(getattr(_base(model), "layers", []))
    return layers


class _BaseHookedDDP(nn.parallel.DistributedDataParallel):
    """DDP whose forward bookkeeping runs around the HF *base* model's forward (what the loop calls);
    unknown attributes fall through to the wrapped HF module (``base_model_prefix``, ``config``, ...)."""

    def __init__(self, module: nn.Module, **kw: Any) -> None:
        super().__init__(module, **kw)
        base = _base(module)
        base.register_forward_pre_hook(self._base_pre_forward, with_kwargs=True, prepend=True)
        base.register_forward_hook(self._base_post_forward)

    def _base_pre_forward(self, _mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not torch.is_grad_enabled():  # pi_old / generation forwards: nothing to synchronise
            return args, kwargs
        return self._pre_forward(*args, **kwargs)

    def _base_post_forward(self, _mod: nn.Module, _args: tuple, output: Any) -> Any:
        return self._post_forward(output) if torch.is_grad_enabled() else output

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # the hooks on the base model do DDP's work
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module" or "module" not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self._modules["module"], name)


def _broadcast_from_rank0(model: nn.Module) -> None:
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=0)


def _fsdp(model: nn.Module, ctx: DistContext) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    base = _base(model)
    if base is not model:  # the loop calls base(...) directly: run the root's hooks around it
        state = model._get_fsdp_state()
        state._pre_forward_hook_handle.remove()
        state._post_forward_hook_handle.remove()
        state._pre_forward_hook_handle = base.register_forward_pre_hook(
            state._pre_forward, prepend=True, with_kwargs=True
        )
        state._post_forward_hook_handle = base.register_forward_hook(state._post_forward, prepend=False)
    return model


def wrap(model: Any, cfg: Config, ctx: DistContext) -> Any:
    """Data-parallel wrapper (FSDP2 or DDP) when world_size > 1; the model itself otherwise."""
    if not _distributed(ctx):
        return model
    _broadcast_from_rank0(model)  # identical replicas whatever happened before (init, warm start)
    if cfg.parallel == "ddp":
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # buffers (rotary tables) never change; syncing them is a collective inside every forward
        params = inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
        no_sync = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in params
            else {"broadcast_buffers": False}
        )
        return _BaseHookedDDP(model, device_ids=ids, **no_sync)
    ctx.rollout_copy = copy.deepcopy(model).requires_grad_(False)  # tying survives deepcopy
    return _fsdp(model, ctx)


def unwrap(model: Any) -> Any:
    """The plain HF module inside a DDP wrapper (FSDP2 modules are the HF module itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def rollout_model(model: Any, ctx: DistContext) -> Any:
    """The module the rollout engine samples from: one without collectives in its forward."""
    if ctx.rollout_copy is not None:
        return ctx.rollout_copy
    return unwrap(model)


def _reshard(model: nn.Module) -> None:
    """Put every FSDP group back to its sharded parameters (no-grad forwards leave the root unsharded)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


@torch.no_grad()
def sync_rollout_model(model: Any, rollout: Any, ctx: DistContext) -> None:
    """Copy updated weights into the rollout module when it is a separate copy (collective)."""
    if rollout is None or rollout is unwrap(model):
        return None
    from torch.distributed.tensor import DTensor

    _reshard(model)
    dst = dict(rollout.named_parameters())
    for name, p in model.named_parameters():
        dst[name].copy_(p.full_tensor() if isinstance(p, DTensor) else p)
    return None


def _is_fsdp(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: Any, ctx: DistContext) -> dict[str, torch.Tensor] | None:
    """Unsharded model state on rank 0 (collective; every rank must call). None: use the module's own."""
    if not _distributed(ctx):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if _is_fsdp(model):
        _reshard(model)
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if ctx.rank == 0 else None


# ------------------------------------------------------------------------------------------------
# optimizer state: ``optimizer.state_dict()`` (int keys) in one process, FQN-keyed full state in N


def _param_names(model: Any, optimizer: torch.optim.Optimizer) -> list[str]:
    """FQN of each optimizer parameter, in ``param_groups`` order (the int ids of ``state_dict()``)."""
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
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
