"""The studio's Run tab: `RunPanel` starts a run and watches it.

A run trains in a child process by default (`fastft.studio.process_run.ProcessRun`: the run goes on through
a kernel restart, and a studio opened later follows it again), or in this kernel (`fastft.studio.run_control.Run`:
the model object holds the trained weights at once), or on every GPU through torchrun
(`fastft.studio.launched.LaunchedRun`). `RunPanel` never touches widgets from inside a training step: events
are appended to ``run.events`` (a list, cheap), and a `Ticker` thread drains them a few times a second into
bounded float32 series (`SeriesBuffer`) that the live plots show. The Runs view (`fastft.studio.runs`) lists
the runs folder's runs and resumes any checkpoint.
"""

from __future__ import annotations

import contextlib
import html
import math
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import ipywidgets as widgets
import torch

from fastft.data.pairs import PackedPairs
from fastft.data.rewards import RewardError, check_columns
from fastft.report.figures import phases_figure, run_dashboard_figure
from fastft.studio.grpo import GRPOControls, grpo_figure, reward_functions, rollout_html
from fastft.studio.launched import LaunchedRun, launch_choices
from fastft.studio.live import (
    DISPLAY_INTERVAL,
    WIDGET_INTERVAL,
    Ema,
    LiveFigure,
    SeriesBuffer,
    Ticker,
    frontend,
)
from fastft.studio.notices import (
    Panel,
    StatusLog,
    button,
    call_code,
    code_section,
    error_html,
    field,
    py_repr,
    row,
    status_html,
)
from fastft.studio.preference import preference_figure
from fastft.studio.process_run import ProcessRun
from fastft.studio.run_control import Run, RunLifecycle, explain
from fastft.studio.runs import RunsView
from fastft.studio.state import StudioState
from fastft.training.events import EvalEvent, StepEvent
from fastft.training.objectives.preference import DEFAULT_BETA
from fastft.training.timing import phase_table
from fastft.training.tracking import make_trackers, tracking_problems
from fastft.training.trainer import TrainConfig

# Function-local imports: tests replace these names on their modules, so they are looked up when called.

__all__ = [
    "METHODS",
    "Run",
    "RunPanel",
    "explain",
]  # Run and explain: imported here before run_control existed

# The Run tab's method choice: value → label. The preference methods train on pairs (the Data tab packs them
# with `fastft.pack_pairs`); GRPO on the loaded rows' prompts, scored by the chosen rewards
# (`fastft.studio.grpo`).
METHODS = {"sft": "SFT", "dpo": "DPO", "orpo": "ORPO", "simpo": "SimPO", "grpo": "GRPO"}
PREFERENCE_METHODS = ("dpo", "orpo", "simpo")
DPO_LOSSES = {"sigmoid": "sigmoid", "ipo": "IPO", "robust": "robust"}
# Where Start trains: value → label.
TRAIN_IN = {"process": "a child process", "kernel": "this kernel"}


