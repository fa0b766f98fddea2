"""Plotly figure builders for training runs, shared by the HTML report and the notebook studio.

Every builder takes plain data (trainer events, mappings of numbers) and returns a fresh
`plotly.graph_objects.Figure`; none does any I/O. All figures share one look (`TEMPLATE`,
`HEIGHT`) and never raise on empty input: they return a figure with a short notice instead.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from fastft.training.events import EvalEvent, StepEvent
from fastft.training.timing import PhaseSpan, exclusive_phases, group_of

__all__ = [
    "HEIGHT",
    "TEMPLATE",
    "accuracy_figure",
    "learning_rate_figure",
    "loss_figure",
    "kernels_figure",
    "memory_label",
    "phases_figure",
    "run_dashboard_figure",
    "sequence_length_figure",
    "smooth",
    "throughput_figure",
    "timeline_figure",
    "vram_figure",
]

TEMPLATE = "plotly_white"
HEIGHT = 350
TOOLBAR_PX = 30  # height of the strip at the top where plotly's toolbar shows on hover
GIB = 1024**3
FONT_FAMILY = "system-ui, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"

_BLUE = "#1f6fb4"
_BLUE_FAINT = "rgba(31, 111, 180, 0.30)"
_RED = "#d62728"
_GREEN = "#2a9d5c"
_PURPLE = "#8e5ec9"
_ORANGE = "#e8871e"
_GREY = "#a3acb9"


def smooth(values: Iterable[float], smoothing: float = 0.9) -> list[float]:
    """Exponential moving average with bias correction, as TensorBoard's scalar smoothing.

    ``ema_n = smoothing * ema_{n-1} + (1 - smoothing) * x_n`` starting from ``ema_0 = 0``, and each
    output is ``ema_n / (1 - smoothing ** n)`` so the first values are not pulled towards zero.
    Non-finite values (NaN, inf) are passed through unchanged and do not enter the average.
    ``smoothing=0`` returns the input; it must lie in ``[0, 1)``.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
    out: list[float] = []
    ema = 0.0
    n = 0
    for value in values:
        x = float(value)
        if not math.isfinite(x):
            out.append(x)
            continue
        n += 1
        ema = smoothing * ema + (1.0 - smoothing) * x
        out.append(ema / (1.0 - smoothing**n))
    return out


def memory_kind_here() -> str:
    """The `StepEvent.memory_kind` a run on this machine reports: "cuda" with a CUDA GPU, else "cpu-rss"
    (what an empty chart names before a run has said)."""

    return "cuda" if torch.cuda.is_available() else "cpu-rss"


def memory_label(memory_kind: str) -> str:
    """Human label for a `StepEvent.memory_kind`: "GPU peak allocated" or "CPU peak RSS"."""
    kind = (memory_kind or "").strip().lower()
    if kind.startswith("cpu") or "rss" in kind or kind in {"host", "process"}:
        return "CPU peak RSS"
    if any(word in kind for word in ("cuda", "gpu", "alloc", "mps", "xpu", "device")):
        return "GPU peak allocated"
    return f"Peak memory ({memory_kind})" if memory_kind else "Peak memory"


def _base_layout(fig: go.Figure, title: str, x_title: str, y_title: str) -> go.Figure:
    fig.update_layout(
        template=TEMPLATE,
        height=HEIGHT,
        # the title sits below the strip where plotly's toolbar appears on hover, so the two never meet
        title={
            "text": title,
            "x": 0.01,
            "xanchor": "left",
            "yref": "container",
            "y": 1.0,
            "yanchor": "top",
            "pad": {"t": TOOLBAR_PX},
            "font": {"size": 16},
        },
        font={"family": FONT_FAMILY, "size": 12},
        margin={"l": 64, "r": 24, "t": 64 + TOOLBAR_PX // 2, "b": 48},
        legend={"orientation": "h", "x": 1.0, "xanchor": "right", "y": 1.0, "yanchor": "bottom"},
        hovermode="x unified",
    )
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text=y_title)
    return fig


