"""VRAM: estimate what a LoRA/QLoRA run needs, find the longest context that fits, measure it on a GPU.

``estimate_vram(model, seq_len, …)`` returns a `VramEstimate` (a breakdown with ``.table()`` and
``.to_dict()``); ``max_context`` and ``fits`` answer the questions a user asks before training;
``measure`` runs real training steps on CUDA and reports the peak beside the estimate.
"""

from fastft.vram.estimate import (
    CHECKPOINTING,
    LOSSES,
    OPTIMIZERS,
    PRECISIONS,
    FitVerdict,
    Fix,
    VramComponent,
    VramEstimate,
    VramEstimateError,
    VramSettings,
    estimate_vram,
    fits,
    max_context,
)
from fastft.vram.gpus import GPUS, GpuSpec, capped_gpu, detect_gpu, get_gpu
from fastft.vram.measure import VramMeasurement, measure

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
