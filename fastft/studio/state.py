"""`StudioState`: the one mutable object the studio's panels share, and the worker they run jobs on.

Plain Python, no widgets: a panel reads and writes the fields, then calls ``state.notify(name)``;
panels that care subscribe with ``state.observe(callback, names)`` and are called as
``callback(name)``. Bound methods are held weakly, so a closed panel that nobody references
stops being called without unsubscribing.

Fields and who writes them::

    model_name      ModelPanel, as soon as a model is picked (before Load)   notify("model_name")
    load_settings   ModelPanel: precision, max_seq_length                     notify("load_settings")
    lora_settings   ModelPanel: r, alpha, dropout, targets, checkpointing     notify("lora_settings")
    model, tokenizer  ModelPanel after Load (or Apply LoRA)                   notify("model")
    dataset_name, rows  DataPanel after Load data                             notify("rows")
    pack_settings   DataPanel: max_seq_length, format, chat template, train_on  notify("pack_settings")
    packed          DataPanel after Pack (None when stale)                    notify("packed")
    run             RunPanel                                                  notify("run")
    run_settings    RunPanel: its controls' values, kept across a re-run of the studio cell
    saved           whoever saves the trained adapter (`mark_saved`): (model id, step, folder)
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import fastft.weight_formats as weight_formats

__all__ = [
    "PRECISIONS",
    "LoadSettings",
    "LoraSettings",
    "PackSettings",
    "Debouncer",
    "StudioState",
    "Worker",
]

PRECISIONS = tuple(record.choice for record in weight_formats.choices())  # "16-bit", "8-bit", "4-bit"


@dataclass
class LoadSettings:
    """How the model is loaded: ``precision`` "16-bit" | "8-bit" | "4-bit" | "FP8", and ``max_seq_length``."""

    precision: str = "16-bit"
    max_seq_length: int = 256

    @property
    def load_kwargs(self) -> dict[str, Any]:
        """The `fastft.load_model` keyword arguments these settings stand for (defaults left out)."""
        kwargs: dict[str, Any] = {"max_seq_length": int(self.max_seq_length)}
        load_flag = weight_formats.from_choice(self.precision).load_flag
        if load_flag is not None:
            kwargs[load_flag] = True
        return kwargs

    @property
    def vram_precision(self) -> str | None:
        """`fastft.estimate_vram`'s name for the precision: "nf4", "int8", or None (bf16 default)."""
        record = weight_formats.from_choice(self.precision)
        return record.name if record.quantized else None


@dataclass
class LoraSettings:
    """The adapters `add_lora` puts on the model.

    ``target_modules`` is a list of short layer names, or None for every linear layer ("all-linear").
    ``gradient_checkpointing`` is a `Checkpointing` kind ("auto", "offload", "recompute" or "none"), the
    value `add_lora` and ``estimate_vram`` take.
    """

    r: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | None = None
    gradient_checkpointing: str = "auto"

    @property
    def targets(self) -> str | list[str]:
        """``add_lora(target_modules=...)``: "all-linear" or the list of names."""
        return "all-linear" if self.target_modules is None else list(self.target_modules)

    @property
    def add_lora_kwargs(self) -> dict[str, Any]:
        """The `fastft.add_lora` keyword arguments these settings stand for."""
        return dict(
            r=int(self.r),
            alpha=_number(self.alpha),
            dropout=float(self.dropout),
            target_modules=self.targets,
            gradient_checkpointing=self.gradient_checkpointing,
        )


@dataclass
class PackSettings:
    """How rows become packed bins: ``max_seq_length`` per bin, the row ``format`` given to
    `load_dataset` ("auto", "alpaca", "sharegpt", "messages", "text"), the ``chat_template``
    ("tokenizer": the tokenizer's own, or "chatml") and ``train_on`` ("responses" or "all")."""

    max_seq_length: int = 256
    format: str = "auto"
    chat_template: str = "tokenizer"
    train_on: str = "responses"


