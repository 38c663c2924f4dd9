"""The one training config: flat attributes (``cfg.lr``), declared in feature groups, each field
documented by the string below it.

Values come from (later wins) the defaults here, a YAML file (``--config run.yaml``) and CLI flags
(``--group-size 8``; dashes or underscores), converted to the fields' types by pydantic
(:mod:`gspo.config.parse`). Every value is validated in :meth:`Config.validate`: each field's own
rules (its ``Annotated`` markers), the hard limits of :mod:`gspo.limits`, then each group's rules that
relate fields. Bad input raises :class:`GspoError` naming the field.

Groups (in field order): :class:`RunSetup`, :class:`ModelAndTask`, :class:`WarmStart`, :class:`Algorithm`,
:class:`Mismatch`, :class:`Async`, :class:`SampleFilters`, :class:`PolicyForward`, :class:`Sampling`,
:class:`MultiTurn`, :class:`Optimization`, :class:`LoRA`, :class:`Evaluation`, :class:`Distributed`.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter

from gspo.config.checks import field_kinds
from gspo.config.parse import MAX_CONFIG_BYTES, coerce, load_yaml, load_yaml_lines, parse_values
from gspo.config.schema import GROUPS, Config
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
