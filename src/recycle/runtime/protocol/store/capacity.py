"""How many connections the job's store must hold at once, and the file descriptors that takes: every worker process
keeps three open to it (its calls, its watcher's wait on the abort key, its outbox's writer) and every node launcher
two (its calls, its stop-report digests' thread), so a job of 1,400 workers already passes the server's default
limit, and most machines' default `ulimit -n`."""

from __future__ import annotations

import resource

from recycle.errors import ConfigError

__all__ = ["CONNECTIONS_PER_PROCESS", "CONNECTIONS_PER_LAUNCHER", "connections_needed", "connection_limit",
           "ensure_descriptors"]

CONNECTIONS_PER_PROCESS = 3  # measured: `ss -tnp` of a running job shows three per worker process
CONNECTIONS_PER_LAUNCHER = 2  # its follow loop's, and its record digests' thread's (control.node_digests)
SPARE_CONNECTIONS = 256  # replacements starting while the dying process's sockets close, tools, the listener itself
DEFAULT_MAX_CONNECTIONS = 4096  # the store's limit for a small job (StoreLimits)


def connections_needed(worker_processes: int, nodes: int) -> int:
    """The connections a job store that serves `worker_processes` (every rank of every worker, live or not: a failed
    one may be respawned) and `nodes` launchers must be able to hold at once."""
    return CONNECTIONS_PER_PROCESS * worker_processes + CONNECTIONS_PER_LAUNCHER * nodes + SPARE_CONNECTIONS


def connection_limit(needed: int) -> int:
    """The store's connection limit for a job that needs `needed`: never below the default."""
    return max(DEFAULT_MAX_CONNECTIONS, needed)


def ensure_descriptors(connections: int, what: str) -> None:
    """Raise this process's soft limit on open files so that `connections` sockets fit (plus room for its own
    files), up to the hard limit; past it, refuse with the limit to set."""
    want = connections + SPARE_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    if hard != resource.RLIM_INFINITY and hard < want:
        raise ConfigError(f"{what} must hold up to {connections:,} connections ({CONNECTIONS_PER_PROCESS} per worker "
                          f"process and one per node), which needs {want:,} open files, but this process may open "
                          f"only {hard:,} (the hard `ulimit -n`); raise it where the job is started (`ulimit -Hn "
                          f"{want}` as root, `LimitNOFILE={want}` in a systemd unit, `nofile` in "
                          "/etc/security/limits.conf, or the container runtime's ulimits)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
