"""VRAM: estimate what a LoRA/QLoRA run needs, find the longest context that fits, measure it on a GPU.

``estimate_vram(model, seq_len, …)`` (`estimate`, its inputs checked by `settings`, each part's bytes
`part_bytes` and `methods`, the peaks `assemble`) returns a `VramEstimate` (`result`: a breakdown with
``.table()`` and ``.to_dict()``); ``max_context`` and ``fits`` (`fit`) answer the questions a user asks
before training; ``measure`` runs real training steps on CUDA and reports the peak beside the estimate.
The activation model, per layer and tensor, is `activations`; the model's shapes, `inventory` (for catalog
models read from `catalog_cache`). Nothing here imports torch at import time (`measure` imports it when it
runs), so ``fastft estimate`` on a catalog model runs without torch.
"""

from fastft.vram.estimate import estimate_vram
from fastft.vram.fit import FitVerdict, Fix, fits, max_context
from fastft.vram.gpus import GPUS, GpuSpec, capped_gpu, detect_gpu, get_gpu
from fastft.vram.measure import VramMeasurement, measure
from fastft.vram.result import VramComponent, VramEstimate, VramEstimateError, VramSettings
from fastft.vram.settings import CHECKPOINTING, LOSSES, OPTIMIZERS, PRECISIONS

__all__ = [
    "CHECKPOINTING",
    "GPUS",
    "LOSSES",
    "OPTIMIZERS",
    "PRECISIONS",
    "FitVerdict",
    "Fix",
    "GpuSpec",
    "VramComponent",
    "VramEstimate",
    "VramEstimateError",
    "VramMeasurement",
    "VramSettings",
    "capped_gpu",
    "detect_gpu",
    "estimate_vram",
    "fits",
    "get_gpu",
    "max_context",
    "measure",
]
