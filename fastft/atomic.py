"""Atomic writes: a folder or file appears complete under its final name, or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def replace_folder_atomically(write: Callable[[Path], None], destination: str | os.PathLike) -> Path:
    """Call ``write(tmp_folder)`` then move the result to `destination` in one rename.

    An existing `destination` is swapped out and removed only after the new folder is in place.
    """
    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = destination.parent / f".{destination.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        write(tmp)
        _fsync_tree(tmp)
        old = None
        if destination.exists():
            old = destination.parent / f".{destination.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(destination, old)
        os.replace(tmp, destination)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return destination


def write_text_atomically(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, fsync it, then `os.replace` it into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
