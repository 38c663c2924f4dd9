"""The one training config: flat attributes (``cfg.lr``), declared in feature groups, each field
documented by the string below it.

Values come from (later wins) the defaults here, a YAML file (``--config run.yaml``) and CLI flags
(``--group-size 8``; dashes or underscores), converted to the fields' types by pydantic
(:mod:`gspo.config.parse`). Every value is validated in :meth:`Config.validate`: each field's own
rules (its ``Annotated`` markers), the hard limits of :mod:`gspo.limits`, then each group's rules that
relate fields. Bad input raises :class:`GspoError` naming the field.

Groups (in field order): :class:`RunSetup`, :class:`ModelAndTask`, :class:`WarmStart`, :class:`Algorithm`,
:class:`Mismatch`, :class:`Async`, :class:`SampleFilters`, :class:`PolicyForward`, :class:`Rollout`,
:class:`MultiTurn`, :class:`Optimization`, :class:`LoRA`, :class:`Evaluation`, :class:`Distributed`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ConfigDict, TypeAdapter, with_config

from gspo.config.algorithm import Algorithm, Async, Mismatch, PolicyForward, SampleFilters
from gspo.config.checks import Group, check_fields, check_types, field_kinds
from gspo.config.parse import MAX_CONFIG_BYTES, coerce, load_yaml, load_yaml_lines, parse_values
from gspo.config.rollout import MultiTurn, Rollout
from gspo.config.run import ModelAndTask, RunSetup, WarmStart
from gspo.config.training import Distributed, Evaluation, LoRA, Optimization
from gspo.errors import GspoError

__all__ = [
    "MAX_CONFIG_BYTES",
    "Config",
    "coerce",
    "field_docs",
    "field_type",
    "load_yaml",
    "make_config",
    "parse_values",
    "save_yaml",
]


# a dataclass lists its bases' fields from the last base to the first: the groups in reverse reading order
@with_config(ConfigDict(extra="forbid"))
@dataclass
class Config(
    Distributed, Evaluation, LoRA, Optimization, MultiTurn, Rollout, PolicyForward, SampleFilters,
    Async, Mismatch, Algorithm, WarmStart, ModelAndTask, RunSetup,
):  # fmt: skip
    """Every group's fields, flat: ``cfg.lr``, ``dataclasses.replace(cfg, seed=1)``."""

    def validate(self) -> Config:
        """Check every value; raise GspoError naming the first bad field."""
        from gspo.limits import check_config

        check_types(self)
        check_fields(self, late=False)  # choices, lower bounds, finite numbers
        check_config(self)  # upper bounds before any relation between fields is computed from them
        check_fields(self, late=True)
        for group in GROUPS:
            group._rules(self)  # each group's own, called by class: one per group, none shadowed
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


@functools.cache
def _docs() -> dict[str, str]:
    docs = {}
    for group in GROUPS:  # pydantic reads the docstrings of a class's own fields: ask each group
        for name, prop in TypeAdapter(group).json_schema()["properties"].items():
            docs[name] = " ".join(prop.get("description", "").split())
    return docs


def field_docs() -> dict[str, str]:
    """Field name -> its docstring (the string under each field), whitespace collapsed."""
    return dict(_docs())


def field_type(name: str) -> type:
    """The non-None type of field ``name`` (``int | None`` -> int)."""
    return field_kinds(Config)[name][0]


def make_config(yaml_path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults <- YAML file <- overrides (already coerced), validated. A value of the file that
    validation refuses is named by the file and its line too."""
    values, lines = load_yaml_lines(yaml_path) if yaml_path else ({}, {})
    values.update(overrides or {})
    try:
        return Config(**values).validate()
    except GspoError as e:
        field = re.match(r"config field '(\w+)'", str(e))
        if field and field[1] in lines and field[1] not in (overrides or {}):
            raise GspoError(f"{yaml_path}:{lines[field[1]]}: {e}") from None
        raise


def save_yaml(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
