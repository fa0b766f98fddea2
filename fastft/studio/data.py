"""`DataPanel`: pick data, see rows as the model will see them, pack them into bins.

Sources: bundled data (``bundled:skills``, ``bundled:skills-eval``), an uploaded file, a path or a hub
id. The preview renders a row with the tokenizer's chat template and colours each token by what
training does with it: prompt tokens (no loss), trained tokens (labelled), tokens cut by
``max_seq_length``. Pack runs `fastft.pack` and shows its statistics and a length histogram.
Loading and packing run on a background thread; `wait()` blocks until they are done.
"""

from __future__ import annotations

import html
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import ipywidgets as widgets

import fastft
from fastft.data.loading import dataset_kind, list_bundled
from fastft.data.pairs import pack_pairs
from fastft.data.tokenize import IGNORE_INDEX, KEPT, render_chats, tokenized_records
from fastft.models.presets import CHATML_TEMPLATE
from fastft.report.figures import sequence_length_figure
from fastft.studio.live import LiveFigure
from fastft.studio.notices import (
    LABEL_STYLE,
    Panel,
    button,
    call_code,
    code_html,
    code_section,
    error_html,
    facts_table,
    field,
    py_repr,
    row,
    status_html,
)
from fastft.studio.state import StudioState, Worker

__all__ = ["DataPanel", "Segment", "uploaded_files"]

FORMATS = ("auto", "alpaca", "sharegpt", "messages", "text", "preference")
TEMPLATES = {"tokenizer": "the tokenizer's own", "chatml": "ChatML (<|im_start|>role …<|im_end|>)"}
UPLOAD_SUFFIXES = ".jsonl,.ndjson,.json,.csv,.tsv,.parquet"
PREVIEW_TOKENS = 2048  # tokens drawn per row; the rest is summarised
_WIDE = LABEL_STYLE
_KIND_STYLE = {
    "prompt": "color:#4a5563",
    "trained": "background:#c9efd6;color:#10331f;border-radius:2px",
    "cut": "color:#a3acb9;text-decoration:line-through",
}


@dataclass(frozen=True)
class Segment:
    """A run of consecutive tokens of one kind in a previewed row: "prompt" (no loss), "trained"
    (labelled: the loss is computed on it) or "cut" (beyond ``max_seq_length``, truncated away: a long
    prompt's start, or the end of a row whose prompt is too short to absorb the cut)."""

    text: str
    kind: str
    tokens: int


def uploaded_files(value) -> list[tuple[str, bytes]]:
    """``(file name, content)`` of a `FileUpload` value in either ipywidgets format.

    ipywidgets 8: a tuple of dicts with ``name`` and ``content`` (a memoryview). ipywidgets 7: a dict
    from file name to ``{"metadata": {...}, "content": bytes}``.
    """
    if not value:
        return []
    if isinstance(value, dict):  # ipywidgets 7
        return [(str(name), bytes(item["content"])) for name, item in value.items()]
    return [(str(item["name"]), bytes(item["content"])) for item in value]


