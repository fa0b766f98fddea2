"""Training from the studio: a `Run` on a background thread, and the `RunPanel` that starts and watches it.

`Run` wraps the engine's `Trainer`: ``start()`` trains on a daemon thread so the notebook stays
responsive; ``pause()`` / ``resume()`` / ``stop()`` take effect between steps; ``wait()`` blocks
(scripts, notebook execution); ``save_checkpoint()`` is done by the training thread at the next step
boundary (at once while paused), so a checkpoint never sees half an optimizer step. Errors (out of
memory, a non-finite loss, bad data) end the run cleanly: they are kept in ``run.error`` with a
message that names the fix (`explain`), the kernel stays alive, and checkpoints already written stay.

`RunPanel` never touches widgets from inside a training step: the trainer's events are appended to
``run.events`` (a list, cheap), and a `Ticker` thread drains them a few times a second into bounded
float32 series (`SeriesBuffer`) that the live plots show.
"""

from __future__ import annotations

import html
import math
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future

from fastft.studio.live import (
    DISPLAY_INTERVAL,
    WIDGET_INTERVAL,
    Ema,
    LiveFigure,
    SeriesBuffer,
    Ticker,
    frontend,
)
from fastft.studio.notices import Panel
from fastft.studio.state import StudioState
from fastft.training.events import EvalEvent, Event, StepEvent

__all__ = ["Run", "RunPanel", "explain"]

_ACTIVE = ("starting", "running", "paused", "stopping")


