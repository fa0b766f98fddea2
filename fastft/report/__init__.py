"""Run reports: plotly figure builders (shared with the notebook studio) and a self-contained HTML page.

Every figure a notebook draws is exported here and from `fastft` itself (``fastft.loss_figure(result.steps)``).
"""

from fastft.report.figures import (
    accuracy_figure,
    kernel_profile_figure,
    learning_rate_figure,
    loss_figure,
    memory_label,
    phases_figure,
    sequence_length_figure,
    smooth,
    step_profile_figure,
    step_timeline_figure,
    throughput_figure,
    timeline_figure,
    vram_figure,
)
from fastft.report.html import RunReport, render_report, write_report

__all__ = [
    "RunReport",
    "accuracy_figure",
    "kernel_profile_figure",
    "learning_rate_figure",
    "loss_figure",
    "memory_label",
    "phases_figure",
    "render_report",
    "sequence_length_figure",
    "smooth",
    "step_profile_figure",
    "step_timeline_figure",
    "throughput_figure",
    "timeline_figure",
    "vram_figure",
    "write_report",
]
