"""The :class:`Config` class: every group's fields, flat (the groups are in the modules beside it)."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, with_config

from gspo.config.algorithm import Algorithm, Async, Mismatch, PolicyForward, SampleFilters
from gspo.config.checks import Group, check_fields, check_types
from gspo.config.run import ModelAndTask, RunSetup, WarmStart
from gspo.config.sampling import MultiTurn, Sampling
from gspo.config.training import Distributed, Evaluation, LoRA, Optimization


# a dataclass lists its bases' fields from the last base to the first: the groups in reverse reading order
@with_config(ConfigDict(extra="forbid"))
@dataclass
class Config(
    Distributed, Evaluation, LoRA, Optimization, MultiTurn, Sampling, PolicyForward, SampleFilters,
    Async, Mismatch, Algorithm, WarmStart, ModelAndTask, RunSetup,
):  # fmt: skip
    """Every group's fields, flat: ``cfg.lr``, ``dataclasses.replace(cfg, seed=1)``."""

    def __post_init__(self) -> None:
        # a path given as a pathlib.Path (``output_dir=Path("runs")``) is the string it spells: the
        # config stays plain YAML, and str fields stay str
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, os.PathLike) and "str" in str(f.type) and isinstance(os.fspath(v), str):
                setattr(self, f.name, os.fspath(v))

    def validate(self) -> Config:
        """Check every value; raise GspoError naming the first bad field. Once per set of values: a
        config validated as it stands (the CLI's, then ``gspo.train``'s) is not checked again."""
        from gspo.limits import check_config

        values = dataclasses.asdict(self)
        if self.__dict__.get("_validated") == values:  # not a field: no part of the config itself
            return self
        check_types(self)
        check_fields(self, late=False)  # choices, lower bounds, finite numbers
        check_config(values)  # upper bounds before any relation between fields is computed from them
        check_fields(self, late=True)
        for group in GROUPS:
            group._rules(self)  # each group's own, called by class: one per group, none shadowed
        self.__dict__["_validated"] = dataclasses.asdict(self)
        return self

    @property
    def run_name(self) -> str:
        task = Path(self.task).stem if ("/" in self.task or "." in self.task) else self.task
        task = re.sub(r"[^A-Za-z0-9._-]+", "_", task)  # rg:name:size=8 -> rg_name_size_8
        return self.name or f"{self.algo}-{task}-s{self.seed}"

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name

    def mismatch_high_resolved(self) -> float:
        if self.mismatch_high is not None:
            return self.mismatch_high
        return 5.0 if self.mismatch_correction == "token_mask" else 2.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


GROUPS: tuple[type[Group], ...] = tuple(
    c for c in reversed(Config.__mro__) if issubclass(c, Group) and c not in (Group, Config)
)
# the fields ``gspo eval`` reads from a run's config.yaml (its task and how it was scored) and takes
# as flags; the rest of a run's settings do not change what a checkpoint scores
EVAL_FIELDS = (
    "task", "eval_task", "reward", "prompt_field", "answer_field", "eval_size", "max_new_tokens", "seed",
    "chat_template", "system_prompt", "max_prompt_tokens", "reward_on_error", "reward_timeout_s",
    "env", "max_turns", "max_trajectory_tokens", "tool_concurrency", "tool_tick_steps",
)  # fmt: skip
