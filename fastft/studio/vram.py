"""The VRAM panel, a what-if planner: would this run fit that GPU, what takes the memory, what to change when
it does not, and the smallest GPU preset it fits. Nothing here changes the loaded model; "Use in Model tab"
copies the planned precision, rank, checkpointing and length there.

Works from a model name alone (an embedded preset or a catalog id: no download), or from the loaded
model when it sits on a GPU (its real dtypes, quantisation and adapters). Every change of a control,
or of the model, LoRA or packing settings in the shared `StudioState`, re-estimates at once: an
estimate is pure arithmetic over the architecture (well under a millisecond per call). A hub id or a
folder needs its config first: that is read on a timer thread once typing pauses (`Debouncer`), once per
name (successes and failures are kept), and offline it fails at once from the local cache, so no
keystroke ever waits for the network.
"""

from __future__ import annotations

import html
import threading
import time
from pathlib import Path

import ipywidgets as widgets
import torch

import fastft.weight_formats as weight_formats
from fastft.data.hub import offline_fix, offline_reason
from fastft.kernels.capability import kernel_status
from fastft.models.catalog import CATALOG
from fastft.models.presets import PRESETS
from fastft.report.figures import vram_figure
from fastft.runtime.activation_checkpointing import KINDS as CHECKPOINTING_KINDS
from fastft.runtime.host_budget import HOST_BUDGET_FRACTION, host_memory_total
from fastft.studio.live import LiveFigure
from fastft.studio.notices import (
    LABEL_STYLE,
    Panel,
    button,
    call_code,
    code_html,
    code_section,
    error_html,
    field,
    py_repr,
    row,
    status_html,
)
from fastft.studio.state import PRECISIONS, Debouncer, LoadSettings, StudioState
from fastft.vram import GPUS, VramEstimateError, fits, get_gpu, max_context
from fastft.vram.inventory import inventory_of

# Function-local imports: tests replace these names on their modules, so they are looked up when called.

__all__ = ["VramPanel"]

DEFAULT_GPU = "t4"  # when no GPU is visible: the card of a free Colab / Kaggle notebook
SEQ_MAX = 32768  # the sequence-length slider's end, unless the longest context that fits is further
DEFAULT_HOST_GIB = 16.0  # host memory planned for when this machine's total cannot be read


def _box(text: str, kind: str) -> str:
    """The verdict (green when it fits, amber with the fixes when not) or an error (red, with its fix)."""

    if kind == "error":
        return error_html(text, "Cannot estimate")
    return status_html(text, kind)


def _dropdown(options, value: str, description: str) -> widgets.Dropdown:
    """A plan setting picked from `options` (their values as their labels)."""
    return widgets.Dropdown(
        options=list(options), value=value, description=description, style=LABEL_STYLE, layout=field("22em")
    )


