"""`load_dataset`: turn any supported input into a `datasets.Dataset` with the normalised schema.

Inputs: ``"bundled:NAME"``; a local ``.jsonl``/``.ndjson``, ``.json``, ``.csv``/``.tsv`` or ``.parquet``
file; a ``datasets.Dataset``/``DatasetDict``; a pandas DataFrame; a list of dicts; or a Hugging Face
hub id. Output: a ``messages`` column (chat) or a ``text`` column (plain text), plus the source's
other columns unchanged. Bad rows raise `MalformedRowError` naming the file and line (or row index).

JSON Lines and CSV are parsed here, not by ``datasets``, so every error can point at a line.
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from fastft.data.hub import cached_dataset_snapshot, declared_offline, offline_fix, offline_reason

from .errors import FastftDataError, MalformedRowError
from .formats import consumed_fields, converter, describe, detect_format, output_column

__all__ = ["BUNDLED_DIR", "SUPPORTED_SUFFIXES", "dataset_kind", "list_bundled", "load_dataset"]

BUNDLED_DIR = Path(__file__).parent / "bundled"
SUPPORTED_SUFFIXES: tuple[str, ...] = (".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".parquet")

_MESSAGE_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
# a list literal (not datasets.List) so datasets 3.x reads it too
_MESSAGE_FEATURE = [{"role": datasets.Value("string"), "content": datasets.Value("string")}]
_PAIR_SIDES = ("prompt", "chosen", "rejected")
_PAIR_TYPE = pa.struct([(side, _MESSAGE_TYPE) for side in _PAIR_SIDES])
_PAIR_FEATURE = {side: _MESSAGE_FEATURE for side in _PAIR_SIDES}
_COLUMN_TYPES = {"messages": _MESSAGE_TYPE, "pair": _PAIR_TYPE, "text": pa.string()}
_COLUMN_FEATURES = {"messages": _MESSAGE_FEATURE, "pair": _PAIR_FEATURE, "text": datasets.Value("string")}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_PATHY_SUFFIXES = {*SUPPORTED_SUFFIXES, ".txt", ".arrow", ".gz", ".zip", ".xz", ".bz2", ".zst", ".xlsx"}
_decode_json = json.JSONDecoder().decode
_OFFLINE_FIX = "Check the id, or download it and pass the local file; this machine may be offline."


def list_bundled() -> list[str]:
    """Names of the datasets shipped with fastft, for ``load_dataset("bundled:NAME")``."""
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.jsonl"))


def dataset_kind(ds: datasets.Dataset) -> str:
    """``"pairs"`` when `ds` has a ``pair`` column (preference rows), ``"chat"`` when it has a ``messages``
    column, ``"text"`` when it has a ``text`` column, in that order. Raises `FastftDataError` for a dataset
    with none (not normalised: pass it through `load_dataset` first).
    """
    columns = ds.column_names
    if "pair" in columns:
        return "pairs"
    if "messages" in columns:
        return "chat"
    if "text" in columns:
        return "text"
    raise FastftDataError(
        f"dataset with columns {columns} has neither 'messages' nor 'text'; "
        "pass it through fastft's load_dataset(...) to normalise it"
    )


def load_dataset(source: Any, format: str = "auto", split: str = "train") -> datasets.Dataset:
    """Load `source` as a normalised `datasets.Dataset`.

    Args:
        source: ``"bundled:NAME"`` (see `list_bundled`); a path (str or PathLike) to a ``.jsonl``,
            ``.ndjson``, ``.json`` (array of objects or JSON lines), ``.csv``, ``.tsv`` or ``.parquet``
            file; a ``datasets.Dataset`` or ``DatasetDict``; a pandas DataFrame; a list of dicts; or
            a Hugging Face hub dataset id (any other string that is not an existing path).
        format: ``"auto"`` (detect from the first row, then require every row to match), or one of
            ``"alpaca"``, ``"sharegpt"``, ``"messages"``, ``"text"``.
        split: the split to take from a ``DatasetDict`` or a hub dataset; ignored for files and lists.

    Returns:
        A dataset with a ``messages`` column (list of ``{"role", "content"}``, roles in
        system/user/assistant/tool) or a ``text`` column, followed by the source's other columns;
        `dataset_kind` tells which.

    Raises:
        MalformedRowError: a row does not fit the format; the message names the file and 1-based line
            (JSON Lines, CSV) or the 0-based row (Parquet, JSON arrays, lists, datasets).
        FastftDataError: unknown format, missing or unsupported file, empty input, unknown bundled
            name, missing split, or a hub dataset that could not be loaded.
    """
    fmt = _check_format(format)
    if isinstance(source, datasets.DatasetDict):
        source = _pick_split(source, split, "DatasetDict")
    if isinstance(source, datasets.Dataset):
        return _normalise_dataset(source, fmt, "dataset")
    if isinstance(source, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise FastftDataError(
            "streaming (iterable) datasets are not supported; load it without streaming=True, "
            "or take rows with .take(n) and pass list(...) of them"
        )
    if _is_dataframe(source):
        try:
            ds = datasets.Dataset.from_pandas(source, preserve_index=False)
        except Exception as e:  # pyarrow can't store a column
            raise FastftDataError(f"could not convert the DataFrame to a dataset ({e})") from e
        return _normalise_dataset(ds, fmt, "DataFrame")
    if isinstance(source, (list, tuple)):
        return _build(enumerate(source), fmt, "input list", "row")
    if isinstance(source, (str, os.PathLike)):
        return _load_path_or_id(os.fspath(source), fmt, split)
    raise FastftDataError(
        f"can't load a {type(source).__name__}; pass a file path, 'bundled:NAME', a hub id, "
        "a datasets.Dataset, a pandas DataFrame, or a list of dicts"
    )


# --- sources ------------------------------------------------------------------------------------------


def _check_format(format: str) -> str | None:
    """None for auto, else the validated format name."""
    if format == "auto":
        return None
    converter(format)  # raises with the list of valid names
    return format


def _is_dataframe(obj: Any) -> bool:
    pandas = sys.modules.get("pandas")
    return pandas is not None and isinstance(obj, pandas.DataFrame)


def _pick_split(dd: datasets.DatasetDict, split: str, label: str) -> datasets.Dataset:
    if split not in dd:
        raise FastftDataError(
            f"{label} has no split {split!r}; available splits: {', '.join(dd) or 'none'}. Pass split=..."
        )
    return dd[split]


def _load_path_or_id(source: str, fmt: str | None, split: str) -> datasets.Dataset:
    if source.startswith("bundled:"):
        return _load_file(_bundled_path(source[len("bundled:") :]), fmt)
    path = Path(source).expanduser()
    if path.exists():
        return _load_file(path, fmt)
    if _looks_like_path(source):
        raise FastftDataError(f"file not found: {source} (resolved to {path.absolute()}). Check the path.")
    if not _HUB_ID.match(source):
        raise FastftDataError(
            f"{source!r} is not an existing file, a bundled dataset ('bundled:NAME', one of "
            f"{', '.join(list_bundled())}), or a Hugging Face hub id like 'org/name'"
        )
    return _load_hub(source, fmt, split)


def _bundled_path(name: str) -> Path:
    name = name.strip().removesuffix(".jsonl")
    available = list_bundled()
    if name not in available:
        raise FastftDataError(
            f"no bundled dataset named {name!r}; available: {', '.join('bundled:' + n for n in available)}"
        )
    return BUNDLED_DIR / f"{name}.jsonl"


def _looks_like_path(source: str) -> bool:
    """True for strings that are meant as file paths, not hub ids ('org/name' has one slash, no data suffix)."""
    if source.startswith(("/", "./", "../", "~", ".\\", "..\\")) or "\\" in source or source.count("/") > 1:
        return True
    if re.match(r"^[A-Za-z]:[\\/]", source):
        return True
    return Path(source).suffix.lower() in _PATHY_SUFFIXES


def _load_hub(source: str, fmt: str | None, split: str) -> datasets.Dataset:
    target = source
    if not declared_offline() and offline_reason() is not None:
        # out of reach though not declared offline: `datasets` would retry for half a minute; read the
        # cached snapshot instead, or say at once what to do
        target = cached_dataset_snapshot(source)
        if target is None:
            raise FastftDataError(offline_fix(source, repo_type="dataset"))
    try:
        loaded = datasets.load_dataset(target, split=split)
    except Exception as e:  # anything the hub client raises: offline, gated, missing, bad config
        detail = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise FastftDataError(
            f"could not load {source!r} from the Hugging Face hub ({type(e).__name__}: {detail}). {_OFFLINE_FIX}"
        ) from e
    if isinstance(loaded, datasets.DatasetDict):
        loaded = _pick_split(loaded, split, source)
    if not isinstance(loaded, datasets.Dataset):
        raise FastftDataError(f"hub dataset {source!r} loaded as {type(loaded).__name__}, not a Dataset")
    return _normalise_dataset(loaded, fmt, source)


def _load_file(path: Path, fmt: str | None) -> datasets.Dataset:
    label = path.name
    if path.is_dir():
        raise FastftDataError(f"{path} is a directory; pass one data file ({', '.join(SUPPORTED_SUFFIXES)})")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _build(_iter_jsonl(path, label), fmt, label, "line")
    if suffix == ".json":
        kind, items = _iter_json(path, label)
        return _build(items, fmt, label, kind)
    if suffix in (".csv", ".tsv"):
        return _build(_iter_csv(path, label, "\t" if suffix == ".tsv" else ","), fmt, label, "line")
    if suffix == ".parquet":
        return _build(_iter_parquet(path, label), fmt, label, "row")
    raise FastftDataError(
        f"{path} has an unsupported file type {suffix or '(no suffix)'!r}; supported: {', '.join(SUPPORTED_SUFFIXES)}"
    )


# --- file readers: each yields (location, row dict) -----------------------------------------------------


def _iter_jsonl(path: Path, label: str) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = _decode_json(raw.rstrip(b"\r\n").decode("utf-8-sig" if number == 1 else "utf-8"))
            except json.JSONDecodeError as e:
                raise MalformedRowError(label, _json_problem(e), line=number) from None
            except UnicodeDecodeError as e:
                raise MalformedRowError(
                    label,
                    f"not valid UTF-8 ({e.reason} at byte {e.start} of the line)",
                    line=number,
                    fix="Save the file as UTF-8.",
                ) from None
            if type(obj) is not dict:
                raise MalformedRowError(
                    label,
                    f"the line holds {describe(obj)}, not a JSON object (JSON Lines needs one object per line)",
                    line=number,
                )
            yield number, obj


def _json_detail(e: json.JSONDecodeError) -> str:
    """ "Expecting ',' delimiter at column 7" from a decode error (its msg may already end in 'at')."""
    return f"{e.msg}{'' if e.msg.endswith(' at') else ' at'} column {e.colno}"


def _json_problem(e: json.JSONDecodeError) -> str:
    return f"invalid JSON ({_json_detail(e)})"


def _iter_json(path: Path, label: str) -> tuple[str, Iterable[tuple[int, Any]]]:
    """A ``.json`` file: a JSON array of objects (located by row), or JSON lines (located by line)."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise MalformedRowError(
            label, f"not valid UTF-8 ({e.reason})", line=line, fix="Save the file as UTF-8."
        ) from None
    stripped = text.lstrip()
    if not stripped:
        return "line", []
    if stripped[0] == "[":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise MalformedRowError(
                label,
                _json_problem(e),
                line=e.lineno,
                fix="Fix the JSON: the file must be a JSON array of objects, or one JSON object per line.",
            ) from None
        return "row", _check_array(rows, label)
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None  # several objects: JSON lines
    if isinstance(whole, dict):
        return "line", [(text[: len(text) - len(stripped)].count("\n") + 1, _single_object(whole, label))]
    return "line", _iter_jsonl(path, label)


