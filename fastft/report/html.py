"""A training run as one self-contained HTML page (plotly.js inlined once, no network needed).

`RunReport` holds the run's data, `render_report` turns it into a page, `write_report` writes the
page atomically together with a ``report.json`` from which `RunReport.from_json` reloads the run.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from fastft.atomic import write_text_atomically
from fastft.report.figures import (
    accuracy_figure,
    learning_rate_figure,
    loss_figure,
    phases_figure,
    throughput_figure,
    timeline_figure,
)
from fastft.training.events import EvalEvent, StepEvent
from fastft.training.timing import phase_table

__all__ = ["JSON_NAME", "RunReport", "render_report", "write_report"]

JSON_NAME = "report.json"
FORMAT = "fastft.report/1"
SAMPLE_COLUMNS = ("prompt", "expected", "before", "after")


def _now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def _known(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass
class RunReport:
    """Everything the report page shows about one training run.

    `config` is the run configuration (nested dicts are shown flattened with dotted keys),
    `summary` the headline facts (model, device, duration_s, final_loss, trainable parameters...),
    `samples` a list of dicts with keys ``prompt``, ``expected``, ``before`` and ``after``
    (completions before/after training), `created` an ISO-8601 time (default: now, local zone).
    `accuracy_before`/`accuracy_after` map each task (and "all") to its share of right answers; when
    `format_before`/`format_after` are given too, the first pair is content accuracy (the right answer in
    any wording) and these are format compliance (the answer in the requested form), drawn apart.
    `timeline` holds the spans of one profiled step (dicts with the fields of
    `fastft.profile.PhaseSpan`) and `kernels` the rows of a profiling window's top kernels (dicts
    with the fields of `fastft.profile.KernelRow`); both feed the step-timing section.
    """

    title: str
    config: dict = field(default_factory=dict)
    steps: list[StepEvent] = field(default_factory=list)
    evals: list[EvalEvent] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    accuracy_before: dict[str, float] | None = None
    accuracy_after: dict[str, float] | None = None
    format_before: dict[str, float] | None = None
    format_after: dict[str, float] | None = None
    samples: list[dict] = field(default_factory=list)
    timeline: list[dict] = field(default_factory=list)
    kernels: list[dict] = field(default_factory=list)
    created: str = field(default_factory=_now)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data: the fields, with events as plain dicts, plus a ``format`` tag."""
        return {
            "format": FORMAT,
            "title": self.title,
            "created": self.created,
            "summary": self.summary,
            "config": self.config,
            "accuracy_before": self.accuracy_before,
            "accuracy_after": self.accuracy_after,
            "format_before": self.format_before,
            "format_after": self.format_after,
            "samples": self.samples,
            "timeline": self.timeline,
            "kernels": self.kernels,
            "steps": [s.as_dict() for s in self.steps],
            "evals": [e.as_dict() for e in self.evals],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunReport:
        """Inverse of `to_dict` (unknown keys, including those of events, are ignored)."""
        kwargs = _known(cls, data)
        kwargs["steps"] = [
            s if isinstance(s, StepEvent) else StepEvent(**_known(StepEvent, s))
            for s in data.get("steps", [])
        ]
        kwargs["evals"] = [
            e if isinstance(e, EvalEvent) else EvalEvent(**_known(EvalEvent, e))
            for e in data.get("evals", [])
        ]
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> RunReport:
        """Read a report saved by `write_report`: the ``report.json`` itself, its folder or the HTML page."""
        path = Path(path)
        if path.is_dir():
            path = path / JSON_NAME
        elif path.suffix.lower() in {".html", ".htm"}:
            path = path.with_name(JSON_NAME)
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))


# ---------------------------------------------------------------------------------------------- rendering

