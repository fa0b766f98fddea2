"""What the panels show besides controls: errors with their fix, status lines, generated code, figures.

Errors are never raised into the notebook: a panel catches them and puts `error_html` in its
error area. fastft's errors already name the input and the fix; for anything else the type and
message are shown as they are.
"""

from __future__ import annotations

import html
import sys
import time
from collections.abc import Iterable, Mapping

import ipywidgets as widgets

# Function-local imports: IPython exists only in a notebook.

__all__ = [
    "call_code",
    "close_tree",
    "code_html",
    "error_html",
    "facts_table",
    "in_kernel",
    "py_repr",
    "show_figure",
    "status_html",
    "StatusLog",
    "button",
    "field",
    "row",
]

LABEL_STYLE = {"description_width": "9em"}  # in em: labels scale with the font, not the screen

_ERROR_STYLE = (
    "border-left:4px solid #d62728;background:#fdf0f0;padding:6px 10px;margin:4px 0;"
    "white-space:pre-wrap;font-size:13px;line-height:1.4"
)
_STATUS_COLORS = {"info": "#1f6fb4", "ok": "#2a9d5c", "warn": "#b7791f", "busy": "#7a8594"}


def error_html(error: BaseException | str, title: str | None = None) -> str:
    """An error as a red box: its type (or `title`) in bold, then the message (which holds the fix)."""
    if isinstance(error, BaseException):
        name = title or type(error).__name__
        message = str(error) or repr(error)
        if isinstance(error, KeyError) and message.startswith(("'", '"')):  # KeyError quotes its message
            message = message[1:-1]
    else:
        name, message = title or "Error", error
    return f'<div style="{_ERROR_STYLE}"><b>{html.escape(name)}</b>: {html.escape(message)}</div>'


def status_html(text: str, kind: str = "info", *, raw: bool = False) -> str:
    """A one-line status; `kind` is "info", "ok", "warn" or "busy". `raw`: `text` is already HTML."""
    body = text if raw else html.escape(text)
    color = _STATUS_COLORS.get(kind, _STATUS_COLORS["info"])
    marker = {"ok": "✓ ", "warn": "⚠ ", "busy": "⏳ "}.get(kind, "")
    return f'<div style="color:{color};font-size:13px;margin:2px 0">{marker}{body}</div>'


def code_html(code: str) -> str:
    """Generated Python in a copyable block."""
    return (
        '<pre style="background:#f6f8fa;border:1px solid #e1e4e8;border-radius:4px;padding:8px;'
        f'font-size:12px;white-space:pre;overflow-x:auto;user-select:text">{html.escape(code)}</pre>'
    )


def facts_table(rows: Iterable[tuple[str, str]]) -> str:
    """Label/value pairs as a small two-column table (labels grey, values plain)."""
    cells = "".join(
        f'<tr><td style="color:#7a8594;padding:1px 12px 1px 0;vertical-align:top">{html.escape(k)}</td>'
        f'<td style="padding:1px 0">{html.escape(v)}</td></tr>'
        for k, v in rows
    )
    return f'<table style="font-size:13px;border-collapse:collapse">{cells}</table>'


def call_code(target: str, function: str, args: Iterable[str] = (), kwargs: Mapping[str, object] = ()) -> str:
    """``target = function(args..., key=repr(value)...)``, on one line when it fits in 100 characters,
    else one argument per line."""
    parts = [*args, *(f"{key}={py_repr(value)}" for key, value in dict(kwargs).items())]
    head = f"{target} = {function}(" if target else f"{function}("
    line = head + ", ".join(parts) + ")"
    if len(line) <= 100:
        return line
    return head + "\n" + "".join(f"    {part},\n" for part in parts) + ")"


def py_repr(value: object) -> str:
    """`repr` as a person writes Python: strings in double quotes (lists and tuples of them too)."""
    if isinstance(value, str) and '"' not in value and "\\" not in value and value.isprintable():
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(py_repr(v) for v in value) + "]"
    return repr(value)


