"""gspo: Group Sequence Policy Optimization for RL post-training of causal LMs.

``gspo.train(gspo.Config(steps=50))`` makes the same run as ``gspo train --steps 50``.
"""

from gspo import train  # the training package, callable: gspo.train(cfg)
from gspo.advantages import group_advantages
from gspo.config import Config
from gspo.loss_inputs import LossInputs, loss_inputs
from gspo.losses import (
    LOSSES,
    LossOutput,
    LossSpec,
    cispo_loss,
    gmpo_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
    sapo_loss,
    sapo_token_loss,
)

__all__ = [
    "LOSSES",
    "Config",
    "LossInputs",
    "LossOutput",
    "LossSpec",
    "cispo_loss",
    "gmpo_loss",
    "group_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "loss_inputs",
    "sapo_loss",
    "sapo_token_loss",
    "train",
]
__version__ = "0.1.0"
