"""Atomic file writes (temp file in the destination folder, then os.replace) and up-front checks of output paths."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from recycle.errors import OutputError

__all__ = ["atomic_write_bytes", "atomic_write_text", "check_output_file", "check_output_dir"]


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically, creating parent folders; return the path. Any OS failure (unwritable,
    disk full, not a directory) is an OutputError naming the directory; the previous file, if any, is kept."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OutputError(_cannot_write(path, exc)) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the result is an ordinary, readable output file
        os.replace(tmp, path)
    except BaseException as exc:
        # Leave no temp file behind whatever went wrong (disk full, interrupt).
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise OutputError(_cannot_write(path, exc)) from None
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write UTF-8 `text` to `path` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def _cannot_write(path: Path, exc: OSError) -> str:
    return (f"cannot write {str(path)!r} in directory {str(path.parent)!r}: {exc.strerror or exc}; free space "
            "there or pick a writable directory (any earlier version of the file is unchanged)")


def check_output_file(path: str | Path, flag: str) -> None:
    """Before any work: `path` (given as `flag`) must be a file path whose folder exists or can be created and
    accepts new files. Nothing is left behind by the check."""
    p = Path(path)
    if str(path) == "" or p.is_dir() or str(path).endswith(("/", os.sep)):
        raise OutputError(f"{flag} {str(path)!r} is a directory; {flag} takes a file path, e.g. "
                          f"{str(p / _example(flag))!r}")
    _check_folder(p.parent, flag, path)


def check_output_dir(path: str | Path, flag: str, need_bytes: int = 0) -> None:
    """Before any work: `path` (given as `flag`) must be a directory, or creatable as one, that accepts new files
    and (when `need_bytes` > 0) has that much free space."""
    p = Path(path)
    if str(path) == "":
        raise OutputError(f"{flag} is empty; pass a directory path")
    if p.exists() and not p.is_dir():
        raise OutputError(f"{flag} {str(path)!r} exists and is not a directory; pass a directory path (or move "
                          "the file away)")
    _check_folder(p, flag, path)
    if need_bytes > 0:
        free = shutil.disk_usage(_nearest_existing(p)).free
        if free < need_bytes:
            raise OutputError(f"{flag} {str(path)!r}: {free / 1e6:.1f} MB free on its filesystem but about "
                              f"{need_bytes / 1e6:.1f} MB are needed; free space there or pick another directory")


def _example(flag: str) -> str:
    return {"--save": "model.pt", "--metrics": "metrics.jsonl", "--gantt": "gantt.png", "--trace": "trace.json",
            "--csv": "plan.csv", "--out": "out.toml"}.get(flag, "file")


def _nearest_existing(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_folder(folder: Path, flag: str, given: str | Path) -> None:
    """`folder` (or its nearest existing ancestor, where it would be created) must be a directory that accepts a
    new file: a real probe, since permission bits lie for root, read-only mounts and immutable folders."""
    base = _nearest_existing(folder)
    if not base.is_dir():
        raise OutputError(f"{flag} {str(given)!r}: {str(base)!r} is a file, not a directory, so nothing can be "
                          "created under it; pick another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".recycle-probe-", dir=base)
    except OSError as exc:
        where = "" if base == folder.absolute() else f" (where {str(folder)!r} would be created)"
        raise OutputError(f"{flag} {str(given)!r}: cannot create files in {str(base)!r}{where}: "
                          f"{exc.strerror or exc}; pick a writable location") from None
    os.close(fd)
    os.unlink(probe)
