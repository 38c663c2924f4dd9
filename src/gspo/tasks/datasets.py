"""Prompt datasets: (prompt, reference answer) rows from JSONL / JSON / CSV / Parquet / HF directories.

A prompt is a string, or, as in Hugging Face chat datasets, a list of messages
``[{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...]`` ending with a user (or tool)
message; those are rendered with the tokenizer's chat template (:func:`apply_chat_template`) and
rewards see the text of the last user message (:func:`prompt_text`).

Every problem with the data is a one-line :class:`GspoError` that names the file, the line (or row)
and the field, e.g. ``data.jsonl:17: missing field 'prompt' (fields: question, solution)``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import numbers
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gspo.errors import GspoError, one_line

Message = dict[str, Any]
Prompt = str | list[Message]


def is_chat(prompt: Any) -> bool:
    """True for a prompt given as chat messages (a list), False for a plain string."""
    return isinstance(prompt, list)


def prompt_text(prompt: Prompt) -> str:
    """The prompt as one string for rewards and messages: itself, or for chat messages the content
    of the last user message (the question; the rendered template text depends on the tokenizer)."""
    if isinstance(prompt, str):
        return prompt
    for m in reversed(prompt):
        if m.get("role") == "user":
            return m.get("content") or ""
    return ""


@dataclass(frozen=True)
class Example:
    prompt: Prompt
    """A string, or chat messages ``[{"role": ..., "content": ...}, ...]`` (see :func:`is_chat`)."""
    answer: str
    """Reference passed to the reward: the answer, or test code for the ``code`` reward."""
    meta: dict[str, Any] = field(default_factory=dict, hash=False)
    """The row's other fields, untouched."""

    def __hash__(self) -> int:  # chat prompts are lists: hash their (role, content) pairs
        p = self.prompt
        key = p if isinstance(p, str) else tuple((m.get("role"), m.get("content")) for m in p)
        return hash((key, self.answer))

    @property
    def text(self) -> str:
        """:func:`prompt_text` of the prompt: what rewards receive as the prompt."""
        return prompt_text(self.prompt)


_JSONL = (".jsonl", ".ndjson")
_FORMATS = ".jsonl, .json, .csv, .tsv, .parquet or a Hugging Face dataset directory"


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _read_text(path: str) -> str:
    from gspo import memory

    free = memory.available_memory()
    size = os.path.getsize(path)
    if free is not None and size * 4 > free:  # bytes, text and parsed rows: a few times the file
        raise GspoError(f"{path}: dataset file of {size / 2**30:.1f} GiB does not fit the memory available")
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise GspoError(f"{path}:{line}: not valid UTF-8 text ({e.reason})") from None


def _json_error(path: str, e: json.JSONDecodeError) -> GspoError:
    return GspoError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})")


def _decode(path: str, line: int, text: str, pos: int | None = None) -> tuple[Any, int]:
    """``json.loads`` (``pos`` None) or ``raw_decode`` at ``pos``, with the errors JSONDecodeError does
    not cover (nesting deeper than Python's recursion limit, integers past the int-to-str digit
    limit) as one-line errors at ``path``:``line``."""
    try:
        if pos is None:
            return json.loads(text), len(text)
        return json.JSONDecoder().raw_decode(text, pos)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise GspoError(f"{path}:{line}: invalid JSON: nested too deeply") from None
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise GspoError(f"{path}:{line}: unreadable JSON value: {one_line(e).split(';')[0]}") from None


def _iter_jsonl(path: str, text: str) -> Iterator[tuple[str, Any]]:
    # split("\n"), not splitlines(): U+2028 and friends may appear raw inside JSON strings.
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj, _ = _decode(path, lineno, line)
        except json.JSONDecodeError as e:
            raise GspoError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        yield f"{path}:{lineno}", obj


