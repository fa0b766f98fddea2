"""Settings a notebook can train with on the GPU it finds: the largest model of a ladder whose estimate fits
at the context asked for, 4-bit where 16-bit does not fit, the micro-batch the estimate still allows, and
the dtype the card computes in (fp16 on a T4: it has no bf16).

``fastft.pick_settings()`` in a notebook's parameters cell detects the GPU (or takes a card name and its
memory) and says what it picked and why; every number comes from `estimate_vram` / `max_context`, so the
picked settings are ones the estimator says fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import fastft.weight_formats as weight_formats
from fastft.vram.fit import max_context
from fastft.vram.gpus import GiB, GpuSpec, detect_gpu, get_gpu

# Function-local imports: tests replace these names on their modules, so they are looked up when called.

# (model, 4-bit), preferred first: an 8B model in 16-bit where it fits, else in 4-bit (Colab's classic T4
# recipe; a larger model fits some cards but trains slowly there), then smaller ones, a bigger model in 4-bit
# before a smaller one in 16-bit. Every one is in fastft's catalog, so the estimate reads its shapes without a
# download. A notebook passes its own.
LADDER = (
    ("Qwen/Qwen3-8B", False),
    ("Qwen/Qwen3-8B", True),
    ("Qwen/Qwen3-4B", True),
    ("Qwen/Qwen3-1.7B", False),
    ("Qwen/Qwen3-1.7B", True),
    ("Qwen/Qwen3-0.6B", False),
)
CPU_SETTINGS = ("tiny-llama", 256)  # no GPU: the embedded preset, short bins


@dataclass(frozen=True)
class PickedSettings:
    """What `pick_settings` chose: `model` (a hub id or preset), `load_in_4bit`, `dtype` ("bf16", "fp16", or
    "fp32" on the CPU), `max_seq_length` (tokens per packed bin), `micro_batch_bins` (bins per micro-batch),
    `gpus` (visible GPUs: each rank of ``fastft launch`` trains these settings), `card` (the GPU planned for,
    None on the CPU) and `why` (one line a notebook prints)."""

    model: str
    load_in_4bit: bool
    dtype: str
    max_seq_length: int
    micro_batch_bins: int
    card: GpuSpec | None
    gpus: int
    why: str

    def __str__(self) -> str:
        return self.why


def _card(gpu, memory_gib: float | None) -> GpuSpec | None:
    """The GPU to plan for: a preset by name, with `memory_gib` (what PyTorch reports) overriding its size;
    only `memory_gib`: the visible GPU with that much memory (a share of it: two models side by side), else
    an unnamed card of that size (bf16 assumed); neither: the visible GPU, None without."""
    if gpu is None and memory_gib is None:
        return detect_gpu()
    spec = (
        get_gpu(gpu) if gpu is not None else (detect_gpu() or GpuSpec("custom", f"{memory_gib:g} GiB GPU", 0))
    )
    if memory_gib is not None:
        spec = GpuSpec(spec.name, spec.label, int(memory_gib * GiB), spec.context_bytes, spec.bf16, "given")
    return spec


def pick_settings(
    gpu: str | GpuSpec | None = None,
    memory_gib: float | None = None,
    *,
    context: int = 2048,
    ladder=LADDER,
    most_bins: int = 8,
    gpus: int | None = None,
    say: bool = True,
) -> PickedSettings:
    """The largest model of `ladder` that the estimator says trains at `context` tokens per bin on `gpu` (a
    preset name such as "t4", "rtx4090", "a100-40gb", a `GpuSpec`, or None: the visible GPU), with as many
    bins per micro-batch (a power of two up to `most_bins`) as still fit; `memory_gib` overrides the card's
    memory (given alone, the visible card's). When no model fits `context`, the smallest model at the longest
    context that fits. `gpus` (default: the visible GPUs when none is named, else 1): above 1, each rank of a
    DDP run (``fastft launch``) trains these settings, estimated per GPU. Without a GPU: the embedded
    tiny-llama in fp32. Prints `PickedSettings.why` when `say`."""
    card = _card(gpu, memory_gib)
    if gpus is None:
        gpus = _visible_gpus() if gpu is None else 1
    if card is not None:
        gpus = max(gpus, 1)  # a card given by name or memory on a machine without one: plan for one
    if card is None:
        model, length = CPU_SETTINGS
        picked = PickedSettings(
            model, False, "fp32", length, 1, None, 0, f"No CUDA GPU here: {model} (embedded, no download) in "
            f"fp32 with {length}-token bins."
        )  # fmt: skip
        if say:
            print(picked.why)
        return picked
    dtype = "bf16" if card.bf16 else "fp16"
    # each rank of a DDP run holds the whole model and its own micro-batches, plus the gradients' buckets
    per_rank = {"world_size": gpus, "sharding": "ddp"} if gpus > 1 else {}
    chosen = fallback = None
    for model, four_bit in ladder:
        weight_format = weight_formats.from_flags(load_in_4bit=four_bit)
        precision = weight_format.name if weight_format.quantized else dtype
        longest = max_context(model, card, precision=precision, **per_rank)
        if longest >= context:
            chosen = (model, four_bit, precision, context, longest)
            break
        if longest > 0:  # the ladder goes down in size: the last of these is the smallest model
            fallback = (model, four_bit, precision, longest, longest)
    chosen = chosen or fallback
    if chosen is None:
        raise ValueError(
            f"No model of the ladder fits {card} even at 128 tokens: pass memory_gib=... if the card has "
            "more memory than its preset, or a smaller ladder=[(model, load_in_4bit), ...]."
        )
    model, four_bit, precision, length, longest = chosen
    bins = _most_bins(model, card, precision, length, most_bins, per_rank)
    where = f"{card.label} ({card.capacity_gib:.2f} GiB{', no bf16: fp16' if not card.bf16 else ''})"
    ranks = f", on each of {gpus} GPUs (fastft launch --gpus {gpus})" if gpus > 1 else ""
    why = (
        f"Picked for {where}{ranks}: {model} {'in 4-bit (NF4)' if four_bit else 'in ' + dtype}, "
        f"{length:,}-token bins, {bins} bin{'s' if bins > 1 else ''} per micro-batch; the estimator fits up to "
        f"{longest:,} tokens per bin with this model."
    )
    if length < context:
        why += f" No model of the ladder fits {context:,} tokens: this is the longest that does."
    picked = PickedSettings(model, four_bit, dtype, length, bins, card, gpus, why)
    if say:
        print(picked.why)
    return picked


def _most_bins(model: str, card: GpuSpec, precision: str, length: int, most: int, per_rank: dict) -> int:
    """The largest power of two up to `most` whose micro-batch (that many bins of `length` tokens) fits."""
    from fastft.vram.estimate import estimate_vram

    bins = 1
    while (
        bins * 2 <= most
        and estimate_vram(model, length, length * bins * 2, precision=precision, gpu=card, **per_rank).fits
    ):
        bins *= 2
    return bins


def _visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


__all__ = ["LADDER", "PickedSettings", "pick_settings"]
