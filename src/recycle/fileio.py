"""Atomic file writes (temp file in the destination folder, then os.replace), up-front checks of output paths, and
bounded reads of regular files inside a folder (checkpoints, plan stores: untrusted input).

Output targets (`atomic_write_bytes`, `check_output_file`), by what the path is when it is written:
* a new path or a regular file: written atomically (a temp file in the same folder, then os.replace);
* a symbolic link: followed; the file it points to is written by these rules and the link is kept;
* a character device or a FIFO (/dev/null, a terminal, a named pipe), or a process's open file (/dev/stdout,
  /dev/fd/N, /proc/self/fd/N, whatever it is: `--metrics /dev/stdout > log` must not replace the shell's log file):
  a stream, written into directly (appending), never replaced (the device node stays); a FIFO with no reader is an
  error, not a hang. Rewriting a stream with content that extends what it was sent before in this process sends
  only the new part; `append_text` (the --metrics log, one record at a time) sends each record as it is;
* a directory, block device or socket: refused with an OutputError (a block device would have its contents
  overwritten).
Files recycle keeps inside its own folders (a checkpoint's .metadata, `latest`, a plan store's index) are written
with `follow=False`: whatever entry is at the path (a planted link, a FIFO, a device node) is replaced, never
followed or written into.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path, PurePosixPath

from recycle.errors import OutputError

__all__ = ["atomic_write_bytes", "atomic_write_text", "append_text", "check_output_file", "check_output_dir",
           "is_stream_target", "UnsafeFile", "open_inside", "read_inside", "sha256_inside", "lstat_inside",
           "relative_parts"]


# -- writing ------------------------------------------------------------------------------------------------------
def atomic_write_bytes(path: str | Path, data: bytes, follow: bool = True, durable: bool = True) -> Path:
    """Write `data` to `path` atomically, creating parent folders; return the path. Any OS failure (unwritable,
    disk full, not a directory) is an OutputError naming the directory; the previous file, if any, is kept. A
    user's output target is followed if a link and written into if a device or FIFO (module docstring); with
    `follow=False` (recycle's own files inside its folders) the entry at `path` is replaced whatever it is.
    `durable=False` skips the fsync before the rename: for files whose loss or truncation by a crash is detected
    when read and costs only a rebuild (plan cache entries), where the fsync per file dominates the write."""
    path = Path(path)
    target = _write_target(path) if follow else path
    if target is None:
        _write_stream(path, data)
        return path
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise _output_error(path, target, exc) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the result is an ordinary, readable output file
        os.replace(tmp, target)
    except BaseException as exc:
        # Leave no temp file behind whatever went wrong (disk full, interrupt).
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise _output_error(path, target, exc) from None
        raise
    return path


def atomic_write_text(path: str | Path, text: str, follow: bool = True, durable: bool = True) -> Path:
    """Write UTF-8 `text` to `path` atomically (atomic_write_bytes)."""
    return atomic_write_bytes(path, text.encode("utf-8"), follow, durable)


def append_text(path: str | Path, text: str) -> None:
    """Append UTF-8 `text` to the user's output target `path` in one write: a log that grows by whole records (the
    --metrics JSONL), whose cost per record does not grow with the file. Start it with atomic_write_text(path, "")
    (a previous run's file is then replaced whole, never mixed in); a stream is written into, as for a write."""
    path = Path(path)
    target = _write_target(path)
    data = text.encode("utf-8")
    if target is None:
        _write_stream(path, data, rewrite=False)
        return
    try:
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise _output_error(path, target, exc) from None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        raise _output_error(path, target, exc) from None
    finally:
        os.close(fd)


def _write_target(path: Path) -> Path | None:
    """Where the atomic write goes (the link's target for a symbolic link), or None for a stream (written into).
    Refuses what must not be written or replaced."""
    try:
        info = os.stat(path)  # follows symbolic links
    except FileNotFoundError:
        return Path(os.path.realpath(path)) if os.path.islink(path) else path  # a dangling link: create its target
    except OSError as exc:
        raise _output_error(path, path, exc) from None
    if _is_stream(path, info.st_mode):
        return None
    if stat.S_ISREG(info.st_mode):
        return Path(os.path.realpath(path)) if os.path.islink(path) else path
    raise OutputError(_refusal(path, info.st_mode))


def _is_stream(path: str | Path, mode: int) -> bool:
    """A character device, a FIFO, or any file reached through a process's descriptor table (module docstring)."""
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode) or (stat.S_ISREG(mode) and _via_descriptor(path))