class Run:
    """One training run of `model` on `train_data`, on a background thread.

    Arguments are `fastft.Trainer`'s; the trainer is built on the training thread when `start()`
    is called (choosing the attention backend can take a moment on a GPU) and is then ``.trainer``.
    ``.events`` lists every `StepEvent` / `EvalEvent` so far; ``.result`` is the trainer's
    `TrainResult` (partial while running); ``.error`` the exception that ended it, if any, and
    ``.error_message`` what to do about it. ``.status``: "created", "starting", "running",
    "paused", "stopping", then "finished", "stopped" or "failed".
    """

    def __init__(self, model, tokenizer, train_data, eval_data=None, config=None, *, trainer=None):
        self.model, self.tokenizer = model, tokenizer
        self.train_data, self.eval_data = train_data, eval_data
        self.config = config if config is not None else getattr(trainer, "config", None)
        self.trainer = trainer
        self.events: list[Event] = []
        self.error: BaseException | None = None
        self.traceback = ""
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._status = "created"
        self._cond = threading.Condition()
        self._pause = False
        self._stop = False
        self._jobs: list[tuple[Callable[[], object], Future]] = []
        self._serving = False
        self._parked = False
        self._paused_seconds = 0.0
        self._paused_since: float | None = None
        self._listeners: list[Callable[[Event], None]] = []
        self._done_callbacks: list[Callable[[Run], None]] = []
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def of(cls, trainer) -> Run:
        """A run of an existing `Trainer` (its model, data and config)."""
        return cls(trainer.model, trainer.tokenizer, trainer.train_data, trainer.eval_data, trainer=trainer)

    # -- control (any thread) -------------------------------------------------------------------------
    def start(self) -> Run:
        """Start training on a daemon thread and return at once."""
        with self._cond:
            if self._status != "created":
                raise RuntimeError(f"This run was already started ({self._status}); create a new Run.")
            self._status = "starting"
            self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._main, name="fastft-run", daemon=True)
        self._thread.start()
        return self

    def pause(self) -> None:
        """Hold the run after the current step (its weights, optimizer and data order stay as they are)."""
        with self._cond:
            if self._status in ("starting", "running") and not self._stop:
                self._pause = True
                self._paused_since = time.monotonic()
                self._status = "paused"
                self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            if self._pause:
                self._pause = False
                self._paused_seconds += time.monotonic() - (self._paused_since or time.monotonic())
                self._paused_since = None
                if self._status == "paused":
                    self._status = "running"
                self._cond.notify_all()

    def stop(self) -> None:
        """Finish the current step, then stop; a checkpoint is written when the config has an output_dir."""
        with self._cond:
            if self.done:
                return
            self._stop = True
            self._status = "stopping"
            if self._pause:
                self._paused_seconds += time.monotonic() - (self._paused_since or time.monotonic())
                self._pause, self._paused_since = False, None
            if self.trainer is not None:
                self.trainer.stop()
            self._cond.notify_all()

    def save_checkpoint(self) -> Future:
        """Write a checkpoint at the next step boundary (at once while paused or after the run).

        Returns a `Future` of the checkpoint folder; its exception says why none was written.
        """
        future: Future = Future()
        if self.error is not None:
            future.set_exception(
                RuntimeError(
                    "This run failed; its weights may be damaged, so no new checkpoint is written. "
                    + _last_checkpoint_sentence(self)
                )
            )
            return future
        if self.trainer is None and self._status == "created":
            future.set_exception(RuntimeError("The run has not started: nothing to save yet."))
            return future
        with self._cond:
            if not self.done:
                self._jobs.append((self._save, future))
                self._cond.notify_all()
                return future
        _run_job(self._save, future)  # the training thread is gone: the trainer is idle
        return future

    def _save(self):
        return self.trainer.save_checkpoint()

    def wait(self, timeout: float | None = None, *, raise_error: bool = False):
        """Block until the run ends (or `timeout` seconds); returns its `TrainResult` (None before the
        trainer exists). With `raise_error`, the exception that ended the run is raised here."""
        self._done.wait(timeout)
        if raise_error and self.error is not None and self.done:
            raise self.error
        return self.result

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        """Call `listener(event)` on the training thread for every event: keep it cheap (append, set a flag)."""
        self._listeners.append(listener)

    def add_done_callback(self, callback: Callable[[Run], None]) -> None:
        """Call `callback(run)` once the run has ended (on the training thread; at once if it already has)."""
        with self._cond:
            if not self.done:
                self._done_callbacks.append(callback)
                return
        callback(self)

    # -- reading -------------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        return self._status

    @property
    def parked(self) -> bool:
        """True while the training thread holds between two steps (paused)."""
        return self._parked

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def active(self) -> bool:
        return self._status in _ACTIVE

    @property
    def result(self):
        return None if self.trainer is None else self.trainer.result

    @property
    def checkpoints(self) -> list[str]:
        return [] if self.trainer is None else list(self.trainer.result.checkpoints)

    @property
    def max_steps(self) -> int | None:
        if self.trainer is not None:
            return self.trainer.max_steps
        return getattr(self.config, "max_steps", None)

    @property
    def step(self) -> int:
        """The last step whose event arrived."""
        for event in reversed(self.events):
            if isinstance(event, StepEvent):
                return event.step
        return 0

    @property
    def elapsed_seconds(self) -> float:
        """Wall time spent training (pauses left out)."""
        if self.started_at is None:
            return 0.0
        end = self.finished_at or time.monotonic()
        paused = self._paused_seconds + (end - self._paused_since if self._paused_since else 0.0)
        return max(0.0, end - self.started_at - paused)

    @property
    def error_message(self) -> str:
        return "" if self.error is None else explain(self.error, self)

    # -- the training thread ---------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            if self.trainer is None:
                from fastft.training.trainer import Trainer

                self.trainer = Trainer(
                    self.model, self.tokenizer, self.train_data, self.eval_data, self.config
                )
            self.trainer.subscribe(self._on_event)
            with self._cond:
                if self._stop:
                    self.trainer.stop()
                elif self._status == "starting":
                    self._status = "running"
            self.trainer.train()
        except BaseException as error:  # noqa: BLE001 - kept for the panel; the kernel must live on
            self.error = error
            self.traceback = traceback.format_exc()
            _release_memory(self.trainer, error)
        finally:
            self.finished_at = time.monotonic()
            with self._cond:
                jobs, self._jobs = self._jobs, []
                if self.error is not None:
                    self._status = "failed"
                elif self.trainer is not None and self.trainer.result.stopped_early:
                    self._status = "stopped"
                else:
                    self._status = "finished"
            for job, future in jobs:  # asked for during the final steps: the trainer is idle now
                if self.error is None:
                    _run_job(job, future)
                else:
                    future.set_exception(RuntimeError("The run failed before it could save."))
            with self._cond:
                callbacks, self._done_callbacks = self._done_callbacks, []
            for callback in callbacks:
                try:
                    callback(self)
                except Exception:  # noqa: BLE001 - a face's bug must not hide the run's end
                    traceback.print_exc()
            self._done.set()

    def _on_event(self, event: Event) -> None:
        self.events.append(event)
        for listener in self._listeners:
            listener(event)
        if isinstance(event, StepEvent) and not self._serving:
            self._between_steps()

    def _between_steps(self) -> None:
        """At a step boundary: run queued jobs, and wait here while paused."""
        self._serving = True
        try:
            while True:
                with self._cond:
                    jobs, self._jobs = self._jobs, []
                    if not jobs:
                        if not self._pause or self._stop:
                            return
                        self._parked = True
                        self._cond.wait()
                        self._parked = False
                        continue
                for job, future in jobs:
                    _run_job(job, future)
        finally:
            self._serving = False


