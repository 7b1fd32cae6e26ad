"""The control plane at scale (issue 23 item 4): the real coordinator loop (control/supervisor.Supervisor driving
control/coordinator.Coordinator, as `recycle coordinator` runs it: a process that hosts the job store and runs no
worker), the real authenticated job store server, and stand-in nodes (control_plane_nodes.py) that write and read
exactly what today's node launchers and workers do, with no torch compute and no process groups.

Run: .venv/bin/python benchmarks/bench_control_plane.py --ranks 1024 [--ranks 4096 ...] [--ranks-per-node 8]
     [--failures 5] [--silent-failures 1] [--no-join] [--steady-s 8] [--step-s 2] [--standins 2] [--profile]

Measured per size, on one coordinator process (store server thread + supervisor thread) and --standins processes:
- detect_to_announce_s: a worker's exit flag raised by its node launcher (the launcher sees a SIGKILL at once) ->
  the coordinator's announcement of the next generation is in the store; median over --failures. Broken down into
  flag -> abort, abort -> last stop report (each node's launcher writes one digest of its workers' reports),
  plan provider, plan to JSON + store, announcement. End to end: it includes the stand-ins seeing the abort and
  writing every node's digest, which on this machine compete with the coordinator for the same cores (a real
  node's launcher writes one from its own machine).
- coordinator_announce_s: the coordinator's own part of it, timed on when the keys landed in the store (LandedClock,
  stamped by the store as it applies each write): the
  exit flag in the store -> the abort written, plus the last stop report (digest) in the store -> the
  announcement (reading the reports, the plan provider, each worker's plan view, the announcement). The store
  server's work to take in the reports is left out of it (it is in the end-to-end figure, and in
  store_server_cpu_fraction's per-request cost); coordinator_announce_without_plan_s leaves out the plan provider's
  call where it was on the path (plan_on_path_s: its part after the last report landed; the coordinator asks a
  repeatable provider at the abort), and plan_to_announce_cpu_s is the supervisor thread's CPU time from the plan in
  hand (or the start of the announcement's work, if later) to the announcement.
- silent_detect_to_announce_s: a worker frozen (its heartbeat stops) -> announcement, minus the heartbeat timeout
  (the part the control plane adds to the timeout); node_detect_to_announce_s: a whole node silent, the same.
- join_s: the repaired node's replacements say they are ready -> the announcement that admits them (it waits for
  the survivors to drain at an iteration boundary, up to three steps ahead: Coordinator.on_join_ready).
- store_ops_per_s: requests the store served per second while nothing fails (server + the coordinator's own
  in-process calls), and offered_store_ops_per_s, what the protocol's rates ask of it (the stand-ins' schedule);
  when the stand-ins cannot keep up on this machine, the first is below the second (`stand_in_lag`).
- coordinator_cpu_fraction: the supervisor thread's CPU time over the same window (pthread CPU clock), as a
  fraction of one core, and per tick; store_server_cpu_fraction likewise for the store's network thread, its CPU
  per request served and so the cores the protocol's requests would take it (store_server_cores_asked);
  coordinator_process_cpu_fraction, the whole coordinator process (supervisor, store server, garbage collector;
  the benchmark's own thread sleeps meanwhile), and gc_cpu_fraction, the collector's share of it.
- --profile: cProfile (thread CPU time) of the supervisor thread over a second steady window (which calls dominate
  a tick).
- coordinator_peak_rss_mb: this process's peak resident memory (it is the coordinator's: store server and
  supervisor); rss_after_each_failure_mb and store_keys_after_each_failure: its resident memory and the store's
  keys after each recovery.
A worker the coordinator declares lost that the benchmark did not fail (stand-ins behind their heartbeats on an
overloaded machine: at 16,384 ranks hundreds of nodes at once) stops the measurements with an error saying so.
The plan provider is a user's: a plan library (planner.provider.PlanLibrary.lookup, what `recycle coordinator` is
given) holding a plan per failure state this run meets, made before the run (bench_library: each failed worker's
micro-batches re-routed to its stage's survivors straight in the IR on the state's canonical layout, instead of the
planner's search, which takes seconds per state at 16,384 ranks); at a failure it normalizes the failed set and
renames the stored plan onto the real ranks. Its time is reported apart (plan_s).
- --profile also profiles each stand-in process's loop (printed when the size ends), and the supervisor thread over
  the kills; every failure logs the supervisor thread's CPU from the abort to the announcement by activity.
The last line is one JSON object {"runs": [...]}, one entry per --ranks value.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from control_plane_nodes import NodesSpec, StandInNodes, standin_main  # noqa: E402

from recycle.config import Config, parse_config  # noqa: E402
from recycle.ir import Plan, PlanChoice  # noqa: E402
from recycle.ir.actions import Action, Kind  # noqa: E402
from recycle.planner.api import resolve_options  # noqa: E402
from recycle.planner.failures import canonical_failed, normalize  # noqa: E402
from recycle.planner.options import PlannerOptions  # noqa: E402
from recycle.planner.patterns import pattern_of  # noqa: E402
from recycle.planner.provider import PlanLibrary  # noqa: E402
from recycle.planner.store import PlanStore  # noqa: E402
from recycle.runtime.control.processes import WorkerProcesses, node_ranks  # noqa: E402
from recycle.runtime.control.supervisor import Supervisor  # noqa: E402
from recycle.runtime.options import ClusterOptions, LaunchOptions, RecoveryOptions  # noqa: E402
from recycle.runtime.protocol.channels import Flags, JobStore, Keys, host_store, new_token  # noqa: E402
from recycle.runtime.protocol.records import Announcement, from_json  # noqa: E402
from recycle.runtime.protocol.store import LocalStore, StoreServer  # noqa: E402
from recycle.runtime.protocol.store.data import Feed, KeyValue  # noqa: E402
from recycle.schedules.fault_free import build_schedule  # noqa: E402

END_STEP = 10**6  # the run never ends by itself (the benchmark stops it; Checkpoints lists the steps up to it)


# -- the plan provider: re-routing in the IR, no search ----------------------------------------------------------
def bench_config(num_replicas: int, num_stages: int, num_microbatches: int) -> Config:
    return parse_config({
        "topology": {"num_replicas": num_replicas, "num_stages": num_stages},
        "workload": {"num_microbatches": num_microbatches, "microbatch_size": 1, "seq_len": 8},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "model": {"preset": "tiny"}, "training": {"steps": 1},
    }, name="control-plane-bench")


def rerouted_plan(base: Plan, failed: frozenset[tuple[int, int]]) -> Plan:
    """`base` (a GPipe schedule: every worker's forwards, then its backwards, then OPT) with each failed worker's
    micro-batches dealt round-robin to its stage's survivors, which run them after their own forwards and
    backwards: a valid plan (validate_plan's dry run passes: see the test), built in one pass over the lists."""
    S = base.num_stages
    actions = [list(a) for a in base.actions]
    adopted: dict[int, list[int]] = {}
    for stage in range(S):
        down = sorted(p for p, s in failed if s == stage)
        survivors = [p for p in range(base.num_replicas) if (p, stage) not in failed]
        if down and not survivors:
            raise ValueError(f"stage {stage} has no survivor in {sorted(failed)}")
        dealt = 0
        for replica in down:
            for mb in range(replica * base.num_microbatches, (replica + 1) * base.num_microbatches):
                host = survivors[dealt % len(survivors)]
                dealt += 1
                adopted.setdefault(base.rank(host, stage), []).append(mb)
            actions[base.rank(replica, stage)] = []
    for rank, mbs in adopted.items():
        stage = base.worker(rank)[1]
        own = actions[rank]
        forwards = [a for a in own if a.kind is Kind.F] + [Action(Kind.F, stage, mb) for mb in mbs]
        backwards = [a for a in own if a.kind not in (Kind.F, Kind.OPT)] + \
            [Action(Kind.BW, stage, mb) for mb in reversed(mbs)]
        actions[rank] = forwards + backwards + [a for a in own if a.kind is Kind.OPT]
    return Plan.from_worker_lists(base.num_replicas, S, base.num_microbatches, actions, failed, base.staggered,
                                  base.meta)


def bench_library(base: Plan, states: list[frozenset[tuple[int, int]]]) -> PlanLibrary:
    """A plan library (planner.provider.PlanLibrary, what `recycle train` and `recycle coordinator` hand the
    coordinator: a plan per failure state made before the run) holding the plans of `states` (the failure sets this
    run will meet) and of no failure: per key (states one relabelling of pipelines maps: PlanStore) or per failure
    pattern across pipelines (PlanLibrary.patterns), each made by rerouted_plan on the state's canonical layout
    rather than by the planner, whose seconds per state at 16,384 ranks are no part of a failure's path. A failure
    then costs the coordinator what it costs a user's: PlanLibrary.lookup (normalize, a renaming onto the real
    ranks)."""
    D, S = base.num_replicas, base.num_stages
    config = bench_config(D, S, base.num_microbatches)
    plans: dict[tuple[int, ...], Plan] = {(0,) * S: base}
    patterns: dict[tuple, Plan] = {}
    for failed in states:
        state = normalize(failed, D, S)
        if state.symmetric:
            if state.key not in plans:
                plans[state.key] = rerouted_plan(base, canonical_failed(state.key))
        else:
            pattern = pattern_of(failed, D, S)
            if pattern.lost not in patterns:
                patterns[pattern.lost] = rerouted_plan(base, pattern.canonical_failed())
    options = resolve_options(config, PlannerOptions())
    most = max((len(failed) for failed in states), default=0)
    return PlanLibrary(PlanStore(Path("<memory>"), config, options, most, {}, plans), patterns)


@dataclass
class LibraryProvider:
    """A PlanProvider: the library's lookup (PlanLibrary.lookup, as a user's coordinator calls it), timed per call;
    repeatable like the library (ir.provider), so the coordinator asks at the abort, as it asks a user's library."""

    library: PlanLibrary
    repeatable: bool = True
    calls: list[tuple[float, float]] = field(default_factory=list)  # (start, end) wall clock
    ended_cpu: list[float] = field(default_factory=list)  # the calling thread's CPU clock at each call's end

    def __call__(self, failed: frozenset[tuple[int, int]]) -> PlanChoice:
        start = time.time()
        choice = self.library.lookup(failed)
        end = time.time()
        self.calls.append((start, end))
        self.ended_cpu.append(time.thread_time())  # the supervisor's thread: it calls the provider
        return choice


# -- the coordinator's store: counted, timed, stoppable ---------------------------------------------------------
class _Stop(Exception):
    """The benchmark is over: the supervisor's loop ends at its next store call."""


class CoordinatorStore(LocalStore):
    """The coordinator's in-process view of the store (as in launch()), counting its calls and noting when the
    keys of a recovery (abort, plan, announcement) are written."""

    def __init__(self, data: KeyValue, timeout_s: float) -> None:
        super().__init__(data, timeout_s)
        self.calls = 0
        self.written: dict[str, float] = {}  # key (of a multi-set: its last) -> wall clock of its first write
        self.announcements: dict[int, tuple[float, Announcement]] = {}
        self.announced_cpu: dict[int, float] = {}  # generation -> the writing thread's CPU clock (the supervisor's)
        self.trace: SupervisorTrace | None = None  # snapshots of its CPU by activity at each abort and announcement
        self.stopping = threading.Event()

    def _count(self) -> None:
        if self.stopping.is_set():
            raise _Stop()
        self.calls += 1

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._count()
        super().multi_set(keys, values)
        if keys:  # (one write: its keys landed together; noting each would add the benchmark's work to the thread's)
            self.written.setdefault(keys[-1], time.time())

    def set(self, key: str, value: Any) -> None:
        self._count()
        super().set(key, value)
        if key.startswith("gen"):
            now = time.time()
            self.written.setdefault(key, now)
            if key.endswith("/announce"):
                cpu = time.thread_time()
                record = from_json(Announcement, value)
                self.announced_cpu[record.generation] = cpu
                self.announcements[record.generation] = (now, record)
                if self.trace is not None:
                    self.trace.snap(f"announce/{record.generation}", cpu)
            elif key.endswith("/abort") and self.trace is not None:
                self.trace.snap(key, time.thread_time())

    def try_get(self, key: str) -> bytes | None:
        self._count()
        return super().try_get(key)

    def add(self, key: str, value: int) -> int:
        self._count()
        return super().add(key, value)

    def check(self, keys: list[str]) -> bool:
        self._count()
        return super().check(keys)

    def delete_key(self, key: str) -> bool:
        self._count()
        return super().delete_key(key)

    def take(self, keys: list[bytes]) -> list[bytes | None]:
        self._count()  # (one call, one hold of the lock, however many records it reads)
        return super().take(keys)

    def get(self, key: str) -> bytes:
        self._count()
        return super().get(key)


class _NoLocalWorkers(WorkerProcesses):
    """The coordinator process runs no worker (`recycle coordinator`); each end of a supervisor tick (its wait)
    is counted and timed in the supervisor's own thread, and a requested profile starts or stops there."""

    def __init__(self, jobs: JobStore) -> None:
        super().__init__(jobs, self._no_spawn)
        self.ticks = 0
        self.busy_cpu_s = 0.0
        self.tick_started_cpu = time.thread_time()
        self.profiler: cProfile.Profile | None = None
        self.profile_wanted = False

    @staticmethod
    def _no_spawn(rank: int, joining: bool) -> Any:
        raise AssertionError(f"the coordinator process starts no worker (rank {rank})")

    def wait(self, timeout_s: float, also: Any = ()) -> None:
        self.ticks += 1
        self.busy_cpu_s += time.thread_time() - self.tick_started_cpu
        if self.profile_wanted and self.profiler is None:
            self.profiler = cProfile.Profile(time.thread_time)  # CPU time: wall time under load is the others'
            self.profiler.enable()
        elif not self.profile_wanted and self.profiler is not None:
            self.profiler.disable()
        if also:  # as WorkerProcesses.wait: woken by the store's feed (no local worker here)
            mp_connection.wait(list(also), timeout=timeout_s)
        else:
            time.sleep(timeout_s)
        self.tick_started_cpu = time.thread_time()


class SupervisorTrace:
    """The supervisor thread's CPU time by activity (reading node launchers' step batches and stop digests, the
    reports' decision, the recovery's report afterwards, the step reports), snapshotted when an abort and an
    announcement are written: what the coordinator's thread did between the two (its own clock, so the others'
    load on the cores does not count)."""

    ACTIVITIES = ("_take_node_steps", "_take_node_stops", "_stopped_reports", "_complete_recovery", "_drain",
                  "_prepare_next", "_announce")

    def __init__(self, supervisor: Supervisor) -> None:
        self.cpu = dict.fromkeys(self.ACTIVITIES, 0.0)
        self.ticks = 0  # the loop's passes (_stopped_reports runs once in each)
        self.snaps: dict[str, tuple[float, dict[str, float], int]] = {}
        self.depth = 0
        self.announce_started: list[float] = []  # the thread's CPU clock as each _announce began
        for name in self.ACTIVITIES:
            if hasattr(supervisor, name):  # (_prepare_next: not in the tree before it)
                setattr(supervisor, name, self._timed(name, getattr(supervisor, name)))

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if name == "_stopped_reports":
                self.ticks += 1
            if self.depth:  # (nested: counted by the outer one)
                return method(*args, **kwargs)
            self.depth += 1
            started = time.thread_time()
            if name == "_announce":
                self.announce_started.append(started)
            try:
                return method(*args, **kwargs)
            finally:
                self.depth -= 1
                self.cpu[name] += time.thread_time() - started
        return timed

    def snap(self, label: str, cpu: float) -> None:
        self.snaps.setdefault(label, (cpu, dict(self.cpu), self.ticks))

    def between(self, first: str, last: str) -> dict[str, float] | None:
        """The thread's CPU between two snapshots: in all, and by activity (ms); and "ticks", the loop's passes."""
        if first not in self.snaps or last not in self.snaps:
            return None
        (cpu0, by0, ticks0), (cpu1, by1, ticks1) = self.snaps[first], self.snaps[last]
        spent = {name: 1e3 * (by1[name] - by0[name]) for name in self.ACTIVITIES if by1[name] > by0[name]}
        return {"total": 1e3 * (cpu1 - cpu0), **spent, "ticks": float(ticks1 - ticks0)}


class GcClock:
    """CPU time this process spends in Python's cyclic garbage collector, by generation (in whichever thread an
    allocation set it off: the supervisor's, or the store server's)."""

    def __init__(self) -> None:
        self.cpu_s = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._started: dict[int, float] = {}
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._started[ident] = time.thread_time()
        elif ident in self._started:
            generation = info["generation"]
            self.cpu_s[generation] += time.thread_time() - self._started.pop(ident)
            self.collections[generation] += 1

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)


class LandedClock(Feed):
    """When each exit flag, silence flag and stop report landed in the store: the store hands the clock every key as
    it applies the write (in its network thread, under its lock), so this is when the coordinator could first see
    it. It wakes nobody and queues nothing."""

    def __init__(self, server: StoreServer) -> None:
        super().__init__((b"exit/", b"silent/", b"stopped/", b"node_stopped/"))
        self.landed: dict[bytes, float] = {}
        server.data.attach(self)

    def publish(self, key: bytes) -> None:
        if key.startswith(self.prefixes):
            self.landed.setdefault(key, time.time())

    def first(self, key: str) -> float | None:
        return self.landed.get(key.encode())

    def last_under(self, prefix: str) -> float | None:
        start = prefix.encode()
        return max((t for key, t in list(self.landed.items()) if key.startswith(start)), default=None)


def _thread_cpu_s(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


# -- one size ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    ranks: int
    ranks_per_node: int = 8
    num_stages: int = 8
    num_microbatches: int = 8
    failures: int = 5
    silent_failures: int = 1
    join: bool = True
    steady_s: float = 8.0
    step_s: float = 2.0
    heartbeat_s: float = 0.5  # RecoveryOptions' defaults
    heartbeat_timeout_s: float = 5.0
    standins: int = 2  # 0: stand-ins as threads of this process (tests)
    profile: bool = False
    event_timeout_s: float = 120.0
    prepare: bool = True  # the provider is repeatable (a plan library): the coordinator asks it at the abort

    def check(self) -> None:
        for name, value in (("--ranks", self.ranks), ("--ranks-per-node", self.ranks_per_node),
                            ("--stages", self.num_stages), ("--microbatches", self.num_microbatches)):
            if value < 1:
                raise SystemExit(f"error: {name} {value} must be at least 1")
        if self.ranks % self.ranks_per_node or self.ranks % self.num_stages:
            raise SystemExit(f"error: --ranks {self.ranks} must be a multiple of --ranks-per-node "
                             f"{self.ranks_per_node} and of --stages {self.num_stages}")
        replicas = self.ranks // self.num_stages
        if replicas < 2 + self.failures + self.silent_failures:
            # Each failure takes a pipeline of its own, never replica 0's; the node loss takes another.
            raise SystemExit(f"error: --ranks {self.ranks} / --stages {self.num_stages} = {replicas} replicas per "
                             f"stage, fewer than the {2 + self.failures + self.silent_failures} that --failures "
                             f"{self.failures} and --silent-failures {self.silent_failures} need (one pipeline each, "
                             "plus replica 0 and the lost node's); use more ranks or fewer failures")


class _Cluster:
    """The coordinator (this process: store server thread + supervisor thread) and its stand-in nodes."""

    def __init__(self, settings: Settings) -> None:
        self.settings = s = settings
        self.nnodes = s.ranks // s.ranks_per_node
        config = bench_config(s.ranks // s.num_stages, s.num_stages, s.num_microbatches)
        started = time.perf_counter()
        self.base = build_schedule(config, "gpipe")
        self.setup_plan_s = time.perf_counter() - started
        live = self.base.live_ranks()
        self.node_of: dict[int, int] = {}
        groups: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in range(max(1, s.standins))]
        for node in range(self.nnodes):
            ranks = tuple(node_ranks(live, self.nnodes, node))
            groups[node * len(groups) // self.nnodes].append((node, ranks))
            self.node_of.update({r: node for r in ranks})
        # Who fails, in order (each kill and freeze a pipeline of its own, then the lost node), and so the failure
        # sets the run meets: their plans go into the library before the run, as a user's plan store holds its own.
        used: set[int] = set()
        self.kills = [_pick(s, used, i) for i in range(s.failures)]
        self.freezes = [_pick(s, used, s.failures + i) for i in range(s.silent_failures)]
        taken = {self.node_of[r] for r in used}
        self.lost_node = next(n for n in range(self.nnodes - 1, 0, -1) if n not in taken)
        self.failed_by_us: set[int] = set()  # the ranks the benchmark has failed so far
        states: list[frozenset[tuple[int, int]]] = []
        for rank in self.kills + self.freezes:
            states.append((states[-1] if states else frozenset()) | {self.base.worker(rank)})
        if s.join:
            lost = {self.base.worker(r) for r in node_ranks(live, self.nnodes, self.lost_node)}
            states.append((states[-1] if states else frozenset()) | lost)
        started = time.perf_counter()
        self.provider = LibraryProvider(bench_library(self.base, states), repeatable=s.prepare)
        self.setup_library_s = time.perf_counter() - started
        token = new_token()
        self.server: StoreServer = host_store("127.0.0.1", 0, token)
        self.store = CoordinatorStore(self.server.data, 120.0)
        options = LaunchOptions(
            steps=END_STEP, progress=None, plan_provider=self.provider,
            recovery=RecoveryOptions(heartbeat_s=s.heartbeat_s, heartbeat_timeout_s=s.heartbeat_timeout_s),
            cluster=ClusterOptions(master_port=self.server.port, nnodes=self.nnodes, token=token, backend="gloo",
                                   coordinator="self"))
        self.workers = _NoLocalWorkers(JobStore(self.store))
        self.supervisor = Supervisor(config, self.base, options, self.store, self.workers, 0, END_STEP, time.time(),
                                     self.server, feed=Supervisor.subscribe(self.server.data))
        self.landed = LandedClock(self.server)
        # The activity timers (trace_activities) go in after the steady window: two thread-CPU clock reads per wrapped
        # call, ~2,200 a second at 16,384 ranks, took a tenth of the steady supervisor thread's samples (py-spy).
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._supervise, daemon=True, name="coordinator")
        self.profile_dir = tempfile.mkdtemp(prefix="standin-profile-") if s.profile and s.standins else ""
        self.specs = [NodesSpec("127.0.0.1", self.server.port, token, tuple(g), s.num_stages, s.heartbeat_s,
                                s.step_s, niceness=5 if s.standins else 0, heartbeat_timeout_s=s.heartbeat_timeout_s,
                                profile_path=os.path.join(self.profile_dir, f"{i}.prof") if self.profile_dir else "")
                      for i, g in enumerate(groups)]
        self.links: list[Any] = []
        self.standins: list[Any] = []

    def _supervise(self) -> None:
        try:
            self.supervisor.run()
        except _Stop:
            pass
        except BaseException as exc:  # reported by the benchmark's waits
            self.error = exc

    def start(self) -> None:
        self.thread.start()
        context = mp.get_context("spawn")
        for spec in self.specs:
            mine, theirs = context.Pipe()
            if self.settings.standins:
                process: Any = context.Process(target=standin_main, args=(spec, theirs), daemon=True)
            else:
                process = threading.Thread(target=lambda sp=spec, c=theirs: StandInNodes(sp).run(c), daemon=True)
            process.start()
            self.links.append(mine)
            self.standins.append(process)
        for link in self.links:
            if not link.poll(120.0):
                raise RuntimeError("a stand-in did not start within 120 s")
            assert link.recv()[0] == "ready"

    def ask(self, node: int, *command: Any) -> dict[str, Any]:
        link = self.links[next(i for i, spec in enumerate(self.specs) if node in dict(spec.ranks_of))]
        link.send(command)
        kind, reply = link.recv()
        assert kind == "done", kind
        return reply

    def stats(self) -> tuple[dict[str, float], dict[str, float], list[dict[str, Any]]]:
        """Every stand-in's requests sent and due by kind (summed), and their events."""
        sent: dict[str, float] = {}
        due: dict[str, float] = {}
        events: list[dict[str, Any]] = []
        for s, d, e, _ in self.each_stats():
            for k, v in s.items():
                sent[k] = sent.get(k, 0) + v
            for k, v in d.items():
                due[k] = due.get(k, 0) + v
            events += e
        return sent, due, events

    def each_stats(self) -> list[tuple[dict[str, float], dict[str, float], list[dict[str, Any]], float]]:
        """Per stand-in: requests sent and due by kind, events, and the time its counts are up to."""
        replies = []
        for link in self.links:
            link.send(("stats",))
            _, sent, due, events, at = link.recv()
            replies.append((sent, due, events, at))
        return replies

    def wait_for(self, what: str, condition: Callable[[], bool]) -> None:
        deadline = time.time() + self.settings.event_timeout_s
        while not condition():
            if self.error is not None:
                raise RuntimeError(f"the coordinator failed while waiting for {what}: {self.error}") from self.error
            if time.time() > deadline:
                raise RuntimeError(f"timed out after {self.settings.event_timeout_s:g} s waiting for {what} "
                                   f"({self._state_now()})")
            time.sleep(0.005)

    def _state_now(self) -> str:
        """Where the coordinator stands, for a phase that never ended (which side stopped moving)."""
        state, supervisor = self.supervisor.coordinator.state, self.supervisor
        pending = supervisor.pending.facts.generation if supervisor.pending is not None else None
        return (f"coordinator: generation {state.generation}, recovering {state.recovering}, recovery being "
                f"reported {pending}, {len(state.live)} live, joining {sorted(state.joining)}, next step "
                f"{supervisor.coordinator.next_step}, {self.recoveries()} recoveries reported")

    def recoveries(self) -> int:
        return len(self.supervisor.reporter.recoveries)

    def settled(self, reported: int) -> Callable[[], bool]:
        """Whether more than `reported` recoveries are reported and none is under way: an announcement is in the
        store a moment before the supervisor takes up its recovery, so the announcement alone does not say it."""
        def done() -> bool:
            state = self.supervisor.coordinator.state
            return self.recoveries() > reported and not state.recovering and self.supervisor.pending is None
        return done

    def trace_activities(self) -> None:
        """Time the supervisor thread's activities from now on (SupervisorTrace): the failures' CPU breakdown."""
        self.store.trace = SupervisorTrace(self.supervisor)

    def stop(self) -> None:
        for link in self.links:
            try:
                link.send(("stop",))
                link.poll(10.0)
            except (BrokenPipeError, EOFError, OSError):
                pass
        for process in self.standins:
            process.join(10.0)
        if self.profile_dir:
            out = io.StringIO()
            for spec in self.specs:
                if os.path.exists(spec.profile_path):
                    pstats.Stats(spec.profile_path, stream=out).sort_stats("tottime").print_stats(15)
            print("cProfile (process CPU time) of each stand-in's loop thread over the whole run, by own time:\n"
                  + out.getvalue(), flush=True)
        self.store.stopping.set()
        self.thread.join(10.0)
        self.landed.close()  # (its socket pair: nothing was queued on it)
        self.server.close()


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _steady(cluster: _Cluster, seconds: float) -> dict[str, Any]:
    """Counters over a window in which nothing fails."""
    workers, server = cluster.workers, cluster.server
    before = cluster.each_stats()
    requests0, calls0, ticks0, busy0 = server.requests, cluster.store.calls, workers.ticks, workers.busy_cpu_s
    steps0 = cluster.supervisor.reporter.steps_reported
    assert server._thread is not None
    cpu0, server_cpu0, wall0 = _thread_cpu_s(cluster.thread), _thread_cpu_s(server._thread), time.perf_counter()
    process0 = time.process_time()  # this thread only sleeps meanwhile: the rest is the coordinator's process
    collector = GcClock()
    time.sleep(seconds)
    collector.close()
    wall = time.perf_counter() - wall0
    cpu, server_cpu = _thread_cpu_s(cluster.thread) - cpu0, _thread_cpu_s(server._thread) - server_cpu0
    process = time.process_time() - process0
    ticks = workers.ticks - ticks0
    remote, local = server.requests - requests0, cluster.store.calls - calls0
    served = remote + local
    after = cluster.each_stats()  # after the counts: at 16,384 ranks a stand-in answers only between passes
    # What the protocol asks of the stand-ins per second, each over its own clock; a watcher's wait per beat is
    # counted though the stand-ins wait once for all their workers.
    offered_remote = 0.0
    sent_polls = due_polls = 0.0
    for (sent0, due0, _, at0), (sent1, due1, _, at1) in zip(before, after):
        due = {k: due1.get(k, 0) - due0.get(k, 0) for k in due1}
        sent = {k: sent1.get(k, 0) - sent0.get(k, 0) for k in sent1}
        if at1 > at0:
            offered_remote += (due.get("watch", 0) + due.get("node", 0) + sent.get("metrics", 0)) / (at1 - at0)
        sent_polls += sent.get("node", 0)
        due_polls += due.get("node", 0)
    offered = offered_remote + local / wall
    return {
        "window_s": wall, "store_ops_per_s": served / wall, "offered_store_ops_per_s": offered,
        "coordinator_store_ops_per_s": local / wall,
        "coordinator_cpu_fraction": cpu / wall, "store_server_cpu_fraction": server_cpu / wall,
        "coordinator_process_cpu_fraction": process / wall if cluster.settings.standins else None,
        "gc_cpu_fraction": sum(collector.cpu_s) / wall, "gc_collections": collector.collections,
        "coordinator_ticks_per_s": ticks / wall,
        # The server thread's CPU per request it served, and so the cores the protocol's requests would take it.
        "store_server_us_per_request": 1e6 * server_cpu / remote if remote else None,
        "store_server_cores_asked": offered_remote * server_cpu / remote if remote else None,
        "coordinator_cpu_ms_per_tick": 1e3 * (workers.busy_cpu_s - busy0) / ticks if ticks else None,
        "steps_reported": cluster.supervisor.reporter.steps_reported - steps0,
        "stand_in_lag": 1.0 - sent_polls / due_polls if due_polls else 0.0,
    }


def _profile(cluster: _Cluster, seconds: float, top: int = 22) -> str:
    ticks0 = _profile_start(cluster)
    time.sleep(seconds)
    ticks, text = _profile_stop(cluster, ticks0, top)
    return (f"cProfile (thread CPU time) of the supervisor thread over {seconds:g} s ({ticks} ticks; divide ncalls "
            "and cumtime by it for one tick), the recycle calls by cumulative time, then every call by own time:\n"
            + text)


def _profile_start(cluster: _Cluster) -> int:
    workers = cluster.workers
    workers.profile_wanted = True
    ticks0 = workers.ticks
    cluster.wait_for("the profiler to start", lambda: workers.profiler is not None)
    return ticks0


def _profile_stop(cluster: _Cluster, ticks0: int, top: int = 22) -> tuple[int, str]:
    workers = cluster.workers
    workers.profile_wanted = False
    ticks = max(1, workers.ticks - ticks0)
    cluster.wait_for("the profiler to stop", lambda: workers.ticks > ticks0 + ticks)
    assert workers.profiler is not None
    out = io.StringIO()
    stats = pstats.Stats(workers.profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(r"recycle|json", top)
    stats.sort_stats("tottime").print_stats(12)
    workers.profiler = None
    return ticks, out.getvalue()


def _wait_announced(cluster: _Cluster, after: int, condition: Callable[[Announcement], bool]) -> tuple[float, int]:
    """The first announcement of a generation above `after` that satisfies `condition`: (time, generation)."""
    found: list[tuple[float, int]] = []

    def check() -> bool:
        for generation, (when, record) in sorted(cluster.store.announcements.items()):
            if generation > after and condition(record):
                found.append((when, generation))
                return True
        return False

    cluster.wait_for(f"an announcement after generation {after}", check)
    return found[0]


def _pick(s: Settings, used: set[int], index: int) -> int:
    """A live worker for failure `index`: spread over stages, nodes and stand-ins, never the same pipeline twice."""
    D, S = s.ranks // s.num_stages, s.num_stages
    replicas = {r // S for r in used}
    for k in range(D):
        replica = (1 + (index * 2 * D) // max(1, s.failures + s.silent_failures + 2) + k) % D
        if replica not in replicas and replica != 0:
            rank = replica * S + index % S
            used.add(rank)
            return rank
    raise RuntimeError("no live replica left to fail")


def _unplanned_losses(cluster: _Cluster) -> None:
    """Stop the run if the coordinator lost workers the benchmark did not fail: stand-ins that fell behind their
    heartbeats on an overloaded machine (at 16,384 ranks, hundreds of nodes at once). What follows is a mass
    failure of the benchmark's making, not the protocol's timing."""
    state = cluster.supervisor.coordinator.state
    lost = set(range(cluster.settings.ranks)) - state.live - state.done - cluster.failed_by_us
    if lost:
        nodes = sorted({cluster.node_of[r] for r in lost})
        raise RuntimeError(f"the coordinator declared {len(lost)} workers on {len(nodes)} nodes lost that the "
                           f"benchmark did not fail (nodes {nodes[:5]}...): their stand-in fell behind its heartbeats "
                           "(an overloaded machine); the measurements stop here")


def _failure(cluster: _Cluster, rank: int, command: str) -> dict[str, Any]:
    generation = cluster.supervisor.coordinator.state.generation
    calls_before, reported = len(cluster.provider.calls), cluster.recoveries()
    cluster.failed_by_us.add(rank)
    reply = cluster.ask(cluster.node_of[rank], command, rank)
    when, announced = _wait_announced(cluster, generation, lambda a: rank not in a.live)
    cluster.wait_for("the recovery to complete", cluster.settled(reported))
    settled = time.time()  # every worker's start records are in (nodes' NodeStarted digests) and it is reported
    _unplanned_losses(cluster)
    written = cluster.store.written
    # The provider's call whose plan was announced: the last one (the coordinator asks a repeatable provider at the
    # abort, while the reports come in, and again only if the failed set changed by the announcement).
    asked = len(cluster.provider.calls) > calls_before
    plan_start, plan_end = cluster.provider.calls[-1] if asked else (when, when)
    # The supervisor thread's CPU time from the plan in hand (or, when it was asked for before, from the start of
    # the announcement's work: Supervisor._announce) to the announcement (its wall time, less what the thread waited
    # for a core or the GIL: the store server thread of its process, the stand-ins).
    plan_cpu = cluster.provider.ended_cpu[-1] if asked else None
    announced_cpu = cluster.store.announced_cpu.get(announced)
    trace = cluster.store.trace
    if trace is not None and announced_cpu is not None:
        started = max((cpu for cpu in trace.announce_started if cpu <= announced_cpu), default=None)
        if started is not None and (plan_cpu is None or plan_cpu < started):
            plan_cpu = started  # the plan was in hand when the announcement's work began
    abort = written.get(Keys.abort(generation), when)
    _, _, events = cluster.stats()
    noticed = [e["time"] for e in events if e["kind"] == "stopped" and e["generation"] == generation]
    sent = [e["time"] for e in events if e["kind"] == "reports_sent" and e["generation"] == generation]
    flag = cluster.landed.first(Keys.exited(rank) if command == "kill" else Flags.SILENT.name(rank))
    landed = (cluster.landed.last_under(f"stopped/{generation}/"),
              cluster.landed.last_under(f"node_stopped/{generation}/"))
    reports = max((t for t in landed if t is not None), default=None)
    return {"rank": rank, "failed_at": reply.get("time", reply.get("last_beat")), "announced": when, "settled": settled,
            "flag_landed": flag if flag is not None else abort,
            "last_report_landed": reports if reports is not None else abort,
            "generation": announced, "abort": abort, "noticed": max(noticed, default=abort),
            "reports_sent": max(sent, default=abort), "plan_start": plan_start, "plan_end": plan_end,
            "plan_stored": max((t for k, t in written.items() if k.startswith(f"gen{announced}/plan/")), default=when),
            "plan_to_announce_cpu": announced_cpu - plan_cpu if plan_cpu is not None and announced_cpu is not None
            else None,
            "abort_to_announce_cpu_ms": cluster.store.trace.between(Keys.abort(generation), f"announce/{announced}")
            if cluster.store.trace is not None else None,
            "rss_mb": _rss_mb(), "store_keys": cluster.server.data.num_keys()}


def _rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory now (the coordinator's: store server and supervisor), or with "VmHWM" its
    peak so far. (Both from /proc: getrusage's ru_maxrss can lag the VmRSS read just before it.)"""
    with open("/proc/self/status") as status:
        return next((int(line.split()[1]) / 1024 for line in status if line.startswith(field + ":")), 0.0)


def run_size(settings: Settings, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every measurement at one size; the dict is one entry of the JSON's `runs`."""
    settings.check()
    s = settings
    cluster = _Cluster(s)
    result: dict[str, Any] = {"ranks": s.ranks, "nodes": cluster.nnodes, "ranks_per_node": s.ranks_per_node,
                              "num_stages": s.num_stages, "num_replicas": s.ranks // s.num_stages,
                              "setup_plan_s": cluster.setup_plan_s, "setup_library_s": cluster.setup_library_s,
                              "step_s": s.step_s,
                              "heartbeat_s": s.heartbeat_s, "heartbeat_timeout_s": s.heartbeat_timeout_s,
                              "standins": s.standins, "load_average": os.getloadavg()[0]}
    exits: list[dict[str, Any]] = []
    silent: list[dict[str, Any]] = []
    try:
        started = time.perf_counter()
        cluster.start()
        cluster.wait_for("the first two steps", lambda: cluster.supervisor.reporter.steps_reported >= 2)
        result["start_s"] = time.perf_counter() - started
        log(f"[{s.ranks} ranks] running: {cluster.nnodes} stand-in nodes, first steps reported after "
            f"{result['start_s']:.1f} s; steady window {s.steady_s:g} s")
        result.update(_steady(cluster, s.steady_s))
        log(f"[{s.ranks} ranks] steady: coordinator CPU {result['coordinator_cpu_fraction']:.3f} of a core, "
            f"{result['coordinator_cpu_ms_per_tick'] or 0:.1f} ms per tick; store {result['store_ops_per_s']:,.0f} "
            f"ops/s served, {result['offered_store_ops_per_s']:,.0f} asked")
        if s.profile:
            result["profile"] = _profile(cluster, s.steady_s)
            log(result["profile"])
        cluster.trace_activities()
        ticks0 = _profile_start(cluster) if s.profile else 0
        for i, rank in enumerate(cluster.kills):
            exits.append(_failure(cluster, rank, "kill"))
            log(f"[{s.ranks} ranks] kill {i + 1}/{s.failures}: {_phases(exits[-1])}")
            time.sleep(min(s.step_s, 1.0))
        if s.profile:
            _, text = _profile_stop(cluster, ticks0, 40)
            result["profile_kills"] = text
            log(f"cProfile (thread CPU time) of the supervisor thread over the {s.failures} kills and their "
                f"recoveries (and {min(s.step_s, 1.0):g} s after each):\n{text}")
        for i, rank in enumerate(cluster.freezes):
            silent.append(_failure(cluster, rank, "freeze"))
            log(f"[{s.ranks} ranks] freeze {i + 1}/{s.silent_failures} (from its last beat): {_phases(silent[-1])}")
        if s.join:
            _node_loss_and_join(cluster, log, result)
        _, _, events = cluster.stats()
        plan_bytes = [e["plan_bytes"] for e in events if e["kind"] == "resumed"]
        result["plan_bytes"] = max(plan_bytes) if plan_bytes else None
        result["recoveries"] = len(cluster.supervisor.reporter.recoveries)
    except RuntimeError as exc:  # what ran is still reported, with why the rest did not
        result["error"] = str(exc)
        log(f"[{s.ranks} ranks] stopped early: {exc}")
    finally:
        result.update(_failure_summary(exits, silent, s.heartbeat_timeout_s))
        cluster.stop()
        # This process is the coordinator's (store server and supervisor threads; the benchmark's own thread holds
        # little): its peak resident memory so far (over every --ranks of one invocation).
        result["coordinator_peak_rss_mb"] = _rss_mb("VmHWM")
    return result


def _phases(row: dict[str, Any]) -> str:
    """One failure's recovery, phase by phase, for the log."""
    failed, abort, noticed, sent = row["failed_at"], row["abort"], row["noticed"], row["reports_sent"]
    return (f"announced after {row['announced'] - failed:.3f} s (abort {abort - failed:.3f} s, last stand-in saw it "
            f"{noticed - abort:.3f} s later, its reports sent {sent - noticed:.3f} s later and in the store "
            f"{row['last_report_landed'] - sent:.3f} s later; coordinator RSS after it {row['rss_mb']:.0f} MB, "
            f"{row['store_keys']:,} keys in the store; plan asked {row['plan_start'] - abort:.3f} s after the "
            f"abort, for {row['plan_end'] - row['plan_start']:.3f} s; the coordinator thread's CPU from the abort to "
            "the "
            f"announcement, ms: {_cpu_text(row.get('abort_to_announce_cpu_ms'))})")


def _cpu_text(spent: dict[str, float] | None) -> str:
    if not spent:
        return "-"
    ticks = spent.get("ticks")
    return ", ".join(f"{name.strip('_')} {ms:.0f}" for name, ms in spent.items() if name != "ticks") + \
        ("" if ticks is None else f"; in {ticks:.0f} passes of its loop")


def _plan_on_path(row: dict[str, Any]) -> float:
    """The part of the provider's call after the last stop report landed (asked at the abort, it is mostly before)."""
    return max(0.0, row["plan_end"] - max(row["plan_start"], row["last_report_landed"]))


def _coordinator_part(row: dict[str, Any]) -> float:
    return (row["abort"] - row["flag_landed"]) + (row["announced"] - row["last_report_landed"])


def _failure_summary(exits: list[dict[str, Any]], silent: list[dict[str, Any]], timeout_s: float) -> dict[str, Any]:
    def med(key: Callable[[dict[str, Any]], float], rows: list[dict[str, Any]]) -> float | None:
        return _median([key(r) for r in rows])

    return {
        "detect_to_announce_s": med(lambda r: r["announced"] - r["failed_at"], exits),
        # The coordinator's own part: from the exit flag in the store to its abort, plus from the last stop report
        # in the store to the announcement (reading the reports, the plan provider, the views, the announcement).
        # Left out: the survivors seeing the abort and writing their reports (stand-ins on this machine's cores).
        "coordinator_announce_s": med(_coordinator_part, exits),
        "coordinator_announce_max_s": max(map(_coordinator_part, exits), default=None),
        "coordinator_announce_without_plan_s": med(lambda r: _coordinator_part(r) - _plan_on_path(r), exits),
        "flag_landed_to_abort_s": med(lambda r: r["abort"] - r["flag_landed"], exits),
        "abort_to_last_report_landed_s": med(lambda r: r["last_report_landed"] - r["abort"], exits),
        "last_report_landed_to_announce_s": med(lambda r: r["announced"] - r["last_report_landed"], exits),
        "detect_to_announce_max_s": max((r["announced"] - r["failed_at"] for r in exits), default=None),
        # The recovery's tail: from the announcement until the coordinator has every worker's Joined and Resumed
        # records (the stand-ins' view reads, their nodes' start digests) and has reported the recovery.
        "announce_to_reported_s": med(lambda r: r["settled"] - r["announced"], exits),
        "failures": len(exits),
        "flag_to_abort_s": med(lambda r: r["abort"] - r["failed_at"], exits),
        "abort_to_plan_s": med(lambda r: r["plan_start"] - r["abort"], exits),
        "plan_on_path_s": med(_plan_on_path, exits),
        "abort_seen_s": med(lambda r: r["noticed"] - r["abort"], exits),
        "reports_sent_s": med(lambda r: r["reports_sent"] - r["noticed"], exits),
        "reports_read_s": med(lambda r: r["plan_start"] - r["reports_sent"], exits),
        "plan_s": med(lambda r: r["plan_end"] - r["plan_start"], exits),
        "plan_to_announce_s": med(lambda r: r["announced"] - max(r["plan_end"], r["last_report_landed"]), exits),
        "plan_to_announce_cpu_s": _median([r["plan_to_announce_cpu"] for r in exits
                                           if r["plan_to_announce_cpu"] is not None]),
        "control_plane_s": med(lambda r: r["announced"] - r["failed_at"] - _plan_on_path(r), exits),
        # The supervisor thread's CPU from the abort to the announcement, by activity (SupervisorTrace), median.
        "abort_to_announce_cpu_ms": {name: _median([r["abort_to_announce_cpu_ms"].get(name, 0.0) for r in exits
                                                    if r.get("abort_to_announce_cpu_ms")])
                                     for name in ("total",) + SupervisorTrace.ACTIVITIES + ("ticks",)}
        if exits else None,
        "silent_detect_to_announce_s": med(lambda r: r["announced"] - r["failed_at"], silent),
        "silent_beyond_timeout_s": med(lambda r: r["announced"] - r["failed_at"] - timeout_s, silent),
        "silent_abort_beyond_timeout_s": med(lambda r: r["abort"] - r["failed_at"] - timeout_s, silent),
        # After each recovery, in order (kills, then frozen workers): the coordinator process's resident memory and
        # the store's keys.
        "rss_after_each_failure_mb": [round(r["rss_mb"], 1) for r in exits + silent],
        "store_keys_after_each_failure": [r["store_keys"] for r in exits + silent],
    }


def _node_loss_and_join(cluster: _Cluster, log: Callable[[str], None], result: dict[str, Any]) -> None:
    """A whole node goes silent (launcher and workers), is declared dead, then comes back repaired: its workers
    re-join as replacements (into `result` as each is measured)."""
    s = cluster.settings
    node = cluster.lost_node
    ranks = set(node_ranks(cluster.base.live_ranks(), cluster.nnodes, node))
    generation, reported = cluster.supervisor.coordinator.state.generation, cluster.recoveries()
    cluster.failed_by_us.update(ranks)
    down = cluster.ask(node, "node_down", node)
    when, _ = _wait_announced(cluster, generation, lambda a: not ranks & set(a.live))
    result["node_detect_to_announce_s"] = when - down["last_beat"]
    result["node_beyond_timeout_s"] = when - down["last_beat"] - s.heartbeat_timeout_s
    cluster.wait_for("the recovery from the node loss", cluster.settled(reported))
    _unplanned_losses(cluster)
    log(f"[{s.ranks} ranks] node {node} silent: its last worker out of the generation "
        f"{when - down['last_beat']:.3f} s after its last beats")
    time.sleep(min(s.step_s, 1.0))
    generation, reported = cluster.supervisor.coordinator.state.generation, cluster.recoveries()
    up = cluster.ask(node, "node_up", node)
    admitted, _ = _wait_announced(cluster, generation, lambda a: ranks <= set(a.live))
    result["join_s"] = admitted - up["ready"]
    cluster.wait_for("the join to complete", cluster.settled(reported))
    log(f"[{s.ranks} ranks] node {node} repaired: its {len(ranks)} workers admitted {admitted - up['ready']:.3f} s "
        "after they said they were ready")


# -- output ------------------------------------------------------------------------------------------------------
def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}{unit}" if abs(value) < 100 else f"{value:,.0f}{unit}"
    return f"{value}{unit}"


ROWS = [
    ("failure (exit flag) -> announce, median", "detect_to_announce_s", " s"),
    ("announce -> every worker's start records in, reported", "announce_to_reported_s", " s"),
    ("  ... max", "detect_to_announce_max_s", " s"),
    ("the coordinator's own part of it, median", "coordinator_announce_s", " s"),
    ("  ... max", "coordinator_announce_max_s", " s"),
    ("  ... of which not the plan provider", "coordinator_announce_without_plan_s", " s"),
    ("  flag in the store -> abort written", "flag_landed_to_abort_s", " s"),
    ("  abort -> the last stop report in the store", "abort_to_last_report_landed_s", " s"),
    ("  last stop report in the store -> announced", "last_report_landed_to_announce_s", " s"),
    ("  flag -> abort written (detection)", "flag_to_abort_s", " s"),
    ("  abort -> plan asked", "abort_to_plan_s", " s"),
    ("    abort -> the last stand-in sees it", "abort_seen_s", " s"),
    ("    -> its stopped reports are all sent", "reports_sent_s", " s"),
    ("    -> the coordinator has read them all", "reports_read_s", " s"),
    ("  plan provider's call", "plan_s", " s"),
    ("    ... of it after the last stop report landed", "plan_on_path_s", " s"),
    ("  plan and last report in -> announced (views + store)", "plan_to_announce_s", " s"),
    ("    ... CPU of the announcement's work (supervisor)", "plan_to_announce_cpu_s", " s"),
    ("  control plane alone (without the plan on the path)", "control_plane_s", " s"),
    ("frozen worker: announce after the heartbeat timeout", "silent_beyond_timeout_s", " s"),
    ("  its abort after the heartbeat timeout (detection)", "silent_abort_beyond_timeout_s", " s"),
    ("silent node: announce after the heartbeat timeout", "node_beyond_timeout_s", " s"),
    ("repaired node: ready -> admitted (join_s)", "join_s", " s"),
    ("steady: store ops/s served", "store_ops_per_s", ""),
    ("steady: store ops/s the protocol asks", "offered_store_ops_per_s", ""),
    ("steady: stand-ins behind their schedule", "stand_in_lag", ""),
    ("steady: coordinator's own store calls/s", "coordinator_store_ops_per_s", ""),
    ("steady: coordinator CPU (fraction of a core)", "coordinator_cpu_fraction", ""),
    ("steady: its process (+ store server, GC) CPU", "coordinator_process_cpu_fraction", ""),
    ("steady: of which the garbage collector", "gc_cpu_fraction", ""),
    ("steady: coordinator CPU per tick", "coordinator_cpu_ms_per_tick", " ms"),
    ("steady: coordinator ticks/s", "coordinator_ticks_per_s", ""),
    ("steady: store server thread CPU (fraction)", "store_server_cpu_fraction", ""),
    ("steady: store server CPU per request", "store_server_us_per_request", " us"),
    ("steady: server cores the protocol's requests need", "store_server_cores_asked", ""),
    ("a worker's plan view (largest)", "plan_bytes", " B"),
    ("the coordinator process's peak resident memory", "coordinator_peak_rss_mb", " MB"),
]


def table(runs: list[dict[str, Any]]) -> str:
    head = f"{'':52}" + "".join(f"{str(r['ranks']) + ' ranks':>16}" for r in runs)
    lines = [head, "-" * len(head)]
    for label, key, unit in ROWS:
        lines.append(f"{label:52}" + "".join(f"{_fmt(r.get(key), unit):>16}" for r in runs))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, action="append", help="workers in the job (repeatable)")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--failures", type=int, default=5, help="worker exits (their node raises the EXITED flag)")
    parser.add_argument("--silent-failures", type=int, default=1, help="frozen workers (their heartbeat stops)")
    parser.add_argument("--no-join", action="store_true", help="skip the node loss and the repaired node's join")
    parser.add_argument("--steady-s", type=float, default=8.0)
    parser.add_argument("--step-s", type=float, default=2.0)
    parser.add_argument("--heartbeat-s", type=float, default=RecoveryOptions.heartbeat_s)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=RecoveryOptions.heartbeat_timeout_s)
    parser.add_argument("--standins", type=int, default=2, help="stand-in processes (0: threads of this process)")
    parser.add_argument("--profile", action="store_true", help="cProfile the supervisor over a second window")
    parser.add_argument("--event-timeout-s", type=float, default=120.0, help="give up on a phase after this long")
    parser.add_argument("--no-prepare", action="store_true", help="ask the plan provider at the announcement only "
                        "(as a provider that is not repeatable), not at the abort")
    args = parser.parse_args(argv)
    runs = []
    for ranks in args.ranks or [1024]:
        settings = Settings(ranks, args.ranks_per_node, args.stages, args.microbatches, args.failures,
                            args.silent_failures, not args.no_join, args.steady_s, args.step_s, args.heartbeat_s,
                            args.heartbeat_timeout_s, standins=args.standins, profile=args.profile,
                            event_timeout_s=args.event_timeout_s, prepare=not args.no_prepare)
        started = time.perf_counter()
        run = run_size(settings, log=lambda line: print(line, flush=True))
        run["wall_s"] = time.perf_counter() - started
        runs.append(run)
    print(table(runs))
    for run in runs:
        if "error" in run:
            print(f"{run['ranks']} ranks stopped early: {run['error']}")
    print(json.dumps({"runs": [{k: v for k, v in r.items() if not k.startswith("profile")} for r in runs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