class DataPanel(Panel):
    """Load, preview and pack a dataset; shares rows and packed bins through `StudioState`.

    Controls: ``source`` (bundled names; any path or hub id can be typed), ``upload``, ``format``,
    ``load_button``, ``chat_template``, ``train_on``, ``max_seq_length``, ``row`` (which row to
    preview), ``pack_button``. Output: ``preview`` (the row, coloured), ``stats`` (after Pack),
    ``histogram`` (an `Output` showing ``figure``, the plotly length histogram), ``status``,
    ``error``, ``code_view``.
    """

    def __init__(self, state: StudioState | None = None, *, live: str | None = None):
        self.state = state if state is not None else StudioState()
        self._worker = Worker("fastft-studio-data")
        self._fallback_tokenizer = None
        self._original_templates: dict[int, str | None] = {}
        self._packed_with = None  # what the shared packed bins were made with
        self.pair_cut = ""  # what pack_pairs cut from the previewed pair ("" when nothing)
        self._loaded_format = None
        self.figure = None
        state = self.state
        settings = state.pack_settings
        if state.model is None and state.packed is None:
            settings.max_seq_length = state.load_settings.max_seq_length
        bundled = [f"bundled:{name}" for name in list_bundled()]

        self.source = widgets.Combobox(
            value=state.dataset_name or (bundled[0] if bundled else ""),
            options=bundled,
            placeholder="bundled:NAME, a file path or a hub id (org/name)",
            description="Data",
            ensure_option=False,
            layout=field("24em", grow=3, max_width="48em"),
            style=_WIDE,
        )
        self.upload = widgets.FileUpload(
            accept=UPLOAD_SUFFIXES,
            multiple=False,
            description="Upload",
            layout=widgets.Layout(width="auto", flex="0 0 auto"),
        )
        self.format = widgets.Dropdown(
            options=list(FORMATS),
            value=settings.format,
            description="Format",
            style=_WIDE,
            layout=field("16em", max_width="22em"),
        )
        self.load_button = button(description="Load data", button_style="primary", icon="folder-open")
        self.chat_template = widgets.Dropdown(
            options=[(label, key) for key, label in TEMPLATES.items()],
            value=settings.chat_template,
            description="Chat template",
            layout=field("22em", max_width="36em"),
            style=_WIDE,
        )
        self.train_on = widgets.ToggleButtons(
            options=[("responses only", "responses"), ("every token", "all")],
            value=settings.train_on,
            description="Train on",
            style=_WIDE,
        )
        self.max_seq_length = widgets.BoundedIntText(
            value=settings.max_seq_length,
            min=2,
            max=1 << 20,
            step=64,
            description="Max length",
            layout=field("14em", max_width="20em"),
            style=_WIDE,
        )
        self.row = widgets.BoundedIntText(
            value=0,
            min=0,
            max=0,
            description="Preview row",
            layout=field("14em", max_width="20em"),
            style=_WIDE,
        )
        self.preview = widgets.HTML()
        self.pack_button = button(description="Pack", button_style="primary", icon="cubes")
        self.stats = widgets.HTML()
        self.length_plot = LiveFigure(sequence_length_figure([]), live)
        self.histogram = self.length_plot.widget
        self.histogram.layout.display = "none"  # until the first Pack
        self.rows_info = widgets.HTML()  # "N rows of chats from …": stays until other rows are loaded
        self.status = widgets.HTML()
        self.error = widgets.HTML()
        self.code_view = widgets.HTML()
        code = code_section(self.code_view)

        self.widget = widgets.VBox(
            [
                widgets.HTML("<b>2. Pick data</b>"),
                row([self.source, self.load_button, self.upload]),
                row([self.format, self.chat_template]),
                row([self.train_on, self.max_seq_length]),
                self.rows_info,
                self.status,
                self.error,
                row([self.row, widgets.HTML(_legend())]),
                self.preview,
                row([self.pack_button]),
                self.stats,
                self.histogram,
                code,
            ]
        )

        self.load_button.on_click(lambda _: self.load())
        self.pack_button.on_click(lambda _: self.pack())
        self.upload.observe(lambda change: self.load_upload(change["new"]), names="value")
        self.row.observe(lambda _: self._render_preview(), names="value")
        self.format.observe(self._on_format, names="value")
        for control in (self.chat_template, self.train_on, self.max_seq_length):
            control.observe(self._on_pack_settings, names="value")
        state.observe(self._on_state, ("model", "load_settings", "rows", "packed"))

        if state.rows is not None:  # a studio re-run on a kept state
            self._show_rows()
        if state.packed is not None:
            self._packed_with = self._pack_key()
            self._show_stats(state.packed)
        self._refresh()

    # ------------------------------------------------------------------------------------------ actions

    def load(self) -> bool:
        """Start loading ``source`` in ``format`` on a background thread (False while a job runs)."""
        source = self.source.value.strip()
        self.error.value = ""
        if not source:
            self.error.value = error_html(
                "Pick bundled data, upload a file, or type a path or a hub id.", "No data"
            )
            return False
        return self._start(lambda: self._load_job(source, self.format.value), f"Loading {source}…")

    def load_upload(self, value) -> bool:
        """Save an uploaded file (a `FileUpload` value, ipywidgets 7 or 8 format) and load it."""
        files = uploaded_files(value)
        if not files:
            return False
        name, content = files[0]
        folder = Path(tempfile.mkdtemp(prefix="fastft-upload-"))
        path = folder / Path(name).name  # the user's file name, so errors name the file they know
        path.write_bytes(content)
        self.source.value = str(path)
        return self.load()

    def pack(self) -> bool:
        """Start packing the loaded rows into bins of ``max_seq_length`` (False while a job runs)."""
        self.error.value = ""
        if self.state.rows is None:
            self.error.value = error_html("Load data first (Load data).", "No rows")
            return False
        return self._start(self._pack_job, "Packing…")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a running load or pack finishes; False if `timeout` seconds passed first."""
        return self._worker.wait(timeout)

    @property
    def busy(self) -> bool:
        return self._worker.busy

    @property
    def pairs(self) -> bool:
        """Whether the loaded rows are preference pairs (``prompt`` / ``chosen`` / ``rejected``)."""
        rows = self.state.rows
        return rows is not None and "pair" in getattr(rows, "column_names", ())

    def code(self) -> str:
        """The plain-Python calls that the current settings stand for (copy-paste into a cell)."""
        settings = self.state.pack_settings
        imports = []
        if self.state.tokenizer is None:
            imports.append("load_preset_tokenizer")
        if settings.chat_template == "chatml":
            imports.append("CHATML_TEMPLATE")
        lines = ["import fastft"]
        if imports:
            lines.append(f"from fastft.models.presets import {', '.join(sorted(imports))}")
        lines.append("")
        if self.state.tokenizer is None:
            lines.append(
                "tokenizer = load_preset_tokenizer()  # the tiny presets' tokenizer (no model loaded yet)"
            )
        if settings.chat_template == "chatml":
            lines.append("tokenizer.chat_template = CHATML_TEMPLATE")
        load_kwargs = {} if settings.format == "auto" else {"format": settings.format}
        source = self.state.dataset_name or self.source.value.strip()
        lines.append(call_code("rows", "fastft.load_dataset", [py_repr(source)], load_kwargs))
        if self.pairs:
            lines.append(
                call_code("data", "fastft.pack_pairs", ["rows", "tokenizer", str(settings.max_seq_length)])
            )
        else:
            pack_kwargs = {} if settings.train_on == "responses" else {"train_on": settings.train_on}
            lines.append(
                call_code(
                    "data", "fastft.pack", ["rows", "tokenizer", str(settings.max_seq_length)], pack_kwargs
                )
            )
        lines.append("print(data.stats.summary())")
        return "\n".join(lines) + "\n"

    def preview_segments(self, index: int | None = None) -> list[Segment] | dict[str, list[Segment]]:
        """Row `index` (default: the ``row`` control) as the model sees it: runs of prompt, trained
        and cut tokens, in order, with the chat template and ``max_seq_length`` applied."""

        rows = self.state.rows
        if rows is None or len(rows) == 0:
            return []
        index = int(self.row.value if index is None else index)
        row = rows[index]
        tokenizer = self._tokenizer()
        settings = self.state.pack_settings
        if "pair" in rows.column_names:
            return self.pair_segments(index)
        # Labels come from the same code `pack` runs (it also checks the chat template first).
        [record] = tokenized_records(
            [{k: row[k] for k in ("messages", "text") if k in row}],
            tokenizer,
            settings.max_seq_length,
            settings.train_on,
            "cut_prompt",  # what `pack` does by default: a long prompt loses its start, the answer stays
            batch_size=1,
        )
        if row.get("messages") is not None:
            text = render_chats(tokenizer, [row["messages"]])[0][0] if row["messages"] else ""
        else:
            text = (row.get("text") or "") + (tokenizer.eos_token or "")
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
        labels = record.labels if record.status == KEPT else None
        left = record.cut_tokens if record.cut_prompt else 0  # tokens cut from the start
        kinds = []
        for i in range(len(offsets)):
            if i < left or i - left >= settings.max_seq_length:
                kinds.append("cut")
            elif labels is not None and labels[i - left] != IGNORE_INDEX:
                kinds.append("trained")
            else:
                kinds.append("prompt")
        # Each token owns the characters from its start to the next token's start, so the text between
        # tokens (spaces a tokenizer does not cover) is shown too and the segments add up to `text`.
        starts = [start for start, _ in offsets] + [len(text)]
        starts[0] = 0
        segments: list[Segment] = []
        for i, kind in enumerate(kinds):
            piece = text[starts[i] : starts[i + 1]]
            if segments and segments[-1].kind == kind:
                last = segments[-1]
                segments[-1] = Segment(last.text + piece, kind, last.tokens + 1)
            else:
                segments.append(Segment(piece, kind, 1))
        return segments

    def pair_segments(self, index: int | None = None) -> dict[str, list[Segment]]:
        """Preference row `index` as the model sees it: ``{"chosen": [...], "rejected": [...]}``, each side
        the prompt and that answer rendered with the chat template, in runs of prompt and trained tokens, cut
        to ``max_seq_length`` as `fastft.pack_pairs` cuts it (both sides share one bin)."""

        index = int(self.row.value if index is None else index)
        tokenizer = self._tokenizer()
        with warnings.catch_warnings(record=True) as cut:  # the cut is shown in the preview instead
            warnings.simplefilter("always")
            packed = pack_pairs([self.state.rows[index]], tokenizer, self.state.pack_settings.max_seq_length)
        sides = {}
        for side, ids, labels in zip(
            ("chosen", "rejected"), packed.data.input_ids, packed.data.labels, strict=True
        ):
            segments: list[Segment] = []
            kinds = ["trained" if label != IGNORE_INDEX else "prompt" for label in labels]
            start = 0
            for i in range(1, len(kinds) + 1):
                if i == len(kinds) or kinds[i] != kinds[start]:
                    text = tokenizer.decode(ids[start:i].tolist(), skip_special_tokens=False)
                    segments.append(Segment(text, kinds[start], i - start))
                    start = i
            sides[side] = segments
        self.pair_cut = str(packed.pair_stats) if cut else ""
        return sides

    # ------------------------------------------------------------------------------------------ jobs

    def _start(self, job, message: str) -> bool:
        busy = status_html(message, "busy")

        def guarded():
            self.load_button.disabled = self.pack_button.disabled = True
            self.status.value = busy
            try:
                job()
            except Exception as error:  # noqa: BLE001 - every failure is shown in the panel, none raised
                self.error.value = error_html(error)
            finally:
                if self.status.value == busy:
                    self.status.value = ""
                self.load_button.disabled = self.pack_button.disabled = False
                self._refresh()

        if not self._worker.start(guarded):
            self.status.value = status_html("Still working on the last click; wait for it to finish.", "warn")
            return False
        return True

    def _load_job(self, source: str, fmt: str) -> None:
        rows = fastft.load_dataset(source, format=fmt)
        state = self.state
        self._clear_stats()  # the last pack's numbers describe other rows
        state.rows, state.dataset_name = rows, source
        state.pack_settings.format = fmt
        self._loaded_format = fmt
        if state.packed is not None:
            state.packed = None
            state.notify("packed")
        state.notify("rows")
        self._show_rows()

    def _pack_job(self) -> None:
        state = self.state
        settings = state.pack_settings
        tokenizer = self._tokenizer()
        if self.pairs:  # preference rows: both answers of a pair in one bin, labels on the answers only
            packed = fastft.pack_pairs(state.rows, tokenizer, settings.max_seq_length)
        else:
            packed = fastft.pack(state.rows, tokenizer, settings.max_seq_length, train_on=settings.train_on)
        state.packed = packed
        self._packed_with = self._pack_key()
        self._show_stats(packed)
        state.notify("packed")

    # ------------------------------------------------------------------------------------------ display

    def _show_rows(self) -> None:
        rows = self.state.rows
        self.row.max = max(len(rows) - 1, 0)
        self.row.value = min(self.row.value, self.row.max)
        try:
            kind = dataset_kind(rows)
        except ValueError:
            kind = "?"
        extra = [c for c in rows.column_names if c not in ("messages", "text", "pair")]
        what = {"chat": "chats", "pairs": "preference pairs"}.get(kind, "plain text")
        text = f"{len(rows):,} row{'s' if len(rows) != 1 else ''} of {what} from {self.state.dataset_name}"
        if extra:
            text += f" (other columns kept: {', '.join(extra)})"
        self.rows_info.value = status_html(text, "ok")
        self._render_preview()

    def _render_preview(self) -> None:
        rows = self.state.rows
        if rows is None:
            self.preview.value = ""
            return
        try:
            segments = self.preview_segments()
        except Exception as error:  # noqa: BLE001 - e.g. a tokenizer without a chat template: show its fix
            self.preview.value = error_html(error)
            return
        if isinstance(segments, dict):  # a preference pair: each side as the model sees it
            note = self._tokenizer_note()
            if self.pair_cut:
                note = f"Cut to fit max length together: {self.pair_cut}. {note}".strip()
            self.preview.value = "".join(
                f"<b>{side}</b>" + _segments_html(parts, note if side == "rejected" else "")
                for side, parts in segments.items()
            )
            return
        self.preview.value = _segments_html(segments, self._tokenizer_note())

    def _show_stats(self, packed) -> None:
        stats = packed.stats
        t = stats.tokenize
        rows = [
            ("efficiency", f"{stats.efficiency:.1%} of each bin holds tokens (the rest is padding)"),
            ("bins", f"{stats.bins:,} bins of {stats.max_seq_length:,} tokens"),
            ("sequences per bin", f"{stats.sequences_per_bin:.2f}"),
            ("sequences", f"{stats.sequences:,} kept of {t.rows:,} rows"),
            ("tokens", f"{stats.tokens:,} in all, {stats.trained_tokens:,} trained"),
            ("truncated", f"{t.truncated:,} rows cut to max length"),
            ("dropped", f"{t.dropped_overlong:,} rows longer than max length"),
            ("skipped", f"{t.skipped_empty:,} empty, {t.skipped_no_labels:,} without trained tokens"),
        ]
        self.stats.value = facts_table(rows)
        self.figure = sequence_length_figure(packed.data.lengths, stats.max_seq_length, truncated=t.truncated)
        self.length_plot.replace(self.figure)
        self.length_plot.flush()
        self.histogram.layout.display = None

    def _clear_stats(self, note: str = "") -> None:
        """Take the last pack's statistics and histogram off the screen (`note`: say why instead)."""
        self.stats.value = note
        self.figure = None
        self.histogram.layout.display = "none"

    def _refresh(self) -> None:
        self.code_view.value = code_html(self.code())

    def _tokenizer(self):
        """The loaded model's tokenizer, with the chosen chat template; the presets' tokenizer while no
        model is loaded and a preset is picked."""
        tokenizer = self.state.tokenizer
        if tokenizer is None:
            from fastft.models.presets import PRESETS, load_preset_tokenizer

            name = self.state.model_name
            if name is not None and name not in PRESETS:
                raise RuntimeError(
                    f"Load the model first (Model tab: Load model): rows are rendered and counted with "
                    f"{name}'s own tokenizer and chat template."
                )
            if self._fallback_tokenizer is None:
                self._fallback_tokenizer = load_preset_tokenizer()
            tokenizer = self._fallback_tokenizer
        self._apply_template(tokenizer)
        return tokenizer

    def _tokenizer_note(self) -> str:
        if self.state.tokenizer is None:
            return "No model loaded yet: shown with the tiny presets' tokenizer."
        return ""

    def _apply_template(self, tokenizer) -> None:
        key = id(tokenizer)
        if key not in self._original_templates:
            self._original_templates[key] = getattr(tokenizer, "chat_template", None)
        if self.state.pack_settings.chat_template == "chatml":
            tokenizer.chat_template = CHATML_TEMPLATE
        else:
            tokenizer.chat_template = self._original_templates[key]

    def _pack_key(self) -> tuple:
        """What packed bins depend on besides the rows: settings and the tokenizer's identity."""
        settings = self.state.pack_settings
        tokenizer = self.state.tokenizer or self._fallback_tokenizer
        identity = None
        if tokenizer is not None:
            identity = (getattr(tokenizer, "name_or_path", ""), len(tokenizer), tokenizer.eos_token)
        return (settings.max_seq_length, settings.chat_template, settings.train_on, identity)

    def _drop_stale_pack(self, reason: str) -> None:
        state = self.state
        if state.packed is not None and self._packed_with != self._pack_key():
            state.packed = None
            self._clear_stats(status_html(f"{reason}: click Pack again.", "warn"))
            state.notify("packed")

    # ------------------------------------------------------------------------------------------ events

    def _on_format(self, change) -> None:
        self.state.pack_settings.format = change["new"]
        if self.state.rows is not None and change["new"] != self._loaded_format:
            self.status.value = status_html("Format changed: click Load data to read the rows again.", "warn")
        self.state.notify("pack_settings")
        self._refresh()

    def _on_pack_settings(self, _change=None) -> None:
        settings = self.state.pack_settings
        settings.chat_template = self.chat_template.value
        settings.train_on = self.train_on.value
        settings.max_seq_length = int(self.max_seq_length.value)
        self.state.notify("pack_settings")
        self._drop_stale_pack("Packing settings changed")
        self._render_preview()
        self._refresh()

    def _on_state(self, name: str) -> None:
        if name == "load_settings":
            self.max_seq_length.value = self.state.load_settings.max_seq_length  # follows the model's
        elif name == "model" and self.state.tokenizer is not None:
            self._drop_stale_pack("Another tokenizer was loaded")
            self._render_preview()
            self._refresh()
        elif name == "packed" and self.state.packed is None and self.figure is not None:
            self._clear_stats(self.stats.value if "Pack again" in self.stats.value else "")


