"""Private transformers model/config attributes and the save-time weight conversion.

* ``config._attn_implementation``: the attention kernel a model runs; transformers exposes it only
  under this name (the one its own docs use).
* ``PreTrainedModel._no_split_modules``: the repeated blocks (decoder layers) transformers never
  splits; FSDP shards one group per block.
* ``PreTrainedModel._init_weights``: where transformers computes a module's buffers (rotary tables);
  a model built on the meta device and sharded needs them recomputed on every rank.
* ``PreTrainedModel._keys_to_ignore_on_save``, ``modeling_utils.remove_tied_weights_from_state_dict``
  and ``core_model_loading.revert_weight_conversion`` (5.x): what ``save_pretrained`` does to the
  in-memory state dict before writing it (e.g. transformers 5 keeps MoE experts fused as
  ``experts.gate_up_proj [E, 2I, H]`` and writes ``experts.<e>.gate_proj.weight``...); the vLLM
  weight sync streams exactly that. transformers 4.x has no conversions: its state dict already
  carries the checkpoint names.
"""

from __future__ import annotations

from typing import Any

import torch

from gspo.compat import installed_version
from gspo.errors import GspoError

#: transformers releases from which the save-time conversion lives in ``core_model_loading``
CONVERSION_MIN_VERSION = (5, 0)

UPSTREAM: list[tuple[str, str]] = [
    ("transformers", "PretrainedConfig._attn_implementation"),
    ("transformers", "PreTrainedModel._no_split_modules"),
    ("transformers", "PreTrainedModel._keys_to_ignore_on_save"),
    ("transformers", "PreTrainedModel._init_weights"),
]
#: needed only where :func:`applies` (transformers >= 5)
UPSTREAM_5: list[tuple[str, str]] = [
    ("transformers.core_model_loading", "revert_weight_conversion"),
    ("transformers.modeling_utils", "remove_tied_weights_from_state_dict"),
]


def applies() -> bool:
    """Whether the installed transformers has the 5.x save-time conversion (``UPSTREAM_5``)."""
    v = installed_version("transformers")
    return v is not None and v >= CONVERSION_MIN_VERSION


def attn_implementation(model: Any) -> str:
    """The attention kernel ``model`` runs (``sdpa``, ``eager``, ``flash_attention_2``, ...; "" if unset)."""
    return getattr(model.config, "_attn_implementation", None) or ""


def no_split_modules(model: Any) -> set[str]:
    """Class names of the blocks transformers never splits across devices (the decoder layers)."""
    return set(getattr(model, "_no_split_modules", None) or [])


def save_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The state dict ``save_pretrained`` starts from (references to the live tensors, no copies):
    without keys the model ignores on save and without tied duplicates (``lm_head.weight`` of a
    model with tied embeddings)."""
    sd = dict(model.state_dict())
    for k in getattr(model, "_keys_to_ignore_on_save", None) or ():
        sd.pop(k, None)
    from torch.distributed.tensor import DTensor

    if any(isinstance(v, DTensor) for v in sd.values()):  # FSDP2 shards have no storage to compare
        names = {n for n, _ in model.named_parameters()}
        tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - names
        return {k: v for k, v in sd.items() if k not in tied}
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # transformers 4.x: drop aliases by storage
        seen: set[tuple[int, int]] = set()
        out = {}
        for k, v in sd.items():
            key = (v.untyped_storage().data_ptr(), v.storage_offset())
            if key not in seen:
                seen.add(key)
                out[k] = v
        return out
    return remove_tied_weights_from_state_dict(sd, model)


def init_buffers(model: Any) -> None:
    """Compute the buffers a model built on the meta device lost to ``to_empty`` (rotary tables):
    ``PreTrainedModel._init_weights`` on each module holding buffers and no parameters, which is where
    transformers computes them (parameters are left alone: they are loaded next)."""
    for module in model.modules():
        if any(True for _ in module.buffers(recurse=False)) and not any(
            True for _ in module.parameters(recurse=False)
        ):
            model._init_weights(module)


def revert_weight_conversion(model: Any, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` (a part of :func:`save_state_dict`) named and laid out as ``save_pretrained``
    writes it: transformers' own ``revert_weight_conversion`` (5.x); unchanged under 4.x."""
    try:
        from transformers.core_model_loading import revert_weight_conversion as revert
    except ImportError:
        if applies():
            import transformers

            raise GspoError(
                f"transformers {transformers.__version__} has no core_model_loading.revert_weight_conversion; "
                "gspo's vLLM weight sync needs updating for it (gspo/compat/transformers_model.py)"
            ) from None
        return state_dict
    return revert(model, state_dict)
