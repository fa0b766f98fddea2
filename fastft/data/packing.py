"""Padding-free packing: best-fit decreasing of tokenised rows into bins of `max_seq_length` tokens.

Longest sequences are placed first, each into the fullest bin that still has room (best fit),
opening a new bin only when none has. Bins are looked up through the sorted set of distinct
remaining capacities (at most `max_seq_length` + 1 values), so packing n sequences costs
O(n log max_seq_length) and is deterministic: ties keep the rows' original order.

`pack` tokenises a large `datasets.Dataset` in several processes (same result as one);
`pack_shards` packs data larger than memory one shard of rows at a time.
"""

from __future__ import annotations

import bisect
import itertools
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from fastft.atomic import write_file_atomically
from fastft.data.batch import PackedBatch
from fastft.data.tokenize import (
    TokenizedData,
    TokenizeStats,
    check_arguments,
    dataset_column,
    dataset_rows,
    is_dataset,
    tokenize_dataset,
    tokenize_rows,
)


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
            f"{self.trained_tokens} trained tokens); truncated {t.truncated}{_cut_detail(t)}, dropped "
            f"{t.dropped_overlong}, skipped {t.skipped_empty} empty and {t.skipped_no_labels} without labels"
        )


def _cut_detail(stats: TokenizeStats) -> str:
    if not stats.truncated:
        return ""
    return f" ({stats.truncated_tokens} tokens lost; {stats.cut_prompts} cut in the prompt, answer kept)"


def warn_truncated(stats: TokenizeStats, max_seq_length: int, overlong: str) -> None:
    """Say how many rows were cut and how many tokens were lost (a warning, not only a counter in `.stats`)."""
    if not stats.truncated:
        return
    ends = stats.truncated - stats.cut_prompts
    how = f"{stats.cut_prompts} lost the start of their prompt (the answer kept whole), {ends} lost their end"
    warnings.warn(
        f"{stats.truncated} of {stats.rows} rows are longer than max_seq_length={max_seq_length}: {how}; "
        f"{stats.truncated_tokens} tokens cut in all (overlong={overlong!r}). Raise max_seq_length to keep them "
        "whole, or pass overlong='drop' to leave such rows out.",
        stacklevel=3,
    )


class PackedDataset:
    """Tokenised rows packed into bins; `batch([i, j])` concatenates bins into one `PackedBatch`."""

    def __init__(self, data: TokenizedData, bins: list[list[int]], max_seq_length: int):
        self.data = data
        self.bins = bins
        self.max_seq_length = max_seq_length
        tokens = int(data.lengths.sum()) if len(data) else 0
        # each row's trained targets in a batch: its labels after the first token (a batch never predicts a
        # sequence's first token, `PackedBatch.from_sequences`); counted once, for the stats and the shapes
        self.trained_per_row = np.fromiter(
            ((labels[1:] != -100).sum() for labels in data.labels), dtype=np.int64, count=len(data.labels)
        )
        trained = int(self.trained_per_row.sum())
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

    def batches_repeat_one_shape(self) -> bool:
        """Every batch of these bins has one shape as it is: fixed-length rows with the same number of trained
        tokens each, the same number per bin (pretraining chunks, the benchmarks' random tokens), so a CUDA
        graph replays it unpadded."""
        lengths = self.data.lengths
        if not len(lengths) or len(set(lengths.tolist())) != 1 or len({len(b) for b in self.bins}) != 1:
            return False
        return len(set(self.trained_per_row.tolist())) == 1

    def largest_batch(self, bins_per_batch: int) -> tuple[int, int, int]:
        """Bounds on a batch of `bins_per_batch` of these bins: (tokens, sequences, trained targets), each the
        sum of the largest bins' (`fastft.data.batch.BatchShape.covering` takes them)."""
        sizes = np.zeros((len(self.bins), 3), dtype=np.int64)
        lengths = self.data.lengths
        for index, members in enumerate(self.bins):
            sizes[index] = (lengths[members].sum(), len(members), self.trained_per_row[members].sum())
        largest = -np.sort(-sizes, axis=0)[:bins_per_batch].sum(axis=0)
        return tuple(int(value) for value in largest)

    def attended_length(self) -> int:
        """`PackedBatch.attended_length` of the whole run: ``sum(l**2) / sum(l)`` over every sequence, the
        token-weighted mean of its bins' values. A CUDA-graphed run decides once what to keep for the
        recompute (`fastft.data.batch.BatchShape.attended`): keeping holds two device buffers through every
        step, and pays back in proportion to the attention the run's bins recompute in all, which this
        measures (on `fastft bench sft`'s chats, 1,194, though one bin in nine is above 2,048)."""
        lengths = self.data.lengths.astype(np.int64)
        total = int(lengths.sum())
        return int((lengths * lengths).sum()) // total if total else 0

    def batch(self, bin_indices: Iterable[int]) -> PackedBatch:
        """The sequences of the given bins, in bin order, as one CPU `PackedBatch`."""
        members = [row for b in bin_indices for row in self.bins[b]]
        return PackedBatch.from_sequences(
            [self.data.input_ids[i] for i in members], [self.data.labels[i] for i in members]
        )

    def save(self, path: str | os.PathLike) -> str:
        """Write the packed data to `path` (one ``.npz`` file of plain arrays, no pickle) so another process
        trains on exactly these bins: `load_packed` reads it back. Written under a temporary name and renamed
        into place. Returns the path written."""

        lengths = self.data.lengths
        arrays = {
            "format": np.array([PACKED_FORMAT]),
            "max_seq_length": np.array([self.max_seq_length], dtype=np.int64),
            "lengths": lengths,
            "input_ids": _concat(self.data.input_ids),
            "labels": _concat(self.data.labels),
            "source_rows": np.asarray(self.data.source_rows, dtype=np.int64),
            "bin_sizes": np.fromiter((len(b) for b in self.bins), dtype=np.int64, count=len(self.bins)),
            "bin_members": np.fromiter(itertools.chain.from_iterable(self.bins), dtype=np.int64),
            "stats_names": np.array(list(asdict(self.data.stats))),
            "stats_values": np.array(list(asdict(self.data.stats).values()), dtype=np.int64),
        }
        pair_stats = getattr(self, "pair_stats", None)  # `PackedPairs`: load_packed gives back pairs
        if pair_stats is not None:  # its counts, and the rows left out as one array of their own
            counts = asdict(pair_stats)
            arrays["pair_identical_rows"] = np.asarray(counts.pop("identical_rows", ()), dtype=np.int64)
            arrays["pair_stats_names"] = np.array(list(counts))
            arrays["pair_stats_values"] = np.array(list(counts.values()), dtype=np.int64)
        path = os.fspath(path)
        if not path.endswith(".npz"):
            path += ".npz"

        write_file_atomically(path, lambda handle: np.savez(handle, **arrays))
        return path

    def __repr__(self) -> str:
        return f"PackedDataset({self.stats.summary()})"


