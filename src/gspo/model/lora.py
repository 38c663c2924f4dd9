"""LoRA through PEFT (optional: ``pip install gspo[peft]``). MoE routers are never adapted, so
Routing Replay and the volatility metric see the same router modules as in full fine-tuning."""

from __future__ import annotations

import copy
from typing import Any

from gspo.errors import GspoError, one_line
from gspo.model.unwrap import is_peft, unwrap

__all__ = ["apply_lora", "hf_module", "is_peft", "merged_copy"]


def apply_lora(model: Any, rank: int, alpha: float, targets: str) -> Any:
    """Wrap ``model`` in a PEFT LoRA model; only the adapters require grad afterwards."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise GspoError("config field 'lora_rank': peft is not installed (pip install gspo[peft])") from None
    import torch

    from gspo.model.routing import find_routers

    routers = set(map(id, find_routers(model).values()))
    if targets == "all-linear":
        # spelled out: PEFT's own "all-linear" also wraps MoE routers and fused expert parameters
        target = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, mod in model.named_modules()
                if isinstance(mod, torch.nn.Linear)
                and id(mod) not in routers
                and mod is not model.get_output_embeddings()
            }
        )
    else:
        target = [t.strip() for t in targets.split(",") if t.strip()]
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=target, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, cfg)
    except ValueError as e:
        raise GspoError(f"config field 'lora_target_modules': {one_line(e, typed=False)}") from None


def hf_module(model: Any) -> Any:
    """The transformers model (LoRA layers injected in place) inside a PEFT wrapper, else ``model``:
    ``unwrap(model, "transformers")`` (:func:`gspo.model.unwrap.unwrap`, which also removes DDP and
    :class:`~gspo.model.logprobs.PolicyLogprobs`)."""
    return unwrap(model, "transformers")


def merged_copy(model: Any) -> Any:
    """A plain transformers model with the adapters merged in (what ``from_pretrained`` users want)."""
    return copy.deepcopy(model).merge_and_unload() if is_peft(model) else model
