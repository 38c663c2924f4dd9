"""load_prompt_dataset formats and one-line error messages; apply_chat_template."""

from __future__ import annotations

import json

import pytest

from gspo.errors import GspoError
from gspo.tasks.datasets import Example, apply_chat_template, is_chat, load_prompt_dataset, prompt_text

ROWS = [
    {"prompt": "What is 2+2?", "answer": "4", "source": "a"},
    {"prompt": 'Line one\nline two, with "quotes"', "answer": "x, y", "source": "b"},
]


def _expected(rows=ROWS) -> list[Example]:
    return [Example(r["prompt"], r["answer"], {"source": r["source"]}) for r in rows]


def _write(tmp_path, name: str, text: str):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


def _error(path: str, **kw) -> str:
    with pytest.raises(GspoError) as ei:
        load_prompt_dataset(path, **kw)
    msg = str(ei.value)
    assert "\n" not in msg, "GspoError messages are one line"
    return msg


# ------------------------------------------------------------------------------------------------
# formats


def test_jsonl_round_trip_skips_blank_lines(tmp_path):
    """JSONL: one object per line, blank lines skipped, other fields kept in meta."""
    path = _write(tmp_path, "d.jsonl", "\n".join(["", json.dumps(ROWS[0]), "   ", json.dumps(ROWS[1]), ""]))
    assert load_prompt_dataset(path) == _expected()


def test_jsonl_keeps_unicode_line_separators_inside_strings(tmp_path):
    """U+2028 inside a JSON string is data, not a line break (no str.splitlines())."""
    row = {"prompt": "a\u2028b", "answer": "1"}
    path = _write(tmp_path, "d.jsonl", json.dumps(row, ensure_ascii=False) + "\n")
    assert load_prompt_dataset(path) == [Example("a\u2028b", "1")]


def test_json_list_round_trip(tmp_path):
    """JSON: a top-level list of objects; JSON Lines saved as .json is accepted too."""
    path = _write(tmp_path, "d.json", json.dumps(ROWS, indent=2))
    assert load_prompt_dataset(path) == _expected()
    path = _write(tmp_path, "lines.json", "\n".join(json.dumps(r) for r in ROWS))
    assert load_prompt_dataset(path) == _expected()


def test_csv_and_tsv_round_trip(tmp_path):
    """CSV with a header row (quoted commas, newlines) and TSV; values are strings, others in meta."""
    import csv

    for name, delim in (("d.csv", ","), ("d.tsv", "\t")):
        p = tmp_path / name
        with open(p, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=["prompt", "answer", "source"], delimiter=delim)
            w.writeheader()
            w.writerows(ROWS)
        assert load_prompt_dataset(str(p)) == _expected()


def test_custom_fields_and_number_answers(tmp_path):
    """prompt_field/answer_field select columns; numeric answers become strings ("72", not "72.0")."""
    rows = [
        {"question": "q1", "solution": 72},
        {"question": "q2", "solution": 72.0},
        {"question": "q3", "solution": 2.5},
    ]
    path = _write(tmp_path, "d.jsonl", "\n".join(json.dumps(r) for r in rows))
    got = load_prompt_dataset(path, prompt_field="question", answer_field="solution")
    assert [e.answer for e in got] == ["72", "72", "2.5"]
    assert got[0] == Example("q1", "72", {})


