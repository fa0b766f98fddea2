"""Chat rows → token ids and labels, with the loss on assistant responses only.

The conversation is rendered once with the tokenizer's chat template; the character span of
each assistant turn is found by rendering the prefixes (the prompt with the generation prompt,
and the prompt with the turn), and tokens whose characters fall in a span are labelled. That
works with any chat template, including ones without ``{% generation %}`` markers, and the span
includes the end-of-turn token, so the model learns to stop. Rows are rendered and tokenised in
batches: two batched template calls per batch, then the fast (Rust) tokenizer with offset
mappings. `tokenize_dataset` does the same for a `datasets.Dataset` in several processes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import datasets
import numpy as np
import pyarrow as pa

from fastft.checks import whole_number
from fastft.data.errors import MalformedRowError

IGNORE_INDEX = -100
TRAIN_ON = ("responses", "all")
# "cut_prompt": keep the answer, cut the prompt from the left (else cut the end); "truncate": cut the end;
# "drop": leave the row out
OVERLONG = ("cut_prompt", "truncate", "drop")


class ChatTemplateError(ValueError):
    """The tokenizer cannot render chats; the message says how to give it a template."""


@dataclass
class TokenizeStats:
    """Counts of what tokenisation kept, cut and skipped (never silently trained on)."""

    rows: int = 0
    kept: int = 0
    truncated: int = 0  # rows cut to max_seq_length, at either end
    truncated_tokens: int = 0  # tokens those cuts removed
    cut_prompts: int = 0  # truncated rows whose prompt was cut from the left, the answer kept whole
    dropped_overlong: int = 0
    skipped_empty: int = 0
    skipped_no_labels: int = 0


@dataclass
class TokenizedData:
    """Token ids and labels per kept row (int32 arrays; labels use -100 for "not trained")."""

    input_ids: list[np.ndarray]
    labels: list[np.ndarray]
    source_rows: list[int]
    stats: TokenizeStats = field(default_factory=TokenizeStats)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(ids) for ids in self.input_ids), dtype=np.int64, count=len(self.input_ids))


def render_chat(tokenizer, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The templated text of a conversation and the character spans of its assistant turns."""
    return render_chats(tokenizer, [messages])[0]


def render_chats(
    tokenizer, conversations: Sequence[Sequence[dict]]
) -> list[tuple[str, list[tuple[int, int]]]]:
    """`render_chat` for many conversations at once: one ``(text, spans)`` per conversation.

    Each conversation needs its full text and, per assistant turn, the prompt before it (with the
    generation prompt) and the conversation through it. All of them are rendered in two batched
    ``apply_chat_template`` calls (with and without the generation prompt), and the text through a
    final assistant turn is the full text, so it is not rendered twice.
    """
    prompts: list[list[dict]] = []  # rendered with the generation prompt
    plain: list[list[dict]] = []  # rendered without: full texts and texts through a turn
    plans = []
    for messages in conversations:
        messages = list(messages)
        full_at = len(plain)
        plain.append(messages)
        turns = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompts.append(messages[:i])
            through_at = full_at if i == len(messages) - 1 else len(plain)
            if through_at != full_at:
                plain.append(messages[: i + 1])
            turns.append((message, len(prompts) - 1, through_at))
        plans.append((full_at, turns))
    prompt_texts = _render_batch(tokenizer, prompts, add_generation_prompt=True)
    plain_texts = _render_batch(tokenizer, plain, add_generation_prompt=False)
    return [
        _assistant_spans(plain_texts[full_at], [(m, prompt_texts[p], plain_texts[t]) for m, p, t in turns])
        for full_at, turns in plans
    ]


