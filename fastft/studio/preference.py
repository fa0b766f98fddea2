"""The Run tab's preference curves: rewards of the chosen and rejected answers, their margin, and accuracy.

Built from plain arrays like `fastft.report.figures.run_dashboard_figure` (a live plot sets the traces' data
afterwards); the numbers are `StepEvent.preference`'s (`fastft.training.objectives.preference`).
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from fastft.report.figures import grid_layout

__all__ = ["PREFERENCE_TRACES", "preference_figure"]

PREFERENCE_TRACES = ("rewards chosen", "rewards rejected", "margin", "accuracy")


def preference_figure(
    step: Sequence[float] = (),
    rewards_chosen: Sequence[float] = (),
    rewards_rejected: Sequence[float] = (),
    margin: Sequence[float] = (),
    accuracy: Sequence[float] = (),
    *,
    max_steps: int | None = None,
) -> go.Figure:
    """Three panels over the steps: the rewards of the chosen and the rejected answers across the top, their
    margin and the share of pairs whose chosen answer has the higher reward below (two side by side stay
    readable in a narrow notebook; traces in `PREFERENCE_TRACES` order)."""
    fig = make_subplots(
        rows=2,
        cols=2,
        specs=[[{"colspan": 2}, None], [{}, {}]],
        # two lines each: side by side in a narrow notebook, one line each would run into the other
        subplot_titles=("Rewards", "Margin<br>(chosen − rejected)", "Accuracy<br>(chosen > rejected)"),
        horizontal_spacing=0.09,
        vertical_spacing=0.16,
    )
    line = {"mode": "lines", "hoverlabel": {"namelength": -1}}
    for name, y, color, (row, col) in (
        ("rewards chosen", rewards_chosen, "#2a9d5c", (1, 1)),
        ("rewards rejected", rewards_rejected, "#d62728", (1, 1)),
        ("margin", margin, "#1f6fb4", (2, 1)),
        ("accuracy", accuracy, "#8e5ec9", (2, 2)),
    ):
        fig.add_trace(
            go.Scatter(x=step, y=y, name=name, line={"color": color, "width": 2}, **line), row=row, col=col
        )
    grid_layout(fig, "preference")
    # a SimPO loss or margin near 0 reads 2e-12, not plotly's SI "2p"
    fig.update_yaxes(exponentformat="e", row=1, col=1)
    fig.update_yaxes(exponentformat="e", row=2, col=1)
    fig.update_yaxes(range=[0, 1], tickformat=".0%", row=2, col=2)
    if max_steps:
        fig.update_xaxes(range=[0, max_steps])
    return fig
