"""Live plots for the studio: bounded float32 series, a throttle, and a figure that updates in place.

Three ways to show a figure that changes while a run trains (`frontend` picks one):

- ``"widget"``: a plotly ``FigureWidget`` whose traces are updated in place (JupyterLab 4, Notebook 7,
  VS Code, Voila: wherever custom widgets render);
- ``"display"``: where they do not (Colab, Kaggle: found from their environment variables, never by
  importing ``google.colab``), an ``ipywidgets.Output`` whose content is replaced by the figure as the
  notebook's plotly renderer draws it, at most every `DISPLAY_INTERVAL` seconds (each update resends
  the whole figure);
- ``"text"``: no kernel (a script, a test): nothing is drawn; the figure object is still kept up to date.

A run of 10,000 steps must not slow the browser: `SeriesBuffer` keeps at most `max_points` points,
dropping every other one whenever it fills, so the whole run stays visible at a uniform spacing.
Updates are throttled by the caller (`Ticker`, a few per second).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

MODES = ("widget", "display", "text")
WIDGET_INTERVAL = 0.5  # seconds between updates of a FigureWidget (cheap: only changed arrays are sent)
DISPLAY_INTERVAL = 2.0  # seconds between re-renders of a whole figure in the display fallback
_COLAB = ("COLAB_RELEASE_TAG", "COLAB_BACKEND_VERSION")
_KAGGLE = ("KAGGLE_KERNEL_RUN_TYPE", "KAGGLE_URL_BASE")


def frontend(env: Mapping[str, str] | None = None, kernel: bool | None = None) -> str:
    """How live figures are shown here: "widget", "display" or "text" (see the module docstring).

    ``FASTFT_LIVE=widget|display|text`` overrides the guess (e.g. ``widget`` on Colab after
    ``google.colab.output.enable_custom_widget_manager()``).
    """
    env = os.environ if env is None else env
    forced = env.get("FASTFT_LIVE", "").strip().lower()
    if forced in MODES:
        return forced
    if kernel is None:
        from fastft.studio.notices import in_kernel

        kernel = in_kernel()
    if not kernel:
        return "text"
    if any(env.get(name) for name in (*_COLAB, *_KAGGLE)):
        return "display"
    return "widget"


class SeriesBuffer:
    """Columns of float32 numbers sharing one x, bounded in length for plotting.

    ``append(step, loss=…, lr=…)`` adds a row. Rows are kept at a uniform stride over the whole run:
    when `max_points` rows are held, every other one is dropped and the stride doubles, so the buffer
    always spans the run from its first row, with between ``max_points/2`` and `max_points` rows.
    The newest row is always there (held provisionally until the next one replaces it, when it falls
    between two strides). `count` is the number of rows ever appended; `stride` the current spacing.
    Values are sampled, not averaged: smooth a curve before it goes in (the run panel's EMA does).
    """

    def __init__(self, columns: Sequence[str], max_points: int = 2000):
        if max_points < 8:
            raise ValueError(f"max_points must be at least 8, got {max_points}.")
        self.columns = ("x", *columns)
        self.max_points = int(max_points)
        self._data = np.zeros((len(self.columns), self.max_points), dtype=np.float32)
        self._size = 0
        self._provisional = False
        self.count = 0
        self.stride = 1

    def __len__(self) -> int:
        return self._size

    def append(self, x: float, **values: float) -> None:
        if self._provisional:  # the last row fell between strides: the new one takes its place
            self._size -= 1
        if self._size == self.max_points:
            kept = self._data[:, : self._size : 2]
            n = kept.shape[1]
            self._data[:, :n] = kept
            self._size, self.stride = n, self.stride * 2
        row = self._data[:, self._size]
        row[0] = x
        for i, name in enumerate(self.columns[1:], start=1):
            row[i] = values.get(name, np.nan)
        self._size += 1
        self._provisional = self.count % self.stride != 0
        self.count += 1

    def column(self, name: str) -> np.ndarray:
        """A copy of one column's rows (float32), safe to hand to a plot."""
        return self._data[self.columns.index(name), : self._size].copy()

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: self.column(name) for name in self.columns}

    def clear(self) -> None:
        self._size, self._provisional, self.count, self.stride = 0, False, 0, 1


