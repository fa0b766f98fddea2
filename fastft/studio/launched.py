"""A studio run on every GPU: the Run tab's settings trained by a torchrun subprocess, followed like a run in
the kernel.

`LaunchedRun` writes what the run needs into a folder of its own under the run's output folder
(``<output_dir>/launch``): the packed data as the Data tab packed it (`PackedDataset.save`: the same bins in
every process), the adapter as it is in the kernel now (`save_adapter`: a run continues from there, as one in
the kernel would), and ``train.py``, the script each rank runs (readable: it is the Python section's run with
those two files). It starts ``torchrun --standalone --nproc_per_node=N train.py`` (`fastft.launch`) in a
process group of its own; rank 0 writes every event to ``events.jsonl`` (`fastft.training.events.EventLog`),
which this run reads a few times a second, so the plots, the progress line and the status follow it. Stop
ends the processes (SIGTERM to the group: torchrun stops its workers); the last checkpoint written stays.
When the run finishes, rank 0 saves the trained adapter (``trained``) and this run puts it into the kernel's
model, so Export and "Try a prompt" use what was trained. Pause and checkpoints on demand need the training loop in this process: they
are not offered here. Its output (torchrun's and the ranks') goes to ``train.log``, whose end an error
shows.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from fastft.launch import torchrun_command
from fastft.models.hf_save import save_adapter
from fastft.studio.notices import call_code, py_repr
from fastft.studio.process_run import load_trained_adapter
from fastft.studio.run_control import RunLifecycle, run_result
from fastft.training.checkpoint import list_checkpoints
from fastft.training.events import Event, read_events

__all__ = ["LaunchedRun", "launch_choices"]

POLL_S = 0.5  # how often the events file and the processes are looked at


def launch_choices() -> list[tuple[str, int]]:
    """The Run tab's "processes" choices: this kernel, and every GPU through torchrun when there are several."""

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    choices = [("this kernel", 1)]
    if gpus > 1:
        choices.append((f"all {gpus} GPUs (torchrun)", gpus))
    return choices


