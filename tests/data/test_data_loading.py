"""fastft.data loading: every source and format to the normalised schema, and errors that point at the line."""

from __future__ import annotations

import csv
import json
import pickle
import random
import re
import time
from pathlib import Path

import datasets
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fastft.data.errors import FastftDataError, MalformedRowError
from fastft.data.formats import (
    FORMATS,
    ROLES,
    detect_format,
    from_alpaca,
    from_messages,
    from_sharegpt,
    from_text,
)
from fastft.data.loading import BUNDLED_DIR, dataset_kind, list_bundled, load_dataset

# --- helpers -------------------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list, blank_lines: dict[int, int] | None = None) -> Path:
    """Write rows as JSON lines; `blank_lines` maps a row index to blank lines inserted before it."""
    blank_lines = blank_lines or {}
    with open(path, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            f.write("\n" * blank_lines.get(i, 0))
            f.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")
    return path


def write_csv(path: Path, header: list[str], records: list[list[str]], delimiter: str = ",") -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter=delimiter)
        writer.writerow(header)
        writer.writerows(records)
    return path


def columns_of(rows: list[dict]) -> dict[str, list]:
    """Rows as columns over the union of their keys (from_pylist/from_list only use the first row's keys)."""
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: [r.get(k) for r in rows] for k in keys}


def chat(*pairs: tuple[str, str]) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


def awkward_text(rng: random.Random, n: int = 30) -> str:
    """Random text with quotes, commas, tabs, newlines, braces and non-ASCII characters."""
    alphabet = "abcXYZ 019,;\"'\t\n{}[]\\/é中😀ß—"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, n)))


def raises_at(match_source: str, where: str, *fragments: str):
    """Context manager: a MalformedRowError whose message has `source where:` and every fragment."""
    location = re.escape(f"{match_source} {where}") + r"( \(counting from 0\))?: "
    return pytest.raises(MalformedRowError, match=location + ".*" + ".*".join(map(re.escape, fragments)))


