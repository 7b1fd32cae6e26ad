"""A worker process's name as ps, top and /proc show it (its comm), so an operator can tell which process is which
worker: written to /proc/self/comm (Linux's prctl(PR_SET_NAME), at most 15 bytes). setproctitle, which also
rewrites the command line, is not a dependency; `ps -o pid,comm` (not `ps aux`) shows the name."""

from __future__ import annotations

__all__ = ["set_process_title", "COMM_BYTES"]

COMM_BYTES = 15  # the kernel keeps a thread's comm in 16 bytes, the last a NUL


def set_process_title(title: str) -> bool:
    """Name this process's main thread `title` (cut to 15 bytes); threads started afterwards inherit the name.
    False where the system has no /proc/self/comm (not Linux): nothing changes then."""
    try:
        with open("/proc/self/comm", "wb") as comm:
            comm.write(title.encode()[:COMM_BYTES])
        return True
    except OSError:
        return False
