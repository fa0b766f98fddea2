"""`PackedBatch`: one padding-free batch and the metadata every layer reads, built once.

Sequences are concatenated into a single row ``[1, T]``. Positions restart at 0 for each
sequence, ``cu_seqlens`` holds the sequence boundaries, and the host-side numbers (`max_seqlen`,
token counts) are computed when the batch is built, so nothing in a training step has to ask
the device for them.
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