def _iter_json(path: str, text: str) -> Iterator[tuple[str, Any]]:
    """Items of a top-level JSON list, each located by the line where it starts."""
    ws = " \t\r\n"
    n, i = len(text), 0
    while i < n and text[i] in ws:
        i += 1
    if i == n:
        return
    if text[i] == "{":
        # Either one object (not a dataset) or JSON Lines saved as .json: tell them apart.
        try:
            _decode(path, 1, text)
        except json.JSONDecodeError as e:
            if e.msg == "Extra data":
                yield from _iter_jsonl(path, text)
                return
            raise _json_error(path, e) from None
        raise GspoError(
            f"{path}: expected a JSON list of objects, got one object (for one object per line, use .jsonl)"
        )
    if text[i] != "[":
        try:
            value, _ = _decode(path, 1, text)
        except json.JSONDecodeError as e:
            raise _json_error(path, e) from None
        raise GspoError(f"{path}: expected a JSON list of objects, got {_type_name(value)}")
    line, line_pos = 1, 0

    def line_at(pos: int) -> int:  # incremental, so a long list stays O(n)
        nonlocal line, line_pos
        line += text.count("\n", line_pos, pos)
        line_pos = pos
        return line

    def skip(j: int) -> int:
        while j < n and text[j] in ws:
            j += 1
        return j

    i = skip(i + 1)
    if i < n and text[i] == "]":
        i = skip(i + 1)
    else:
        while True:
            start = i
            try:
                obj, i = _decode(path, line_at(start), text, i)
            except json.JSONDecodeError as e:
                raise _json_error(path, e) from None
            yield f"{path}:{line_at(start)}", obj
            i = skip(i)
            if i < n and text[i] == ",":
                i = skip(i + 1)
                continue
            if i < n and text[i] == "]":
                i = skip(i + 1)
                break
            raise GspoError(
                f"{path}:{line_at(min(i, n))}: invalid JSON: expected ',' or ']' after a list item"
            )
    if i < n:
        raise GspoError(f"{path}:{line_at(i)}: invalid JSON: extra data after the list")


def _iter_csv(path: str, text: str, delimiter: str) -> Iterator[tuple[str, Any]]:
    # Long prompts / test code exceed the default 128 KiB field limit.
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    header: list[str] | None = None
    prev = 0  # reader.line_num after the previous row, so a row starts at prev + 1
    try:
        for values in reader:
            start, prev = prev + 1, reader.line_num
            if not values:  # blank line
                continue
            if header is None:
                header = values
                seen = set()
                for name in header:
                    if name in seen:
                        raise GspoError(f"{path}:{start}: duplicate column {name!r} in the header")
                    seen.add(name)
                continue
            if len(values) > len(header):
                raise GspoError(
                    f"{path}:{start}: row has {len(values)} values but the header has {len(header)} columns"
                )
            # A short row lacks the trailing columns: they are missing fields, not empty strings.
            yield f"{path}:{start}", dict(zip(header, values, strict=False))
    except csv.Error as e:
        raise GspoError(f"{path}:{reader.line_num}: invalid CSV: {e}") from None


def _check_columns(path: str, columns: list[str], prompt_field: str, answer_field: str) -> None:
    for name in (prompt_field, answer_field):
        if name not in columns:
            raise GspoError(f"{path}: missing field {name!r} (columns: {', '.join(columns)})")


