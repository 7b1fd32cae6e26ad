"""The thread-cluster tier's harness: a job's workers as threads running the package's worker code on its real store,
node 0's real coordination loop deciding, and an injector script of faults (the fixtures: conftest.py)."""

from __future__ import annotations

import datetime
import itertools
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from recycle.config import Config
from recycle.ir import Plan, PlanChoice
from recycle.planner.api import make_plan  # tests may use the planner; the runtime may not
from recycle.planner.options import PlannerOptions
from recycle.runtime.control.launcher import _spec_maker
from recycle.runtime.control.processes import WorkerProcesses
from recycle.runtime.control.reporter import Recovery, StepMetrics
from recycle.runtime.control.supervisor import Supervisor
from recycle.runtime.options import LaunchOptions, with_keywords
from recycle.runtime.protocol.channels import (Channels, JobStore, Keys, connect_store, host_store, new_token,
                                               worker_identity)
from recycle.runtime.protocol.store import LocalStore, StoreFenced, StoreServer
from recycle.runtime.tools.fakes import FaultyComm, MemoryNetwork
from recycle.runtime.tools.faults import FaultInjection, fire
from recycle.runtime.worker.process import EXIT_FENCED, WorkerHooks, WorkerSpec, run_worker

_PIDS = itertools.count(1 << 30)  # above any kernel's pid_max: a signal the launcher sends to one reaches nobody


@dataclass
class Injector:
    """A run's script of events at exact points of the workers' work, each chained (`.kill(...).rejoin(...)`).
    Workers are (replica, stage); steps are 0-based."""

    faults: list[tuple[tuple[int, int], FaultInjection]] = field(default_factory=list)
    rejoins: list[tuple[tuple[int, int], int]] = field(default_factory=list)
    lost_links: list[tuple[tuple[int, int], int, int, int]] = field(default_factory=list)

    def kill(self, worker: tuple[int, int], step: int, action: int = 0) -> "Injector":
        """The worker dies (SIGKILL) before action `action` of its list in `step`."""
        return self._fault(worker, FaultInjection(step, action, "kill"))

    def kill_in_recovery(self, worker: tuple[int, int], step: int) -> "Injector":
        """The worker dies as it stops for a recovery in `step` or later, before it reports."""
        return self._fault(worker, FaultInjection(step, 0, "kill", "recovery"))

    def freeze(self, worker: tuple[int, int], step: int, action: int = 0) -> "Injector":
        """The whole worker stops (SIGSTOP): no beat, no op; only its heartbeat's silence tells."""
        return self._fault(worker, FaultInjection(step, action, "hang"))

    def stall(self, worker: tuple[int, int], step: int, action: int = 0) -> "Injector":
        """The worker's main thread is stuck in an action while its heartbeat goes on."""
        return self._fault(worker, FaultInjection(step, action, "stall"))

    def raise_error(self, worker: tuple[int, int], step: int, action: int = 0) -> "Injector":
        """The worker raises an ordinary exception (a bug): the run must fail, not recover."""
        return self._fault(worker, FaultInjection(step, action, "raise"))

    def lose_link(self, worker: tuple[int, int], iteration: int, op: int, generation: int = 0) -> "Injector":
        """The worker's transport of `generation` loses its peer at comm op `op` of its `iteration`-th iteration
        (runtime.fakes.FaultyComm): a transient network error, nobody dies."""
        self.lost_links.append((worker, generation, iteration, op))
        return self

    def rejoin(self, worker: tuple[int, int], step: int) -> "Injector":
        """Bring the worker back (a replacement process) once `step` steps are done, if it is down then. The
        others wait at the end of `step` until it says it is ready (torchft's barrier_at): its admission point is
        then the same in every run, not a race between its start and the end of the run."""
        self.rejoins.append((worker, step))
        return self

    def _fault(self, worker: tuple[int, int], fault: FaultInjection) -> "Injector":
        self.faults.append((worker, fault))
        return self


