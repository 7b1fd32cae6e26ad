"""The sockets a generation's gloo groups opened, and cutting them from any thread: gloo's own abort() does not wake
an op blocked on a peer that is alive but silent (measured on torch 2.13), while shutting the op's socket down makes it
raise at once; the peer's side of the connection sees the same close, so it leaves the generation too."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

__all__ = ["SocketSet", "open_sockets", "cut"]

_PROC_FD = "/proc/self/fd"


def open_sockets() -> dict[int, str]:
    """fd -> inode ("socket:[123]") of every socket this process holds now."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(_PROC_FD)
    except OSError:
        return found
    for name in names:
        try:
            link = os.readlink(f"{_PROC_FD}/{name}")
        except OSError:
            continue  # closed since the listing
        if link.startswith("socket:"):
            found[int(name)] = link
    return found


@dataclass(frozen=True)
class SocketSet:
    """A generation's sockets: while it forms, every socket opened since `before` was taken; once it has formed
    (`settled`), exactly those that existed then (so a later generation's sockets are never taken for its own).
    Connections to the `keep` peers (the job store) are never cut."""

    before: frozenset[tuple[int, str]]
    keep: frozenset[tuple[str, int]]
    members: frozenset[tuple[int, str]] | None = None

    @staticmethod
    def start(keep: set[tuple[str, int]]) -> "SocketSet":
        return SocketSet(frozenset(open_sockets().items()), frozenset(keep))

    def settled(self) -> "SocketSet":
        return SocketSet(self.before, self.keep, frozenset(self.new_sockets().items()))

    def new_sockets(self) -> dict[int, str]:
        if self.members is not None:
            return dict(self.members)
        return {fd: inode for fd, inode in open_sockets().items() if (fd, inode) not in self.before}


def cut(sockets: SocketSet) -> int:
    """Shut down (both directions) every connected socket opened since `sockets` was started, except the kept
    peers; never a listening socket (gloo's listener thread would crash the process). The fd is checked to still be
    the same socket (same inode) right before, so a number reused by something else is left alone. Returns how many
    were cut."""
    count = 0
    for fd, inode in sockets.new_sockets().items():
        try:
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if os.readlink(f"{_PROC_FD}/{fd}") != inode:
                continue
            if probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            if probe.family not in (socket.AF_INET, socket.AF_INET6):
                continue  # unix sockets: multiprocessing's, never gloo's
            try:
                peer = probe.getpeername()[:2]
            except OSError:
                continue  # not connected (yet or any more)
            if (peer[0], peer[1]) in sockets.keep:
                continue
            probe.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            probe.close()  # closes only the duplicate; the shutdown holds for every fd of the socket
    return count
