"""`PackedBatch`: one padding-free batch and the metadata every layer reads, built once.

Sequences are concatenated into a single row ``[1, T]``. Positions restart at 0 for each
sequence, ``cu_seqlens`` holds the sequence boundaries, and the host-side numbers (`max_seqlen`,
token counts) are computed when the batch is built, so nothing in a training step has to ask
the device for them.

`BatchShape` and `PackedBatch.padded` give every micro-batch of a run one static shape (padded with a
tail segment that attends only to itself and trains nothing), so a CUDA graph captured on one batch
replays on every other (`fastft.training.graph`): packed bins of chat data never repeat their lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from fastft.data.tokenize import IGNORE_INDEX


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """A packed batch.

    input_ids, labels, position_ids: ``[1, T]`` int64; labels are unshifted (token t's label is
    its own id) with -100 where no loss is taken, including the first token of every sequence,
    so no sequence is ever predicted from the one before it.
    cu_seqlens: ``[num_sequences + 1]`` int32 cumulative lengths, starting at 0.
    target_positions, target_ids: ``[num_trained_tokens]`` int64, the positions whose next token
    is trained and that token: the loss reads the logits of these positions only.
    max_seqlen, num_tokens, num_trained_tokens, sequence_lengths: host numbers (no device sync
    to read them).
    padding, static: a batch `padded` to a `BatchShape` (``static``) ends with `padding` pad tokens (their own
    segment, labels -100); its `num_sequences` is the shape's boundary capacity (``cu_seqlens`` repeats
    its last value for the unused ones), `max_seqlen` the shape's token count, and its targets are padded
    with ignored ones (target id -100) to the shape's target count, while `num_trained_tokens` and
    `sequence_lengths` stay the real ones (host statistics; the forward reads only the shape).
    Attention artefacts (a mask, a flex-attention BlockMask, …) are built at first use through
    `artifact` and cached here, so every layer, in forward and in recompute, reuses them.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    target_positions: torch.Tensor
    target_ids: torch.Tensor
    max_seqlen: int
    num_sequences: int
    num_tokens: int
    num_trained_tokens: int
    sequence_lengths: tuple[int, ...]
    padding: int = 0
    static: bool = False
    attended: int = 0  # a static batch's `attended_length`: its shape's (`BatchShape.attended`)
    _artifacts: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_sequences(cls, input_ids: Sequence[np.ndarray], labels: Sequence[np.ndarray]) -> PackedBatch:
        """Concatenate token/label arrays (one pair per sequence) into a CPU batch."""
        if not input_ids:
            raise ValueError("a PackedBatch needs at least one sequence")
        lengths = np.fromiter((len(ids) for ids in input_ids), dtype=np.int64, count=len(input_ids))
        cu_seqlens = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu_seqlens[1:])
        total = int(cu_seqlens[-1])
        ids = np.concatenate(input_ids).astype(np.int64)
        lab = np.concatenate(labels).astype(np.int64)
        lab[cu_seqlens[:-1]] = IGNORE_INDEX
        target_positions = np.flatnonzero(lab[1:] != IGNORE_INDEX)
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu_seqlens[:-1].astype(np.int64), lengths)
        return cls(
            input_ids=torch.from_numpy(ids).view(1, total),
            labels=torch.from_numpy(lab).view(1, total),
            position_ids=torch.from_numpy(positions).view(1, total),
            cu_seqlens=torch.from_numpy(cu_seqlens),
            target_positions=torch.from_numpy(target_positions),
            target_ids=torch.from_numpy(lab[target_positions + 1]),
            max_seqlen=int(lengths.max()),
            num_sequences=len(lengths),
            num_tokens=total,
            num_trained_tokens=len(target_positions),
            sequence_lengths=tuple(lengths.tolist()),
        )

    @classmethod
    def from_position_ids(
        cls, position_ids: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> PackedBatch:
        """The boundaries of a padding-free row as Hugging Face collators build it (``[1, T]`` position ids
        restarting at each sequence: ``DataCollatorWithFlattening``, TRL's ``padding_free``), for the
        attention only: no labels or targets (the caller computes its loss). A sequence starts wherever a
        position does not follow the one before it, as transformers detects packing; reading the lengths is
        the one host sync of such a batch, made once for every layer."""
        positions = position_ids.reshape(-1)
        total = positions.numel()
        starts = torch.nonzero(positions[1:] != positions[:-1] + 1).reshape(-1) + 1
        boundaries = [0, *starts.tolist(), total]
        lengths = [end - start for start, end in zip(boundaries, boundaries[1:], strict=False)]
        device = position_ids.device
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        ids = (
            input_ids.reshape(1, total)
            if input_ids is not None
            else torch.zeros_like(positions).view(1, total)
        )
        return cls(
            input_ids=ids,
            labels=torch.full((1, total), IGNORE_INDEX, dtype=torch.int64, device=device),
            position_ids=positions.view(1, total),
            cu_seqlens=torch.tensor(boundaries, dtype=torch.int32).to(device, non_blocking=True),
            target_positions=empty,
            target_ids=empty,
            max_seqlen=max(lengths),
            num_sequences=len(lengths),
            num_tokens=total,
            num_trained_tokens=0,
            sequence_lengths=tuple(lengths),
        )

    @property
    def attended_length(self) -> int:
        """The token-weighted mean length of this batch's sequences (``sum(l**2) / sum(l)`` over the real ones;
        host numbers): the length of one sequence, of each of equal-length ones, and far less than
        `max_seqlen` for a bin of short chats with one long one.

        Causal attention costs ``sum(l**2)`` where the projections cost ``sum(l)``, so this is what decides
        whether keeping the attention output for the recompute pays (`fastft.runtime.attention._kept_attention`).
        A static batch gives its shape's (`BatchShape.attended`), so every replay of one CUDA graph decides
        alike, or, where the shape does not know it (a stream's bins), its own token count."""
        if self.static:
            return self.attended or self.num_tokens
        return self.artifact("attended_length", self._attended_length)  # read by every layer, made once

    def _attended_length(self) -> int:
        tokens = sum(self.sequence_lengths)
        return sum(length * length for length in self.sequence_lengths) // tokens if tokens else 0

    @property
    def real_tokens(self) -> int:
        """Tokens of the batch's sequences, without the padding of a static batch."""
        return self.num_tokens - self.padding

    @property
    def real_sequences(self) -> int:
        """The batch's own sequences: a static batch's pad tail and zero-length boundaries left out."""
        return len(self.sequence_lengths) - (1 if self.padding else 0)

    def padded(self, shape: BatchShape) -> PackedBatch:
        """This CPU batch padded to `shape` (see the class docstring); it must fit (`BatchShape.holds`).

        The pad tokens form one causal segment of their own at the end: no real token attends to them,
        they take no loss, and so every gradient is the unpadded batch's (up to summation order)."""
        if self.static:
            raise ValueError("this batch is already padded to a static shape")
        if not shape.holds(self):
            raise ValueError(
                f"a batch of {self.num_tokens} tokens, {self.num_sequences} sequences and "
                f"{self.num_trained_tokens} targets does not fit {shape}"
            )
        pad = shape.tokens - self.num_tokens
        extra_targets = shape.targets - self.num_trained_tokens
        boundaries = self.cu_seqlens.tolist() + ([shape.tokens] if pad else [])
        boundaries += [shape.tokens] * (shape.segments + 1 - len(boundaries))

        def extend(tensor: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
            return torch.cat([tensor.reshape(-1), tail]).view(*tensor.shape[:-1], -1)

        return replace(
            self,
            input_ids=extend(self.input_ids, torch.zeros(pad, dtype=torch.int64)),
            labels=extend(self.labels, torch.full((pad,), IGNORE_INDEX, dtype=torch.int64)),
            position_ids=extend(self.position_ids, torch.arange(pad, dtype=torch.int64)),
            cu_seqlens=torch.tensor(boundaries, dtype=self.cu_seqlens.dtype),
            target_positions=extend(
                self.target_positions, torch.full((extra_targets,), shape.tokens - 1, dtype=torch.int64)
            ),
            target_ids=extend(self.target_ids, torch.full((extra_targets,), IGNORE_INDEX, dtype=torch.int64)),
            max_seqlen=shape.tokens,
            num_sequences=shape.segments,
            num_tokens=shape.tokens,
            sequence_lengths=self.sequence_lengths + ((pad,) if pad else ()),
            padding=pad,
            static=True,
            attended=shape.attended,
            _artifacts={},
        )

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch on `device`; CPU→CUDA copies go through pinned memory without blocking."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        pin = device.type == "cuda"

        def move(tensor: torch.Tensor) -> torch.Tensor:
            if pin and not tensor.is_pinned():
                tensor = tensor.pin_memory()
            return tensor.to(device, non_blocking=pin)

        return replace(
            self,
            input_ids=move(self.input_ids),
            labels=move(self.labels),
            position_ids=move(self.position_ids),
            cu_seqlens=move(self.cu_seqlens),
            target_positions=move(self.target_positions),
            target_ids=move(self.target_ids),
            _artifacts={},
        )

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def artifact(self, key: str, build: Callable[[], object]) -> object:
        """The cached artefact `key`, built by ``build()`` the first time it is asked for."""
        if key not in self._artifacts:
            self._artifacts[key] = build()
        return self._artifacts[key]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class BatchShape:
    """The one static shape of a run's packed micro-batches: `tokens` per micro-batch, `segments`
    boundaries (sequences, the pad tail and unused zero-length ones) and `targets` trained positions.

    `covering` takes the largest micro-batch the run can draw, rounded up (tokens and targets to 64,
    segments to 8), so one shape serves the whole run; `grown_to` widens it for a batch that does not fit
    (a stream's bins are not known ahead), which costs one new graph capture. `attended`: the run's
    `PackedBatch.attended_length` (`fastft.data.packing.PackedDataset.attended_length`), which every padded
    batch reports in place of its own, so that all replays of one graph decide alike what to keep for the
    recompute (0: not known, a stream's; the padded batches then report their token count, as a single
    sequence would)."""

    tokens: int
    segments: int
    targets: int
    attended: int = 0

    @classmethod
    def covering(cls, tokens: int, sequences: int, targets: int, attended: int = 0) -> BatchShape:
        """A shape for micro-batches of at most these many tokens, sequences and trained targets (and
        `attended`, the run's `PackedBatch.attended_length`, where known)."""
        tokens = _round_up(max(tokens, 1), 64)
        # one more boundary for the pad tail, and at least two segments: a static batch never looks like
        # a bin of equal-length sequences to the attention (`fastft.runtime.attention._uniform_length`)
        segments = _round_up(max(sequences + 1, 2), 8)
        return cls(tokens, segments, min(_round_up(max(targets, 1), 64), tokens), min(attended, tokens))

    def holds(self, batch: PackedBatch) -> bool:
        pad_segment = 1 if batch.num_tokens < self.tokens else 0
        return (
            batch.num_tokens <= self.tokens
            and batch.num_sequences + pad_segment <= self.segments
            and batch.num_trained_tokens <= self.targets
        )

    def grown_to(self, batch: PackedBatch) -> BatchShape:
        """The smallest widening of this shape (each bound at least doubled where it grows) that holds
        `batch`."""

        def grow(current: int, needed: int) -> int:
            return current if needed <= current else max(needed, 2 * current)

        tokens = grow(self.tokens, batch.num_tokens)
        return BatchShape.covering(
            tokens,
            grow(self.segments - 1, batch.num_sequences),
            grow(self.targets, batch.num_trained_tokens),
            self.attended,
        )
