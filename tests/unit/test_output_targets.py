"""Output targets (issue 21 item 5): a file path that is a device, a FIFO or a link is written as a user expects
instead of being replaced by a regular file (before: as root, `--save /dev/full` replaced the device node, and
`--metrics /dev/null` would have replaced /dev/null). See recycle.fileio's docstring for the rules."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest
import torch

from recycle.errors import ConfigError, OutputError
from recycle.fileio import atomic_write_bytes, atomic_write_text, check_output_file, is_stream_target
from recycle.runtime.control import preflight
from recycle.runtime.options import ClusterOptions, LaunchOptions, OutputOptions
from recycle.runtime.state import checkpoint

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="making a device node (mknod) needs root")


def _device(path: Path, minor: int) -> Path:
    """A character device node like /dev/null (minor 3) or /dev/full (minor 7), made in the test's folder: a
    broken implementation replaces this one, never the machine's."""
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
    return path


def _kind(path: Path) -> str:
    mode = os.lstat(path).st_mode
    return "link" if stat.S_ISLNK(mode) else "char" if stat.S_ISCHR(mode) else "fifo" if stat.S_ISFIFO(mode) \
        else "file" if stat.S_ISREG(mode) else "other"


@needs_root
def test_a_null_device_is_written_into_and_stays_a_device(tmp_path: Path) -> None:
    null = _device(tmp_path / "null", 3)
    check_output_file(null, "--metrics")
    for _ in range(2):
        atomic_write_text(null, "{}\n")
    assert _kind(null) == "char" and os.listdir(tmp_path) == ["null"]


@needs_root
def test_a_full_device_is_a_clear_error_and_stays_a_device(tmp_path: Path) -> None:
    full = _device(tmp_path / "full", 7)
    check_output_file(full, "--save")  # a device accepts the path; the write says what is wrong
    with pytest.raises(OutputError, match=r"cannot write '.*full': No space left on device; pass another path"):
        atomic_write_bytes(full, b"weights")
    assert _kind(full) == "char" and os.listdir(tmp_path) == ["full"]


class _Reader(threading.Thread):
    """Reads a FIFO until `finish()`, collecting what came. It holds a write end of its own, so that its reads
    wait between the writes under test instead of ending."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.data = b""
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a reader is there before any write
        os.set_blocking(self.fd, True)
        self.keep = os.open(path, os.O_WRONLY)
        self.start()

    def run(self) -> None:
        while chunk := os.read(self.fd, 65536):
            self.data += chunk
        os.close(self.fd)

    def finish(self) -> bytes:
        os.close(self.keep)  # the last writer gone: the reader sees the end
        self.join(10)
        return self.data


@pytest.mark.timeout(30)
def test_a_fifo_with_a_reader_gets_each_record_once(tmp_path: Path) -> None:
    """The launcher rewrites the whole --metrics log after every step: a stream gets only what is new."""
    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    check_output_file(fifo, "--metrics")
    reader = _Reader(fifo)
    log = ""
    for step in range(3):
        log += f'{{"step": {step}}}\n'
        atomic_write_text(fifo, log)
    assert reader.finish().decode() == log and _kind(fifo) == "fifo"


@pytest.mark.timeout(30)
def test_a_fifo_without_a_reader_is_an_error_not_a_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="a FIFO \\(named pipe\\) that no process is reading; start its reader"):
        atomic_write_bytes(fifo, b"weights")
    assert _kind(fifo) == "fifo"


def test_a_link_is_followed_and_kept(tmp_path: Path) -> None:
    """`--save latest.pt` where latest.pt links to the run's file: the file is replaced (atomically, in its own
    folder), the link stays; a dangling link creates its target."""
    (tmp_path / "runs").mkdir()
    real = tmp_path / "runs" / "model.pt"
    real.write_bytes(b"old")
    link = tmp_path / "latest.pt"
    link.symlink_to(real)
    check_output_file(link, "--save")
    atomic_write_bytes(link, b"new")
    assert _kind(link) == "link" and real.read_bytes() == b"new"
    dangling = tmp_path / "next.pt"
    dangling.symlink_to(tmp_path / "runs" / "next.pt")
    atomic_write_bytes(dangling, b"made")
    assert _kind(dangling) == "link" and (tmp_path / "runs" / "next.pt").read_bytes() == b"made"
    assert sorted(os.listdir(tmp_path / "runs")) == ["model.pt", "next.pt"]


def test_a_process_descriptor_is_appended_to_not_replaced(tmp_path: Path) -> None:
    """`--metrics /dev/stdout > log`: /dev/stdout leads to the shell's log file; replacing it would cut the log
    off from the process writing it. It is appended to instead, each record once."""
    log = tmp_path / "log.txt"
    with open(log, "w") as handle:
        handle.write("before\n")
        handle.flush()
        target = f"/proc/self/fd/{handle.fileno()}"
        check_output_file(target, "--metrics")
        assert is_stream_target(target)
        atomic_write_text(target, "a\n")
        atomic_write_text(target, "a\nb\n")
        stat_before = os.fstat(handle.fileno())
    assert log.read_text() == "before\na\nb\n" and os.stat(log).st_ino == stat_before.st_ino


def test_a_socket_or_directory_target_is_refused(tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock))
    try:
        with pytest.raises(OutputError, match=r"--save '.*s.sock' is a socket; recycle writes only regular files"):
            check_output_file(sock, "--save")
        with pytest.raises(OutputError, match="is a socket"):
            atomic_write_bytes(sock, b"x")
        assert _kind(sock) == "other"
    finally:
        server.close()
    with pytest.raises(OutputError, match="is a directory"):
        check_output_file(tmp_path, "--save")


def test_recycles_own_files_replace_a_link_instead_of_following_it(tmp_path: Path) -> None:
    """follow=False (a checkpoint's files, a plan store's index): a planted link is replaced, never written
    through."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    link = tmp_path / "latest"
    link.symlink_to(victim)
    atomic_write_text(link, "step000002\n", follow=False)
    assert _kind(link) == "file" and victim.read_text() == "precious"


@pytest.mark.timeout(30)
def test_save_into_a_fifo_merges_the_stage_parts_outside_dev(tmp_path: Path) -> None:
    """The workers' --save parts go next to a regular target; for a stream (/dev/null) they go to the temporary
    folder, so nothing is created in /dev, and the merged file is written into the stream."""
    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    parts = [checkpoint.part_file(fifo, s) for s in range(2)]
    assert all(p.parent != tmp_path for p in parts)
    for stage, part in enumerate(parts):
        checkpoint.atomic_torch_save({f"w{stage}": torch.full((2,), float(stage))}, part)
    reader = _Reader(fifo)
    checkpoint.merge_stage_parts(fifo, 2, {"step": 3})
    import io

    saved = torch.load(io.BytesIO(reader.finish()), weights_only=True)
    assert saved["model"].keys() == {"w0", "w1"} and saved["step"] == 3
    assert not any(p.exists() for p in parts) and os.listdir(tmp_path) == ["model.fifo"]


def test_a_stream_save_target_is_refused_on_several_nodes(tmp_path: Path) -> None:
    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is a device or FIFO: on several nodes"):
        preflight.check_save_target(LaunchOptions(outputs=OutputOptions(save_path=str(fifo)),
                                                  cluster=ClusterOptions(nnodes=2, master_port=29500, token="x" * 48)))
    preflight.check_save_target(LaunchOptions(outputs=OutputOptions(save_path=str(fifo))))
