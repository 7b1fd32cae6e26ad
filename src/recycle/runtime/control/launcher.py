"""The launcher: spawns one process per live worker of its node and follows the coordinator's fences and respawns;
where the coordinator runs (node 0's launcher by default, or `recycle coordinator` alone), it hosts the job's store
and runs the supervisor that keeps the job going when workers die: it detects the failure, fences the worker, picks
the plan for the new failure state and announces the next generation; it also gathers per-step metrics."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from recycle.config import Config
from recycle.errors import ConfigError, RuntimeFailure
from recycle.ir import Plan, validate_plan
from recycle.ir.worker import Worker
from recycle.runtime.control import preflight
from recycle.runtime.control.coordinator import hang_limit_s
from recycle.runtime.control.liveness import Liveness
from recycle.runtime.control.node_digests import DIGESTED_PREFIXES, DigestForwarder
from recycle.runtime.control.node_steps import StepForwarder
from recycle.runtime.control.processes import Spawner, WorkerProcesses, node_ranks, start_context
from recycle.runtime.control.reporter import Recovery, StepMetrics, last_reported_step
from recycle.runtime.control.resync import Rebuilt, collect_hellos, collect_resyncs, is_restart, rebuild
from recycle.runtime.control.stall import StallClock
from recycle.runtime.control.supervisor import Supervisor
from recycle.runtime.control.worker_table import WorkerRow, replacement_line, worker_table
from recycle.runtime.options import ClusterOptions, LaunchOptions, OutputOptions
from recycle.runtime.protocol.channels import (Channels, Flags, JobStore, Keys, connect_store, host_store,
                                               launcher_identity, new_incarnation, new_token)
from recycle.runtime.protocol.messages import check_plan_matches
from recycle.runtime.protocol.records import JobSettings, NodeHello, RecordError
from recycle.runtime.protocol.store import LocalStore, StoreFenced, StoreServer, StoreUnavailable
from recycle.runtime.protocol.store.capacity import connections_needed
from recycle.runtime.protocol.store.data import Feed
from recycle.runtime.state import checkpoint
from recycle.runtime.worker.data import check_data
from recycle.runtime.worker.process import EXIT_FENCED, WorkerSpec
from recycle.runtime.worker.stage import check_model
from recycle.runtime.worker.transport import default_backend

__all__ = ["StepMetrics", "Recovery", "TrainResult", "launch", "node_ranks"]

# A node launcher's wait on the coordinator's word ends this much after its next beat falls due: the store counts
# whole milliseconds, and a wait that ended a hair early would cost a second one of no length.
WAIT_SLACK_S = 0.005


@dataclass(frozen=True)
class TrainResult:
    start_step: int
    end_step: int
    steps: tuple[StepMetrics, ...]
    wall_s: float
    recoveries: tuple[Recovery, ...] = ()
    failed: tuple[tuple[int, int], ...] = ()  # workers down at the end
    chaos_events: tuple[dict[str, Any], ...] = ()  # what --chaos did: time, kind, workers, step


def _check_options(config: Config, plan: Plan, options: LaunchOptions) -> tuple[int, int]:
    """What the options cannot check alone (each sub-config checked its own values): against the config and the
    plan, the model, the outputs and the checkpoint to resume."""
    check_plan_matches(plan, config.num_replicas, config.num_stages, config.num_microbatches,
                       chunks=config.topology.chunks_per_worker, chunk_layout=config.topology.chunk_layout)
    validate_plan(plan)
    end = config.training.steps if options.steps is None else options.steps  # both checked >= 0
    # Catch model and data errors here, with a clear message, rather than in every worker.
    check_model(config, options.model_factory)
    check_data(config, options.model_factory)
    start = preflight.check_launch(config, options, end)  # outputs, checkpoint: before any worker
    if start > end:
        raise ConfigError(f"the checkpoint in {options.checkpoint.resume_dir!r} is at step {start}, past --steps "
                          f"{end}; ask for more steps than {start}")
    return start, end


def launch(config: Config, plan: Plan, options: LaunchOptions = LaunchOptions()) -> TrainResult:
    """Train `config`'s model with `plan` for the requested steps, surviving worker failures when a plan provider
    is given; raise RuntimeFailure when the run cannot continue."""
    with contextlib.nullcontext() if options.cluster.hosts_coordinator else _store_contact(options):
        return _launch(config, plan, options)


def _launch(config: Config, plan: Plan, options: LaunchOptions) -> TrainResult:
    start_step, end_step = _check_options(config, plan, options)
    cluster = options.cluster
    token = cluster.token or new_token()
    store_timeout_s = max(options.recovery.timeout_s, 60.0)
    server: StoreServer | None = None
    feed: Feed | None = None
    store: Any
    if cluster.hosts_coordinator:
        # The coordinator's process serves the store and reads it in-process (no socket, and it cannot be fenced).
        server = host_store(cluster.master_addr, cluster.master_port, token,
                            connections_needed(plan.num_workers * config.topology.gpus_per_worker, cluster.nnodes))
        store, store_port = LocalStore(server.data, store_timeout_s), server.port
        # Before any node can write: the coordinator learns of records and flags from the feed, not by polling.
        feed = Supervisor.subscribe(server.data)
    else:
        # This launcher's connections to the job's store, all under one identity (the follow loop's, the record
        # digests' thread's).
        connect = functools.partial(connect_store, cluster.master_addr, cluster.master_port, token,
                                    launcher_identity(cluster.node_rank, new_incarnation()), store_timeout_s,
                                    connect_timeout_s=store_timeout_s)
        store = connect()
        store_port = cluster.master_port
    # What the workers are told: the store's real port, the job secret and the backend, all settled.
    resolved = replace(cluster, master_port=store_port, token=token, backend=cluster.backend or default_backend())
    mine = node_ranks(plan.live_ranks(), cluster.nnodes, cluster.node_rank) if cluster.runs_workers else []
    wall0 = time.time()
    jobs = JobStore(store)
    rebuilt = None
    if cluster.hosts_coordinator:
        rebuilt = _restarted(jobs, config, plan, options, start_step, end_step)
    else:
        # The first word to the coordinator: it tells a fresh start from its own restart by these.
        jobs.put(Channels.HELLO, NodeHello("fresh"), cluster.node_rank)
    settings = _agree_on_settings(jobs, _job_settings(config, plan, options, end_step), cluster)
    # A node started again while its job runs (a repaired node) brings its workers back as replacements.
    rejoining = not cluster.hosts_coordinator and jobs.is_set(Flags.RUNNING)
    # A node launcher that does not host the coordinator hosts its node's own store: its workers beat there and it
    # watches them itself, so the coordinator's work and its store's traffic grow with the nodes, not the workers.
    node_server = host_store("127.0.0.1", 0, token) if cluster.runs_workers and not cluster.hosts_coordinator \
        else None
    # Its workers' step records come to it there too (before any can write): one record per step to the coordinator.
    forwarder = StepForwarder(cluster.node_rank, LocalStore(node_server.data),
                              node_server.data.subscribe((b"metrics/",))) if node_server is not None else None
    # And their stop reports and start records, which a thread of its own writes on as digests per generation as
    # soon as they are in (on a connection of its own: the follow loop's waits on the coordinator's word hold its
    # connection).
    digests = DigestForwarder(cluster.node_rank, LocalStore(node_server.data),
                              node_server.data.subscribe(DIGESTED_PREFIXES)) if node_server is not None else None
    if digests is not None:
        digests.start(JobStore(connect()))
    spec_for = _spec_maker(config, plan, options, resolved, start_step, end_step, mine,
                           node_server.port if node_server is not None else 0, settings.grad_norm)
    spawner = Spawner(start_context(cluster.start_method), spec_for, plan.worker)
    workers = WorkerProcesses(jobs, spawner)
    finished = False
    try:
        if options.progress and cluster.runs_workers:
            T = config.topology.gpus_per_worker
            processes = f"{len(mine)} worker process(es)" if T == 1 else \
                f"{len(mine)} workers x {T} tensor-parallel ranks = {len(mine) * T} processes (pids below: TP rank 0's)"
            options.progress(f"starting {processes} ({cluster.start_method}): each imports torch "
                             "and builds its stage; step 1 follows when every worker has joined"
                             + (" (this node re-joins a running job)" if rejoining else ""))
        elif options.progress:
            options.progress(f"coordinator: the job's store listens on {cluster.master_addr}:{store_port}; waiting "
                             f"for {cluster.nnodes} training node(s) to start their workers (`recycle train "
                             "--coordinator separate --node-rank R` with the same config and job secret)")
        for rank in mine:
            workers.start(rank, joining=rejoining)
        if options.progress and mine:
            options.progress(f"node {cluster.node_rank}'s workers started (pid -> worker; `ps -o pid,comm` shows "
                             "each as 'recycle R:S'):")
            for line in worker_table([WorkerRow(cluster.node_rank, Worker(*plan.worker(r)), r, workers.pid(r))
                                      for r in mine]):
                options.progress(line)
        if cluster.hosts_coordinator:
            assert feed is not None  # subscribed with the store it serves
            run = Supervisor(config, plan, options, store, workers, start_step, end_step, wall0, server, rebuilt,
                             feed=feed)
            steps, recoveries, failed = run.run()
            chaos_events = [event.record() for event in run.reporter.chaos_events]
        else:
            assert node_server is not None and forwarder is not None and digests is not None
            _follow(jobs, workers, options, plan, NodeWatch(node_server, options), forwarder, digests)
            steps, recoveries, failed, chaos_events = [], [], plan.failed, []
        finished = True
    finally:
        workers.stop()
        spawner.close()
        if server is not None:
            server.close()
        if feed is not None:
            feed.close()
        if forwarder is not None:
            forwarder.feed.close()
        if digests is not None:
            digests.stop()
            digests.feed.close()
        if node_server is not None:
            node_server.close()
        if not finished and options.checkpoint.dir:  # a shard being written when the run failed
            checkpoint.clear_dead_writers(options.checkpoint.dir)
        if not finished and options.outputs.parts_path and cluster.hosts_coordinator:
            for stage in range(plan.num_stages):  # a failed run leaves no half-made --save behind
                checkpoint.part_file(options.outputs.parts_path, stage).unlink(missing_ok=True)
    if options.outputs.parts_path and cluster.hosts_coordinator and end_step > start_step:
        _write_final(config, options.outputs, plan.num_stages, end_step, options.model_factory)
    return TrainResult(start_step, end_step, tuple(steps), time.time() - wall0, tuple(recoveries),
                       tuple(sorted(failed)), tuple(chaos_events))


def _write_final(config: Config, outputs: OutputOptions, num_stages: int, end_step: int, factory: str = "") -> None:
    """--save (the stages' parts merged) and --export-hf (a from_pretrained folder), from the parts the stages'
    writers left; no part outlives this."""
    from recycle.runtime.worker.stage import drop_tied_copies, tied_copy_keys

    try:
        stages = drop_tied_copies(checkpoint.read_stage_parts(outputs.parts_path, num_stages),
                                  tied_copy_keys(config, factory))  # written once, as save_pretrained writes it
        if outputs.save_path:
            checkpoint.write_merged(outputs.save_path, stages, {"step": end_step, "config": config.to_dict()})
        if outputs.export_hf:
            from recycle.models.hf_export import export_hf
            from recycle.runtime.worker.stage import hf_path

            export_hf(hf_path(config), config.workload.seq_len, {k: v for s in stages for k, v in s.items()},
                      outputs.export_hf)
    finally:
        checkpoint.remove_stage_parts(outputs.parts_path, num_stages)


def _restarted(jobs: JobStore, config: Config, plan: Plan, options: LaunchOptions, start_step: int,
               end_step: int) -> Rebuilt | None:
    """A separate coordinator hears from every node first: if their workers train already, it is a restarted one, and
    it rebuilds the run from what the launchers and workers tell its empty store (None: a fresh start)."""
    cluster, recovery = options.cluster, options.recovery
    if cluster.coordinator != "self":
        return None  # node 0's launcher hosts the coordinator: it cannot restart without its node's workers
    window = max(3.0, 2 * recovery.heartbeat_timeout_s)
    hellos = collect_hellos(jobs, cluster.watched_nodes, window, options.progress)
    if not is_restart(hellos):
        return None
    jobs.raise_flag(Flags.RUNNING)  # before the settings: a node launcher that starts now is a repaired one
    alive = frozenset(r for hello in hellos.values() for r in hello.alive)
    resyncs = collect_resyncs(jobs, alive, window)
    metrics = options.outputs.metrics_path
    try:
        rebuilt = rebuild(frozenset(plan.live_ranks()), hellos, resyncs,
                          lambda generation: jobs.read(Channels.ANNOUNCE, generation),
                          _latest_complete(options.checkpoint.dir),
                          start_step, end_step, last_reported_step(metrics) if metrics else None)
    except RecordError as exc:
        raise RuntimeFailure(f"the restarted coordinator cannot take the run over ({exc}); stop the nodes and "
                             "restart the job with --resume from its checkpoint directory") from None
    if options.progress:
        lost = "" if rebuilt.lost_steps is None else \
            (f"; steps {rebuilt.lost_steps[0] + 1}-{rebuilt.lost_steps[1]} ran while no coordinator could record "
             "them (their training stands; their records are lost)")
        options.progress(f"coordinator: took over the run in generation {rebuilt.generation} with "
                         f"{len(rebuilt.live)} live worker(s) ({len(resyncs)} reported, {len(rebuilt.done)} finished), "
                         f"reporting from step {rebuilt.next_step + 1}{lost}")
    return rebuilt


def _latest_complete(root: str) -> int | None:
    """The step of the newest complete checkpoint in --checkpoint-dir `root` (None: none, or no directory)."""
    if not root or not (Path(root) / "latest").is_file():
        return None
    return checkpoint.latest_step(root)


def _job_settings(config: Config, plan: Plan, options: LaunchOptions, end_step: int) -> JobSettings:
    def digest(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()

    return JobSettings(digest(json.dumps(config.to_dict(), sort_keys=True)), digest(plan.to_json()),
                       options.model_factory, end_step, options.outputs.save_path, options.checkpoint.dir,
                       options.checkpoint.every, options.checkpoint.resume_dir, options.outputs.export_hf,
                       options.wants_grad_norm)


def _agree_on_settings(jobs: JobStore, mine: JobSettings, cluster: ClusterOptions) -> JobSettings:
    """The coordinator publishes the run's settings; every node launcher checks its own against them before it
    starts a worker, so that a node started with other flags is refused at once, saying what differs. Returns the
    job's settings (the coordinator's), whose adopted ones the node's workers follow."""
    if cluster.hosts_coordinator:
        jobs.put(Channels.JOB, mine)
        return mine
    job = jobs.get(Channels.JOB)
    differences = mine.differences(job)
    if differences:
        raise ConfigError(f"node {cluster.node_rank} was started with other settings than the job's coordinator "
                          f"({'; '.join(differences)}); start every node, and the coordinator, with the same flags")
    return job