def _notice(text: str, kind: str = "info", title: str | None = None) -> str:
    if not text:
        return ""
    return error_html(text, title) if kind == "error" else status_html(text, kind)


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class RunPanel(Panel):
    """Hyperparameters, Start / Pause / Stop / Save, live plots and the step timing of a run.

    Reads the model, tokenizer and packed data from `state` (an ``eval_packed`` attribute on the state,
    when present, is the eval set). Controls: `steps`, `learning_rate`, `micro_batch_bins`,
    `grad_accum_steps`, `warmup` (a share of the steps below 1, else a step count), `eval_every` and
    `save_every` (0: off), `output_dir`; buttons `start_button`, `pause_button` (Pause / Resume),
    `stop_button`, `save_button`. `code()` is the same run in plain Python. `live` chooses how plots
    update ("widget", "display", "text"; default: `fastft.studio.live.frontend()`). `processes`: on a
    machine with several GPUs the run goes to "this kernel" or to every GPU through torchrun
    (`fastft.studio.launched.LaunchedRun`); the choices are `launch_choices()` unless given.
    `train_in`: "process" (a child process, the default: `ProcessRun`) or "kernel" (`Run`); `threads`: CPU
    threads, "auto" (timed as the demo does) or a count; `tensorboard` / `wandb`: log the run there too.
    `runs` is the Runs view (`fastft.studio.runs.RunsView`). Opened with no run in its state, the panel
    follows the newest run still going in the runs folder (the folder above the output dir).
    """

    TIMING_EVERY = 5.0  # seconds between redraws of the step-timing figure and table
    TIMING_STEPS = 120  # steps shown in the step-timing bars (the latest ones)
    TEXT_EVERY = 10.0  # seconds between status lines printed without a notebook

    def __init__(
        self,
        state: StudioState | None = None,
        *,
        live: str | None = None,
        max_points: int = 2000,
        processes: list[tuple[str, int]] | None = None,
    ):
        self.state = state if state is not None else StudioState()
        self.run: Run | None = None
        self.mode = live or frontend()
        self._lock = threading.RLock()
        self._ticker = None
        self._closed = False
        self._seen = 0
        self._last_timing = 0.0
        self._last_text = 0.0
        self._shown_status = ""  # the run's status as last said (a change is shown once)
        self.series = SeriesBuffer(
            ("loss", "smoothed", "learning_rate", "tokens_per_second", "memory_gib"), max_points
        )
        self.eval_series = SeriesBuffer(("eval_loss",), max_points)
        self.preference_series = SeriesBuffer(
            ("rewards_chosen", "rewards_rejected", "margin", "accuracy"), max_points
        )
        self.max_points = max_points
        self.grpo_series = SeriesBuffer(("reward", "kl", "completion_length", "accuracy"), max_points)
        self._grpo_rewards: list[str] = []  # the running GRPO run's reward names, as its series hold them
        self._shown_rollout = None
        self._ema = Ema(0.9)

        style = {"description_width": "11em"}  # "grad accumulation", "eval every (0: end)" in full

        def wide():  # each control its own Layout: hiding one (per method) must not hide the others
            return field("18em", max_width="28em")

        self._default_beta = DEFAULT_BETA
        self.method = widgets.Dropdown(
            options=[(label, key) for key, label in METHODS.items()],
            value="sft",
            description="method",
            style=style,
            layout=wide(),
        )
        self.beta = widgets.BoundedFloatText(
            value=DEFAULT_BETA["dpo"],
            min=1e-6,
            max=1000,
            step=0.05,
            description="beta",
            style=style,
            layout=field("18em", max_width="28em"),  # its own: hidden for SFT, the others not
        )
        self.dpo_loss = widgets.Dropdown(
            options=[(label, key) for key, label in DPO_LOSSES.items()],
            value="sigmoid",
            description="DPO loss",
            style=style,
            layout=field("18em", max_width="28em"),
        )
        self.grpo = GRPOControls(style, wide)
        self.steps = widgets.BoundedIntText(
            value=60, min=1, max=10_000_000, description="steps", style=style, layout=wide()
        )
        self.learning_rate = widgets.FloatText(
            value=2e-4, description="learning rate", style=style, layout=wide()
        )
        self.micro_batch_bins = widgets.BoundedIntText(
            value=1, min=1, max=1024, description="micro-batch bins", style=style, layout=wide()
        )
        self.grad_accum_steps = widgets.BoundedIntText(
            value=1, min=1, max=1024, description="grad accumulation", style=style, layout=wide()
        )
        self.warmup = widgets.BoundedFloatText(
            value=0.05, min=0.0, max=1_000_000, step=0.01, description="warmup", style=style, layout=wide()
        )
        # ipywidgets 8 calls it `tooltip`, 7.x `description_tooltip`
        tip = "tooltip" if "tooltip" in self.warmup.traits() else "description_tooltip"
        setattr(self.warmup, tip, "below 1: a share of the steps; 1 or more: a number of steps")
        self.eval_every = widgets.BoundedIntText(
            value=0, min=0, max=10_000_000, description="eval every (0: end)", style=style, layout=wide()
        )
        self.save_every = widgets.BoundedIntText(
            value=0, min=0, max=10_000_000, description="save every (0: off)", style=style, layout=wide()
        )
        self.output_dir = widgets.Text(
            value="runs/studio", description="output dir", style=style, layout=wide()
        )
        self.train_in = widgets.Dropdown(
            options=[(label, key) for key, label in TRAIN_IN.items()],
            value="process",
            description="train in",
            style=style,
            layout=field("24em", max_width="32em"),  # its choices' names in full
        )
        setattr(
            self.train_in,
            tip,
            "a child process: the run goes on if the kernel restarts; this kernel: the model object is trained",
        )

        from fastft.runtime.threads import TORCH_DEFAULT_THREADS

        thread_choices = [("auto (timed)", "auto"), ("1", 1)]
        if TORCH_DEFAULT_THREADS > 1:
            thread_choices.append((f"{TORCH_DEFAULT_THREADS} (torch's default)", TORCH_DEFAULT_THREADS))
        self.threads = widgets.Dropdown(
            options=thread_choices,
            value="auto",
            description="CPU threads",
            style=style,
            layout=field("24em", max_width="32em"),
        )
        setattr(
            self.threads, tip, "auto: a micro-batch timed at 1 thread and at torch's default, the faster kept"
        )
        if torch.cuda.is_available():
            self.threads.layout.display = "none"  # a GPU run: the thread count hardly matters
        self.tensorboard = widgets.Checkbox(
            value=False, description="TensorBoard", indent=False, layout=field("9em", grow=0)
        )
        self.wandb = widgets.Checkbox(
            value=False, description="W&B", indent=False, layout=field("6em", grow=0)
        )

        choices = launch_choices() if processes is None else processes
        # "this kernel", or every GPU through torchrun (`fastft.studio.launched`); shown only with a choice
        self.processes = widgets.Dropdown(
            options=choices, value=choices[0][1], description="processes", style=style, layout=wide()
        )
        if len(choices) < 2:
            self.processes.layout.display = "none"
        self.start_button = button(description="Start", icon="play", button_style="success")
        self.pause_button = button(description="Pause", icon="pause", disabled=True)
        self.stop_button = button(description="Stop", icon="stop", button_style="danger", disabled=True)
        self.save_button = button(description="Save checkpoint", icon="save", disabled=True)
        # no side margins: at 100 % width they would push the bar past the tab's edge
        self.progress = widgets.IntProgress(
            value=0, min=0, max=1, layout=widgets.Layout(width="100%", margin="2px 0")
        )
        self.progress_text = widgets.HTML("")
        self.checks = widgets.HTML("")  # what cannot work (or looks wrong) with these settings, before Start
        self.where = widgets.HTML("")  # where the run trains: this kernel, or a child process (pid, log)
        self.log = StatusLog()
        self.status = self.log.widget
        self.code_preview = widgets.HTML("")
        self.plots = LiveFigure(run_dashboard_figure(), self.mode)
        self.preference_plots = LiveFigure(preference_figure(), self.mode)
        self.grpo_plots = LiveFigure(grpo_figure(), self.mode)
        self.rollouts = widgets.HTML("")  # the latest rollout: prompts, completions, rewards, advantages
        self.timing_figure = LiveFigure(phases_figure([], []), self.mode)
        self.timing_table = widgets.HTML("")

        self._controls = [
            self.method,
            self.beta,
            self.dpo_loss,
            *self.grpo.widgets,
            self.steps,
            self.learning_rate,
            self.micro_batch_bins,
            self.grad_accum_steps,
            self.warmup,
            self.eval_every,
            self.save_every,
            self.output_dir,
            self.train_in,
            self.threads,
            self.tensorboard,
            self.wandb,
            self.processes,
        ]
        kept = self.state.run_settings  # the last studio's values: a re-run cell keeps them
        for control in self._controls:
            name = control.description
            if name in kept:
                with contextlib.suppress(Exception):  # a value it no longer takes: its default stays
                    control.value = kept[name]
            control.observe(self._on_setting, names="value")
        self.method.observe(self._on_method, names="value")
        self._show_method_controls()
        self.start_button.on_click(self._on_start)
        self.pause_button.on_click(self._on_pause)
        self.stop_button.on_click(self._on_stop)
        self.save_button.on_click(self._on_save)
        self.state.observe(
            self._on_state,
            (
                "model",
                "model_name",
                "load_settings",
                "lora_settings",
                "rows",
                "packed",
                "pack_settings",
                "run",
            ),
        )

        settings = widgets.VBox(
            [
                widgets.HTML("<b>Hyperparameters</b>"),
                row([*self._controls]),
            ]
        )
        buttons = row([self.start_button, self.pause_button, self.stop_button, self.save_button])
        timing = widgets.VBox(
            [
                widgets.HTML("<b>Step timing</b> (ms per phase, latest steps)"),
                self.timing_figure.widget,
                self.timing_table,
            ]
        )
        code = code_section(self.code_preview)

        self.runs = RunsView(self)
        self.widget = widgets.VBox(
            [
                settings,
                self.checks,
                buttons,
                self.where,
                self.progress,
                self.progress_text,
                self.status,
                self.plots.widget,
                self.preference_plots.widget,
                self.grpo_plots.widget,
                self.rollouts,
                timing,
                self.runs.widget,
                code,
            ]
        )
        self._update_preview()
        self._update_checks()
        self._update_buttons()
        if isinstance(self.state.run, RunLifecycle):  # a studio shown again: watch the state's run
            self._attach(self.state.run)
        else:
            self._follow_running()
        self._update_where()

    def _follow_running(self) -> None:
        """Follow the newest run still going in the runs folder (a kernel restarted, a second notebook)."""
        going = [info for info in self.runs.refresh() if info.active]
        if not going:
            return
        info = going[0]
        try:
            run = ProcessRun.attach(info.folder)
        except Exception as error:  # noqa: BLE001 - the studio opens either way
            self._show(f"Could not follow the run in {info.folder}: {error}", "error", "Runs")
            return
        self.follow(run)
        self._show(
            f"Following the run in {info.folder} ({info.status}, pid {info.pid}), started before.", "info"
        )

    def follow(self, run: RunLifecycle) -> None:
        """Show `run` here (its curves from its first event, then live) and make it the state's run."""
        self.state.run = run
        self._attach(run)
        self.state.notify("run")

    # -- settings and code ---------------------------------------------------------------------------
    def train_config(self):
        """The `TrainConfig` the controls describe, a `GRPOConfig` for GRPO (its errors name the field and
        the fix)."""
        if self.method.value == "grpo":
            from fastft.training.objectives.grpo import GRPOConfig

            return GRPOConfig(**self._config_kwargs())

        return TrainConfig(**self._config_kwargs())

    def _config_kwargs(self) -> dict:
        warmup = float(self.warmup.value)
        kwargs = dict(
            max_steps=int(self.steps.value),
            learning_rate=float(self.learning_rate.value),
            micro_batch_bins=int(self.micro_batch_bins.value),
            grad_accum_steps=int(self.grad_accum_steps.value),
            warmup=int(warmup) if warmup >= 1 else warmup,
            eval_every=int(self.eval_every.value) or None,
            save_every=int(self.save_every.value) or None,
            output_dir=self.output_dir.value.strip() or None,
        )
        method = self.method.value
        if method == "grpo":  # a rollout is one micro-batch set of its own; GRPO has no eval loss
            for name in ("micro_batch_bins", "grad_accum_steps", "eval_every"):
                del kwargs[name]
            return kwargs | self.grpo.config_kwargs()
        if method != "sft":
            kwargs["method"] = method
            kwargs["beta"] = float(self.beta.value)
            if method == "dpo":
                kwargs["dpo_loss"] = self.dpo_loss.value
        return kwargs

    @property
    def preference(self) -> bool:
        """Whether the chosen method trains on preference pairs (DPO, ORPO, SimPO)."""
        return self.method.value in PREFERENCE_METHODS

    def _on_method(self, change) -> None:
        new, old = self._default_beta.get(change["new"]), self._default_beta.get(change["old"])
        if new is not None and (old is None or float(self.beta.value) == old):
            self.beta.value = new  # each method's usual beta, unless the user chose another
        self._show_method_controls()

    def _show_method_controls(self) -> None:
        method = self.method.value
        grpo = method == "grpo"
        self.beta.layout.display = None if self.preference else "none"
        self.dpo_loss.layout.display = None if method == "dpo" else "none"
        self.grpo.show(grpo)
        for control in (self.micro_batch_bins, self.grad_accum_steps, self.eval_every):
            control.layout.display = "none" if grpo else None
        self.preference_plots.widget.layout.display = None if self.preference else "none"
        self.grpo_plots.widget.layout.display = None if grpo else "none"
        self.rollouts.layout.display = None if grpo else "none"

    def code(self) -> str:
        """The plain-Python equivalent of this run, from loading the model to training (runs as is)."""

        state = self.state
        name = self._model_name()
        pack = state.pack_settings
        seq = getattr(state.packed, "max_seq_length", None) or pack.max_seq_length
        config = self._config_kwargs()
        lines = [
            "import fastft",
            "",
            call_code(
                "model, tokenizer",
                "fastft.load_model",
                [py_repr(name or "<model name>")],
                state.load_settings.load_kwargs,
            ),
            call_code("model", "fastft.add_lora", ["model"], state.lora_settings.add_lora_kwargs),
            call_code(
                "rows",
                "fastft.load_dataset",
                [py_repr(state.dataset_name or "bundled:skills")],
                {"format": pack.format} if pack.format != "auto" else {},
            ),
        ]
        if pack.chat_template != "tokenizer":
            lines.append(f"# chat template: {pack.chat_template} (as chosen in the Data tab)")
        if self.method.value == "grpo":
            from fastft.studio.grpo import REWARDS

            made = ", ".join(REWARDS[key][1] for key in self.grpo.reward_keys)
            lines.append(f"rewards = [{made}]")
            shown = {"temperature": 1.0, "kl_coef": 0.0}  # GRPOConfig's defaults: left out of the call
            lines.append(
                call_code(
                    "result",
                    "fastft.grpo",
                    ["model", "tokenizer", "rows", "rewards"],
                    {k: v for k, v in config.items() if v is not None and not (k in shown and shown[k] == v)},
                )
            )
            lines.append(
                "print(result.steps[-1].grpo)  # reward (per function), KL, completion length, accuracy"
            )
            return "\n".join(lines) + "\n"
        if self.preference:
            lines.append(
                call_code("data", "fastft.pack_pairs", ["rows", "tokenizer"], {"max_seq_length": int(seq)})
            )
        else:
            train_on = {"train_on": pack.train_on} if pack.train_on != "responses" else {}
            lines.append(
                call_code(
                    "data", "fastft.pack", ["rows", "tokenizer"], {"max_seq_length": int(seq), **train_on}
                )
            )
        lines.append(
            call_code(
                "result",
                "fastft.train",
                ["model", "tokenizer", "data"],
                self._train_kwargs(),
            )
        )
        lines.append('print(f"final loss {result.final_loss:.4f}")')
        if self.in_process:
            lines.insert(
                0,
                "# the studio runs this in a child process (python -m fastft.studio.worker <output dir>): the "
                "run goes on if the kernel restarts",
            )
        if self.processes.value > 1:
            lines.insert(
                0,
                f"# on {self.processes.value} processes: save as train.py and run "
                f"`fastft launch --gpus {self.processes.value} train.py` (the studio writes and runs its own)",
            )
        if self.preference:
            lines.append("print(result.steps[-1].preference)  # rewards chosen/rejected, margin, accuracy")
        return "\n".join(lines) + "\n"

    _TRAIN_DEFAULTS = {"grad_accum_steps": 1, "micro_batch_bins": 1, "eval_every": None, "save_every": None}

    def _train_kwargs(self) -> dict:
        """`fastft.train`'s keyword arguments for these settings, its defaults left out (the Python section's
        call, and the script of a run on several processes)."""
        defaults = self._TRAIN_DEFAULTS
        return {k: v for k, v in self._config_kwargs().items() if not (k in defaults and defaults[k] == v)}

    def _model_name(self) -> str | None:
        state = self.state
        return state.model_name or getattr(getattr(state.model, "fastft_info", None), "name", None)

    def _update_preview(self) -> None:
        try:
            from fastft.studio.notices import code_html

            self.code_preview.value = code_html(self.code())
        except Exception as error:  # noqa: BLE001 - a preview must never break the panel
            self.code_preview.value = _notice(f"(no preview: {error})", "warn")

    def _on_setting(self, change=None) -> None:
        if change is not None:
            self.state.run_settings[change["owner"].description] = change["new"]
        self._update_preview()
        self._update_checks()
        if self.run is None or not self.run.active:
            self._update_where()

    def problems(self) -> list[tuple[str, str]]:
        """What cannot work with these settings ("error": Start refuses) or looks like a mistake ("warn"),
        each with its fix; checked on every change, before Start."""
        found: list[tuple[str, str]] = []
        try:
            config = self.train_config()
        except Exception as error:  # noqa: BLE001 - TrainConfig's own checks name the field and the fix
            return [("error", str(error))]
        steps = config.max_steps
        warmup = config.warmup if isinstance(config.warmup, int) else round(config.warmup * steps)
        if warmup >= steps:
            found.append(
                (
                    "error",
                    f"warmup is {warmup} steps, as long as the whole run ({steps} steps): the learning rate never "
                    f"reaches its peak. Fix: fewer warmup steps than {steps}, or a share below 1 (0.05).",
                )
            )
        found += self._data_problems(config.method)
        packed = self.state.packed
        bins = len(packed) if packed is not None and hasattr(packed, "__len__") else None
        per_step = config.micro_batch_bins * config.grad_accum_steps
        if config.method != "grpo" and bins is not None and per_step > bins:
            found.append(
                (
                    "error",
                    f"one step takes {config.micro_batch_bins} micro-batch bins × {config.grad_accum_steps} "
                    f"accumulation = {per_step} bins, but the packed data has only {bins}: a step would train "
                    f"the same bins twice. Fix: at most {bins} bins per step, or a shorter max length in the "
                    "Data tab (more, smaller bins).",
                )
            )
        if config.save_every and not config.output_dir:
            found.append(("error", "save every is set but output dir is empty. Fix: name an output dir."))
        if config.save_every and config.save_every > steps:
            found.append(
                (
                    "warn",
                    f"save every {config.save_every} is longer than the run ({steps} steps): one checkpoint, at the end.",
                )
            )
        if config.eval_every and config.eval_every > steps:
            found.append(
                (
                    "warn",
                    f"eval every {config.eval_every} is longer than the run ({steps} steps): evaluation runs at the end only.",
                )
            )
        if config.eval_every and getattr(self.state, "eval_packed", None) is None:
            found.append(("warn", "eval every is set but there is no eval set: no evaluation will run."))
        found += self._launch_problems(config)
        found += self._where_problems(config)
        return found

    @property
    def in_process(self) -> bool:
        """Whether Start trains in a child process (`ProcessRun`), not in this kernel nor under torchrun."""
        return self.train_in.value == "process" and self.processes.value < 2

    @property
    def trackers(self) -> list[str]:
        """The experiment trackers ticked ("tensorboard", "wandb")."""
        return [name for name, box in (("tensorboard", self.tensorboard), ("wandb", self.wandb)) if box.value]

    def _where_problems(self, config) -> list[tuple[str, str]]:
        """A run in a child process needs its folder and a model it can load by name; a tracker must be
        installed, and TensorBoard writes into the output dir."""

        found = [("error", text) for text in tracking_problems(self.trackers)]
        if self.trackers and not config.output_dir:
            found.append(
                ("error", "experiment tracking writes into the run's folder. Fix: name an output dir.")
            )
        if not self.in_process:
            return found
        if not config.output_dir:
            found.append(
                (
                    "error",
                    "a run in a child process writes its events and checkpoints to its folder. Fix: name an "
                    "output dir, or train in 'this kernel'.",
                )
            )
        if self.state.model is not None and self._model_name() is None:
            found.append(
                (
                    "error",
                    "the child process loads the model by name, and this model has none. Fix: load it in the "
                    "Model tab, or train in 'this kernel'.",
                )
            )
        return found

    def _launch_problems(self, config) -> list[tuple[str, str]]:
        """A run on several processes: SFT on packed data, with an output dir to bring the adapter back from."""
        processes = self.processes.value
        if processes < 2:
            return []
        found = []
        if config.method != "sft":
            found.append(
                (
                    "error",
                    f"the studio runs only SFT on {processes} processes so far ({config.method} here). Fix: "
                    "processes 'this kernel', or run the Python section's script with `fastft launch --gpus "
                    f"{processes} train.py`.",
                )
            )
        if not config.output_dir:
            found.append(
                (
                    "error",
                    "a run on several processes brings its adapter back from its checkpoints. Fix: name an "
                    "output dir.",
                )
            )
        if getattr(self.state, "eval_packed", None) is not None:
            found.append(("warn", "a run on several processes leaves out the eval set."))
        return found

    def _data_problems(self, method: str) -> list[tuple[str, str]]:
        """A preference method on data without pairs, or SFT on pairs: the method and the data disagree."""

        state = self.state
        if method == "grpo":
            return self._grpo_problems()
        if state.packed is not None:
            pairs = isinstance(state.packed, PackedPairs)
        elif state.rows is not None and hasattr(state.rows, "column_names"):
            pairs = "pair" in state.rows.column_names
        else:
            return []
        name = METHODS.get(method, method)
        if method != "sft" and not pairs:
            return [
                (
                    "error",
                    f"{name} trains on preference pairs (a prompt with a chosen and a rejected answer), but the "
                    "loaded data has none. Fix: load rows with 'prompt', 'chosen' and 'rejected' in the Data tab "
                    "(format auto or preference) and Pack them, or pick SFT.",
                )
            ]
        if method == "sft" and pairs:
            return [
                (
                    "error",
                    "SFT trains on chats or text, but the loaded data is preference pairs. Fix: pick DPO, ORPO "
                    "or SimPO as the method, or load chat data in the Data tab.",
                )
            ]
        return []

    def _grpo_problems(self) -> list[tuple[str, str]]:
        """GRPO needs prompt rows (a 'prompt' or 'messages' column, not pairs), at least one reward, and the
        columns the chosen rewards read."""

        rows = self.state.rows
        if not self.grpo.reward_keys:
            return [("error", "GRPO needs a reward to score completions. Fix: pick at least one in rewards.")]
        if rows is None:
            return [
                (
                    "error",
                    "GRPO samples from the loaded rows' prompts, but no rows are loaded. Fix: load a dataset "
                    "in the Data tab (bundled:skills has prompts and answers).",
                )
            ]
        columns = list(getattr(rows, "column_names", None) or (rows[0] if len(rows) else {}))
        if "pair" in columns or not ({"prompt", "messages", "prompt_ids"} & set(columns)):
            return [
                (
                    "error",
                    "GRPO samples completions of prompts, but the loaded rows have no 'prompt' or 'messages' "
                    "column. Fix: load chat rows or rows with a 'prompt' in the Data tab.",
                )
            ]
        try:
            check_columns(reward_functions(self.grpo.reward_keys), columns)
        except RewardError as error:
            return [("error", f"{error} Or pick rewards these rows can feed (format, length penalty).")]
        return []

    def _update_checks(self) -> None:
        found = self.problems()
        self.checks.value = "".join(
            error_html(text, "Cannot start") if kind == "error" else status_html(text, "warn")
            for kind, text in found
        )

    def _on_state(self, name: str) -> None:
        run = self.state.run
        if name == "run" and isinstance(run, RunLifecycle) and run is not self.run:
            self._attach(run)  # started elsewhere (another panel, or code): watch it here too
        self._update_preview()
        if name in ("packed", "rows"):
            self._update_checks()
        self._update_buttons()

    # -- buttons -------------------------------------------------------------------------------------
    def _on_start(self, _button=None) -> None:
        try:
            self.start()
        except Exception as error:  # noqa: BLE001 - shown in the panel, never raised into the notebook
            self._show(explain(error), "error", "Cannot start")

    def start(self) -> Run:
        """Start a run with the panel's settings on the state's model and packed data."""
        state = self.state
        if self.run is not None and self.run.active:
            raise RuntimeError("A run is already going: stop it first (Stop), or wait for it to finish.")
        if state.model is None or state.tokenizer is None:
            raise RuntimeError(
                "No model yet. Fix: load one in the Model tab (or fastft.load_model + add_lora)."
            )
        grpo = self.method.value == "grpo"
        if state.packed is None and not grpo:
            raise RuntimeError(
                "No packed data yet. Fix: load and pack a dataset in the Data tab (fastft.pack)."
            )
        if not any(p.requires_grad for p in state.model.parameters()):
            raise RuntimeError(
                "The model has no LoRA adapters to train. Fix: apply LoRA in the Model tab (fastft.add_lora)."
            )
        config = self.train_config()
        found = self.problems()
        errors = [text for kind, text in found if kind == "error"]
        if errors:
            raise ValueError(" ".join(errors))
        eval_data = getattr(state, "eval_packed", None)
        notes = [text for kind, text in found if kind == "warn"]
        notes += self._fit_warning(config)
        if self.processes.value > 1:
            run = LaunchedRun(
                state, config, self.processes.value, model_name=self._model_name(), train=self._train_kwargs()
            )
        elif self.in_process:
            from fastft.studio.run_folder import fresh_folder

            folder = fresh_folder(config.output_dir)
            run = ProcessRun.create(
                folder,
                state,
                model_name=self._model_name(),
                method=self.method.value,
                config=self._config_kwargs(),
                rewards=self.grpo.reward_keys if grpo else None,
                threads=self.threads.value,
                trackers=self.trackers,
            )
            if folder != Path(config.output_dir).expanduser():
                notes.append(f"{config.output_dir} holds an earlier run: this one goes to {folder}.")
        elif grpo:
            from fastft.studio.grpo import reward_functions

            rewards = reward_functions(self.grpo.reward_keys)
            run = Run(
                state.model,
                state.tokenizer,
                state.rows,
                None,
                config,
                rewards=rewards,
                threads=self.threads.value,
            )
        else:
            run = Run(
                state.model, state.tokenizer, state.packed, eval_data, config, threads=self.threads.value
            )
        if isinstance(run, Run) and self.trackers:
            self._track(run, config)
        state.run = run
        self._attach(run)
        self._show(" ".join(notes), "warn")
        run.start()
        self._update_buttons()
        self._update_where()
        state.notify("run")
        self.runs.refresh()
        return run

    def _track(self, run: Run, config) -> None:
        """The ticked trackers, subscribed to an in-kernel run and closed when it ends."""

        trackers = make_trackers(
            self.trackers, config.output_dir, self._config_kwargs(), name=Path(config.output_dir).name
        )
        for tracker in trackers:
            run.subscribe(tracker)

        def close(_run) -> None:
            for tracker in trackers:
                tracker.close()

        run.add_done_callback(close)

    def _attach(self, run: RunLifecycle) -> None:
        """Watch `run`: plots from its first event, updates a few times a second until it ends."""
        if self._ticker is not None:
            self._ticker.stop()
        self.run = run
        self._shown_status = run.status
        self._reset_plots(run)
        interval = {"widget": WIDGET_INTERVAL, "display": DISPLAY_INTERVAL}.get(self.mode, 1.0)
        self._ticker = Ticker(self.refresh, interval, name="fastft-run-plots").start()
        run.add_done_callback(self._on_done)
        self._update_buttons()

    def close(self) -> None:
        """Stop updating and close the panel's widgets (a run it started goes on: it is the state's)."""
        self._closed = True
        if self._ticker is not None:
            self._ticker.stop()
        super().close()

    def _fit_warning(self, config) -> list[str]:
        """On a GPU: the estimator's verdict for this run, when it says the run will not fit."""
        try:
            import torch

            from fastft.vram import fits

            device = next(self.state.model.parameters()).device
            if device.type != "cuda" or not torch.cuda.is_available():
                return []
            seq = self.state.packed.max_seq_length
            verdict = fits(self.state.model, seq, gpu="auto", batch_tokens=seq * config.micro_batch_bins)
            return [] if verdict.fits else [verdict.message]
        except Exception:  # noqa: BLE001 - the estimate is advice; never block a run on it
            return []

    def _on_pause(self, _button=None) -> None:
        run = self.run
        if run is None or not run.active:
            return
        if run.status in ("pausing", "paused"):
            run.resume()
            self._show("Resumed.", "info")
        else:
            run.pause()
            self._show("Pausing after the step in progress…", "info")
        self._shown_status = run.status
        self._update_buttons()

    def _on_stop(self, _button=None) -> None:
        if self.run is not None and self.run.active:
            self.run.stop()
            self._show("Stopping after the current step…", "info")
            self._update_buttons()

    def _on_save(self, _button=None) -> None:
        run = self.run
        if run is None:
            return
        if not run.config or not run.config.output_dir:
            self._show("Set an output dir to save checkpoints.", "error")
            return
        self._show("Saving a checkpoint at the next step boundary…", "info")
        future = run.save_checkpoint()
        future.add_done_callback(self._on_saved)

    def _on_saved(self, future: Future) -> None:
        error = future.exception()
        if error is not None:
            self._show(str(error), "error", "No checkpoint written")
        else:
            self._show(f"Checkpoint saved: {future.result()}", "ok")

    def wait(self, timeout: float | None = None):
        """Block until the current run ends and the plots show all of it; returns its `TrainResult`."""
        if self.run is None:
            return None
        return self.run.wait(timeout)  # the run's done callback has drawn its last events by then

    # -- plots -----------------------------------------------------------------------------------------
    def _reset_plots(self, run: RunLifecycle) -> None:
        max_steps = run.max_steps
        try:
            cuda = next(run.model.parameters()).device.type == "cuda"
        except (AttributeError, StopIteration, TypeError):
            cuda = bool(getattr(run, "on_cuda", False))
        with self._lock:
            self.series.clear()
            self.eval_series.clear()
            self.preference_series.clear()
            self._shown_rollout = None
            self.rollouts.value = ""
            self._ema = Ema(0.9)
            self._seen = 0
            self._last_timing = 0.0
            self.progress.max = max(1, int(max_steps or 1))
            self.progress.value = 0
            self.progress.bar_style = ""
            self.progress_text.value = ""
            self.timing_figure.replace(phases_figure([], []))  # the last run's bars, labels and axis go
            self.timing_table.value = ""
            self.plots.replace(
                run_dashboard_figure(max_steps=max_steps, memory_kind="cuda" if cuda else "cpu-rss")
            )
            method = getattr(run.config, "method", "sft")
            preference = method in PREFERENCE_METHODS
            self.preference_plots.widget.layout.display = None if preference else "none"
            if preference:
                from fastft.studio.preference import preference_figure

                self.preference_plots.replace(preference_figure(max_steps=max_steps))
            grpo = method == "grpo"
            self.grpo_plots.widget.layout.display = None if grpo else "none"
            self.rollouts.layout.display = None if grpo else "none"
            if grpo:
                from fastft.data.rewards import reward_name
                from fastft.studio.grpo import grpo_figure

                self._grpo_rewards = [reward_name(r) for r in run.rewards or ()]
                self.grpo_series = SeriesBuffer(self._grpo_columns(), self.max_points)
                self.grpo_plots.replace(grpo_figure(self._grpo_rewards, max_steps=max_steps))

    def refresh(self, final: bool = False) -> None:
        """Move new events into the plots, progress and status (called by the ticker a few times a second)."""
        run = self.run
        if run is None or self._closed:
            return
        with self._lock:
            n = len(run.events)
            new = run.events[self._seen : n]
            self._seen = n
            for event in new:
                if isinstance(event, StepEvent):
                    self.series.append(
                        event.step,
                        loss=event.loss,
                        smoothed=self._ema(event.loss),
                        learning_rate=event.learning_rate,
                        tokens_per_second=event.trained_tokens_per_second,
                        memory_gib=event.peak_memory_bytes / 2**30,
                    )
                    if event.preference:
                        self.preference_series.append(
                            event.step, **{k: v for k, v in event.preference.items() if k != "pairs"}
                        )
                    if event.grpo:
                        self.grpo_series.append(event.step, **event.grpo)
                elif isinstance(event, EvalEvent):
                    self.eval_series.append(event.step, eval_loss=event.eval_loss)
            if new or final:
                self._draw()
                self._show_rollout(run)
            self._update_progress()
            self._on_status(run)
            now = time.monotonic()
            if final or now - self._last_timing >= self.TIMING_EVERY:
                self._last_timing = now
                self._draw_timing()
            if self.mode == "text" and (final or now - self._last_text >= self.TEXT_EVERY) and run.events:
                self._last_text = now
                print(self._status_line(), flush=True)
            if final:
                self.plots.flush()
                self.preference_plots.flush()
                self.grpo_plots.flush()
                self.timing_figure.flush()

    def _draw(self) -> None:
        s = self.series
        x = s.column("x")
        self.plots.set_data(
            {
                0: (x, s.column("loss")),
                1: (x, s.column("smoothed")),
                2: (self.eval_series.column("x"), self.eval_series.column("eval_loss")),
                3: (x, s.column("learning_rate")),
                4: (x, s.column("tokens_per_second")),
                5: (x, s.column("memory_gib")),
            }
        )
        g = self.grpo_series
        if len(g) and g.columns[1:] == self._grpo_columns():
            gx = g.column("x")
            self.grpo_plots.set_data({i: (gx, g.column(name)) for i, name in enumerate(self._grpo_columns())})
        p = self.preference_series
        if len(p):
            px = p.column("x")
            self.preference_plots.set_data(
                {
                    0: (px, p.column("rewards_chosen")),
                    1: (px, p.column("rewards_rejected")),
                    2: (px, p.column("margin")),
                    3: (px, p.column("accuracy")),
                }
            )

    def _grpo_columns(self) -> tuple[str, ...]:
        """The GRPO series' columns in `fastft.studio.grpo.grpo_figure`'s trace order."""
        per_function = (f"reward/{name}" for name in self._grpo_rewards)
        return ("reward", *per_function, "kl", "completion_length", "accuracy")

    def _show_rollout(self, run: Run) -> None:
        """The rollouts inspector: redrawn when the trainer has a new rollout."""
        owner = run.trainer if run.trainer is not None else run  # a `ProcessRun` reads its worker's
        rollout = getattr(owner, "last_rollout", None)
        if rollout is None or rollout is self._shown_rollout:
            return

        self._shown_rollout = rollout
        group = run.config.num_generations
        # its own step: the trainer keeps a step's rollout before that step's event arrives
        self.rollouts.value = rollout_html(rollout, self._grpo_rewards, group, step=rollout.step or None)

    def _update_progress(self) -> None:
        run = self.run
        self.progress.max = max(1, int(run.max_steps or 1))
        step = run.step
        self.progress.value = min(step, self.progress.max)
        self.progress.bar_style = {"failed": "danger", "finished": "success", "stopped": "warning"}.get(
            run.status, ""
        )
        self.progress_text.value = html.escape(self._status_line())
        if run.done:
            self._update_buttons()

    def _status_line(self) -> str:
        run = self.run
        step, total = run.step, run.max_steps or 0
        elapsed = run.elapsed_seconds
        parts = [f"{run.status}", f"step {step}/{total}", f"{_duration(elapsed)} elapsed"]
        if run.active and step and total > step:
            parts.append(f"ETA {_duration(elapsed / step * (total - step))}")
        recent = [e for e in run.events[-50:] if isinstance(e, StepEvent)][-20:]
        if recent:
            last = recent[-1]
            # tokens/s over the last steps, not the last one alone: one step slowed by the notebook's own
            # work (a plot redraw holding the GIL) would otherwise read as the run's speed
            seconds = sum(e.step_seconds for e in recent)
            speed = sum(e.trained_tokens for e in recent) / seconds if seconds > 0 else 0.0
            parts += [
                f"loss {last.loss:.4f}",
                f"{speed:,.0f} trained tok/s",
                f"{last.peak_memory_bytes / 2**30:.2f} GiB",
            ]
            replayed = sum(e.graph_replays for e in recent)
            if replayed:  # chat data replays too: its micro-batches are padded to one shape
                parts.append(
                    f"CUDA graph: {replayed}/{sum(e.micro_batches for e in recent)} micro-batches replayed"
                )
        if recent and recent[-1].preference:
            metrics = recent[-1].preference
            parts.append(f"accuracy {metrics['accuracy']:.0%} · margin {metrics['margin']:+.3f}")
        if recent and recent[-1].grpo:
            metrics = recent[-1].grpo
            parts.append(f"reward {metrics['reward']:+.3f}")
            if "accuracy" in metrics:
                parts.append(f"accuracy {metrics['accuracy']:.0%}")
        evals = [e for e in run.events[-50:] if isinstance(e, EvalEvent)]
        if evals:
            parts.append(f"eval loss {evals[-1].eval_loss:.4f}")
        return " · ".join(parts)

    def _on_status(self, run: RunLifecycle) -> None:
        """Say when the run's status changes on its own: paused once the step in progress has ended."""
        status = run.status
        if status == self._shown_status:
            return
        self._shown_status = status
        if status == "paused":
            self._show(
                f"Paused at step {run.step}: Resume continues, Save checkpoint writes one now.", "info"
            )
        self._update_buttons()
        self._update_where()

    def _draw_timing(self) -> None:
        run = self.run
        profile = getattr(getattr(run, "trainer", None), "profile", None)
        if profile is not None:
            n = len(profile.steps)  # phases are appended before steps: both hold at least n entries
            all_steps, all_phases = profile.steps[:n], profile.phases[:n]
        else:  # a run in another process: the phases its events carry
            timed = [e for e in run.events if isinstance(e, StepEvent) and e.phases]
            all_steps, all_phases = [e.step for e in timed], [e.phases for e in timed]
        n = len(all_steps)
        if not n:
            return
        first = max(0, n - self.TIMING_STEPS)
        self.timing_figure.update_from(phases_figure(list(all_steps[first:]), list(all_phases[first:])))
        table = phase_table(all_phases[1:] if n > 1 else all_phases)
        self.timing_table.value = table._repr_html_()

    def _on_done(self, run: RunLifecycle) -> None:
        if self._ticker is not None:
            self._ticker.stop()
        if self._closed or run is not self.run:
            return
        self.refresh(final=True)
        if run.error is not None:
            self._show(run.error_message, "error", "The run stopped")
        elif run.status == "stopped":
            where = f" Last checkpoint: {run.checkpoints[-1]}." if run.checkpoints else ""
            self._show(f"Stopped at step {run.step}.{where}", "warn")
        else:
            final = run.result.final_loss
            where = f" Checkpoint: {run.checkpoints[-1]}." if run.checkpoints else ""
            loss = f" with loss {final:.4f}" if final is not None and math.isfinite(final) else ""
            attention = f" Attention: {run.result.attention}." if run.result.attention else ""
            self._show(
                f"Finished {run.step} steps in {_duration(run.elapsed_seconds)}{loss}.{where}{attention}",
                "ok",
            )
        self._update_buttons()
        self._update_where()
        self.runs.refresh()
        self.state.notify("run")

    # -- small helpers ---------------------------------------------------------------------------------
    def _show(self, text: str, kind: str = "info", title: str | None = None) -> None:
        self.log.say(text, kind, title)

    def _update_where(self) -> None:
        """One line on where the run trains: this kernel, or a child process (its pid, folder and log)."""

        run = self.run
        if isinstance(run, ProcessRun):
            alive = "running" if run.active else "ended"
            parts = [
                f"In a child process: pid {run.pid} ({alive})",
                f"folder {run.folder}",
                f"log {run.log_path}",
            ]
            if run.threads_note:
                parts.append(f"CPU threads {run.threads_note}")
            text = html.escape(" · ".join(parts))
            if run.traceback:
                text += (
                    "<details><summary>the worker's traceback</summary><pre style='white-space:pre-wrap'>"
                    f"{html.escape(run.traceback)}</pre></details>"
                )
            self.where.value = status_html(text, "info", raw=True)
            return
        if isinstance(run, Run) and run.active:
            threads = f" · CPU threads {run.threads_note}" if run.threads_note else ""
            self.where.value = status_html(f"In this kernel: the model object is trained{threads}.", "info")
            return
        if isinstance(run, LaunchedRun) and run.active:
            self.where.value = status_html(
                f"On {run.processes} processes (torchrun) · log {run.log_path}", "info"
            )
            return
        if self.in_process:
            text = "Start trains in a child process: the run goes on if the kernel restarts."
        elif self.processes.value > 1:
            text = f"Start trains on {self.processes.value} processes (torchrun)."
        else:
            text = "Start trains in this kernel: the model object holds the trained weights afterwards."
        self.where.value = status_html(text, "info")

    def _update_buttons(self) -> None:
        run = self.run
        active = run is not None and run.active
        self.start_button.disabled = active
        launched = isinstance(run, LaunchedRun)  # on several processes: no pause, no save
        held = active and run.status in ("pausing", "paused")
        self.pause_button.disabled = not active or run.status == "stopping" or launched
        self.pause_button.description = "Resume" if held else "Pause"
        self.pause_button.icon = "play" if held else "pause"
        self.stop_button.disabled = not active
        self.save_button.disabled = (
            run is None or run.error is not None or run.status == "created" or launched
        )
        for control in self._controls:
            control.disabled = active
