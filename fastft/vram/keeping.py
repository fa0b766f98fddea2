"""The estimator's answer to a conditional `fastft.runtime.offload.KeepPolicy`: does keeping each offloaded
layer's attention output for a forward of so many tokens still fit the device? Registered into the runtime
from above (`fastft.runtime.keep_fit`), since the runtime never imports the estimator."""

from __future__ import annotations

import torch

from fastft.vram.result import VramEstimateError

# Function-local imports: tests replace these names on their modules, so they are looked up when called.


def keeping_fits(model: torch.nn.Module, tokens: int, device: torch.device) -> bool:
    """Whether `estimate_vram` keeps the attention outputs for `tokens` tokens on this CUDA device (it does
    only where they fit). The device's room is its allocator cap (``set_per_process_memory_fraction``), or
    what the driver has free plus what PyTorch holds already, whichever is less."""
    from fastft.vram import capped_gpu, estimate_vram

    total = torch.cuda.get_device_properties(device).total_memory
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    free, _ = torch.cuda.mem_get_info(device)
    room = min(int(total * fraction), free + torch.cuda.memory_reserved(device))
    try:
        estimate = estimate_vram(
            model,
            tokens,
            tokens,
            gpu=capped_gpu(room),
            checkpointing="offload",
            keep_attention=None,
            host_memory=None,  # the offloader keeps only what its pinned budget holds (`_keep_room`)
        )
    except (VramEstimateError, ValueError):  # a model the estimator cannot describe: keep nothing
        return False
    return bool(estimate.fits) and estimate.settings.keep_attention
