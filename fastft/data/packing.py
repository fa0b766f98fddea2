"""Padding-free packing: best-fit decreasing of tokenised rows into bins of `max_seq_length` tokens.

Longest sequences are placed first, each into the fullest bin that still has room (best fit),
opening a new bin only when none has. Bins are looked up through the sorted set of distinct
remaining capacities (at most `max_seq_length` + 1 values), so packing n sequences costs
O(n log max_seq_length) and is deterministic: ties keep the rows' original order.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from fastft.data.batch import PackedBatch
from fastft.data.tokenize import TokenizedData, TokenizeStats, tokenize_rows


def best_fit_decreasing(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins whose sums are at most `capacity`.

    Each bin lists its items longest first; bins come in the order they were opened.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.max() > capacity:
        raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit a bin of {capacity}")
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    free_by_room: dict[int, list[int]] = {}  # remaining room → bins with exactly that room
    rooms: list[int] = []  # sorted distinct rooms present in free_by_room
    for index in order.tolist():
        need = int(lengths[index])
        slot = bisect.bisect_left(rooms, need)
        if slot < len(rooms):
            room = rooms[slot]
            stack = free_by_room[room]
            bin_id = stack.pop()
            if not stack:
                del free_by_room[room]
                rooms.pop(slot)
        else:
            room = capacity
            bin_id = len(bins)
            bins.append([])
        bins[bin_id].append(index)
        left = room - need
        if left > 0:
            if left not in free_by_room:
                free_by_room[left] = []
                bisect.insort(rooms, left)
            free_by_room[left].append(bin_id)
    return bins


@dataclass(frozen=True)
class PackingStats:
    """How well the rows packed, and what was cut or skipped on the way."""

    sequences: int
    bins: int
    max_seq_length: int
    tokens: int
    trained_tokens: int
    efficiency: float  # tokens / (bins × max_seq_length): the share of each bin that is not padding
    sequences_per_bin: float
    tokenize: TokenizeStats

    def summary(self) -> str:
        t = self.tokenize
        return (
            f"{self.sequences} sequences → {self.bins} bins of {self.max_seq_length} tokens "
            f"({self.efficiency:.1%} full, {self.sequences_per_bin:.1f} sequences/bin, "
            f"{self.trained_tokens} trained tokens); truncated {t.truncated}, dropped {t.dropped_overlong}, "
            f"skipped {t.skipped_empty} empty and {t.skipped_no_labels} without labels"
        )


class PackedDataset:
    """Tokenised rows packed into bins; `batch([i, j])` concatenates bins into one `PackedBatch`."""

    def __init__(self, data: TokenizedData, bins: list[list[int]], max_seq_length: int):
        self.data = data
        self.bins = bins
        self.max_seq_length = max_seq_length
        tokens = int(data.lengths.sum()) if len(data) else 0
        trained = sum(int((labels[1:] != -100).sum()) for labels in data.labels)
        self.stats = PackingStats(
            sequences=len(data),
            bins=len(bins),
            max_seq_length=max_seq_length,
            tokens=tokens,
            trained_tokens=trained,
            efficiency=tokens / (len(bins) * max_seq_length) if bins else 0.0,
            sequences_per_bin=len(data) / len(bins) if bins else 0.0,
            tokenize=data.stats,
        )

    def __len__(self) -> int:
        return len(self.bins)

    def batch(self, bin_indices: Iterable[int]) -> PackedBatch:
        """The sequences of the given bins, in bin order, as one CPU `PackedBatch`."""
        members = [row for b in bin_indices for row in self.bins[b]]
        return PackedBatch.from_sequences(
            [self.data.input_ids[i] for i in members], [self.data.labels[i] for i in members]
        )

    def __repr__(self) -> str:
        return f"PackedDataset({self.stats.summary()})"


def pack(
    dataset,
    tokenizer,
    max_seq_length: int | None = None,
    train_on: str = "responses",
    overlong: str = "truncate",
) -> PackedDataset:
    """Tokenise `dataset` (rows with ``messages`` or ``text``) and pack it into bins.

    `max_seq_length` defaults to the tokenizer's ``model_max_length`` set by `load_model`.
    See `tokenize_rows` for `train_on` and `overlong`. The result's `.stats` reports packing
    efficiency, sequences per bin and every truncated, dropped or skipped row.
    """
    if max_seq_length is None:
        max_seq_length = int(tokenizer.model_max_length)
        if max_seq_length > 1_000_000:
            raise ValueError("pass max_seq_length=…: this tokenizer does not say how long its inputs are")
    data = tokenize_rows(_rows(dataset), tokenizer, max_seq_length, train_on=train_on, overlong=overlong)
    if not len(data):
        raise ValueError(
            f"No trainable rows: {data.stats}. Check the dataset's format and that chats have "
            "assistant turns (or use train_on='all')."
        )
    bins = best_fit_decreasing(data.lengths, max_seq_length)
    return PackedDataset(data, bins, max_seq_length)


def _rows(dataset) -> Iterable[dict]:
    """Rows as dicts with only the columns tokenisation reads (fast for Arrow-backed datasets)."""
    column_names = getattr(dataset, "column_names", None)
    if column_names is not None:
        key = "messages" if "messages" in column_names else "text"
        if key not in column_names:
            raise ValueError(
                f"dataset has columns {column_names}; expected 'messages' or 'text'. "
                "Load it with fastft.load_dataset(...) to normalise its format."
            )
        return ({key: value} for value in dataset[key])
    return iter(dataset)
