"""The run folder (`TrainConfig.output_dir`): one run at a time, and a run touches only its own checkpoints.

**Lock.** A run holds an OS lock (``fcntl.flock``) on ``output_dir/.fastft-run.lock`` while it trains; the file
records the holder (pid, host, start time, command), so a second run into the folder is refused naming it
(`FolderInUseError`). The kernel drops the lock when the process ends, however it ends, so a lock file left by a
killed run blocks nothing; a run that ends normally removes the file.

**Ownership.** Every checkpoint records the id of the run that wrote it (``trainer_state.json``: ``run.id``); a
resumed run carries on the id of the checkpoint it resumed from. A run refuses a folder that holds another
run's checkpoints (`FolderHoldsAnotherRunError`, naming them and the fixes) unless ``overwrite_output_dir=True``,
which removes them first, with a warning; pruning to `save_total_limit` removes only the run's own checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import uuid
import warnings
from pathlib import Path

from fastft.atomic import expand, remove_tree
from fastft.checks import SettingError
from fastft.training.checkpoint import list_checkpoints

try:
    import fcntl
except ImportError:  # Windows: no flock; the folder is not locked there
    fcntl = None

LOCK_NAME = ".fastft-run.lock"
# the run id of a checkpoint whose trainer_state.json cannot be read: never this run's, never pruned
UNREADABLE = "<unreadable>"


class FolderInUseError(RuntimeError):
    """Another run (this process's or another's) holds the output_dir's lock."""


class FolderHoldsAnotherRunError(FileExistsError):
    """The output_dir holds checkpoints another run wrote; the message names them and the fixes."""


class OutputDirOverwriteWarning(UserWarning):
    """``overwrite_output_dir=True`` removed another run's checkpoints."""


class RunLock:
    """An exclusive lock on a run folder, held until `release` (or the process ends)."""

    def __init__(self, path: Path, descriptor: int):
        self.path = path
        self._descriptor: int | None = descriptor

    @classmethod
    def acquire(cls, output_dir) -> RunLock:
        """Lock `output_dir` for this run, or raise `FolderInUseError` naming the run that holds it."""
        path = expand(output_dir) / LOCK_NAME
        if fcntl is None:
            return cls(path, -1)
        while True:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(descriptor)
                raise FolderInUseError(_in_use_message(path)) from None
            except OSError as error:  # a filesystem without locks (some network or FUSE mounts)
                os.close(descriptor)
                warnings.warn(
                    f"{path.parent} cannot be locked ({error.strerror or error}): make sure no other run trains "
                    "into this output_dir at the same time.",
                    stacklevel=4,
                )
                return cls(path, -1)
            except BaseException:
                os.close(descriptor)
                raise
            # the file we locked may have been removed by the run that held it just before: lock the new one
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(descriptor).st_ino:
                    break
            os.close(descriptor)
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": " ".join(sys.argv) or sys.executable,
        }
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, (json.dumps(record) + "\n").encode("utf-8"), 0)
        return cls(path, descriptor)

    @property
    def held(self) -> bool:
        return self._descriptor is not None

    def release(self) -> None:
        """Remove the lock file and drop the lock (removed while still held, so no other run's file goes)."""
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is None or descriptor < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(descriptor)  # closing drops the flock

    def __del__(self) -> None:  # a trainer dropped mid-run frees its folder
        if getattr(self, "_descriptor", None) is not None and self._descriptor >= 0:
            os.close(self._descriptor)


def _in_use_message(path: Path) -> str:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        holder = {}
    pid = holder.get("pid")
    who = f"process {pid}" if pid else "another process"
    if pid == os.getpid():
        who = f"this process ({pid}: another Trainer, e.g. from an earlier notebook cell)"
    where = f" on {holder['host']}" if holder.get("host") else ""
    since = f", started {holder['started']}" if holder.get("started") else ""
    command = f" ({holder['command']})" if holder.get("command") else ""
    fix = (
        "let that run finish, or free the folder with trainer.close() on the trainer that holds it"
        if pid == os.getpid()
        else "wait for it to finish or stop it"
    )
    return (
        f"{path.parent} is in use by a run of {who}{where}{since}{command}: two runs in one output_dir would "
        f"overwrite each other's checkpoints. Train into another output_dir, or {fix}."
    )


