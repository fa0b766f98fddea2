"""`ModelPanel`: pick a model, see what it is and how fastft runs it, load it with LoRA adapters.

Before Load nothing is downloaded: presets and catalog entries are described from their configs
(shapes, parameters, whether each part gets fused kernels); a local folder from its config.json.
Load runs `fastft.load_model` then `fastft.add_lora` on a background thread (`wait()` blocks until
it is done); afterwards the model's real linear layers become the LoRA target checkboxes and the
patch report says what runs on fused kernels.
"""

from __future__ import annotations

import gc
import re
import warnings
from pathlib import Path

import ipywidgets as widgets

import fastft
import fastft.weight_formats as weight_formats
from fastft.models.catalog import CATALOG
from fastft.models.facts import ModelFacts, model_choices, model_facts
from fastft.models.lora import linear_layer_names, trainable_parameter_count
from fastft.models.patch import patch_report, unpatch
from fastft.models.presets import DEFAULT_PRESET, PRESETS
from fastft.runtime.activation_checkpointing import KINDS as CHECKPOINTING_KINDS
from fastft.runtime.activation_checkpointing import Checkpointing
from fastft.runtime.model_state import base_model, state_of
from fastft.studio.facts_html import facts_html, fusion_text, parameter_count_text, unknown_model_hint
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
from fastft.studio.state import PRECISIONS, Debouncer, LoraSettings, StudioState, Worker

__all__ = [
    "ModelFacts",
    "ModelPanel",
    "model_choices",
    "model_facts",
]  # the facts live in fastft.models.facts

_WIDE = LABEL_STYLE


def _number(cls, value, description: str, **bounds):
    """A number field of the panel: a short box (a few digits) behind its label."""
    return cls(
        value=value, description=description, layout=field("14em", max_width="20em"), style=_WIDE, **bounds
    )