_CSS = """
:root { --fg: #1d2430; --muted: #6b7686; --line: #e3e7ed; --bg: #f5f6f8; --card: #fff; --accent: #1f6fb4; }
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--fg);
  font: 14px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; }
main { max-width: 1200px; margin: 0 auto; padding: 24px 20px 48px; }
header h1 { margin: 0 0 2px; font-size: 24px; font-weight: 650; overflow-wrap: anywhere; }
header .meta { color: var(--muted); font-size: 13px; }
h2 { font-size: 16px; font-weight: 600; margin: 0 0 10px; }
section.card { background: var(--card); border: 1px solid var(--line); border-radius: 10px;
  padding: 16px 18px; margin-top: 18px; box-shadow: 0 1px 2px rgba(16, 24, 40, .04); }
.figs { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(100%, 480px), 1fr));
  gap: 18px; margin-top: 18px; }
.figs > .card { margin-top: 0; padding: 8px; min-width: 0; }
.figs > .wide { grid-column: 1 / -1; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { text-align: left; vertical-align: top; padding: 6px 10px; border-bottom: 1px solid var(--line); }
th { font-weight: 600; color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .03em; }
table.kv th { width: 32%; text-transform: none; letter-spacing: 0; font-size: 13px; color: var(--fg);
  font-weight: 500; }
table.kv td, table.samples td { overflow-wrap: anywhere; }
table.timing .num { text-align: right; }
table.samples td { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px; }
table.samples .cell { white-space: pre-wrap; max-height: 14em; overflow: auto; }
tbody tr:nth-child(even) { background: #fafbfc; }
.muted { color: var(--muted); }
.scroll { overflow-x: auto; }
footer { color: var(--muted); font-size: 12px; margin-top: 28px; text-align: center; }
@media print { body { background: #fff; } section.card { box-shadow: none; break-inside: avoid; } }
"""

_PLOTLY_CONFIG = {"displaylogo": False, "responsive": True}


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any) -> str:
    """A value as escaped, compact text for a table cell."""
    if value is None:
        return '<span class="muted">&mdash;</span>'
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value == 0:
            return "0"
        if abs(value) >= 10_000:
            return f"{value:,.1f}"
        if abs(value) < 1e-3:
            return f"{value:.3e}"
        return f"{value:.4g}"
    if isinstance(value, (dict, list, tuple)):
        return _esc(json.dumps(value, default=str, ensure_ascii=False))
    return _esc(value)


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _kv_table(data: Mapping[str, Any]) -> str:
    rows = "".join(f"<tr><th>{_esc(k)}</th><td>{_fmt(v)}</td></tr>" for k, v in data.items())
    return f'<table class="kv"><tbody>{rows}</tbody></table>'


def _samples_table(samples: list[dict]) -> str:
    columns = list(SAMPLE_COLUMNS)
    for sample in samples:
        columns.extend(k for k in sample if k not in columns)
    head = "".join(f"<th>{_esc(c)}</th>" for c in columns)
    body = []
    for sample in samples:
        cells = []
        for column in columns:
            value = sample.get(column)
            text = _fmt(None) if value is None else _esc(value)
            cells.append(f'<td><div class="cell">{text}</div></td>')
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f'<table class="samples"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _figure_div(fig: go.Figure, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=_PLOTLY_CONFIG)


def _card(title: str, body: str) -> str:
    return f'<section class="card"><h2>{_esc(title)}</h2>{body}</section>'


def _table(columns: list[str], rows: list[list[str]], numbers_from: int) -> str:
    """A table of already formatted cells; columns from index `numbers_from` on are right-aligned numbers."""

    def cls(i: int) -> str:
        return ' class="num"' if i >= numbers_from else ""

    head = "".join(f"<th{cls(i)}>{_esc(c)}</th>" for i, c in enumerate(columns))
    body = "".join(
        "<tr>" + "".join(f"<td{cls(i)}>{_esc(c)}</td>" for i, c in enumerate(row)) + "</tr>" for row in rows
    )
    return f'<table class="timing"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _timing_parts(report: RunReport) -> list[str]:
    """The step-timing section: phases across steps, one step's timeline, median per phase, top kernels."""
    timed = [s for s in report.steps if s.phases]
    if not timed and not report.timeline and not report.kernels:
        return []
    figures = []
    if timed:
        figures.append(("fig-phases", phases_figure([s.step for s in timed], [s.phases for s in timed])))
    if report.timeline:
        figures.append(("fig-timeline", timeline_figure(report.timeline)))
    parts = []
    if timed:
        table = phase_table([s.phases for s in (timed[1:] if len(timed) > 1 else timed)])  # step 1 warms up
        note = (
            '<p class="muted">Median over steps (the first left out), in milliseconds; nested phases are '
            "inside the one named in the second column. <code>layers.*</code> sums every decoder layer; "
            "<code>layers.recompute</code> is activation checkpointing running the layers again in backward."
            "</p>"
        )
        parts.append(_card("Step timing", note + _table(table.columns, table.cells(), 2)))
    if figures:
        parts.append(
            '<div class="figs">'
            + "".join(
                f'<section class="card wide">{_figure_div(fig, div_id)}</section>' for div_id, fig in figures
            )
            + "</div>"
        )
    if report.kernels:
        rows = [
            [str(k.get("name")), str(k.get("calls")), f"{float(k.get('total_ms', 0.0)):,.3f}",
             f"{float(k.get('share', 0.0)):.1%}"]
            for k in report.kernels
        ]  # fmt: skip
        parts.append(
            _card("Top kernels (profiling window)", _table(["kernel", "calls", "total ms", "share"], rows, 1))
        )
    return parts