def _render_batch(tokenizer, conversations: list[list[dict]], add_generation_prompt: bool) -> list[str]:
    if not conversations:
        return []
    return tokenizer.apply_chat_template(
        conversations, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _assistant_spans(full: str, turns: list[tuple[dict, str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Spans of the assistant turns in `full`, from each turn's (message, prompt text, text through it)."""
    spans: list[tuple[int, int]] = []
    search_from = 0
    for message, prompt, through in turns:
        if through.startswith(prompt) and full.startswith(through) and len(through) > len(prompt):
            spans.append((len(prompt), len(through)))
            search_from = len(through)
            continue
        # Templates that rewrite earlier turns (e.g. dropping reasoning): fall back to the content,
        # looked for only where this turn is rendered, so a user turn quoting it is never labelled.
        lo, hi = search_from, len(full)
        if full.startswith(prompt):
            lo, hi = max(search_from, len(prompt)), len(through)
        start = full.find(message["content"], lo, hi)
        if start >= 0 and message["content"]:
            spans.append((start, start + len(message["content"])))
            search_from = start + len(message["content"])
    return full, spans


def _check_template(tokenizer) -> None:
    if getattr(tokenizer, "chat_template", None):
        return
    raise ChatTemplateError(
        "This tokenizer has no chat template, so chat rows cannot be rendered. Set one "
        "(tokenizer.chat_template = '...jinja...'), load the model's -Instruct variant, or load "
        "the data as plain text (format='text')."
    )


def tokenize_rows(
    rows: Iterable[dict],
    tokenizer,
    max_seq_length: int,
    train_on: str = "responses",
    overlong: str = "cut_prompt",
    batch_size: int = 1024,
) -> TokenizedData:
    """Tokenise chat rows (``messages``) or text rows (``text``) into ids and labels.

    `train_on="responses"` labels only assistant turns (chats) — text rows are always trained on
    whole; `train_on="all"` labels every token. Rows longer than `max_seq_length`: by default
    (`overlong="cut_prompt"`) the prompt is cut from the left so the answer stays whole, and where the prompt
    is too short for that the row's end is cut; `"truncate"` always cuts the end; `"drop"` leaves the row
    out. Every cut row and its lost tokens are counted. Empty rows and rows left with no labelled token are
    skipped and counted. `rows` is read once, `batch_size` rows at a time.
    """
    check_arguments(max_seq_length, train_on, overlong)
    out = TokenizedData([], [], [])
    stats = out.stats
    for record in tokenized_records(rows, tokenizer, max_seq_length, train_on, overlong, batch_size):
        stats.rows += 1
        stats.truncated += record.truncated
        stats.truncated_tokens += record.cut_tokens
        stats.cut_prompts += record.cut_prompt
        if record.status == KEPT:
            out.input_ids.append(record.input_ids)
            out.labels.append(record.labels)
            out.source_rows.append(record.index)
            stats.kept += 1
        elif record.status == SKIPPED_EMPTY:
            stats.skipped_empty += 1
        elif record.status == SKIPPED_NO_LABELS:
            stats.skipped_no_labels += 1
        else:
            stats.dropped_overlong += 1
    return out


def check_arguments(max_seq_length: int, train_on: str, overlong: str) -> None:
    """Raise `ValueError` naming the valid values when a tokenisation argument is not one of them."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on={train_on!r}: use one of {TRAIN_ON}.")
    if overlong not in OVERLONG:
        raise ValueError(f"overlong={overlong!r}: use one of {OVERLONG}.")
    whole_number("max_seq_length", max_seq_length, minimum=2, fix="It is a token count, e.g. 2048.")


# What became of a row (`RowRecord.status`).
KEPT, SKIPPED_EMPTY, SKIPPED_NO_LABELS, DROPPED_OVERLONG = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class RowRecord:
    """What tokenisation made of one row: ``index`` (its position in the input), ``status`` (`KEPT`,
    `SKIPPED_EMPTY`, `SKIPPED_NO_LABELS` or `DROPPED_OVERLONG`), whether it was ``truncated`` (a
    truncated row can still be skipped for having no labels left), and for kept rows its int32
    ``input_ids`` and ``labels`` of equal length (None otherwise)."""

    index: int
    status: int
    truncated: bool = False
    input_ids: np.ndarray | None = None
    labels: np.ndarray | None = None
    cut_tokens: int = 0  # tokens the truncation removed
    cut_prompt: bool = False  # the cut took the prompt's start, the answer stayed whole


def tokenized_records(
    rows: Iterable[dict],
    tokenizer,
    max_seq_length: int,
    train_on: str = "responses",
    overlong: str = "cut_prompt",
    batch_size: int = 1024,
) -> Iterator[RowRecord]:
    """One `RowRecord` per row of `rows`, read lazily `batch_size` rows at a time.

    Kept rows come in input order; an empty row's record comes as soon as it is read, so it can
    precede the records of earlier rows still waiting to be encoded. `tokenize_rows` collects
    these; arguments are as there (and are not checked here: see `check_arguments`).
    """
    pending: list[tuple[int, object]] = []  # (index, messages) for chats, (index, text) for texts
    checked_template = False
    eos = tokenizer.eos_token or ""
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise MalformedRowError(
                "the data",
                f"the row is a {type(row).__name__}, not a dict",
                row=index,
                fix="Give rows as {'text': ...} or {'messages': [{'role': ..., 'content': ...}, ...]}, or load "
                "the data with fastft.load_dataset(...).",
            )
        if row.get("pair") is not None or ("chosen" in row and "rejected" in row):
            raise ValueError(_PAIRS_FOR_SFT)
        if "messages" in row and row["messages"] is not None:
            messages = row["messages"]
            if not messages or all(not (m.get("content") or "").strip() for m in messages):
                yield RowRecord(index, SKIPPED_EMPTY)
                continue
            if not checked_template:
                _check_template(tokenizer)
                checked_template = True
            pending.append((index, messages))
        else:
            text = row.get("text") or ""
            if not text.strip():
                yield RowRecord(index, SKIPPED_EMPTY)
                continue
            pending.append((index, text + eos))
        if len(pending) >= batch_size:
            yield from _encode(pending, tokenizer, max_seq_length, train_on, overlong)
            pending = []
    if pending:
        yield from _encode(pending, tokenizer, max_seq_length, train_on, overlong)


def _encode(
    pending: list[tuple[int, object]], tokenizer, max_seq_length: int, train_on: str, overlong: str
) -> Iterator[RowRecord]:
    chats = [payload for _, payload in pending if not isinstance(payload, str)]
    if train_on == "all":
        # Every token is trained: the spans are not needed, only the full texts.
        rendered = iter([(text, None) for text in _render_batch(tokenizer, chats, False)])
    else:
        rendered = iter(render_chats(tokenizer, chats))
    texts: list[str] = []
    all_spans: list[list[tuple[int, int]] | None] = []
    for _, payload in pending:
        if isinstance(payload, str):
            texts.append(payload)
            all_spans.append(None)
        else:
            text, spans = next(rendered)
            texts.append(text)
            all_spans.append(spans)
    encoded = tokenizer(
        texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False
    )
    for (index, _), spans, ids, offsets in zip(
        pending, all_spans, encoded["input_ids"], encoded["offset_mapping"], strict=True
    ):
        ids = np.asarray(ids, dtype=np.int32)
        if spans is None:
            labels = ids.copy()
        else:
            starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
            trained = np.zeros(len(ids), dtype=bool)
            for lo, hi in spans:
                trained |= (starts >= lo) & (starts < hi)
            labels = np.where(trained, ids, IGNORE_INDEX).astype(np.int32)
        truncated, cut_tokens, cut_prompt = False, 0, False
        if len(ids) > max_seq_length:
            if overlong == "drop":
                yield RowRecord(index, DROPPED_OVERLONG)
                continue
            truncated, cut_tokens = True, len(ids) - max_seq_length
            ids, labels, cut_prompt = _cut(ids, labels, max_seq_length, overlong)
        labels[0] = IGNORE_INDEX  # the first token is never predicted
        if not (labels != IGNORE_INDEX).any():
            yield RowRecord(index, SKIPPED_NO_LABELS, truncated, cut_tokens=cut_tokens, cut_prompt=cut_prompt)
            continue
        yield RowRecord(index, KEPT, truncated, ids, labels, cut_tokens, cut_prompt)


def _cut(ids: np.ndarray, labels: np.ndarray, max_seq_length: int, overlong: str):
    """`ids` and `labels` cut to `max_seq_length`: from the left when that removes only prompt tokens
    (``cut_prompt``; the answer stays whole and keeps a token of context), else from the right."""
    excess = len(ids) - max_seq_length
    trained = np.flatnonzero(labels != IGNORE_INDEX)
    first_trained = int(trained[0]) if len(trained) else len(ids)
    if overlong == "cut_prompt" and first_trained > excess:
        return ids[excess:], labels[excess:], True
    return ids[:max_seq_length], labels[:max_seq_length], False


# --- datasets.Dataset input, serial or in several processes -----------------------------------------


def is_dataset(obj: object) -> bool:
    """True for a `datasets.Dataset` (checked without importing `datasets` when it is not loaded)."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(obj, module.Dataset)


_PAIRS_FOR_SFT = (
    "These rows are preference pairs (chosen and rejected answers): train them with "
    "fastft.train(..., method='dpo') (or 'orpo', 'simpo'), or pack them with fastft.pack_pairs(rows, tokenizer)."
)


def dataset_column(dataset) -> str:
    """``"messages"`` or ``"text"``: the column of `dataset` that tokenisation reads."""
    column_names = dataset.column_names
    if "pair" in column_names:
        raise ValueError(_PAIRS_FOR_SFT)
    key = "messages" if "messages" in column_names else "text"
    if key not in column_names:
        raise ValueError(
            f"dataset has columns {column_names}; expected 'messages' or 'text'. "
            "Load it with fastft.load_dataset(...) to normalise its format."
        )
    return key


def dataset_rows(dataset, batch_size: int = 1000) -> Iterator[dict]:
    """The rows of a `datasets.Dataset` as ``{column: value}`` dicts with only the column read.

    Read `batch_size` rows at a time (whole Arrow batches convert much faster than row by row,
    docs/journal.md, "Measurements once quoted in code comments"; and only one batch is held as Python objects).
    """
    key = dataset_column(dataset)
    for batch in dataset.select_columns([key]).with_format(None).iter(batch_size=batch_size):
        for value in batch[key]:
            yield {key: value}


def tokenize_dataset(
    dataset,
    tokenizer,
    max_seq_length: int,
    train_on: str = "responses",
    overlong: str = "cut_prompt",
    num_proc: int = 1,
    batch_size: int = 1024,
) -> TokenizedData:
    """`tokenize_rows` for a `datasets.Dataset`, in `num_proc` processes; the same result.

    With ``num_proc > 1`` the ``messages`` (or ``text``) column is tokenised by
    ``Dataset.map(batched=True, num_proc=num_proc)``, in memory (no cache files), and gathered
    back into one `TokenizedData` whose ids, labels, `source_rows` and stats equal the serial
    ones. The tokenizer is pickled to each process (fast tokenizers pickle); the Rust tokenizer
    runs one thread per process unless ``TOKENIZERS_PARALLELISM`` is set.
    """
    check_arguments(max_seq_length, train_on, overlong)
    if num_proc < 1:
        raise ValueError(f"num_proc must be at least 1, got {num_proc}.")
    key = dataset_column(dataset)
    num_proc = min(num_proc, len(dataset))
    if num_proc <= 1:
        return tokenize_rows(dataset_rows(dataset), tokenizer, max_seq_length, train_on, overlong, batch_size)

    features = datasets.Features(
        {
            "status": datasets.Value("int8"),
            "truncated": datasets.Value("bool"),
            "cut_tokens": datasets.Value("int32"),
            "cut_prompt": datasets.Value("bool"),
            # list literals (not datasets.List) so datasets 3.x reads them too
            "input_ids": [datasets.Value("int32")],
            "labels": [datasets.Value("int32")],
        }
    )
    with _tokenizers_parallelism_off():
        out = (
            dataset.select_columns([key])
            .with_format(None)
            .map(
                _tokenize_batch,
                batched=True,
                batch_size=batch_size,
                num_proc=num_proc,
                input_columns=[key],
                remove_columns=[key],
                features=features,
                fn_kwargs=dict(
                    key=key,
                    tokenizer=tokenizer,
                    max_seq_length=max_seq_length,
                    train_on=train_on,
                    overlong=overlong,
                ),
                keep_in_memory=True,
                load_from_cache_file=False,
                # Nothing is cached, so hashing the tokenizer for a fingerprint would be wasted work.
                new_fingerprint=f"fastft-tokenize-{uuid.uuid4().hex}",
                desc=f"fastft: tokenising ({num_proc} processes)",
            )
        )
    return _gather(out.with_format("arrow")[:])


def _tokenize_batch(
    values: list, key: str, tokenizer, max_seq_length: int, train_on: str, overlong: str
) -> pa.Table:
    """`Dataset.map` worker: one output row per input row (status, truncated, ids, labels)."""

    n = len(values)
    status = np.zeros(n, dtype=np.int8)
    truncated = np.zeros(n, dtype=bool)
    cut_tokens = np.zeros(n, dtype=np.int32)
    cut_prompt = np.zeros(n, dtype=bool)
    lengths = np.zeros(n, dtype=np.int64)
    ids: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    records = tokenized_records(
        ({key: value} for value in values), tokenizer, max_seq_length, train_on, overlong, batch_size=n
    )
    for record in records:  # kept rows come in input order
        status[record.index] = record.status
        truncated[record.index] = record.truncated
        cut_tokens[record.index] = record.cut_tokens
        cut_prompt[record.index] = record.cut_prompt
        if record.status == KEPT:
            lengths[record.index] = len(record.input_ids)
            ids.append(record.input_ids)
            labels.append(record.labels)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    empty = np.zeros(0, dtype=np.int32)
    # An Arrow table, not lists: datasets stores it as is instead of converting every token.
    return pa.table(
        {
            "status": pa.array(status),
            "truncated": pa.array(truncated),
            "cut_tokens": pa.array(cut_tokens),
            "cut_prompt": pa.array(cut_prompt),
            "input_ids": pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(ids) if ids else empty)),
            "labels": pa.ListArray.from_arrays(
                offsets, pa.array(np.concatenate(labels) if labels else empty)
            ),
        }
    )


def _gather(table: pa.Table) -> TokenizedData:
    """The `TokenizedData` of `_tokenize_batch`'s output rows (in input order)."""
    status = table.column("status").to_numpy()
    counts = np.bincount(status, minlength=4)
    out = TokenizedData([], [], [])
    out.stats = TokenizeStats(
        rows=len(status),
        kept=int(counts[KEPT]),
        truncated=int(table.column("truncated").to_numpy().sum()),
        truncated_tokens=int(table.column("cut_tokens").to_numpy().sum()),
        cut_prompts=int(table.column("cut_prompt").to_numpy().sum()),
        dropped_overlong=int(counts[DROPPED_OVERLONG]),
        skipped_empty=int(counts[SKIPPED_EMPTY]),
        skipped_no_labels=int(counts[SKIPPED_NO_LABELS]),
    )
    start = 0
    for batch in table.to_batches():
        if not batch.num_rows:
            continue
        kept = np.flatnonzero(status[start : start + batch.num_rows] == KEPT)
        for name, target in (("input_ids", out.input_ids), ("labels", out.labels)):
            column = batch.column(name)
            offsets = column.offsets.to_numpy()
            # One writable int32 copy per Arrow batch; each row is a view into it.
            values = np.array(column.values.to_numpy()[offsets[0] : offsets[-1]], dtype=np.int32)
            offsets = offsets - offsets[0]
            target.extend(values[offsets[i] : offsets[i + 1]] for i in kept)
        out.source_rows.extend((kept + start).tolist())
        start += batch.num_rows
    return out


@contextlib.contextmanager
def _tokenizers_parallelism_off() -> Iterator[None]:
    # Each worker is one process per core already: a Rust thread pool in each would oversubscribe
    # the cores, and a forked child of a parent that used the pool prints a warning and goes serial.
    if "TOKENIZERS_PARALLELISM" in os.environ:
        yield
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
