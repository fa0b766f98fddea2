"""`studio()`: the five panels as tabs (Model, Data, VRAM, Run, Export) over one `StudioState`.

Calling ``fastft.studio()`` again in the same kernel keeps what the last studio loaded (its state:
model, rows, packed bins, run) and closes the last studio's widgets, so a re-run cell never loads a
second model beside the first; ``fastft.studio(fresh=True)`` starts from nothing.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import ipywidgets as widgets

from fastft.studio.notices import close_tree, error_html, in_kernel
from fastft.studio.state import StudioState

# Function-local imports: IPython exists only in a notebook.

__all__ = ["TABS", "Studio", "studio"]

# Tab title, attribute on `Studio`, module, class.
TABS = (
    ("Model", "model", "fastft.studio.model", "ModelPanel"),
    ("Data", "data", "fastft.studio.data", "DataPanel"),
    ("VRAM", "vram", "fastft.studio.vram", "VramPanel"),
    ("Run", "run", "fastft.studio.run", "RunPanel"),
    ("Export", "export", "fastft.studio.export", "ExportPanel"),
)

# The last studio made in this process (a strong reference: re-running the cell finds its state).
_last: Studio | None = None


class Studio:
    """The panels as tabs over one shared `StudioState`.

    ``studio.model``, ``.data``, ``.vram``, ``.run``, ``.export`` are the panels (None for one that
    could not be built: its tab then says why); ``.tabs`` is the `Tab` widget, ``.widget`` the whole
    studio. Each panel's ``.code()`` gives its steps as plain Python (the Run panel's covers every step).
    """

    def __init__(self, state: StudioState | None = None):
        self.state = state if state is not None else StudioState()
        self.panels: dict[str, object] = {}
        self.problems: dict[str, str] = {}
        children = []
        for title, attribute, module, name in TABS:
            panel, problem = _build(module, name, self.state)
            setattr(self, attribute, panel)
            if panel is not None:
                self.panels[title] = panel
                children.append(panel.widget)
            else:
                self.problems[title] = problem
                children.append(widgets.HTML(error_html(problem, f"The {title} panel is not available")))
        self.tabs = widgets.Tab(children=children)
        for index, (title, *_rest) in enumerate(TABS):
            self.tabs.set_title(index, title)
        header = widgets.HTML(
            '<div style="font-size:15px;margin:2px 0 6px 0"><b>fastft studio</b>: '
            "pick a model → pack data → check VRAM → run → export. "
            "Each panel's <i>Python</i> section shows the same steps as code.</div>"
        )
        self.widget = widgets.VBox([header, self.tabs])
        self._shown_at: int | None = None

    def close(self) -> None:
        """Close every panel's widgets and stop them reacting to the state (the state is kept)."""
        for panel in self.panels.values():
            closer = getattr(panel, "close", None)
            if closer is not None:
                closer()
            else:
                self.state.unobserve(owner=panel)
                close_tree(panel.widget)
        close_tree(self.widget)

    def display(self) -> None:
        """Show the studio in the notebook (once per cell, however it is asked for)."""
        from IPython import get_ipython
        from IPython.display import display

        shell = get_ipython()
        count = getattr(shell, "execution_count", None)
        if count is not None and count == self._shown_at:
            return
        self._shown_at = count
        display(self.widget)

    def _ipython_display_(self) -> None:
        self.display()

    def __repr__(self) -> str:
        tabs = ", ".join(title if title in self.panels else f"{title} (unavailable)" for title, *_ in TABS)
        return f"Studio({tabs}; model={self.state.model_name!r}, data={self.state.dataset_name!r})"


def _build(module: str, name: str, state: StudioState):
    """(panel, None), or (None, why it could not be built) without stopping the other tabs."""
    try:
        cls = getattr(importlib.import_module(module), name)
        return cls(state), None
    except Exception as error:  # noqa: BLE001 - one broken panel must not take the studio down
        return None, f"{type(error).__name__}: {error}"


def studio(
    state: StudioState | None = None, *, fresh: bool = False, display: bool = True, run: str | None = None
) -> Studio:
    """Show the studio (Model, Data, VRAM, Run and Export tabs) and return it.

    `state`: the `StudioState` to share (default: the last studio's in this kernel, so a re-run cell
    keeps the loaded model and data; its old widgets are closed). `fresh=True` starts a new state.
    `display`: show it now when running in a notebook (a `Studio` left as a cell's last value is
    shown once, not twice). `run`: the folder of a run the studio started in a child process
    (``"runs/studio"``): the Run tab follows it, live while it trains (after a kernel restart, or from a
    second notebook). Without it, a studio opened with no run follows the newest run still training in the
    runs folder.
    """
    global _last
    previous = _last
    if state is None and not fresh and previous is not None:
        state = previous.state
    state = state if state is not None else StudioState()
    if run is not None:
        from fastft.studio.process_run import ProcessRun

        current = getattr(state.run, "folder", None)
        if current is None or Path(current).resolve() != Path(run).expanduser().resolve():
            state.run = ProcessRun.attach(run)  # its errors name the folder and the fix
    if previous is not None and previous.state is state:
        previous.close()
    result = Studio(state)
    _last = result
    if display and in_kernel():
        result.display()
    return result