ALPACA = [
    {"instruction": "Add 2 and 3.", "input": "", "output": "5"},
    {"instruction": "Translate.", "input": "bonjour", "output": "hello", "system": "Be brief."},
    {"instruction": "Say hi.", "output": "hi"},
]
ALPACA_MESSAGES = [
    [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Translate.\n\nbonjour"},
        {"role": "assistant", "content": "hello"},
    ],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}],
]
SHAREGPT = [
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    {
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "user", "value": "q"},
            {"from": "assistant", "value": "a"},
            {"from": "tool", "value": "t"},
        ]
    },
    {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}], "system": "top"},
]
SHAREGPT_MESSAGES = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "t"},
    ],
    [
        {"role": "system", "content": "top"},
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"},
    ],
]
MESSAGES = [
    chat(("system", "s"), ("user", "u"), ("assistant", "a")),
    chat(("user", "only a prompt")),  # no assistant turn: allowed here, tokenisation skips it later
    chat(("user", "u"), ("assistant", "call"), ("tool", "42"), ("assistant", "42")),
]
TEXTS = [{"text": "first document"}, {"text": ""}, {"text": "line one\nline two"}]
PAIRS = [  # one type per field, as a Parquet column has (chats as answers: tests/data/test_pairs.py)
    {"prompt": [{"role": "user", "content": "2 + 2?"}], "chosen": "4", "rejected": "5"},
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "chosen": "Hello.",
        "rejected": "What do you want?",
    },
]
PAIRS_NORMALISED = [
    {
        "prompt": [{"role": "user", "content": "2 + 2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    },
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "chosen": [{"role": "assistant", "content": "Hello."}],
        "rejected": [{"role": "assistant", "content": "What do you want?"}],
    },
]

CASES = {
    "alpaca": (ALPACA, ALPACA_MESSAGES),
    "sharegpt": (SHAREGPT, SHAREGPT_MESSAGES),
    "messages": (MESSAGES, [r["messages"] for r in MESSAGES]),
    "text": (TEXTS, [r["text"] for r in TEXTS]),
    "preference": (PAIRS, PAIRS_NORMALISED),
}


def column_of(fmt: str) -> str:
    return {"text": "text", "preference": "pair"}.get(fmt, "messages")


# --- bundled -------------------------------------------------------------------------------------------


def test_list_bundled_names_the_shipped_files():
    assert {"skills", "skills-eval"} <= set(list_bundled())
    assert list_bundled() == sorted(p.stem for p in BUNDLED_DIR.glob("*.jsonl"))


@pytest.mark.parametrize(("name", "rows"), [("skills", 4000), ("skills-eval", 256)])
def test_bundled_loads_with_its_columns(name, rows):
    ds = load_dataset(f"bundled:{name}")
    assert isinstance(ds, datasets.Dataset)
    assert len(ds) == rows
    assert ds.column_names == ["messages", "task", "answer"]
    assert dataset_kind(ds) == "chat"
    first = json.loads((BUNDLED_DIR / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert ds[0] == first
    assert all(m["role"] in ROLES for m in ds[rows - 1]["messages"])


def test_unknown_bundled_name_lists_the_available_ones():
    with pytest.raises(FastftDataError, match="no bundled dataset named 'nope'") as info:
        load_dataset("bundled:nope")
    assert "bundled:skills" in str(info.value) and "bundled:skills-eval" in str(info.value)


# --- each format from each file type ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("explicit", [False, True])
def test_each_format_from_jsonl(tmp_path, fmt, explicit):
    rows, expected = CASES[fmt]
    path = write_jsonl(tmp_path / f"{fmt}.jsonl", rows, blank_lines={1: 2})
    ds = load_dataset(path, format=fmt if explicit else "auto")
    column = column_of(fmt)
    assert ds[column] == expected
    assert dataset_kind(ds) == {"text": "text", "preference": "pairs"}.get(fmt, "chat")
    assert ds.column_names == [column]  # format fields are consumed, nothing else is added


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_from_json_array_and_json_lines_in_a_json_file(tmp_path, fmt):
    rows, expected = CASES[fmt]
    array = tmp_path / "array.json"
    array.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    lines = write_jsonl(tmp_path / "lines.json", rows)
    for path in (array, lines):
        assert load_dataset(str(path))[column_of(fmt)] == expected


def test_messages_may_come_as_conversations_with_role_and_content(tmp_path):
    rows = [{"conversations": r["messages"], "id": i} for i, r in enumerate(MESSAGES)]
    assert detect_format(rows[0]) == "messages"
    ds = load_dataset(write_jsonl(tmp_path / "c.jsonl", rows))
    assert ds.column_names == ["messages", "id"]
    assert ds["messages"] == [r["messages"] for r in MESSAGES]


def test_csv_alpaca_with_awkward_cells(tmp_path):
    rng = random.Random(0)
    records = [
        [awkward_text(rng), awkward_text(rng) if i % 2 else "", awkward_text(rng), str(i)] for i in range(50)
    ]
    path = write_csv(tmp_path / "alpaca.csv", ["instruction", "input", "output", "id"], records)
    ds = load_dataset(path)
    assert ds.column_names == ["messages", "id"]
    assert len(ds) == 50
    for (instruction, extra, output, ident), got in zip(records, ds, strict=True):
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        assert got["messages"] == [
            {"role": "user", "content": user},
            {"role": "assistant", "content": output},
        ]
        assert got["id"] == ident  # CSV cells stay strings


def test_tsv_and_csv_with_json_messages_cells(tmp_path):
    tsv = write_csv(tmp_path / "t.tsv", ["text", "source"], [["a, b", "x"], ["c\td", "y"]], delimiter="\t")
    assert load_dataset(tsv)["text"] == ["a, b", "c\td"]
    cells = [[json.dumps(r["messages"]), "s"] for r in MESSAGES]
    ds = load_dataset(write_csv(tmp_path / "m.csv", ["messages", "source"], cells))
    assert ds["messages"] == [r["messages"] for r in MESSAGES]


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_from_parquet(tmp_path, fmt):
    rows, expected = CASES[fmt]
    path = tmp_path / f"{fmt}.parquet"
    pq.write_table(pa.table(columns_of(rows)), path)
    assert load_dataset(path)[column_of(fmt)] == expected


def test_parquet_written_by_pandas_with_missing_optional_fields(tmp_path):
    df = pd.DataFrame(
        {"instruction": ["a", "b"], "input": ["x", None], "output": ["1", "2"], "score": [0.5, float("nan")]}
    )
    path = tmp_path / "pandas.parquet"
    df.to_parquet(path, index=False)
    ds = load_dataset(path, format="alpaca")
    assert ds["messages"][1] == [{"role": "user", "content": "b"}, {"role": "assistant", "content": "2"}]
    assert ds["messages"][0][0]["content"] == "a\n\nx"
    assert ds.column_names == ["messages", "score"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_datasets_dataset_and_datasetdict_inputs(fmt):
    rows, expected = CASES[fmt]
    ds_in = datasets.Dataset.from_dict(columns_of([{**r, "n": i} for i, r in enumerate(rows)]))
    ds = load_dataset(ds_in)
    assert ds[column_of(fmt)] == expected
    assert ds.column_names[0] == column_of(fmt) and "n" in ds.column_names
    assert ds["n"] == list(range(len(rows)))
    dd = datasets.DatasetDict({"train": ds_in.select([0]), "test": ds_in})
    assert load_dataset(dd, split="test")[column_of(fmt)] == expected
    assert load_dataset(dd)[column_of(fmt)] == expected[:1]


def test_dataset_messages_with_extra_keys_are_trimmed_to_role_and_content():
    ds_in = datasets.Dataset.from_list(
        [{"messages": [{"role": "user", "content": "x", "name": "bob"}], "k": 1}]
    )
    ds = load_dataset(ds_in)
    assert ds.to_list() == [{"messages": [{"role": "user", "content": "x"}], "k": 1}]
    assert ds.features["messages"] == load_dataset("bundled:skills-eval").features["messages"]


def test_datasetdict_without_the_split_lists_splits():
    dd = datasets.DatasetDict({"validation": datasets.Dataset.from_list(TEXTS)})
    with pytest.raises(FastftDataError, match=r"no split 'train'; available splits: validation"):
        load_dataset(dd)


def test_list_of_dicts_and_dataframe(tmp_path):
    assert load_dataset(ALPACA)["messages"] == ALPACA_MESSAGES
    assert load_dataset(SHAREGPT, format="sharegpt")["messages"] == SHAREGPT_MESSAGES
    df = pd.DataFrame(TEXTS)
    assert load_dataset(df)["text"] == [r["text"] for r in TEXTS]


def test_random_content_round_trips_through_every_file_type(tmp_path):
    rng = random.Random(1234)
    rows = [
        {
            "messages": [
                {"role": rng.choice(ROLES), "content": awkward_text(rng, 80)}
                for _ in range(rng.randint(1, 5))
            ],
            "tag": awkward_text(rng, 10),
        }
        for _ in range(200)
    ]
    write_jsonl(tmp_path / "r.jsonl", rows)
    (tmp_path / "r.json").write_text(json.dumps(rows), encoding="utf-8")
    pq.write_table(pa.table(columns_of(rows)), tmp_path / "r.parquet")
    write_csv(tmp_path / "r.csv", ["messages", "tag"], [[json.dumps(r["messages"]), r["tag"]] for r in rows])
    for name in ("r.jsonl", "r.json", "r.parquet", "r.csv"):
        ds = load_dataset(tmp_path / name)
        assert ds.to_list() == rows, name
    assert load_dataset(rows).to_list() == rows
    assert load_dataset(datasets.Dataset.from_list(rows)).to_list() == rows


def test_extra_columns_are_kept_with_their_types(tmp_path):
    rows = [
        {"instruction": "a", "output": "b", "task": "add", "answer": "5", "score": 1.5, "n": 3, "ok": True},
        {"instruction": "c", "output": "d", "task": "sub", "answer": "1", "score": 2, "n": 4, "ok": False},
        {"instruction": "e", "output": "f", "task": "sub", "note": "late column"},
    ]
    ds = load_dataset(write_jsonl(tmp_path / "x.jsonl", rows))
    assert ds.column_names == ["messages", "task", "answer", "score", "n", "ok", "note"]
    assert ds["task"] == ["add", "sub", "sub"]
    assert ds["score"] == [1.5, 2.0, None]
    assert ds["n"] == [3, 4, None]
    assert ds["ok"] == [True, False, None]
    assert ds["note"] == [None, None, "late column"]


def test_path_objects_and_strings_both_work(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", TEXTS)
    assert load_dataset(path)["text"] == load_dataset(str(path))["text"]


# --- detection -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "fmt"),
    [
        (ALPACA[0], "alpaca"),
        (SHAREGPT[0], "sharegpt"),
        (MESSAGES[0], "messages"),
        ({"conversations": [{"role": "user", "content": "x"}]}, "messages"),
        ({"conversations": []}, "sharegpt"),
        (TEXTS[0], "text"),
        ({"text": "t", "messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"text": "t", "instruction": None}, "text"),  # None-valued fields count as absent
    ],
)
def test_detect_format(row, fmt):
    assert detect_format(row) == fmt


def test_detect_format_rejects_unknown_rows():
    with pytest.raises(
        FastftDataError, match=r"can't tell the format of a row with fields 'prompt', 'completion'"
    ):
        detect_format({"prompt": "p", "completion": "c"})
    with pytest.raises(FastftDataError, match="not a list"):
        detect_format([1, 2])


def test_format_functions_directly():
    assert from_text({"text": "x"}) == {"text": "x"}
    assert from_alpaca(ALPACA[1]) == {"messages": ALPACA_MESSAGES[1]}
    assert from_sharegpt(SHAREGPT[2]) == {"messages": SHAREGPT_MESSAGES[2]}
    extra_keys = {"messages": [{"role": "user", "content": "x", "name": "bob", "weight": 0}]}
    assert from_messages(extra_keys) == {"messages": [{"role": "user", "content": "x"}]}


def test_auto_requires_every_row_to_match_the_first(tmp_path):
    rows = [ALPACA[0], ALPACA[1], SHAREGPT[0], ALPACA[2]]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows, blank_lines={2: 1})
    with raises_at("mixed.jsonl", "line 4", "sharegpt format", "line 1 is alpaca", "one format"):
        load_dataset(path)


def test_explicit_format_that_does_not_fit(tmp_path):
    path = write_jsonl(tmp_path / "alp.jsonl", ALPACA)
    with raises_at("alp.jsonl", "line 1", "no 'text' field, which the text format needs"):
        load_dataset(path, format="text")


def test_unknown_format_name_lists_valid_ones():
    with pytest.raises(
        FastftDataError,
        match="unknown format 'chatml'; valid formats: auto, alpaca, sharegpt, messages, text",
    ):
        load_dataset(TEXTS, format="chatml")


# --- errors that point at the line ---------------------------------------------------------------------


def test_missing_content_message_matches_the_documented_wording(tmp_path):
    rows = [MESSAGES[0]] * 16 + [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]}]
    path = write_jsonl(tmp_path / "skills.jsonl", rows)
    with pytest.raises(MalformedRowError) as info:
        load_dataset(path)
    err = info.value
    assert str(err) == (
        "skills.jsonl line 17: assistant message has no 'content' "
        '(each message needs "role" and "content" strings). Fix the row or drop it.'
    )
    assert (err.source, err.line, err.row) == ("skills.jsonl", 17, None)
    assert err.reason.startswith("assistant message has no 'content'")
    assert isinstance(err, FastftDataError) and isinstance(err, ValueError)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


@pytest.mark.parametrize("seed", range(3))
def test_invalid_json_reports_the_physical_line(tmp_path, seed):
    rng = random.Random(seed)
    n = rng.randint(3, 40)
    bad = rng.randrange(n)
    blanks = {i: rng.randint(0, 2) for i in range(n)}
    rows: list = [{"text": awkward_text(rng)} for _ in range(n)]
    rows[bad] = '{"text": "unterminated'
    path = write_jsonl(tmp_path / "broken.jsonl", rows, blank_lines=blanks)
    line = bad + 1 + sum(blanks[i] for i in range(bad + 1))
    with raises_at(
        "broken.jsonl", f"line {line}", "invalid JSON (Unterminated string starting at column 10)"
    ):
        load_dataset(path)


@pytest.mark.parametrize(
    ("row", "fragments"),
    [
        ({"messages": "hello"}, ["'messages' is a string, not a list of messages"]),
        ({"messages": []}, ["'messages' is an empty list"]),
        ({"messages": ["hi"]}, ["message 1 is a string, not an object"]),
        ({"messages": [{"content": "x"}]}, ["message 1 has no 'role'"]),
        ({"messages": [{"from": "human", "value": "x"}]}, ["no 'role'", "format='sharegpt'"]),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]},
            ["message 2 has unknown role 'bot' (valid roles: system, user, assistant, tool)"],
        ),
        ({"messages": [{"role": 3, "content": "x"}]}, ["'role' is a number, not a string"]),
        (
            {"messages": [{"role": "user", "content": 7}]},
            ["user message 'content' is a number, not a string"],
        ),
        ({"messages": [{"role": "assistant", "content": None}]}, ["assistant message 'content' is null"]),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, ["content lists"]),
    ],
)
def test_chat_row_errors(tmp_path, row, fragments):
    path = write_jsonl(
        tmp_path / "chat.jsonl", [MESSAGES[0], MESSAGES[2], row, MESSAGES[0]], blank_lines={1: 1}
    )
    with raises_at("chat.jsonl", "line 4", *fragments):
        load_dataset(path)


