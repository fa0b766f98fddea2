"""Live plots for the studio: bounded float32 series, a throttle, and a figure that updates in place.

How a changing figure is shown is decided by what the front end really renders, not by guessing from
environment variables (`frontend` says "auto" in any kernel):

- ``"widget"``: a `fastft.studio.live_plot.LivePlot`, a small custom widget (anywidget) that draws the
  figure's JSON with the one plotly.js the page loads for every plot (`live_plot.library`), and redraws
  it when the figure changes. In "auto" mode each `LiveFigure` starts this way, and the plot itself is
  its render probe: it tells the kernel once the browser has drawn it.
- ``"display"``: when no plot has reported after `PROBE_TIMEOUT` seconds (custom widgets do not render
  here: Colab without its custom widget manager, Kaggle, nbviewer-like front ends), the figure moves to
  an ``ipywidgets.Output`` (a core widget every Jupyter front end draws) whose one display output is
  replaced at most every `DISPLAY_INTERVAL` seconds, only when the data changed, with the front end's
  own plotly renderer (plotly.js itself is not resent: it comes from the page or the CDN). The plot
  stays beside it, hidden; if it reports later, the figure is shown by it again, with the latest data.
- ``"text"``: no kernel (a script, a test): nothing is drawn; the figure object is still kept up to date.

Widget values are only ever set (from any thread); nothing prints into an ``Output`` with ``with
output:`` from a worker thread, which only shows where the kernel's current cell happens to be.

A run of 10,000 steps must not slow the browser: `SeriesBuffer` keeps at most `max_points` points,
dropping every other one whenever it fills, so the whole run stays visible at a uniform spacing.
Updates are throttled by the caller (`Ticker`, about once a second).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import ipywidgets as widgets
import numpy as np
import plotly.graph_objects as go
import plotly.io as pio

from fastft.studio.live_plot import figure_json, live_plot

MODES = ("auto", "widget", "display", "text")
WIDGET_INTERVAL = 1.0  # seconds between updates of the run's plots (the ticker)
DISPLAY_INTERVAL = 2.0  # seconds between re-renders of a whole figure in the display fallback
PROBE_TIMEOUT = 8.0  # seconds a plot has to report that it drew before a figure falls back to "display"
DRAWN_TIMEOUT = 6.0  # seconds a drawn plot has to answer a new figure before it is taken for frozen


def frontend(env: Mapping[str, str] | None = None, kernel: bool | None = None) -> str:
    """How live figures are shown here: "auto" in a kernel, "text" without one (see the module docstring).

    ``FASTFT_LIVE=widget|display|text`` overrides it (e.g. ``display`` where custom widgets are known not
    to render, to skip the probe's wait).
    """
    env = os.environ if env is None else env
    forced = env.get("FASTFT_LIVE", "").strip().lower()
    if forced in MODES:
        return forced
    if kernel is None:
        from fastft.studio.notices import in_kernel

        kernel = in_kernel()
    return "auto" if kernel else "text"


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
    """A plotly figure shown once and then updated in place, the way this front end allows.

    `figure` is the figure being updated (a plain ``go.Figure``, in every mode); `widget` is what to put in
    a panel (a box holding the `LivePlot` or the ``Output``, or an empty ``HTML`` in "text" mode); `plot`
    the `LivePlot` (None without one), which is also the render `probe`; `mode` is the current way
    ("widget", "display" or "text"). `set_data` changes some traces' x/y (cheap); `update_from` takes
    another figure's data, trace by trace when the traces match, else `replace`s the whole figure. The
    display fallback is throttled here to one render per `DISPLAY_INTERVAL` seconds; `flush()` forces
    the last one out.
    """

    def __init__(self, figure, mode: str | None = None, *, probe_timeout: float = PROBE_TIMEOUT):
        requested = mode or frontend()
        if requested not in MODES:
            raise ValueError(f"mode={requested!r}: use one of {MODES}.")
        self.requested = requested
        self._lock = threading.RLock()
        self._last_render = 0.0
        self._dirty = False
        self._output = None
        self._ops = None  # the display fallback's hidden Output for update scripts
        self._shown = None  # what the display fallback's page holds: traces and layout as last sent
        self._sent = None  # what the plot holds: the figure's JSON as last sent
        self._seq = 0
        self._id = f"fastft-live-{uuid.uuid4().hex[:12]}"
        self.last_update = ""  # the last update script sent (display fallback)
        self.plot = None
        self.replaced_plots = 0  # plots found frozen and replaced (`_check_drawn`)
        self._watch = None  # the timer that checks the browser drew the last figure sent
        self.rendered = False  # the plot reported: custom widgets render here
        self.fell_back_at: float | None = None
        self.mode = "text" if requested == "text" else ("display" if requested == "display" else "widget")
        self.figure = go.Figure(figure)
        if self.mode == "text":
            self.widget = widgets.HTML("")
            return
        _fill_width(self.figure)
        # min_width 0 and overflow hidden: a drawn chart must not hold its box wide when the notebook narrows,
        # so the plot's resize sees the new width
        self.widget = widgets.Box(
            layout=widgets.Layout(width="100%", min_width="0", overflow="hidden", flex_flow="column")
        )
        if self.mode == "widget":
            self.plot = live_plot(self.figure, _PLOT_CONFIG)
            if self.plot is None:
                self.mode = "display"
        if self.mode == "widget":
            self._sent = self.plot.figure
            self.widget.children = [self.plot]
            self.plot.observe(self._on_probe, names="rendered")
            if requested == "auto":
                self._arm(probe_timeout)
        else:
            self._show_output()

    @property
    def probe(self):
        """The widget whose ``rendered`` says the browser drew it: the plot itself (None without one)."""
        return self.plot

    # -- choosing the way -------------------------------------------------------------------------------
    def _on_probe(self, change) -> None:
        if not change["new"]:
            return
        with self._lock:
            self.rendered = True
            if self.mode == "display":  # the plot reported late: it shows the figure again, the latest data
                self.mode, self._shown, self._sent = "widget", None, None
                self.plot.layout.display = None
                self._push()
                self.widget.children = [self.plot]
            self._arm_watch()  # it drew, but perhaps not the figures sent since

    def _arm(self, timeout: float) -> None:
        """Start the probe's clock once the cell that made this figure has finished: the browser's report
        is read by the kernel only between cells, so time spent running the cell must not count."""
        shell = None
        try:
            from IPython import get_ipython

            shell = get_ipython() if getattr(get_ipython(), "kernel", None) is not None else None
        except ImportError:
            pass

        def start(*_args) -> None:
            if shell is not None:
                shell.events.unregister("post_run_cell", start)
            timer = threading.Timer(timeout, self._on_timeout)
            timer.daemon = True
            timer.start()

        if shell is None:
            start()
        else:
            shell.events.register("post_run_cell", start)

    def _on_timeout(self) -> None:
        with self._lock:
            if not self.rendered and self.mode == "widget":
                self._fall_back()

    def _fall_back(self) -> None:
        """Custom widgets do not render here (no plot reported): show the figure in a core `Output`. The plot
        stays in the box, hidden, in case the browser draws it after all."""
        self.mode = "display"
        self.fell_back_at = time.monotonic()
        self.plot.layout.display = "none"
        self._show_output()

    def _show_output(self) -> None:
        if self._output is None:
            # no side margins: at 100 % width they would push the chart past the tab's edge
            self._output = widgets.Output(layout=widgets.Layout(width="100%", margin="2px 0"))
            hidden = widgets.Layout(width="0", height="0", overflow="hidden", margin="0")
            self._ops = widgets.Output(layout=hidden)
        self.widget.children = [c for c in (self._output, self._ops, self.plot) if c is not None]
        self._shown = None  # nothing drawn in this output yet: the next render draws the whole figure
        self._dirty = True
        self._render(force=True)

    # -- updates ----------------------------------------------------------------------------------------
    def set_data(self, traces: Mapping[int, tuple[Sequence[float], Sequence[float]]], **layout) -> None:
        """Set the x/y arrays of traces by index (and optional layout properties) in one update."""
        with self._lock:
            self._assign(traces, layout)
            if self.mode == "widget":
                self._push()
            else:
                self._dirty = True
                self._render()

    def _assign(self, traces, layout) -> None:
        for index, (x, y) in traces.items():
            trace = self.figure.data[index]
            trace.x, trace.y = x, y
        if layout:
            self.figure.update_layout(**layout)

    def update_from(self, figure) -> None:
        """Show `figure`'s data: trace by trace when its traces have the same names and types as those shown
        (the display fallback then sends only the new points), else by `replace`."""
        names = [(t.type, t.name) for t in figure.data]
        with self._lock:
            if names != [(t.type, t.name) for t in self.figure.data] or not names:
                self.replace(figure)
                return
            layout = figure.layout
            changes = {
                "title": layout.title,
                "annotations": layout.annotations,
                "shapes": layout.shapes,
                "yaxis": {"range": layout.yaxis.range, "autorange": layout.yaxis.range is None},
            }
            self.set_data({i: (t.x, t.y) for i, t in enumerate(figure.data)}, **changes)

    def replace(self, figure) -> None:
        """Show another figure in the same place (traces and layout replaced)."""

        with self._lock:
            self.figure = go.Figure(figure)
            if self.mode == "text":
                return
            _fill_width(self.figure)
            if self.mode == "widget":
                self._push()
            else:
                self._dirty = True
                self._render()

    def _push(self) -> None:
        """The widget way: send the figure's JSON to the plot when it changed (the browser redraws it with
        ``Plotly.react``, which keeps what did not change), then check that the browser drew it."""

        sent = figure_json(self.figure)
        if sent == self._sent:
            return
        self._sent = sent
        with self.plot.hold_sync():
            self.plot.figure = sent
            self.plot.revision += 1
        self._arm_watch()

    def _arm_watch(self) -> None:
        """Check in `DRAWN_TIMEOUT` seconds that a plot a browser draws has drawn the last figure sent."""
        plot = self.plot
        if self._watch is None and plot is not None and plot.rendered and plot.drawn < plot.revision:
            self._watch = threading.Timer(DRAWN_TIMEOUT, self._check_drawn)
            self._watch.daemon = True
            self._watch.start()

    def _check_drawn(self) -> None:
        """A plot that drew before but has not drawn the figure sent `DRAWN_TIMEOUT` seconds ago no longer
        takes updates in the browser (see `fastft.studio.live_plot`): show a new one, with the latest data."""

        with self._lock:
            self._watch = None
            old = self.plot
            if self.mode != "widget" or not old.rendered or old.drawn >= old.revision:
                return
            plot = live_plot(self.figure, _PLOT_CONFIG)
            if plot is None:
                return
            self.plot, self._sent = plot, plot.figure
            self.replaced_plots += 1
            plot.observe(self._on_probe, names="rendered")
            self.widget.children = [plot]
            old.close()

    def flush(self) -> None:
        """Draw any update the display throttle held back."""
        with self._lock:
            if self.mode == "display" and self._dirty:
                self._render(force=True)

    def _render(self, force: bool = False) -> None:
        """The display fallback: the whole figure once (the front end's own plotly renderer), then only what
        changed, as a small script in a second, hidden `Output` that updates the drawn plot in place."""
        if self.mode != "display" or self._output is None:
            return
        now = time.monotonic()
        if not force and now - self._last_render < DISPLAY_INTERVAL:
            return
        self._last_render, self._dirty = now, False
        figure = self.figure
        figure.layout.meta = self._id  # how the update scripts find the drawn plot, whatever drew it
        traces = [_trace_state(trace) for trace in figure.data]
        layout = {
            key: json.dumps(value, sort_keys=True, default=_jsonable)
            for key, value in _layout_json(figure).items()
        }
        shown = self._shown
        if shown is None:
            # Setting `outputs` replaces the one display output in a single message: no clear, no flicker,
            # and it is safe from any thread (unlike `with output:`). It is drawn once per output.
            bundle = mime_bundle(_plain(figure))
            self._output.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)
            self._shown = {"traces": traces, "layout": layout}
            self._send({"kind": "setup"})
            return
        if [t["rest"] for t in traces] != [t["rest"] for t in shown["traces"]]:
            # other traces or trace styles: the whole figure's data, drawn into the same plot (Plotly.react)
            plain = json.loads(_plain(figure).to_json())
            self._shown = {"traces": traces, "layout": layout}
            self._send({"kind": "react", "data": plain.get("data", []), "layout": plain.get("layout", {})})
            return
        changed = []
        for index, (new, old) in enumerate(zip(traces, shown["traces"], strict=True)):
            start = min(_common_prefix(new["x"], old["x"]), _common_prefix(new["y"], old["y"]))
            if start == len(new["x"]) == len(old["x"]) and start == len(new["y"]) == len(old["y"]):
                continue
            changed.append([index, start, _values(new["x"][start:]), _values(new["y"][start:])])
        relayout = {
            key: json.loads(value) for key, value in layout.items() if shown["layout"].get(key) != value
        }
        relayout.update({key: None for key in shown["layout"] if key not in layout})
        self._shown = {"traces": traces, "layout": layout}
        if changed or relayout:
            self._send({"kind": "update", "traces": changed, "layout": relayout})

    def _send(self, op: dict) -> None:
        self._seq += 1
        script = (
            _UPDATE_JS.replace("__ID__", json.dumps(self._id))
            .replace("__SEQ__", str(self._seq))
            .replace("__OP__", _js(op))
        )
        self.last_update = script
        self._ops.outputs = (
            {
                "output_type": "display_data",
                "data": {"application/javascript": script, "text/plain": ""},
                "metadata": {},
            },
        )


# Runs in the page (an `application/javascript` output of the hidden ops `Output`): finds the plot drawn with
# `layout.meta` = its id, waits for it and for plotly.js (the page's `Plotly`, or require's "plotly" where the
# front end loads it that way: Kaggle, the classic notebook), and applies the operation in order, once per plot
# (`__fastftSeq`: a re-rendered output does not apply it twice). It also keeps the plot at its box's width.
_UPDATE_JS = """(function () {
  const id = __ID__, seq = __SEQ__, op = __OP__;
  const queue = (window.__fastftLive = window.__fastftLive || {});
  const plotly = () => window.Plotly ? Promise.resolve(window.Plotly) : window.require
    ? new Promise((ok, no) => window.require(["plotly"], ok, no)) : Promise.reject(new Error("no plotly.js"));
  const plots = () => [...document.querySelectorAll(".js-plotly-plot")].filter(g => g.layout && g.layout.meta === id);
  const found = () => new Promise((ok, no) => {
    const look = n => { const g = plots(); if (g.length) ok(g); else if (n <= 0) no(new Error("no plot " + id));
      else setTimeout(() => look(n - 1), 100); };
    look(150);
  });
  const resize = () => {
    const shared = (window.__fastftResize = window.__fastftResize || { pending: false });
    if (shared.pending) return;
    shared.pending = true;
    requestAnimationFrame(() => { shared.pending = false; window.dispatchEvent(new Event("resize")); });
  };
  queue[id] = (queue[id] || Promise.resolve()).then(() => Promise.all([plotly(), found()])).then(([P, gds]) => {
    for (const gd of gds) {
      if ((gd.__fastftSeq || 0) >= seq) continue;
      gd.__fastftSeq = seq;
      if (!gd.__fastftObserver && typeof ResizeObserver !== "undefined" && gd.parentElement) {
        let width = -1;
        gd.__fastftObserver = new ResizeObserver(e => {
          const now = Math.round(e[e.length - 1].contentRect.width);
          if (now !== width && now > 0) { width = now; resize(); }
        });
        gd.__fastftObserver.observe(gd.parentElement);
      }
      if (op.kind === "react") { op.layout.meta = id; P.react(gd, op.data, op.layout); }
      else if (op.kind === "update") {
        const x = [], y = [], which = [];
        for (const [i, start, tx, ty] of op.traces) {
          const t = gd.data[i] || {};
          const ox = Array.from(t.x || []), oy = Array.from(t.y || []);
          if (ox.length < start || oy.length < start) continue;  // an update was missed: keep what is drawn
          x.push(ox.slice(0, start).concat(tx)); y.push(oy.slice(0, start).concat(ty)); which.push(i);
        }
        if (which.length || Object.keys(op.layout).length)
          P.update(gd, which.length ? { x, y } : {}, op.layout, which.length ? which : undefined);
      }
    }
  }).catch(error => console.warn("fastft live plot:", error.message));
})();
"""


def _layout_json(figure) -> dict:
    return figure.layout.to_plotly_json()


def _trace_state(trace) -> dict:
    """A trace's x and y as arrays (for the prefix test) and the rest of it as JSON (a style change)."""
    rest = {k: v for k, v in trace.to_plotly_json().items() if k not in ("x", "y")}
    return {
        "x": _array(trace.x),
        "y": _array(trace.y),
        "rest": json.dumps(rest, sort_keys=True, default=_jsonable),
    }


def _jsonable(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def _array(values) -> np.ndarray:
    if values is None:
        return np.zeros(0, dtype=np.float32)
    array = np.asarray(values)
    if array.dtype.kind in "fiub":
        return array.astype(np.float64).round(7) if array.dtype.kind == "f" else array.astype(np.float64)
    return array.astype(object)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading entries `a` and `b` share (NaN equals NaN)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    same = a[:n] == b[:n]
    if a.dtype.kind == "f" and b.dtype.kind == "f":
        same |= np.isnan(a[:n]) & np.isnan(b[:n])
    different = np.flatnonzero(~np.asarray(same, dtype=bool))
    return int(different[0]) if different.size else n


class _Values:
    """Numbers written as a JavaScript array literal (NaN stays NaN: a gap in the line), 7 digits each."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def js(self) -> str:
        if self.array.dtype.kind == "f":
            return "[" + ",".join(_number(v) for v in self.array.tolist()) + "]"
        return json.dumps(self.array.tolist(), default=_jsonable)


def _number(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (np.inf, -np.inf):
        return "Infinity" if value > 0 else "-Infinity"
    return f"{value:.7g}"


def _values(array: np.ndarray) -> _Values:
    return _Values(array)


def _js(value) -> str:
    """`value` as a JavaScript literal (JSON, with `_Values` as number arrays)."""
    if isinstance(value, _Values):
        return value.js()
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{_js(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_js(v) for v in value) + "]"
    return json.dumps(value, default=_jsonable)


def _plain(figure):
    """A copy of `figure` whose x/y arrays are plain lists: drawn as JavaScript arrays (not typed arrays
    from base64), which the update scripts extend."""

    plain = go.Figure(figure)
    for trace in plain.data:
        for name in ("x", "y"):
            values = getattr(trace, name, None)
            if values is not None and not isinstance(values, str):
                array = _array(values)
                setattr(
                    trace,
                    name,
                    [None if v != v else v for v in array.tolist()]
                    if array.dtype.kind == "f"
                    else array.tolist(),
                )
    return plain


def _fill_width(figure) -> None:
    """Let the figure follow its panel's width (plotly's autosize), whatever width it was made with."""
    figure.layout.width = None
    figure.layout.autosize = True


_CONFIG = {"responsive": True, "displaylogo": False}
# The live plot follows its box itself (a ResizeObserver): plotly's window-resize listener is not needed.
_PLOT_CONFIG = {"displaylogo": False}


def mime_bundle(figure) -> dict:
    """The figure as the notebook's plotly renderer draws it (Colab's, Kaggle's, …); HTML otherwise."""
    try:
        # `responsive`: the figure follows its output's width (the renderer's copy is configured, not plotly's)
        bundle = figure._repr_mimebundle_(include=None, exclude=None, config=_CONFIG)
    except Exception:  # noqa: BLE001 - no renderer for this frontend
        bundle = None
    if bundle:
        return bundle

    return {
        "text/html": pio.to_html(figure, include_plotlyjs="cdn", full_html=False, config=_CONFIG),
        "text/plain": f"<plotly figure: {len(figure.data)} traces>",
    }