PACKED_FORMAT = "fastft-packed-1"


# Preference pairs packed (`fastft.data.pairs.pack_pairs` makes them); here so `load_packed` gives them back.
@dataclass(frozen=True)
class PairStats:
    """What `pack_pairs` did: pairs kept, pairs whose prompt or answers were cut (and the tokens cut)."""

    rows: int
    pairs: int
    cut_prompt: int = 0
    cut_answer: int = 0
    cut_tokens: int = 0
    dropped: int = 0  # an answer with no token left to train after the cut
    identical_rows: tuple[int, ...] = ()  # rows (from 0) whose chosen equals their rejected: left out

    def __str__(self) -> str:
        text = f"{self.pairs} of {self.rows} pairs"
        cuts = []
        if self.cut_prompt:
            cuts.append(f"{self.cut_prompt} prompts cut from the left")
        if self.cut_answer:
            cuts.append(f"{self.cut_answer} answers cut at the end")
        if cuts:
            text += f" ({', '.join(cuts)}: {self.cut_tokens} tokens)"
        if self.dropped:
            text += f"; {self.dropped} dropped (no answer token left)"
        if self.identical_rows:
            text += f"; {len(self.identical_rows)} left out (chosen equals rejected: {row_list(self.identical_rows)})"
        return text


def row_list(rows: tuple[int, ...], shown: int = 10) -> str:
    """``"rows 3, 7, counting from 0"``: the first `shown` of `rows`, for a message."""
    listed = ", ".join(str(r) for r in rows[:shown]) + (
        f", … ({len(rows) - shown} more)" if len(rows) > shown else ""
    )
    return f"row{'s' if len(rows) > 1 else ''} {listed}, counting from 0"


class PackedPairs(PackedDataset):
    """A `PackedDataset` whose bins hold whole pairs: sequence ``2 i`` is pair ``i``'s chosen side, ``2 i + 1``
    its rejected side, and a bin lists both. `pair_stats` says what was cut; `reference_cache` holds the
    precomputed reference log-probs (``TrainConfig(precompute_reference=True)``), by sequence."""

    def __init__(
        self, data: TokenizedData, bins: list[list[int]], max_seq_length: int, pair_stats: PairStats
    ):
        super().__init__(data, bins, max_seq_length)
        self.pair_stats = pair_stats
        # per-sequence reference log-probs by base-model fingerprint (fastft.training.objectives.preference)
        self.reference_cache: dict = {}

    @property
    def pairs(self) -> int:
        return len(self.data) // 2


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, dtype=np.int32)


