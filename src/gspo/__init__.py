"""gspo: Group Sequence Policy Optimization for RL post-training of causal LMs.

``gspo.train(gspo.Config(steps=50))`` makes the same run as ``gspo train --steps 50``.
"""

from gspo.advantages import group_advantages
from gspo.config import Config
from gspo.launch import train
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
    luspo_loss,
    sapo_loss,
    sapo_token_loss,
    vespo_loss,
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
    "luspo_loss",
    "sapo_loss",
    "sapo_token_loss",
    "train",
    "vespo_loss",
]
__version__ = "0.1.0"