@pytest.mark.parametrize(
    ("row", "fragments"),
    [
        (
            {"conversations": [{"from": "alien", "value": "x"}]},
            ["unknown 'from' value 'alien'", "human", "gpt"],
        ),
        ({"conversations": [{"from": "gpt"}]}, ["gpt turn has no 'value'"]),
        ({"conversations": [{"from": "gpt", "value": 1}]}, ["'value' is a number"]),
        ({"conversations": []}, ["'conversations' is an empty list"]),
        ({"conversations": [{"from": "human", "value": "x"}], "system": 5}, ["'system' is a number"]),
    ],
)
def test_sharegpt_row_errors(tmp_path, row, fragments):
    path = write_jsonl(tmp_path / "sg.jsonl", [SHAREGPT[0], row])
    with raises_at("sg.jsonl", "line 2", *fragments):
        load_dataset(path)


@pytest.mark.parametrize(
    ("row", "fragments"),
    [
        (
            {"instruction": "x"},
            ["no 'output' field, which the alpaca format needs", "'instruction' and 'output'"],
        ),
        ({"instruction": "x", "output": None}, ["'output' is null, not a string"]),
        ({"instruction": ["x"], "output": "y"}, ["'instruction' is a list, not a string"]),
        ({"instruction": "x", "output": "y", "input": 3}, ["'input' is a number, not a string or null"]),
    ],
)
def test_alpaca_row_errors(tmp_path, row, fragments):
    path = write_jsonl(tmp_path / "alp.jsonl", [ALPACA[0], ALPACA[1], row])
    with raises_at("alp.jsonl", "line 3", *fragments):
        load_dataset(path)