def load_packed(path: str | os.PathLike) -> PackedDataset:
    """A `PackedDataset` written by `PackedDataset.save`: the same rows, bins and statistics (a `PackedPairs`
    when pairs were saved)."""
    try:
        stored = np.load(os.fspath(path), allow_pickle=False)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{path} cannot be read as packed data ({error}): save packed data with PackedDataset.save."
        ) from None
    with stored:
        if "format" not in stored or str(stored["format"][0]) != PACKED_FORMAT:
            raise ValueError(
                f"{path} is not packed data written by PackedDataset.save ({PACKED_FORMAT}): pack the rows again "
                "with fastft.pack and save that."
            )
        rows = np.cumsum(stored["lengths"])[:-1]  # where each row's tokens start, after the first
        bins = [b.tolist() for b in np.split(stored["bin_members"], np.cumsum(stored["bin_sizes"])[:-1])]
        stats = TokenizeStats(
            **dict(zip(stored["stats_names"].tolist(), stored["stats_values"].tolist(), strict=True))
        )
        data = TokenizedData(
            np.split(stored["input_ids"], rows),
            np.split(stored["labels"], rows),
            stored["source_rows"].tolist(),
            stats,
        )
        max_seq_length = int(stored["max_seq_length"][0])
        if "pair_stats_names" in stored:
            names, values = stored["pair_stats_names"].tolist(), stored["pair_stats_values"].tolist()
            counts = dict(zip(names, values, strict=True))
            if "pair_identical_rows" in stored:
                counts["identical_rows"] = tuple(stored["pair_identical_rows"].tolist())
            return PackedPairs(data, bins, max_seq_length, PairStats(**counts))
        return PackedDataset(data, bins, max_seq_length)


# `pack` tokenises a `datasets.Dataset` of at least this many rows in several processes by default.
AUTO_NUM_PROC_ROWS = 50_000


def pack(
    dataset,
    tokenizer,
    max_seq_length: int | None = None,
    train_on: str = "responses",
    overlong: str = "cut_prompt",
    num_proc: int | None = None,
) -> PackedDataset:
    """Tokenise `dataset` (rows with ``messages`` or ``text``) and pack it into bins.

    `max_seq_length` defaults to the tokenizer's ``model_max_length`` set by `load_model`.
    See `tokenize_rows` for `train_on` and `overlong`. The result's `.stats` reports packing
    efficiency, sequences per bin and every truncated, dropped or skipped row.

    `num_proc`: processes that tokenise a `datasets.Dataset` (through ``Dataset.map``; the result
    is the same as with one). None: ``min(cores, 8)`` for a dataset of at least 50,000 rows, else
    one. Other inputs (lists, generators) are tokenised in this process. For data that does not fit
    in memory, see `pack_shards`.
    """
    _check_rows_given(dataset)
    max_seq_length = _max_seq_length(tokenizer, max_seq_length)
    check_arguments(max_seq_length, train_on, overlong)
    num_proc = _num_proc(dataset, num_proc)
    if num_proc > 1:
        data = tokenize_dataset(dataset, tokenizer, max_seq_length, train_on, overlong, num_proc=num_proc)
    else:
        data = tokenize_rows(_rows(dataset), tokenizer, max_seq_length, train_on=train_on, overlong=overlong)
    if not len(data):
        raise _nothing_trainable(data.stats)
    warn_truncated(data.stats, max_seq_length, overlong)
    bins = best_fit_decreasing(data.lengths, max_seq_length)
    return PackedDataset(data, bins, max_seq_length)


def pack_shards(
    rows: Iterable[dict],
    tokenizer,
    max_seq_length: int | None = None,
    shard_rows: int = 100_000,
    train_on: str = "responses",
    overlong: str = "cut_prompt",
) -> Iterator[PackedDataset]:
    """Pack data larger than memory: one `PackedDataset` per `shard_rows` consecutive rows.

    `rows`: any iterable of rows with ``messages`` or ``text`` — a list, a generator, a
    `datasets.IterableDataset` (``streaming=True``; its rows must already be in that format) or a
    `datasets.Dataset`. It is read lazily, once, front to back: this generator holds the rows of at
    most one encoding batch (1,024) and the tokens of the one shard it is building, so memory is
    bounded by `shard_rows`, not by the data (a caller that keeps earlier shards keeps their memory).

    Each shard is packed best-fit decreasing on its own and has its own `.stats`; its
    ``data.source_rows`` are positions in the whole input, so every kept row can be traced back.
    Shards are yielded as they are built; one whose rows are all skipped is still yielded (with no
    bins), so its stats are seen. `ValueError` is raised at the end if no shard had a trainable row.

    Trade-off: rows are never packed across a shard edge, so each shard ends with a few part-filled
    bins that one whole-data packing could have filled. The loss is a handful of bins per shard —
    for ``shard_rows`` = 100,000 short chats, well under 0.1% of the tokens — and grows as
    `shard_rows` shrinks or as sequences approach `max_seq_length`. Arguments are checked on the
    call; `max_seq_length`, `train_on` and `overlong` are as in `pack`.
    """
    _check_rows_given(rows)
    max_seq_length = _max_seq_length(tokenizer, max_seq_length)
    check_arguments(max_seq_length, train_on, overlong)
    if shard_rows < 1:
        raise ValueError(f"shard_rows must be at least 1, got {shard_rows}.")
    return _shards(_rows(rows), tokenizer, max_seq_length, shard_rows, train_on, overlong)


