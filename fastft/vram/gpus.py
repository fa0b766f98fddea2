"""GPU presets: the memory a training process can really use on each card.

Capacities are ``torch.cuda.get_device_properties(i).total_memory`` as PyTorch reports it on that card
(MiB figures from ``_CudaDeviceProperties`` printouts; nvidia-smi's "Total" where no printout was found),
not the marketing size: a "16 GB" T4 with ECC on offers 14.74 GiB, an "80 GB" H100 79.19 GiB.
The CUDA context (driver state, loaded kernels, cuBLAS/cuDNN handles) lives outside PyTorch's allocator
and is charged separately (`GpuSpec.context_bytes`).
"""

from __future__ import annotations

import difflib
import glob
import os
import re
import sys
from dataclasses import dataclass

# Function-local imports: `import fastft.vram` and `fastft estimate` run without torch or transformers
# (tests/faces/test_cli.py).

MiB = 2**20
GiB = 2**30

# CUDA context of a PyTorch training process with lazy module loading (CUDA ≥ 11.7): driver state,
# the kernels it actually loads, and library handles. Typically 0.4–0.6 GiB; `fastft bench vram`
# measures it as (total − free) − torch.cuda.memory_reserved() after a training step.
DEFAULT_CONTEXT_BYTES = 512 * MiB


@dataclass(frozen=True)
class GpuSpec:
    """A GPU as the estimate sees it: usable bytes, CUDA context and whether it computes in bf16."""

    name: str  # key in GPUS, e.g. "rtx4090"
    label: str  # e.g. "NVIDIA GeForce RTX 4090"
    capacity_bytes: int  # total_memory as PyTorch reports it
    context_bytes: int = DEFAULT_CONTEXT_BYTES
    bf16: bool = True  # False: Turing and older train in fp16 (same bytes per element)
    source: str = ""  # where the capacity figure comes from

    @property
    def capacity_gib(self) -> float:
        return self.capacity_bytes / GiB

    @property
    def usable_bytes(self) -> int:
        """Bytes left for PyTorch's allocator once the CUDA context is loaded."""
        return self.capacity_bytes - self.context_bytes

    def __str__(self) -> str:
        return f"{self.label} ({self.capacity_gib:.2f} GiB)"


def _mib(value: int) -> int:
    return value * MiB


GPUS: dict[str, GpuSpec] = {
    gpu.name: gpu
    for gpu in (
        GpuSpec("t4", "NVIDIA Tesla T4 16 GB", _mib(15095), bf16=False, source="torch total_memory=15095MB"),
        GpuSpec("rtx3090", "NVIDIA GeForce RTX 3090 24 GB", _mib(24259), source="torch total_memory=24259MB"),
        GpuSpec("rtx4090", "NVIDIA GeForce RTX 4090 24 GB", _mib(24563), source="torch total_memory=24563MB"),
        GpuSpec("rtx5090", "NVIDIA GeForce RTX 5090 32 GB", _mib(32607), source="nvidia-smi 32607MiB"),
        GpuSpec("l4", "NVIDIA L4 24 GB", _mib(23034), source="nvidia-smi 23034MiB (ECC on)"),
        GpuSpec("a10g", "NVIDIA A10G 24 GB", _mib(23028), source="nvidia-smi 23028MiB (ECC on; AWS g5)"),
        GpuSpec("a100-40gb", "NVIDIA A100 40 GB", _mib(40536), source="total_memory=40536MB"),
        GpuSpec("a100-80gb", "NVIDIA A100 80 GB", _mib(81050), source="torch total_memory≈81050MB"),
        GpuSpec("h100", "NVIDIA H100 80 GB HBM3", _mib(81090), source="torch total_memory=81090MB"),
        GpuSpec("h200", "NVIDIA H200 141 GB", _mib(143156), source="torch total_memory=143156MB"),
        GpuSpec("b200", "NVIDIA B200 180 GB", _mib(182631), source="torch total_memory=182631MB"),
    )
}

_ALIASES = {
    "a100": "a100-80gb",
    "a10040": "a100-40gb",
    "a10040gb": "a100-40gb",
    "a10080": "a100-80gb",
    "a10080gb": "a100-80gb",
    "h10080gb": "h100",
    "3090": "rtx3090",
    "4090": "rtx4090",
    "5090": "rtx5090",
    "teslat4": "t4",
}


def _key(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower().replace("geforce", "").replace("nvidia", ""))


def get_gpu(gpu: str | GpuSpec) -> GpuSpec:
    """A preset by name ("rtx4090", "RTX 4090", "a100-40gb", "H100", …), or "auto"/"detected" for this GPU."""
    if isinstance(gpu, GpuSpec):
        return gpu
    if gpu in ("auto", "detected", "cuda"):
        detected = detect_gpu()
        if detected is None:
            raise ValueError(
                "No CUDA GPU is visible here to estimate against. Name one: gpu='rtx4090' "
                f"(presets: {', '.join(GPUS)})."
            )
        return detected
    key = _key(gpu)
    by_key = {_key(name): name for name in GPUS}
    name = by_key.get(key) or _ALIASES.get(key)
    if name is None:
        close = difflib.get_close_matches(gpu.lower(), list(GPUS), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"Unknown GPU {gpu!r}.{hint} Presets: {', '.join(GPUS)}; or pass a GpuSpec("
            "name, label, capacity_bytes) for another card."
        )
    return GPUS[name]


def detect_gpu(index: int | None = None) -> GpuSpec | None:
    """The visible CUDA GPU as a `GpuSpec` (capacity from `torch.cuda.get_device_properties`), or None.

    On Linux without a GPU device node (``/dev/nvidia*``, ROCm's ``/dev/kfd``) there is none, which is
    answered without importing torch (seconds) unless torch is loaded already."""

    if "torch" not in sys.modules and _no_gpu_device_nodes():
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    return GpuSpec(
        name="detected",
        label=props.name,
        capacity_bytes=int(props.total_memory),
        bf16=props.major >= 8,
        source=f"torch.cuda.get_device_properties({index})",
    )


def _no_gpu_device_nodes() -> bool:
    if not sys.platform.startswith("linux"):
        return False  # elsewhere ask torch
    return not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"))


def capped_gpu(capacity_bytes: int, label: str | None = None) -> GpuSpec:
    """A GPU limited by ``torch.cuda.set_per_process_memory_fraction``: the cap covers PyTorch's allocator
    only, so no CUDA context is charged against it."""
    label = label or f"{capacity_bytes / GiB:.0f} GiB allocator cap"
    return GpuSpec("capped", label, int(capacity_bytes), context_bytes=0, source="per-process memory cap")
