"""A studio run's folder: the files a run in a child process (`fastft.studio.worker`) reads and writes, and
what its state is, read from them.

One folder per run (the Run tab's output dir; the runs folder is the one above it)::

    run.json        the run as the studio asked for it (model, data files, method, settings): the worker's spec
    start/          the adapter as it was in the kernel at Start (the run trains on from there)
    data.npz        the packed training data (`PackedDataset.save`); eval.npz the eval set; rows.jsonl GRPO's rows
    status.json     written by the worker, replaced whole at each change and every second: pid, status, step,
                    threads, the checkpoints saved on request, the error and its traceback
    events.jsonl    one JSON line per `StepEvent` / `EvalEvent`, appended and flushed per step (`EventLog`)
    worker.log      the worker's stdout and stderr
    rollout.json    GRPO: the latest rollout's prompts, completions, rewards and advantages
    control/        what the studio asks of the worker, one empty file each: ``pause``, ``stop``,
                    ``save-<id>``; the worker acts on them between steps
    checkpoint-N/   the trainer's checkpoints; trained/ the adapter at the run's end

A run's state comes from ``status.json`` and whether its pid still lives: a worker that died without writing
its end (killed, out of host memory) is "failed", with the end of its log.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from fastft.training.checkpoint import list_checkpoints
from fastft.training.events import StepEvent, read_events

__all__ = [
    "ACTIVE",
    "ENDED",
    "RunInfo",
    "list_runs",
    "pid_alive",
    "read_json",
    "read_run",
    "write_json",
]

SPEC, STATUS, EVENTS, LOG, CONTROL = "run.json", "status.json", "events.jsonl", "worker.log", "control"
START, TRAINED, ROLLOUT = "start", "trained", "rollout.json"
SPEC_FORMAT = "fastft-studio-run-1"
WORKER_MODULE = "fastft.studio.worker"
ACTIVE = ("starting", "running", "pausing", "paused", "stopping")
ENDED = ("finished", "stopped", "failed")


def write_json(path: Path, data: dict) -> None:
    """Replace `path` whole (a reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """The JSON object at `path`, or None when there is none (or it cannot be read)."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def pid_alive(pid: int | None) -> bool:
    """Whether a studio worker runs under `pid` (not a zombie; on Linux, not another program that got
    the number since)."""
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path(f"/proc/{int(pid)}")
    if proc.is_dir():
        with contextlib.suppress(OSError):
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return False
            if WORKER_MODULE.encode() not in (proc / "cmdline").read_bytes():
                return False
    return True


def tail(path: str | os.PathLike, lines: int = 25) -> str:
    """The last `lines` lines of the text file at `path` ("(no log)" when there is none)."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def log_tail(folder: str | os.PathLike, lines: int = 25) -> str:
    return tail(Path(folder) / LOG, lines)


@dataclass(frozen=True)
class RunInfo:
    """What a run folder says about its run. `status`: "starting", "running", "pausing", "paused",
    "stopping", "finished", "stopped" or "failed" ("created": written but never started)."""

    folder: Path
    status: str
    pid: int | None
    step: int
    max_steps: int | None
    loss: float | None
    method: str
    model: str | None
    checkpoints: list[str] = field(default_factory=list)
    error: str = ""
    traceback: str = ""
    started: float | None = None

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def active(self) -> bool:
        return self.status in ACTIVE


def read_status(folder: Path) -> tuple[dict, str, str]:
    """(status.json's fields, the run's status, the error): an active status whose worker is gone is
    "failed", with the end of its log as the error."""
    status = read_json(Path(folder) / STATUS) or {}
    state = status.get("status", "created")
    error = status.get("error") or ""
    if state in ACTIVE and not pid_alive(status.get("pid")):
        state = "failed"
        error = (
            f"The run's worker (pid {status.get('pid')}) ended without saying why (killed, or out of host "
            f"memory?). The end of its log ({Path(folder) / LOG}):\n{log_tail(folder)}"
        )
    return status, state, error


def read_run(folder: str | os.PathLike) -> RunInfo | None:
    """The run in `folder`, or None when it is not a studio run folder (no ``run.json``)."""

    folder = Path(folder)
    spec = read_json(folder / SPEC)
    if spec is None or spec.get("format") != SPEC_FORMAT:
        return None
    status, state, error = read_status(folder)
    events, _ = read_events(folder / EVENTS)
    steps = [e for e in events if isinstance(e, StepEvent)]
    return RunInfo(
        folder=folder,
        status=state,
        pid=status.get("pid"),
        step=steps[-1].step if steps else int(status.get("step") or 0),
        max_steps=spec.get("config", {}).get("max_steps"),
        loss=steps[-1].loss if steps else None,
        method=spec.get("method", "sft"),
        model=spec.get("model", {}).get("name"),
        checkpoints=[str(path) for path in list_checkpoints(folder)],
        error=error,
        traceback=status.get("traceback") or "",
        started=status.get("started") or spec.get("created"),
    )


def list_runs(runs_folder: str | os.PathLike) -> list[RunInfo]:
    """Every studio run in the folders directly under `runs_folder`, the newest first."""
    root = Path(runs_folder).expanduser()
    if not root.is_dir():
        return []
    runs = [info for child in root.iterdir() if child.is_dir() and (info := read_run(child)) is not None]
    return sorted(runs, key=lambda info: info.started or 0.0, reverse=True)


def ask(folder: Path, what: str) -> None:
    """Leave a request for the worker in ``control/`` ("pause", "stop", "save-<id>")."""
    control = Path(folder) / CONTROL
    control.mkdir(parents=True, exist_ok=True)
    (control / what).touch()


def withdraw(folder: Path, what: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (Path(folder) / CONTROL / what).unlink()


def requests(folder: Path) -> set[str]:
    try:
        return {entry.name for entry in (Path(folder) / CONTROL).iterdir()}
    except OSError:
        return set()


def fresh_folder(wanted: str | os.PathLike) -> Path:
    """`wanted`, or `wanted`-2, -3, … : the first that holds no earlier run's files (nothing is overwritten)."""
    base = Path(wanted).expanduser()
    candidate, n = base, 1
    while candidate.exists() and any(candidate.iterdir()):
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate
