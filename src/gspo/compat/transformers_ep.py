"""transformers' own expert parallelism (``transformers.distributed``, 5.x) applied to a model gspo
built itself.

Public: ``PreTrainedModel.ep_plan`` (a model's expert-parallel rules, e.g. Qwen3-MoE's
``layers.*.mlp.experts``: ``ep_dispatch_experts``, its ``gate_up_proj`` / ``down_proj``:
``grouped_gemm``). Not exported by the package, so kept here behind a version guard:

* ``transformers.distributed.expert_parallel.apply_expert_parallelism``: shards each experts
  module's weights on dim 0 over the EP mesh (whole experts per rank) and replaces the module's
  ``forward`` (an instance attribute) by the all-to-all token exchange (``AllToAllEP``).
* the experts module's own forward (its class's ``forward``), which the sampler runs on the whole,
  gathered experts (:func:`plain_forward`): generation runs no collective.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch
from torch import nn

from gspo.compat import installed_version
from gspo.errors import GspoError

#: the first transformers release with ``ep_implementation="all_to_all"`` and the (efsdp, ep) meshes
MIN_VERSION = (5, 25)
DISPATCH = "ep_dispatch_experts"

UPSTREAM: list[tuple[str, str]] = [
    ("transformers.distributed.expert_parallel", "apply_expert_parallelism"),
    ("transformers.distributed.expert_parallel", "AllToAllEP"),
    ("transformers", "PreTrainedModel.ep_plan"),
]


@functools.cache
def applies() -> bool:
    """Whether the installed transformers has the expert-parallel API used here."""
    v = installed_version("transformers")
    return v is not None and v >= MIN_VERSION


def check() -> None:
    if not applies():
        raise GspoError(
            "config field 'expert_parallel_size': expert parallelism needs transformers >= "
            f"{'.'.join(map(str, MIN_VERSION))} (transformers.distributed's all-to-all experts)"
        )


def meshes(root: Any) -> dict[str, Any]:
    """The meshes transformers' expert parallelism works on, sliced from ``root``, an ``(efsdp, ep,
    tp)`` mesh of every rank (``tp`` of size 1) that the caller builds with each group's timeout set
    (:func:`gspo.training.distributed.device_mesh`): the layout of transformers' own
    ``initialize_distributed_mesh`` expert mesh (pp and dp_replicate of size 1), whose groups would
    wait torch's default 10 minutes (it passes no timeout). ``dense`` (2-D: replicated over the
    ``world / ep`` groups, sharded within one), ``efsdp`` (the ranks holding the same experts, which
    FSDP2 shards them over), ``ep`` and ``tp`` (size 1: every rank holds its own batch). All slices of
    one mesh, so every parameter's DTensor lives on the same (efsdp, ep) mesh and the gradient norm
    and the optimizer see one mesh."""
    check()
    return {"dense": root[("efsdp", "ep")], "efsdp": root["efsdp"], "ep": root["ep"], "tp": root["tp"]}


def _plan(model: nn.Module) -> dict[str, str]:
    """``model.ep_plan`` with its ``*`` replaced by the layer numbers: parameters before their module
    (the weights are sharded before the module's forward is replaced)."""
    rules = [(re.compile(re.escape(k).replace(r"\*", r"\d+")), v) for k, v in model.ep_plan.items()]
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    plan = {n: v for n in names for rx, v in rules if rx.fullmatch(n)}
    return dict(sorted(plan.items(), key=lambda kv: kv[1] == DISPATCH))


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{qualified name: experts module}`` that the model's EP plan dispatches to ({} for none)."""
    return {n: model.get_submodule(n) for n, style in _plan(model).items() if style == DISPATCH}


def install(model: nn.Module, ep_mesh: Any, tp_mesh: Any) -> dict[str, nn.Module]:
    """Shard ``model``'s experts over ``ep_mesh`` and route their tokens by all-to-all (in place);
    returns the experts modules."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    check()
    plan = _plan(model)
    apply_expert_parallelism(model, ep_mesh, tp_mesh, plan, ep_implementation="all_to_all")
    return {n: model.get_submodule(n) for n, style in plan.items() if style == DISPATCH}


def plain_forward(experts: nn.Module, weights: dict[str, torch.Tensor]) -> Any:
    """The experts' own forward (no token exchange) over the whole ``weights`` (every expert), as a
    callable to put in place of the all-to-all one while the sampler runs."""
    with torch.device("meta"):
        whole = type(experts)(experts.config)
    for name, w in weights.items():
        setattr(whole, name, nn.Parameter(w, requires_grad=False))
    return whole.forward