def test_text_row_errors_and_non_object_lines(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [TEXTS[0], {"text": 12}])
    with raises_at("t.jsonl", "line 2", "'text' is a number, not a string", "text rows need a 'text' string"):
        load_dataset(path)
    path = write_jsonl(tmp_path / "arr.jsonl", [TEXTS[0], "[1, 2]"])
    with raises_at("arr.jsonl", "line 2", "holds a list, not a JSON object"):
        load_dataset(path)


def test_unrecognised_first_row(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}], blank_lines={0: 3})
    with raises_at("qa.jsonl", "line 4", "can't tell the format", "'question', 'answer'"):
        load_dataset(path)


def test_invalid_utf8_line(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with raises_at("latin.jsonl", "line 2", "not valid UTF-8", "Save the file as UTF-8"):
        load_dataset(path)


def test_extra_column_with_mixed_types_names_the_line(tmp_path):
    rows = [{"text": "a", "id": 1}, {"text": "b"}, {"text": "c", "id": 2}, {"text": "d", "id": "three"}]
    with raises_at("ids.jsonl", "line 4", "field 'id' is a string here but a number on line 1"):
        load_dataset(write_jsonl(tmp_path / "ids.jsonl", rows))


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("e.jsonl", ""),
        ("w.jsonl", "\n  \n\n"),
        ("e.json", "[]"),
        ("w.json", " \n"),
        ("h.csv", "text,id\n"),
        ("z.csv", ""),
    ],
)
def test_empty_files(tmp_path, name, content):
    (tmp_path / name).write_text(content, encoding="utf-8")
    with pytest.raises(FastftDataError, match=re.escape(f"{name} is empty")):
        load_dataset(tmp_path / name)


