"""gspo: Group Sequence Policy Optimization for RL post-training of causal LMs.

``gspo.train(gspo.Config(steps=50))`` makes the same run as ``gspo train --steps 50``.

The names below are imported when first used (PEP 562), so that ``gspo``'s command line reads and
checks its arguments without first importing transformers and the study tools: a bad flag is refused
in the time it takes to import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "LOSSES",
    "Config",
    "LossInputs",
    "LossOutput",
    "LossSpec",
    "cispo_loss",
    "clip_cov_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "gmpo_loss",
    "group_advantages",
    "grpo_loss",
    "grpo_seq_mask_loss",
    "gspo_loss",
    "gspo_token_loss",
    "kl_cov_loss",
    "loss_inputs",
    "luspo_loss",
    "sapo_loss",
    "sapo_token_loss",
    "train",
    "vespo_loss",
]
__version__ = "0.1.0"
# each name imported on first use -> its module: these five, and the rest of ``__all__`` from gspo.losses
_EXPORTS = {n: "gspo.losses" for n in __all__} | {
    "LossInputs": "gspo.loss_prologue",
    "loss_inputs": "gspo.loss_prologue",
    "Config": "gspo.config",
    "train": "gspo.launch",
    "group_advantages": "gspo.advantages",
}

if TYPE_CHECKING:  # what type checkers and IDEs see
    from gspo.advantages import group_advantages
    from gspo.config import Config
    from gspo.launch import train
    from gspo.loss_prologue import LossInputs, loss_inputs
    from gspo.losses import (
        LOSSES,
        LossOutput,
        LossSpec,
        cispo_loss,
        clip_cov_loss,
        dppo_kl_loss,
        dppo_tv_loss,
        gmpo_loss,
        grpo_loss,
        grpo_seq_mask_loss,
        gspo_loss,
        gspo_token_loss,
        kl_cov_loss,
        luspo_loss,
        sapo_loss,
        sapo_token_loss,
        vespo_loss,
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gspo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