def _spec_maker(config: Config, plan: Plan, options: LaunchOptions, cluster: ClusterOptions, start_step: int,
                end_step: int, mine: list[int], node_store_port: int = 0,
                grad_norm: bool = True) -> Callable[[int, bool], WorkerSpec]:
    """What a worker process of this launcher is told: its rank, the run, and whether it joins a running job
    (a replacement: no resume, no scripted faults); `grad_norm`: the job's (the coordinator's) choice of metric."""
    plan_json = plan.to_json()

    def spec_for(rank: int, joining: bool) -> WorkerSpec:
        return WorkerSpec(
            rank=rank, config=config, plan_json=plan_json, cluster=cluster, start_step=start_step, end_step=end_step,
            model_factory=options.model_factory, outputs=options.outputs, checkpoint=options.checkpoint,
            recovery=options.recovery, debug=options.debug, faults=() if joining else options.faults.of(rank),
            device_index=(mine.index(rank) if rank in mine else rank) % max(torch.cuda.device_count(), 1),
            joining=joining, incarnation=new_incarnation(), node_store_port=node_store_port,
            joiner_dies_at=os.environ.get("RECYCLE_TEST_JOINER_DIES", "") if joining else "", grad_norm=grad_norm)

    return spec_for


class NodeWatch:
    """A node launcher's watch over its own workers' beats (on the node's store, in this process): it tells the
    coordinator about a worker only when it goes silent (frozen) or hangs, once per process, as a SILENT flag."""

    def __init__(self, server: StoreServer, options: LaunchOptions) -> None:
        recovery = options.recovery
        # Once per heartbeat interval, in step with the node's own beat: the launcher's wait on the coordinator's
        # word lasts until the next of the two (its workers' beats are local; only a verdict reaches the store).
        self.liveness = Liveness(JobStore(LocalStore(server.data)), range(0), recovery.heartbeat_s,
                                 recovery.heartbeat_timeout_s, check_every_s=recovery.heartbeat_s)
        self.explicit_hang_s, self.timeout_s = recovery.hang_timeout_s, recovery.timeout_s
        self.told: dict[int, int | None] = {}  # rank -> pid whose silence was told
        self.limit_s: float | None = None  # the hang limit last read from the store
        self.limit_read_at = -math.inf

    def started(self, rank: int) -> None:
        """A new process runs as `rank`: watched from its first beat."""
        self.liveness.forget(rank)
        self.told.pop(rank, None)

    def check(self, jobs: JobStore, workers: WorkerProcesses, now: float) -> None:
        if not self.liveness.due(now):
            return
        running = frozenset(r for r in workers.ranks if workers.exitcode(r) is None)
        causes = [(r, f"stopped responding (no heartbeat for {s:.1f} s; fenced)")
                  for r, s in self.liveness.silent_workers(running, now)]
        # The limit is read again before it condemns a worker (the coordinator may have raised it for a slower
        # plan) and once per heartbeat timeout (it may have lowered it), not on every check.
        if self.limit_s is None or now - self.limit_read_at >= self.liveness.timeout_s or \
                self.liveness.any_hung(running, self.limit_s):
            self.limit_s, self.limit_read_at = self._hang_limit(jobs), now
        limit = self.limit_s
        causes += [(r, f"is hung (its heartbeat goes on, but one action has computed for {s:.1f} s, over the "
                       f"{limit:.1f} s limit; fenced)") for r, s in self.liveness.hung_workers(running, now, limit)]
        for rank, cause in causes:
            if self.told.get(rank, -1) != workers.pid(rank):
                self.told[rank] = workers.pid(rank)
                jobs.raise_flag(Flags.SILENT, rank, text=cause)  # the coordinator learns of it from its store's feed

    def due_in_s(self) -> float:
        """Seconds until the next check is due (<= 0: now)."""
        return self.liveness.next_check - time.time()

    def _hang_limit(self, jobs: JobStore) -> float:
        """The coordinator's limit (it knows the run's step periods), else the one --hang-timeout or the op timeout
        sets before any step."""
        raw = jobs.raw.try_get(Keys.HANG_LIMIT)
        try:
            return float(raw) if raw is not None else hang_limit_s(self.explicit_hang_s, [], self.timeout_s)
        except ValueError:
            return hang_limit_s(self.explicit_hang_s, [], self.timeout_s)


