"""The worker processes of one node's launcher: started, started again as replacements, fenced (killed) and stopped.
A tensor-parallel worker is T processes on the node, started, watched and killed as one (WorkerGroup)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Protocol, Sequence

import torch

from recycle.ir.worker import Worker
from recycle.runtime.control.worker_start import start_context
from recycle.runtime.protocol.channels import JobStore, Keys
from recycle.runtime.worker.process import WorkerSpec, worker_main

__all__ = ["WorkerProcess", "WorkerGroup", "Spawner", "WorkerProcesses", "start_context", "node_ranks"]


def node_ranks(live: list[int], nnodes: int, node_rank: int) -> list[int]:
    """The live workers node `node_rank` starts: contiguous, as even as possible."""
    base, extra = divmod(len(live), nnodes)
    start = node_rank * base + min(node_rank, extra)
    return live[start:start + base + (1 if node_rank < extra else 0)]


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


class WorkerGroup:
    """A tensor-parallel worker's T processes as one WorkerProcess. The worker is the failure unit: once any of its
    processes has ended in failure (a non-zero exit: killed, crashed, fenced), the others are killed at once and the
    worker has ended with that process's exit code; after a clean end of all T its code is 0. Its pid is TP rank
    0's (the one that speaks for the worker)."""

    def __init__(self, members: list[WorkerProcess]) -> None:
        self.members = members
        self._failure: int | None = None  # the exit code of the first process seen to fail

    @property
    def pid(self) -> int | None:
        return self.members[0].pid

    @property
    def exitcode(self) -> int | None:
        if self._failure is None:
            failed = [code for code in (p.exitcode for p in self.members) if code not in (None, 0)]
            if failed:
                self._failure = failed[0]
                self._fence()
        if self._failure is not None:
            return self._failure if all(p.exitcode is not None for p in self.members) else None
        codes = [p.exitcode for p in self.members]
        return 0 if all(code == 0 for code in codes) else None

    def _fence(self) -> None:
        """Kill the worker's other processes (SIGKILL: works on a SIGSTOPped one) and reap them."""
        for p in self.members:
            if p.exitcode is None:
                p.kill()
        for p in self.members:
            p.join(2.0)

    @property
    def sentinel(self) -> int:
        return self.members[0].sentinel

    def running_sentinels(self) -> list[int]:
        """What to wait on: each process still running (one that has ended would wake every wait at once)."""
        return [p.sentinel for p in self.members if p.exitcode is None]

    def terminate(self) -> None:
        for p in self.members:
            p.terminate()

    def kill(self) -> None:
        for p in self.members:
            p.kill()

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.time() + timeout
        for p in self.members:
            p.join(None if deadline is None else max(0.0, deadline - time.time()))


def _members(process: WorkerProcess) -> list[WorkerProcess]:
    return process.members if isinstance(process, WorkerGroup) else [process]


class Spawner:
    """Starts worker processes: one fresh process per call, told its WorkerSpec and the launcher's pipe."""

    def __init__(self, context: Any, spec_for: Callable[[int, bool], WorkerSpec],
                 worker: Callable[[int], tuple[int, int]]) -> None:
        self.context, self.spec_for, self.worker = context, spec_for, worker
        # Workers block reading this pipe; only the launcher holds the write end, so they see EOF the moment it dies.
        self._alive, self._alive_writer = context.Pipe(duplex=False)

    def __call__(self, rank: int, joining: bool) -> WorkerProcess:
        replica, stage = self.worker(rank)
        spec = self.spec_for(rank, joining)
        T = spec.tp_degree
        if T == 1:
            return self._start(spec, f"recycle-worker-{Worker(replica, stage)}")
        # A worker's T ranks run on this node, each on its own device (CUDA), each with its own scripted faults.
        members = [self._start(replace(spec, tp_rank=t, faults=tuple(f for f in spec.faults if f.tp_rank == t),
                                       device_index=(spec.device_index * T + t) % max(torch.cuda.device_count(), 1)),
                               f"recycle-worker-{Worker(replica, stage)}-tp{t}")
                   for t in range(T)]
        return WorkerGroup(members)

    def _start(self, spec: WorkerSpec, name: str) -> WorkerProcess:
        process = self.context.Process(target=worker_main, args=(spec, self._alive), name=name, daemon=True)
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
        # Processes of earlier lives of a rank not yet reaped when it was started again (a fenced TP member whose
        # reaping timed out on a loaded machine): stop() kills and reaps them too.
        self._retired: list[WorkerProcess] = []

    @property
    def ranks(self) -> list[int]:
        """Every rank this node has started, in the order first started."""
        return list(self._processes)

    def start(self, rank: int, joining: bool) -> int | None:
        """Start a process as `rank` (`joining`: a replacement that joins the running job); its pid."""
        if joining:
            for key in (Keys.join_ready(rank), Keys.join_generation(rank), Keys.exited(rank), Keys.error(rank)):
                self.jobs.raw.delete_key(key)  # left by an earlier life of this rank
        earlier = self._processes.get(rank)
        if earlier is not None:
            self._retired = [p for p in self._retired if p.exitcode is None]
            self._retired += [m for m in _members(earlier) if m.exitcode is None]
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

    def signal(self, rank: int, number: signal.Signals, tp_rank: int | None = None) -> None:
        """Send `number` to the running process(es) of `rank`, or to its TP rank `tp_rank` alone (SIGKILL: works
        on a SIGSTOPped process too)."""
        process = self._processes.get(rank)
        if process is None or not self.running(rank):
            return
        members = _members(process)
        for member in members if tp_rank is None else members[tp_rank:tp_rank + 1]:
            if member.exitcode is None and member.pid is not None:
                try:
                    os.kill(member.pid, number)
                except ProcessLookupError:
                    pass

    def wait(self, timeout_s: float, also: Sequence[Any] = ()) -> None:
        """Sleep until a worker exits (seen at once), one of `also` (objects with a fileno()) is readable, or
        `timeout_s` passes: a busy poll would take CPU from the workers on a small machine."""
        waiting = self.running_sentinels() + list(also)
        if waiting:
            mp_connection.wait(waiting, timeout=timeout_s)
        else:
            time.sleep(timeout_s)

    def running_sentinels(self) -> list[int]:
        """What turns readable when a running worker process ends (one that has ended would wake every wait)."""
        return [s for p in self._processes.values() if p.exitcode is None
                for s in (p.running_sentinels() if isinstance(p, WorkerGroup) else [p.sentinel])]

    def stop(self) -> None:
        """Terminate every still-running worker (SIGTERM, then SIGKILL) and reap it."""
        processes = [m for p in self._processes.values() for m in _members(p)] + self._retired
        for p in processes:
            if p.exitcode is None:
                p.terminate()
                try:
                    if p.pid is not None:
                        os.kill(p.pid, signal.SIGCONT)  # a frozen (SIGSTOPped) worker acts on SIGTERM once continued
                except ProcessLookupError:
                    pass
        deadline = time.time() + 3.0
        for p in processes:
            p.join(max(0.0, deadline - time.time()))
            if p.exitcode is None:
                p.kill()
                p.join(1.0)