def test_empty_list_dataset_and_parquet(tmp_path):
    with pytest.raises(FastftDataError, match="input list is empty"):
        load_dataset([])
    with pytest.raises(FastftDataError, match="dataset is empty"):
        load_dataset(datasets.Dataset.from_dict({"text": []}))
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "none.parquet")
    with pytest.raises(FastftDataError, match="none.parquet is empty"):
        load_dataset(tmp_path / "none.parquet")


def test_csv_errors_use_the_physical_line_of_the_record(tmp_path):
    # line 1 header; line 2 record; lines 3-5 one record with two newlines inside quotes; line 6 blank;
    # line 7 a record with a missing output column.
    path = tmp_path / "multi.csv"
    path.write_text(
        'instruction,output\nq1,a1\n"q2 spans\nthree\nlines",a2\n\nq3 has no output\nq4,a4\n',
        encoding="utf-8",
    )
    with raises_at("multi.csv", "line 7", "the record has 1 fields but the header has 2"):
        load_dataset(path)
    path.write_text('instruction,output\nq1,a1\n"q2\nq2",a2\n\n"q3",\n', encoding="utf-8")
    ds = load_dataset(path)
    assert ds["messages"][1][0]["content"] == "q2\nq2"
    assert ds["messages"][2][1]["content"] == ""