class ThreadProcess:
    """One worker 'process' of threads (runtime.worker.run_worker, the watcher thread it starts), with what the
    launcher uses of a multiprocessing.Process. Its exit records an exit code and wakes the launcher (a pipe is its
    sentinel); a SIGKILL, a fence or a SIGSTOP parks every thread of it at its next store call (or in the fault
    itself), so nothing of it runs or writes again, as after os._exit."""

    def __init__(self, cluster: "ThreadCluster", rank: int, spec: WorkerSpec) -> None:
        self.cluster, self.rank, self.spec = cluster, rank, spec
        self.pid = next(_PIDS)
        self.exitcode: int | None = None
        self.frozen = False
        self._lock = threading.Lock()
        self.sentinel, self._wake = os.pipe()
        self.hooks = WorkerHooks(connect=self._connect, transport=self._transport, fire=self._fire)
        self.thread = threading.Thread(target=self._main, daemon=True, name=f"worker-{rank}")

    def start(self) -> None:
        self.thread.start()

    def _main(self) -> None:
        try:
            self.exit(run_worker(self.spec, self._connect(self.spec), self.hooks))
        except StoreFenced:
            pass  # parked while it connected

    def exit(self, code: int) -> None:
        """The process ends with `code` (the first end counts); the launcher sees it at once."""
        with self._lock:
            if self.exitcode is None:
                self.exitcode = code
                os.write(self._wake, b"x")

    def park(self) -> None:
        """Nothing of a dead or frozen process runs again. At the test's end its threads unwind as a fenced
        process's do: the store refuses it (the watcher returns, the main thread reports and ends)."""
        self.cluster.gone.wait()
        raise StoreFenced(f"worker rank {self.rank}: the test is over")

    def gate(self) -> None:
        if self.exitcode is not None or self.frozen or self.cluster.gone.is_set():
            self.park()

    # -- the launcher's calls -----------------------------------------------------------------------------------
    def terminate(self) -> None:
        self.exit(-15)

    def kill(self) -> None:
        self.exit(-9)

    def join(self, timeout: float | None = None) -> None:
        pass  # an exit is immediate here

    # -- the worker's hooks -------------------------------------------------------------------------------------
    def _connect(self, spec: WorkerSpec) -> Any:
        cluster = spec.cluster
        client = connect_store(cluster.master_addr, cluster.master_port, cluster.token,
                               worker_identity(spec.rank, spec.incarnation), max(spec.recovery.timeout_s, 30.0),
                               on_fenced=self._fenced)
        self.cluster.clients.append(client)
        return _Gated(client, self)

    def _fenced(self) -> None:
        self.exit(EXIT_FENCED)
        self.park()

    def _transport(self, store: Any, generation: int, rank: int, *args: Any, **kwargs: Any) -> Any:
        comm: Any = self.cluster.network.transport(store, generation, rank, *args, **kwargs)
        for worker, at_generation, iteration, op in self.cluster.injector.lost_links:
            if self.cluster.rank(worker) == rank and at_generation == generation:
                comm = FaultyComm(comm, fail_at=(iteration, op))
        return comm

    def _fire(self, fault: FaultInjection, where: str) -> None:
        if fault.mode == "kill":
            self.exit(-9)
            self.park()
        elif fault.mode == "hang":
            self.frozen = True
            self.park()
        elif fault.mode == "stall":
            self.park()  # the main thread only: the watcher thread beats on
        else:
            fire(fault, where)


class _Gated:
    """A store connection of a ThreadProcess: every call first checks that the process still runs."""

    def __init__(self, client: Any, process: ThreadProcess) -> None:
        self._client, self._process = client, process

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            self._process.gate()
            if name == "set":
                self._process.cluster.hold(args[0])
            result = attribute(*args, **kwargs)
            self._process.gate()  # died while it waited: the answer never arrives
            return result

        return call


class _KillingServer:
    """The store server as the launcher drives it: its fence of a worker is followed by the kill the launcher sends
    (RECYCLE_TEST_UNFENCEABLE keeps the launcher's own os.kill off these pids)."""

    def __init__(self, server: StoreServer, processes: dict[int, ThreadProcess]) -> None:
        self.server, self.processes = server, processes

    def fence(self, prefix: str) -> list[str]:
        fenced = self.server.fence(prefix)
        _, rank, _ = prefix.split("/")
        process = self.processes.get(int(rank))
        if process is not None:
            process.kill()
        return fenced


@dataclass(frozen=True)
class Outcome:
    steps: tuple[StepMetrics, ...]
    recoveries: tuple[Recovery, ...]
    failed: frozenset[tuple[int, int]]
    seconds: float
    jobs: JobStore  # the job's store after the run