@dataclass(eq=False)
class StudioState:
    """Everything the studio's panels share; see the module docstring for who writes what."""

    model_name: str | None = None
    model: Any = None
    tokenizer: Any = None
    load_settings: LoadSettings = field(default_factory=LoadSettings)
    lora_settings: LoraSettings = field(default_factory=LoraSettings)
    dataset_name: str | None = None
    rows: Any = None
    packed: Any = None
    pack_settings: PackSettings = field(default_factory=PackSettings)
    run: Any = None
    run_settings: dict = field(default_factory=dict)
    saved: tuple | None = None
    _observers: list = field(default_factory=list, init=False, repr=False, compare=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False, compare=False)

    def observe(self, callback: Callable[[str], Any], names: str | Iterable[str] | None = None) -> None:
        """Call ``callback(name)`` after ``notify(name)`` for each of `names` (None: every name).

        A bound method is held weakly (its panel can be garbage-collected); a plain function strongly.
        Observing the same callback again replaces its names.
        """
        wanted = None if names is None else frozenset([names] if isinstance(names, str) else names)
        ref = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else _Strong(callback)
        with self._lock:
            self._observers = [(r, n) for r, n in self._observers if r() is not None and r() != callback]
            self._observers.append((ref, wanted))

    def unobserve(self, callback: Callable | None = None, *, owner: object = None) -> None:
        """Stop calling `callback`, or every bound method of `owner` (e.g. a panel being closed)."""
        with self._lock:
            self._observers = [
                (r, n)
                for r, n in self._observers
                if (f := r()) is not None
                and f != callback
                and (owner is None or getattr(f, "__self__", None) is not owner)
            ]

    def notify(self, name: str) -> None:
        """Tell every observer of `name` that it changed. An observer that raises is reported as a
        warning and does not stop the others (one panel's bug must not break another's action)."""
        with self._lock:
            targets = [f for r, n in self._observers if (f := r()) is not None and (n is None or name in n)]
        for callback in targets:
            try:
                callback(name)
            except Exception as error:  # noqa: BLE001 - reported, never raised into another panel's job
                warnings.warn(
                    f"studio observer {getattr(callback, '__qualname__', callback)!r} failed on "
                    f"{name!r}: {type(error).__name__}: {error}",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def trained_steps(self) -> int:
        """Steps the state's run has trained into the loaded model (0: none, or another model's run)."""
        run = self.run
        if run is None or getattr(run, "model", None) is not self.model or self.model is None:
            return 0
        return int(getattr(run, "step", 0) or 0)

    def mark_saved(self, folder: str) -> None:
        """Record that the loaded model's adapter, as trained so far, is saved in `folder` (the Export tab
        and the Model tab's automatic save call this), so loading another model does not save it again."""
        self.saved = (id(self.model), self.trained_steps(), str(folder))

    def unsaved_steps(self) -> int:
        """Trained steps of the loaded model that neither a save nor the run's last checkpoint holds."""
        steps = self.trained_steps()
        if not steps:
            return 0
        if self.saved is not None and self.saved[0] == id(self.model) and self.saved[1] >= steps:
            return 0
        checkpoints = list(getattr(self.run, "checkpoints", ()) or ())
        if checkpoints and str(checkpoints[-1]).rstrip("/").endswith(f"checkpoint-{steps}"):
            return 0
        return steps


class _Strong:
    """A strong reference with `weakref.WeakMethod`'s calling convention."""

    def __init__(self, value):
        self._value = value

    def __call__(self):
        return self._value


def _number(value: float) -> int | float:
    """16.0 → 16 so generated code reads as a person would write it."""
    value = float(value)
    return int(value) if value.is_integer() else value


class Worker:
    """Runs one job at a time on a daemon thread, so a click returns at once and the notebook stays
    responsive; `wait` blocks until the job is done (scripts, tests, notebook execution)."""

    def __init__(self, name: str = "fastft-studio"):
        self.name = name
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """Whether a job is running."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self, job: Callable[[], Any]) -> bool:
        """Start `job` on a new thread; False (and nothing started) while another job runs.

        `job` must handle its own errors (the panels show them in their error area)."""
        with self._lock:
            if self.busy:
                return False
            self._thread = threading.Thread(target=job, name=self.name, daemon=True)
            self._thread.start()
            return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the running job (if any) finishes; False if `timeout` seconds passed first."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()


class Debouncer:
    """Calls `callback(*args)` on a timer thread once `delay` seconds pass without another `__call__`:
    a keystroke re-arms it, so only the last value typed is looked up. `cancel` drops the pending call."""

    def __init__(self, callback: Callable[..., Any], delay: float = 0.35):
        self.callback = callback
        self.delay = delay
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self.running = 0  # callbacks running now

    def __call__(self, *args: Any) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self.delay, self._call, args)
            self._timer.daemon = True
            self._timer.start()

    def _call(self, *args: Any) -> None:
        self.running += 1
        try:
            self.callback(*args)
        finally:
            self.running -= 1

    def cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    @property
    def pending(self) -> bool:
        timer = self._timer
        return timer is not None and timer.is_alive() and not self.running