def _empty_figure(title: str, message: str) -> go.Figure:
    fig = go.Figure()
    _base_layout(fig, title, "", "")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.add_annotation(
        text=message,
        x=0.5,
        y=0.5,
        xref="paper",
        yref="paper",
        showarrow=False,
        font={"size": 15, "color": "#7a8594"},
    )
    return fig


def _step_range(fig: go.Figure, steps: Sequence[StepEvent]) -> None:
    """Pin the x axis to the whole run (0..max_steps) so a live plot shows progress."""
    last = max(max(s.max_steps for s in steps), max(s.step for s in steps))
    if last > 0:
        fig.update_xaxes(range=[0, last])


def loss_figure(
    steps: Sequence[StepEvent], evals: Sequence[EvalEvent] = (), *, smoothing: float = 0.9
) -> go.Figure:
    """Training loss per optimizer step: raw (thin), smoothed (`smooth`) and eval-loss markers.

    Traces, in order: "train loss" (raw), "train loss (smoothed)", then "eval loss" if `evals`.
    Returns a figure with a "no steps yet" notice (plus any eval markers) when `steps` is empty.
    """
    title = "Loss"
    if not steps and not evals:
        return _empty_figure(title, "no steps yet")
    fig = go.Figure()
    if steps:
        x = [s.step for s in steps]
        losses = [float(s.loss) for s in steps]
        fig.add_trace(
            go.Scatter(
                x=x,
                y=losses,
                name="train loss",
                mode="lines",
                line={"color": _BLUE_FAINT, "width": 1},
                hovertemplate="%{y:.4f}",
            )
        )
        fig.add_trace(
            go.Scatter(
                x=x,
                y=smooth(losses, smoothing),
                name=f"train loss (smoothed {smoothing:g})",
                mode="lines",
                line={"color": _BLUE, "width": 2.5},
                hovertemplate="%{y:.4f}",
            )
        )
    if evals:
        fig.add_trace(
            go.Scatter(
                x=[e.step for e in evals],
                y=[float(e.eval_loss) for e in evals],
                name="eval loss",
                mode="lines+markers",
                marker={"color": _RED, "size": 9, "symbol": "diamond"},
                line={"color": _RED, "width": 1, "dash": "dot"},
                hovertemplate="%{y:.4f}",
            )
        )
    _base_layout(fig, title, "optimizer step", "loss (nats / token)")
    if steps:
        _step_range(fig, steps)
    else:
        fig.add_annotation(text="no steps yet", x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False)
    return fig


def throughput_figure(steps: Sequence[StepEvent]) -> go.Figure:
    """Trained tokens per second per step with its median, and peak memory (GiB) on a second axis.

    Traces, in order: "trained tokens/s", "median …", then the memory trace named by
    `memory_label` of the last step's `memory_kind` ("GPU peak allocated" / "CPU peak RSS").
    """
    title = "Throughput and memory"
    if not steps:
        return _empty_figure(title, "no steps yet")
    x = [s.step for s in steps]
    rates = [float(s.trained_tokens_per_second) for s in steps]
    finite = [r for r in rates if math.isfinite(r)]
    label = memory_label(steps[-1].memory_kind)

    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(
        go.Scatter(
            x=x,
            y=rates,
            name="trained tokens/s",
            mode="lines+markers" if len(steps) <= 60 else "lines",
            marker={"size": 4},
            line={"color": _GREEN, "width": 1.5},
            hovertemplate="%{y:,.0f} tok/s",
        ),
        secondary_y=False,
    )
    if finite:
        median = statistics.median(finite)
        fig.add_trace(
            go.Scatter(
                x=[x[0], x[-1]],
                y=[median, median],
                name=f"median {median:,.0f} tok/s",
                mode="lines",
                line={"color": _GREEN, "width": 1.5, "dash": "dash"},
                hoverinfo="skip",
            ),
            secondary_y=False,
        )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[s.peak_memory_bytes / GIB for s in steps],
            name=label,
            mode="lines",
            line={"color": _PURPLE, "width": 2, "shape": "hv"},
            hovertemplate="%{y:.2f} GiB",
        ),
        secondary_y=True,
    )
    _base_layout(fig, title, "optimizer step", "trained tokens / s")
    fig.update_yaxes(rangemode="tozero", secondary_y=False)
    fig.update_yaxes(title_text=f"{label} (GiB)", rangemode="tozero", showgrid=False, secondary_y=True)
    _step_range(fig, steps)
    return fig


