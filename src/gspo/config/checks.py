"""Per-field rules, declared beside each field: ``steps: Annotated[int, Ge(1)] = 200``.

Bounds are annotated_types' markers, checked by pydantic; choices are :class:`OneOf`. Parsing a YAML
file or a flag only converts types, and the rules run in :meth:`gspo.config.Config.validate` on the
merged values, so a bad value in a file can still be
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
from typing import Annotated, Any

from annotated_types import Ge, Gt, Interval
from pydantic import ConfigDict, TypeAdapter, ValidationError

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


# bounds are annotated_types' own markers (``Ge``, ``Gt``, ``Interval``), checked by pydantic on the
# merged values; ``late``: after gspo.limits.check_config (its temperature floor speaks first)
BOUNDS: dict[type, tuple[int, bool, Callable[[Any], str]]] = {
    Ge: (1, False, lambda b: f"must be >= {b.ge}"),
    Gt: (2, True, lambda b: f"must be > {b.gt}"),
    Interval: (3, True, lambda b: f"must be in {_interval(b)}"),  # Adam's betas, the lr
}


def _interval(b: Interval) -> str:
    """``[0, 1)``, ``(0, 1]``: an Interval's bounds as written in maths."""
    lo = f"[{b.ge}" if b.ge is not None else f"({b.gt}" if b.gt is not None else "(-inf"
    hi = f"{b.le}]" if b.le is not None else f"{b.lt})" if b.lt is not None else "inf)"
    return f"{lo}, {hi}"


def _kind(rule: Any) -> tuple[int, bool]:
    """(order, late) of a field's rule: a :class:`Rule`'s own, or its bound's (``BOUNDS``)."""
    return (rule.order, rule.late) if isinstance(rule, Rule) else BOUNDS[type(rule)][:2]


@functools.cache
def _adapter(typ: type, bound: Any) -> TypeAdapter:
    return TypeAdapter(Annotated[typ, bound])


def _error(rule: Any, typ: type, value: Any) -> str | None:
    """Why ``value`` breaks ``rule`` (None when it keeps it). A bound passes None, and NaN too: the
    early pass refuses NaN as not finite, after the rules."""
    if isinstance(rule, Rule):
        return rule.error(value)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    try:
        _adapter(typ, rule).validate_python(value)
    except ValidationError:
        return BOUNDS[type(rule)][2](rule)
    return None


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
def field_rules(cls: type) -> dict[str, tuple[Any, ...]]:
    """Field name -> the rules (:class:`Rule`) and bounds (``BOUNDS``) in its ``Annotated`` type, in
    field order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    kinds = (Rule, *BOUNDS)
    return {
        f.name: tuple(m for m in getattr(hints[f.name], "__metadata__", ()) if isinstance(m, kinds))
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
    kinds = field_kinds(type(cfg))
    rules = [(r, name) for name, rs in field_rules(type(cfg)).items() for r in rs if _kind(r)[1] == late]
    for rule, name in sorted(rules, key=lambda rn: _kind(rn[0])[0]):  # stable: field order within a kind
        msg = _error(rule, kinds[name][0], getattr(cfg, name))
        if msg:
            raise bad(cfg, name, msg)
    if not late:
        for f in dataclasses.fields(cfg):
            v = getattr(cfg, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise bad(cfg, f.name, "must be a finite number")