def _check_array(rows: list, label: str) -> Iterator[tuple[int, Any]]:
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise MalformedRowError(label, f"the item is {describe(row)}, not a JSON object", row=i)
        yield i, row


def _single_object(obj: dict, label: str) -> dict:
    """A .json file holding one object: a one-row dataset if it looks like a row, else a clear error."""
    try:
        detect_format(obj)
        return obj
    except FastftDataError:
        pass
    hint = ""
    for key, value in obj.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            hint = (
                f" Its {key!r} field holds a list of {len(value)} objects: pass that list instead, "
                f"e.g. load_dataset(json.load(open(path))[{key!r}])."
            )
            break
    raise FastftDataError(
        f"{label} holds one JSON object with fields {list(obj)[:12]}, not rows; expected a JSON array "
        f"of objects or one object per line.{hint}"
    )


def _iter_csv(path: Path, label: str, delimiter: str) -> Iterator[tuple[int, Any]]:
    """CSV/TSV rows as dicts of strings, located by the physical line where each record starts."""
    if csv.field_size_limit() < 2**31 - 1:
        csv.field_size_limit(2**31 - 1)  # long training texts exceed the 128 KiB default
    with open(path, newline="", encoding="utf-8-sig") as f:
        # strict: an unclosed quote is an error, not a field that swallows the rest of the file
        reader = csv.reader(f, delimiter=delimiter, strict=True)
        header: list[str] | None = None
        previous = 0  # physical lines consumed before the current record
        while True:
            start = previous + 1
            try:
                record = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                if "unexpected end of data" in str(e):
                    raise MalformedRowError(
                        label,
                        "a quote opened in the record that starts here is never closed, so it would swallow "
                        "the rest of the file",
                        line=start,
                        fix='Close the quote (a quote inside a quoted field is written twice: "").',
                    ) from None
                raise MalformedRowError(label, f"the CSV can't be parsed ({e})", line=start) from None
            except UnicodeDecodeError as e:
                raise MalformedRowError(
                    label, f"not valid UTF-8 ({e.reason})", line=start, fix="Save the file as UTF-8."
                ) from None
            previous = reader.line_num
            if not record:
                continue  # blank line
            if header is None:
                header = [name.strip() for name in record]
                _check_header(header, label, start)
                continue
            if len(record) != len(header):
                raise MalformedRowError(
                    label,
                    f"the record has {len(record)} fields but the header has {len(header)} "
                    "(look for an unquoted comma or newline, or a missing quote)",
                    line=start,
                )
            row: dict[str, Any] = dict(zip(header, record, strict=True))
            for field in ("messages", "conversations"):
                if field in row:
                    row[field] = _json_cell(row[field], field, label, start)
            yield start, row