def test_csv_missing_column_and_bad_header(tmp_path):
    path = write_csv(tmp_path / "noout.csv", ["instruction", "answer"], [["q", "a"]])
    with raises_at("noout.csv", "line 2", "no 'output' field, which the alpaca format needs"):
        load_dataset(path)
    path = write_csv(tmp_path / "dup.csv", ["text", "text"], [["a", "b"]])
    with raises_at("dup.csv", "line 1", "repeats column names ['text']"):
        load_dataset(path)


def test_csv_messages_cell_must_be_json(tmp_path):
    path = write_csv(
        tmp_path / "m.csv", ["messages"], [[json.dumps(MESSAGES[0]["messages"])], ["[{'role': 'user'}]"]]
    )
    with raises_at("m.csv", "line 3", "the 'messages' cell is not valid JSON"):
        load_dataset(path)


def test_json_array_errors_use_row_index_or_parse_line(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([TEXTS[0], TEXTS[2], {"text": None}], indent=1), encoding="utf-8")
    with pytest.raises(
        MalformedRowError, match=re.escape("arr.json row 2 (counting from 0): 'text' is null")
    ) as info:
        load_dataset(path)
    assert (info.value.row, info.value.line) == (2, None)
    path.write_text('[\n {"text": "a"},\n {"text": "b"}\n {"text": "c"}\n]', encoding="utf-8")
    with raises_at("arr.json", "line 4", "invalid JSON (Expecting ','"):
        load_dataset(path)
    path.write_text('[{"text": "a"}, "b"]', encoding="utf-8")
    with raises_at("arr.json", "row 1", "the item is a string, not a JSON object"):
        load_dataset(path)