class Ema:
    """Exponential moving average with bias correction, one value at a time (as `report.figures.smooth`)."""

    def __init__(self, smoothing: float = 0.9):
        self.smoothing = smoothing
        self._ema = 0.0
        self._n = 0

    def __call__(self, value: float) -> float:
        if not np.isfinite(value):
            return float(value)
        self._n += 1
        self._ema = self.smoothing * self._ema + (1.0 - self.smoothing) * float(value)
        return self._ema / (1.0 - self.smoothing**self._n)


class Ticker:
    """Calls `callback` every `interval` seconds on a daemon thread until `stop()`.

    The callback's exceptions are kept in `errors` (the last few) rather than killing the thread:
    a plot that failed once must not stop the next update.
    """

    def __init__(
        self, callback: Callable[[], None], interval: float = WIDGET_INTERVAL, name: str = "fastft-ticker"
    ):
        self.callback = callback
        self.interval = interval
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> Ticker:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.callback()
            except Exception as error:  # noqa: BLE001 - shown by the owner, never fatal here
                self.errors = [*self.errors[-4:], error]

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class LiveFigure:
    """A plotly figure shown once and then updated in place, the way this frontend allows.

    `figure` is the figure being updated (a ``FigureWidget`` in "widget" mode, else a plain
    ``go.Figure``); `widget` is what to put in a panel (the FigureWidget, an ``Output``, or an empty
    ``HTML`` in "text" mode). `set_data` changes some traces' x/y (cheap, throttled by the caller);
    `replace` swaps in a whole new figure. In "display" mode the render is throttled here to at most
    one per `DISPLAY_INTERVAL` seconds; `flush()` forces the last one out.
    """

    def __init__(self, figure, mode: str | None = None):
        import ipywidgets as widgets
        import plotly.graph_objects as go

        self.mode = mode or frontend()
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: use one of {MODES}.")
        self._lock = threading.RLock()
        self._last_render = 0.0
        self._dirty = False
        if self.mode == "widget":
            try:
                self.figure = go.FigureWidget(figure)
            except Exception:  # noqa: BLE001 - FigureWidget needs anywidget (plotly ≥ 6); fall back
                self.mode = "display"
        if self.mode == "widget":
            self.widget = self.figure
        else:
            self.figure = go.Figure(figure)
            self.widget = widgets.Output() if self.mode == "display" else widgets.HTML("")
            if self.mode == "display":
                self._render(force=True)

    def set_data(self, traces: Mapping[int, tuple[Sequence[float], Sequence[float]]], **layout) -> None:
        """Set the x/y arrays of traces by index (and optional layout properties) in one update."""
        with self._lock:
            if self.mode == "widget":
                with self.figure.batch_update():
                    self._assign(traces, layout)
            else:
                self._assign(traces, layout)
                self._dirty = True
                self._render()

    def _assign(self, traces, layout) -> None:
        for index, (x, y) in traces.items():
            trace = self.figure.data[index]
            trace.x, trace.y = x, y
        if layout:
            self.figure.update_layout(**layout)

    def replace(self, figure) -> None:
        """Show another figure in the same place (traces and layout replaced)."""
        with self._lock:
            if self.mode == "widget":
                with self.figure.batch_update():
                    self.figure.data = ()
                    self.figure.add_traces(list(figure.data))
                    self.figure.layout = figure.layout
            else:
                import plotly.graph_objects as go

                self.figure = go.Figure(figure)
                self._dirty = True
                self._render()

    def flush(self) -> None:
        """Draw any update the display throttle held back."""
        with self._lock:
            if self.mode == "display" and self._dirty:
                self._render(force=True)

    def _render(self, force: bool = False) -> None:
        if self.mode != "display":
            return
        now = time.monotonic()
        if not force and now - self._last_render < DISPLAY_INTERVAL:
            return
        self._last_render, self._dirty = now, False
        self.widget.outputs = (
            {"output_type": "display_data", "data": mime_bundle(self.figure), "metadata": {}},
        )


def mime_bundle(figure) -> dict:
    """The figure as the notebook's plotly renderer draws it (Colab's, Kaggle's, …); HTML otherwise."""
    try:
        bundle = figure._repr_mimebundle_(include=None, exclude=None)
    except Exception:  # noqa: BLE001 - no renderer for this frontend
        bundle = None
    if bundle:
        return bundle
    import plotly.io as pio

    return {
        "text/html": pio.to_html(figure, include_plotlyjs="cdn", full_html=False),
        "text/plain": f"<plotly figure: {len(figure.data)} traces>",
    }