def render_report(report: RunReport) -> str:
    """The report as one self-contained HTML page (plotly.js inlined once; loads nothing from the network).

    Sections: title, summary table, figures (loss, throughput/memory, learning rate, and accuracy
    when either accuracy mapping is given), step timing (when the steps carry phases, or a timeline
    or kernels are given), configuration table, sample completions. Every string
    that comes from the report is HTML-escaped.
    """
    figures = [
        ("fig-loss", loss_figure(report.steps, report.evals), True),
        ("fig-throughput", throughput_figure(report.steps), False),
        ("fig-lr", learning_rate_figure(report.steps), False),
    ]
    if report.accuracy_before or report.accuracy_after:
        content = report.format_before or report.format_after
        title = "Content accuracy per task (right answer, any wording)" if content else "Accuracy per task"
        figures.append(
            (
                "fig-accuracy",
                accuracy_figure(report.accuracy_before, report.accuracy_after, title=title),
                True,
            )
        )
    if report.format_before or report.format_after:
        title = "Format compliance per task (the bare answer the prompt asks for)"
        figures.append(
            ("fig-format", accuracy_figure(report.format_before, report.format_after, title=title), True)
        )
    fig_html = "".join(
        f'<section class="card{" wide" if wide else ""}">{_figure_div(fig, div_id)}</section>'
        for div_id, fig, wide in figures
    )

    parts = [
        f'<header><h1>{_esc(report.title)}</h1><div class="meta">created {_esc(report.created)}'
        f" &middot; {len(report.steps)} steps &middot; {len(report.evals)} evaluations</div></header>"
    ]
    if report.summary:
        parts.append(_card("Summary", _kv_table(report.summary)))
    parts.append(f'<div class="figs">{fig_html}</div>')
    parts.extend(_timing_parts(report))
    if report.config:
        parts.append(_card("Configuration", _kv_table(_flatten(report.config))))
    if report.samples:
        parts.append(
            _card(
                f"Samples before and after training ({len(report.samples)})",
                f'<div class="scroll">{_samples_table(report.samples)}</div>',
            )
        )
    parts.append("<footer>fastft report</footer>")

    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<meta name="generator" content="fastft">\n'
        f"<title>{_esc(report.title)}</title>\n"
        f"<style>{_CSS}</style>\n"
        "<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>\n"
        f'<script type="text/javascript">{get_plotlyjs()}</script>\n'
        "</head>\n<body>\n<main>\n" + "\n".join(parts) + "\n</main>\n</body>\n</html>\n"
    )


# ---------------------------------------------------------------------------------------------- writing


def write_report(report: RunReport, path: str | os.PathLike[str]) -> Path:
    """Write the HTML page to `path` and the report's data to ``report.json`` in the same folder.

    Parent folders are created; both files are written atomically (temp file in the same folder,
    then `os.replace`), so a reader never sees a half-written file. If `path` is an existing folder
    the page is written as ``report.html`` inside it. Values in `config`/`summary`/`samples` that
    JSON cannot hold are stored as their ``str()``. Returns the page's path.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "report.html"
    if path.name == JSON_NAME:
        raise ValueError(f"the HTML page cannot be named {JSON_NAME!r}: that is the data file beside it")
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(report.to_dict(), indent=1, default=str, ensure_ascii=False)
    page = render_report(report)
    write_text_atomically(path.with_name(JSON_NAME), data + "\n")
    write_text_atomically(path, page)
    return path
