"""Atomic writes: a folder or file appears complete under its final name, or not at all."""

from __future__ import annotations

import os
import shutil
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
