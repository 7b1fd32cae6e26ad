"""Node 0's supervisor: turns worker processes and store keys into the coordinator's facts, carries out its commands
and hands steps and recoveries to the reporter."""

from __future__ import annotations

import gc
import os
import signal
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, NoReturn, TypeVar

from recycle.collector import collector_paused
from recycle.config import Config
from recycle.errors import RuntimeFailure
from recycle.ir import Plan, PlanChoice
from recycle.ir.completion import Completion, CompletionViews, WorkerProgress, complete_iteration
from recycle.ir.worker import Worker
from recycle.ir.worker_view import PlanViews
from recycle.runtime.control.coordinator import (AbortGeneration, Announce, Command, Coordinator, Drain, FailRun, Fence,
                                                 MarkLatest, Move, RecoveryFacts, Respawn, describe_exit, hang_limit_s)
from recycle.runtime.control.liveness import NODE_BEATS, Liveness, node_beats_from
from recycle.runtime.control.node_steps import HeldSteps
from recycle.runtime.control.processes import WorkerProcesses, node_ranks
from recycle.runtime.control.reporter import (ChaosEvent, EvalMetrics, EventSink, GenerationRecords, MetricsFile,
                                              ProgressSink, Recovery, Reporter, StepMetrics, measure_recovery,
                                              replica_mismatch)
from recycle.runtime.control.resync import Rebuilt
from recycle.runtime.control.worker_table import WorkerRow, replacement_line
from recycle.runtime.options import LaunchOptions
from recycle.runtime.protocol.channels import (Channel, Channels, Flags, JobStore, Keys, launcher_fence_prefix,
                                               launcher_node, worker_fence_prefix)
from recycle.runtime.protocol.records import (Announcement, FaultRecord, Joined, NodeStarted, NodeSteps, NodeStops,
                                              PackedRows, RecordError, StepRows, StoppedReport, Timestamp, decode)
from recycle.runtime.protocol.store import StoreServer
from recycle.runtime.protocol.store.data import Feed, KeyValue
from recycle.runtime.state import checkpoint
from recycle.runtime.tools.chaos import ChaosMonkey
from recycle.runtime.worker.process import EXIT_FENCED
from recycle.runtime.worker.stage import tied_stages

__all__ = ["Supervisor"]

R = TypeVar("R")


TICK_MIN_S = 0.01  # the supervisor's loop, while nothing fails: what it adds at most to noticing a failure
RECOVERY_REST_MAX_S = 0.01  # the most the loop rests between a recovery's passes (as long as the last pass took)


def _launchers_on(server: StoreServer) -> set[int]:
    """The nodes whose launcher holds a connection to the store open."""
    return {node for node in map(launcher_node, server.connected()) if node is not None}


def _freeze_long_lived(collect: bool = False) -> None:
    """Move every object alive now (the plan and its views' sources: at 16,384 workers millions) out of the cyclic
    collector's reach. The loop allocates a node's step records per step and node, thousands a second at scale, and
    each full collection would walk the plan again. What is frozen is still freed by reference counting (plans and
    records hold no cycles); `collect` first (at the start, not on a recovery's path)."""
    if collect:
        gc.collect()
    gc.freeze()


@dataclass(frozen=True)
class _PendingRecovery:
    """An announced generation whose recovery is reported once every worker has started in it."""

    facts: RecoveryFacts
    choice: PlanChoice
    announced: float  # wall clock of the announcement
    live: frozenset[int]
    moves_layers: bool  # workers may write MigrationRecords (their layers may have moved)


@dataclass(frozen=True)
class _Prepared:
    """A recovery's plan and its views, made while the survivors' reports come in (a repeatable provider's: the same
    failed set at the announcement gives this plan)."""

    failed: frozenset[tuple[int, int]]
    choice: PlanChoice
    views: PlanViews
    encoded: list[bytes]  # views.encoded_tails(the plan's live ranks)


@dataclass
class _Started:
    """A generation's Joined and Resumed records that came in node launchers' digests (NodeStarted), by rank."""

    joined: dict[int, Joined] = field(default_factory=dict)
    resumed: dict[int, Timestamp] = field(default_factory=dict)


