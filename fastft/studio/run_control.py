"""Training from the studio: a `Run` of the engine's `Trainer` on a background thread, and `explain`.

`Run` wraps the `Trainer`: ``start()`` trains on a daemon thread so the notebook stays responsive;
``pause()`` / ``resume()`` / ``stop()`` take effect between steps (the trainer's own `pause` / `unpause` /
`stop`, which hold its thread at a step boundary); ``wait()`` blocks (scripts, notebook execution);
``save_checkpoint()`` is done by the training thread at the next step boundary, at once while paused
(`Trainer.call_between_steps`), so a checkpoint never sees half an optimizer step. Errors (out of memory, a non-finite loss, bad data) end
the run cleanly: they are kept in ``run.error`` with a message that names the fix (`explain`), the kernel
stays alive, and checkpoints already written stay. The widgets that drive a `Run` are
`fastft.studio.run.RunPanel`.
"""

from __future__ import annotations

import gc
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace

import torch

from fastft.data.errors import FastftDataError
from fastft.training.cpu_threads import choose_training_threads
from fastft.training.events import Event, StepEvent
from fastft.training.trainer import NonFiniteLossError

__all__ = ["Run", "RunLifecycle", "explain", "run_result"]

_ACTIVE = ("starting", "running", "pausing", "paused", "stopping")


class RunLifecycle:
    """What every studio run shares (`Run` in this process, `fastft.studio.launched.LaunchedRun` under
    torchrun): its status and events, waiting for it, and being told when it ends. A run sets ``events``,
    ``error``, ``_status``, ``_lock``, ``_done`` (an Event) and ``_done_callbacks``, and has a ``result``."""

    def wait(self, timeout: float | None = None, *, raise_error: bool = False):
        """Block until the run ends (or `timeout` seconds); returns its result (None before there is one).
        With `raise_error`, the exception that ended the run is raised here."""
        self._done.wait(timeout)
        if raise_error and self.error is not None and self.done:
            raise self.error
        return self.result

    def add_done_callback(self, callback: Callable[[RunLifecycle], None]) -> None:
        """Call `callback(run)` once the run has ended (on the thread that ends it; at once if it has)."""
        with self._lock:
            if not self.done:
                self._done_callbacks.append(callback)
                return
        callback(self)

    def _begin(self, instead: str) -> None:
        """Move a created run to "starting" and start its clock (`started_at`); a run started before is
        refused, the error saying what to do `instead`."""
        with self._lock:
            if self._status != "created":
                raise RuntimeError(f"This run was already started ({self._status}); {instead}.")
            self._status = "starting"
            self.started_at = time.monotonic()

    @property
    def status(self) -> str:
        return self._status

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def active(self) -> bool:
        return self._status in _ACTIVE

    @property
    def step(self) -> int:
        """The last step whose event arrived."""
        for event in reversed(self.events):
            if isinstance(event, StepEvent):
                return event.step
        return 0