def _iter_parquet(path: str, prompt_field: str, answer_field: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise GspoError(f"{path}: reading .parquet needs pyarrow: pip install gspo[data]") from None
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise GspoError(f"{path}: cannot read Parquet: {one_line(e)}") from None
    _check_columns(path, table.column_names, prompt_field, answer_field)
    for i, row in enumerate(table.to_pylist(), 1):
        yield f"{path}: row {i}", row


def _iter_hf_dir(path: str, prompt_field: str, answer_field: str, split: str) -> Iterator[tuple[str, Any]]:
    try:
        import datasets as hf
    except ImportError:
        raise GspoError(
            f"{path}: loading a dataset directory needs the datasets package: pip install gspo[data]"
        ) from None
    saved = any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json"))
    try:
        obj = hf.load_from_disk(path) if saved else hf.load_dataset(path)
    except Exception as e:
        raise GspoError(f"{path}: cannot load dataset directory: {one_line(e)}") from None
    if isinstance(obj, (hf.DatasetDict, dict)):
        if split not in obj:
            raise GspoError(f"{path}: no split {split!r} (splits: {', '.join(obj)})")
        obj = obj[split]
    _check_columns(path, list(obj.column_names), prompt_field, answer_field)
    for i, row in enumerate(obj, 1):
        yield f"{path}: {split} row {i}", row


def _answer(v: Any, loc: str, name: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Number):
        raise GspoError(f"{loc}: field {name!r} must be a string or a number, got {_type_name(v)}")
    if isinstance(v, float):
        if not math.isfinite(v):
            raise GspoError(f"{loc}: field {name!r} is {v}")
        if v.is_integer():  # 72.0 (e.g. an int column with nulls read as float) -> "72"
            return str(int(v))
    try:
        return str(v)
    except ValueError as e:  # an integer past Python's int-to-str digit limit
        raise GspoError(f"{loc}: field {name!r}: {one_line(e).split(';')[0]}") from None


def _is_array(v: Any) -> bool:
    """A numpy array (how some readers return list columns)."""
    return type(v).__module__ == "numpy" and type(v).__name__ == "ndarray"


def _messages(items: list[Any], loc: str, name: str) -> list[Message]:
    """Validated chat messages: objects with a string 'role' and a string 'content', at least one
    from the user, not ending with the assistant (the completion is what gets generated)."""
    where = f"{loc}: field {name!r}"
    if not items:
        raise GspoError(f"{where} is an empty list of messages")
    out: list[Message] = []
    for i, m in enumerate(items, 1):
        if not isinstance(m, dict):
            raise GspoError(
                f"{where}: message {i} must be an object with 'role' and 'content', got {_type_name(m)}"
            )
        for key in ("role", "content"):
            if key not in m or m[key] is None:
                raise GspoError(
                    f"{where}: message {i} has no {key!r} (keys: {', '.join(map(str, m)) or 'none'})"
                )
        role, content = m["role"], m["content"]
        if not isinstance(role, str) or not role.strip():
            raise GspoError(f"{where}: message {i}: 'role' must be a non-empty string, got {role!r:.40}")
        if not isinstance(content, str):
            raise GspoError(
                f"{where}: message {i}: 'content' must be a string, got {_type_name(content)} "
                "(multimodal content lists are not supported)"
            )
        # Parquet/Arrow fill keys other rows have with nulls: drop them, keep real extras (e.g. 'name').
        out.append({k: v for k, v in m.items() if v is not None or k in ("role", "content")})
    roles = [m["role"] for m in out]
    if "user" not in roles:
        raise GspoError(f"{where}: no message with role 'user' (roles: {', '.join(roles)})")
    if roles[-1] == "assistant":
        raise GspoError(
            f"{where}: the last message (message {len(out)}) is from the assistant; the prompt must end "
            "where the model's answer starts (put the reference in the answer field)"
        )
    if not prompt_text(out).strip():
        raise GspoError(f"{where}: the last user message is empty")
    return out


def _example(loc: str, row: Any, prompt_field: str, answer_field: str) -> Example:
    if not isinstance(row, dict):
        raise GspoError(f"{loc}: expected a JSON object, got {_type_name(row)}")
    for name in (prompt_field, answer_field):
        if name not in row:
            fields = ", ".join(str(k) for k in list(row)[:12]) or "none"
            raise GspoError(f"{loc}: missing field {name!r} (fields: {fields})")
        if row[name] is None:
            raise GspoError(f"{loc}: field {name!r} is null")
    prompt = row[prompt_field]
    if isinstance(prompt, (list, tuple)) or _is_array(prompt):
        prompt = _messages(list(prompt), loc, prompt_field)
    elif not isinstance(prompt, str):
        raise GspoError(
            f"{loc}: field {prompt_field!r} must be a string or a list of chat messages, got {_type_name(prompt)}"
        )
    elif not prompt.strip():
        raise GspoError(f"{loc}: field {prompt_field!r} is empty")
    answer = _answer(row[answer_field], loc, answer_field)
    meta = {k: v for k, v in row.items() if k != prompt_field and k != answer_field}
    return Example(prompt, answer, meta)


def _rows(path: str, prompt_field: str, answer_field: str, split: str) -> Iterable[tuple[str, Any]]:
    if os.path.isdir(path):
        return _iter_hf_dir(path, prompt_field, answer_field, split)
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        return _iter_parquet(path, prompt_field, answer_field)
    if ext in _JSONL:
        return _iter_jsonl(path, _read_text(path))
    if ext == ".json":
        return _iter_json(path, _read_text(path))
    if ext in (".csv", ".tsv"):
        return _iter_csv(path, _read_text(path), "\t" if ext == ".tsv" else ",")
    raise GspoError(f"{path}: unsupported dataset format {ext or '(no extension)'!r} (expected {_FORMATS})")


def load_prompt_dataset(
    path: str, prompt_field: str = "prompt", answer_field: str = "answer", split: str = "train"
) -> list[Example]:
    """Examples from a local dataset; formats by extension (``.jsonl``/``.ndjson``, ``.json`` list,
    ``.csv``/``.tsv`` with a header row, ``.parquet``) or a directory (``datasets.save_to_disk``
    output, or data files loadable by ``datasets.load_dataset``; ``split`` applies only there).

    Answers that are numbers become strings (integral floats without ``.0``); other fields go to
    ``Example.meta``. Raises :class:`GspoError` naming file, line/row and field on bad data.
    """
    path = os.path.expanduser(os.fspath(path))
    if not os.path.exists(path):
        hint = ""
        if not os.path.splitext(path)[1] and path.count("/") == 1:
            hint = " (for a Hugging Face Hub dataset, save it locally first: load_dataset(...).save_to_disk(DIR))"
        raise GspoError(f"dataset file not found: {path}{hint}")
    if not os.path.isdir(path) and not os.path.isfile(path):  # a FIFO or device would block or never end
        raise GspoError(f"{path}: not a regular file or dataset directory")
    try:
        examples = [
            _example(loc, row, prompt_field, answer_field)
            for loc, row in _rows(path, prompt_field, answer_field, split)
        ]
    except OSError as e:
        raise GspoError(f"{path}: cannot read: {one_line(e)}") from None
    if not examples:
        raise GspoError(f"{path}: dataset is empty (no examples)")
    return examples


def apply_chat_template(tokenizer: Any, prompt: Prompt, system: str | None = None) -> str:
    """``prompt`` as a chat ending in the assistant prefix, via the tokenizer's chat template.

    A string becomes one user turn, after ``system`` when given; without a template it is returned
    unchanged (``system`` ignored). Chat messages are rendered as they are, with ``system`` put first
    only when they have no system message of their own; they need a template (one-line
    :class:`GspoError` otherwise: there is no faithful plain-text rendering).
    """
    chat = is_chat(prompt)
    if not getattr(tokenizer, "chat_template", None):
        if chat:
            raise GspoError(
                "the dataset's prompts are chat messages but the tokenizer has no chat template "
                "(use an instruct model's tokenizer, or a dataset with string prompts)"
            )
        return prompt  # type: ignore[return-value]
    if chat:
        messages = [dict(m) for m in prompt]  # type: ignore[union-attr]
        if system and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system})
    else:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # e.g. a template that rejects the system role
        what = " with a system prompt" if any(m.get("role") == "system" for m in messages) else ""
        raise GspoError(f"the tokenizer's chat template failed{what}: {one_line(e)}") from None
    if not isinstance(text, str):
        raise GspoError(f"the tokenizer's chat template returned {_type_name(text)}, expected a string")
    return text
