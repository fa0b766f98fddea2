"""Run reports: plotly figure builders (shared with the notebook studio) and a self-contained HTML page."""

from fastft.report.figures import (
    accuracy_figure,
    learning_rate_figure,
    loss_figure,
    memory_label,
    smooth,
    throughput_figure,
)
from fastft.report.html import RunReport, render_report, write_report

__all__ = [
    "RunReport",
    "accuracy_figure",
    "learning_rate_figure",
    "loss_figure",
    "memory_label",
    "render_report",
    "smooth",
    "throughput_figure",
    "write_report",
]