def _segments_html(segments: list[Segment], note: str = "") -> str:
    tokens = sum(s.tokens for s in segments)
    trained = sum(s.tokens for s in segments if s.kind == "trained")
    cut = sum(s.tokens for s in segments if s.kind == "cut")
    parts = []
    shown = 0
    for segment in segments:
        if shown >= PREVIEW_TOKENS:
            break
        text = segment.text
        if shown + segment.tokens > PREVIEW_TOKENS:  # draw only part of the last run (characters, roughly)
            text = text[: max(1, len(text) * (PREVIEW_TOKENS - shown) // segment.tokens)] + " …"
        shown += segment.tokens
        parts.append(f'<span style="{_KIND_STYLE[segment.kind]}">{html.escape(text)}</span>')
    summary = f"{tokens:,} tokens, {trained:,} trained"
    if cut:
        summary += f", {cut:,} cut by max length"
    if not trained:
        summary += " — no trained token: this row is skipped when packing"
    if note:
        summary += f". {note}"
    body = "".join(parts)
    return (
        f'<div style="font-size:12px;color:#7a8594;margin:2px 0">{html.escape(summary)}</div>'
        '<pre style="white-space:pre-wrap;word-break:break-word;font-size:12px;background:#fafbfc;'
        f'border:1px solid #e1e4e8;border-radius:4px;padding:8px;max-height:320px;overflow:auto">{body}</pre>'
    )


def _legend() -> str:
    return (
        '<span style="font-size:12px;margin-left:12px">'
        f'<span style="{_KIND_STYLE["prompt"]}">prompt (no loss)</span> · '
        f'<span style="{_KIND_STYLE["trained"]}">trained (labelled)</span> · '
        f'<span style="{_KIND_STYLE["cut"]}">cut by max length</span></span>'
    )
