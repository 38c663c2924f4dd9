"""Config values from text: a YAML file's scalars and the command line's strings, converted by pydantic
to each field's type. Only types: the rules and bounds run later, on the merged values, in
``Config.validate``."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

from gspo.config.checks import field_kinds
from gspo.config.schema import Config
from gspo.errors import GspoError

MAX_CONFIG_BYTES = 1 << 20  # a config is a few dozen keys: anything larger is not one
MAX_YAML_DEPTH = 64  # a config or preset nests a few levels: deeper is not one (PyYAML recurses per level)
BOOL_WORDS = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(
    ("0", "false", "no", "off"), False
)


def _refuse(msg: str) -> PydanticCustomError:
    return PydanticCustomError("gspo", msg)


def from_text(typ: type, optional: bool, value: Any) -> Any:
    """What a YAML scalar or flag string means for a field of type ``typ`` where pydantic's lax mode
    differs (it takes ``t`` for a bool, ``True`` for a number, ``'2.0'`` for an int, and no number
    for a str), and what it never is (a container, a NUL character)."""
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
        return typ(value)  # Python's number syntax (ValueError: reported as the wrong type)
    return str(value) if typ is str else value  # YAML's `name: 2024` is a name


@functools.cache
def _adapter(typ: type, optional: bool) -> TypeAdapter[Any]:
    """The field type alone: its bounds (annotated_types, in the field's ``Annotated``) are checked
    later, on the merged values."""
    return TypeAdapter(typ | None if optional else typ)


def parse_values(
    values: Mapping[str, Any], source: str, lines: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """``values`` converted to their fields' types (unknown keys refused): GspoError naming ``source``
    (with the key's line from ``lines`` when given) and the first bad key (in ``values``' order)."""
    kinds = field_kinds(Config)
    out = {}
    for name, value in values.items():
        where = f"{source}:{lines[name]}" if lines and name in lines else source
        if name not in kinds:
            close = [k for k in kinds if k.startswith(str(name)[:3])]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise GspoError(f"{where}: unknown config key '{name}'{hint}")
        typ, optional = kinds[name]
        try:
            out[name] = _adapter(typ, optional).validate_python(from_text(typ, optional, value))
        except PydanticCustomError as e:
            raise GspoError(f"{where}: config key '{name}' {e.message()}") from None
        except (ValidationError, ValueError, OverflowError):
            raise GspoError(
                f"{where}: config key '{name}' expects {typ.__name__}, got {value!r:.80}"
            ) from None
    return out


def coerce(name: str, value: Any, source: str) -> Any:
    """Convert ``value`` (a CLI string or YAML scalar) to field ``name``'s type; GspoError if it won't."""
    return parse_values({name: value}, source)[name]


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key repeated in one mapping (PyYAML keeps the last
    silently: ``steps: 2`` then ``steps: 3`` would run 3 steps) and nesting deeper than
    ``MAX_YAML_DEPTH`` (PyYAML recurses once per level: 10,000 nested lists exhaust the stack).
    Merge keys (``<<: *base``) may still be overridden: only a mapping's own keys are compared."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(
                    None, None, f"nested too deeply (more than {MAX_YAML_DEPTH} levels)", mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # a merge key, or a complex key (refused where names are expected)
                key = self.construct_object(key_node)
                if key in first:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first on line {first[key]})", key_node.start_mark
                    )
                first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path, what: str = "config file") -> tuple[Any, dict[str, int]]:
    """A YAML file a user gives gspo (config, preset): its value and the line of each top-level key.
    Every problem is a one-line GspoError naming the file (and line): not a regular file, too large,
    not UTF-8, invalid YAML, a duplicate key, too deeply nested."""
    p = Path(path)
    if p.is_dir():
        raise GspoError(f"{what} {path} is a directory")
    if not p.exists():
        raise GspoError(f"{what} not found: {path}")
    if not p.is_file():  # a FIFO or a device would block or never end
        raise GspoError(f"{what} {path} is not a regular file")
    try:
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise GspoError(f"{path}: {what} is larger than {MAX_CONFIG_BYTES >> 20} MiB")
        raw = p.read_bytes()
    except OSError as e:
        raise GspoError(f"{path}: cannot read {what}: {e.strerror or e}") from None
    try:
        loader = UniqueKeyLoader(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise GspoError(f"{path}: {what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise GspoError(f"{where}: invalid YAML: {problem}") from None
    except RecursionError:  # deep nesting inside one construct the depth check does not see
        raise GspoError(f"{path}: invalid YAML: nested too deeply") from None
    finally:
        loader.dispose()
    lines = {}
    if isinstance(node, yaml.MappingNode):
        lines = {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}
    return data, lines


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML mapping of config keys; errors name the file (and the line of the key)."""
    return load_yaml_lines(path)[0]


def load_yaml_lines(path: str) -> tuple[dict[str, Any], dict[str, int]]:
    """:func:`load_yaml`, and the line of each key (for errors found later, in validation)."""
    data, lines = read_yaml(path)
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise GspoError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    for k in data:
        if not isinstance(k, str):
            raise GspoError(f"{path}: config keys must be names, got {type(k).__name__} {k!r:.40}")
    values = {k.replace("-", "_"): v for k, v in data.items()}
    lines = {k.replace("-", "_"): n for k, n in lines.items()}
    return parse_values(values, path, lines), lines
