"""What the panels show besides controls: errors with their fix, status lines, generated code, figures.

Errors are never raised into the notebook: a panel catches them and puts `error_html` in its
error area. fastft's errors already name the input and the fix; for anything else the type and
message are shown as they are.
"""

from __future__ import annotations

import html
import sys
from collections.abc import Iterable, Mapping

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
]

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
    import ipywidgets as widgets

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