def _run_job(job: Callable[[], object], future: Future) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(job())
    except BaseException as error:  # noqa: BLE001 - handed to whoever asked
        future.set_exception(error)


def _release_memory(trainer, error: BaseException) -> None:
    """After a failed step: drop its gradients and cached blocks so the notebook can go on."""
    import gc

    import torch

    try:
        if trainer is not None:
            trainer.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort only
        pass


def _last_checkpoint_sentence(run: Run | None) -> str:
    checkpoints = run.checkpoints if run is not None else []
    if checkpoints:
        return f"The last checkpoint is {checkpoints[-1]} (resume with resume_from='{checkpoints[-1]}')."
    return "No checkpoint was written (set save_every to keep one as the run goes)."


def _is_oom(error: BaseException) -> bool:
    import torch

    oom = getattr(torch.cuda, "OutOfMemoryError", ())
    return (oom and isinstance(error, oom)) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower()
    )


def explain(error: BaseException, run: Run | None = None) -> str:
    """A message for `error` that says what happened and how to fix it (plain text)."""
    from fastft.data.errors import FastftDataError
    from fastft.training.trainer import NonFiniteLossError

    step = run.step + 1 if run is not None and run.events else None
    at = f" at step {step}" if step else ""
    if isinstance(error, NonFiniteLossError):
        return str(error)
    if _is_oom(error):
        first = str(error).strip().splitlines()[0] if str(error).strip() else "CUDA out of memory"
        bins = getattr(getattr(run, "config", None), "micro_batch_bins", None)
        fewer = f"fewer micro-batch bins (now {bins})" if bins and bins > 1 else "a shorter max_seq_length"
        return (
            f"Out of GPU memory{at} ({first}). Fix: {fewer}, 4-bit loading, gradient checkpointing "
            "'offload' or a lower LoRA rank; the VRAM tab estimates each. The kernel is fine and its GPU "
            f"memory was released. {_last_checkpoint_sentence(run)}"
        )
    if isinstance(error, FastftDataError):
        return f"Bad data: {error}"
    if isinstance(error, IndexError) and "index out of range" in str(error):
        return (
            f"A token id is outside the model's vocabulary{at} ({error}): the data was packed with another "
            "tokenizer. Fix: pack the data again with this model's tokenizer (Data tab). "
            + _last_checkpoint_sentence(run)
        )
    text = str(error) or type(error).__name__
    if isinstance(error, (ValueError, TypeError, KeyError)) and run is None:
        return text  # fastft's own input errors already name the input and the fix
    return (
        f"{type(error).__name__}{at}: {text}. The run stopped and the kernel is fine. "
        f"{_last_checkpoint_sentence(run)} The traceback is in run.traceback."
    )


# ------------------------------------------------------------------------------------------------ panel


