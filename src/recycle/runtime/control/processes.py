"""The worker processes of one node's launcher: started, started again as replacements, fenced (killed) and stopped."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Protocol, Sequence

from recycle.ir.worker import Worker
from recycle.runtime.options import StartMethod
from recycle.runtime.protocol.channels import JobStore, Keys
from recycle.runtime.worker.process import WorkerSpec, worker_main

__all__ = ["WorkerProcess", "Spawner", "WorkerProcesses", "start_context", "node_ranks"]


def node_ranks(live: list[int], nnodes: int, node_rank: int) -> list[int]:
    """The live workers node `node_rank` starts: contiguous, as even as possible."""
    base, extra = divmod(len(live), nnodes)
    start = node_rank * base + min(node_rank, extra)
    return live[start:start + base + (1 if node_rank < extra else 0)]


def start_context(start_method: StartMethod) -> Any:
    """The multiprocessing context the workers start from (typeshed's BaseContext lacks Process: hence Any)."""
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(["torch", "torch.distributed", "recycle.runtime.worker.process"])
    return context


class WorkerProcess(Protocol):
    """What the launcher uses of a worker's process (a multiprocessing.Process; the thread tier's fake)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    @property
    def sentinel(self) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...


class Spawner:
    """Starts worker processes: one fresh process per call, told its WorkerSpec and the launcher's pipe."""

    def __init__(self, context: Any, spec_for: Callable[[int, bool], WorkerSpec],
                 worker: Callable[[int], tuple[int, int]]) -> None:
        self.context, self.spec_for, self.worker = context, spec_for, worker
        # Workers block reading this pipe; only the launcher holds the write end, so they see EOF the moment it dies.
        self._alive, self._alive_writer = context.Pipe(duplex=False)

    def __call__(self, rank: int, joining: bool) -> WorkerProcess:
        replica, stage = self.worker(rank)
        process = self.context.Process(target=worker_main, args=(self.spec_for(rank, joining), self._alive),
                                       name=f"recycle-worker-{Worker(replica, stage)}", daemon=True)
        process.start()
        return process

    def close(self) -> None:
        """Drop the launcher's ends of the pipe (after the workers are stopped)."""
        self._alive_writer.close()
        self._alive.close()


class WorkerProcesses:
    """One process per rank of this node, the latest one that ran as it. Stop it to end them all: no orphans."""

    def __init__(self, jobs: JobStore, spawn: Callable[[int, bool], WorkerProcess]) -> None:
        self.jobs, self.spawn = jobs, spawn
        self._processes: dict[int, WorkerProcess] = {}

    @property
    def ranks(self) -> list[int]:
        """Every rank this node has started, in the order first started."""
        return list(self._processes)

    def start(self, rank: int, joining: bool) -> int | None:
        """Start a process as `rank` (`joining`: a replacement that joins the running job); its pid."""
        if joining:
            for key in (Keys.join_ready(rank), Keys.join_generation(rank), Keys.exited(rank), Keys.error(rank)):
                self.jobs.raw.delete_key(key)  # left by an earlier life of this rank
        process = self.spawn(rank, joining)
        self._processes[rank] = process
        return process.pid

    def respawn(self, rank: int) -> int | None:
        """Start a replacement for `rank` unless one is running (it is already starting): its pid, or None."""
        if self.running(rank):
            return None
        return self.start(rank, joining=True)

    def running(self, rank: int) -> bool:
        process = self._processes.get(rank)
        return process is not None and process.exitcode is None

    def exitcode(self, rank: int) -> int | None:
        """How the latest process of `rank` ended; None while it runs (or none was started)."""
        process = self._processes.get(rank)
        return None if process is None else process.exitcode

    def exitcodes(self) -> dict[int, int]:
        """The ranks whose latest process has ended, and how."""
        codes = {r: p.exitcode for r, p in self._processes.items()}
        return {r: code for r, code in codes.items() if code is not None}

    def pid(self, rank: int) -> int | None:
        process = self._processes.get(rank)
        return None if process is None else process.pid

    def signal(self, rank: int, number: signal.Signals) -> None:
        """Send `number` to the running process of `rank` (SIGKILL: works on a SIGSTOPped process too)."""
        pid = self.pid(rank)
        if self.running(rank) and pid is not None:
            os.kill(pid, number)

    def wait(self, timeout_s: float, also: Sequence[Any] = ()) -> None:
        """Sleep until a worker exits (seen at once), one of `also` (objects with a fileno()) is readable, or
        `timeout_s` passes: a busy poll would take CPU from the workers on a small machine."""
        waiting = [p.sentinel for p in self._processes.values() if p.exitcode is None] + list(also)
        if waiting:
            mp_connection.wait(waiting, timeout=timeout_s)
        else:
            time.sleep(timeout_s)

    def stop(self) -> None:
        """Terminate every still-running worker (SIGTERM, then SIGKILL) and reap it."""
        for p in self._processes.values():
            if p.exitcode is None:
                p.terminate()
                try:
                    if p.pid is not None:
                        os.kill(p.pid, signal.SIGCONT)  # a frozen (SIGSTOPped) worker acts on SIGTERM once continued
                except ProcessLookupError:
                    pass
        deadline = time.time() + 3.0
        for p in self._processes.values():
            p.join(max(0.0, deadline - time.time()))
            if p.exitcode is None:
                p.kill()
                p.join(1.0)