def in_kernel() -> bool:
    """Whether a Jupyter kernel (not a plain interpreter or pytest) is running this code."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def show_figure(output, figure) -> None:
    """Replace what the `Output` widget shows with the plotly `figure`.

    Headless (no kernel, e.g. tests and scripts) nothing is drawn: the figure is kept by the panel.
    In a notebook plotly's renderer for that front end (JupyterLab's mime type, Colab's or Kaggle's
    HTML) draws a static figure, which needs no custom-widget support.
    """
    if not in_kernel():
        return
    from IPython.display import display

    output.clear_output(wait=True)
    with output:
        display(figure)


def close_tree(widget) -> None:
    """Close `widget` and every widget below it (a container's ``close`` leaves its children open)."""
    for child in getattr(widget, "children", ()) or ():
        close_tree(child)
    widget.close()


def code_section(view) -> object:
    """A closed accordion titled "Python: the same steps as code" around the HTML widget `view`."""

    section = widgets.Accordion(children=[view])
    section.set_title(0, "Python: the same steps as code")
    section.selected_index = None
    return section


class Panel:
    """What every studio panel shares: it displays its `widget`, and `close` stops it following the shared
    `state` and closes its widgets. A panel sets ``self.state`` and ``self.widget``."""

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def close(self) -> None:
        """Stop following the shared state and close the panel's widgets."""
        self.state.unobserve(owner=self)
        close_tree(self.widget)


# ------------------------------------------------------------------------------------------------ layout
# No fixed pixel widths: controls grow and shrink between a minimum (in em, so a label and a few digits
# always fit) and the panel's width, rows wrap on a narrow notebook, and buttons are as wide as their text.


def field(basis: str = "18em", *, grow: int = 1, max_width: str | None = "40em"):
    """A control's `Layout` in a `row`: starts at `basis` wide, grows to fill the row (up to `max_width`), wraps
    below. Only for a row's children: in a column the flex basis would be the control's height."""

    return widgets.Layout(
        flex=f"{grow} 1 {basis}", width="auto", min_width=f"min({basis}, 100%)", max_width=max_width
    )


def button(**kwargs):
    """A `Button` whose width follows its text (never truncated), keeping its row's height."""

    return widgets.Button(
        layout=widgets.Layout(width="auto", min_width="fit-content", flex="0 0 auto"), **kwargs
    )


def row(children, **layout):
    """An `HBox` that wraps its children onto the next line when the panel is narrow."""

    return widgets.HBox(
        list(children),
        layout=widgets.Layout(flex_flow="row wrap", align_items="center", width="100%", **layout),
    )


class StatusLog:
    """The last few messages of a panel, newest first, each with the time it was said: a new message
    never hides the one before (a warning stays readable under the "done" that follows it).

    `widget` is the HTML widget; `say(text, kind)` adds a line ("info", "ok", "warn", "busy", "error");
    `clear()` empties it. A "busy" line is replaced by the next message, since it only says "working".
    """

    def __init__(self, keep: int = 4):
        self.keep = keep
        self.widget = widgets.HTML("")
        self.lines: list[tuple[str, str, str, str | None]] = []  # (time, kind, text, title)

    def say(self, text: str, kind: str = "info", title: str | None = None) -> None:
        if not text:
            return
        if self.lines and self.lines[0][1] == "busy":
            self.lines.pop(0)
        self.lines.insert(0, (time.strftime("%H:%M:%S"), kind, text, title))
        del self.lines[self.keep :]
        self._render()

    def clear(self) -> None:
        self.lines = []
        self._render()

    @property
    def latest(self) -> str:
        return self.lines[0][2] if self.lines else ""

    def _render(self) -> None:
        parts = []
        for index, (stamp, kind, text, title) in enumerate(self.lines):
            if kind == "error":
                body = error_html(text, title or "Error")
            else:
                body = status_html(text if title is None else f"{title}: {text}", kind)
            faded = "" if index == 0 else "opacity:0.6;"
            parts.append(
                f'<div style="display:flex;gap:0.6em;align-items:baseline;{faded}">'
                f'<span style="color:#a3acb9;font-size:11px">{stamp}</span><div style="flex:1">{body}</div></div>'
            )
        self.widget.value = "".join(parts)