def _follow(jobs: JobStore, workers: WorkerProcesses, options: LaunchOptions, plan: Plan, watch: NodeWatch,
            forwarder: StepForwarder, digests: DigestForwarder) -> None:
    """A node whose coordinator runs elsewhere (node 0's launcher or `recycle coordinator`): hand on its workers'
    step records, report their exits, carry out fences and respawns, stop when the run ends."""
    stalls = StallClock().start()
    try:
        _follow_loop(jobs, workers, options, plan, watch, forwarder, digests, stalls)
    finally:
        stalls.stop()


@contextlib.contextmanager
def _store_contact(options: LaunchOptions) -> Iterator[None]:
    """Around everything a node launcher does with the job's store, from its first connection on (start-up
    included: a repaired node can start while the run ends): a fence or a lost store ends the launch with one line
    that says what happened and what to do. The launch's own clean-up stops the node's workers."""
    node, cluster = options.cluster.node_rank, options.cluster
    where = "node 0" if cluster.coordinator == "node0" else "the coordinator"
    try:
        yield
    except StoreFenced:
        raise RuntimeFailure(f"node {node} was declared dead by the job's coordinator while it did not respond "
                             "(frozen or cut off), and the run went on without it; its workers have been stopped. "
                             "Start this node's launcher again (the same command) to re-join the run as a repaired "
                             "node") from None
    except StoreUnavailable as exc:
        if str(exc).startswith("cannot reach"):  # its first connection: nothing was ever there
            raise RuntimeFailure(f"node {node}: {exc}") from None
        raise _lost(node, where, cluster) from None
    except dist.DistError:
        raise _lost(node, where, cluster) from None


