"""One plotly.js per page: a small live-plot widget and the one library model every plot of a kernel shares.

plotly's ``FigureWidget`` is an anywidget whose ``_esm`` is plotly's whole widget bundle (4.7 MB): anywidget
sends each model's ``_esm`` in that model's own comm, so the studio's six charts were 28 MB per studio cell
(twice that when they fell back and came back), and on a busy 2-core machine the page took tens of seconds
to parse them. Here a kernel makes one `PlotlyLibrary` model holding plotly.js, gzipped (1.5 MB), that the
browser decompresses and imports once per page; each `LivePlot` is a ~2 kB module that waits for it, draws
its ``figure`` (the figure's JSON: numpy arrays travel as base64 typed arrays) with ``Plotly.react`` and
redraws it on every change. A plot reports ``rendered`` once the browser has drawn it: `LiveFigure` takes
that as its render probe (no plot drawn: the front end does not run custom widgets, or could not load
plotly.js).

Listeners are the view's own and go with it (``render`` returns its cleanup), so a plot whose view was
taken down (the display fallback) can be shown again and still draws its updates. Each figure sent carries a
``revision`` and the browser answers with the one it ``drawn``: anywidget (0.11) drops every later message
to a model whose module took over 2 s to initialize (a page busy with a new studio on a slow machine: "Failed
to initialize model"), so the plot drew its first figure and then froze; `LiveFigure` sees the answer not
come and shows a new plot in its place.
"""

from __future__ import annotations

import functools
import gzip
import json
import threading

import plotly

# Function-local imports: torch and transformers submodules load where their feature is used (not every supported
# version has each, and each costs its import).

__all__ = ["figure_json", "library", "live_plot"]

# The page's one loader: `ready` resolves to plotly.js once a library model has imported it (whichever
# kernel's comes first); the library's own module and every plot's share it through `globalThis`.
_HUB_JS = """
const hub = () => (globalThis.__fastftPlotly = globalThis.__fastftPlotly || (() => {
  let ok, no;
  const ready = new Promise((resolve, reject) => { ok = resolve; no = reject; });
  ready.catch(() => {});
  return { ready, ok, no, loading: false };
})());
"""

# plotly.min.js is a UMD script that also sets window.Plotly: imported as a module, it exports plotly.js
# through this `module` object (no stray global). Decompressed with the browser's own DecompressionStream;
# where there is none, no plot reports and the figures fall back to the front end's plotly renderer.
_LIBRARY_ESM = (
    _HUB_JS
    + """
async function load(model) {
  const h = hub();
  if (h.loading) return;  // one plotly.js per page, whatever number of kernels and studios
  h.loading = true;
  try {
    const version = model.get("version");
    if (globalThis.Plotly && globalThis.Plotly.version === version) { h.ok(globalThis.Plotly); return; }
    let blob = new Blob([model.get("source")]);
    if (model.get("encoding") === "gzip")
      blob = await new Response(blob.stream().pipeThrough(new DecompressionStream("gzip"))).blob();
    const url = URL.createObjectURL(new Blob([blob], { type: "text/javascript" }));
    try { h.ok((await import(url)).default); } finally { URL.revokeObjectURL(url); }
  } catch (error) {
    console.warn("fastft: plotly.js did not load:", error);
    h.no(error);
  }
}
// not awaited: anywidget gives a model 2 s to initialize, and a slow page takes longer to parse plotly.js
export default { initialize({ model }) { load(model); } };
"""
)

