"""Atomic writes that never destroy what fastft did not write.

A folder appears complete under its final name, or not at all. Every folder fastft writes carries a marker
file (``MARKER``); an existing folder is replaced only when it carries that marker, is empty, or the caller
says ``overwrite=True``. A file in the way is never renamed or removed.

Replacing a folder is one atomic exchange of the new and the old folder where Linux offers it
(``renameat2(RENAME_EXCHANGE)``). Elsewhere it takes two renames (the old one aside, the new one in); a
process killed between them leaves the path empty, with both folders beside it under hidden names.
`recover_folder`, called before every save and load of that path, puts the newest complete one back and
says so. Folders are deleted by renaming them to a hidden name first, so a kill mid-delete never leaves a
half-deleted folder under a name that looks complete.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import sys
import tempfile
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

MARKER = ".fastft-folder.json"
# the hidden siblings an interrupted save or prune can leave: .NAME.tmp-xxxxxxxx, .NAME.old-…, .NAME.prune-…
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|prune)-[0-9a-f]{8}$")


class FolderInTheWayError(FileExistsError):
    """The destination holds something fastft did not write; the message says how to proceed."""


class DiskFullError(OSError):
    """The disk filled up while writing; what was there before is intact."""


class RecoveredFolderWarning(UserWarning):
    """An interrupted save was found and its folder put back in place."""


def expand(path: str | os.PathLike) -> Path:
    """`path` as a `Path` with ``~`` expanded (every path fastft takes goes through here)."""
    return Path(os.fspath(path)).expanduser()


def written_by_fastft(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def check_destination(destination: str | os.PathLike, overwrite: bool = False) -> Path:
    """Raise `FolderInTheWayError` unless saving to `destination` destroys nothing fastft did not write."""
    destination = expand(destination)
    if destination.is_symlink() or (destination.exists() and not destination.is_dir()):
        raise FolderInTheWayError(
            f"{destination} is a file{' (a link)' if destination.is_symlink() else ''}, not a folder: fastft "
            "saves a folder there and never moves a file away. Pick another path (a new folder name)."
        )
    if destination.is_dir() and not overwrite and not written_by_fastft(destination):
        contents = sorted(path.name for path in destination.iterdir())
        if contents:
            shown = ", ".join(contents[:5]) + (", …" if len(contents) > 5 else "")
            raise FolderInTheWayError(
                f"{destination} already exists and was not written by fastft (it holds {shown}): saving "
                "there would delete it. Pick a new folder, or pass overwrite=True to replace it."
            )
    return destination


def leftovers(parent: Path, name: str | None = None) -> list[Path]:
    """Hidden folders an interrupted save or prune left in `parent` (for the destination `name`, or all)."""
    if not parent.is_dir():
        return []
    found = []
    for path in parent.iterdir():
        match = _LEFTOVER.match(path.name)
        if match and (name is None or match["name"] == name):
            found.append(path)
    return found


def recover_folder(destination: str | os.PathLike) -> Path:
    """Finish or undo a save of `destination` that was killed half-way, then remove its leftovers.

    When `destination` is missing, the newest complete new folder (marker written, so fsynced) is moved in,
    else the old folder that the save had moved aside; a warning says which. Partial folders are removed.
    """
    destination = expand(destination)
    found = leftovers(destination.parent, destination.name)
    if not found:
        return destination
    if not destination.exists():
        complete = [p for p in found if _LEFTOVER.match(p.name)["kind"] == "tmp" and written_by_fastft(p)]
        aside = [p for p in found if _LEFTOVER.match(p.name)["kind"] == "old"]
        candidates = sorted(complete, key=_mtime, reverse=True) or sorted(aside, key=_mtime, reverse=True)
        if candidates:
            os.replace(candidates[0], destination)
            what = "the finished new save" if candidates[0] in complete else "the previous folder"
            warnings.warn(
                f"{destination} was missing after an interrupted save: fastft restored {what} "
                f"(from {candidates[0].name}).",
                RecoveredFolderWarning,
                stacklevel=3,
            )
            found.remove(candidates[0])
    for path in found:
        remove_tree(path)
    return destination


def remove_leftovers(parent: str | os.PathLike) -> list[Path]:
    """Recover every interrupted save in `parent`, then remove every hidden leftover; returns the leftovers
    found (each now restored into place or removed)."""
    parent = expand(parent)
    found = leftovers(parent)
    for name in sorted({_LEFTOVER.match(p.name)["name"] for p in found}):
        recover_folder(parent / name)
    for path in leftovers(parent):
        remove_tree(path)
    return found


def remove_tree(path: Path) -> None:
    """Delete a folder kill-safely: renamed to a hidden leftover name first, so no half-deleted folder ever
    sits under a valid name (a kill mid-delete leaves a leftover the next run removes)."""
    if not path.exists():
        return
    if not _LEFTOVER.match(path.name):
        doomed = path.parent / f".{path.name}.prune-{uuid.uuid4().hex[:8]}"
        os.replace(path, doomed)
        path = doomed
    shutil.rmtree(path, ignore_errors=True)


def replace_folder_atomically(
    write: Callable[[Path], None],
    destination: str | os.PathLike,
    overwrite: bool = False,
    kind: str = "folder",
) -> Path:
    """Call ``write(tmp_folder)`` then move the result to `destination` in one rename.

    `destination` may be missing, empty, a folder fastft wrote (`MARKER`), or anything with `overwrite`;
    anything else raises `FolderInTheWayError` before a byte is written. An existing folder is swapped out
    and removed only after the new folder is in place. A full disk raises `DiskFullError`, with
    `destination` as it was.
    """
    destination = recover_folder(expand(destination))
    check_destination(destination, overwrite)
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = destination.parent / f".{destination.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        write(tmp)
        _fsync_tree(tmp)
        # the marker comes last: a leftover folder that has it was completely written
        _write_marker(tmp, kind)
        if destination.exists() and _exchange(tmp, destination):
            remove_tree(_rename_for_removal(tmp))  # the old folder, now under the temporary name
        else:
            old = None
            if destination.exists():  # two renames; a kill between them is undone by `recover_folder`
                old = destination.parent / f".{destination.name}.old-{uuid.uuid4().hex[:8]}"
                os.replace(destination, old)
            os.replace(tmp, destination)
            if old is not None:
                remove_tree(_rename_for_removal(old))
    except Exception as error:  # safetensors reports a full disk as its own SafetensorError
        if is_disk_full(error, destination.parent):
            raise DiskFullError(
                errno.ENOSPC,
                f"no space left on device while writing {destination}; nothing under that path was changed. "
                "Free some space or save somewhere else.",
            ) from error
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return destination


def _rename_for_removal(path: Path) -> Path:
    """`path` renamed to a ``.prune-`` leftover (never restored by `recover_folder`), ready to delete."""
    match = _LEFTOVER.match(path.name)
    doomed = path.parent / f".{match['name'] if match else path.name}.prune-{uuid.uuid4().hex[:8]}"
    os.replace(path, doomed)
    return doomed


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``), so a kill at any moment
    leaves a complete folder under each name; False where the system or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return result == 0


def is_disk_full(error: BaseException, folder: Path) -> bool:
    """True when `error` came from a full disk: ENOSPC, safetensors' ``StorageFull``, or any failure while
    the disk has (almost) no room left: torch's serializer reports a full disk as ``basic_ios::clear:
    iostream error``, ``[enforce fail at inline_container.cc] unexpected pos`` or ``file write failed``."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    if any(sign in text for sign in ("No space left on device", "StorageFull", "os error 28")):
        return True
    with contextlib.suppress(OSError):
        return shutil.disk_usage(folder).free < 4 * 2**20
    return False


def write_text_atomically(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, fsync it, then `os.replace` it into place."""
    write_file_atomically(path, lambda f: f.write(text.encode("utf-8")))


def write_file_atomically(path: str | os.PathLike, write) -> None:
    """Call ``write(binary_file)`` on a temp file beside `path`, fsync it, then `os.replace` it into place:
    a reader sees the old file or the whole new one, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_folder(folder)


def fsync_folder(folder: Path) -> None:
    """Make the folder's entries (names just written or renamed) durable."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_marker(folder: Path, kind: str) -> None:
    with open(folder / MARKER, "w", encoding="utf-8") as f:
        f.write(json.dumps({"written_by": "fastft", "kind": kind}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_folder(folder)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