def _shards(
    rows: Iterable[dict], tokenizer, max_seq_length: int, shard_rows: int, train_on: str, overlong: str
) -> Iterator[PackedDataset]:
    rows = iter(rows)
    start = 0
    totals = TokenizeStats()
    while True:
        data = tokenize_rows(
            itertools.islice(rows, shard_rows), tokenizer, max_seq_length, train_on, overlong
        )
        read = data.stats.rows
        if read == 0:
            break
        data.source_rows = [start + index for index in data.source_rows]
        start += read
        for name in vars(totals):
            setattr(totals, name, getattr(totals, name) + getattr(data.stats, name))
        shard = PackedDataset(data, best_fit_decreasing(data.lengths, max_seq_length), max_seq_length)
        del data
        yield shard
        # Drop this generator's reference before reading the next shard, so a caller that lets go
        # of a shard frees it while the next one is built.
        del shard
        if read < shard_rows:
            break
    if totals.kept == 0:
        raise _nothing_trainable(totals)
    warn_truncated(totals, max_seq_length, overlong)


def _check_rows_given(dataset) -> None:
    """Refuse what is not a collection of rows (None, a path, a dict) before tokenising starts."""
    if dataset is None:
        raise ValueError(
            "dataset is None: pass rows (a list of dicts, a datasets.Dataset) or fastft.load_dataset(...)."
        )
    if isinstance(dataset, (str, os.PathLike)):
        raise ValueError(
            f"pack takes rows, not the path {os.fspath(dataset)!r}: load it first with "
            f"fastft.load_dataset({os.fspath(dataset)!r})."
        )
    if isinstance(dataset, dict) or not isinstance(dataset, Iterable):
        raise ValueError(
            f"dataset must be rows (a list of dicts with 'messages' or 'text', or a datasets.Dataset), got a "
            f"{type(dataset).__name__}."
        )


def _max_seq_length(tokenizer, max_seq_length: int | None) -> int:
    if max_seq_length is None:
        max_seq_length = int(tokenizer.model_max_length)
        if max_seq_length > 1_000_000:
            raise ValueError("pass max_seq_length=…: this tokenizer does not say how long its inputs are")
    return max_seq_length


def _nothing_trainable(stats: TokenizeStats) -> ValueError:
    return ValueError(
        f"No trainable rows: {stats}. Check the dataset's format and that chats have "
        "assistant turns (or use train_on='all')."
    )


def _num_proc(dataset, num_proc: int | None) -> int:
    """How many processes tokenise `dataset` (see `pack`)."""
    if num_proc is None:
        if is_dataset(dataset) and len(dataset) >= AUTO_NUM_PROC_ROWS:
            return min(_cpu_count(), 8)
        return 1
    if num_proc < 1:
        raise ValueError(f"num_proc must be at least 1, got {num_proc}.")
    if num_proc > 1 and not is_dataset(dataset):
        warnings.warn(
            f"num_proc={num_proc} applies to a datasets.Dataset; this {type(dataset).__name__} is "
            "tokenised in one process (load it with fastft.load_dataset(...) to use several).",
            stacklevel=3,
        )
        return 1
    return num_proc


def _cpu_count() -> int:
    """Cores this process may run on (the affinity mask, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _rows(dataset) -> Iterable[dict]:
    """Rows as dicts with only the columns tokenisation reads (fast for Arrow-backed datasets)."""
    if is_dataset(dataset):
        dataset_column(dataset)  # raise now, not when the rows are first read
        return dataset_rows(dataset)
    column_names = getattr(dataset, "column_names", None)
    if column_names is not None and hasattr(dataset, "select_columns"):  # e.g. a datasets.IterableDataset
        return iter(dataset.select_columns([dataset_column(dataset)]))
    return iter(dataset)
