"""`Checkpointing`: how a model's decoder layers keep activations for backward, in one vocabulary.

``add_lora(gradient_checkpointing=...)``, the offloader, ``estimate_vram(checkpointing=...)``, ``fastft.vram.measure``,
the CLI and the studio all parse what the user wrote with `Checkpointing.parse` and read the result, so each
name means one thing everywhere:

- ``"none"``: keep every activation (fastest, most memory); ``False`` too.
- ``"recompute"``: keep each layer's input on the device and recompute the layer in backward; ``True`` too.
- ``"offload"``: recompute, with each layer's input in pinned host memory, prefetched back on a side stream
  (`fastft.runtime.offload`); on a CPU it is plain recompute. ``"unsloth"`` (Unsloth's name for it) too.
- ``"auto"`` (the default of `add_lora`): ``"offload"`` on a CUDA device, ``"recompute"`` elsewhere
  (`Checkpointing.resolved`). The estimator answers for a GPU, so there "auto" is "offload".
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("auto", "offload", "recompute", "none")
# From most device memory to least: what a "will it fit" fix tries next.
BY_MEMORY = ("none", "recompute", "offload")
ALIASES = {True: "recompute", False: "none", None: "none", "unsloth": "offload", "off": "none"}

# -- attention kept for the recompute ------------------------------------------------------------
# Under offloaded checkpointing (`fastft.runtime.offload`) a layer's forward keeps its attention output and
# log-sum-exp beside its input (`KeptTensors` under the name "attention": host memory, back on the device
# with the input; the layer call's `KeptTensors` reaches the backend as ``kept``), and the
# recompute hands them to the kernel's own backward instead of running the attention forward again. The
# kernel is the one SDPA / varlen would run in training (`_fused_sdp_choice`), called through its ATen
# op, so the forward and the backward see one kernel's output. On the CPU every gradient is bit-identical
# to recomputing (tests/runtime/test_offload.py); on the GPU within bf16 rounding, because without keeping the
# no-grad forward may run another kernel than the recompute (cuDNN vs FlashAttention-2) and FlashAttention-2's backward sums dq with atomics. A layer that keeps its attention
# output keeps o_proj's output too (`fastft.models.patch`), so its recompute skips that GEMM as well.
# Keeping both buys a few percent of a 16-bit step for two device buffers of each (docs/journal.md, "Measurements once quoted in code comments"). Below
# `KEEP_FROM_LENGTH` the attention forward is cheap beside the copies and buffers, so shorter bins keep
# nothing.
#
# Quantised bases are the memory-first choice: there a layer keeps its attention output (not o_proj's)
# only for sequences of `KEEP_QUANTISED_FROM_LENGTH` tokens and more, and only where the VRAM estimate
# with it still fits the device (`fastft.runtime.offload.KeepPolicy`; the estimator answers the same way
# for ``keep_attention=None``). At those lengths the quadratic attention is most of the step, and keeping its
# forward is worth about a fifth of the step; its memory is two kept buffers less the output the recompute no
# longer allocates, as the estimator counts it (the probe: docs/journal.md, "Measurements once quoted in code comments"). Where keeping does not fit (Llama-3.1-8B
# at 163,840 tokens under 24 GiB), the run recomputes.
# The constants live here, not in `fastft.runtime.attention`, so the VRAM estimator reads them without torch.
KEEP_FROM_LENGTH = 2048
KEEP_QUANTISED_FROM_LENGTH = 32768

LABELS = {
    "auto": "auto (offload on a GPU, recompute on the CPU)",
    "offload": "offload (layer inputs in host memory, prefetched)",
    "recompute": "recompute (keep layer inputs on the device)",
    "none": "none (keep every activation)",
}


class CheckpointingError(ValueError):
    """A value that names no checkpointing mode."""


@dataclass(frozen=True)
class Checkpointing:
    """One checkpointing mode: `kind` is one of `KINDS` (parse user input with `Checkpointing.parse`)."""

    kind: str = "auto"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise CheckpointingError(_unknown(self.kind))

    @classmethod
    def parse(cls, value: Checkpointing | str | bool | None) -> Checkpointing:
        """`value` as a `Checkpointing`: a kind, True/False, or an alias ("unsloth", "off"); case-insensitive."""
        if isinstance(value, Checkpointing):
            return value
        if isinstance(value, bool) or value is None:
            return cls(ALIASES[value])
        if not isinstance(value, str):
            raise CheckpointingError(_unknown(value))
        name = value.strip().lower()
        name = {"true": "recompute", "false": "none"}.get(name, ALIASES.get(name, name))
        if name not in KINDS:
            raise CheckpointingError(_unknown(value))
        return cls(name)

    def resolved(self, cuda: bool) -> Checkpointing:
        """ "auto" made concrete for a device (`cuda`: offload there, recompute elsewhere); others as they are."""
        if self.kind != "auto":
            return self
        return Checkpointing("offload" if cuda else "recompute")

    @property
    def checkpoints(self) -> bool:
        """Whether layers are recomputed in backward (every kind but "none")."""
        return self.kind != "none"

    @property
    def offloads(self) -> bool:
        return self.kind == "offload"

    @property
    def label(self) -> str:
        return LABELS[self.kind]

    def __str__(self) -> str:
        return self.kind


def _unknown(value) -> str:
    return (
        f"checkpointing={value!r} is not a mode: use one of {', '.join(map(repr, KINDS))} "
        "(True = 'recompute', False = 'none', 'unsloth' = 'offload')."
    )


__all__ = [
    "BY_MEMORY",
    "KEEP_FROM_LENGTH",
    "KEEP_QUANTISED_FROM_LENGTH",
    "KINDS",
    "LABELS",
    "Checkpointing",
    "CheckpointingError",
]