def new_run_id() -> str:
    return uuid.uuid4().hex


def run_id_of(checkpoint: Path) -> str | None:
    """The id of the run that wrote `checkpoint`: None for a checkpoint from before runs had ids,
    `UNREADABLE` when its trainer_state.json cannot be read."""
    try:
        with open(checkpoint / "trainer_state.json", encoding="utf-8") as f:
            state = json.load(f)
        return (state.get("run") or {}).get("id")
    except (OSError, ValueError, AttributeError):
        return UNREADABLE


def claim_folder(output_dir, run_id: str | None, resumed: bool, overwrite: bool) -> None:
    """Make sure `output_dir` holds no checkpoint of another run before this run writes there.

    A new run (`resumed` False) owns no checkpoint yet, so every one there is another run's; a resumed run owns
    those with its `run_id` (checkpoints it cannot read stay, untouched). Another run's checkpoints raise
    `FolderHoldsAnotherRunError`, or with `overwrite` are removed (kill-safely) with a warning."""
    if resumed and run_id == UNREADABLE:
        return  # its load names the broken file, or "latest" falls back to a readable one
    found = list_checkpoints(output_dir)
    if resumed:
        found = [path for path in found if run_id_of(path) not in (run_id, UNREADABLE)]
    if not found:
        return
    names = ", ".join(path.name for path in found[:4]) + (
        f" and {len(found) - 4} more" if len(found) > 4 else ""
    )
    if overwrite:
        for path in found:
            remove_tree(path)
        warnings.warn(
            f"overwrite_output_dir=True: removed {len(found)} checkpoint(s) of an earlier run from {output_dir} "
            f"({names}).",
            OutputDirOverwriteWarning,
            stacklevel=4,
        )
        return
    whose = "another run" if resumed else "an earlier run"
    raise FolderHoldsAnotherRunError(
        f"output_dir={str(output_dir)!r} holds {len(found)} checkpoint(s) of {whose} ({names}); this "
        f"{'resumed' if resumed else 'new'} run would overwrite or prune them. Resume that run with "
        "resume_from='latest', train into another output_dir, or pass overwrite_output_dir=True to delete them."
    )


def own_checkpoints(output_dir, run_id: str | None) -> list[Path]:
    """The checkpoints in `output_dir` that the run `run_id` wrote, oldest step first."""
    return [path for path in list_checkpoints(output_dir) if run_id_of(path) == run_id]


def prune_own_checkpoints(output_dir, run_id: str | None, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints of the run `run_id`; no other run's (or unreadable one)."""
    for path in own_checkpoints(output_dir, run_id)[:-keep] if keep > 0 else []:
        remove_tree(path)


def resumed_run(output_dir, resume_from: str | None) -> tuple[bool, str | None]:
    """Whether this run resumes one whose checkpoints are in `output_dir`, and that run's id, read before
    anything loads: ``resume_from`` names its checkpoint, "latest" the newest readable one there (none there:
    a new run). A checkpoint that cannot be read gives `UNREADABLE` (its load will name the broken file)."""
    if resume_from is None:
        return False, None
    if resume_from != "latest":
        return True, run_id_of(expand(resume_from))
    checkpoints = list_checkpoints(output_dir)
    ids = [run_id_of(path) for path in reversed(checkpoints)]
    readable = [run_id for run_id in ids if run_id != UNREADABLE]
    if not checkpoints:
        return False, None
    return True, readable[0] if readable else UNREADABLE


def check_writable(output_dir: str | os.PathLike) -> Path:
    """Create `output_dir` and prove a file can be written there, before any step runs."""
    folder = expand(output_dir)
    if folder.exists() and not folder.is_dir():
        raise SettingError(
            f"output_dir={str(folder)!r} is a file, not a folder: pick a folder path for checkpoints."
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".fastft-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise SettingError(
            f"output_dir={str(folder)!r} cannot be written ({error.strerror or error}): pick a folder you can "
            "write to."
        ) from None
    return folder