def test_parquet_round_trip(tmp_path):
    """Parquet via pyarrow; a missing column is reported with the available columns."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load_prompt_dataset(path) == _expected()
    assert f"{path}: missing field 'question' (columns: prompt, answer, source)" in _error(
        path, prompt_field="question"
    )
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "p", "answer": "a"}, {"prompt": None, "answer": "b"}]), path
    )
    assert f"{path}: row 2: field 'prompt' is null" in _error(path)


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    """Without pyarrow, reading .parquet says how to install it."""
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = _write(tmp_path, "d.parquet", "")
    assert "reading .parquet needs pyarrow: pip install gspo[data]" in _error(path)


def test_hf_dataset_directories(tmp_path, monkeypatch):
    """save_to_disk Dataset, DatasetDict (split chosen, unknown split listed), data-file dirs all load."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    hf = pytest.importorskip("datasets")
    ds = hf.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "single"))
    assert load_prompt_dataset(str(tmp_path / "single")) == _expected()
    test_rows = [{"prompt": "t", "answer": "1", "source": "c"}]
    hf.DatasetDict({"train": ds, "test": hf.Dataset.from_list(test_rows)}).save_to_disk(str(tmp_path / "dd"))
    assert load_prompt_dataset(str(tmp_path / "dd"), split="test") == _expected(test_rows)
    assert f"{tmp_path / 'dd'}: no split 'validation' (splits: train, test)" in _error(
        str(tmp_path / "dd"), split="validation"
    )
    files = tmp_path / "files"
    files.mkdir()
    (files / "train.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    assert load_prompt_dataset(str(files)) == _expected()
    assert "missing field 'question' (columns: prompt, answer, source)" in _error(
        str(files), prompt_field="question"
    )


# ------------------------------------------------------------------------------------------------
# errors


def test_missing_file_and_unknown_format(tmp_path):
    """A missing path and an unsupported extension are named in the message."""
    missing = str(tmp_path / "nope.jsonl")
    assert f"dataset file not found: {missing}" in _error(missing)
    assert "save it locally first" in _error("openai/gsm8k")  # looks like a Hub id
    path = _write(tmp_path, "d.txt", "hello")
    assert f"{path}: unsupported dataset format '.txt'" in _error(path)


def test_jsonl_errors_name_file_and_line(tmp_path):
    """Malformed JSON, a non-object line, missing/null/non-string fields: PATH:LINE and the field."""
    good = json.dumps(ROWS[0])
    cases = [
        ([good, "", '{"prompt": "x", "answer": '], ":3: invalid JSON: Expecting value"),
        ([good, "[1, 2]"], ":2: expected a JSON object, got list"),
        ([good, '{"question": "q", "answer": "a"}'], ":2: missing field 'prompt' (fields: question, answer)"),
        ([good, '{"prompt": "q"}'], ":2: missing field 'answer' (fields: prompt)"),
        (['{"prompt": null, "answer": "a"}'], ":1: field 'prompt' is null"),
        (['{"prompt": "q", "answer": null}'], ":1: field 'answer' is null"),
        (
            ['{"prompt": 5, "answer": "a"}'],
            ":1: field 'prompt' must be a string or a list of chat messages, got int",
        ),
        (
            ['{"prompt": [{"role": "user"}], "answer": "a"}'],
            ":1: field 'prompt': message 1 has no 'content' (keys: role)",
        ),
        (['{"prompt": "  ", "answer": "a"}'], ":1: field 'prompt' is empty"),
        (['{"prompt": "q", "answer": true}'], ":1: field 'answer' must be a string or a number, got bool"),
        (['{"prompt": "q", "answer": ["a"]}'], ":1: field 'answer' must be a string or a number, got list"),
        (['{"prompt": "q", "answer": NaN}'], ":1: field 'answer' is nan"),
    ]
    for i, (lines, expected) in enumerate(cases):
        path = _write(tmp_path, f"e{i}.jsonl", "\n".join(lines))
        assert f"{path}{expected}" in _error(path)


def test_json_errors_name_the_line_of_the_item(tmp_path):
    """In a pretty-printed .json list, errors name the line where the offending item starts."""
    rows = [ROWS[0], {"question": "q", "answer": "a"}]
    path = _write(tmp_path, "d.json", json.dumps(rows, indent=2))
    lines = json.dumps(rows, indent=2).splitlines()
    start = [i for i, line in enumerate(lines, 1) if line == "  {"][1]  # the second item's "{"
    assert start == 7
    assert f"{path}:{start}: missing field 'prompt'" in _error(path)
    path = _write(tmp_path, "bad.json", '[\n  {"prompt": "a", "answer": "b"},\n  {"prompt": }\n]')
    assert f"{path}:3: invalid JSON: Expecting value" in _error(path)
    path = _write(tmp_path, "obj.json", '{"prompt": "a", "answer": "b"}')
    assert f"{path}: expected a JSON list of objects, got one object" in _error(path)
    path = _write(tmp_path, "num.json", "3")
    assert f"{path}: expected a JSON list of objects, got int" in _error(path)


def test_csv_errors_name_the_row_line(tmp_path):
    """CSV errors name the data row's line (a multi-line quoted row counts its lines)."""
    path = _write(tmp_path, "d.csv", 'prompt,answer\n"two\nlines",1\nonly-prompt\n')
    assert f"{path}:4: missing field 'answer' (fields: prompt)" in _error(path)
    path = _write(tmp_path, "h.csv", "question,answer\n\nq,a\n")
    assert f"{path}:3: missing field 'prompt' (fields: question, answer)" in _error(path)
    path = _write(tmp_path, "x.csv", "prompt,answer\np,a,extra\n")
    assert f"{path}:2: row has 3 values but the header has 2 columns" in _error(path)
    path = _write(tmp_path, "e.csv", "prompt,answer\n,a\n")
    assert f"{path}:2: field 'prompt' is empty" in _error(path)
    path = _write(tmp_path, "dup.csv", "prompt,prompt,answer\n")
    assert f"{path}:1: duplicate column 'prompt'" in _error(path)


def test_empty_dataset_and_bad_encoding(tmp_path):
    """Files with no examples are an error; so is non-UTF-8 text (with its line)."""
    for name, text in (("e.jsonl", "\n\n"), ("e.json", "[]"), ("e.csv", "prompt,answer\n"), ("z.json", "")):
        path = _write(tmp_path, name, text)
        assert f"{path}: dataset is empty (no examples)" in _error(path)
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(b'{"prompt": "a", "answer": "b"}\n{"prompt": "caf\xe9", "answer": "b"}\n')
    assert f"{p}:2: not valid UTF-8 text" in _error(str(p))


def test_example_is_frozen_and_hashable():
    """Example is immutable and hashable (meta excluded from the hash), positional (prompt, answer)."""
    e = Example("p", "a", {"k": 1})
    with pytest.raises(AttributeError):
        e.prompt = "q"  # type: ignore[misc]
    assert hash(e) == hash(Example("p", "a", {"k": 2})) and Example("p", "a").meta == {}


# ------------------------------------------------------------------------------------------------
# chat template


class _Tok:
    def __init__(self, template: str | None, fail: bool = False):
        self.chat_template = template
        self.fail = fail
        self.calls: list = []

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append((messages, kwargs))
        if self.fail:
            raise ValueError("System role not supported\nmore details")
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"


def test_apply_chat_template():
    """Template: system+user, generation prompt, untokenized; none: prompt unchanged; errors one line."""
    tok = _Tok("{{ messages }}")
    assert apply_chat_template(tok, "hi", "be brief") == "system:be brief|user:hi|assistant:"
    assert tok.calls[0][1] == {"add_generation_prompt": True, "tokenize": False}
    assert apply_chat_template(tok, "hi", None) == "user:hi|assistant:"
    assert apply_chat_template(_Tok(None), "hi", "be brief") == "hi"
    with pytest.raises(
        GspoError,
        match=r"^the tokenizer's chat template failed with a system prompt: "
        r"ValueError: System role not supported$",
    ):
        apply_chat_template(_Tok("t", fail=True), "hi", "sys")


def test_apply_chat_template_with_messages():
    """Chat-message prompts are rendered as they are; the system prompt goes first only when they
    have none; without a template they are an error (no plain-text rendering)."""
    tok = _Tok("{{ messages }}")
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "2+2?"},
    ]
    assert apply_chat_template(tok, msgs) == "user:hi|assistant:yo|user:2+2?|assistant:"
    assert apply_chat_template(tok, msgs, "be brief").startswith("system:be brief|user:hi|")
    own = [{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}]
    assert apply_chat_template(tok, own, "cfg") == "system:mine|user:q|assistant:"
    assert tok.calls[-1][1] == {"add_generation_prompt": True, "tokenize": False}
    assert msgs[0] == {"role": "user", "content": "hi"}  # the example is not modified
    with pytest.raises(
        GspoError, match="^the dataset's prompts are chat messages but the tokenizer has no chat template"
    ):
        apply_chat_template(_Tok(None), msgs)
    with pytest.raises(
        GspoError, match="^the tokenizer's chat template failed with a system prompt: ValueError"
    ):
        apply_chat_template(_Tok("t", fail=True), own)