class Run(RunLifecycle):
    """One training run of `model` on `train_data`, on a background thread.

    Arguments are `fastft.Trainer`'s (with `rewards`, a `GRPOTrainer`'s: `train_data` are the prompt rows and
    `config` a `GRPOConfig`); the trainer is built on the training thread when `start()`
    is called (choosing the attention backend can take a moment on a GPU) and is then ``.trainer``.
    ``.events`` lists every `StepEvent` / `EvalEvent` so far; ``.result`` is the trainer's
    `TrainResult` (partial while running); ``.error`` the exception that ended it, if any, and
    ``.error_message`` what to do about it. ``.status``: "created", "starting", "running",
    "pausing" (until the step in progress ends), "paused", "stopping", then "finished", "stopped" or "failed".
    """

    def __init__(
        self,
        model,
        tokenizer,
        train_data,
        eval_data=None,
        config=None,
        *,
        trainer=None,
        rewards=None,
        threads: str | int | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.rewards = rewards  # GRPO's reward functions (a GRPOConfig run: `train_data` are prompt rows)
        self.train_data, self.eval_data = train_data, eval_data
        self.config = config if config is not None else getattr(trainer, "config", None)
        self.trainer = trainer
        self.threads = threads  # CPU threads: "auto" (timed as the demo does), a count, or None (as they are)
        self.threads_note = ""  # what was chosen, and why
        self.events: list[Event] = []
        self.error: BaseException | None = None
        self.traceback = ""
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._status = "created"
        self._lock = threading.Lock()
        self._pause = False
        self._stop = False
        self._jobs: list[tuple[Callable[[], object], Future]] = []
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
        self._begin("create a new Run")
        self._thread = threading.Thread(target=self._main, name="fastft-run", daemon=True)
        self._thread.start()
        return self

    @property
    def status(self) -> str:
        """As `RunLifecycle.status`, and "pausing" from `pause()` until the step in progress has ended."""
        status = self._status
        return "pausing" if status == "paused" and not self.parked else status

    def pause(self) -> None:
        """Hold the run after the current step (its weights, optimizer and data order stay as they are):
        the status is "pausing" until the step in progress ends, then "paused"."""
        with self._lock:
            if self._status in ("starting", "running") and not self._stop:
                self._pause = True
                self._paused_since = time.monotonic()
                self._status = "paused"
                if self.trainer is not None:  # else the training thread pauses it once it is built
                    self.trainer.pause()

    def resume(self) -> None:
        with self._lock:
            if self._pause:
                self._pause = False
                self._paused_seconds += time.monotonic() - (self._paused_since or time.monotonic())
                self._paused_since = None
                if self._status == "paused":
                    self._status = "running"
                if self.trainer is not None:
                    self.trainer.unpause()

    def stop(self) -> None:
        """Finish the current step, then stop; a checkpoint is written when the config has an output_dir."""
        with self._lock:
            if self.done:
                return
            self._stop = True
            self._status = "stopping"
            if self._pause:
                self._paused_seconds += time.monotonic() - (self._paused_since or time.monotonic())
                self._pause, self._paused_since = False, None
            if self.trainer is not None:
                self.trainer.stop()  # a paused trainer stops where it holds

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
        with self._lock:
            if not self.done:
                self._jobs.append((self._save, future))
                if self.trainer is not None:  # else queued for the trainer once it is built
                    self.trainer.call_between_steps(self._serve_jobs)
                return future
        _run_job(self._save, future)  # the training thread is gone: the trainer is idle
        return future

    def _save(self):
        return self.trainer.save_checkpoint()

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        """Call `listener(event)` on the training thread for every event: keep it cheap (append, set a flag)."""
        self._listeners.append(listener)

    # -- reading -------------------------------------------------------------------------------------
    @property
    def parked(self) -> bool:
        """True while the training thread holds between two steps (paused)."""
        return self.trainer is not None and self.trainer.holding

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
            self._set_threads()
            if self.trainer is None and self.rewards is not None:
                from fastft.training.objectives.grpo import GRPOTrainer

                self.trainer = GRPOTrainer(
                    self.model, self.tokenizer, self.train_data, self.rewards, self.config
                )
            elif self.trainer is None:
                from fastft.training.trainer import Trainer

                self.trainer = Trainer(
                    self.model, self.tokenizer, self.train_data, self.eval_data, self.config
                )
            self.trainer.subscribe(self._on_event)
            with self._lock:  # what was asked for while the trainer was being built
                if self._stop:
                    self.trainer.stop()
                elif self._status == "starting":
                    self._status = "running"
                if self._pause:
                    self.trainer.pause()
                if self._jobs:
                    self.trainer.call_between_steps(self._serve_jobs)
            self.trainer.train()
        except BaseException as error:  # noqa: BLE001 - kept for the panel; the kernel must live on
            self.error = error
            self.traceback = traceback.format_exc()
            _release_memory(self.trainer, error)
        finally:
            self.finished_at = time.monotonic()
            with self._lock:
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
            with self._lock:
                callbacks, self._done_callbacks = self._done_callbacks, []
            for callback in callbacks:
                try:
                    callback(self)
                except Exception:  # noqa: BLE001 - a face's bug must not hide the run's end
                    traceback.print_exc()
            self._done.set()

    def _set_threads(self) -> None:
        """On a CPU, the thread count asked for: "auto" times a micro-batch at one thread and at torch's
        default and keeps the faster (`fastft.training.cpu_threads`), as the demo does."""

        if self.threads is None or self.model is None:
            return
        if next(self.model.parameters()).device.type != "cpu":
            return
        if self.threads != "auto":
            torch.set_num_threads(int(self.threads))
            self.threads_note = f"{int(self.threads)} (as set)"
            return
        if self.rewards is not None or not hasattr(self.train_data, "batch"):
            self.threads_note = f"{torch.get_num_threads()} (not timed: GRPO samples its own batches)"
            return

        bins = getattr(self.config, "micro_batch_bins", 1) or 1
        self.threads_note = choose_training_threads(self.model, self.train_data, bins).describe("micro-batch")

    def _on_event(self, event: Event) -> None:
        self.events.append(event)
        for listener in self._listeners:
            listener(event)

    def _serve_jobs(self) -> None:
        """Called by the trainer on the training thread between two steps: the jobs asked for so far."""
        with self._lock:
            jobs, self._jobs = self._jobs, []
        for job, future in jobs:
            _run_job(job, future)


def _run_job(job: Callable[[], object], future: Future) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(job())
    except BaseException as error:  # noqa: BLE001 - handed to whoever asked
        future.set_exception(error)


def _release_memory(trainer, error: BaseException) -> None:
    """After a failed step: drop its gradients and cached blocks so the notebook can go on."""

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
    oom = getattr(torch.cuda, "OutOfMemoryError", ())
    return (oom and isinstance(error, oom)) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower()
    )


def explain(error: BaseException, run: Run | None = None) -> str:
    """A message for `error` that says what happened and how to fix it (plain text)."""

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


def run_result(events: list, checkpoints: list[str], **extra) -> SimpleNamespace:
    """What the studio reads of a finished run in another process: the final loss, the checkpoints, the steps
    (and `extra`, such as its ``seconds``)."""
    steps = [e for e in events if isinstance(e, StepEvent)]
    return SimpleNamespace(
        final_loss=steps[-1].loss if steps else float("nan"),
        checkpoints=checkpoints,
        steps=steps,
        attention=None,
        **extra,
    )
