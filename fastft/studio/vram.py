"""The VRAM panel: will this run fit that GPU, what takes the memory, and what to change when it does not.

Works from a model name alone (an embedded preset or a catalog id: no download), or from the loaded
model when it sits on a GPU (its real dtypes, quantisation and adapters). Every change of a control,
or of the model, LoRA or packing settings in the shared `StudioState`, re-estimates at once: an
estimate is pure arithmetic over the architecture (well under a millisecond per call).
"""

from __future__ import annotations

import html

from fastft.runtime.checkpointing import KINDS as CHECKPOINTING_KINDS
from fastft.studio.notices import Panel
from fastft.studio.state import PRECISIONS, LoadSettings, StudioState

__all__ = ["VramPanel"]

DEFAULT_GPU = "t4"  # when no GPU is visible: the card of a free Colab / Kaggle notebook


def _box(text: str, kind: str) -> str:
    """The verdict (green when it fits, amber with the fixes when not) or an error (red, with its fix)."""
    from fastft.studio.notices import error_html, status_html

    if kind == "error":
        return error_html(text, "Cannot estimate")
    return status_html(text, kind)


class VramPanel(Panel):
    """GPU, sequence length, batch tokens, LoRA rank → a stacked bar of the step's memory against the card.

    Controls: `model_name` (preset, catalog id, local folder or hub id), `gpu` (the presets of
    `fastft.vram.GPUS`, and the detected GPU first when there is one), `precision` ("16-bit", "8-bit",
    "4-bit"), `checkpointing`, and sliders `seq_len`, `batch_tokens` (tokens per micro-batch) and
    `rank`. Results: `figure` (the bar), `verdict` (fits, or the fixes that make it fit), `longest`
    (the longest context that fits), `breakdown` (the component table) and `status` (errors).
    After each estimate, `estimate`, `fit` and `max_context` hold the numbers.
    """

    def __init__(self, state: StudioState | None = None, *, live: str | None = None):
        import ipywidgets as widgets

        from fastft.models.catalog import CATALOG
        from fastft.models.presets import PRESETS
        from fastft.report.figures import vram_figure
        from fastft.studio.live import LiveFigure
        from fastft.vram import GPUS, detect_gpu

        self.state = state if state is not None else StudioState()
        self.estimate = None
        self.fit = None
        self.max_context: int | None = None
        self._syncing = False

        self.detected = detect_gpu()
        options = [(str(spec), name) for name, spec in GPUS.items()]
        if self.detected is not None:
            options.insert(0, (f"this GPU: {self.detected}", "detected"))
        style = {"description_width": "120px"}
        wide = widgets.Layout(width="480px")
        self.model_name = widgets.Combobox(
            value=self.state.model_name or "tiny-llama",
            options=[*PRESETS, *CATALOG],
            ensure_option=False,
            continuous_update=False,
            description="model",
            placeholder="preset, catalog id, folder or hub id",
            style=style,
            layout=wide,
        )
        self.gpu = widgets.Dropdown(
            options=options,
            value="detected" if self.detected is not None else DEFAULT_GPU,
            description="GPU",
            style=style,
            layout=wide,
        )
        self.precision = widgets.Dropdown(
            options=list(PRECISIONS), value="16-bit", description="precision", style=style
        )
        self.checkpointing = widgets.Dropdown(
            options=list(CHECKPOINTING_KINDS), value="auto", description="checkpointing", style=style
        )
        slider = dict(continuous_update=False, style=style, layout=wide)
        self.seq_len = widgets.IntSlider(
            value=256, min=64, max=32768, step=64, description="sequence length", **slider
        )
        self.batch_tokens = widgets.IntSlider(
            value=256, min=64, max=131072, step=64, description="batch tokens", **slider
        )
        self.rank = widgets.IntSlider(value=16, min=1, max=256, step=1, description="LoRA rank", **slider)
        self.figure = LiveFigure(vram_figure({}), live)
        self.verdict = widgets.HTML("")
        self.longest = widgets.HTML("")
        self.breakdown = widgets.HTML("")
        self.status = widgets.HTML("")
        self._controls = [
            self.model_name,
            self.gpu,
            self.precision,
            self.checkpointing,
            self.seq_len,
            self.batch_tokens,
            self.rank,
        ]
        for control in self._controls:
            control.observe(self._on_control, names="value")
        self.state.observe(
            self._on_state,
            ("model_name", "model", "load_settings", "lora_settings", "pack_settings", "packed"),
        )
        self.widget = widgets.VBox(
            [
                widgets.HBox([widgets.VBox(self._controls[:4]), widgets.VBox(self._controls[4:])]),
                self.figure.widget,
                self.verdict,
                self.longest,
                self.breakdown,
                self.status,
            ]
        )
        self.sync_from_state()

    # -- state ------------------------------------------------------------------------------------------
    def sync_from_state(self, names: tuple[str, ...] | None = None) -> None:
        """Take the model name, precision, rank, checkpointing and sequence length from the state (only
        those behind `names`, the state fields that changed; all when None), then estimate."""
        state = self.state
        wanted = set(names or ("model_name", "load_settings", "lora_settings", "pack_settings"))
        self._syncing = True
        try:
            if "model_name" in wanted and state.model_name:
                self.model_name.value = state.model_name
            if "load_settings" in wanted and state.load_settings.precision in PRECISIONS:
                self.precision.value = state.load_settings.precision
            if "lora_settings" in wanted:
                if state.lora_settings.gradient_checkpointing in CHECKPOINTING_KINDS:
                    self.checkpointing.value = state.lora_settings.gradient_checkpointing
                self._set_slider(self.rank, int(state.lora_settings.r))
            if wanted & {"pack_settings", "packed"}:
                seq = getattr(state.packed, "max_seq_length", None) or state.pack_settings.max_seq_length
                self._set_slider(self.seq_len, int(seq))
                self._set_slider(self.batch_tokens, max(int(seq), int(self.batch_tokens.value)))
        finally:
            self._syncing = False
        self.update()

    @staticmethod
    def _set_slider(slider, value: int) -> None:
        if value > slider.max:
            slider.max = value
        if value < slider.min:
            slider.min = value
        slider.value = value

    def _on_state(self, name: str) -> None:
        self.sync_from_state((name,))

    def _on_control(self, change) -> None:
        if self._syncing:
            return
        if change["owner"] is self.seq_len and self.batch_tokens.value < self.seq_len.value:
            self._syncing = True  # a micro-batch holds at least one whole sequence
            try:
                self._set_slider(self.batch_tokens, self.seq_len.value)
            finally:
                self._syncing = False
        self.update()

    # -- the estimate -------------------------------------------------------------------------------------
    def _source(self):
        """The loaded model when it is the one named and sits on a GPU (exact dtypes); else the name."""
        model = self.state.model
        name = self.model_name.value.strip()
        if model is not None and (not name or name == self.state.model_name):
            try:
                if next(model.parameters()).device.type == "cuda":
                    return model
            except (StopIteration, AttributeError):
                pass
        return name

    def settings(self) -> dict:
        """`fastft.estimate_vram` keyword arguments for the controls (no model, no GPU)."""
        source = self._source()
        settings = dict(
            batch_tokens=max(int(self.batch_tokens.value), int(self.seq_len.value)),
            lora_r=int(self.rank.value),
            checkpointing=self.checkpointing.value,
        )
        if isinstance(source, str):
            settings["precision"] = LoadSettings(precision=self.precision.value).vram_precision or "bf16"
            targets = self.state.lora_settings.target_modules
            if targets:
                settings["targets"] = list(targets)
        return settings

    def update(self) -> None:
        """Estimate with the current controls and show the bar, the verdict and the longest context."""
        from fastft.report.figures import vram_figure
        from fastft.vram import fits, get_gpu, max_context
        from fastft.vram.inventory import inventory_of

        source = self._source()
        if not source:
            self.status.value = _box(
                "Name a model: a preset (tiny-llama), a catalog id or a local folder.", "warn"
            )
            return
        try:
            gpu = self.detected if self.gpu.value == "detected" else get_gpu(self.gpu.value)
            settings = self.settings()
            seq_len = int(self.seq_len.value)
            verdict = fits(source, seq_len, gpu=gpu, **settings)
            longest_settings = {k: v for k, v in settings.items() if k != "batch_tokens"}
            longest = max_context(source, gpu, **longest_settings)
            positions = inventory_of(source).max_position_embeddings
        except Exception as error:  # noqa: BLE001 - shown with its fix, never raised into the notebook
            self.status.value = _box(_explain(error), "error")
            self.fit = self.estimate = self.max_context = None  # never show another model's numbers
            self.verdict.value = self.longest.value = self.breakdown.value = ""
            self.figure.replace(vram_figure({}))
            return
        self.fit, self.estimate, self.max_context = verdict, verdict.estimate, longest
        self.status.value = ""
        self.figure.replace(vram_figure(verdict.estimate))
        self.figure.flush()
        self.verdict.value = _box(verdict.message, "ok" if verdict.fits else "warn")
        if longest:
            beyond = (
                f" (beyond the {positions:,} positions the model was trained on)"
                if positions and longest > positions
                else ""
            )
            text = f"Longest context that fits {gpu.label}: {longest:,} tokens per sequence{beyond}."
        else:
            text = f"No context length fits {gpu.label} with these settings."
        self.longest.value = html.escape(text)
        self.breakdown.value = (
            "<details><summary>Breakdown</summary><pre style='font-size:12px'>"
            f"{html.escape(verdict.estimate.table())}</pre></details>"
        )

    def code(self) -> str:
        """The same estimate in plain Python."""
        from fastft.studio.notices import call_code, py_repr

        source = self._source()
        model = py_repr(source) if isinstance(source, str) else "model"
        gpu = "auto" if self.gpu.value == "detected" else self.gpu.value
        settings = self.settings()
        longest = {k: v for k, v in settings.items() if k != "batch_tokens"}
        seq = int(self.seq_len.value)
        return "\n".join(
            [
                "import fastft",
                "",
                call_code(
                    "estimate", "fastft.estimate_vram", [model], {"seq_len": seq, **settings, "gpu": gpu}
                ),
                "print(estimate.table())",
                call_code("verdict", "fastft.fits", [model, str(seq)], {"gpu": gpu, **settings}),
                "print(verdict.message)",
                call_code("longest", "fastft.max_context", [model], {"gpu": gpu, **longest}),
                'print(f"longest context that fits: {longest:,} tokens")',
                "",
            ]
        )


def _explain(error: BaseException) -> str:
    """Estimator errors name their fix already; a model that cannot be read offline gets one here."""
    from fastft.vram import VramEstimateError

    if isinstance(error, KeyError) and error.args:
        return str(error.args[0])
    if isinstance(error, (VramEstimateError, ValueError)):
        return str(error)
    return (
        f"Could not estimate this model ({type(error).__name__}: {error}). Fix: pick an embedded preset or "
        "a catalog model (they need no download), or a local folder with a config.json."
    )