class Supervisor:
    """Node 0's loop: feed facts from the processes and the store to the Coordinator, carry out its commands, and
    report steps and recoveries."""

    # The keys whose writes the loop learns from the store's feed rather than by polling each worker's key.
    FEED_PREFIXES = (b"metrics/", b"node_metrics/", b"stopped/", b"node_stopped/", b"resumed/", b"node_started/",
                     b"exit/", b"silent/", b"join/", b"ckpt/", b"eval/")

    @classmethod
    def subscribe(cls, data: KeyValue) -> Feed:
        """The feed the loop needs from the store it serves (the node launchers' heartbeats noted without waking
        it: Liveness looks at them at its own pace); subscribe before any node can write."""
        return data.subscribe(cls.FEED_PREFIXES, quiet=(NODE_BEATS,))

    def __init__(self, config: Config, plan: Plan, options: LaunchOptions, store: Any, workers: WorkerProcesses,
                 start_step: int, end_step: int, wall0: float, server: StoreServer | None = None,
                 rebuilt: Rebuilt | None = None, *, feed: Feed) -> None:
        self.plan, self.options, self.store = plan, options, store
        self.jobs = JobStore(store)
        self.server = server
        self.plan_at_start = plan
        self.published: dict[int, list[str]] = {}  # generation -> its per-worker keys (plan and completion views)
        self.views: PlanViews | None = None  # the last generation's plan views
        self.workers = workers
        self.end_step, self.wall0 = end_step, wall0
        self.local = frozenset(workers.ranks)  # ranks this node starts (and restarts)
        self.remote = sorted(set(plan.live_ranks()) - self.local)
        self.coordinator = Coordinator(plan.num_replicas, plan.num_stages, frozenset(plan.live_ranks()), plan.failed,
                                       end_step, report_timeout_s=options.recovery.timeout_s + 5.0,
                                       checkpoint_every=options.checkpoint.every if options.checkpoint.dir else 0,
                                       reshape=options.recovery.stage_loss == "reshape", start_step=start_step,
                                       local=self.local, respawn_after_s=options.faults.respawn_after_s,
                                       rejoins=options.faults.rejoins)
        sinks: list[EventSink] = []
        if options.progress:
            sinks.append(ProgressSink(options.progress, end_step))
        if options.sink is not None:
            sinks.append(options.sink)
        if options.outputs.metrics_path:
            sinks.append(MetricsFile(options.outputs.metrics_path, append=rebuilt is not None))
        tokens_per_step = plan.total_microbatches * config.workload.microbatch_size * config.workload.seq_len
        self.reporter = Reporter(sinks, tokens_per_step, plan.num_stages, wall0, config.topology.gpus_per_worker)
        self.start_step = start_step
        self.eval_every = config.training.eval_every
        self.tokens_per_microbatch = config.workload.microbatch_size * config.workload.seq_len
        self.next_eval = self._first_eval(start_step)  # the next evaluation to report (done steps)
        self.monkey = ChaosMonkey(options.faults.chaos, plan.num_stages, config.topology.gpus_per_worker) \
            if options.faults.chaos is not None else None
        self.last_chaos_step = start_step
        self.exited: set[int] = set()
        self.pids: dict[int, int | None] = {r: workers.pid(r) for r in workers.ranks}
        self.liveness = Liveness(self.jobs, options.cluster.watched_nodes, options.recovery.heartbeat_s,
                                 options.recovery.heartbeat_timeout_s, node_beats_from(feed),
                                 connected_nodes=None if server is None else lambda: _launchers_on(server))
        # Tests only: ranks whose process the launcher must not kill (as if its node could not be reached).
        self.unfenceable = {int(r) for r in os.environ.get("RECYCLE_TEST_UNFENCEABLE", "").split(",") if r.strip()}
        self.pending: _PendingRecovery | None = None  # the recovery being completed
        self.prepared: _Prepared | None = None  # the next generation's plan and views, while its reports come in
        self.prepared_for: frozenset[tuple[int, int]] | None = None  # the failed set last asked for by _prepare_next
        self.failing = False
        # What decides whether an interrupted iteration can be finished rather than redone (ir.completion).
        self.collective_step = not plan.staggered or config.training.grad_clip > 0
        self.tied = bool(tied_stages(config, options.model_factory))
        self.unrecorded: frozenset[int] = frozenset()  # finished members whose records a restart lost
        self.hang_limit_told = 0.0  # the hang limit the node launchers were last told
        # The store's change feed (FEED_PREFIXES, subscribed before any node could write): which step records and
        # which remote workers' EXITED/SILENT flags were written, so that nothing is polled per worker per tick.
        self.feed: Feed = feed
        self.arrived: dict[int, set[int]] = {}  # step -> ranks whose record of it was written
        # Step records that came in a node launcher's NodeSteps (read on arrival: one read per node and step).
        self.held = HeldSteps()
        self.flagged: set[int] = set()  # remote ranks with an EXITED or SILENT flag written since the last look
        # Per generation, the ranks whose stop report (not read yet) and whose "resumed" record were written.
        self.stopped_in: dict[int, set[int]] = {}
        self.resumed_in: dict[int, set[int]] = {}
        # Per generation, the stop reports that came in node launchers' digests (NodeStops), by rank.
        self.digested: dict[int, dict[int, StoppedReport]] = {}
        # Per generation, the Joined and Resumed records that came in node launchers' digests (NodeStarted), by rank.
        self.started: dict[int, _Started] = {}
        self.adopted = rebuilt is not None  # a restarted coordinator's: the run's layouts before it are unknown
        if rebuilt is not None:
            self._adopt(rebuilt)

    def _adopt(self, rebuilt: Rebuilt) -> None:
        """A restarted coordinator: take the run over where its workers are (control.resync)."""
        coordinator, now = self.coordinator, time.time()
        coordinator.adopt(rebuilt.generation, rebuilt.live, rebuilt.done, rebuilt.next_step, rebuilt.member_from,
                          rebuilt.latest_checkpoint)
        failed = coordinator.state.failed
        if failed != self.plan.failed:
            if self.options.plan_provider is None:
                self._fail("the restarted coordinator found workers down and has no plan provider for that state")
            self.plan = self.options.plan_provider(failed).plan
        if rebuilt.generation > 0:
            self.views = PlanViews(self.plan)
            self._publish_views(rebuilt.generation, Keys.plan_view, self.views, self.plan)
        self.start_step = rebuilt.next_step
        self.next_eval = self._first_eval(rebuilt.next_step)
        self.last_chaos_step = rebuilt.next_step
        self.unrecorded = rebuilt.unrecorded
        self.remote = sorted((set(self.remote) | rebuilt.live) - self.local)
        for rank in rebuilt.live:
            self.liveness.admit(rank, now)  # silence counts from the restart
        self.liveness.nodes_seen(now)

    # -- the loop ------------------------------------------------------------------------------------------------
    def run(self) -> tuple[list[StepMetrics], list[Recovery], frozenset[tuple[int, int]]]:
        # Woken by the feed (a record or flag written), a local worker's exit, or else at the liveness checks' pace.
        idle_s = min(0.25, max(0.02, self.options.recovery.heartbeat_s / 2))
        if self.views is None:
            self.views = PlanViews(self.plan)
        self.views.prepare()  # off a recovery's path: its views are made from these
        _freeze_long_lived(collect=True)
        while True:
            tick = time.monotonic()
            self._take_feed()
            now = time.time()
            self._execute(self._exits(now))
            self._execute(self._heartbeats(now))
            self._execute(self._stopped_reports(now))
            self._execute(self._joiners(now))
            self._execute(self.coordinator.on_tick(now))
            running = frozenset(r for r in self.local if self.workers.running(r))
            self._execute(self.coordinator.on_repair_check(now, running))
            self._drain()
            self._report_evaluations()
            self._execute(self.coordinator.on_shards_written(self._written_shards()))
            self._complete_recovery()
            self._chaos(now)
            state = self.coordinator.state
            if self.coordinator.next_step >= self.end_step and self._all_local_exited() and not state.recovering:
                self.coordinator.on_finished()
                self._complete_recovery(final=True)
                self._report_evaluations(final=True)
                self._finish_nodes()
                return list(self.reporter.steps), list(self.reporter.recoveries), self.coordinator.state.failed
            if state.recovering:
                self._prepare_next()
                # A recovery's reports come in bursts (2,048 node digests at 16,384 workers) through the store's
                # thread, which shares this process's interpreter lock: resting as long as the pass took (at most
                # RECOVERY_REST_MAX_S) leaves that thread the lock half the time and makes each pass take a larger
                # batch. A small job's passes, a fraction of a millisecond, are hardly held back.
                time.sleep(min(RECOVERY_REST_MAX_S, time.monotonic() - tick))
            else:
                # The feed wakes the loop on every key a node writes, about one per node and step: at thousands of
                # nodes a tick per key costs more than the keys (540 ticks/s, a third of a core, at 16,384 ranks).
                # Ticks at most every TICK_MIN_S while nothing fails; a recovery's ticks are not held back.
                time.sleep(max(0.0, tick + TICK_MIN_S - time.monotonic()))
            self.workers.wait(0.02 if state.recovering else idle_s, also=[self.feed])

    def _prepare_next(self) -> None:
        """While a recovery waits for the survivors' reports: with a repeatable provider (ir.provider), get the plan
        for the failed set known now and make its views, so that the announcement only writes them. At 16,384
        workers the lookup and the views are tens of ms of CPU that the reports' wait hides; if the failed set has
        changed by the announcement (another failure, a joiner), it asks again."""
        provider, state = self.options.plan_provider, self.coordinator.state
        if provider is None or not getattr(provider, "repeatable", False) or state.finished:
            return
        failed = state.failed - {self.plan.worker(rank) for rank in state.joining}
        if self.prepared_for == failed:
            return
        self.prepared_for = failed  # (asked once per failed set, also when the provider fails)
        with collector_paused():
            try:
                choice = provider(failed)
            except Exception:  # noqa: BLE001 (asked again at the announcement, which reports what is wrong)
                return
            views = PlanViews(choice.plan, self.views)
            self.prepared = _Prepared(failed, choice, views, views.encoded_tails(choice.plan.live_ranks()))

    def _take_feed(self) -> None:
        # Node launchers' step records, stop and start digests (their keys, and the step or generation of each),
        # each kind taken in one batch.
        steps: list[tuple[bytes, int]] = []
        stops: list[tuple[bytes, int]] = []
        starts: list[tuple[bytes, int]] = []
        for key in self.feed.drain():
            kind, _, rest = key.decode().partition("/")
            if kind == "metrics":
                step, _, rank = rest.partition("/")
                self.arrived.setdefault(int(step), set()).add(int(rank))
            elif kind == "node_metrics":
                steps.append((key, int(rest.partition("/")[0])))
            elif kind == "node_stopped":
                stops.append((key, int(rest.partition("/")[0])))
            elif kind == "node_started":
                starts.append((key, int(rest.partition("/")[0])))
            elif kind in ("exit", "silent"):
                self.flagged.add(int(rest))
            elif kind in ("stopped", "resumed"):
                generation, _, rank = rest.partition("/")
                into = self.stopped_in if kind == "stopped" else self.resumed_in
                into.setdefault(int(generation), set()).add(int(rank))
        if steps:
            self._take_node_steps(steps)
        if stops:
            self._take_node_stops(stops)
        if starts:
            self._take_node_started(starts)

    def _take_node_steps(self, keys: list[tuple[bytes, int]]) -> None:
        """Node launchers' records of a step each (NodeSteps: a node's records that came in since its previous
        look), held until the step is reported."""
        for step, batch in self._taken(NodeSteps, keys):
            ranks = self.held.add(batch, self.plan.rank, self.coordinator.next_step)
            if ranks:
                self.arrived.setdefault(step, set()).update(ranks)

    def _taken(self, cls: type[R], keys: list[tuple[bytes, int]]) -> Iterator[tuple[int, R]]:
        """Node launchers' records of class `cls` (their keys, each written once, and the step or generation each is
        of), read and deleted in one hold of the store's lock: at 16,384 workers 2,048 come in at once, every step
        and in a recovery. A record of another version is no record (only the job's processes can write)."""
        for (_, generation), raw in zip(keys, self.store.take([key for key, _ in keys])):
            if raw is not None:
                try:
                    yield generation, decode(cls, raw)
                except RecordError:
                    pass

    def _take_node_stops(self, keys: list[tuple[bytes, int]]) -> None:
        """Node launchers' digests of their workers' stop reports, kept by generation for _stopped_reports."""
        current = self.coordinator.state.generation
        for generation, digest in self._taken(NodeStops, keys):
            if generation >= current:
                into = self.digested.setdefault(generation, {})
                into.update((report.rank, report) for report in digest.reports if report.generation == generation)

    def _take_node_started(self, keys: list[tuple[bytes, int]]) -> None:
        """Node launchers' digests of their workers' Joined and Resumed records, kept until their generation's
        recovery is reported."""
        for generation, digest in self._taken(NodeStarted, keys):
            if self.pending is None or self.pending.facts.generation != generation:
                continue  # (the run's first generation, or one not reported: a restarted coordinator's)
            into = self.started.setdefault(generation, _Started())
            into.joined.update(digest.joined_records)
            resumed = digest.resumed_records
            into.resumed.update(resumed)
            self.resumed_in.setdefault(generation, set()).update(resumed)

    def _all_local_exited(self) -> bool:
        """Every local member of the run has exited (replacements never admitted are stopped afterwards)."""
        members = self.coordinator.participants()
        return all(self.workers.exitcode(r) is not None for r in self.workers.ranks if r in members)

    def _name(self, rank: int) -> str:
        replica, stage = self.plan.worker(rank)
        pid = self.pids.get(rank)
        return f"worker {Worker(replica, stage)} (rank {rank}{f', pid {pid}' if pid else ''})"

    # -- facts ---------------------------------------------------------------------------------------------------
    def _exits(self, now: float) -> list[Command]:
        commands: list[Command] = []
        codes = self.workers.exitcodes()
        flagged, self.flagged = sorted(self.flagged), set()  # remote ranks whose EXITED or SILENT key was written
        for rank in flagged:
            text = self.jobs.flag_text(Flags.EXITED, rank) if rank not in self.exited else None
            if text is not None:
                codes[rank] = int(text)
            elif rank in self.coordinator.state.live and rank not in self.exited:
                silent = self.jobs.flag_text(Flags.SILENT, rank)
                if silent is not None:
                    commands += self.coordinator.on_death(rank, f"{self._name(rank)} {silent}", now, fence=True)
        for rank, code in sorted(codes.items()):
            if rank in self.exited:
                continue
            self.exited.add(rank)
            self.store.delete_key(Keys.join_ready(rank))  # a replacement that said it was ready and then died
            if code == 0 and rank in self.coordinator.state.live:
                commands += self.coordinator.on_done(rank, now)
            elif code not in (0, EXIT_FENCED):
                commands += self._failed_exit(rank, code, now)
                self.coordinator.on_crashed(rank, now)
        return commands

    def _failed_exit(self, rank: int, code: int, now: float) -> list[Command]:
        record = self.jobs.read(Channels.ERROR, rank)
        if record is not None and not record.comm:
            return self.coordinator.on_error(rank, f"{self._name(rank)} raised {record.exception}: {record.message}")
        if code == 3:
            cause = "lost its launcher (node gone)"
        elif record is not None:
            cause = f"failed on a communication error ({record.message})"
        else:
            cause = f"died ({describe_exit(code)})"
        return self.coordinator.on_death(rank, f"{self._name(rank)} {cause}", now)

    def _joiners(self, now: float) -> list[Command]:
        """Replacement workers that say they are ready to be admitted."""
        state = self.coordinator.state
        commands: list[Command] = []
        for replica, stage in sorted(state.failed):
            rank = self.plan.rank(replica, stage)
            if self.workers.exitcode(rank) is not None:
                continue  # its ready key is stale: the process has died since (its exit is handled next loop)
            ready = self.jobs.read(Channels.JOIN_READY, rank) if rank not in state.joining else None
            if ready is not None:
                self.pids[rank] = ready.pid
                self.exited.discard(rank)
                commands += self.coordinator.on_join_ready(rank, now)
        return commands

    def _heartbeats(self, now: float) -> list[Command]:
        if not self.liveness.due(now):
            return []
        # Only this process's own workers beat to its store; every node launcher watches its own (NodeWatch).
        live = (self.coordinator.state.live - self.exited) & self.local
        commands: list[Command] = []
        for rank, silent in self.liveness.silent_workers(live, now):
            commands += self.coordinator.on_death(
                rank, f"{self._name(rank)} stopped responding (no heartbeat for {silent:.1f} s; fenced)", now,
                fence=True)
        limit = hang_limit_s(self.options.recovery.hang_timeout_s, self.reporter.recent_periods(50),
                             self.options.recovery.timeout_s)
        if self.remote and abs(limit - self.hang_limit_told) > 0.05 * self.hang_limit_told:
            self.store.set(Keys.HANG_LIMIT, f"{limit:.3f}")  # the node launchers apply it to their workers
            self.hang_limit_told = limit
        for rank, computing in self.liveness.hung_workers(live - set(self.coordinator.state.reports), now, limit):
            commands += self.coordinator.on_death(
                rank, f"{self._name(rank)} is hung (its heartbeat goes on, but one action has computed for "
                      f"{computing:.1f} s, over the {limit:.1f} s limit; fenced)", now, fence=True)
        # A coordinator apart from the nodes (none of its own) holds off on every node falling silent at once: its
        # own network, more likely, and they wait as long for it (Liveness.silent_nodes).
        held = self.liveness.holding
        hold_s = self.options.recovery.coordinator_grace_s if not self.local else 0.0
        silent_nodes = self.liveness.silent_nodes(now, hold_s)
        self._tell_hold(held, silent_nodes, now, hold_s)
        for node, silent in silent_nodes:
            # Fence its launcher and every worker it runs, so that nothing of it can act on the job when (if) it
            # comes back; the survivors go on without it.
            if self.server is not None:
                self.server.fence(launcher_fence_prefix(node))
            for rank in node_ranks(self.plan_at_start.live_ranks(), self.options.cluster.nnodes, node):
                commands += self.coordinator.on_death(
                    rank, f"{self._name(rank)} is on node {node}, which stopped responding (its launcher: no "
                          f"heartbeat for {silent:.1f} s; frozen or cut off; fenced)", now, fence=True)
            if self.options.progress:
                self.options.progress(f"node {node} stopped responding for {silent:.1f} s (frozen or cut off): "
                                      "fenced; the run goes on without it (start its launcher again to re-join)")
        return commands

    def _tell_hold(self, held: frozenset[int], silent_nodes: list[tuple[int, float]], now: float,
                   hold_s: float) -> None:
        """Say when a hold on silent nodes begins, and when it ends with every node back."""
        holding, progress = self.liveness.holding, self.options.progress
        if progress is None or bool(held) == bool(holding):
            return
        if holding:
            progress(f"every node ({len(holding)}) stopped responding at once: this coordinator has more likely lost "
                     f"its own network than they have all failed, and declaring them dead would end the run; it "
                     f"declares none of them dead for up to {hold_s:g} s (--coordinator-grace), while they train on "
                     "and wait as long for it")
        elif not silent_nodes:
            progress(f"the nodes answer again, {now - self.liveness.hold_began:.1f} s into the hold: none was "
                     "declared dead")

    def _stopped_reports(self, now: float) -> list[Command]:
        """The stop reports written since the last look (the feed says whose): one read per report a worker wrote
        itself (no node store: the coordinator's own node), and those that came in node launchers' digests."""
        state = self.coordinator.state
        self.stopped_in = {g: ranks for g, ranks in self.stopped_in.items() if g >= state.generation}
        self.digested = {g: reports for g, reports in self.digested.items() if g >= state.generation}
        written = self.stopped_in.pop(state.generation, set())
        digested = self.digested.pop(state.generation, {})
        if not written and not digested:
            return []
        # Per new report, not a set difference over every live rank: at 16,384 workers the digests trickle in over
        # a hundred ticks, and a pass over every rank on each cost the recovery 1.5 s of CPU.
        live, reported, done = state.live, state.reports, state.done

        def wanted(rank: int) -> bool:
            return rank in live and rank not in reported and rank not in done

        found = [report for report in (self.jobs.read(Channels.STOPPED, state.generation, rank)
                                       for rank in sorted(filter(wanted, written))) if report is not None]
        found += [digested[rank] for rank in sorted(digested) if rank not in written and wanted(rank)]
        return self.coordinator.on_stopped_all(sorted(found, key=lambda report: report.rank), now)

    def _written_shards(self) -> list[tuple[int, int]]:
        return [(done, stage) for done, stage in self.coordinator.awaited_shards()
                if self.jobs.is_set(Flags.CHECKPOINTED, done, stage)]

    def _records(self, channel: Channel[R], first: int, ranks: Iterable[int],
                 came: Mapping[int, R] | None = None) -> list[R]:
        """The records of `channel` (first, rank) that exist, in the order of `ranks`: those that `came` in node
        launchers' digests, the others read from their own keys."""
        came = came or {}
        found = (came.get(rank) or self.jobs.read(channel, first, rank) for rank in ranks)
        return [record for record in found if record is not None]

    def _chaos(self, now: float) -> None:
        """--chaos: once per completed step, maybe kill or freeze a worker, or a whole stage; repair it later."""
        step = self.coordinator.next_step
        if self.monkey is None or step <= self.last_chaos_step or step >= self.end_step - 2:
            return
        state = self.coordinator.state
        if state.recovering or self.pending is not None or state.joining:
            return  # one thing at a time: the soak checks that each event is survived
        self.last_chaos_step = step
        live = sorted(r for r in state.live if r in self.local and self.workers.running(r))
        event = self.monkey.decide(step, live, can_lose_stage=state.latest_checkpoint is not None)
        if event is None:
            return
        for index, (rank, delay) in enumerate(zip(event.ranks, event.repair_after_s)):
            tp_rank = event.tp_ranks[index] if event.tp_ranks else None  # T > 1: one of the worker's processes
            what = f"a chaos {event.kind}" + (f" of TP rank {tp_rank}" if tp_rank is not None else "")
            # Recorded like an injected fault, so its recovery is timed from the kill, not from its detection.
            self.jobs.put(Channels.FAULT, FaultRecord(time.time(), what, event.kind), rank)
            self.workers.signal(rank, signal.SIGSTOP if event.kind == "hang" else signal.SIGKILL, tp_rank)
            self.coordinator.on_repair_planned(rank, now + delay)
        self.reporter.chaos(ChaosEvent(now, event.kind, event.step,
                                       tuple("%d:%d" % self.plan.worker(r) for r in event.ranks)))

    # -- commands ------------------------------------------------------------------------------------------------
    def _execute(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, Fence):
                self._fence(command)
            elif isinstance(command, AbortGeneration):
                self.jobs.raise_flag(Flags.ABORT, command.generation, text=command.reason)
            elif isinstance(command, Drain):
                self.store.set(Keys.drain(command.generation), str(command.stop_before))
            elif isinstance(command, Respawn):
                for rank in sorted(command.ranks):
                    self._start_replacement(rank, command.reason)
            elif isinstance(command, Move):
                self._fence(Fence(command.donor, command.reason))
                self._start_replacement(command.rank, command.reason)
            elif isinstance(command, Announce):
                self._announce(command)
            elif isinstance(command, MarkLatest):
                if checkpoint.mark_latest(self.options.checkpoint.dir, command.step, self.plan.num_stages,
                                          self.options.checkpoint.keep):
                    self.coordinator.on_checkpoint(command.step)
            elif isinstance(command, FailRun):
                self._fail(command.message)

    def _fence(self, command: Fence) -> None:
        if self.server is not None:
            # First shut it out of the store: from now on the store refuses it whatever it does, which needs nothing
            # from the process or its node (frozen, cut off or busy alike).
            self.server.fence(worker_fence_prefix(command.rank))
        if command.rank in self.unfenceable:
            pass  # tests: the kill cannot reach it; the store's fence alone must keep it out
        elif command.rank not in self.local:
            self.jobs.raise_flag(Flags.FENCE, command.rank, text=command.reason)  # its node's launcher kills it
        else:
            self.workers.signal(command.rank, signal.SIGKILL)  # works on a SIGSTOPped process too

    def _start_replacement(self, rank: int, reason: str) -> None:
        if rank not in self.local:
            self.jobs.raise_flag(Flags.RESPAWN, rank, text=reason)  # its node's launcher starts it
            return
        pid = self.workers.respawn(rank)
        if pid is not None:  # else its replacement is already starting
            self.exited.discard(rank)
            self.pids[rank] = pid
            if self.options.progress:
                self.options.progress(replacement_line(
                    WorkerRow(self.options.cluster.node_rank, Worker(*self.plan.worker(rank)), rank, pid), reason))

    def _announce(self, command: Announce) -> None:
        facts = command.facts
        if self.options.plan_provider is None:
            self._fail(f"{'; '.join(d.cause for d in facts.deaths) or 'a worker failed'}; this run has no plan "
                       "provider to switch plans with (recycle train always has one; a library caller passes "
                       "LaunchOptions.plan_provider). Restart with --resume from the last checkpoint")
        if self.pending is not None:
            self._complete_recovery(final=True)  # a failure during a recovery: report the first one as it ended
        prepared, self.prepared, self.prepared_for = self.prepared, None, None
        if prepared is None or prepared.failed != facts.failed:
            prepared = None
            choice = self.options.plan_provider(facts.failed)
        else:
            choice = prepared.choice  # asked while the reports came in (_prepare_next)
        plan = choice.plan
        # The views and their keys are tens of thousands of young objects at 16,384 workers, and the collections they
        # set off walked the new plan (a fifth of this path's CPU).
        with collector_paused():
            self._execute(self.coordinator.on_plan_chosen(plan.live_ranks()))
            if facts.restore_step is not None:
                self._forget_steps_from(facts.restore_step, facts.generation)
            if prepared is not None:
                self.views = prepared.views
                self._publish_views(facts.generation, Keys.plan_view, self.views, plan, prepared.encoded)
            else:
                self.views = PlanViews(plan, self.views)  # (only the views that changed are encoded again)
                self._publish_views(facts.generation, Keys.plan_view, self.views, plan)
            facts, completion = self._completion(facts, plan)
            if completion is not None:
                self._publish_views(facts.generation, Keys.completion_view, CompletionViews(completion), plan)
            self.jobs.put(Channels.ANNOUNCE, Announcement(
                facts.generation, tuple(sorted(command.live)), facts.redo_step, self.end_step,
                "; ".join(d.cause for d in facts.deaths), tuple(sorted(facts.joining)),
                -1 if facts.restore_step is None else facts.restore_step, completion is not None), facts.generation)
        self._delete_old_views(facts.generation)
        previous = self.plan
        for rank in facts.joining:
            self.liveness.admit(rank, time.time())
            self.store.delete_key(Keys.join_ready(rank))
            self.store.set(Keys.join_generation(rank), str(facts.generation))
        self.plan = plan
        # A step redone in the new generation is recorded again.
        self._forget_arrivals_from(facts.redo_step, facts.generation)
        # Layers move only when a plan re-partitions them (a partition that is not the config's own layout), or, after
        # a coordinator restart, from a layout it did not see.
        moves = bool(plan.partition or previous.partition) or self.adopted
        self.pending = _PendingRecovery(facts, choice, time.time(), command.live, moves)
        _freeze_long_lived()

    def _completion(self, facts: RecoveryFacts, plan: Plan) -> tuple[RecoveryFacts, Completion | None]:
        """With --redo lost: how the survivors finish the interrupted iteration keeping their work (ir.completion),
        and the recovery's facts with the work that is really redone; else (or where that cannot be exact) the
        whole iteration is redone."""
        if self.options.recovery.redo != "lost" or facts.restore_step is not None or \
                facts.joining or facts.redo_step >= self.end_step or not facts.deaths or not facts.redone_actions:
            return facts, None  # (no work done in the iteration: nothing to keep)
        # A tensor-parallel worker's work is kept only when its T ranks stopped at one point (worker.tp_agreement).
        split = next((r for r in facts.reports if r.tp_split), None)
        if split is not None:
            worker = "%d:%d" % self.plan.worker(split.rank)
            return replace(facts, kept=f"the whole iteration is redone: worker {worker}'s {split.tp_split}"), None
        if any(r.completing or r.generation != facts.generation - 1 for r in facts.reports):
            return replace(facts, kept="the whole iteration is redone: a failure hit the completion of the last "
                                       "one"), None
        if plan.chunks > 1:
            return replace(facts, kept="the whole iteration is redone: keeping the survivors' work knows one stage "
                                       "per worker, not chunked plans"), None
        progress = {r.rank: WorkerProgress(r.rank, r.applied, r.iteration, r.current_actions, r.weighed_current,
                                           r.reducing) for r in facts.reports}
        completion = complete_iteration(self.plan, plan, facts.redo_step, progress, self.collective_step,
                                        self.tied)
        if isinstance(completion, str):
            return replace(facts, kept=f"the whole iteration is redone: {completion}"), None
        dropped_s = sum(r.current_s for r in facts.reports if r.iteration > facts.redo_step)
        kept = [r for r in facts.reports if r.iteration == facts.redo_step and r.current_actions]
        per_action = sum(r.current_s for r in kept) / max(1, sum(r.current_actions for r in kept))
        return replace(facts, redone_actions=completion.redone_actions, lost_actions=completion.lost_actions,
                       redone_s=dropped_s + completion.lost_actions * per_action, rolled_back=0,
                       kept=f"kept the survivors' work ({completion.rerouted_actions} steps re-routed, "
                            f"{completion.resent} messages re-sent)"), completion

    def _publish_views(self, generation: int, key: Callable[[int, int], str], views: PlanViews | CompletionViews,
                       plan: Plan, encoded: list[bytes] | None = None) -> None:
        """Each live worker's view (of the generation's plan, or of the completion), under key(generation, rank):
        not the whole, which at 16,384 workers is megabytes that every worker would read and take seconds to parse.
        A plan's views share their start (the routing's exceptions: Keys.plan_shared), stored once; under each
        worker's key only the rest (`encoded`: that of plan.live_ranks(), made already). A copy of the start in
        every view is workers x moved micro-batches: 16,384 views after a rack's loss took the coordinator's process
        past 20 GB."""
        ranks = plan.live_ranks()
        keys = [key(generation, r) for r in ranks]
        if isinstance(views, PlanViews):
            self.store.set(Keys.plan_shared(generation), views.shared)
            self.published.setdefault(generation, []).append(Keys.plan_shared(generation))
            self.store.multi_set(keys, encoded if encoded is not None else views.encoded_tails(ranks))
        else:
            self.store.multi_set(keys, encoded if encoded is not None else views.encoded_views(ranks))
        self.published.setdefault(generation, []).extend(keys)

    def _delete_old_views(self, generation: int) -> None:
        """The views of two generations back: a worker still that far behind has been fenced or aborted, and the
        store stays bounded over many failures. After the announcement, not on its path (16,384 deletes)."""
        for old in [g for g in self.published if g <= generation - 2]:
            for stale in self.published.pop(old):
                self.store.delete_key(stale)

    def _forget_steps_from(self, step: int, generation: int) -> None:
        """A checkpoint restore: steps from `step` on run again, so their records and checkpoint keys are stale."""
        for later in range(step, self.end_step):
            for rank in range(self.plan.num_replicas * self.plan.num_stages):
                self.store.delete_key(Keys.metrics(later, rank))
        self._forget_arrivals_from(step, generation)
        for done in range(step + 1, self.end_step + 1):
            for stage in range(self.plan.num_stages):
                self.jobs.lower_flag(Flags.CHECKPOINTED, done, stage)
        self.reporter.restart()
        # The evaluations from the restored step on run again too (the one at `step` itself, first thing).
        first = self._first_eval(max(step - 1, self.start_step))
        for done in range(first, self.end_step + 1, self.eval_every or self.end_step + 1):
            self.jobs.delete(Channels.EVAL, done)
        self.next_eval = min(self.next_eval, first)

    def _forget_arrivals_from(self, step: int, generation: int) -> None:
        """Steps from `step` on run again in `generation`: their records will be written again (the ones in are
        stale)."""
        self.arrived = {s: ranks for s, ranks in self.arrived.items() if s < step}
        self.held.forget_from(step, generation)

    def _fail(self, message: str) -> NoReturn:
        if not self.failing:
            self.failing = True
            self._drain()  # report the steps that completed before the failure
        self.workers.stop()
        if self.options.cluster.watched_nodes:
            # The other nodes' launchers stop their workers and report this.
            self.jobs.raise_flag(Flags.ABORT_RUN, text=message)
        raise RuntimeFailure(message)

    # -- reports -------------------------------------------------------------------------------------------------
    def _complete_recovery(self, final: bool = False) -> None:
        """Once every worker of the new generation has started its first action, report the recovery."""
        pending = self.pending
        if pending is None:
            return
        facts = pending.facts
        live = sorted(pending.live)
        generation = facts.generation
        # Read once every worker's record is in (the feed says whose are), not on every tick.
        arrived = self.resumed_in.get(generation, set())
        if facts.redo_step < self.end_step and not arrived.issuperset(live) and not final:
            return
        started = self.started.pop(generation, _Started())
        self.started = {g: records for g, records in self.started.items() if g > generation}
        resumed = tuple(t.time for t in self._records(Channels.RESUMED, generation, live, started.resumed))
        self.resumed_in = {g: ranks for g, ranks in self.resumed_in.items() if g > generation}
        self.pending = None
        if not facts.deaths and not facts.joining and not facts.lost_contact:
            self._forget_generation_records(generation, live, started)
            return  # a drain whose joiner never came in (the run ended first): nothing happened
        faults: dict[int, FaultRecord] = {}
        for death in facts.deaths:
            fault = self.jobs.read(Channels.FAULT, death.rank)
            if fault is not None:
                self.jobs.delete(Channels.FAULT, death.rank)  # one record, one death: a later outside kill has none
                faults[death.rank] = fault
        records = GenerationRecords(resumed, tuple(self._records(Channels.JOINED, generation, live, started.joined)),
                                    tuple(self._records(Channels.TRANSFER, generation, sorted(facts.joining))),
                                    # (none without a re-partition: not 16,384 reads for nothing)
                                    tuple(self._records(Channels.MIGRATION, generation, live))
                                    if pending.moves_layers else (), faults)
        self._forget_generation_records(generation, live, started, tuple(sorted(facts.joining)),
                                        bool(records.migrations))
        self.reporter.recovery(measure_recovery(facts, records, self.plan.worker, pending.announced, pending.choice,
                                                time.time(), self.wall0))

    def _forget_generation_records(self, generation: int, live: list[int], came: _Started,
                                   joining: tuple[int, ...] = (), migrated: bool = False) -> None:
        """Read once: a recovery's records of each worker (resumed, joined; a joiner's state transfer; a layer
        migration's) leave the store once reported; kept, they were two keys per worker per recovery for the whole
        run (32,768 a recovery at 16,384 workers, ~20 MB of the coordinator's memory). Those that came in a node's
        digest (`came`) have no key of their own (its key was deleted when read)."""
        channels: list[tuple[Channel[Any], Collection[int]]] = [(Channels.RESUMED, came.resumed),
                                                                (Channels.JOINED, came.joined)]
        if migrated:
            channels.append((Channels.MIGRATION, ()))
        for channel, skip in channels:
            for rank in live:
                if rank not in skip:
                    self.jobs.delete(channel, generation, rank)
        for rank in joining:
            self.jobs.delete(Channels.TRANSFER, generation, rank)

    def _drain(self) -> None:
        """Report every step all its members have finished, in order."""
        while (step := self.coordinator.next_step) < self.end_step:
            # The evaluation before this step first (its record is in before the step's last one: the writer
            # writes it before the step), so that the step's period starts after it.
            self._report_evaluations()
            # Cheap first: fewer records in than the fewest members the step can have (every live rank but the
            # replacements and the unrecorded) cannot complete it; members() sorts every live rank.
            live = len(self.coordinator.state.live)
            if len(self.arrived.get(step, ())) < live - len(self.coordinator.member_from) - len(self.unrecorded):
                return
            members = [r for r in self.coordinator.members(step) if r not in self.unrecorded]
            # Read once every member's record is in (the feed says which are), not on every tick.
            if not members or not self.arrived.get(step, set()).issuperset(members):
                return
            held = self.held.get(step)
            found = list(map(held.get, members))  # (one C pass: at scale every record came through its node)
            if None in found:
                found = [pick or self._own_record(step, rank) for rank, pick in zip(members, found)]
            picks = [pick for pick in found if pick is not None]
            if len(picks) < len(members):
                return
            records = StepRows.gather(picks)  # (every batch was checked as it came in)
            self.arrived.pop(step, None)
            self.held.pop(step)
            metrics = self.reporter.step_metrics(step, records)
            for rank in members:  # read once: the store keeps no per-step record for the whole run
                if rank not in held:
                    self.store.delete_key(Keys.metrics(step, rank))
            if self.options.debug.verify_replicas:
                mismatch = replica_mismatch(metrics.step, records, self.plan.num_stages)
                if mismatch is not None:
                    self._fail(mismatch)
            self.reporter.step(metrics)
            if self.reporter.steps_reported == 1:
                # Generation 0 has run a step, so every node's first launcher is in: a node launcher that starts from
                # now on is a repaired node and brings its workers back as replacements.
                self.jobs.raise_flag(Flags.RUNNING)
            self.coordinator.on_step_reported(step)

    def _own_record(self, step: int, rank: int) -> tuple[PackedRows, int] | None:
        """The step record a worker wrote to the job's store itself (not through its node launcher), as a row."""
        record = self.jobs.read(Channels.METRICS, step, rank)
        return None if record is None else (PackedRows.of([record]), 0)

    def _first_eval(self, after: int) -> int:
        """The first evaluation due after `after` done steps (past the run's end when there are none)."""
        every = self.eval_every
        return (after // every + 1) * every if every else self.end_step + 1

    def _report_evaluations(self, final: bool = False) -> None:
        """Report every evaluation whose step has been reported and whose record is in, in order. `final`: the run
        is over; one still missing was cut by a failure and not run again (the run ended first): say so."""
        while self.next_eval <= min(self.coordinator.next_step, self.end_step):
            done = self.next_eval
            record = self.jobs.read(Channels.EVAL, done)
            if record is not None:
                self.jobs.delete(Channels.EVAL, done)  # read once, like the steps' records
                # Run in a later generation than its step's: a failure cut it short, and the next one ran it again.
                step_generation = next((m.generation for m in reversed(self.reporter.steps) if m.step == done),
                                       record.generation)
                self.reporter.evaluation(EvalMetrics(done, record.loss, record.microbatches,
                                                     record.microbatches * self.tokens_per_microbatch,
                                                     record.end - record.start, record.generation,
                                                     redone=record.generation > step_generation,
                                                     end_time=record.end))
            elif final:
                self.reporter.evaluation(EvalMetrics(done, None, 0, 0, 0.0, self.coordinator.state.generation,
                                                     skipped="a failure cut it short, and the run ended before it "
                                                             "could run again"))
            else:
                return
            self.next_eval += self.eval_every

    def _finish_nodes(self) -> None:
        """Multi-node: say the run is over; keep the store up until every node has said it is done."""
        if not self.options.cluster.watched_nodes:
            return
        self.jobs.raise_flag(Flags.FINISHED)
        live = self.coordinator.participants()
        initial = self.plan_at_start.live_ranks()
        # A node is waited for while it has a live worker or its launcher still beats (a repaired node whose
        # replacements came too late to be admitted: they see the end and exit, then it says it is done too).
        beating = self.liveness.beating_nodes(time.time())
        nodes = [n for n in self.options.cluster.watched_nodes if n not in self.liveness.fenced_nodes
                 and (set(node_ranks(initial, self.options.cluster.nnodes, n)) & live or n in beating)]
        deadline = time.time() + max(self.options.recovery.timeout_s, 60.0)
        while not all(self.jobs.is_set(Flags.NODE_DONE, n) for n in nodes) and time.time() < deadline:
            time.sleep(0.05)
