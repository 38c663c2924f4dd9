"""Config values from text: a YAML file's scalars and the command line's strings, converted by pydantic
to each field's type. Only types: the rules run later, on the merged values, in ``Config.validate``."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from gspo.config.checks import field_kinds
from gspo.errors import GspoError

MAX_CONFIG_BYTES = 1 << 20  # a config is a few dozen keys: anything larger is not one
BOOL_WORDS = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(
    ("0", "false", "no", "off"), False
)


def _refuse(msg: str) -> PydanticCustomError:
    return PydanticCustomError("gspo", msg)


class FromText:
    """Mixin of :class:`gspo.config.Config`: what a YAML scalar or flag string means for a field where
    pydantic's lax mode differs (it takes ``t`` for a bool, ``True`` for a number, ``'2.0'`` for an
    int, and no number for a str), and what it never is (a container, a NUL character)."""

    @field_validator("*", mode="before")
    @classmethod
    def _from_text(cls, value: Any, info: ValidationInfo) -> Any:
        typ, optional = field_kinds(cls)[info.field_name]
        if isinstance(value, (dict, list, tuple, set)):  # e.g. a YAML mapping (or alias bomb) as a name
            raise _refuse(f"expects {typ.__name__}, got a {type(value).__name__}")
        if isinstance(value, str) and "\0" in value:
            raise _refuse("holds a NUL character")
        if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
            if optional:  # 'none' / 'null': how a flag says None
                return None
            raise _refuse("must not be empty")
        if typ is bool:
            word = value if isinstance(value, bool) else BOOL_WORDS.get(str(value).lower())
            if word is None:
                raise _refuse(f"expects bool, got {value!r:.80}")
            return word
        if typ in (int, float) and isinstance(value, bool):
            raise _refuse(f"expects {typ.__name__}, got {value!r:.80}")
        if typ is int and isinstance(value, float) and value.is_integer():
            return int(value)  # YAML's 1.0e+50: a number the limits then refuse by name
        if typ in (int, float) and isinstance(value, str):
            return typ(value)  # Python's number syntax (ValueError: pydantic reports the field)
        return str(value) if typ is str else value  # YAML's `name: 2024` is a name


def _config() -> type:
    from gspo.config import Config  # the package imports this module first

    return Config


@functools.cache
def _adapter() -> TypeAdapter[Any]:
    return TypeAdapter(_config())


def parse_values(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``values`` converted to their fields' types (unknown keys refused): GspoError naming ``source``
    and the first bad key (in ``values``' order)."""
    try:
        cfg = _adapter().validate_python(dict(values))
    except ValidationError as e:
        order = {k: i for i, k in enumerate(values)}
        err = min(e.errors(), key=lambda x: order.get(x["loc"][0] if x["loc"] else "", len(order)))
        raise GspoError(_message(err, values, source)) from None
    return {k: getattr(cfg, k) for k in values}


def _message(err: Any, values: Mapping[str, Any], source: str) -> str:
    name = str(err["loc"][0]) if err["loc"] else "?"
    if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        close = [k for k in field_kinds(_config()) if k.startswith(name[:3])]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        return f"{source}: unknown config key '{name}'{hint}"
    if err["type"] == "gspo":
        return f"{source}: config key '{name}' {err['msg']}"
    typ = field_kinds(_config())[name][0]
    return f"{source}: config key '{name}' expects {typ.__name__}, got {values.get(name)!r:.80}"


def coerce(name: str, value: Any, source: str) -> Any:
    """Convert ``value`` (a CLI string or YAML scalar) to field ``name``'s type; GspoError if it won't."""
    return parse_values({name: value}, source)[name]


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML mapping of config keys; errors name the file (and line for syntax errors)."""
    p = Path(path)
    if p.is_dir():
        raise GspoError(f"config file {path} is a directory")
    if not p.exists():
        raise GspoError(f"config file not found: {path}")
    if not p.is_file():  # a FIFO or a device would block or never end
        raise GspoError(f"config file {path} is not a regular file")
    try:
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise GspoError(f"{path}: config file is larger than {MAX_CONFIG_BYTES >> 20} MiB")
        raw = p.read_bytes()
    except OSError as e:
        raise GspoError(f"{path}: cannot read config file: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(raw.decode("utf-8-sig")) or {}
    except UnicodeDecodeError as e:
        raise GspoError(f"{path}: config file is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise GspoError(f"{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise GspoError(f"{path}: invalid YAML: nested too deeply") from None
    if not isinstance(data, dict):
        raise GspoError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    for k in data:
        if not isinstance(k, str):
            raise GspoError(f"{path}: config keys must be names, got {type(k).__name__} {k!r:.40}")
    return parse_values({k.replace("-", "_"): v for k, v in data.items()}, path)