_PLOT_ESM = (
    _HUB_JS
    + """
export default {
  render({ model, el }) {
    const gd = document.createElement("div");
    gd.style.width = "100%";
    el.appendChild(gd);
    let alive = true, pending = false, drawn = false, width = -1, queue = Promise.resolve();
    const draw = () => {
      if (pending) return;  // one redraw queued is enough: it reads the newest figure
      pending = true;
      queue = queue.then(() => hub().ready).then(async P => {
        pending = false;
        if (!alive) return;
        const figure = model.get("figure") || {};
        const revision = model.get("revision");
        await P.react(gd, figure.data || [], figure.layout || {}, model.get("config") || {});
        if (!alive) return;
        drawn = true;
        if (!model.get("rendered")) model.set("rendered", true);
        if (model.get("drawn") !== revision) model.set("drawn", revision);  // the kernel's proof of delivery
        model.save_changes();
      }).catch(error => { pending = false; console.warn("fastft live plot:", error); });
    };
    // the plot follows its box's width (a hidden tab shown, a side panel opened), once per new width
    const observer = typeof ResizeObserver === "undefined" ? null : new ResizeObserver(entries => {
      const now = Math.round(entries[entries.length - 1].contentRect.width);
      if (now === width || now === 0) return;
      width = now;
      // the box's own width, not Plots.resize: that measures the drawn svg, which still holds the old width
      if (drawn) hub().ready.then(P => { if (alive) P.relayout(gd, { width: now }); }).catch(() => {});
    });
    if (observer) observer.observe(el);
    model.on("change:figure", draw);
    draw();
    return () => {
      alive = false;
      model.off("change:figure", draw);
      if (observer) observer.disconnect();
      hub().ready.then(P => P.purge(gd)).catch(() => {});
    };
  }
};
"""
)

_CLASSES: dict[str, type] = {}
_lock = threading.Lock()
_library = None


def _classes() -> tuple[type, type]:
    """(PlotlyLibrary, LivePlot), defined on first use (anywidget is imported only then)."""
    if not _CLASSES:
        import anywidget
        import ipywidgets as widgets
        import traitlets

        class PlotlyLibrary(anywidget.AnyWidget):
            """plotly.js for the page, sent once per kernel (`library()`); draws nothing itself."""

            _esm = _LIBRARY_ESM
            source = traitlets.Bytes(b"").tag(sync=True)
            encoding = traitlets.Unicode("gzip").tag(sync=True)
            version = traitlets.Unicode("").tag(sync=True)

        class LivePlot(anywidget.AnyWidget):
            """A plotly figure drawn in the browser from its JSON (`figure_json`) with the shared plotly.js;
            ``rendered`` turns True once a browser has drawn it."""

            _esm = _PLOT_ESM
            figure = traitlets.Dict().tag(sync=True)
            config = traitlets.Dict().tag(sync=True)
            rendered = traitlets.Bool(False).tag(sync=True)
            revision = traitlets.Int(0).tag(sync=True)  # counts the figures sent
            drawn = traitlets.Int(-1).tag(sync=True)  # the revision a browser drew last
            # a reference, so the front end has made the library model before it draws this plot
            library = traitlets.Instance(PlotlyLibrary, allow_none=True).tag(
                sync=True, **widgets.widget_serialization
            )

        _CLASSES.update(PlotlyLibrary=PlotlyLibrary, LivePlot=LivePlot)
    return _CLASSES["PlotlyLibrary"], _CLASSES["LivePlot"]


@functools.lru_cache(maxsize=1)
def _plotly_js() -> tuple[bytes, str]:
    """plotly.js (the copy the plotly package ships), gzipped and wrapped as a module; its version."""
    from plotly.offline import get_plotlyjs

    source = (
        b"const module = { exports: {} };\n" + get_plotlyjs().encode() + b"\nexport default module.exports;\n"
    )
    version = getattr(plotly.offline, "get_plotlyjs_version", lambda: "")()
    return gzip.compress(source, compresslevel=6, mtime=0), version


def library():
    """This kernel's one `PlotlyLibrary` (made, and its 1.5 MB sent, on first use; again if it was closed)."""
    global _library
    with _lock:
        if _library is None or _library.comm is None:
            PlotlyLibrary, _ = _classes()
            source, version = _plotly_js()
            _library = PlotlyLibrary(source=source, version=version)
        return _library


def live_plot(figure, config: dict):
    """A `LivePlot` showing `figure`, or None where it cannot be made (it needs anywidget)."""
    try:
        _, LivePlot = _classes()
        import ipywidgets as widgets

        return LivePlot(
            figure=figure_json(figure),
            config=config,
            library=library(),
            layout=widgets.Layout(width="100%", min_width="0"),
        )
    except Exception:  # noqa: BLE001 - no anywidget, no comm: the caller falls back
        return None


def figure_json(figure) -> dict:
    """`figure` as plotly.js takes it (numpy arrays as base64 typed arrays, which plotly.js decodes)."""
    return json.loads(figure.to_json())