def _via_descriptor(path: str | Path) -> bool:
    """Whether `path`, or a symbolic link it leads through, is in /proc or /dev/fd (an open file of a process)."""
    current = os.path.abspath(path)
    for _ in range(40):
        if current.startswith(("/proc/", "/dev/fd/")):
            return True
        try:
            target = os.readlink(current)
        except OSError:
            return False
        current = os.path.normpath(os.path.join(os.path.dirname(current), target))
    return False


def _refusal(path: str | Path, mode: int) -> str:
    kind = _kind(mode)
    if stat.S_ISDIR(mode):
        return f"{str(path)!r} is a directory; pass a file path inside it"
    return (f"{str(path)!r} is a {kind}; recycle writes only regular files, character devices (such as /dev/null) "
            f"and FIFOs{' (writing it would overwrite the device contents)' if stat.S_ISBLK(mode) else ''}: pass a "
            "regular file path")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO (named pipe)"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symbolic link"), (stat.S_ISREG, "regular file")):
        if test(mode):
            return name
    return "special file"


# What each stream written in this process was last sent: (path, device, inode) -> (bytes, SHA-256 of them).
_SENT: dict[tuple[str, int, int], tuple[int, bytes]] = {}


def _write_stream(path: Path, data: bytes, rewrite: bool = True) -> None:
    """Write into a character device or FIFO: no temp file, no replace. A FIFO must have a reader (opened without
    blocking, so a missing reader is an error, not a hang). A rewrite whose content extends what this stream was last
    sent is sent from where the last write ended; `rewrite=False` (an append) sends `data` as it is."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise OutputError(f"cannot write {str(path)!r}: it is a FIFO (named pipe) that no process is reading; "
                              "start its reader first, or pass a regular file path") from None
        raise _output_error(path, None, exc) from None
    try:
        info = os.fstat(fd)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        key = (str(path), info.st_dev, info.st_ino)
        start = 0
        sent = _SENT.get(key) if rewrite else None
        if sent is not None and len(data) >= sent[0] and hashlib.sha256(data[:sent[0]]).digest() == sent[1]:
            start = sent[0]
        view = memoryview(data)[start:]
        while view:
            view = view[os.write(fd, view):]
        if rewrite:
            _SENT[key] = (len(data), hashlib.sha256(data).digest())
    except OSError as exc:
        raise _output_error(path, None, exc) from None
    finally:
        os.close(fd)


def _output_error(path: Path, target: Path | None, exc: OSError) -> OutputError:
    """An OutputError for a failed write into `target`'s folder (None: into the stream `path`), with the errno kept
    (callers tell a full disk apart)."""
    if target is None:
        text = f"cannot write {str(path)!r}: {exc.strerror or exc}; pass another path (a regular file)"
    else:
        text = (f"cannot write {str(path)!r} in directory {str(target.parent)!r}: {exc.strerror or exc}; free space "
                "there or pick a writable directory (any earlier version of the file is unchanged)")
    error = OutputError(text)
    error.errno = exc.errno  # type: ignore[attr-defined]
    return error


# -- checking outputs before any work -----------------------------------------------------------------------------
def check_output_file(path: str | Path, flag: str) -> None:
    """Before any work: `path` (given as `flag`) must be a file path whose folder exists or can be created and
    accepts new files, or an existing character device or FIFO it can write into (module docstring). Nothing is
    left behind by the check."""
    p = Path(path)
    if str(path) == "" or p.is_dir() or str(path).endswith(("/", os.sep)):
        raise OutputError(f"{flag} {str(path)!r} is a directory; {flag} takes a file path, e.g. "
                          f"{str(p / _example(flag))!r}")
    try:
        info = os.stat(p)
    except OSError:
        info = None
    if info is not None and (not stat.S_ISREG(info.st_mode) or _is_stream(p, info.st_mode)):
        if not _is_stream(p, info.st_mode):
            raise OutputError(f"{flag} {_refusal(path, info.st_mode)}")
        if not os.access(p, os.W_OK):
            raise OutputError(f"{flag} {str(path)!r}: this user may not write the {_kind(info.st_mode)}; pick a "
                              "writable location")
        return  # written into (never replaced): its folder need not accept new files
    real = Path(os.path.realpath(p)) if os.path.islink(p) else p
    _check_folder(real.parent, flag, path)


def is_stream_target(path: str | Path) -> bool:
    """Whether `path` names an existing stream (a character device, a FIFO, a process's open file: written into,
    not replaced)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return _is_stream(path, mode)


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


