"""The MoE routers of transformers >= 5 and their score formulas (private: classes inside
``transformers.models.*.modeling_*`` and the formulas of their ``forward``).

In transformers 5 every supported MoE block delegates routing to a router module with the contract
``forward(hidden) -> (router_logits [N, E], router_scores [N, k], router_indices [N, k])``;
:mod:`gspo.model.routing` hooks that output. Replay needs each router's scores at forced indices, so
each function below is the router's forward with ``torch.topk`` replaced by the forced indices, op for
op: replaying a router's own indices gives bit-identical scores (pinned by tests/test_routing.py).
transformers 4.x routes inline in the MoE block (no router module), so nothing matches there and
:mod:`gspo.model.routing` reports the model's MoE as unsupported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gspo.compat import installed_version

# (router, router_logits [N, E], forced indices [N, k]) -> scores [N, k]; the caller casts the result
# to the dtype of the router's own scores, which is where every supported router ends up.
ScoreFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]

#: the first transformers release with the router contract above
MIN_VERSION = (5, 0)


@functools.cache
def applies() -> bool:
    """Whether the installed transformers has router modules (>= 5)."""
    v = installed_version("transformers")
    return v is not None and v >= MIN_VERSION


def _renorm(top_Nk: torch.Tensor) -> torch.Tensor:
    return top_Nk / top_Nk.sum(dim=-1, keepdim=True)


def _softmax_norm_if_flag(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE, Qwen2-MoE, OLMoE, FlexOlmo, Qwen3-Next: float softmax, renorm iff ``norm_topk_prob``."""
    top = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, idx)
    return _renorm(top) if router.norm_topk_prob else top


def _softmax_always_norm(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Qwen3.5-MoE, Qwen3-VL-MoE: float softmax, always renormalised."""
    return _renorm(F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, idx))


def _mixtral(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Mixtral, MiniMax: softmax of ``logits.float()``, always renormalised, scores stay float32."""
    return _renorm(F.softmax(logits.float(), dim=-1).gather(-1, idx))


def _granite(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Granite-MoE: softmax over the selected (float32) logits only (= renormalised softmax)."""
    return torch.softmax(logits.gather(-1, idx), dim=-1)


def _deepseek_v3(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3, GLM-4.5 (Glm4Moe), dots.llm1: sigmoid scores; the correction bias and group limit
    only affect the *choice*, so they drop out; optional renorm (+1e-20), times the scaling factor."""
    top = logits.sigmoid().gather(1, idx)
    if router.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * router.routed_scaling_factor


def _tf(model_type: str, cls_name: str) -> tuple[str, str]:
    return f"transformers.models.{model_type}.modeling_{model_type}", cls_name


#: (module, class name) -> score function. Keyed by names so nothing is imported to build it and
#: remote-code look-alikes (whose formula may differ) are not matched.
SCORE_FNS: dict[tuple[str, str], ScoreFn] = {
    _tf("qwen3_moe", "Qwen3MoeTopKRouter"): _softmax_norm_if_flag,
    _tf("qwen2_moe", "Qwen2MoeTopKRouter"): _softmax_norm_if_flag,
    _tf("olmoe", "OlmoeTopKRouter"): _softmax_norm_if_flag,
    _tf("flex_olmo", "FlexOlmoTopKRouter"): _softmax_norm_if_flag,
    _tf("qwen3_next", "Qwen3NextTopKRouter"): _softmax_norm_if_flag,
    _tf("qwen3_5_moe", "Qwen3_5MoeTopKRouter"): _softmax_always_norm,
    _tf("qwen3_vl_moe", "Qwen3VLMoeTextTopKRouter"): _softmax_always_norm,
    _tf("mixtral", "MixtralTopKRouter"): _mixtral,
    _tf("minimax", "MiniMaxTopKRouter"): _mixtral,
    _tf("granitemoe", "GraniteMoeTopKRouter"): _granite,
    _tf("granitemoeshared", "GraniteMoeSharedTopKRouter"): _granite,
    _tf("granitemoehybrid", "GraniteMoeHybridTopKRouter"): _granite,
    _tf("deepseek_v3", "DeepseekV3TopkRouter"): _deepseek_v3,
    _tf("glm4_moe", "Glm4MoeTopkRouter"): _deepseek_v3,
    _tf("dots1", "Dots1TopkRouter"): _deepseek_v3,
}
SUPPORTED_ROUTERS: tuple[str, ...] = tuple(cls for _, cls in SCORE_FNS)
UPSTREAM: list[tuple[str, str]] = list(SCORE_FNS)


def score_fn(module: nn.Module) -> ScoreFn | None:
    """The registered score function of ``module``'s class or of a base class (wrappers that subclass
    the router, e.g. FSDP2's ``FSDP<cls>``, keep working); None for any other module, and for every
    module under transformers < 5."""
    if not applies():
        return None
    for cls in type(module).__mro__:
        fn = SCORE_FNS.get((cls.__module__, cls.__name__))
        if fn is not None:
            return fn
    return None