def _check_header(header: list[str], label: str, line: int) -> None:
    if any(not name for name in header):
        raise MalformedRowError(
            label, f"the header {header} has an empty column name", line=line, fix="Name every column."
        )
    repeated = sorted({name for name in header if header.count(name) > 1})
    if repeated:
        raise MalformedRowError(
            label, f"the header repeats column names {repeated}", line=line, fix="Rename the columns."
        )


def _json_cell(cell: str, field: str, label: str, line: int) -> Any:
    """A chat column stored in a CSV cell must be JSON text (a list of message objects)."""
    try:
        return json.loads(cell)
    except json.JSONDecodeError as e:
        raise MalformedRowError(
            label,
            f"the '{field}' cell is not valid JSON ({_json_detail(e)} of the cell); in a CSV, "
            f"'{field}' must hold a JSON list of message objects",
            line=line,
        ) from None


def _iter_parquet(path: Path, label: str) -> Iterator[tuple[int, Any]]:
    try:
        table = pq.read_table(path)
    except Exception as e:  # not Parquet, truncated, unsupported encoding
        raise FastftDataError(
            f"could not read {label} as Parquet ({e}). Check that the file is complete."
        ) from e
    return enumerate(table.to_pylist())


# --- normalisation ----------------------------------------------------------------------------------------


