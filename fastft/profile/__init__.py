"""Step profiler: always-on phase timing of every training step, and an on-demand torch.profiler window.

`StepProfile` (the trainer's ``.profile``, recorded in `fastft.training.timing`) times data, forward
(embedding, per-layer norms, attention, MLP or MoE), loss, backward (per layer, recompute apart) and
optimizer with CUDA events or perf_counter, as NVTX ranges on CUDA; `profile_window` records a few steps
with torch.profiler and reports the top kernels, copy/compute overlap and a Chrome/Perfetto trace. Their
figures are drawn by `fastft.report` (`step_profile_figure`, `step_timeline_figure`, `kernel_profile_figure`).
"""

from fastft.profile.window import KernelProfile, KernelRow, copy_compute_overlap, profile_window
from fastft.training.nvtx import nvtx_available, nvtx_tool_attached
from fastft.training.timing import (
    ORDER,
    PARENTS,
    TOP_LEVEL,
    PhaseSpan,
    StepProfile,
    StepTiming,
    Table,
    exclusive_phases,
    group_of,
    phase_table,
)
from fastft.training.timing_hooks import detach_profile, find_backbone

__all__ = [
    "ORDER",
    "PARENTS",
    "TOP_LEVEL",
    "KernelProfile",
    "KernelRow",
    "PhaseSpan",
    "StepProfile",
    "StepTiming",
    "Table",
    "copy_compute_overlap",
    "detach_profile",
    "exclusive_phases",
    "find_backbone",
    "group_of",
    "nvtx_available",
    "nvtx_tool_attached",
    "phase_table",
    "profile_window",
]