def _lost(node: int, where: str, cluster: ClusterOptions) -> RuntimeFailure:
    return RuntimeFailure(f"node {node} lost contact with the job's store on {where} ({cluster.master_addr}:"
                          f"{cluster.master_port}): the run has ended or {where} is gone")


def _follow_loop(jobs: JobStore, workers: WorkerProcesses, options: LaunchOptions, plan: Plan,
                 watch: NodeWatch, forwarder: StepForwarder, digests: DigestForwarder, stalls: StallClock) -> None:
    """Carry out the coordinator's word for this node's workers. A separate coordinator may die and come back: the
    workers train on meanwhile, and once its store answers again (a new one: it restarted) this launcher says where
    its workers stand and reports their exits again."""
    following = _Following()
    node = options.cluster.node_rank
    grace = options.recovery.coordinator_grace_s if options.cluster.coordinator == "separate" else 0.0
    instance = jobs.raw.try_get(Keys.STORE_INSTANCE)
    away_since: float | None = None
    answered_at = time.monotonic()
    for rank in workers.ranks:
        jobs.lower_flag(Flags.FENCE, rank)
    while True:
        try:
            if away_since is not None:
                now_instance = jobs.raw.try_get(Keys.STORE_INSTANCE)
                restarted = now_instance != instance
                if restarted:  # a restarted coordinator: its store starts empty
                    instance = now_instance
                    following.forget()
                    watch.told.clear()
                    forwarder.resend()
                    digests.resend()
                    codes = workers.exitcodes()
                    jobs.put(Channels.HELLO, NodeHello("running", tuple(r for r in workers.ranks if r not in codes),
                                                       tuple(sorted(codes.items()))), node)
                if options.progress:
                    options.progress(f"node {node}: the job's coordinator answers again after "
                                     f"{time.monotonic() - away_since:.1f} s"
                                     + (" (restarted)" if restarted else ""))
                away_since = None
            started = time.monotonic()
            if _follow_once(jobs, workers, options, plan, following, watch, forwarder, digests, started):
                return
            # Only as fresh as the pass's start: a process frozen mid-call reads, when it wakes, the reply that the
            # store sent before it went away.
            answered_at = started
        except StoreUnavailable:
            now = time.monotonic()
            _check_not_stalled(stalls.longest_since(answered_at), workers, options)
            _check_not_shut_out(workers, options)
            if away_since is None:
                away_since = now
                if grace > 0 and options.progress:
                    options.progress(f"node {node} lost the job's coordinator "
                                     f"({options.cluster.master_addr}:{options.cluster.master_port}); its workers "
                                     f"train on while it waits up to {grace:g} s for the coordinator to be restarted")
            if now - away_since >= grace:
                raise
            workers.wait(0.5)


