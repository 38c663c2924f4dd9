"""Per-field rules, declared beside each field: ``steps: Annotated[int, AtLeast(1)] = 200``.

pydantic ignores these markers: parsing a YAML file or a flag only converts types, and the rules run
in :meth:`gspo.config.Config.validate` on the merged values, so a bad value in a file can still be
overridden by a flag. Every failure is a one-line :class:`GspoError` naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict

from gspo.errors import GspoError

# each group's fields are documented by the string under them, which pydantic reads into the schema
DOCUMENTED = ConfigDict(use_attribute_docstrings=True, extra="forbid")


def bad(cfg: Any, field: str, msg: str) -> GspoError:
    return GspoError(f"config field '{field}': {msg} (got {getattr(cfg, field)!r:.80})")


class Rule:
    """A check of one field's value. Rules run kind by kind (``order``): choices, lower bounds, then
    (after :func:`gspo.limits.check_config`) the ``late`` kinds."""

    order = 0
    late = False

    def error(self, value: Any) -> str | None:
        raise NotImplementedError


@dataclass(frozen=True)
class OneOf(Rule):
    """One of ``allowed``: a tuple (None in it: the field may be None) or a function returning one,
    for choices owned by another module (imported when first checked)."""

    allowed: tuple[Any, ...] | Callable[[], tuple[Any, ...]]

    def error(self, value: Any) -> str | None:
        allowed = self.allowed() if callable(self.allowed) else self.allowed
        if value in allowed:
            return None
        return f"must be one of {', '.join(str(a) for a in allowed if a is not None)}"


@dataclass(frozen=True)
class AtLeast(Rule):
    """``>= low`` (None passes; NaN too, refused as not finite instead)."""

    low: int
    order = 1

    def error(self, value: Any) -> str | None:
        return f"must be >= {self.low}" if value is not None and value < self.low else None


@dataclass(frozen=True)
class Positive(Rule):
    """``> 0``; late, so that the temperature floor of gspo.limits speaks first."""

    order, late = 2, True

    def error(self, value: Any) -> str | None:
        return None if value > 0 else "must be > 0"


@dataclass(frozen=True)
class Fraction(Rule):
    """In ``[0, 1)`` (Adam's betas)."""

    order, late = 3, True

    def error(self, value: Any) -> str | None:
        return None if 0 <= value < 1 else "must be in [0, 1)"


class Group:
    """A feature's fields (a dataclass, each field documented by the string under it) and its
    cross-field rules. :class:`gspo.config.Config` inherits every group: attribute access stays flat."""

    @staticmethod
    def _rules(cfg: Any) -> None:
        """Rules that relate fields, run after every single-field rule passed (raise :func:`bad`)."""


@functools.cache
def field_kinds(cls: type) -> dict[str, tuple[type, bool]]:
    """Field name -> (its non-None type, whether it may be None): ``int | None`` -> (int, True)."""
    kinds = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint)
        optional = type(None) in args
        kinds[name] = (next(a for a in args if a is not type(None)) if optional else hint, optional)
    return kinds


@functools.cache
def field_rules(cls: type) -> dict[str, tuple[Rule, ...]]:
    """Field name -> the rules in its ``Annotated`` type, in field order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {
        f.name: tuple(m for m in getattr(hints[f.name], "__metadata__", ()) if isinstance(m, Rule))
        for f in dataclasses.fields(cls)
    }


def check_types(cfg: Any) -> None:
    """Every value of its annotated type: a Config built in Python skips parsing, so a mapping as
    ``name`` or a string as ``steps`` fails here, naming the field, not deep inside training."""
    for name, (typ, optional) in field_kinds(type(cfg)).items():
        v = getattr(cfg, name)
        if v is None and optional:
            continue
        if typ is bool:
            ok = isinstance(v, bool) or (isinstance(v, numbers.Integral) and v in (0, 1))
        elif typ in (int, float):
            ok = isinstance(v, numbers.Integral if typ is int else numbers.Real) and not isinstance(v, bool)
        else:
            ok = isinstance(v, typ)
        if not ok:
            raise GspoError(
                f"config field '{name}': expects {typ.__name__}, got {type(v).__name__} {v!r:.60}"
            )


def check_fields(cfg: Any, late: bool) -> None:
    """The fields' own rules, kind by kind, each kind in field order; the early pass ends refusing inf
    and NaN, which pass every comparison that follows."""
    rules = [(r, name) for name, rs in field_rules(type(cfg)).items() for r in rs if r.late == late]
    for rule, name in sorted(rules, key=lambda rn: rn[0].order):  # stable: field order within a kind
        msg = rule.error(getattr(cfg, name))
        if msg:
            raise bad(cfg, name, msg)
    if not late:
        for f in dataclasses.fields(cfg):
            v = getattr(cfg, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise bad(cfg, f.name, "must be a finite number")
