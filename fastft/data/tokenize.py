"""Chat rows → token ids and labels, with the loss on assistant responses only.

The conversation is rendered once with the tokenizer's chat template; the character span of
each assistant turn is found by rendering the prefixes (the prompt with the generation prompt,
and the prompt with the turn), and tokens whose characters fall in a span are labelled. That
works with any chat template, including ones without ``{% generation %}`` markers, and the span
includes the end-of-turn token, so the model learns to stop. Texts are tokenised in batches by
the fast (Rust) tokenizer with offset mappings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

IGNORE_INDEX = -100
TRAIN_ON = ("responses", "all")
OVERLONG = ("truncate", "drop")


class ChatTemplateError(ValueError):
    """The tokenizer cannot render chats; the message says how to give it a template."""


@dataclass
class TokenizeStats:
    """Counts of what tokenisation kept, cut and skipped (never silently trained on)."""

    rows: int = 0
    kept: int = 0
    truncated: int = 0
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
    full = tokenizer.apply_chat_template(list(messages), tokenize=False)
    spans: list[tuple[int, int]] = []
    search_from = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(list(messages[:i]), tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=False)
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
    overlong: str = "truncate",
    batch_size: int = 1024,
) -> TokenizedData:
    """Tokenise chat rows (``messages``) or text rows (``text``) into ids and labels.

    `train_on="responses"` labels only assistant turns (chats) — text rows are always trained on
    whole; `train_on="all"` labels every token. Rows longer than `max_seq_length` are cut to it
    (`overlong="truncate"`, counted) or left out (`"drop"`, counted). Empty rows and rows left with
    no labelled token are skipped and counted.
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on={train_on!r}: use one of {TRAIN_ON}.")
    if overlong not in OVERLONG:
        raise ValueError(f"overlong={overlong!r}: use one of {OVERLONG}.")
    if max_seq_length < 2:
        raise ValueError(f"max_seq_length must be at least 2, got {max_seq_length}.")
    out = TokenizedData([], [], [])
    pending: list[tuple[int, str, list[tuple[int, int]] | None]] = []
    checked_template = False
    eos = tokenizer.eos_token or ""

    for index, row in enumerate(rows):
        out.stats.rows += 1
        if "messages" in row and row["messages"] is not None:
            messages = row["messages"]
            if not messages or all(not (m.get("content") or "").strip() for m in messages):
                out.stats.skipped_empty += 1
                continue
            if not checked_template:
                _check_template(tokenizer)
                checked_template = True
            text, spans = render_chat(tokenizer, messages)
            pending.append((index, text, None if train_on == "all" else spans))
        else:
            text = row.get("text") or ""
            if not text.strip():
                out.stats.skipped_empty += 1
                continue
            pending.append((index, text + eos, None))
        if len(pending) >= batch_size:
            _encode(pending, tokenizer, max_seq_length, overlong, out)
            pending = []
    if pending:
        _encode(pending, tokenizer, max_seq_length, overlong, out)
    return out


def _encode(pending, tokenizer, max_seq_length: int, overlong: str, out: TokenizedData) -> None:
    encoded = tokenizer(
        [text for _, text, _ in pending],
        add_special_tokens=False,
        return_offsets_mapping=True,
        return_attention_mask=False,
    )
    for (index, _, spans), ids, offsets in zip(
        pending, encoded["input_ids"], encoded["offset_mapping"], strict=True
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
        if len(ids) > max_seq_length:
            if overlong == "drop":
                out.stats.dropped_overlong += 1
                continue
            ids, labels = ids[:max_seq_length], labels[:max_seq_length]
            out.stats.truncated += 1
        labels[0] = IGNORE_INDEX  # the first token is never predicted
        if not (labels != IGNORE_INDEX).any():
            out.stats.skipped_no_labels += 1
            continue
        out.input_ids.append(ids)
        out.labels.append(labels)
        out.source_rows.append(index)
        out.stats.kept += 1