class LaunchedRun(RunLifecycle):
    """One run of `config` on `processes` ranks (see the module docstring). It reads like a `Run`
    (`RunLifecycle`):
    ``.events``, ``.status`` ("created", "starting", "running", "stopping", then "finished", "stopped" or
    "failed"), ``.step``, ``.max_steps``, ``.checkpoints``, ``.result``, ``.error`` and ``.error_message``,
    ``wait()``, ``stop()``, ``add_done_callback()``."""

    trainer = None  # the trainer lives in the ranks
    rewards = None

    def __init__(self, state, config, processes: int, *, model_name: str, train: dict):
        if not getattr(config, "output_dir", None):
            raise ValueError(
                "A run on several GPUs writes its checkpoints to the output dir, and the studio reads the trained "
                "adapter back from there. Fix: set an output dir in the Run tab."
            )
        self.state, self.config, self.processes = state, config, processes
        self.model = state.model
        self.model_name = model_name
        self.train = train  # `fastft.train`'s keyword arguments, as the Run tab's Python section has them
        self.folder = Path(config.output_dir).expanduser() / "launch"
        self.events: list[Event] = []
        self.error: BaseException | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.process: subprocess.Popen | None = None
        self._status = "created"
        self._stop = False
        self._offset = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._done_callbacks: list[Callable[[LaunchedRun], None]] = []
        self._checkpoints: list[str] = []

    # -- what the ranks run ----------------------------------------------------------------------------
    @property
    def events_path(self) -> Path:
        return self.folder / "events.jsonl"

    @property
    def log_path(self) -> Path:
        return self.folder / "train.log"

    @property
    def trained_path(self) -> Path:
        return self.folder / "trained"

    def script(self) -> str:
        """``train.py``: the run each rank executes."""

        state = self.state
        lora = state.lora_settings
        return "\n".join(
            [
                '"""Written by the fastft studio: its Run tab\'s run on every GPU (torchrun runs this on each rank)."""',
                "import fastft",
                "from fastft.data.packing import load_packed",
                "from fastft.models.lora import load_adapter",
                "from fastft.training.distributed import is_main_process",
                "from fastft.training.events import EventLog",
                "",
                call_code(
                    "model, tokenizer",
                    "fastft.load_model",
                    [py_repr(self.model_name)],
                    state.load_settings.load_kwargs,
                ),
                "# the adapter as it was in the studio's kernel when the run started",
                call_code(
                    "model",
                    "load_adapter",
                    ["model", py_repr(str(self.folder / "start"))],
                    {"gradient_checkpointing": lora.gradient_checkpointing},
                ),
                "# the Data tab's packed bins, saved as they were",
                call_code("data", "load_packed", [py_repr(str(self.folder / "data.npz"))]),
                _train_call(self.train, str(self.events_path)),
                "if is_main_process():  # the trained adapter, once, for the studio to take back",
                f"    fastft.save_adapter(model, {py_repr(str(self.trained_path))}, overwrite=True)",
                "",
            ]
        )

    # -- control -------------------------------------------------------------------------------------
    def start(self) -> LaunchedRun:
        """Write the run's files and start torchrun; returns at once (a watcher thread follows it)."""

        self._begin("create a new one")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for stale in (self.events_path, self.log_path, self.trained_path / "adapter_model.safetensors"):
                stale.unlink(missing_ok=True)
            self.state.packed.save(self.folder / "data.npz")
            save_adapter(self.model, self.folder / "start", overwrite=True)
            script = self.folder / "train.py"
            script.write_text(self.script(), encoding="utf-8")
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    torchrun_command(script, [], self.processes),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=os.getcwd(),
                    start_new_session=True,  # its own process group: Stop reaches torchrun and every rank
                )
        except BaseException as error:
            self._finish("failed", error)
            raise
        threading.Thread(target=self._watch, name="fastft-launched-run", daemon=True).start()
        return self

    def stop(self) -> None:
        """End the run: torchrun and its ranks get SIGTERM (the last checkpoint written stays)."""
        with self._lock:
            if self.done or self.process is None:
                return
            self._stop = True
            self._status = "stopping"
        _signal_group(self.process, signal.SIGTERM)

    def pause(self) -> None:
        raise RuntimeError(
            "A run on several GPUs cannot pause: stop it (its checkpoints stay) and start again."
        )

    resume = pause

    def save_checkpoint(self) -> Future:
        future: Future = Future()
        future.set_exception(
            RuntimeError(
                "A run on several GPUs writes checkpoints by 'save every' only: set it before Start, or Stop."
            )
        )
        return future

    # -- reading -------------------------------------------------------------------------------------
    @property
    def parked(self) -> bool:
        return False

    @property
    def max_steps(self) -> int | None:
        return getattr(self.config, "max_steps", None)

    @property
    def checkpoints(self) -> list[str]:
        return list(self._checkpoints)

    @property
    def result(self):
        """What the studio reads of a finished run: the final loss, the checkpoints, the steps."""
        return run_result(self.events, self.checkpoints)

    @property
    def elapsed_seconds(self) -> float:
        if self.started_at is None:
            return 0.0
        return max(0.0, (self.finished_at or time.monotonic()) - self.started_at)

    @property
    def error_message(self) -> str:
        return "" if self.error is None else str(self.error)

    # -- the watcher thread --------------------------------------------------------------------------
    def _read(self) -> None:
        new, self._offset = read_events(self.events_path, self._offset)
        if new:
            self.events.extend(new)
            if self._status == "starting":
                self._status = "running"

    def _watch(self) -> None:
        process = self.process
        while process.poll() is None:
            self._read()
            time.sleep(POLL_S)
        self._read()

        self._checkpoints = [str(path) for path in list_checkpoints(self.config.output_dir)]
        if self._stop:
            self._finish("stopped")
        elif process.returncode != 0:
            self._finish(
                "failed",
                RuntimeError(
                    f"The run on {self.processes} processes failed (torchrun exited with {process.returncode}). "
                    f"The end of its log ({self.log_path}):\n{_tail(self.log_path)}"
                ),
            )
        else:
            try:
                self._load_trained_adapter()
            except Exception as error:  # noqa: BLE001 - shown in the panel
                self._finish("failed", error)
                return
            self._finish("finished")

    def _load_trained_adapter(self) -> None:
        """The adapter rank 0 saved at the end into the kernel's model (checked as a resume checks it)."""

        load_trained_adapter(self.model, self.trained_path, self.log_path)

    def _finish(self, status: str, error: BaseException | None = None) -> None:
        with self._lock:
            self._status, self.error = status, error
            self.finished_at = time.monotonic()
            self._done.set()
            callbacks, self._done_callbacks = self._done_callbacks, []
        for callback in callbacks:
            callback(self)


class _Code:
    """A value `call_code` writes as it is (an expression, not a string)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _train_call(config: dict, events: str) -> str:
    kwargs = {**config, "progress": False, "subscribers": _Code(f"[EventLog({py_repr(events)})]")}
    return call_code("result", "fastft.train", ["model", "tokenizer", "data"], kwargs)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
