"""gspo: Group Sequence Policy Optimization for RL post-training of causal LMs."""

from gspo.advantages import group_advantages
from gspo.losses import LOSSES, grpo_loss, gspo_loss, gspo_token_loss

__all__ = ["LOSSES", "group_advantages", "grpo_loss", "gspo_loss", "gspo_token_loss"]
__version__ = "0.1.0"