def test_json_single_object(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"text": "lonely"}, indent=2), encoding="utf-8")
    assert load_dataset(path)["text"] == ["lonely"]
    path.write_text(json.dumps({"version": 1, "data": TEXTS}, indent=2), encoding="utf-8")
    with pytest.raises(
        FastftDataError, match=r"one.json holds one JSON object.*'data' field holds a list of 3"
    ):
        load_dataset(path)


def test_parquet_errors_use_row_index(tmp_path):
    rows = [MESSAGES[0], MESSAGES[1], {"messages": [{"role": "narrator", "content": "x"}]}]
    pq.write_table(pa.table(columns_of(rows)), tmp_path / "p.parquet")
    with raises_at("p.parquet", "row 2 (counting from 0)", "unknown role 'narrator'"):
        load_dataset(tmp_path / "p.parquet")
    (tmp_path / "fake.parquet").write_text("not parquet", encoding="utf-8")
    with pytest.raises(FastftDataError, match="could not read fake.parquet as Parquet"):
        load_dataset(tmp_path / "fake.parquet")


def test_dataset_and_list_errors_use_row_index():
    rows = [TEXTS[0], TEXTS[1], TEXTS[2], {"text": None}]
    with raises_at("dataset", "row 3", "'text' is null"):
        load_dataset(datasets.Dataset.from_list(rows * 2).select(range(4)))
    with raises_at("input list", "row 1", "the row is a string, not an object"):
        load_dataset([TEXTS[0], "oops"])
    bad_chat = datasets.Dataset.from_list([MESSAGES[0], {"messages": []}])
    with raises_at("dataset", "row 1", "'messages' is an empty list"):
        load_dataset(bad_chat)


def test_sources_that_are_not_data(tmp_path):
    with pytest.raises(FastftDataError, match="is a directory"):
        load_dataset(tmp_path)
    (tmp_path / "notes.txt").write_text("hello", encoding="utf-8")
    with pytest.raises(FastftDataError, match=r"unsupported file type '.txt'.*\.jsonl"):
        load_dataset(tmp_path / "notes.txt")
    with pytest.raises(FastftDataError, match="can't load a int"):
        load_dataset(42)
    with pytest.raises(FastftDataError, match="not an existing file, a bundled dataset"):
        load_dataset("two words")


# --- missing files and the hub -------------------------------------------------------------------------