def _notice(text: str, kind: str = "info", title: str | None = None) -> str:
    from fastft.studio.notices import error_html, status_html

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
    update ("widget", "display", "text"; default: `fastft.studio.live.frontend()`).
    """

    TIMING_EVERY = 3.0  # seconds between redraws of the step-timing figure and table
    TIMING_STEPS = 120  # steps shown in the step-timing bars (the latest ones)
    TEXT_EVERY = 10.0  # seconds between status lines printed without a notebook

    def __init__(self, state: StudioState | None = None, *, live: str | None = None, max_points: int = 2000):
        import ipywidgets as widgets

        from fastft.report.figures import phases_figure, run_dashboard_figure

        self.state = state if state is not None else StudioState()
        self.run: Run | None = None
        self.mode = live or frontend()
        self._lock = threading.RLock()
        self._ticker = None
        self._closed = False
        self._seen = 0
        self._last_timing = 0.0
        self._last_text = 0.0
        self.series = SeriesBuffer(
            ("loss", "smoothed", "learning_rate", "tokens_per_second", "memory_gib"), max_points
        )
        self.eval_series = SeriesBuffer(("eval_loss",), max_points)
        self._ema = Ema(0.9)

        style = {"description_width": "130px"}
        wide = widgets.Layout(width="320px")
        self.steps = widgets.BoundedIntText(
            value=60, min=1, max=10_000_000, description="steps", style=style, layout=wide
        )
        self.learning_rate = widgets.FloatText(
            value=2e-4, description="learning rate", style=style, layout=wide
        )
        self.micro_batch_bins = widgets.BoundedIntText(
            value=1, min=1, max=1024, description="micro-batch bins", style=style, layout=wide
        )
        self.grad_accum_steps = widgets.BoundedIntText(
            value=1, min=1, max=1024, description="grad accumulation", style=style, layout=wide
        )
        self.warmup = widgets.BoundedFloatText(
            value=0.05, min=0.0, max=1_000_000, step=0.01, description="warmup", style=style, layout=wide
        )
        # ipywidgets 8 calls it `tooltip`, 7.x `description_tooltip`
        tip = "tooltip" if "tooltip" in self.warmup.traits() else "description_tooltip"
        setattr(self.warmup, tip, "below 1: a share of the steps; 1 or more: a number of steps")
        self.eval_every = widgets.BoundedIntText(
            value=0, min=0, max=10_000_000, description="eval every (0: end)", style=style, layout=wide
        )
        self.save_every = widgets.BoundedIntText(
            value=0, min=0, max=10_000_000, description="save every (0: off)", style=style, layout=wide
        )
        self.output_dir = widgets.Text(
            value="runs/studio", description="output dir", style=style, layout=wide
        )
        self.start_button = widgets.Button(description="Start", icon="play", button_style="success")
        self.pause_button = widgets.Button(description="Pause", icon="pause", disabled=True)
        self.stop_button = widgets.Button(
            description="Stop", icon="stop", button_style="danger", disabled=True
        )
        self.save_button = widgets.Button(description="Save checkpoint", icon="save", disabled=True)
        self.progress = widgets.IntProgress(value=0, min=0, max=1, layout=widgets.Layout(width="100%"))
        self.progress_text = widgets.HTML("")
        self.status = widgets.HTML("")
        self.code_preview = widgets.HTML("")
        self.plots = LiveFigure(run_dashboard_figure(), self.mode)
        self.timing_figure = LiveFigure(phases_figure([], []), self.mode)
        self.timing_table = widgets.HTML("")

        self._controls = [
            self.steps,
            self.learning_rate,
            self.micro_batch_bins,
            self.grad_accum_steps,
            self.warmup,
            self.eval_every,
            self.save_every,
            self.output_dir,
        ]
        for control in self._controls:
            control.observe(self._on_setting, names="value")
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
                widgets.HBox([widgets.VBox(self._controls[:4]), widgets.VBox(self._controls[4:])]),
            ]
        )
        buttons = widgets.HBox([self.start_button, self.pause_button, self.stop_button, self.save_button])
        timing = widgets.VBox(
            [
                widgets.HTML("<b>Step timing</b> (ms per phase, latest steps)"),
                self.timing_figure.widget,
                self.timing_table,
            ]
        )
        code = widgets.VBox([widgets.HTML("<b>The same run in Python</b>"), self.code_preview])
        self.widget = widgets.VBox(
            [
                settings,
                buttons,
                self.progress,
                self.progress_text,
                self.status,
                self.plots.widget,
                timing,
                code,
            ]
        )
        self._update_preview()
        self._update_buttons()
        if isinstance(self.state.run, Run):  # a studio shown again: watch the run the state already has
            self._attach(self.state.run)

    # -- settings and code ---------------------------------------------------------------------------
    def train_config(self):
        """The `TrainConfig` the controls describe (its errors name the field and the fix)."""
        from fastft.training.trainer import TrainConfig

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
        return kwargs

    def code(self) -> str:
        """The plain-Python equivalent of this run, from loading the model to training (runs as is)."""
        from fastft.studio.notices import call_code, py_repr

        state = self.state
        name = state.model_name or getattr(getattr(state.model, "fastft_info", None), "name", None)
        pack = state.pack_settings
        seq = getattr(state.packed, "max_seq_length", None) or pack.max_seq_length
        config = self._config_kwargs()
        defaults = {"grad_accum_steps": 1, "micro_batch_bins": 1, "eval_every": None, "save_every": None}
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
        train_on = {"train_on": pack.train_on} if pack.train_on != "responses" else {}
        lines.append(
            call_code("data", "fastft.pack", ["rows", "tokenizer"], {"max_seq_length": int(seq), **train_on})
        )
        lines.append(
            call_code(
                "result",
                "fastft.training",
                ["model", "tokenizer", "data"],
                {k: v for k, v in config.items() if not (k in defaults and defaults[k] == v)},
            )
        )
        lines.append('print(f"final loss {result.final_loss:.4f}")')
        return "\n".join(lines) + "\n"

    def _update_preview(self) -> None:
        try:
            from fastft.studio.notices import code_html

            self.code_preview.value = code_html(self.code())
        except Exception as error:  # noqa: BLE001 - a preview must never break the panel
            self.code_preview.value = _notice(f"(no preview: {error})", "warn")

    def _on_setting(self, change=None) -> None:
        self._update_preview()

    def _on_state(self, name: str) -> None:
        run = self.state.run
        if name == "run" and isinstance(run, Run) and run is not self.run:
            self._attach(run)  # started elsewhere (another panel, or code): watch it here too
        self._update_preview()
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
        if state.packed is None:
            raise RuntimeError(
                "No packed data yet. Fix: load and pack a dataset in the Data tab (fastft.pack)."
            )
        if not any(p.requires_grad for p in state.model.parameters()):
            raise RuntimeError(
                "The model has no LoRA adapters to train. Fix: apply LoRA in the Model tab (fastft.add_lora)."
            )
        config = self.train_config()
        eval_data = getattr(state, "eval_packed", None)
        notes = []
        if config.eval_every and eval_data is None:
            notes.append("eval every is set but there is no eval set: no evaluation will run.")
        notes += self._fit_warning(config)
        run = Run(state.model, state.tokenizer, state.packed, eval_data, config)
        state.run = run
        self._attach(run)
        self._show(" ".join(notes), "warn")
        run.start()
        self._update_buttons()
        state.notify("run")
        return run

    def _attach(self, run: Run) -> None:
        """Watch `run`: plots from its first event, updates a few times a second until it ends."""
        if self._ticker is not None:
            self._ticker.stop()
        self.run = run
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
        if run.status == "paused":
            run.resume()
            self._show("Resumed.", "info")
        else:
            run.pause()
            self._show(
                "Pausing after the current step… (Resume continues, Save checkpoint writes one now)", "info"
            )
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
    def _reset_plots(self, run: Run) -> None:
        from fastft.report.figures import run_dashboard_figure

        max_steps = run.max_steps
        try:
            cuda = next(run.model.parameters()).device.type == "cuda"
        except (AttributeError, StopIteration):
            cuda = False
        with self._lock:
            self.series.clear()
            self.eval_series.clear()
            self._ema = Ema(0.9)
            self._seen = 0
            self._last_timing = 0.0
            self.progress.max = max(1, int(max_steps or 1))
            self.progress.value = 0
            self.progress.bar_style = ""
            self.progress_text.value = ""
            self.plots.replace(
                run_dashboard_figure(max_steps=max_steps, memory_kind="cuda" if cuda else "cpu-rss")
            )

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
                elif isinstance(event, EvalEvent):
                    self.eval_series.append(event.step, eval_loss=event.eval_loss)
            if new or final:
                self._draw()
            self._update_progress()
            now = time.monotonic()
            if final or now - self._last_timing >= self.TIMING_EVERY:
                self._last_timing = now
                self._draw_timing()
            if self.mode == "text" and (final or now - self._last_text >= self.TEXT_EVERY) and run.events:
                self._last_text = now
                print(self._status_line(), flush=True)
            if final:
                self.plots.flush()
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
        evals = [e for e in run.events[-50:] if isinstance(e, EvalEvent)]
        if evals:
            parts.append(f"eval loss {evals[-1].eval_loss:.4f}")
        return " · ".join(parts)

    def _draw_timing(self) -> None:
        from fastft.report.figures import phases_figure
        from fastft.training.timing import phase_table

        trainer = self.run.trainer if self.run is not None else None
        profile = getattr(trainer, "profile", None)
        if profile is None:
            return
        n = len(profile.steps)  # phases are appended before steps: both hold at least n entries
        if not n:
            return
        first = max(0, n - self.TIMING_STEPS)
        steps, phases = list(profile.steps[first:n]), list(profile.phases[first:n])
        self.timing_figure.replace(phases_figure(steps, phases))
        table = phase_table(profile.phases[1:n] if n > 1 else profile.phases[:n])
        self.timing_table.value = table._repr_html_()

    def _on_done(self, run: Run) -> None:
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
        self.state.notify("run")

    # -- small helpers ---------------------------------------------------------------------------------
    def _show(self, text: str, kind: str = "info", title: str | None = None) -> None:
        self.status.value = _notice(text, kind, title)

    def _update_buttons(self) -> None:
        run = self.run
        active = run is not None and run.active
        self.start_button.disabled = active
        self.pause_button.disabled = not active or run.status == "stopping"
        self.pause_button.description = "Resume" if active and run.status == "paused" else "Pause"
        self.pause_button.icon = "play" if active and run.status == "paused" else "pause"
        self.stop_button.disabled = not active
        self.save_button.disabled = run is None or run.error is not None or run.status == "created"
        for control in self._controls:
            control.disabled = active
