"""Step profiler: always-on phase timing of every training step, and an on-demand torch.profiler window.

`StepProfile` (the trainer's ``.profile``) times data, forward (embedding, per-layer norms,
attention, MLP or MoE), loss, backward (per layer, recompute apart) and optimizer with CUDA events
or perf_counter, as NVTX ranges on CUDA; `profile_window` records a few steps with torch.profiler
and reports the top kernels, copy/compute overlap and a Chrome/Perfetto trace.
"""

from fastft.profile.hooks import detach_profile, find_backbone
from fastft.profile.ranges import nvtx_available, nvtx_tool_attached
from fastft.profile.steps import (
    ORDER,
    PARENTS,
    TOP_LEVEL,
    PhaseSpan,
    StepProfile,
    StepTiming,
    Table,
    exclusive_phases,
    group_of,
    phase,
    phase_table,
)
from fastft.profile.window import KernelProfile, KernelRow, copy_compute_overlap, profile_window

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
    "phase",
    "phase_table",
    "profile_window",
]