def _check_not_stalled(stalled_s: float, workers: WorkerProcesses, options: LaunchOptions) -> None:
    """A launcher that did not run (frozen, its VM paused) for longer than the coordinator waits for a silent node,
    and then finds the coordinator gone, has been declared dead: the run went on without it, and may since have
    ended, taking its store along, so nothing will ever tell this node so. It stops its workers and says so instead
    of waiting out --coordinator-grace for a coordinator that is only away."""
    limit = options.recovery.heartbeat_timeout_s
    if stalled_s < limit:
        return
    workers.stop()
    raise _left_behind(options, f"node {options.cluster.node_rank} did not run for {stalled_s:.1f} s (frozen or "
                                f"paused), longer than the {limit:g} s after which the coordinator declares a silent "
                                "node dead", "Its workers have been stopped. ")


def _check_not_shut_out(workers: WorkerProcesses, options: LaunchOptions) -> None:
    """Every worker of this node has ended shut out by the coordinator (fenced: it was told so when the network came
    back, or left out of the run) and the coordinator no longer answers: this launcher, whose own word to the
    coordinator may not have got through before the run ended (a node cut off until then), has nothing left to wait
    for. It says so instead of waiting out --coordinator-grace."""
    codes = workers.exitcodes()
    if not workers.ranks or not set(workers.ranks) <= set(codes) or set(codes.values()) != {EXIT_FENCED}:
        return
    raise _left_behind(options, f"every worker of node {options.cluster.node_rank} was shut out by the job's "
                                "coordinator (fenced while it could not be reached, or left out of the run)")