class ThreadCluster:
    """One job: its store, its worker threads, node 0's coordination loop."""

    def __init__(self, config: Config, plan: Plan, options: LaunchOptions, injector: Injector) -> None:
        self.config, self.plan, self.options, self.injector = config, plan, options, injector
        self.gone = threading.Event()
        self.network = MemoryNetwork()
        self.clients: list[Any] = []
        self.processes: dict[int, ThreadProcess] = {}
        self.token = new_token()
        self.server = host_store("127.0.0.1", 0, self.token)
        self.store = LocalStore(self.server.data, 30.0)
        self.feed = Supervisor.subscribe(self.server.data)  # as the launcher does
        self.end_step = config.training.steps
        self.rejoined = {self.rank(worker): (step, threading.Event()) for worker, step in injector.rejoins}
        cluster = replace(options.cluster, master_port=self.server.port, token=self.token)
        self._spec_for = _spec_maker(config, plan, options, cluster, 0, self.end_step, plan.live_ranks())
        self.workers = WorkerProcesses(JobStore(self.store), self.spawn)

    def rank(self, worker: tuple[int, int]) -> int:
        return self.plan.rank(*worker)

    def hold(self, key: str) -> None:
        """Before a worker writes its record of a step that a scripted re-join waits at: wait for the replacement."""
        kind, _, rest = key.partition("/")
        if kind != "metrics":
            return
        step = int(rest.split("/")[0])
        for rank, (at, ready) in self.rejoined.items():
            if step >= at and not ready.is_set():
                self.store.wait([Keys.join_ready(rank)], datetime.timedelta(seconds=10))
                ready.set()  # the launcher deletes the key when it admits the replacement

    def spawn(self, rank: int, joining: bool) -> ThreadProcess:
        """A worker 'process' started as `rank` (WorkerProcesses' spawner)."""
        process = ThreadProcess(self, rank, self._spec_for(rank, joining))
        self.processes[rank] = process
        process.start()
        return process

    def run(self) -> Outcome:
        started = time.perf_counter()
        for rank in self.plan.live_ranks():
            self.workers.start(rank, joining=False)
        server = _KillingServer(self.server, self.processes)
        supervisor = Supervisor(self.config, self.plan, self.options, self.store, self.workers, 0, self.end_step,
                                time.time(), server, feed=self.feed)
        steps, recoveries, failed = supervisor.run()
        return Outcome(tuple(steps), tuple(recoveries), frozenset(failed), time.perf_counter() - started,
                       JobStore(self.store))

    def close(self) -> None:
        self.gone.set()
        for fabric in list(self.network.fabrics.values()):
            fabric.cut()  # a thread still blocked on a peer (after a failed run) raises at once
        for process in list(self.processes.values()):
            process.exit(-15)
            process.thread.join(2.0)
            os.close(process.sentinel)
            os.close(process._wake)
        for client in self.clients:
            client.close()
        self.server.close()


def _heuristic(config: Config) -> Callable[[frozenset[tuple[int, int]]], PlanChoice]:
    def provide(failed: frozenset[tuple[int, int]]) -> PlanChoice:
        started = time.perf_counter()
        plan = make_plan(config, failed, options=PlannerOptions(search=False))  # the priority rules: fast
        return PlanChoice(plan, "heuristic", time.perf_counter() - started)

    return provide


def job(config: Config, injector: Injector, **options: Any) -> ThreadCluster:
    """The job of `config` with the injector's script, on LaunchOptions fit for threads (fast beats, one-process
    timeouts, replicas checked bit-identical after every step) that `options` override. The caller sets
    RECYCLE_TEST_UNFENCEABLE to every rank: a fence's kill is the fake process's own (_KillingServer)."""
    provider = _heuristic(config)
    plan = provider(frozenset()).plan
    settings: dict[str, Any] = dict(timeout_s=5.0, heartbeat_s=0.02, heartbeat_timeout_s=2.0, backend="gloo",
                                    progress=None, plan_provider=provider, verify_replicas=True)
    settings.update(options)
    settings.update(faults=tuple((plan.rank(*w), f) for w, f in injector.faults),
                    rejoins=tuple((plan.rank(*w), step) for w, step in injector.rejoins))
    launch_options = with_keywords(LaunchOptions(), settings)
    return ThreadCluster(config, plan, launch_options, injector)
