"""A studio run in a child process: `ProcessRun` writes the run's folder, starts `fastft.studio.worker` there
in a session of its own, and follows it through the folder's files (`fastft.studio.run_folder`), so the run
outlives the kernel and any notebook can follow it again (`ProcessRun.attach`), or resume it from a checkpoint (`ProcessRun.from_checkpoint`).

It reads like a `Run` (`RunLifecycle`): ``.events`` (read from ``events.jsonl`` a few times a second),
``.status`` (from ``status.json`` and whether the pid lives), ``.step``, ``.checkpoints``, ``.result``,
``.error`` (a crash's traceback included), ``wait()``, ``add_done_callback()``; ``pause()``, ``resume()``,
``stop()`` and ``save_checkpoint()`` leave a request in ``control/`` that the worker acts on between steps.
``.pid`` and ``.log_path`` say where the process is and what it printed. A run this kernel started from its
loaded model gets the trained adapter back into that model when it ends (finished or stopped), so Export
and "Try a prompt" use what was trained; a run attached later leaves the kernel's model alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from safetensors.torch import load_file

from fastft.models.hf_save import save_adapter
from fastft.studio import run_folder as files
from fastft.studio.run_control import RunLifecycle, run_result
from fastft.training.checkpoint import CHECKPOINT_PATTERN, check_adapter_matches, list_checkpoints
from fastft.training.events import Event, read_events

# Function-local imports: peft imports bitsandbytes, which asks the hub for a kernel: peft loads first under
# `fastft.data.hub.hub_offline_while_importing` (fastft.models.lora).

__all__ = ["ProcessRun", "load_trained_adapter"]

POLL_S = 0.25  # how often the folder's events, status and the pid are looked at


class ProcessRun(RunLifecycle):
    """The run in `folder` (see the module docstring); `model`: the kernel's model it trains on, or None."""

    trainer = None  # the trainer lives in the worker

    def __init__(self, folder: str | os.PathLike, *, model=None):
        self.folder = Path(folder).expanduser().absolute()
        self.model = model
        self.spec = files.read_json(self.folder / files.SPEC) or {}
        config = dict(self.spec.get("config") or {})
        config.setdefault("method", self.spec.get("method", "sft"))
        self.config = SimpleNamespace(**config, output_dir=str(self.folder))
        self.rewards = None
        if self.spec.get("rewards"):
            from fastft.studio.grpo import reward_functions

            self.rewards = reward_functions(self.spec["rewards"])
        self.events: list[Event] = []
        self.error: BaseException | None = None
        self.traceback = ""  # the worker's, when it failed
        self.process: subprocess.Popen | None = None
        self.pid: int | None = None
        self.fields: dict = {}
        self._status = "created"
        self._wanted: str | None = None  # "pause", "resume" or "stop": asked, not yet seen in status.json
        self._offset = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._done_callbacks: list[Callable[[ProcessRun], None]] = []
        self._saves: dict[str, Future] = {}
        self._watcher: threading.Thread | None = None
        self._error_text = ""
        self._rollout: tuple | None = None  # (rollout.json's mtime, what it holds)

    # -- making and starting -------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        folder: str | os.PathLike,
        state,
        *,
        model_name: str,
        method: str,
        config: dict,
        rewards: list[str] | None = None,
        threads: str | int | None = "auto",
        trackers: list[str] | tuple = (),
    ) -> ProcessRun:
        """Write a run folder for the state's model and data (`config`: the `TrainConfig` / `GRPOConfig`
        keyword arguments), ready to `start`. `folder` must be new or empty (`run_folder.fresh_folder`)."""

        folder = Path(folder).expanduser()
        if folder.exists() and any(folder.iterdir()):
            raise FileExistsError(f"{folder} already holds files: a new run needs a folder of its own.")
        folder.mkdir(parents=True, exist_ok=True)
        data: dict = {}
        if method == "grpo":
            data["rows"] = "rows.jsonl"
            _write_rows(state.rows, folder / "rows.jsonl")
        else:
            data["train"] = Path(state.packed.save(folder / "data.npz")).name
            eval_packed = getattr(state, "eval_packed", None)
            if eval_packed is not None:
                data["eval"] = Path(eval_packed.save(folder / "eval.npz")).name
        save_adapter(state.model, folder / files.START, overwrite=True)
        device = next(state.model.parameters()).device.type
        spec = {
            "format": files.SPEC_FORMAT,
            "created": time.time(),
            "model": {
                "name": model_name,
                "load": state.load_settings.load_kwargs,
                "gradient_checkpointing": state.lora_settings.gradient_checkpointing,
                "chat_template": getattr(state.tokenizer, "chat_template", None),
            },
            "device": device,
            "method": method,
            "config": {k: v for k, v in config.items() if k not in ("output_dir", "resume_from")},
            "rewards": list(rewards) if rewards else None,
            "threads": threads,
            "trackers": list(trackers),
            "data": data,
        }
        files.write_json(folder / files.SPEC, spec)
        return cls(folder, model=state.model)

    def start(self, resume_from: str | None = None) -> ProcessRun:
        """Start the worker (`resume_from`: a checkpoint folder of this run); returns at once."""
        with self._lock:
            if self._status != "created" or self.process is not None:
                raise RuntimeError(f"This run was already started ({self._status}).")
            self._status = "starting"
        (self.folder / files.STATUS).unlink(missing_ok=True)
        shutil.rmtree(self.folder / files.CONTROL, ignore_errors=True)
        command = [sys.executable, "-m", files.WORKER_MODULE, str(self.folder)]
        if resume_from:
            command += ["--resume-from", str(resume_from)]
        package_root = str(Path(__file__).resolve().parents[2])  # the child imports this same fastft
        path = os.environ.get("PYTHONPATH")
        env = dict(
            os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, [package_root, path]))
        )
        try:
            with open(self.folder / files.LOG, "ab") as log:  # a resume keeps the earlier log above its own
                self.process = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=os.getcwd(),
                    start_new_session=True,  # a kernel restart (SIGKILL to the kernel's group) leaves it running
                )
        except BaseException as error:
            self._finish("failed", error)
            raise
        self.pid = self.process.pid
        self._watch_in_background()
        return self

    @classmethod
    def attach(cls, folder: str | os.PathLike, *, model=None) -> ProcessRun:
        """Follow the run in `folder` (running or ended), started by this kernel or another."""
        folder = Path(folder).expanduser()
        spec = files.read_json(folder / files.SPEC)
        if spec is None or spec.get("format") != files.SPEC_FORMAT:
            raise ValueError(
                f"{folder} is not the folder of a run the studio started (no run.json there). Fix: pass a run's "
                "folder (the Run tab's output dir, e.g. runs/studio), or open the studio without run=."
            )
        run = cls(folder, model=model)
        run._read()
        if run._status == "created":  # written, never started: nothing to follow
            run._finish("created")
            return run
        run._watch_in_background()
        return run

    @classmethod
    def from_checkpoint(
        cls, folder: str | os.PathLike, checkpoint: str | os.PathLike, *, model=None
    ) -> ProcessRun:
        """Train the run in `folder` on from its `checkpoint` in a new worker, with the run's own model, data
        and settings: the same losses as had it never stopped. The events after the checkpoint's step move
        to ``events-<time>.jsonl`` (kept), so the curves go on from the checkpoint."""

        folder = Path(folder).expanduser()
        info = files.read_run(folder)
        if info is None:
            raise ValueError(f"{folder} is not the folder of a run the studio started (no run.json there).")
        if info.active:
            raise RuntimeError(
                f"The run in {folder} is still {info.status} (pid {info.pid}): stop it before resuming it."
            )
        name = Path(checkpoint).name
        match = CHECKPOINT_PATTERN.match(name)
        if match is None or name not in {path.name for path in list_checkpoints(folder)}:
            found = ", ".join(path.name for path in list_checkpoints(folder)) or "none"
            raise ValueError(
                f"{checkpoint} is not a complete checkpoint of {folder} (its checkpoints: {found})."
            )
        _keep_events_to(folder, int(match.group(1)))
        return cls(folder, model=model).start(resume_from=name)

    # -- control -------------------------------------------------------------------------------------
    def pause(self) -> None:
        """Hold the run after the step in progress: "pausing", then "paused" once the worker holds."""
        if self.active and self._status != "stopping":
            files.ask(self.folder, "pause")
            self._wanted = "pause"

    def resume(self) -> None:
        """Go on after a pause."""
        if self.active:
            files.withdraw(self.folder, "pause")
            self._wanted = "resume"

    def stop(self) -> None:
        """Finish the step in progress, write a checkpoint and end the worker."""
        if not self.done:
            files.ask(self.folder, "stop")
            self._wanted = "stop"

    def kill(self) -> None:
        """End the worker at once (SIGKILL to its process group): the last checkpoint written stays."""

        if self.pid and files.pid_alive(self.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def save_checkpoint(self) -> Future:
        """A checkpoint written by the worker at the next step boundary; a `Future` of its folder."""
        future: Future = Future()
        if self.done:
            checkpoints = self.checkpoints
            last = f" Its last checkpoint is {checkpoints[-1]}." if checkpoints else ""
            future.set_exception(RuntimeError(f"The run has ended: no process is left to save.{last}"))
            return future
        key = uuid.uuid4().hex[:12]
        with self._lock:
            self._saves[key] = future
        files.ask(self.folder, f"save-{key}")
        return future

    # -- reading -------------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        status, wanted = self._status, self._wanted
        if wanted == "pause" and status in ("starting", "running"):
            return "pausing"
        if wanted == "resume" and status in ("pausing", "paused"):
            return "running"
        if wanted == "stop" and status in files.ACTIVE:
            return "stopping"
        return status

    @property
    def parked(self) -> bool:
        return self.status == "paused"

    @property
    def log_path(self) -> Path:
        return self.folder / files.LOG

    @property
    def threads_note(self) -> str:
        return self.fields.get("threads") or ""

    @property
    def max_steps(self) -> int | None:
        return getattr(self.config, "max_steps", None)

    @property
    def on_cuda(self) -> bool:
        return self.spec.get("device") == "cuda"

    @property
    def last_rollout(self):
        """GRPO: the latest rollout the worker wrote (prompts, completions, rewards, advantages), or None."""

        path = self.folder / files.ROLLOUT
        try:
            stamp = path.stat().st_mtime_ns
        except OSError:
            return None
        if self._rollout is None or self._rollout[0] != stamp:
            fields = files.read_json(path)
            if fields is None:
                return None if self._rollout is None else self._rollout[1]
            arrays = {k: np.asarray(fields[k]) for k in ("truncated", "rewards", "total", "advantages")}
            self._rollout = (stamp, SimpleNamespace(**{**fields, **arrays}))
        return self._rollout[1]

    @property
    def checkpoints(self) -> list[str]:
        return [str(path) for path in list_checkpoints(self.folder)]

    @property
    def result(self):
        return run_result(self.events, self.checkpoints, seconds=self.elapsed_seconds)

    @property
    def elapsed_seconds(self) -> float:
        fields = self.fields
        elapsed = float(fields.get("elapsed") or 0.0)
        if self._status == "running" and fields.get("updated"):
            elapsed += max(0.0, time.time() - fields["updated"])
        return elapsed

    @property
    def error_message(self) -> str:
        return "" if self.error is None else str(self.error)

    # -- the watcher thread --------------------------------------------------------------------------
    def _read(self) -> None:
        new, self._offset = read_events(self.folder / files.EVENTS, self._offset)
        if new:
            self.events.extend(new)
        fields, status, error = files.read_status(self.folder)
        if self.process is not None:  # our own child: its exit code says more than its pid
            code = self.process.poll()
            if code is None and not fields:
                status = "starting"  # still importing: it writes status.json soon
            elif code is not None and status not in files.ENDED:
                status = "failed"
                error = f"The worker exited with code {code} before it wrote its end. {self._log_end()}"
        if fields:
            self.fields = fields
            self.pid = fields.get("pid", self.pid)
            self.traceback = fields.get("traceback") or self.traceback
        self._error_text = error
        with self._lock:
            seen = {
                "pause": ("pausing", "paused"),
                "resume": ("running",),
                "stop": ("stopping", *files.ENDED),
            }
            if self._wanted and status in seen[self._wanted]:
                self._wanted = None
            self._status = status
            saves = fields.get("saves") or {}
            futures = [(self._saves.pop(key), saves[key]) for key in list(self._saves) if key in saves]
        for future, outcome in futures:
            if "path" in outcome:
                future.set_result(outcome["path"])
            else:
                future.set_exception(RuntimeError(outcome.get("error") or "not saved"))

    def _log_end(self) -> str:
        return f"The end of its log ({self.log_path}):\n{files.log_tail(self.folder)}"

    def _watch_in_background(self) -> None:
        self._watcher = threading.Thread(target=self._watch, name="fastft-process-run", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while True:
            self._read()
            if self._status in files.ENDED:
                break
            time.sleep(POLL_S)
        if self.process is not None:  # reap our child (its end is written; it is exiting)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        self._read()
        status, error = self._status, None
        if status == "failed":
            text = self._error_text or self.fields.get("error") or "The run failed."
            if self.traceback and self.traceback not in text:
                text += f"\nThe worker's traceback:\n{self.traceback}"
            error = RuntimeError(f"{text}\nLog: {self.log_path}")
        elif self.model is not None and (status == "finished" or (self.folder / files.TRAINED).is_dir()):
            try:
                load_trained_adapter(self.model, self.folder / files.TRAINED, self.log_path)
            except Exception as failure:  # noqa: BLE001 - shown in the panel
                status, error = "failed", failure
        self._finish(status, error)

    def _finish(self, status: str, error: BaseException | None = None) -> None:
        """The run's end: its callbacks (the panel's last drawing) run before `wait` returns, as a `Run`'s."""
        with self._lock:
            self._status, self.error, self._wanted = status, error, None
            callbacks, self._done_callbacks = self._done_callbacks, []
            saves, self._saves = self._saves, {}
        for future in saves.values():
            future.set_exception(RuntimeError("The run ended before it could save."))
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - a face's bug must not hide the run's end
                traceback.print_exc()
        with self._lock:
            self._done.set()
            late, self._done_callbacks = self._done_callbacks, []
        for callback in late:  # added while the others ran
            callback(self)


def load_trained_adapter(model, folder: Path, log_path: Path) -> None:
    """The adapter a run saved in `folder` at its end, into `model` (checked as a resume checks it)."""
    from peft import set_peft_model_state_dict

    weights_file = Path(folder) / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise RuntimeError(
            f"The run ended but {weights_file} is missing: its adapter cannot be brought back into the studio. "
            f"The end of its log ({log_path}):\n{files.tail(log_path)}"
        )
    device = next(p.device for p in model.parameters() if p.requires_grad)
    weights = load_file(str(weights_file), device=str(device))
    check_adapter_matches(Path(folder), model, weights)
    set_peft_model_state_dict(model, weights)


def _write_rows(rows, path: Path) -> None:
    try:
        text = "".join(json.dumps(dict(row)) + "\n" for row in rows)
    except TypeError as error:
        raise ValueError(
            f"The loaded rows cannot be written for a child process ({error}). Fix: train in 'this kernel'."
        ) from None
    path.write_text(text, encoding="utf-8")


def _keep_events_to(folder: Path, step: int) -> None:
    """Move ``events.jsonl`` aside (kept as ``events-<time>.jsonl``) and start it again with its events up
    to `step`: a run resumed from ``checkpoint-<step>`` writes the steps after it anew."""
    events = folder / files.EVENTS
    if not events.is_file():
        return
    lines = events.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = folder / f".{files.EVENTS}.tmp"
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(events, folder / f"events-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    os.replace(tmp, events)