def learning_rate_figure(steps: Sequence[StepEvent]) -> go.Figure:
    """Learning rate per optimizer step (one trace, "learning rate")."""
    title = "Learning rate"
    if not steps:
        return _empty_figure(title, "no steps yet")
    fig = go.Figure(
        go.Scatter(
            x=[s.step for s in steps],
            y=[float(s.learning_rate) for s in steps],
            name="learning rate",
            mode="lines",
            line={"color": _ORANGE, "width": 2},
            hovertemplate="%{y:.3e}",
        )
    )
    _base_layout(fig, title, "optimizer step", "learning rate (per step)")
    fig.update_yaxes(tickformat=".1e", rangemode="tozero")
    _step_range(fig, steps)
    return fig


def _as_percent(values: Iterable[float | None], percent: bool) -> list[float | None]:
    out: list[float | None] = []
    for v in values:
        if v is None or not math.isfinite(float(v)):
            out.append(None)
        else:
            out.append(float(v) if percent else 100.0 * float(v))
    return out


def accuracy_figure(
    before: Mapping[str, float] | None,
    after: Mapping[str, float] | None,
    *,
    percent: bool | None = None,
    title: str = "Accuracy per task",
) -> go.Figure:
    """Grouped bars of accuracy per task before and after training, on a 0-100 % axis.

    Tasks are the union of both mappings' keys in first-seen order; the key ``"all"`` (the mean
    over tasks, as given by the caller) is drawn last as its own group. Values are fractions in
    [0, 1] unless `percent` is True; with ``percent=None`` they count as percentages as soon as
    any value exceeds 1. Traces: "before training" and/or "after training" (whichever is given).
    `title` names what was scored (the demo draws content accuracy and format compliance apart).
    """
    before = dict(before or {})
    after = dict(after or {})
    if not before and not after:
        return _empty_figure(title, "no accuracy results yet")
    tasks = [t for t in dict.fromkeys([*before, *after]) if t != "all"]
    if "all" in before or "all" in after:
        tasks.append("all")
    if percent is None:
        numbers = [float(v) for v in (*before.values(), *after.values()) if v is not None]
        percent = any(math.isfinite(v) and v > 1.0 for v in numbers)

    fig = go.Figure()
    for name, values, color in (("before training", before, _GREY), ("after training", after, _BLUE)):
        if not values:
            continue
        y = _as_percent((values.get(t) for t in tasks), percent)
        fig.add_trace(
            go.Bar(
                x=tasks,
                y=y,
                name=name,
                marker={"color": color},
                text=[None if v is None else f"{v:.0f}%" for v in y],
                textposition="outside",
                cliponaxis=False,
                hovertemplate="%{x}: %{y:.1f}%<extra>" + name + "</extra>",
            )
        )
    _base_layout(fig, title, "task", "accuracy (%)")
    fig.update_layout(barmode="group", bargap=0.25, bargroupgap=0.05, hovermode="closest")
    fig.update_yaxes(range=[0, 109], tickvals=[0, 20, 40, 60, 80, 100], ticksuffix="%")
    fig.update_xaxes(type="category")
    return fig