class ModelPanel(Panel):
    """Pick and load a model with LoRA adapters; shares what it loads through `StudioState`.

    Controls: ``model_name`` (Combobox of presets and catalog ids; any hub id or folder can be typed),
    ``precision``, ``max_seq_length``, ``rank``, ``alpha``, ``dropout``, ``gradient_checkpointing``,
    ``target_checkboxes`` (filled after Load), ``load_button`` and ``apply_button`` (re-applies LoRA
    with changed settings to the loaded model). Output: ``info`` (the picked model, before Load),
    ``summary`` (the loaded model and its fused kernels), ``status``, ``error``, ``code_view``.
    """

    def __init__(self, state: StudioState | None = None):
        self.state = state if state is not None else StudioState()
        self._worker = Worker("fastft-studio-model")
        self.fused_report = None
        self.linear_layers: list[str] = []
        self._loaded_name: str | None = None
        self._loading = False
        state = self.state
        if state.model_name is None:
            state.model_name = DEFAULT_PRESET
        self._build_model_controls()
        self._build_lora_controls()
        self.status = widgets.HTML()
        self.saved_note = widgets.HTML()  # where the adapter of the model a Load replaced was saved
        self.error = widgets.HTML()
        self._failed_load: tuple[str, str] | None = None  # the (name, precision) a Load error is about
        self.summary = widgets.HTML()
        self.code_view = widgets.HTML()
        self.widget = self._layout()

        self._describe_later = Debouncer(self._describe)
        self.model_name.observe(self._on_pick, names="value")
        for control in (self.precision, self.max_seq_length):
            control.observe(self._on_load_settings, names="value")
        for control in (self.rank, self.alpha, self.dropout, self.gradient_checkpointing):
            control.observe(self._on_lora_settings, names="value")
        self.load_button.on_click(lambda _: self.load())
        self.apply_button.on_click(lambda _: self.apply_lora())
        state.observe(self._on_state, ("model", "plan"))

        self.info.value = facts_html(model_facts(self.model_name.value))
        if state.model is not None:  # a studio re-run on a kept state: show what is loaded
            self._loaded_name = getattr(getattr(state.model, "fastft_info", None), "name", state.model_name)
            self._show_loaded()
        else:
            self._set_targets([])
        self._refresh()

    def _build_model_controls(self) -> None:
        """The model to load, how to load it (precision, max length), Load and Apply LoRA, and its facts."""
        state = self.state
        self.model_name = widgets.Combobox(
            value=state.model_name,
            options=model_choices(),
            placeholder="preset, catalog id, org/name or a local folder",
            description="Model",
            ensure_option=False,
            layout=field("24em", grow=3, max_width="48em"),
            style=_WIDE,
        )
        self.load_button = button(description="Load model", button_style="primary", icon="download")
        self.apply_button = button(
            description="Apply LoRA",
            icon="refresh",
            disabled=True,
            tooltip="Re-apply the adapters with the settings above to the loaded model",
        )
        self.info = widgets.HTML()
        self.precision = widgets.ToggleButtons(
            options=list(PRECISIONS),
            value=state.load_settings.precision,
            description="Precision",
            style=_WIDE,
        )
        self.max_seq_length = _number(
            widgets.BoundedIntText,
            state.load_settings.max_seq_length,
            "Max length",
            min=16,
            max=1 << 20,
            step=64,
        )

    def _build_lora_controls(self) -> None:
        """The LoRA adapters' settings and target layers (their checkboxes filled after Load)."""
        lora = self.state.lora_settings
        self.rank = _number(widgets.BoundedIntText, lora.r, "LoRA rank", min=1, max=4096)
        self.alpha = _number(widgets.BoundedFloatText, lora.alpha, "Alpha", min=0.0, max=65536.0)
        self.dropout = _number(widgets.BoundedFloatText, lora.dropout, "Dropout", min=0.0, max=0.9, step=0.05)
        self.gradient_checkpointing = widgets.Dropdown(
            options=[(Checkpointing(kind).label, kind) for kind in CHECKPOINTING_KINDS],
            value=lora.gradient_checkpointing,
            description="Checkpointing",
            layout=field("22em", max_width="36em"),
            style=_WIDE,
        )
        self.target_checkboxes: dict[str, widgets.Checkbox] = {}
        self.targets = widgets.HBox(layout=widgets.Layout(flex_flow="row wrap", flex="1 1 20em"))
        self.targets_note = widgets.HTML()

    def _layout(self) -> widgets.VBox:
        return widgets.VBox(
            [
                widgets.HTML("<b>1. Pick a model</b>"),
                row([self.model_name, self.load_button, self.apply_button]),
                self.info,
                row([self.precision, self.max_seq_length]),
                widgets.HTML("<b>LoRA adapters</b>"),
                row([self.rank, self.alpha, self.dropout]),
                row([self.gradient_checkpointing]),  # `field` flexes along a row, never a column's height
                row([widgets.Label("Targets", layout=widgets.Layout(width="9em")), self.targets]),
                self.targets_note,
                self.status,
                self.saved_note,
                self.error,
                self.summary,
                code_section(self.code_view),
            ]
        )

    # ------------------------------------------------------------------------------------------ actions

    def load(self) -> bool:
        """Start loading the picked model with LoRA adapters on a background thread.

        Returns False (and starts nothing) while a load is already running. `wait` blocks until done.
        """
        name = self.model_name.value.strip()
        self.error.value = ""
        self._failed_load = None
        if not name:
            self.error.value = error_html(unknown_model_hint(""), "No model")
            return False
        if not (self._check_idle() and self._check_targets()):
            return False
        if not self._worker.start(lambda: self._load_job(name)):
            self.status.value = status_html("A load is already running; wait for it to finish.", "warn")
            return False
        return True

    def apply_lora(self) -> bool:
        """Re-apply LoRA with the current settings to the loaded model (on the background thread)."""
        self.error.value = ""
        if self.state.model is None:
            self.error.value = error_html("Load a model first (Load model).", "No model loaded")
            return False
        if not (self._check_idle() and self._check_targets()):
            return False
        return self._worker.start(self._apply_job)

    def _check_idle(self) -> bool:
        """False (with the reason shown) while a run is training the loaded model."""
        run = self.state.run
        if run is not None and getattr(run, "active", False):
            self.error.value = error_html(
                "A run is training the loaded model: stop it in the Run tab before loading another "
                "model or changing its adapters.",
                "Run in progress",
            )
            return False
        return True

    def _check_targets(self) -> bool:
        if self.state.lora_settings.target_modules == []:
            self.error.value = error_html(
                "No LoRA target is ticked: tick at least one linear layer (all of them is the usual choice).",
                "LoraTargetError",
            )
            return False
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a running load finishes; False if `timeout` seconds passed first."""
        return self._worker.wait(timeout)

    @property
    def busy(self) -> bool:
        return self._worker.busy

    def code(self) -> str:
        """The plain-Python calls that the current settings stand for (copy-paste into a cell)."""
        settings = self.state.load_settings
        lora = self._lora_settings()
        name = py_repr(self.model_name.value.strip())
        load = call_code("model, tokenizer", "fastft.load_model", [name], settings.load_kwargs)
        adapters = call_code("model", "fastft.add_lora", ["model"], lora.add_lora_kwargs)
        return f"import fastft\n\n{load}\n{adapters}\n"

    # ------------------------------------------------------------------------------------------ jobs

    def _load_job(self, name: str) -> None:
        """Load `name` beside the current model and swap only once it has loaded: a failed Load keeps
        what was loaded (and trained). A trained, unsaved adapter is saved first, and where is said."""

        state = self.state
        settings = state.load_settings
        lora = self._lora_settings()
        previous, previous_name = state.model, self._loaded_name
        self._busy(True, f"Loading {name} ({settings.precision}) and adding LoRA adapters…")
        try:
            try:
                saved = self._save_unsaved(name)
            except Exception as error:  # noqa: BLE001 - nothing is loaded over an adapter we could not keep
                self.error.value = error_html(
                    f"The trained adapter of {previous_name} could not be saved ({type(error).__name__}: "
                    f"{error}), so {name} was not loaded and {previous_name} stays. Fix: save it in the Export "
                    "tab, or set the Run tab's output dir to a folder that can be written.",
                    "Unsaved training kept",
                )
                return
            if saved:
                self.saved_note.value = status_html(
                    f"The adapter trained on {previous_name} was saved to {saved} before loading {name} "
                    f"(reload it with PeftModel.from_pretrained(base, {py_repr(saved)})).",
                    "ok",
                )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model, tokenizer = fastft.load_model(name, **settings.load_kwargs)
                model = fastft.add_lora(model, **lora.add_lora_kwargs)
        except Exception as error:  # noqa: BLE001 - every failure is shown in the panel, none raised
            kept = f" {previous_name} is still loaded." if previous is not None and previous_name else ""
            self.error.value = error_html(
                f"{_message(error)}{kept}", f"{type(error).__name__} (nothing changed)"
            )
            self._failed_load = (name, settings.precision)
            return
        finally:
            self._busy(False)
        self._release_model()
        state.model, state.tokenizer = model, tokenizer
        self._loaded_name = name
        self._show_loaded(_notes(caught))
        state.notify("model")

    def _save_unsaved(self, next_name: str) -> str | None:
        """Save the loaded model's adapter when a run trained it and nothing holds that training yet;
        the folder it went to, or None when there was nothing to save."""

        state = self.state
        steps = state.unsaved_steps()
        if not steps:
            return None
        output_dir = getattr(getattr(state.run, "config", None), "output_dir", None) or "runs/studio"
        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", self._loaded_name or "model").strip("-")
        folder = Path(output_dir).expanduser() / f"adapter-{stem}-step{steps}"
        index = 1
        while folder.exists():
            index += 1
            folder = folder.with_name(f"adapter-{stem}-step{steps}-{index}")
        self._busy(
            True,
            f"Saving the adapter trained on {self._loaded_name} ({steps} steps) before loading {next_name}…",
        )
        path = fastft.save_adapter(state.model, str(folder), state.tokenizer)
        state.mark_saved(str(path))
        return str(path)

    def _apply_job(self) -> None:
        state = self.state
        lora = self._lora_settings()
        self._busy(True, "Re-applying LoRA adapters…")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                base = state.model
                if hasattr(base, "get_base_model"):  # a PeftModel: take its adapters off first
                    unpatch(base)
                    base = base.unload()
                    state.model = None  # the old PeftModel no longer holds adapters
                state.model = fastft.add_lora(base, **lora.add_lora_kwargs)
            self._show_loaded(_notes(caught))
            state.notify("model")
        except Exception as error:  # noqa: BLE001
            self.error.value = error_html(error)
            if state.model is None:  # half-done: nothing usable is left, so say so everywhere
                self._loaded_name = None
                self.summary.value = ""
                state.notify("model")
        finally:
            self._busy(False)

    def _release_model(self) -> None:
        """Drop the previous model once the next one has loaded, and give its GPU memory back (the state
        is told once, when the new model is in place)."""
        if self.state.model is None:
            return
        self.state.model = self.state.tokenizer = None
        self.fused_report = None
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass

    # ------------------------------------------------------------------------------------------ display

    def _busy(self, busy: bool, message: str = "") -> None:
        self._loading = busy
        self.load_button.disabled = busy
        self.apply_button.disabled = busy or self.state.model is None
        if busy:
            self.status.value = status_html(message, "busy")
        else:
            self._refresh()

    def _show_loaded(self, notes: list[str] = ()) -> None:
        model = self.state.model
        base = base_model(model)
        self.linear_layers = linear_layer_names(base)
        chosen = getattr(getattr(state_of(model), "lora", None), "target_modules", None)
        self._set_targets(self.linear_layers, chosen)
        self.fused_report = patch_report(model)
        info = getattr(model, "fastft_info", None)
        trainable, total = trainable_parameter_count(model)
        config = base.config
        device = next(model.parameters()).device
        rows = [
            ("loaded", f"{self._loaded_name} ({info.source if info else '?'}), {config.model_type}"),
            (
                "weights",
                f"{_dtype_name(info)} on {device.type}; {parameter_count_text(total - trainable)} parameters, "
                f"{getattr(config, 'num_hidden_layers', '?')} layers, vocab {getattr(config, 'vocab_size', '?')}",
            ),
        ]
        lora = getattr(state_of(model), "lora", None)
        if lora is not None:
            rows.append(
                (
                    "LoRA",
                    f"r={lora.r}, alpha={lora.alpha:g}, dropout={lora.dropout:g} on {', '.join(lora.target_modules)}: "
                    f"{parameter_count_text(trainable)} trainable ({trainable / max(total, 1):.2%})",
                )
            )
        rows.append(("fused kernels", self._fused_text(device)))
        rows += [("note", note) for note in notes]
        self.summary.value = facts_table(rows)
        self.apply_button.disabled = False
        self._refresh()

    def _fused_text(self, device) -> str:
        report = self.fused_report
        if report is None:
            return "✗ not fused (add_lora(fused=False)): transformers' modules"
        names = {
            "rms_norm": "RMSNorm",
            "attention": "attention blocks",
            "mlp": "MLPs",
            "cross_entropy": "cross-entropy",
        }
        done = ", ".join(
            f"{count} {names.get(kind, kind)}" if kind != "cross_entropy" else names[kind]
            for kind, count in report.fused.items()
        )
        text = fusion_text([done] if done else [], list(report.not_fused))
        if device.type != "cuda" and report.fused:
            text += " (on the CPU each fused module runs its PyTorch reference; Triton runs on a GPU)"
        return text

    def _set_targets(self, names: list[str], chosen=None) -> None:
        chosen = set(names if chosen is None else chosen)
        for box in self.target_checkboxes.values():
            box.close()
        self.target_checkboxes = {
            name: widgets.Checkbox(
                value=name in chosen,
                description=name,
                indent=False,
                layout=widgets.Layout(width="auto", min_width="10em"),
            )
            for name in names
        }
        for box in self.target_checkboxes.values():
            box.observe(self._on_lora_settings, names="value")
        self.targets.children = list(self.target_checkboxes.values())
        self.targets_note.value = (
            ""
            if names
            else status_html("Every linear layer is targeted; the model's own layers appear here after Load.")
        )

    def _refresh(self) -> None:
        """Write the controls into the shared state and update the code preview and hints."""
        self.code_view.value = code_html(self.code())
        notes = []
        if weight_formats.from_choice(self.precision.value).loader == "bitsandbytes" and not _cuda():
            notes.append(
                f"No CUDA GPU: {self.precision.value} runs through bitsandbytes' CPU backend, which is slow "
                "(16-bit is faster here)."
            )
        lora = getattr(state_of(self.state.model), "lora", None)
        if lora is not None and self._lora_differs(lora):
            notes.append("LoRA settings changed: click Apply LoRA to re-apply them to the loaded model.")
        if self._loaded_name and self.model_name.value.strip() != self._loaded_name:
            notes.append(
                f"{self._loaded_name} is loaded; click Load model to load {self.model_name.value.strip()}."
            )
        if self._loading:
            return
        if notes:
            self.status.value = "".join(status_html(n, "warn") for n in notes)
        elif self._loaded_name and self.state.model is not None:
            self.status.value = status_html(f"Loaded {self._loaded_name}.", "ok")
        else:
            self.status.value = ""

    def _lora_differs(self, loaded) -> bool:
        current = self._lora_settings()
        targets = current.target_modules if current.target_modules is not None else self.linear_layers
        return (
            loaded.r != current.r
            or loaded.alpha != float(current.alpha)
            or loaded.dropout != float(current.dropout)
            or loaded.gradient_checkpointing != Checkpointing.parse(current.gradient_checkpointing)
            or set(loaded.target_modules) != set(targets or ())
        )

    def _lora_settings(self) -> LoraSettings:
        return self.state.lora_settings

    # ------------------------------------------------------------------------------------------ events

    def _clear_failed_load(self) -> None:
        """A failed Load's error goes once another model or precision is picked (the loaded one again, say):
        it spoke of a load that is no longer asked for."""
        picked = (self.model_name.value.strip(), self.precision.value)
        if self._failed_load is not None and picked != self._failed_load:
            self._failed_load = None
            self.error.value = ""

    def _on_pick(self, change) -> None:
        name = (change["new"] or "").strip()
        self._clear_failed_load()
        self.state.model_name = name
        if name != self._loaded_name and self.target_checkboxes:
            self._set_targets([])  # another model: its layers are known after Load
            self._write_lora()
        self._describe_later.cancel()
        if _quick(name):
            self.info.value = facts_html(model_facts(name))
        else:  # a folder's config is read on a timer thread once typing pauses, never per keystroke
            self._describe_later(name)
        self.state.notify("model_name")
        self._refresh()

    def _describe(self, name: str) -> None:
        if (self.model_name.value or "").strip() != name:
            return
        try:
            html = facts_html(model_facts(name))
        except Exception as error:  # noqa: BLE001 - a description must never break the picker
            html = status_html(f"{name}: {type(error).__name__}: {error}", "warn")
        if (self.model_name.value or "").strip() == name:
            self.info.value = html

    def _on_load_settings(self, _change=None) -> None:
        self._clear_failed_load()
        settings = self.state.load_settings
        settings.precision = self.precision.value
        settings.max_seq_length = int(self.max_seq_length.value)
        self.state.notify("load_settings")
        self._refresh()

    def _on_lora_settings(self, _change=None) -> None:
        self._write_lora()
        self._refresh()

    def _write_lora(self) -> None:
        lora = self.state.lora_settings
        lora.r = int(self.rank.value)
        lora.alpha = float(self.alpha.value)
        lora.dropout = float(self.dropout.value)
        lora.gradient_checkpointing = self.gradient_checkpointing.value
        if self.target_checkboxes:
            chosen = [name for name, box in self.target_checkboxes.items() if box.value]
            lora.target_modules = None if len(chosen) == len(self.target_checkboxes) else chosen
        else:
            lora.target_modules = None
        self.state.notify("lora_settings")

    def _on_state(self, name: str) -> None:
        if name == "plan":  # the VRAM tab's "Use in Model tab": its settings become these controls
            state = self.state
            name, load, lora = state.model_name, state.load_settings, state.lora_settings
            plan = (load.precision, int(load.max_seq_length), int(lora.r), lora.gradient_checkpointing)
            if name and self.model_name.value.strip() != name:  # each control writes the state back as it
                self.model_name.value = name  # changes, so the plan is read first
            self.precision.value, self.max_seq_length.value = plan[0], plan[1]
            self.rank.value, self.gradient_checkpointing.value = plan[2], plan[3]
            self.status.value = status_html(
                "Settings taken from the VRAM tab's plan: click Load model (or Apply LoRA) to use them.",
                "info",
            )
            return
        if name == "model" and self.state.model is None and not self._loading:
            self.summary.value = ""
            self.apply_button.disabled = True


def _quick(name: str) -> bool:
    """Whether `name` is described from memory (a preset or a catalog id, or plainly neither)."""

    return name in PRESETS or name in CATALOG or "/" not in name and not name.startswith((".", "~"))


def _message(error: BaseException) -> str:
    text = str(error) or repr(error)
    if isinstance(error, KeyError) and text.startswith(("'", '"')):
        text = text[1:-1]
    return text


def _notes(caught) -> list[str]:
    """Warnings raised while loading, as notes (the fused report already says what is not fused)."""
    notes = []
    for warning in caught:
        if type(warning.message).__name__ == "UnfusedWarning":
            continue
        text = str(warning.message)
        if text not in notes and issubclass(warning.category, UserWarning):
            notes.append(text)
    return notes


def _dtype_name(info) -> str:
    if info is None:
        return "?"
    if info.quantization:
        return weight_formats.get(info.quantization).label
    return str(info.dtype).removeprefix("torch.")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