@pytest.fixture
def hub_calls(monkeypatch):
    """Replace datasets.load_dataset so nothing reaches the network; records the calls."""
    calls: list[tuple[str, str]] = []

    def offline(path, split=None, **kwargs):
        calls.append((path, split))
        raise ConnectionError("Couldn't reach 'org/name' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    return calls


@pytest.mark.parametrize(
    "missing",
    [
        "data/train.jsonl",
        "train.csv",
        "./x",
        "/no/such/dir/file",
        "a/b/c",
        "~/missing.parquet",
        "C:\\data\\x",
    ],
)
def test_missing_file_names_the_path_and_never_tries_the_hub(hub_calls, missing):
    with pytest.raises(FastftDataError, match=re.escape(f"file not found: {missing}")):
        load_dataset(missing)
    assert hub_calls == []


def test_hub_failure_is_wrapped_with_the_fix(hub_calls):
    with pytest.raises(FastftDataError) as info:
        load_dataset("org/name", split="validation")
    message = str(info.value)
    assert "could not load 'org/name' from the Hugging Face hub" in message
    assert "ConnectionError" in message
    assert message.endswith(
        "Check the id, or download it and pass the local file; this machine may be offline."
    )
    assert isinstance(info.value.__cause__, ConnectionError)
    assert hub_calls == [("org/name", "validation")]


def test_hub_dataset_is_normalised(monkeypatch):
    calls = []

    def fake(path, split=None, **kwargs):
        calls.append((path, split))
        return datasets.Dataset.from_dict(columns_of([{**r, "idx": i} for i, r in enumerate(ALPACA)]))

    monkeypatch.setattr(datasets, "load_dataset", fake)
    ds = load_dataset("tatsu-lab/alpaca")
    assert calls == [("tatsu-lab/alpaca", "train")]
    assert ds["messages"] == ALPACA_MESSAGES
    assert ds.column_names == ["messages", "idx"]


def test_hub_rows_errors_name_the_id(monkeypatch):
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        lambda path, split=None: datasets.Dataset.from_list(TEXTS + [{"text": None}]),
    )
    with raises_at("someone/corpus", "row 3", "'text' is null"):
        load_dataset("someone/corpus")


# --- dataset_kind and speed ----------------------------------------------------------------------------


def test_dataset_kind():
    assert dataset_kind(datasets.Dataset.from_dict({"text": ["a"]})) == "text"
    assert dataset_kind(load_dataset(MESSAGES)) == "chat"
    with pytest.raises(FastftDataError, match="neither 'messages' nor 'text'"):
        dataset_kind(datasets.Dataset.from_dict({"prompt": ["a"]}))


def test_many_jsonl_rows_load_quickly(tmp_path):
    path = tmp_path / "big.jsonl"
    row = json.dumps(
        chat(("system", "Answer."), ("user", "What is 2 + 2?"), ("assistant", "4")) | {"task": "add"}
    )
    path.write_text((row + "\n") * 100_000, encoding="utf-8")
    start = time.perf_counter()
    ds = load_dataset(path)
    elapsed = time.perf_counter() - start
    assert len(ds) == 100_000 and ds.column_names == ["messages", "task"]
    assert elapsed < 20, f"100k rows took {elapsed:.1f}s"


def test_an_unreachable_hub_dataset_loads_its_cached_snapshot_or_fails_at_once(tmp_path):
    """Hub out of reach (a closed loopback port) without HF_HUB_OFFLINE: a cached dataset loads from its
    snapshot and an uncached one fails at once naming the fix; `datasets` alone retried for ~25 s."""
    import os
    import subprocess
    import sys

    repo = tmp_path / "hf" / "hub" / "datasets--some-org--tiny"
    commit = "a" * 40
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(3)]  # fmt: skip
    (repo / "snapshots" / commit / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
        and not k.lower().endswith("_proxy")
    }
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    code = (
        "from fastft.data.errors import FastftDataError\n"
        "from fastft.data.loading import load_dataset\n"
        "ds = load_dataset('some-org/tiny')\n"
        "print(len(ds), ds[2]['messages'][1]['content'])\n"
        "try:\n"
        "    load_dataset('some-org/not-cached')\n"
        "except FastftDataError as error:\n"
        "    print('ERROR', error)\n"
    )
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "3 a2"
    assert "hf download some-org/not-cached --repo-type dataset" in done.stdout
    assert "127.0.0.1:9 cannot be reached" in done.stdout and "Retrying" not in done.stderr
    assert time.perf_counter() - started < 120
