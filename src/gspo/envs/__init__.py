"""Multi-turn environments: the interface (:mod:`.base`), tools (:mod:`.tools`), the multi-turn
rollout (:mod:`.rollout`) and the warm start on demonstrations (:mod:`.sft`)."""

from gspo.envs.base import Env, Limits, Step, TaskEnv
from gspo.envs.tools import ToolEnv, calculator, parse_tool_call

__all__ = ["Env", "Limits", "Step", "TaskEnv", "ToolEnv", "calculator", "parse_tool_call"]
