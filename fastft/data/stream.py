"""Training on data larger than memory: packed shards streamed to the trainer, one shard held at a time.

`pack_shards` packs a row stream shard by shard; `PackedStream` makes that re-iterable for a run of many
epochs and resumable at any step. The order is a pure function of (seed, epoch, shard): each shard's
bins are shuffled with a generator seeded by all three, shards are read front to back, and optimizer
step ``s`` reads bins ``s * bins_per_step .. (s + 1) * bins_per_step - 1`` of that sequence, so a
micro-batch may take its last bins from the next shard. A resumed run re-reads (tokenises and packs) the
shards before its step, without building their batches, and continues with the same bins as the
uninterrupted run.

Memory: the cursor holds the shard it is reading and, across a shard edge, the next one; the row source
is read lazily by `pack_shards`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np

from fastft.data.batch import PackedBatch
from fastft.data.packing import PackedDataset, pack_shards


class PackedStream:
    """A re-iterable stream of packed shards (`PackedDataset`s) for `Trainer` / `fastft.train`.

    `rows` is a callable returning a fresh iterable of rows (called once per epoch), or a re-iterable
    such as a list or a `datasets.Dataset` / `IterableDataset` (a generator is read only once: pass a
    function that makes it). The other arguments are `pack_shards`'. Its length is unknown until it has
    been read once, so training on it needs ``max_steps``.
    """

    def __init__(
        self,
        rows: Callable[[], Iterable[dict]] | Iterable[dict],
        tokenizer,
        max_seq_length: int,
        shard_rows: int = 100_000,
        train_on: str = "responses",
        overlong: str = "cut_prompt",
    ):
        if isinstance(rows, Iterator):
            raise TypeError(
                "PackedStream reads its rows once per epoch, and an iterator can be read only once: pass a "
                "function that returns a new one, e.g. PackedStream(lambda: read_rows(path), tokenizer, ...)."
            )
        self._rows = rows if callable(rows) else (lambda: rows)
        self.tokenizer = tokenizer
        self.max_seq_length = int(max_seq_length)
        self.shard_rows = shard_rows
        self.train_on = train_on
        self.overlong = overlong
        self.bins_per_pass: int | None = None  # known once a whole pass has been read

    def shards(self) -> Iterator[PackedDataset]:
        """One pass over the data: its packed shards, built as they are read."""
        return pack_shards(
            self._rows(), self.tokenizer, self.max_seq_length, self.shard_rows, self.train_on, self.overlong
        )

    def __repr__(self) -> str:
        size = f"{self.bins_per_pass} bins per pass" if self.bins_per_pass is not None else "length unknown"
        return f"PackedStream(shards of {self.shard_rows} rows, {self.max_seq_length} tokens per bin, {size})"


class StreamCursor:
    """Reads a `PackedStream` bin by bin in the seeded order (see the module doc); forward only, and
    restarted from the beginning when asked for an earlier position."""

    def __init__(self, stream: PackedStream, seed: int):
        self.stream = stream
        self.seed = seed
        self._restart()

    def _restart(self) -> None:
        self.position = 0  # bins handed out (or skipped) so far, over all epochs
        self.epoch = 0
        self._pass_bins = 0
        self._start_epoch()

    def _start_epoch(self) -> None:
        self._shards = iter(self.stream.shards())
        self._shard_index = -1
        self._shard: PackedDataset | None = None
        self._order: np.ndarray = np.empty(0, dtype=np.int64)
        self._next = 0

    def _advance(self) -> tuple[PackedDataset, int]:
        """The next bin as (shard, bin index), moving to the next shard or epoch when one runs out (a pass
        with no trainable row ends in `pack_shards`' own error)."""
        while self._next >= len(self._order):
            shard = next(self._shards, None)
            if shard is None:  # the pass is over
                self.stream.bins_per_pass = self._pass_bins
                self.epoch += 1
                self._pass_bins = 0
                self._start_epoch()
                continue
            self._shard_index += 1
            self._shard = shard
            generator = np.random.default_rng([self.seed, self.epoch, self._shard_index])
            self._order = generator.permutation(len(shard))
            self._next = 0
        bin_index = int(self._order[self._next])
        self._next += 1
        self._pass_bins += 1
        self.position += 1
        return self._shard, bin_index

    def bins(self, start: int, count: int) -> list[tuple[PackedDataset, int]]:
        """Bins ``start .. start + count - 1`` of the ordered stream."""
        if start < self.position:
            self._restart()
        while self.position < start:  # a resume: read and pack up to here, build nothing
            self._advance()
        return [self._advance() for _ in range(count)]

    @property
    def epoch_progress(self) -> float:
        """Epochs read so far: whole passes plus the share of this one, once a pass's length is known."""
        total = self.stream.bins_per_pass
        return self.epoch + (self._pass_bins / total if total else 0.0)


def batch_of(bins: list[tuple[PackedDataset, int]]) -> PackedBatch:
    """One padding-free `PackedBatch` of bins that may come from different shards."""
    ids, labels = [], []
    for shard, index in bins:
        for row in shard.bins[index]:
            ids.append(shard.data.input_ids[row])
            labels.append(shard.data.labels[row])
    return PackedBatch.from_sequences(ids, labels)