class VramPanel(Panel):
    """GPU, sequence length, batch tokens, LoRA rank → a stacked bar of the step's memory against the card.

    Controls: `model_name` (preset, catalog id, local folder or hub id), `gpu` (the presets of
    `fastft.vram.GPUS`, and the detected GPU first when there is one), `precision` ("16-bit", "8-bit",
    "4-bit"), `checkpointing`, `host_memory` (GiB of RAM of the machine planned for, this one's total by
    default: offloading may pin `HOST_BUDGET_FRACTION` of it; the plan never reads this machine's free
    memory, so the same plan gives the same answer), and sliders `seq_len` (it reaches the longest context
    that fits), `batch_tokens` (tokens per micro-batch) and `rank`. Results: `figure` (the bar), `verdict` (fits, or the fixes that make it fit), `longest`
    (the longest context that fits), `breakdown` (the component table) and `status` (errors).
    After each estimate, `estimate`, `fit` and `max_context` hold the numbers.
    """

    def __init__(self, state: StudioState | None = None, *, live: str | None = None):
        from fastft.vram import GPUS, detect_gpu

        self.state = state if state is not None else StudioState()
        self.estimate = None
        self.fit = None
        self.max_context: int | None = None
        self.smallest_gpu = None  # the smallest GPU preset the planned run fits, or None
        self._syncing = False
        self._inventories: dict[str, object] = {}  # name → its inventory, or the error reading it gave
        self._lookup = Debouncer(self._fetch)
        self.lookups = 0  # configs read (a name is read once)
        self._update_lock = threading.RLock()
        self._blank = True  # the chart shows no estimate

        self.detected = detect_gpu()
        self._build_plan_controls(GPUS)
        self._build_results(live)
        self._controls = [
            self.model_name,
            self.gpu,
            self.precision,
            self.checkpointing,
            self.host_memory,
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
        self.widget = self._layout()
        self.sync_from_state()

    def _build_plan_controls(self, gpus: dict) -> None:
        """What the plan is for: the model, the GPU (`gpus`' presets, the detected one first), how the model
        is loaded, the host's memory and the run's shape."""
        options = [(str(spec), name) for name, spec in gpus.items()]
        if self.detected is not None:
            options.insert(0, (f"this GPU: {self.detected}", "detected"))
        style = LABEL_STYLE
        self.model_name = widgets.Combobox(
            value=self.state.model_name or "tiny-llama",
            options=[*PRESETS, *CATALOG],
            ensure_option=False,
            continuous_update=False,
            description="model",
            placeholder="preset, catalog id, folder or hub id",
            style=style,
            layout=field("22em"),
        )
        self.gpu = widgets.Dropdown(
            options=options,
            value="detected" if self.detected is not None else DEFAULT_GPU,
            description="GPU",
            style=style,
            layout=field("30em", max_width="44em"),  # "NVIDIA GeForce RTX 3090 24 GB (23.69 GiB)" in full
        )
        self.precision = _dropdown(PRECISIONS, "16-bit", "precision")
        self.checkpointing = _dropdown(CHECKPOINTING_KINDS, "auto", "checkpointing")
        self.host_memory = widgets.BoundedFloatText(
            value=_host_gib(),
            min=0.0,
            max=1e6,
            step=1.0,
            description="host RAM (GiB)",
            tooltip=(
                "RAM of the machine planned for (this one's total by default): offloaded checkpointing may pin "
                f"{HOST_BUDGET_FRACTION:.0%} of it"
            ),
            continuous_update=False,
            style=style,
            layout=field("22em"),
        )
        slider = dict(continuous_update=False, style=style, layout=field("22em"))
        self.seq_len = widgets.IntSlider(
            value=256, min=64, max=SEQ_MAX, step=64, description="sequence length", **slider
        )
        self.batch_tokens = widgets.IntSlider(
            value=256, min=64, max=131072, step=64, description="batch tokens", **slider
        )
        self.rank = widgets.IntSlider(value=16, min=1, max=256, step=1, description="LoRA rank", **slider)

    def _build_results(self, live: str | None) -> None:
        """The plan's answer: the memory bar, the verdict, the longest context, the breakdown, the smallest
        GPU it fits with "Use in Model tab", and its code."""
        self.figure = LiveFigure(vram_figure({}), live)
        self.verdict = widgets.HTML("")
        self.longest = widgets.HTML("")
        self.breakdown = widgets.HTML("")
        self.status = widgets.HTML("")
        self.suggestion = widgets.HTML("")
        self.this_machine = widgets.HTML("")
        self.use_button = button(
            description="Use in Model tab",
            icon="arrow-left",
            tooltip="Copy this plan's precision, LoRA rank, checkpointing and length to the Model and Data tabs",
        )
        self.use_button.on_click(lambda _: self.apply_to_model())
        self.code_view = widgets.HTML("")

    def _layout(self) -> widgets.VBox:
        return widgets.VBox(
            [
                widgets.HTML(
                    "<b>3. Plan the memory</b>: a what-if planner. Change any setting to see whether a run "
                    "would fit a GPU; nothing here changes the loaded model until you click "
                    "<i>Use in Model tab</i>."
                ),
                row(self._controls),
                self.this_machine,
                self.status,
                self.figure.widget,
                self.verdict,
                self.longest,
                row([self.suggestion, self.use_button]),
                self.breakdown,
                code_section(self.code_view),
            ]
        )

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

    def _reach(self, longest: int) -> None:
        """The sequence-length slider reaches the longest context that fits (its end moves no lower than
        `SEQ_MAX` or the length chosen)."""
        step = self.seq_len.step
        end = max(SEQ_MAX, -(-int(longest) // step) * step, int(self.seq_len.value))
        if end != self.seq_len.max:
            self.seq_len.max = end

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
            # what offloading may pin on the machine planned for: stated, never this machine's free memory
            host_memory=int(HOST_BUDGET_FRACTION * float(self.host_memory.value) * 2**30),
        )
        if isinstance(source, str):
            settings["precision"] = LoadSettings(precision=self.precision.value).vram_precision or "bf16"
            targets = self.state.lora_settings.target_modules
            if targets:
                settings["targets"] = list(targets)
        return settings

    def update(self) -> None:
        """Estimate with the current controls and show the bar, the verdict, the longest context and the
        smallest GPU it fits. A name whose config is not known yet is looked up off this thread first."""
        with self._update_lock:
            self._update()

    def _update(self) -> None:
        source = self._source()
        self.code_view.value = code_html(self.code())
        self.this_machine.value = this_machine_html(self.precision.value)
        if not source:
            self._clear()
            self.status.value = _box(
                "Name a model: a preset (tiny-llama), a catalog id or a local folder.", "warn"
            )
            return
        try:
            model = self._known(source)
            if model is None:  # looked up on a timer thread; `update` runs again when it is known
                self._clear()
                self.status.value = _box(
                    f"Looking up {source} (in the background: the notebook stays usable)…", "busy"
                )
                self._lookup(source)
                return
            gpu = self.detected if self.gpu.value == "detected" else get_gpu(self.gpu.value)
            settings = self.settings()
            seq_len = int(self.seq_len.value)
            verdict = fits(model, seq_len, gpu=gpu, **settings)
            longest_settings = {k: v for k, v in settings.items() if k != "batch_tokens"}
            longest = max_context(model, gpu, **longest_settings)
            positions = _inventory(model).max_position_embeddings
            smallest = _smallest_gpu(model, seq_len, settings)
        except Exception as error:  # noqa: BLE001 - shown with its fix, never raised into the notebook
            self._clear()
            self.status.value = _box(_explain(error), "error")
            return
        self.fit, self.estimate, self.max_context, self.smallest_gpu = (
            verdict,
            verdict.estimate,
            longest,
            smallest,
        )
        self.status.value = ""
        self._blank = False
        self._reach(longest)
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
        if smallest is None:
            self.suggestion.value = _box(
                "No GPU preset fits this plan: try 4-bit, 'offload' checkpointing or a shorter length.",
                "warn",
            )
        elif smallest.name == getattr(gpu, "name", None):
            self.suggestion.value = _box(f"{gpu.label} is the smallest GPU preset this plan fits.", "ok")
        else:
            self.suggestion.value = _box(
                f"The smallest GPU preset this plan fits: {smallest.label} ({smallest.capacity_gib:.1f} GiB).",
                "info",
            )
        self.breakdown.value = (
            "<details><summary>Breakdown</summary><pre style='font-size:12px;overflow-x:auto'>"
            f"{html.escape(verdict.estimate.table())}</pre></details>"
        )

    def _clear(self) -> None:
        """Never show another model's numbers (or a capacity line with no bar)."""

        self.fit = self.estimate = self.max_context = self.smallest_gpu = None
        self.verdict.value = self.longest.value = self.breakdown.value = self.suggestion.value = ""
        if not self._blank:  # a plotly figure costs ~0.1 s to build: not once per keystroke
            self.figure.replace(vram_figure({}))
            self.figure.flush()
            self._blank = True

    def _known(self, source):
        """`source` itself when it needs no lookup (a loaded model, a preset, a catalog id), its inventory
        once looked up, None while it is not; the lookup's error is raised again (it is kept)."""
        if not isinstance(source, str) or _quick(source):
            return source
        known = self._inventories.get(source)
        if isinstance(known, BaseException):
            raise known
        return known

    def _fetch(self, name: str) -> None:
        """On the debouncer's thread: read `name`'s config once, keep the outcome, estimate again."""

        if name in self._inventories or self.model_name.value.strip() != name:
            return
        self.lookups += 1
        try:
            _offline_and_not_cached(name)
            self._inventories[name] = inventory_of(name)
        except Exception as error:  # noqa: BLE001 - kept, shown by `update`
            self._inventories[name] = error
        if self.model_name.value.strip() == name:
            self.update()

    def wait(self, timeout: float = 30.0) -> bool:
        """Block until a pending config lookup is done (tests, scripts); False if `timeout` passed."""

        deadline = time.monotonic() + timeout
        while self._lookup.pending or self._lookup.running:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def apply_to_model(self) -> None:
        """Carry this plan back: the model name, precision, LoRA rank, checkpointing and the length become the
        Model tab's (and the Data tab's max length), as if set there."""
        state = self.state
        name = self.model_name.value.strip()
        if name:
            state.model_name = name
        state.load_settings.precision = self.precision.value
        state.load_settings.max_seq_length = int(self.seq_len.value)
        state.lora_settings.r = int(self.rank.value)
        state.lora_settings.gradient_checkpointing = self.checkpointing.value
        state.pack_settings.max_seq_length = int(self.seq_len.value)
        state.notify("plan")

    def code(self) -> str:
        """The same estimate in plain Python."""

        source = self._source()
        model = py_repr(source) if isinstance(source, str) else "model"
        gpu = "auto" if self.gpu.value == "detected" else self.gpu.value
        settings = self.settings()
        # what offloading may pin of the host RAM planned for, written as the sum it is
        settings["host_memory"] = _Code(
            f"int({HOST_BUDGET_FRACTION} * {float(self.host_memory.value):g} * 2**30)"
        )
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


class _Code:
    """A value shown in the code preview as the expression that makes it."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _host_gib() -> float:
    """This machine's total RAM in GiB (rounded to 0.1), the host memory a plan states by default."""

    total = host_memory_total()
    return round(total / 2**30, 1) if total else DEFAULT_HOST_GIB


def _quick(name: str) -> bool:
    """Whether `name` is estimated from what fastft ships (a preset or a catalog id), on the spot; any other
    name (a hub id, a folder, or a half-typed word) is looked up once typing pauses."""

    return name in PRESETS or name.lower() in {hub_id.lower() for hub_id in CATALOG}


def _inventory(model):
    return inventory_of(model)


def _smallest_gpu(model, seq_len: int, settings: dict):
    """The GPU preset with the least memory that this plan fits, or None."""

    for gpu in sorted(GPUS.values(), key=lambda g: g.capacity_bytes):
        if fits(model, seq_len, gpu=gpu, **settings).fits:
            return gpu
    return None


def _offline_and_not_cached(name: str) -> None:
    """Offline, a hub id whose config.json is not in the local cache fails here, without importing
    transformers or trying the network more than once (`offline_reason`: one connection per process, made
    only once a hub id is typed; a panel that only sees presets and folders opens no socket)."""

    parts = name.split("/")
    hub_id = len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))
    if not hub_id or Path(name).expanduser().is_dir() or offline_reason() is None:
        return
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
    except Exception:  # noqa: BLE001 - not a valid repo id: the inventory's own error says so
        return
    if not isinstance(cached, str):
        from fastft.models.errors import ModelLoadError

        raise ModelLoadError(offline_fix(name, "config.json"))


def _explain(error: BaseException) -> str:
    """Estimator errors name their fix already; a model that cannot be read offline gets one here."""

    if isinstance(error, KeyError) and error.args:
        return str(error.args[0])
    if isinstance(error, (VramEstimateError, ValueError)):
        return str(error)
    return (
        f"Could not estimate this model ({type(error).__name__}: {error}). Fix: pick an embedded preset or "
        "a catalog model (they need no download), or a local folder with a config.json."
    )


def this_machine_html(precision: str) -> str:
    """One grey line on what runs here, whatever GPU the plan is for: fastft's Triton kernels or the PyTorch
    references they fall back to (and why), and that 4/8-bit runs through bitsandbytes' slow CPU backend
    when there is no CUDA GPU."""

    status = kernel_status()
    parts = ["This machine: " + ("fastft's Triton kernels." if status["triton"] else f"{status['reason']}.")]
    if not torch.cuda.is_available() and weight_formats.from_choice(precision).loader == "bitsandbytes":
        parts.append(f"{precision} here runs through bitsandbytes' CPU backend: it trains, slowly.")
    return f"<span style='color:#666;font-size:12px'>{html.escape(' '.join(parts))}</span>"