# ------------------------------------------------------------------------------------------------
# chat-format prompts

CHAT = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
        "answer": "4",
    },
    {
        "prompt": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Capital of France?", "name": "bob"},
        ],
        "answer": "Paris",
    },
]


def test_chat_prompts_jsonl_and_json(tmp_path):
    """A prompt field holding a list of messages (HF chat datasets) loads as messages; .text and
    prompt_text give the last user message; examples stay hashable and comparable."""
    for name, text in (
        ("c.jsonl", "\n".join(json.dumps(r) for r in CHAT)),
        ("c.json", json.dumps(CHAT, indent=1)),
    ):
        got = load_prompt_dataset(_write(tmp_path, name, text))
        assert [e.prompt for e in got] == [r["prompt"] for r in CHAT]
        assert [e.text for e in got] == ["What is 2+2?", "Capital of France?"]
        assert [prompt_text(e.prompt) for e in got] == [e.text for e in got]
        assert is_chat(got[0].prompt) and not is_chat("x")
        assert len({*got, *got}) == 2 and got[0] == Example(CHAT[0]["prompt"], "4")


def test_chat_prompts_parquet_and_hf(tmp_path, monkeypatch):
    """Arrow list-of-struct columns (Parquet, HF datasets) load as messages; the nulls Arrow adds for
    keys that only some messages have are dropped."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = str(tmp_path / "c.parquet")
    pq.write_table(pa.Table.from_pylist(CHAT), path)
    got = load_prompt_dataset(path)
    assert [e.prompt for e in got] == [r["prompt"] for r in CHAT]  # no 'name': None in row 1
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    hf = pytest.importorskip("datasets")
    hf.Dataset.from_list(CHAT).save_to_disk(str(tmp_path / "hf"))
    assert [e.prompt for e in load_prompt_dataset(str(tmp_path / "hf"))] == [r["prompt"] for r in CHAT]


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ([], "field 'prompt' is an empty list of messages"),
        (["hi"], "field 'prompt': message 1 must be an object with 'role' and 'content', got str"),
        ([{"content": "hi"}], "field 'prompt': message 1 has no 'role' (keys: content)"),
        (
            [{"role": "user", "content": None}],
            "field 'prompt': message 1 has no 'content' (keys: role, content)",
        ),
        (
            [{"role": "", "content": "hi"}],
            "field 'prompt': message 1: 'role' must be a non-empty string, got ''",
        ),
        (
            [{"role": 3, "content": "hi"}],
            "field 'prompt': message 1: 'role' must be a non-empty string, got 3",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "field 'prompt': message 1: 'content' must be a string, got list (multimodal content lists are not supported)",
        ),
        ([{"role": "system", "content": "s"}], "field 'prompt': no message with role 'user' (roles: system)"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "field 'prompt': the last message (message 2) is from the assistant",
        ),
        ([{"role": "user", "content": "  "}], "field 'prompt': the last user message is empty"),
    ],
)
def test_malformed_chat_prompts_name_file_line_field(tmp_path, prompt, expected):
    """Each malformed message list is one line naming the file, the line and the field."""
    rows = [{"q": "fine", "answer": "a"}, {"q": prompt, "answer": "a"}]
    path = _write(tmp_path, "bad.jsonl", "\n".join(json.dumps(r) for r in rows))
    msg = _error(path, prompt_field="q")
    assert msg.startswith(f"{path}:2: {expected.replace('prompt', 'q', 1)}"), msg


# ------------------------------------------------------------------------------------------------
# held-out size


def test_small_held_out_set_warns_once(tmp_path):
    """A held-out set smaller than eval_size warns (why, and how to get more); same call, one warning."""
    import warnings

    from gspo.tasks import build_task

    path = _write(
        tmp_path, "d.jsonl", "\n".join(json.dumps({"prompt": f"p{i}", "answer": "a"}) for i in range(30))
    )
    with pytest.warns(
        UserWarning, match=r"held-out set has 3 examples, fewer than eval_size=50 \(10% of the 30 "
    ):
        task = build_task(path, "exact_match", 0, 50)
    assert len(task.eval) == 3 and len(task.train) == 27
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(3):  # one call site, as in the trainer: shown once
            build_task(path, "exact_match", 0, 50)
    assert len([w for w in seen if "held-out set" in str(w.message)]) == 1
    small = _write(
        tmp_path, "e.jsonl", "\n".join(json.dumps({"prompt": f"e{i}", "answer": "a"}) for i in range(4))
    )
    with pytest.warns(
        UserWarning, match=r"held-out set has 4 examples, fewer than eval_size=10 \(.*e.jsonl has only 4"
    ):
        build_task(path, "exact_match", 0, 10, eval_task=small)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(build_task(path, "exact_match", 0, 3).eval) == 3  # enough: no warning
        assert len(build_task("reverse", "exact_match", 0, 20).eval) == 20