# -- reading untrusted folders ------------------------------------------------------------------------------------
class UnsafeFile(Exception):
    """A path inside a folder of untrusted input that recycle refuses to read: outside the folder, through a
    symbolic link, not a regular file (a FIFO would hang the read, /dev/zero never ends), or over its size bound.
    Callers turn it into their own error (CheckpointError, PlanError); the message names the path and why."""


_NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NOFOLLOW_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def relative_parts(relative: str | Path) -> tuple[str, ...]:
    """The components of a path that must stay inside its folder: not absolute, no '..', '.' or empty parts.
    Raises UnsafeFile otherwise."""
    text = str(relative)
    parts = PurePosixPath(text).parts
    if not text or text.startswith("/") or "\x00" in text or any(p in ("..", ".") for p in parts) \
            or any(p in ("..", ".", "") for p in text.split("/")):
        raise UnsafeFile(f"{text!r} is not a path inside the folder (absolute, or with '..')")
    return parts


def open_inside(root: str | Path, relative: str | Path) -> int:
    """A read-only descriptor of the regular file `relative` under `root`, reached without following any symbolic
    link below `root` (root itself may be one: the user named it). Raises FileNotFoundError when it is missing and
    UnsafeFile when it is a link, not a regular file, or not inside `root`."""
    parts = relative_parts(relative)
    shown = Path(root, *parts)
    folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for depth, part in enumerate(parts[:-1]):
            try:
                inner = os.open(part, _NOFOLLOW_DIR, dir_fd=folder)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeFile(f"{Path(root, *parts[:depth + 1])} is a symbolic link or not a folder; "
                                     "refused (recycle reads only regular files inside the folder)") from None
                raise
            os.close(folder)
            folder = inner
        info = os.stat(parts[-1], dir_fd=folder, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(f"{shown} is a {_kind(info.st_mode)}, not a regular file; refused (recycle reads only "
                             "regular files inside the folder)")
        try:
            fd = os.open(parts[-1], _NOFOLLOW_FILE, dir_fd=folder)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeFile(f"{shown} is a symbolic link; refused (recycle reads only regular files inside "
                                 "the folder)") from None
            raise
    finally:
        os.close(folder)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # replaced between the stat and the open
        os.close(fd)
        raise UnsafeFile(f"{shown} is a {_kind(info.st_mode)}, not a regular file; refused")
    return fd


def lstat_inside(root: str | Path, relative: str | Path) -> os.stat_result:
    """The stat of the regular file `relative` under `root` (as open_inside reaches it)."""
    fd = open_inside(root, relative)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


def read_inside(root: str | Path, relative: str | Path, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file `relative` under `root` (open_inside), at most `limit` of them: a larger file
    is an UnsafeFile naming the bound."""
    fd = open_inside(root, relative)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UnsafeFile(f"{Path(root, relative)} is {size:,} bytes, more than a {what} may have "
                             f"({limit:,}); refused")
        chunks = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:  # grew while being read
            raise UnsafeFile(f"{Path(root, relative)} is more than a {what} may have ({limit:,} bytes); refused")
        return data
    finally:
        os.close(fd)


def sha256_inside(root: str | Path, relative: str | Path) -> str:
    """The SHA-256 of the regular file `relative` under `root` (open_inside), read to its end."""
    fd = open_inside(root, relative)
    digest = hashlib.sha256()
    try:
        while block := os.read(fd, 1 << 20):
            digest.update(block)
    finally:
        os.close(fd)
    return digest.hexdigest()
