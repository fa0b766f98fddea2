"""The studio's Run tab: `RunPanel` starts a run and watches it.

A run trains in a child process by default (`fastft.studio.process_run.ProcessRun`: the run goes on through
a kernel restart, and a studio opened later follows it again), or in this kernel (`fastft.studio.run_control.Run`:
the model object holds the trained weights at once), or on every GPU through torchrun
(`fastft.studio.launched.LaunchedRun`). `RunPanel` never touches widgets from inside a training step: events
are appended to ``run.events`` (a list, cheap), and a `Ticker` thread drains them a few times a second into
the live read-out (`fastft.studio.run_readout.RunReadout`: bounded float32 series behind the live plots).
What the settings cannot do is checked in `fastft.studio.run_settings`, the Python section is written by
`fastft.studio.run_code`, and the Runs view (`fastft.studio.runs`) lists the runs folder's runs and resumes
any checkpoint.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future
from pathlib import Path

import ipywidgets as widgets
import torch

from fastft.runtime.threads import TORCH_DEFAULT_THREADS
from fastft.studio.grpo import GRPOControls, reward_functions
from fastft.studio.launched import LaunchedRun, launch_choices
from fastft.studio.live import DISPLAY_INTERVAL, WIDGET_INTERVAL, Ticker, frontend
from fastft.studio.notices import (
    Panel,
    StatusLog,
    button,
    code_html,
    code_section,
    error_html,
    field,
    row,
    status_html,
)
from fastft.studio.process_run import ProcessRun
from fastft.studio.run_code import run_code, train_kwargs
from fastft.studio.run_control import Run, RunLifecycle, explain
from fastft.studio.run_folder import fresh_folder
from fastft.studio.run_readout import RunReadout, ending, status_line, where_html
from fastft.studio.run_settings import (
    DPO_LOSSES,
    METHODS,
    PREFERENCE_METHODS,
    TRAIN_IN,
    RunTarget,
    fit_warning,
    missing_for_start,
    run_problems,
)
from fastft.studio.runs import RunsView
from fastft.studio.state import StudioState
from fastft.training.objectives.grpo import GRPOConfig
from fastft.training.objectives.preference import DEFAULT_BETA
from fastft.training.tracking import make_trackers
from fastft.training.trainer import TrainConfig

__all__ = [
    "METHODS",
    "Run",
    "RunPanel",
    "explain",
]  # Run and explain: imported here before run_control existed

# What the panel follows in the shared `StudioState`.
_STATE_NAMES = (
    "model",
    "model_name",
    "load_settings",
    "lora_settings",
    "rows",
    "packed",
    "pack_settings",
    "run",
)
_STYLE = {"description_width": "11em"}  # "grad accumulation", "eval every (0: end)" in full


def _wide():  # each control its own Layout: hiding one (per method) must not hide the others
    return field("18em", max_width="28em")


def _choice(choices: dict[str, str], value: str, description: str, layout=None) -> widgets.Dropdown:
    """A dropdown of `choices` (value → label), `value` picked."""
    return widgets.Dropdown(
        options=[(label, key) for key, label in choices.items()],
        value=value,
        description=description,
        style=_STYLE,
        layout=layout or _wide(),
    )


def _tip(control, text: str) -> None:
    """Set `control`'s hover text (ipywidgets 8 calls it `tooltip`, 7.x `description_tooltip`)."""
    setattr(control, "tooltip" if "tooltip" in control.traits() else "description_tooltip", text)


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
    follows the newest run still going in the runs folder (the folder above the output dir). The live
    read-out's widgets and series (`plots`, `series`, `progress`, `timing_figure`, …) are `readout`'s.
    """

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
        self._shown_status = ""  # the run's status as last said (a change is shown once)
        self.max_points = max_points
        self.readout = RunReadout(self.mode, max_points)
        self._share_readout()
        self._default_beta = DEFAULT_BETA
        self._build_method_controls()
        self._build_schedule_controls()
        self._build_where_controls(launch_choices() if processes is None else processes)
        self._build_buttons()
        self.checks = widgets.HTML("")  # what cannot work (or looks wrong) with these settings, before Start
        self.where = widgets.HTML("")  # where the run trains: this kernel, or a child process (pid, log)
        self.log = StatusLog()
        self.status = self.log.widget
        self.code_preview = widgets.HTML("")
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
        self._keep_settings()
        self.method.observe(self._on_method, names="value")
        self._show_method_controls()
        self.start_button.on_click(self._on_start)
        self.pause_button.on_click(self._on_pause)
        self.stop_button.on_click(self._on_stop)
        self.save_button.on_click(self._on_save)
        self.state.observe(self._on_state, _STATE_NAMES)
        self.runs = RunsView(self)
        self.widget = self._layout()
        self._update_preview()
        self._update_checks()
        self._update_buttons()
        if isinstance(self.state.run, RunLifecycle):  # a studio shown again: watch the state's run
            self._attach(self.state.run)
        else:
            self._follow_running()
        self._update_where()

    # -- building the tab ----------------------------------------------------------------------------
    def _share_readout(self) -> None:
        """The read-out's widgets and series under the panel's own names (as notebooks and tests read them)."""
        r = self.readout
        self.series, self.eval_series, self.preference_series = r.series, r.eval_series, r.preference_series
        self.progress, self.progress_text, self.rollouts = r.progress, r.progress_text, r.rollouts
        self.plots, self.preference_plots, self.grpo_plots = r.plots, r.preference_plots, r.grpo_plots
        self.timing_figure, self.timing_table = r.timing_figure, r.timing_table

    @property
    def grpo_series(self):
        """The GRPO curves' series (a new one per GRPO run: its columns follow the run's rewards)."""
        return self.readout.grpo_series

    def _build_method_controls(self) -> None:
        """The method (SFT, a preference method or GRPO) and the controls only some methods have."""
        self.method = _choice(METHODS, "sft", "method")
        self.beta = widgets.BoundedFloatText(
            value=DEFAULT_BETA["dpo"],
            min=1e-6,
            max=1000,
            step=0.05,
            description="beta",
            style=_STYLE,
            layout=_wide(),  # its own: hidden for SFT, the others not
        )
        self.dpo_loss = _choice(DPO_LOSSES, "sigmoid", "DPO loss")
        self.grpo = GRPOControls(_STYLE, _wide)

    def _build_schedule_controls(self) -> None:
        """How long and how fast the run trains, how often it evaluates and saves, and where to."""

        def control(cls, value, description, **bounds):
            return cls(value=value, description=description, style=_STYLE, layout=_wide(), **bounds)

        self.steps = control(widgets.BoundedIntText, 60, "steps", min=1, max=10_000_000)
        self.learning_rate = control(widgets.FloatText, 2e-4, "learning rate")
        self.micro_batch_bins = control(widgets.BoundedIntText, 1, "micro-batch bins", min=1, max=1024)
        self.grad_accum_steps = control(widgets.BoundedIntText, 1, "grad accumulation", min=1, max=1024)
        self.warmup = control(widgets.BoundedFloatText, 0.05, "warmup", min=0.0, max=1_000_000, step=0.01)
        _tip(self.warmup, "below 1: a share of the steps; 1 or more: a number of steps")
        self.eval_every = control(widgets.BoundedIntText, 0, "eval every (0: end)", min=0, max=10_000_000)
        self.save_every = control(widgets.BoundedIntText, 0, "save every (0: off)", min=0, max=10_000_000)
        self.output_dir = control(widgets.Text, "runs/studio", "output dir")

    def _build_where_controls(self, choices: list[tuple[str, int]]) -> None:
        """Where the run trains (a child process or this kernel; on how many processes), on how many CPU
        threads, and which experiment trackers log it."""
        # its choices' names in full
        self.train_in = _choice(TRAIN_IN, "process", "train in", field("24em", max_width="32em"))
        _tip(
            self.train_in,
            "a child process: the run goes on if the kernel restarts; this kernel: the model object is trained",
        )
        thread_choices = [("auto (timed)", "auto"), ("1", 1)]
        if TORCH_DEFAULT_THREADS > 1:
            thread_choices.append((f"{TORCH_DEFAULT_THREADS} (torch's default)", TORCH_DEFAULT_THREADS))
        self.threads = widgets.Dropdown(
            options=thread_choices,
            value="auto",
            description="CPU threads",
            style=_STYLE,
            layout=field("24em", max_width="32em"),
        )
        _tip(self.threads, "auto: a micro-batch timed at 1 thread and at torch's default, the faster kept")
        if torch.cuda.is_available():
            self.threads.layout.display = "none"  # a GPU run: the thread count hardly matters
        self.tensorboard = widgets.Checkbox(
            value=False, description="TensorBoard", indent=False, layout=field("9em", grow=0)
        )
        self.wandb = widgets.Checkbox(
            value=False, description="W&B", indent=False, layout=field("6em", grow=0)
        )
        # "this kernel", or every GPU through torchrun (`fastft.studio.launched`); shown only with a choice
        self.processes = widgets.Dropdown(
            options=choices, value=choices[0][1], description="processes", style=_STYLE, layout=_wide()
        )
        if len(choices) < 2:
            self.processes.layout.display = "none"

    def _build_buttons(self) -> None:
        self.start_button = button(description="Start", icon="play", button_style="success")
        self.pause_button = button(description="Pause", icon="pause", disabled=True)
        self.stop_button = button(description="Stop", icon="stop", button_style="danger", disabled=True)
        self.save_button = button(description="Save checkpoint", icon="save", disabled=True)

    def _keep_settings(self) -> None:
        """Each control takes the last studio's value (a re-run cell keeps them) and keeps its changes."""
        kept = self.state.run_settings
        for control in self._controls:
            name = control.description
            if name in kept:
                with contextlib.suppress(Exception):  # a value it no longer takes: its default stays
                    control.value = kept[name]
            control.observe(self._on_setting, names="value")

    def _layout(self) -> widgets.VBox:
        settings = widgets.VBox([widgets.HTML("<b>Hyperparameters</b>"), row([*self._controls])])
        buttons = row([self.start_button, self.pause_button, self.stop_button, self.save_button])
        return widgets.VBox(
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
                self.readout.timing,
                self.runs.widget,
                code_section(self.code_preview),
            ]
        )

    # -- following a run ------------------------------------------------------------------------------
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
        self.readout.show_method(method)

    def code(self) -> str:
        """The plain-Python equivalent of this run, from loading the model to training (runs as is)."""
        return run_code(self.state, self.method.value, self._config_kwargs(), self._target())

    def _train_kwargs(self) -> dict:
        """`fastft.train`'s keyword arguments for these settings, its defaults left out."""
        return train_kwargs(self._config_kwargs())

    def _target(self) -> RunTarget:
        """Where and how Start would train, as the checks and the Python section read it."""
        return RunTarget(
            in_process=self.in_process,
            processes=self.processes.value,
            trackers=self.trackers,
            reward_keys=self.grpo.reward_keys,
            model_name=self._model_name(),
        )

    def _model_name(self) -> str | None:
        state = self.state
        return state.model_name or getattr(getattr(state.model, "fastft_info", None), "name", None)

    def _update_preview(self) -> None:
        try:
            self.code_preview.value = code_html(self.code())
        except Exception as error:  # noqa: BLE001 - a preview must never break the panel
            self.code_preview.value = status_html(f"(no preview: {error})", "warn")

    def _on_setting(self, change=None) -> None:
        if change is not None:
            self.state.run_settings[change["owner"].description] = change["new"]
        self._update_preview()
        self._update_checks()
        if self.run is None or not self.run.active:
            self._update_where()

    def problems(self) -> list[tuple[str, str]]:
        """What cannot work with these settings ("error": Start refuses) or looks like a mistake ("warn"),
        each with its fix; checked on every change, before Start (`fastft.studio.run_settings.run_problems`)."""
        try:
            config = self.train_config()
        except Exception as error:  # noqa: BLE001 - TrainConfig's own checks name the field and the fix
            return [("error", str(error))]
        return run_problems(config, self.state, self._target())

    @property
    def in_process(self) -> bool:
        """Whether Start trains in a child process (`ProcessRun`), not in this kernel nor under torchrun."""
        return self.train_in.value == "process" and self.processes.value < 2

    @property
    def trackers(self) -> list[str]:
        """The experiment trackers ticked ("tensorboard", "wandb")."""
        return [name for name, box in (("tensorboard", self.tensorboard), ("wandb", self.wandb)) if box.value]

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
        missing = missing_for_start(state, self.method.value)
        if missing:
            raise RuntimeError(missing)
        config = self.train_config()
        found = self.problems()
        errors = [text for kind, text in found if kind == "error"]
        if errors:
            raise ValueError(" ".join(errors))
        notes = [text for kind, text in found if kind == "warn"]
        notes += fit_warning(state, config)
        run = self._new_run(config, notes)
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

    def _new_run(self, config, notes: list[str]) -> RunLifecycle:
        """The run these settings describe, not started: under torchrun, in a child process or in this kernel
        (a note added to `notes` when a child process's run goes to a fresh folder beside the output dir)."""
        state = self.state
        grpo = self.method.value == "grpo"
        if self.processes.value > 1:
            return LaunchedRun(
                state, config, self.processes.value, model_name=self._model_name(), train=self._train_kwargs()
            )
        if self.in_process:
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
            return run
        if grpo:
            rewards = reward_functions(self.grpo.reward_keys)
            return Run(
                state.model,
                state.tokenizer,
                state.rows,
                None,
                config,
                rewards=rewards,
                threads=self.threads.value,
            )
        eval_data = getattr(state, "eval_packed", None)
        return Run(state.model, state.tokenizer, state.packed, eval_data, config, threads=self.threads.value)

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
        try:
            cuda = next(run.model.parameters()).device.type == "cuda"
        except (AttributeError, StopIteration, TypeError):
            cuda = bool(getattr(run, "on_cuda", False))
        with self._lock:
            self.readout.reset(run, cuda)

    def refresh(self, final: bool = False) -> None:
        """Move new events into the plots, progress and status (called by the ticker a few times a second)."""
        run = self.run
        if run is None or self._closed:
            return
        with self._lock:
            self.readout.take(run, final)
            if run.done:
                self._update_buttons()
            self._on_status(run)
            self.readout.tick(run, final)

    def _status_line(self) -> str:
        return status_line(self.run)

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

    def _on_done(self, run: RunLifecycle) -> None:
        if self._ticker is not None:
            self._ticker.stop()
        if self._closed or run is not self.run:
            return
        self.refresh(final=True)
        self._show(*ending(run))
        self._update_buttons()
        self._update_where()
        self.runs.refresh()
        self.state.notify("run")

    # -- small helpers ---------------------------------------------------------------------------------
    def _show(self, text: str, kind: str = "info", title: str | None = None) -> None:
        self.log.say(text, kind, title)

    def _update_where(self) -> None:
        """One line on where the run trains: this kernel, or a child process (its pid, folder and log)."""
        self.where.value = where_html(self.run, self.in_process, self.processes.value)

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
