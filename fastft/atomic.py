"""Atomic writes that never destroy what fastft did not write.

A folder appears complete under its final name, or not at all. Every folder fastft writes carries a manifest
(``MARKER``): the name, size, SHA-256 and writing function of every file it wrote. A save into an existing
folder is refused unless the folder carries a manifest, is empty, or the caller says ``overwrite=True``; and
then it replaces only what fastft wrote: a file the save writes may take the place of a file the manifest
lists with the same content (never of one the user added or changed since: that save is refused, naming it),
and every other entry (the user's notes, code, folders) is carried into the new folder. A save that writes a
whole model (``replace_previous=True``: adapters, merged models, checkpoints) also leaves out the files an
earlier whole-model save wrote that it does not write again (a shard the new model no longer has), again only
those unchanged since; a GGUF file or Modelfile stays. So a copied manifest gives no licence over the user's
files: they do not match it. ``overwrite=True`` replaces the whole folder. A file in the way is never renamed or removed.

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
import hashlib
import json
import math
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
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")


class FolderInTheWayError(FileExistsError):
    """The destination holds something fastft did not write; the message says how to proceed."""


class DiskFullError(OSError):
    """The disk filled up while writing; what was there before is intact."""


class RecoveredFolderWarning(UserWarning):
    """An interrupted save was found and its folder put back in place."""


class RemovedLeftoverWarning(UserWarning):
    """Files an interrupted save left behind (under hidden names) were removed."""


def expand(path: str | os.PathLike) -> Path:
    """`path` as a `Path` with ``~`` expanded (every path fastft takes goes through here)."""
    return Path(os.fspath(path)).expanduser()


def written_by_fastft(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def check_destination(destination: str | os.PathLike, overwrite: bool = False, beside: bool = False) -> Path:
    """Raise `FolderInTheWayError` unless saving to `destination` destroys nothing fastft did not write.
    With `beside`, a folder fastft did not write is taken too: the save adds its files beside the folder's
    own, and `replace_folder_atomically` refuses it if one of them would replace a file there."""
    destination = expand(destination)
    if destination.is_symlink() or (destination.exists() and not destination.is_dir()):
        raise FolderInTheWayError(
            f"{destination} is a file{' (a link)' if destination.is_symlink() else ''}, not a folder: fastft "
            "saves a folder there and never moves a file away. Pick another path (a new folder name)."
        )
    if destination.is_dir() and not overwrite and not beside and not written_by_fastft(destination):
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
    by: str | None = None,
    replace_previous: bool = True,
    beside: bool = False,
) -> Path:
    """Call ``write(tmp_folder)`` then move the result to `destination` in one rename.

    `destination` may be missing, empty, a folder fastft wrote (`MARKER`), or anything with `overwrite`;
    anything else raises `FolderInTheWayError` before a byte is written. In a folder fastft wrote, only
    the files its manifest lists (unchanged) are replaced, and only by files of the same name, or left out
    with `replace_previous` when an earlier whole-model save wrote them; everything else is carried into
    the new folder (module doc). With `beside`, a folder fastft did not write is taken the same way: all of
    it is carried into the new folder (Unsloth's merged save beside an adapter that peft wrote), and a
    file there with the same name and bytes as one the save writes is replaced (nothing is lost). A file
    the save writes whose name the user's file holds (with other bytes, under `beside`) raises
    `FolderInTheWayError` naming it, with `destination` as it was. The manifest records each written file as written by `by` (the function's name). An existing
    folder is swapped out and removed only after the new folder is in place. A full disk raises
    `DiskFullError`, a folder that cannot be written `PermissionError`, both naming `destination`.
    """
    destination = recover_folder(expand(destination))
    check_destination(destination, overwrite, beside)
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = destination.parent / f".{destination.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        write(tmp)
        files = {name: file_record(tmp / name, by or kind, replace_previous) for name in _files_under(tmp)}
        left_out: set[str] = set()
        if destination.is_dir() and not overwrite:
            carried, left_out = _carry_over(destination, tmp, set(files), replace_previous, beside)
            files.update(carried)
        _fsync_tree(tmp)
        # the manifest comes last: a leftover folder that has it was completely written
        _write_marker(tmp, kind, files)
        if destination.exists() and _exchange(tmp, destination):
            old = _rename_for_removal(tmp)  # the old folder, now under the temporary name
        else:
            old = None
            if destination.exists():  # two renames; a kill between them is undone by `recover_folder`
                old = destination.parent / f".{destination.name}.old-{uuid.uuid4().hex[:8]}"
                os.replace(destination, old)
            os.replace(tmp, destination)
            old = _rename_for_removal(old) if old is not None else None
        if old is not None:
            if not overwrite:  # anything added to the old folder while this save ran
                _rescue(old, destination, left_out)
            remove_tree(old)
    except Exception as error:  # safetensors reports a full disk as its own SafetensorError
        explained = explain_write_error(error, destination, "nothing under that path was changed")
        if explained is not None:
            raise explained from error
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return destination


def file_record(path: Path, by: str, whole: bool = False) -> dict:
    """What the manifest keeps of one file: its size, SHA-256, the fastft function that wrote it, and whether
    that save wrote a whole model (its files are left out by the next whole-model save that does not write
    them again; a GGUF or Modelfile stays)."""
    return {"size": path.stat().st_size, "sha256": sha256_of(path), "by": by, "whole": whole}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(folder: Path) -> dict[str, dict] | None:
    """The files fastft's manifest in `folder` lists (relative name → record); None when the folder has no
    manifest, or one from an earlier fastft that listed no files, or one that cannot be read."""
    try:
        data = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        return None
    return {str(k): v for k, v in files.items() if isinstance(v, dict)}


def unchanged(path: Path, record: dict) -> bool:
    """Whether `path` is a plain file whose size and SHA-256 are those `record` lists."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        return path.stat().st_size == record.get("size") and sha256_of(path) == record.get("sha256")
    except OSError:
        return False


def record_file(folder: Path, name: str, by: str) -> None:
    """Add (or renew) `folder/name` in the folder's manifest, when the folder has one (a folder fastft saved)."""
    files = read_manifest(folder)
    if files is None:
        return
    files[name] = file_record(folder / name, by)
    data = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    data["files"] = files
    write_text_atomically(folder / MARKER, json.dumps(data) + "\n")


def _files_under(folder: Path) -> list[str]:
    """Every file under `folder` (the manifest excluded), as posix paths relative to it."""
    return sorted(
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.is_file() and not path.is_symlink() and path.name != MARKER
    )


def _ours(entry: Path, name: str, listed: dict[str, dict]) -> dict[str, dict] | None:
    """The manifest's records of `entry` (a top-level file or folder of the destination) when it is wholly
    fastft's: every file in it listed and unchanged, nothing else in it; None otherwise."""
    if entry.is_symlink():
        return None
    if entry.is_file():
        record = listed.get(name)
        return {name: record} if record is not None and unchanged(entry, record) else None
    if not entry.is_dir():
        return None
    found = {}
    for path in entry.rglob("*"):
        if path.is_dir() and not path.is_symlink():
            continue
        key = path.relative_to(entry.parent).as_posix()
        record = listed.get(key)
        if record is None or not unchanged(path, record):
            return None
        found[key] = record
    return found


def _carry_over(
    destination: Path, tmp: Path, written: set[str], replace_previous: bool, beside: bool = False
) -> tuple[dict[str, dict], set[str]]:
    """Link every entry of `destination` this save must keep into `tmp` (module doc); returns the manifest
    records of the kept files fastft wrote (unchanged) and the names left out. Raises `FolderInTheWayError`,
    before anything is moved, when a file this save writes would replace one fastft did not write."""
    listed = read_manifest(destination)
    new = {name.split("/")[0] for name in written}
    carried: dict[str, dict] = {}
    keep, left_out, in_the_way = [], set(), []
    for entry in sorted(destination.iterdir()):
        if entry.name == MARKER:
            continue
        ours = _ours(entry, entry.name, listed or {})
        if entry.name in new:
            if ours is None and not (beside and _same_file(entry, tmp / entry.name)):
                in_the_way.append(entry.name)
            else:
                left_out.add(entry.name)
        elif ours is not None and replace_previous and all(r.get("whole") for r in ours.values()):
            left_out.add(entry.name)
        else:
            keep.append(entry)
            carried.update(ours or {})
    if in_the_way:
        shown = ", ".join(in_the_way[:5]) + (", …" if len(in_the_way) > 5 else "")
        why = (
            "fastft did not write them"
            if not written_by_fastft(destination)
            else "its manifest comes from an earlier fastft, which did not list its files"
            if listed is None
            else "fastft did not write them, or they changed since it did"
        )
        raise FolderInTheWayError(
            f"saving into {destination} would replace {shown} ({why}). fastft replaces only the files it "
            "wrote and left unchanged: move those files out of the folder, save into a new folder, or pass "
            "overwrite=True to replace the whole folder."
        )
    for entry in keep:
        _link_copy(entry, tmp / entry.name)
    return carried, left_out


def _same_file(old: Path, new: Path) -> bool:
    """Whether `old` and `new` are plain files with the same bytes (replacing one by the other loses nothing)."""
    if old.is_symlink() or not old.is_file() or not new.is_file():
        return False
    try:
        return old.stat().st_size == new.stat().st_size and sha256_of(old) == sha256_of(new)
    except OSError:
        return False


def _link_copy(source: Path, target: Path) -> None:
    """`source` (a file, folder or link) at `target` too: hard links where the filesystem has them (no data
    is copied), copies elsewhere."""
    if source.is_symlink():
        os.symlink(os.readlink(source), target)
    elif source.is_dir():
        shutil.copytree(source, target, symlinks=True, copy_function=_link_or_copy)
    else:
        _link_or_copy(source, target)


def _link_or_copy(source, target) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _rescue(old: Path, destination: Path, left_out: set[str]) -> None:
    """Move into `destination` whatever the replaced folder holds that the new one lacks and the save did not
    mean to leave out (an entry the user added while the save was running)."""
    for entry in old.iterdir():
        if (
            entry.name != MARKER
            and entry.name not in left_out
            and not os.path.lexists(destination / entry.name)
        ):
            os.replace(entry, destination / entry.name)


def explain_write_error(error: BaseException, target: Path, state: str) -> OSError | None:
    """`error` (raised while saving `target`) restated to name `target`, not a hidden temporary name: a full
    disk as `DiskFullError` with the room left, a folder that cannot be written as `PermissionError`; None
    for any other error. `state` says what became of `target` ("nothing under that path was changed")."""
    folder = target.parent
    if isinstance(error, FolderInTheWayError) or (
        isinstance(error, DiskFullError) and str(target) in str(error)
    ):
        return None
    if is_disk_full(error, folder):
        needed = getattr(error, "needed", None)
        free = _free_bytes(folder)
        room = (
            f"it needs {_size(needed)} and {_size(free)} are free there" if needed else f"{_size(free)} free"
        )
        explained = DiskFullError(
            errno.ENOSPC,
            f"no space left on device while writing {target} ({room}); {state}. Free some space or save "
            "somewhere else.",
        )
        explained.needed, explained.free = needed, free
        return explained
    if isinstance(error, PermissionError) or (
        isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
    ):
        why = error.strerror or str(error)
        return PermissionError(
            error.errno or errno.EACCES,
            f"cannot write {target}: {folder} does not let this process write there ({why}); {state}. Save "
            "into a folder you can write to, or change that folder's permissions.",
        )
    return None


def _free_bytes(folder: Path) -> int | None:
    with contextlib.suppress(OSError):
        return shutil.disk_usage(folder).free
    return None


def _size(count: int | None) -> str:
    if count is None:
        return "an unknown amount"
    if count < 1024:
        return f"{count} bytes"
    exponent = min(int(math.log(count, 1024)), 4)
    return f"{count / 1024**exponent:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[exponent - 1]}"


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
    if _SHORT_WRITE.search(text):  # numpy's tofile on a full disk: "46784 requested and 8160 written"
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


def _write_marker(folder: Path, kind: str, files: dict[str, dict]) -> None:
    with open(folder / MARKER, "w", encoding="utf-8") as f:
        f.write(json.dumps({"written_by": "fastft", "kind": kind, "files": files}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_folder(folder)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