def _error(label: str, kind: str, loc: int, reason: str) -> MalformedRowError:
    return MalformedRowError(label, reason, **{kind: loc})


def _where(kind: str, loc: int) -> str:
    return f"line {loc}" if kind == "line" else f"row {loc}"


def _mismatch_reason(reason: str, row: Any, fmt: str, first: str) -> str:
    """In auto mode, say when a failing row is in another format than the first row."""
    try:
        other = detect_format(row)
    except FastftDataError:
        return f"{reason} (the format {fmt} was detected from {first})"
    if other == fmt:
        return reason
    return f"this row is in the {other} format, but {first} is {fmt}; every row must use one format"


def _build(items: Iterable[tuple[int, Any]], fmt: str | None, label: str, kind: str) -> datasets.Dataset:
    """Normalise (location, row) pairs into Python lists, then build the dataset once."""
    auto = fmt is None
    convert = column = first = None
    main: list = []
    extras: list[dict[str, Any]] = []
    locations: list[int] = []
    for loc, row in items:
        if not isinstance(row, (dict, Mapping)):  # dict first: the ABC check is slow
            raise _error(label, kind, loc, f"the row is {describe(row)}, not an object with named fields")
        if convert is None:
            if fmt is None:
                try:
                    fmt = detect_format(row)
                except FastftDataError as e:
                    raise MalformedRowError(label, str(e), fix="", **{kind: loc}) from None
            convert, column, first = converter(fmt), output_column(fmt), _where(kind, loc)
        try:
            value = convert(row)[column]
        except FastftDataError as e:
            reason = _mismatch_reason(str(e), row, fmt, first) if auto else str(e)
            raise _error(label, kind, loc, reason) from None
        consumed = consumed_fields(fmt, row)
        main.append(value)
        extras.append({k: v for k, v in row.items() if k not in consumed})
        locations.append(loc)
    if not main:
        raise FastftDataError(
            f"{label} is empty: it has no rows. Add data, or check that you passed the right file."
        )
    names: dict[str, None] = {}
    for extra in extras:
        names.update(dict.fromkeys(extra))
    columns: dict[str, pa.Array] = {column: pa.array(main, type=_COLUMN_TYPES[column])}
    for name in names:
        values = [extra.get(name) for extra in extras]
        columns[name] = _extra_column(name, values, locations, label, kind)
    return datasets.Dataset.from_dict(columns)