def _left_behind(options: LaunchOptions, why: str, done: str = "") -> RuntimeFailure:
    """A node that knows the run went on without it and finds the coordinator gone: `why` it knows, `done` what it
    did about its workers, and how to re-join."""
    where = f"{options.cluster.master_addr}:{options.cluster.master_port}"
    return RuntimeFailure(f"{why}, and the job's coordinator at {where} no longer answers: the run went on without "
                          f"this node and may have ended since. {done}If the run is still going, start this node's "
                          "launcher again (the same command) to re-join it as a repaired node")


@dataclass
class _Following:
    """What a node launcher has done about its workers: per rank, the pid whose exit it reported and the pid it was
    told to kill; whether the run has finished."""

    reported: dict[int, int | None] = field(default_factory=dict)
    killed: dict[int, int | None] = field(default_factory=dict)
    finished: bool = False
    beat_at: float = -math.inf  # when this launcher last beat (time.monotonic())

    def forget(self) -> None:
        """A restarted coordinator's store starts empty: report everything again."""
        self.reported.clear()
        self.killed.clear()
        self.finished = False
        self.beat_at = -math.inf


def _beat_every_s(options: LaunchOptions) -> float:
    """How often a node launcher beats: once per heartbeat interval, and at least 4 times in a timeout."""
    return min(options.recovery.heartbeat_s, options.recovery.heartbeat_timeout_s / 4)