def sequence_length_figure(
    lengths: Sequence[int], max_seq_length: int | None = None, *, truncated: int = 0, buckets: int = 40
) -> go.Figure:
    """Histogram of tokenised sequence lengths (tokens per kept row), with the bin capacity marked.

    Counted here with numpy into at most `buckets` equal-width buckets from 0 to `max_seq_length`
    (or the longest row), so a million rows send a few dozen bars to the browser, not a million
    numbers. One trace, "sequences"; a dashed line marks `max_seq_length`; the title gives the
    count and the median, and how many rows were `truncated` to fit.
    """

    title = "Sequence lengths"
    values = np.asarray(lengths, dtype=np.int64).ravel()
    if values.size == 0:
        return _empty_figure(title, "no sequences")
    top = int(max(max_seq_length or 0, int(values.max()), 1))
    width = max(1, math.ceil(top / buckets))
    edges = np.arange(0, top + width + 1, width)
    counts, edges = np.histogram(values, bins=edges)
    centres = (edges[:-1] + edges[1:]) / 2
    fig = go.Figure(
        go.Bar(
            x=centres.tolist(),
            y=counts.tolist(),
            width=[width * 0.95] * len(counts),
            name="sequences",
            marker={"color": _BLUE},
            customdata=np.stack([edges[:-1], edges[1:] - 1], axis=1).tolist(),
            hovertemplate="%{customdata[0]}–%{customdata[1]} tokens: %{y} sequences<extra></extra>",
        )
    )
    title = f"Sequence lengths: {values.size:,} sequences, median {int(np.median(values)):,} tokens"
    if truncated:
        title += f", {truncated:,} truncated"
    _base_layout(fig, title, "tokens per sequence", "sequences")
    fig.update_layout(hovermode="closest", bargap=0.05)
    if max_seq_length:
        fig.add_vline(x=max_seq_length, line={"color": _RED, "width": 2, "dash": "dash"})
        fig.add_annotation(
            x=max_seq_length,
            y=1.0,
            yref="paper",
            text=f"max_seq_length {max_seq_length:,}",
            showarrow=False,
            xanchor="right",
            yanchor="bottom",
            font={"color": _RED, "size": 11},
        )
    fig.update_xaxes(range=[0, top + width])
    return fig


# ---------------------------------------------------------------------------------------------- step timing

# One colour per phase group (`fastft.profile.group_of`); the parents' "rest" slices are paler.
PHASE_COLORS = {
    "data": "#a3acb9",
    "forward": "#9ecae1",
    "embed": "#6baed6",
    "layers.norm": "#17becf",
    "layers.attention": "#1f6fb4",
    "layers.mlp": "#2a9d5c",
    "layers.moe": "#1b7340",
    "final_norm": "#0e8a9c",
    "loss": "#e8871e",
    "backward": "#f4b6c2",
    "loss_backward": "#f3b170",
    "layers.backward": "#c9a3e6",
    "layers.recompute": "#8e5ec9",
    "offload_wait": "#d62728",
    "graph": "#5b8def",
    "communication": "#17becf",
    "optimizer": "#8c564b",
    "other": "#dde2e8",
}
_REST = {
    "forward": "forward (rest)",
    "backward": "backward (rest)",
    "layers.backward": "layer backward (rest)",
}
_EXTRA_COLORS = ("#bcbd22", "#e377c2", "#7f7f7f", "#ff9896", "#98df8a", "#c5b0d5")


def _phase_color(group: str, extra: dict[str, str]) -> str:
    if group in PHASE_COLORS:
        return PHASE_COLORS[group]
    return extra.setdefault(group, _EXTRA_COLORS[len(extra) % len(_EXTRA_COLORS)])