def _extra_column(name: str, values: list, locations: list[int], label: str, kind: str) -> pa.Array:
    """An extra column as Arrow; a column whose rows disagree on type is reported at the first odd row."""
    try:
        return pa.array(values)
    except (pa.ArrowException, OverflowError, TypeError, ValueError) as e:
        problem = e
    first_index = next((i for i, v in enumerate(values) if v is not None), None)
    if first_index is not None:
        expected = describe(values[first_index])
        for i, v in enumerate(values):
            if v is not None and describe(v) != expected:
                where = _where(kind, locations[first_index])
                raise _error(
                    label,
                    kind,
                    locations[i],
                    f"field {name!r} is {describe(v)} here but {expected} on {where}; "
                    "a field must have one type in every row (convert it, or drop the field)",
                )
    raise FastftDataError(
        f"{label}: field {name!r} can't be stored as a column ({problem}). "
        "Give it the same structure in every row, or drop it."
    )


def _normalise_dataset(ds: datasets.Dataset, fmt: str | None, label: str) -> datasets.Dataset:
    """Normalise a `datasets.Dataset` with a batched ``map``; failures name the 0-based row index."""
    if len(ds) == 0:
        raise FastftDataError(f"{label} is empty: it has no rows.")
    first_row = ds[0]
    auto = fmt is None
    if fmt is None:
        try:
            fmt = detect_format(first_row)
        except FastftDataError as e:
            raise MalformedRowError(label, str(e), row=0, fix="") from None
    column = output_column(fmt)
    remove = [c for c in consumed_fields(fmt, first_row) if c in ds.column_names]
    features = datasets.Features({c: ds.features[c] for c in ds.column_names if c not in remove})
    features[column] = _COLUMN_FEATURES[column]
    convert = converter(fmt)

    def normalise(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        names = list(batch)
        out = []
        for j, index in enumerate(indices):
            row = {name: batch[name][j] for name in names}
            try:
                out.append(convert(row)[column])
            except FastftDataError as e:
                reason = _mismatch_reason(str(e), row, fmt, "row 0") if auto else str(e)
                raise MalformedRowError(label, reason, row=index) from None
        return {column: out}

    out = ds.map(
        normalise,
        batched=True,
        with_indices=True,
        remove_columns=remove,
        features=features,
        desc=f"fastft: normalising {label}",
    )
    return out.select_columns([column, *(c for c in out.column_names if c != column)])