def _follow_once(jobs: JobStore, workers: WorkerProcesses, options: LaunchOptions, plan: Plan,
                 following: _Following, watch: NodeWatch, forwarder: StepForwarder, digests: DigestForwarder,
                 now: float) -> bool:
    """One pass over this node's workers, then a wait for the coordinator's word; True when the run is over for this
    node. The word is waited for in the store on its keys (this node's FENCE and RESPAWN flags, the run's end or
    failure): one request per pass, not a poll of every worker's flags."""
    node = options.cluster.node_rank
    # The coordinator tells a frozen or cut-off node by its silence: a beat once per heartbeat interval (at least 4
    # in a timeout), sent with this pass's wait (one request for both). `now`: monotonic.
    beat = None
    if now - following.beat_at >= _beat_every_s(options):
        beat = Keys.node_heartbeat(node)
        following.beat_at = now
    # Before the exits: a worker that finished wrote its last record before it exited, and the coordinator must not
    # see the exit of a member whose last step it has no record of yet.
    forwarder.forward(jobs)
    if digests.error is not None:
        raise digests.error
    # The workers whose records a digest waits for (a hold at most: a frozen one never reports).
    digests.running = frozenset(r for r in workers.ranks if workers.exitcode(r) is None)
    for rank in workers.ranks:
        code = workers.exitcode(rank)
        if code is not None and following.reported.get(rank) != workers.pid(rank):
            jobs.raise_flag(Flags.EXITED, rank, text=str(code))
            following.reported[rank] = workers.pid(rank)
            jobs.lower_flag(Flags.FENCE, rank)
            jobs.lower_flag(Flags.SILENT, rank)
    watch.check(jobs, workers, time.time())
    if following.finished:
        if all(workers.exitcode(r) is not None for r in workers.ranks):
            jobs.raise_flag(Flags.NODE_DONE, node)
            return True
        workers.wait(0.1)
    orders: list[tuple[str, int]] = [("abort", -1)] + ([] if following.finished else [("finished", -1)])
    for rank in workers.ranks:
        running = workers.exitcode(rank) is None
        if running and following.killed.get(rank, -1) != workers.pid(rank):
            orders.append(("fence", rank))
        elif not running:
            orders.append(("respawn", rank))
    keys = [Flags.ABORT_RUN.name() if what == "abort" else Flags.FINISHED.name() if what == "finished" else
            (Flags.FENCE if what == "fence" else Flags.RESPAWN).name(rank) for what, rank in orders]
    if following.finished:
        hit = jobs.raw.wait_any(keys, 0.0, beat=beat)
    else:
        # Until the node's next beat or look at its workers' beats (once per heartbeat interval), cut short when one
        # of its workers ends: one request per interval, not one wait every 0.1 s (docs/cluster.md).
        wait_s = min(following.beat_at + _beat_every_s(options) - time.monotonic(), watch.due_in_s())
        hit = jobs.raw.wait_any(keys, max(0.0, wait_s) + WAIT_SLACK_S, wake=workers.running_sentinels(), beat=beat)
    if hit is None:
        return False
    what, rank = orders[hit]
    if what == "abort":
        workers.stop()
        raise RuntimeFailure(jobs.flag_text(Flags.ABORT_RUN) or "the run failed")
    if what == "finished":
        following.finished = True
    elif what == "fence":
        following.killed[rank] = workers.pid(rank)
        workers.signal(rank, signal.SIGKILL)
    else:
        reason = jobs.flag_text(Flags.RESPAWN, rank) or ""
        jobs.lower_flag(Flags.RESPAWN, rank)
        watch.started(rank)
        pid = workers.start(rank, joining=True)
        if options.progress:
            options.progress(replacement_line(WorkerRow(node, Worker(*plan.worker(rank)), rank, pid), reason))
    return False