def phases_figure(steps: Sequence[int], phases: Sequence[Mapping[str, float]]) -> go.Figure:
    """Where each step's time went: stacked bars (ms) per step of the parts that add up to the step.

    `phases` are summaries as in `StepEvent.phases` (one per entry of `steps`); each bar is split
    by `fastft.profile.exclusive_phases`: nested phases (``layers.attention``, ``layers.recompute``,
    …), each parent's remainder ("forward (rest)") and "other" (time outside every phase).
    One trace per part, in the order a step runs them.
    """
    title = "Step time by phase"
    pairs = [(s, p) for s, p in zip(steps, phases, strict=True) if p]
    if not pairs:
        return _empty_figure(title, "no step timings")
    parts = [exclusive_phases(p) for _, p in pairs]
    names = list(dict.fromkeys(name for part in parts for name in part))
    fig = go.Figure()
    extra: dict[str, str] = {}
    x = [s for s, _ in pairs]
    for name in names:
        label = _REST.get(name, name)
        fig.add_trace(
            go.Bar(
                x=x,
                y=[part.get(name, 0.0) for part in parts],
                name=label,
                marker={"color": _phase_color(name, extra), "line": {"width": 0}},
                hovertemplate="%{y:.2f} ms<extra>" + label + "</extra>",
            )
        )
    _base_layout(fig, title, "optimizer step", "ms")
    fig.update_layout(barmode="stack", bargap=0.1 if len(x) <= 60 else 0.0, hovermode="x")
    fig.update_layout(legend={"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1.0, "yanchor": "top"})
    fig.update_layout(margin={"r": 180})
    _cut_outlier_steps(fig, x, [sum(part.values()) for part in parts])
    _note_graph_replays(fig, names)
    return fig


GRAPH_NOTE = (
    "graph: forward and backward replayed from a CUDA graph, untimed inside "
    "(TrainConfig(cuda_graph=False) times each layer)"
)


def _note_graph_replays(fig: go.Figure, names: Iterable[str]) -> None:
    """Say under the title why a replayed step has no per-layer phases."""
    if "graph" in names:
        fig.add_annotation(
            text=GRAPH_NOTE, xref="paper", yref="paper", x=0.0, y=1.0, yanchor="bottom", xanchor="left",
            showarrow=False, font={"size": 11, "color": "#555"},
        )  # fmt: skip


# A step this many times the median (the first: allocation, compilation, autotuning) is cut off at that height
# instead of flattening every other bar; the annotation gives its real time.
OUTLIER_STEP_RATIO = 2.5


def _cut_outlier_steps(fig: go.Figure, x: Sequence[int], totals: Sequence[float]) -> None:
    """Cut bars taller than `OUTLIER_STEP_RATIO` × the median at that height and label their real time in
    one label at the first cut step (several labels met each other on a narrow chart)."""
    if len(totals) < 3:
        return
    ceiling = OUTLIER_STEP_RATIO * statistics.median(totals)
    cut = [(step, total) for step, total in zip(x, totals, strict=True) if total > ceiling]
    if not cut or ceiling <= 0:
        return
    fig.update_yaxes(range=[0, ceiling * 1.05])
    top = max(total for _, total in cut)
    text = f"{top:,.0f} ms" if len(cut) == 1 else f"{len(cut)} steps cut, up to {top:,.0f} ms"
    fig.add_annotation(  # at the top of the plot area in paper units: inside it whatever the y range
        x=cut[0][0],
        yref="paper",
        y=1.0,
        text=text,
        showarrow=False,
        xanchor="left",
        yanchor="top",
        font={"size": 10},
        bgcolor="rgba(255,255,255,0.8)",
    )


_ROWS = ("step phases", "modules and layers", "recompute and waits")


def timeline_figure(spans: Sequence[PhaseSpan | Mapping], step: int | None = None) -> go.Figure:
    """One step as a Gantt chart (like Nsight Systems): a bar per span, one row per nesting depth.

    Rows from top: top-level phases (data, forward, loss, backward, optimizer), the modules and
    per-layer backward nested in them, then recompute and waits inside a layer's backward. Bars are
    coloured by phase group (one legend entry per group); hover names the span and its duration.
    `spans` are `PhaseSpan`s or mappings with their fields (as saved in a report).
    """
    title = "Step timeline" if step is None else f"Step {step} timeline"
    items = [s if isinstance(s, PhaseSpan) else PhaseSpan(**{k: s[k] for k in ("name", "start_ms", "end_ms", "depth")})
             for s in spans]  # fmt: skip
    if not items:
        return _empty_figure(title, "no step timings")
    by_group: dict[str, list[PhaseSpan]] = {}
    for span in items:
        by_group.setdefault(group_of(span.name), []).append(span)
    fig = go.Figure()
    extra: dict[str, str] = {}
    for group, members in by_group.items():
        fig.add_trace(
            go.Bar(
                orientation="h",
                base=[s.start_ms for s in members],
                x=[max(s.duration_ms, 0.0) for s in members],
                y=[_ROWS[min(s.depth, len(_ROWS) - 1)] for s in members],
                customdata=[[s.name, s.start_ms] for s in members],
                name=group,
                marker={"color": _phase_color(group, extra), "line": {"width": 0.5, "color": "white"}},
                hovertemplate="%{customdata[0]}<br>%{x:.3f} ms at %{customdata[1]:.3f} ms<extra></extra>",
            )
        )
    _base_layout(fig, title, "ms since the step started", "")
    used = [row for row in _ROWS if any(_ROWS[min(s.depth, len(_ROWS) - 1)] == row for s in items)]
    fig.update_layout(barmode="overlay", hovermode="closest", bargap=0.25)
    fig.update_layout(legend={"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1.0, "yanchor": "top"})
    fig.update_layout(margin={"r": 180, "l": 150})
    fig.update_yaxes(categoryorder="array", categoryarray=used, autorange="reversed")
    fig.update_xaxes(rangemode="tozero")
    _note_graph_replays(fig, [span.name for span in items])
    return fig


def kernels_figure(
    kernels: Sequence[Mapping], *, steps: int | None = None, overlap: float | None = None
) -> go.Figure:
    """The top kernels of a profiling window as a table (rows: name, calls, total_ms, share).

    With `steps`, a "ms per step" column is added; `overlap` (fraction of copy time overlapped by
    kernels) goes into the title.
    """
    title = "Top kernels" + ("" if overlap is None else f" · copy/compute overlap {overlap:.0%}")
    if not kernels:
        return _empty_figure(title, "no profiling window recorded")
    header = ["kernel", "calls", "total ms", *(["ms per step"] if steps else []), "share"]
    columns = [
        [str(k["name"]) for k in kernels],
        [int(k["calls"]) for k in kernels],
        [f"{float(k['total_ms']):,.3f}" for k in kernels],
        *([[f"{float(k['total_ms']) / steps:,.3f}" for k in kernels]] if steps else []),
        [f"{float(k['share']):.1%}" for k in kernels],
    ]
    fig = go.Figure(
        go.Table(
            columnwidth=[6, 1, 1.3, *([1.3] if steps else []), 1],
            header={"values": header, "align": "left", "fill": {"color": "#eef1f5"}, "font": {"size": 12}},
            cells={"values": columns, "align": ["left", "right"], "font": {"size": 11}},
        )
    )
    _base_layout(fig, title, "", "")
    fig.update_layout(height=max(HEIGHT, 60 + 24 * len(kernels)))
    return fig


# ------------------------------------------------------------------------------------------------ VRAM bar

# The estimate's components (`fastft.vram.VramEstimate.components`) in the five blocks a user reasons about.
VRAM_GROUPS: dict[str, tuple[str, ...]] = {
    "weights": ("weights", "quant_constants", "dequant"),
    "LoRA + optimizer": ("lora", "optimizer", "gradients", "communication"),
    "activations": ("activations", "recompute", "backward_workspace"),
    "logits": ("logits",),
    "workspace": ("workspace", "context", "slack"),
}
_VRAM_COLORS = {
    "weights": _GREY,
    "LoRA + optimizer": _PURPLE,
    "activations": _BLUE,
    "logits": _ORANGE,
    "workspace": "#dde2e8",
}


def step_profile_figure(profile) -> go.Figure:
    """A `StepProfile`'s phases across its steps as stacked bars (what `phases_figure` draws)."""
    return phases_figure(profile.steps, profile.phases)


def step_timeline_figure(profile, step: int | None = None) -> go.Figure:
    """One step of a `StepProfile` (default: the latest it kept) as a Gantt chart of its spans."""
    timing = profile.timing(step)
    return timeline_figure(timing.spans if timing else (), step=timing.step if timing else None)


def kernel_profile_figure(window) -> go.Figure:
    """The top kernels of a `profile_window` result (`KernelProfile`) as a table."""
    return kernels_figure([asdict(k) for k in window.kernels], steps=window.steps, overlap=window.overlap)


def vram_figure(estimate) -> go.Figure:
    """The memory of one training step as a stacked horizontal bar against the GPU's capacity.

    `estimate` is a `fastft.vram.VramEstimate` or its ``to_dict()``. Segments, in order: weights,
    LoRA + optimizer, activations, logits, workspace (`VRAM_GROUPS` lists the components of each;
    a component freed before the step's peak counts 0). A dashed red line marks the capacity when the
    estimate has a GPU; the title gives the total and the verdict. Sizes in GiB.
    """
    data = estimate if isinstance(estimate, Mapping) else estimate.to_dict()
    components = {c["key"]: c for c in data.get("components", ())}
    title = "VRAM estimate"
    if not components:
        return _empty_figure(title, "no estimate")
    total = float(data["total_bytes"]) / GIB
    gpu = data.get("gpu")
    capacity = float(gpu["capacity_bytes"]) / GIB if gpu else None
    fig = go.Figure()
    for group, keys in VRAM_GROUPS.items():
        members = [components[k] for k in keys if k in components]
        size = sum(float(c["bytes"]) for c in members) / GIB
        lines = "<br>".join(
            f"{c['label']}: {float(c['bytes']) / GIB:.2f} GiB"
            for c in members
            if c["bytes"] or c["own_bytes"]
        )
        fig.add_trace(
            go.Bar(
                orientation="h",
                x=[size],
                y=["this run"],
                name=group,
                marker={"color": _VRAM_COLORS[group], "line": {"width": 0.5, "color": "white"}},
                text=[f"{size:.2f}" if total and size / total > 0.06 else ""],
                textposition="inside",
                insidetextanchor="middle",
                hovertemplate=f"<b>{group}</b>: %{{x:.2f}} GiB<br>{lines}<extra></extra>",
            )
        )
    if gpu:
        fits = total <= capacity
        verdict = "fits" if fits else f"short by {total - capacity:.2f} GiB"
        title = f"{total:.2f} GiB: {verdict}"
        subtitle = f"of {gpu['label']} ({capacity:.2f} GiB)"
        fig.add_vline(x=capacity, line={"color": _RED, "width": 2, "dash": "dash"})
        top = max(total, capacity) * 1.08
        # inside the plot, in the strip above the bar, on the side of the line with room for it
        fig.add_annotation(
            x=capacity,
            y=1.0,
            yref="paper",
            text=f"capacity {capacity:.2f} GiB",
            showarrow=False,
            xanchor="right" if capacity > top / 2 else "left",
            xshift=-4 if capacity > top / 2 else 4,
            yanchor="top",
            font={"color": _RED, "size": 11},
            bgcolor="rgba(255,255,255,0.85)",
        )
    else:
        title, subtitle = f"{total:.2f} GiB", "no GPU chosen"
    _base_layout(fig, title, "", "")
    fig.update_layout(title_subtitle={"text": subtitle, "font": {"size": 12, "color": "#5a6270"}})
    top = max(total, capacity or 0.0) * 1.08
    fig.update_layout(
        barmode="stack",
        height=260,
        hovermode="closest",
        bargap=0.45,
        # the legend below the axis: never beside the title or the capacity label
        legend={"orientation": "h", "x": 0.0, "xanchor": "left", "y": -0.25, "yanchor": "top"},
        margin={"b": 72},
    )
    fig.update_xaxes(range=[0, top if top > 0 else 1], ticksuffix=" GiB")
    fig.update_yaxes(showticklabels=False)
    return fig


# ------------------------------------------------------------------------------------- live run dashboard

# Trace order of `run_dashboard_figure`: a live plot updates these by index.
DASHBOARD_TRACES = ("loss", "loss (smoothed)", "eval loss", "learning rate", "trained tokens/s", "memory")


def grid_layout(fig: go.Figure, uirevision: str) -> go.Figure:
    """The layout of a two-row grid of live panels (the Run tab's dashboard, preference and GRPO curves):
    a legend below, the user's zoom kept under `uirevision` while the data grows."""
    fig.update_layout(
        template=TEMPLATE,
        height=2 * HEIGHT - 60,
        font={"family": FONT_FAMILY, "size": 12},
        margin={"l": 56, "r": 24, "t": 48 + TOOLBAR_PX // 2, "b": 72},
        showlegend=True,
        legend={"orientation": "h", "x": 0.0, "y": -0.1, "yanchor": "top"},
        hovermode="x unified",
        uirevision=uirevision,
    )
    return fig


def run_dashboard_figure(
    step: Sequence[float] = (),
    loss: Sequence[float] = (),
    smoothed: Sequence[float] = (),
    learning_rate: Sequence[float] = (),
    tokens_per_second: Sequence[float] = (),
    memory_gib: Sequence[float] = (),
    *,
    eval_step: Sequence[float] = (),
    eval_loss: Sequence[float] = (),
    max_steps: int | None = None,
    memory_kind: str | None = None,
) -> go.Figure:
    """A run at a glance, built from plain arrays (a live plot sets the traces' data afterwards).

    Four panels: loss (raw, smoothed and eval), learning rate, trained tokens/s and peak memory (GiB,
    labelled by `memory_label` of `memory_kind`; None: what a run on this machine measures,
    `memory_kind_here`). Traces follow `DASHBOARD_TRACES`; every array of a panel is indexed by `step`
    (`eval_loss` by `eval_step`). `max_steps` pins the x axes to the whole run.
    """
    label = memory_label(memory_kind_here() if memory_kind is None else memory_kind)
    fig = make_subplots(
        rows=2,
        cols=2,
        subplot_titles=("Loss", "Learning rate", "Trained tokens / s", f"{label} (GiB)"),
        horizontal_spacing=0.09,
        vertical_spacing=0.16,
    )
    line = {"mode": "lines", "hoverlabel": {"namelength": -1}}
    fig.add_trace(
        go.Scatter(x=step, y=loss, name="loss", line={"color": _BLUE_FAINT, "width": 1}, **line), row=1, col=1
    )
    fig.add_trace(
        go.Scatter(x=step, y=smoothed, name="loss (smoothed)", line={"color": _BLUE, "width": 2.5}, **line),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=eval_step,
            y=eval_loss,
            name="eval loss",
            mode="lines+markers",
            marker={"color": _RED, "size": 8, "symbol": "diamond"},
            line={"color": _RED, "width": 1, "dash": "dot"},
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=step, y=learning_rate, name="learning rate", line={"color": _ORANGE, "width": 2}, **line
        ),
        row=1,
        col=2,
    )
    fig.add_trace(
        go.Scatter(
            x=step, y=tokens_per_second, name="trained tokens/s", line={"color": _GREEN, "width": 1.5}, **line
        ),
        row=2,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=step, y=memory_gib, name="memory", line={"color": _PURPLE, "width": 2, "shape": "hv"}, **line
        ),
        row=2,
        col=2,
    )
    grid_layout(fig, "run")
    fig.update_yaxes(exponentformat="e", row=1, col=1)  # a loss near 0 reads 2e-12, not "2p"
    fig.update_yaxes(tickformat=".1e", rangemode="tozero", row=1, col=2)
    fig.update_yaxes(rangemode="tozero", row=2, col=1)
    fig.update_yaxes(rangemode="tozero", row=2, col=2)
    if max_steps:
        fig.update_xaxes(range=[0, max_steps])
    return fig
