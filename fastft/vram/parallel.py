"""The estimate per GPU of a run on several GPUs (`fastft.training.distributed`).

DDP (``sharding="ddp"``): every rank holds the whole model and runs the one-process step on its own
micro-batches (``batch_tokens`` is per rank), so the per-GPU peak is the one-process estimate. The gradient
all-reduce flattens the LoRA gradients into buckets (4 B per LoRA parameter, all launched before they are
waited), after the backward has freed the stored activations: the note says so, and the buffer is counted
only where it exceeds what the backward freed.

FSDP2 (``sharding="fsdp"``): the base weights of the decoder, the LoRA adapters, their gradients and the
AdamW states are split across the ranks (1/N each); the output head stays replicated (fastft's fused loss
reads its weight directly), and each rank holds two decoder layers' gathered weights at a time (the one
computing and the next, prefetched).
"""

from __future__ import annotations

from dataclasses import replace

import fastft.weight_formats as weight_formats
from fastft.vram.result import VramComponent, VramEstimate, VramEstimateError

SHARDINGS = ("ddp", "fsdp")


def per_gpu(estimate: VramEstimate, inventory, world_size: int, sharding: str) -> VramEstimate:
    """`estimate` (one process) as each of `world_size` GPUs sees it under `sharding`."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise VramEstimateError(f"world_size={world_size!r}: give the number of GPUs, 1 or more.")
    if sharding not in SHARDINGS:
        raise VramEstimateError(f"sharding={sharding!r} is not one of {', '.join(SHARDINGS)}.")
    settings = replace(estimate.settings, world_size=world_size, sharding=sharding)
    if world_size == 1:
        return replace(estimate, settings=settings)
    if sharding == "ddp":
        return _ddp(estimate, settings)
    return _fsdp(estimate, inventory, world_size, settings)


def _ddp(estimate: VramEstimate, settings) -> VramEstimate:
    buckets = 4 * estimate.lora_parameters
    freed = estimate.component("activations").own_bytes + estimate.component("recompute").own_bytes
    extra = max(0, buckets - freed) if estimate.peak_phase == "backward" else 0
    components = (
        *estimate.components,
        VramComponent(
            "communication",
            "gradient all-reduce buffers",
            extra,
            buckets,
            "backward",
            "LoRA gradients flattened for the all-reduce, after the backward freed the activations",
        ),
    )
    note = (
        f"per GPU of {settings.world_size} (DDP): the whole model on each, batch_tokens per rank; NCCL's own "
        "buffers (outside torch's allocator) are not counted"
    )
    return replace(estimate, settings=settings, components=components, notes=(*estimate.notes, note))


def _fsdp(estimate: VramEstimate, inventory, world_size: int, settings) -> VramEstimate:
    if settings.precision in weight_formats.quantized_names():
        raise VramEstimateError(
            f"sharding='fsdp' with precision={settings.precision!r}: FSDP2 cannot shard a quantised base "
            "(fastft.training.distributed.FSDP_LIMITS). Use sharding='ddp', or a 16-bit precision."
        )
    weights = estimate.component("weights").own_bytes
    per_param = weights / max(1, inventory.total_params)
    replicated = int(per_param * inventory.head_params)  # a tied head is the embedding: replicated too
    sharded = weights - replicated
    layer = sharded / max(1, inventory.num_layers)
    weights_per_gpu = replicated + int(sharded / world_size) + int(2 * layer * (world_size - 1) / world_size)
    divided = {"lora", "optimizer", "gradients"}
    components = []
    for c in estimate.components:
        if c.key == "weights":
            c = replace(
                c,
                bytes=weights_per_gpu,
                own_bytes=weights_per_gpu,
                note=f"1/{world_size} of the decoder, the head replicated, 2 layers gathered at a time",
            )
        elif c.key in divided:
            c = replace(c, bytes=c.bytes // world_size, own_bytes=c.own_bytes // world_size)
        components.append(c)
    note = (
        f"per GPU of {world_size} (FSDP2): base, LoRA, gradients and optimizer sharded; batch_tokens per rank"
    )
    return replace(estimate, settings=settings, components=tuple(components), notes=(*estimate.notes, note))
