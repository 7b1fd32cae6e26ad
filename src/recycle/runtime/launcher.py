"""The launcher: hosts the job's store (node 0), spawns one process per live worker of its node, and on node 0 runs
the coordinator that keeps the job going when workers die: it detects the failure, fences the worker, picks the
plan for the new failure state and announces the next generation; it also gathers per-step metrics."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Iterable, TypeVar

import torch
import torch.distributed as dist

from recycle.config import Config
from recycle.errors import ConfigError, RuntimeFailure
from recycle.ir import Plan, PlanChoice, PlanSource, validate_plan
from recycle.runtime import checkpoint, preflight
from recycle.runtime.control import (Channel, Channels, JobStore, Keys, connect_store, host_store,
                                     launcher_fence_prefix, launcher_identity, new_incarnation, new_token,
                                     worker_fence_prefix)
from recycle.runtime.coordinator import (AbortGeneration, Announce, Command, Coordinator, Drain, FailRun, Fence,
                                         Move, Progress, RecoveryFacts, Respawn, describe_exit, hang_limit_s,
                                         hung_workers, stale_heartbeats, track_progress)
from recycle.runtime.chaos import ChaosMonkey
from recycle.runtime.data import check_data
from recycle.runtime.messages import check_plan_matches
from recycle.runtime.options import ClusterOptions, LaunchOptions, StartMethod
from recycle.runtime.records import Announcement, Beat, FaultRecord, RecordError, StepRecord
from recycle.runtime.stage import check_model
from recycle.runtime.store import LocalStore, StoreFenced, StoreServer
from recycle.runtime.transport import default_backend
from recycle.runtime.worker import EXIT_FENCED, WorkerSpec, worker_main

R = TypeVar("R")

__all__ = ["StepMetrics", "Recovery", "TrainResult", "launch", "node_ranks", "grad_norm"]


@dataclass(frozen=True)
class StepMetrics:
    step: int  # 1-based count of completed steps
    loss: float
    tokens_per_s: float
    period_s: float  # end of this iteration minus end of the previous one (the first step: its own span)
    step_time_s: float  # first start to last end over all workers
    elapsed_s: float
    grad_norm: float | None = None
    worker_time_s: dict[str, float] = field(default_factory=dict)  # "replica:stage" -> busy span of the iteration
    worker_cpu_s: dict[str, float] = field(default_factory=dict)  # "replica:stage" -> CPU seconds of the iteration
    digests: dict[str, str] = field(default_factory=dict)  # "replica:stage" -> parameter digest (verify_replicas)
    generation: int = 0
    end_time: float = 0.0  # wall clock when the last worker finished the step


@dataclass(frozen=True)
class Recovery:
    """One survived failure, as measured."""

    generation: int  # the generation it started
    step: int  # 1-based step that was redone first
    workers: tuple[str, ...]  # "replica:stage" of the workers lost
    causes: tuple[str, ...]  # one line per worker lost
    failed: tuple[tuple[int, int], ...]  # every worker down after it
    failure_time: float  # the injected fault's time when known, else when it was detected (or the joiner was up)
    detected_s: float | None  # fault -> coordinator knows (None: an outside kill, whose moment is unknown)
    plan_source: PlanSource
    plan_lookup_s: float
    formed_s: float  # announcement -> every worker joined the new groups
    resumed_s: float  # failure (unknown moment: its detection; a join: the survivors' stop) -> first actions of the new plan
    redone_actions: int
    redone_s: float
    rolled_back: int  # survivors whose stage had already stepped the redone iteration (restored from a snapshot)
    joined: tuple[str, ...] = ()  # "replica:stage" of workers re-admitted
    transfer_bytes: int = 0  # state moved to them from live replicas
    transfer_s: float = 0.0  # the longest transfer
    restored_step: int | None = None  # every worker loaded this checkpoint (a stage had lost every replica)
    steps_lost: int = 0
    moved: tuple[str, ...] = ()  # "donor -> slot" ("1:0 -> 1:1"): live workers moved into a lost stage (reshape)
    partition: tuple[int, ...] = ()  # layers per stage after it, when the plan re-partitioned them (else empty)
    layers_moved: int = 0  # layers handed between stages at the switch (each counted once per receiving worker)
    migration_bytes: int = 0  # parameters and optimizer state sent for them
    migration_s: float = 0.0  # the slowest worker's exchange
    plan_note: str = ""  # the plan provider's reason for the plan (PlanChoice.note)
    formation: str = ""  # how the new generation's groups were made and the slowest worker's time ("init 0.031 s")

    def line(self) -> str:
        what = list(self.causes)
        for move in self.moved:
            donor, slot = move.split(" -> ")
            what.append(f"worker {donor} moved to stage {slot.split(':')[1]} as {slot} (reshape)")
        if self.joined:
            moved = (f"{self.transfer_bytes / 1e6:.2f} MB of state from live replicas in {self.transfer_s:.3f} s"
                     if self.restored_step is None else "state from the checkpoint")
            what.append(f"{', '.join(self.joined)} re-joined ({moved})")
        if self.restored_step is not None:
            what.append(f"restored checkpoint step {self.restored_step} ({self.steps_lost} steps lost)")
        if self.layers_moved:
            what.append(f"layers re-partitioned to {list(self.partition) or 'the configured split'} per stage "
                        f"({self.layers_moved} layer move(s), {self.migration_bytes / 1e6:.2f} MB in "
                        f"{self.migration_s:.3f} s)")
        if self.plan_note:
            what.append(self.plan_note)
        detected = f"detected in {self.detected_s:.2f} s; " if self.detected_s is not None else ""
        down: dict[int, int] = {}
        for _, stage in self.failed:
            down[stage] = down.get(stage, 0) + 1
        state = ", ".join(f"stage {s}: {k} down" for s, k in sorted(down.items()))
        source = "from the store" if self.plan_source == "store" else f"planned by the {self.plan_source}"
        # An outside kill or a freeze leaves no record of its moment: time it from its first sign then (a survivor's
        # failed op, which can come well before the death is detected, or the detection itself), and say so.
        after = ("after the others stopped for it" if not self.causes else
                 "after the failure" if self.detected_s is not None else "after its first sign")
        return (f"step {self.step}: {'; '.join(what)}; {detected}plan for {{{state or 'none down'}}} {source} "
                f"({self.plan_lookup_s * 1e3:.1f} ms); generation {self.generation} in {self.formed_s:.2f} s"
                f"{f' (groups: {self.formation})' if self.formation else ''}; "
                f"redid {self.redone_actions} actions ({self.redone_s:.2f} s of work); training resumed "
                f"{self.resumed_s:.2f} s {after}")


@dataclass(frozen=True)
class TrainResult:
    start_step: int
    end_step: int
    steps: tuple[StepMetrics, ...]
    wall_s: float
    recoveries: tuple[Recovery, ...] = ()
    failed: tuple[tuple[int, int], ...] = ()  # workers down at the end
    chaos_events: tuple[dict[str, Any], ...] = ()  # what --chaos did: time, kind, workers, step



def node_ranks(live: list[int], nnodes: int, node_rank: int) -> list[int]:
    """The live workers node `node_rank` starts: contiguous, as even as possible."""
    base, extra = divmod(len(live), nnodes)
    start = node_rank * base + min(node_rank, extra)
    return live[start:start + base + (1 if node_rank < extra else 0)]


def _check_options(config: Config, plan: Plan, options: LaunchOptions) -> tuple[int, int]:
    """What the options cannot check alone (each sub-config checked its own values): against the config and the
    plan, the model, the outputs and the checkpoint to resume."""
    check_plan_matches(plan, config.num_replicas, config.num_stages, config.num_microbatches)
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
    start_step, end_step = _check_options(config, plan, options)
    cluster = options.cluster
    token = cluster.token or new_token()
    store_timeout_s = max(options.recovery.timeout_s, 60.0)
    server: StoreServer | None = None
    store: Any
    if cluster.node_rank == 0:
        # Node 0 serves the store; its coordinator reads the data in-process (no socket, and it cannot be fenced).
        server = host_store(cluster.master_addr, cluster.master_port, token)
        store, store_port = LocalStore(server.data, store_timeout_s), server.port
    else:
        store = connect_store(cluster.master_addr, cluster.master_port, token,
                              launcher_identity(cluster.node_rank, new_incarnation()), store_timeout_s,
                              connect_timeout_s=store_timeout_s)
        store_port = cluster.master_port
    # What the workers are told: the store's real port, the job secret and the backend, all settled.
    resolved = replace(cluster, master_port=store_port, token=token, backend=cluster.backend or default_backend())
    mine = node_ranks(plan.live_ranks(), cluster.nnodes, cluster.node_rank)
    context = _context(cluster.start_method)
    processes: dict[int, mp.process.BaseProcess] = {}
    # Workers block reading this pipe; only the launcher holds the write end, so they see EOF the moment it dies.
    launcher_alive, alive_writer = context.Pipe(duplex=False)
    wall0 = time.time()
    # A node started again while its job runs (a repaired node) brings its workers back as replacements.
    rejoining = cluster.node_rank > 0 and store.check([Keys.RUNNING])
    spec_for = _spec_maker(config, plan, options, resolved, start_step, end_step, mine)

    def spawn(rank: int, joining: bool) -> mp.process.BaseProcess:
        if joining:
            for key in (Keys.join_ready(rank), Keys.join_generation(rank), Keys.exited(rank), Keys.error(rank)):
                store.delete_key(key)  # left by an earlier life of this rank
        replica, stage = plan.worker(rank)
        process = context.Process(target=worker_main, args=(spec_for(rank, joining), launcher_alive),
                                  name=f"recycle-worker-{replica}:{stage}", daemon=True)
        process.start()
        processes[rank] = process
        return process

    finished = False
    try:
        if options.progress:
            options.progress(f"starting {len(mine)} worker process(es) ({cluster.start_method}): each imports torch "
                             "and builds its stage; step 1 follows when every worker has joined"
                             + (" (this node re-joins a running job)" if rejoining else ""))
        for rank in mine:
            spawn(rank, joining=rejoining)
        if cluster.node_rank == 0:
            run = _Coordination(config, plan, options, store, processes, start_step, end_step, wall0, spawn, server)
            steps, recoveries, failed = run.run()
            chaos_events = run.chaos_events
        else:
            _follow(store, processes, options, spawn)
            steps, recoveries, failed, chaos_events = [], [], plan.failed, []
        finished = True
    finally:
        _stop(processes)
        alive_writer.close()
        launcher_alive.close()
        if server is not None:
            server.close()
        if not finished and options.outputs.save_path and cluster.node_rank == 0:
            for stage in range(plan.num_stages):  # a failed run leaves no half-made --save behind
                checkpoint.part_file(options.outputs.save_path, stage).unlink(missing_ok=True)
    if options.outputs.save_path and cluster.node_rank == 0 and end_step > start_step:
        checkpoint.merge_stage_parts(options.outputs.save_path, plan.num_stages,
                                     {"step": end_step, "config": config.to_dict()})
    return TrainResult(start_step, end_step, tuple(steps), time.time() - wall0, tuple(recoveries),
                       tuple(sorted(failed)), tuple(chaos_events))


def _spec_maker(config: Config, plan: Plan, options: LaunchOptions, cluster: ClusterOptions, start_step: int,
                end_step: int, mine: list[int]) -> Callable[[int, bool], WorkerSpec]:
    """What a worker process of this launcher is told: its rank, the run, and whether it joins a running job
    (a replacement: no resume, no scripted faults)."""
    plan_json = plan.to_json()

    def spec_for(rank: int, joining: bool) -> WorkerSpec:
        return WorkerSpec(
            rank=rank, config=config, plan_json=plan_json, cluster=cluster, start_step=start_step, end_step=end_step,
            model_factory=options.model_factory, outputs=options.outputs, checkpoint=options.checkpoint,
            recovery=options.recovery, debug=options.debug, faults=() if joining else options.faults.of(rank),
            device_index=(mine.index(rank) if rank in mine else rank) % max(torch.cuda.device_count(), 1),
            joining=joining, incarnation=new_incarnation(),
            joiner_dies_at=os.environ.get("RECYCLE_TEST_JOINER_DIES", "") if joining else "")

    return spec_for


def _context(start_method: StartMethod) -> mp.context.BaseContext:
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(["torch", "torch.distributed", "recycle.runtime.worker"])
    return context


@dataclass(frozen=True)
class _PendingRecovery:
    """An announced generation whose recovery is reported once every worker has started in it."""

    facts: RecoveryFacts
    choice: PlanChoice
    announced: float  # wall clock of the announcement
    live: frozenset[int]


class _Coordination:
    """Node 0's loop: feed facts from processes and the store to the Coordinator, carry out its commands, report
    steps and recoveries."""

    def __init__(self, config: Config, plan: Plan, options: LaunchOptions, store: dist.Store,
                 processes: dict[int, mp.process.BaseProcess], start_step: int, end_step: int, wall0: float,
                 spawn: Callable[[int, bool], mp.process.BaseProcess], server: StoreServer | None = None) -> None:
        self.config, self.plan, self.options, self.store = config, plan, options, store
        self.jobs = JobStore(store)
        self.server = server
        self.plan_at_start = plan
        self.processes = processes
        self.start_step, self.end_step, self.wall0 = start_step, end_step, wall0
        self.spawn = spawn
        self.coordinator = Coordinator(plan.num_replicas, plan.num_stages, frozenset(plan.live_ranks()), plan.failed,
                                       end_step, report_timeout_s=options.recovery.timeout_s + 5.0,
                                       checkpointing=bool(options.checkpoint.dir and options.checkpoint.every > 0),
                                       reshape=options.recovery.stage_loss == "reshape", start_step=start_step)
        self.local = set(processes)  # ranks this node starts (and restarts)
        self.remote = sorted(set(plan.live_ranks()) - self.local)
        self.member_from: dict[int, int] = {}  # rank -> first step it reports (a replacement: its redo step)
        self.respawn_at: dict[int, float] = {}  # rank -> when to bring it back (--respawn-after)
        self.vacated: dict[int, int] = {}  # a lost stage's slot -> the slot its reshape donor left empty
        self.rejoins = sorted(options.faults.rejoins, key=lambda item: item[1])
        self.monkey = ChaosMonkey(options.faults.chaos, plan.num_stages) if options.faults.chaos is not None else None
        self.chaos_events: list[dict[str, Any]] = []
        self.last_chaos_step = start_step
        self.tokens_per_step = plan.total_microbatches * config.workload.microbatch_size * config.workload.seq_len
        self.steps: list[StepMetrics] = []
        self.records: list[dict[str, Any]] = []  # steps and events, for --metrics
        self.recoveries: list[Recovery] = []
        self.next_step = start_step
        self.previous_end: float | None = None
        self.exited: set[int] = set()
        self.done: set[int] = set()  # exited cleanly after the last step
        self.pids: dict[int, int | None] = {r: p.pid for r, p in processes.items()}
        self.beats: dict[int, tuple[str, int]] = {}  # rank -> (incarnation, beats) of its last beat seen
        self.last_beat: dict[int, float] = {}
        self.progress: dict[int, Progress] = {}  # rank -> its main thread's progress (hang detection)
        self.node_beats: dict[int, int] = {}
        self.node_last_beat: dict[int, float] = {}
        self.fenced_nodes: set[int] = set()
        # Tests only: ranks whose process the launcher must not kill (as if its node could not be reached).
        self.unfenceable = {int(r) for r in os.environ.get("RECYCLE_TEST_UNFENCEABLE", "").split(",") if r.strip()}
        self.next_beat_check = 0.0
        self.pending: _PendingRecovery | None = None  # the recovery being completed
        self.failing = False
        self.pending_checkpoints = [d for d in range(start_step + 1, end_step + 1)
                                    if options.checkpoint.dir and options.checkpoint.every > 0
                                    and d % options.checkpoint.every == 0]

    # -- the loop ------------------------------------------------------------------------------------------------
    def run(self) -> tuple[list[StepMetrics], list[Recovery], frozenset[tuple[int, int]]]:
        while True:
            now = time.time()
            self._execute(self._exits(now))
            self._execute(self._heartbeats(now))
            self._execute(self._stopped_reports(now))
            self._execute(self._joiners(now))
            self._execute(self.coordinator.on_tick(now))
            self._respawn_due(now)
            self._drain()
            self._mark_checkpoints()
            self._complete_recovery()
            self._chaos(now)
            if self.next_step >= self.end_step and self._all_local_exited() and not self.coordinator.state.recovering:
                self.coordinator.on_finished()
                self._complete_recovery(final=True)
                self._finish_nodes()
                return self.steps, self.recoveries, self.coordinator.state.failed
            waiting = [p.sentinel for p in self.processes.values() if p.exitcode is None]
            if waiting:
                # Sleep until a worker exits (seen at once) or the next poll of the store; a busy poll would take
                # CPU from the workers on a small machine.
                mp_connection.wait(waiting, timeout=0.02 if self.coordinator.state.recovering else 0.05)
            else:
                time.sleep(0.05)

    def _all_local_exited(self) -> bool:
        """Every local member of the run has exited (replacements never admitted are stopped afterwards)."""
        members = self.coordinator.state.live | self.done
        return all(p.exitcode is not None for r, p in self.processes.items() if r in members)

    def _name(self, rank: int) -> str:
        replica, stage = self.plan.worker(rank)
        pid = self.pids.get(rank)
        return f"worker {replica}:{stage} (rank {rank}{f', pid {pid}' if pid else ''})"

    # -- facts ---------------------------------------------------------------------------------------------------
    def _exits(self, now: float) -> list[Command]:
        commands: list[Command] = []
        codes = {r: p.exitcode for r, p in self.processes.items() if p.exitcode is not None}
        for rank in self.remote:
            if rank not in self.exited and self.store.check([Keys.exited(rank)]):
                codes[rank] = int(self.store.get(Keys.exited(rank)))
        for rank, code in sorted(codes.items()):
            if rank in self.exited:
                continue
            self.exited.add(rank)
            self.store.delete_key(Keys.join_ready(rank))  # a replacement that said it was ready and then died
            if code == 0 and rank in self.coordinator.state.live:
                self.done.add(rank)
                commands += self.coordinator.on_done(rank, now)
            elif code not in (0, EXIT_FENCED):
                commands += self._failed_exit(rank, code, now)
            if code not in (0, EXIT_FENCED) and rank in self.local and self.options.faults.respawn_after_s is not None:
                self.respawn_at[rank] = now + self.options.faults.respawn_after_s
        return commands

    def _joiners(self, now: float) -> list[Command]:
        """Replacement workers that say they are ready to be admitted."""
        state = self.coordinator.state
        commands: list[Command] = []
        for replica, stage in sorted(state.failed):
            rank = self.plan.rank(replica, stage)
            process = self.processes.get(rank)
            if process is not None and process.exitcode is not None:
                continue  # its ready key is stale: the process has died since (its exit is handled next loop)
            ready = self.jobs.read(Channels.JOIN_READY, rank) if rank not in state.joining else None
            if ready is not None:
                self.pids[rank] = ready.pid
                self.exited.discard(rank)
                commands += self.coordinator.on_join_ready(rank, now)
        return commands

    def _respawn_due(self, now: float) -> None:
        """Bring workers back: --respawn-after (a stand-in for repair) and scripted `rejoin:` events."""
        failed_ranks = {self.plan.rank(p, s) for p, s in self.coordinator.state.failed}
        for rank, at in sorted(self.respawn_at.items()):
            if now >= at:
                if self.vacated.get(rank) in failed_ranks:
                    # A moved worker holds (or is about to hold) this slot: the repaired machine takes the slot its
                    # donor left.
                    del self.respawn_at[rank]
                    self._respawn(self.vacated.pop(rank))
                elif rank in failed_ranks:
                    del self.respawn_at[rank]
                    self._respawn(rank)
                elif self.processes[rank].exitcode is not None:
                    del self.respawn_at[rank]  # nothing to repair
                # else: a frozen worker not yet declared dead: repaired once it is
        while self.rejoins and self.next_step >= self.rejoins[0][1]:
            rank, _ = self.rejoins.pop(0)
            if rank in failed_ranks and rank in self.local:
                self._respawn(rank)

    def _chaos(self, now: float) -> None:
        """--chaos: once per completed step, maybe kill or freeze a worker, or a whole stage; repair it later."""
        if self.monkey is None or self.next_step <= self.last_chaos_step or self.next_step >= self.end_step - 2:
            return
        state = self.coordinator.state
        if state.recovering or self.pending is not None or state.joining:
            return  # one thing at a time: the soak checks that each event is survived
        self.last_chaos_step = self.next_step
        live = sorted(r for r in state.live if r in self.local and self.processes[r].exitcode is None)
        event = self.monkey.decide(self.next_step, live, can_lose_stage=state.latest_checkpoint is not None)
        if event is None:
            return
        for rank, delay in zip(event.ranks, event.repair_after_s):
            # Recorded like an injected fault, so its recovery is timed from the kill, not from its detection.
            self.jobs.put(Channels.FAULT, FaultRecord(time.time(), f"a chaos {event.kind}", event.kind), rank)
            os.kill(self.processes[rank].pid, signal.SIGSTOP if event.kind == "hang" else signal.SIGKILL)
            self.respawn_at[rank] = now + delay
        record = {"event": "chaos", "time": now, "kind": event.kind, "step": event.step,
                  "workers": ["%d:%d" % self.plan.worker(r) for r in event.ranks]}
        self.chaos_events.append(record)
        self.records.append(record)
        if self.options.on_event:
            self.options.on_event(record)
        if self.options.progress:
            self.options.progress(f"chaos at step {event.step}: {event.kind} {' '.join(record['workers'])}")

    def _start_replacement(self, rank: int, reason: str) -> None:
        if rank in self.local:
            self._respawn(rank)
        else:
            self.store.set(Keys.respawn(rank), reason)  # its node's launcher starts it

    def _respawn(self, rank: int) -> None:
        process = self.processes.get(rank)
        if process is not None and process.exitcode is None:
            return  # its replacement is already starting
        self.exited.discard(rank)
        self.pids[rank] = self.spawn(rank, True).pid

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

    def _heartbeats(self, now: float) -> list[Command]:
        if now < self.next_beat_check:
            return []
        self.next_beat_check = now + self.options.recovery.heartbeat_s / 2
        live = self.coordinator.state.live - self.exited
        for rank in live:
            beat = self._beat(rank)
            if beat is None:
                continue
            if (beat.incarnation, beat.beats) != self.beats.get(rank):
                self.beats[rank] = (beat.incarnation, beat.beats)
                self.last_beat[rank] = now
                self.progress[rank] = track_progress(self.progress.get(rank), beat.actions, beat.phase, now)
        commands: list[Command] = []
        for rank in stale_heartbeats(self.last_beat, frozenset(live), now, self.options.recovery.heartbeat_timeout_s):
            commands += self.coordinator.on_death(
                rank, f"{self._name(rank)} stopped responding (no heartbeat for "
                      f"{now - self.last_beat[rank]:.1f} s; fenced)", now, fence=True)
        limit = hang_limit_s(self.options.recovery.hang_timeout_s, [m.period_s for m in self.steps[-50:]],
                             self.options.recovery.timeout_s)
        for rank in hung_workers(self.progress, frozenset(live) - set(self.coordinator.state.reports), now, limit):
            progress = self.progress.pop(rank)
            commands += self.coordinator.on_death(
                rank, f"{self._name(rank)} is hung (its heartbeat goes on, but one action has computed for "
                      f"{now - progress.since:.1f} s, over the {limit:.1f} s limit; fenced)", now, fence=True)
        commands += self._node_heartbeats(now)
        return commands

    def _records(self, channel: Channel[R], first: int, ranks: Iterable[int]) -> list[R]:
        """The records of `channel` (first, rank) that exist, in the order of `ranks`."""
        found = (self.jobs.read(channel, first, rank) for rank in ranks)
        return [record for record in found if record is not None]

    def _beat(self, rank: int) -> Beat | None:
        try:
            return self.jobs.read(Channels.HEARTBEAT, rank)
        except RecordError:
            return None  # only the job's own processes can write it; a malformed beat is no beat

    def _node_heartbeats(self, now: float) -> list[Command]:
        """A node whose launcher stops beating is frozen or cut off: fence its launcher and every worker it runs,
        so that nothing of it can act on the job when (if) it comes back; the survivors go on without it."""
        commands: list[Command] = []
        for node in range(1, self.options.cluster.nnodes):
            raw = self.store.try_get(Keys.node_heartbeat(node))
            if raw is not None and raw.isdigit() and int(raw) != self.node_beats.get(node):
                self.node_beats[node] = int(raw)
                self.node_last_beat[node] = now
                self.fenced_nodes.discard(node)  # a fenced launcher cannot beat: this is its node's new launcher
        nodes = frozenset(n for n in range(1, self.options.cluster.nnodes) if n not in self.fenced_nodes)
        for node in stale_heartbeats(self.node_last_beat, nodes, now, self.options.recovery.heartbeat_timeout_s):
            self.fenced_nodes.add(node)
            if self.server is not None:
                self.server.fence(launcher_fence_prefix(node))
            silent = now - self.node_last_beat[node]
            for rank in node_ranks(self.plan_at_start.live_ranks(), self.options.cluster.nnodes, node):
                commands += self.coordinator.on_death(
                    rank, f"{self._name(rank)} is on node {node}, which stopped responding (its launcher: no "
                          f"heartbeat for {silent:.1f} s; frozen or cut off; fenced)", now, fence=True)
            if self.options.progress:
                self.options.progress(f"node {node} stopped responding for {silent:.1f} s (frozen or cut off): "
                                      "fenced; the run goes on without it (start its launcher again to re-join)")
        return commands

    def _stopped_reports(self, now: float) -> list[Command]:
        state = self.coordinator.state
        if self.store.add(Keys.stopped_count(state.generation), 0) == len(state.reports):
            return []  # nobody new has stopped in this generation
        commands: list[Command] = []
        for rank in sorted(state.live - set(state.reports) - state.done):
            report = self.jobs.read(Channels.STOPPED, state.generation, rank)
            if report is not None:
                commands += self.coordinator.on_stopped(report, now)
        return commands

    # -- commands ------------------------------------------------------------------------------------------------
    def _execute(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, Fence):
                if self.server is not None:
                    # First shut it out of the store: from now on the store refuses it whatever it does, which needs
                    # nothing from the process or its node (frozen, cut off or busy alike).
                    self.server.fence(worker_fence_prefix(command.rank))
                process = self.processes.get(command.rank)
                if command.rank in self.unfenceable:
                    pass  # tests: the kill cannot reach it; the store's fence alone must keep it out
                elif process is not None and process.exitcode is None:
                    os.kill(process.pid, signal.SIGKILL)  # works on a SIGSTOPped process too
                elif process is None:
                    self.store.set(Keys.fence(command.rank), command.reason)  # its node's launcher kills it
            elif isinstance(command, AbortGeneration):
                self.store.set(Keys.abort(command.generation), command.reason)
            elif isinstance(command, Drain):
                # Workers stop before this step; every worker is at most in next_step + 1 now.
                self.store.set(Keys.drain(command.generation), str(self.next_step + 3))
            elif isinstance(command, Respawn):
                for rank in sorted(command.ranks):
                    self._start_replacement(rank, command.reason)
            elif isinstance(command, Move):
                self._execute([Fence(command.donor, command.reason)])
                self.vacated[command.rank] = command.donor
                self._start_replacement(command.rank, command.reason)
            elif isinstance(command, Announce):
                self._announce(command)
            elif isinstance(command, FailRun):
                self._fail(command.message)

    def _announce(self, command: Announce) -> None:
        facts = command.facts
        if self.options.plan_provider is None:
            self._fail(f"{'; '.join(d.cause for d in facts.deaths) or 'a worker failed'}; this run has no plan "
                       "provider to switch plans with (recycle train always has one; a library caller passes "
                       "LaunchOptions.plan_provider). Restart with --resume from the last checkpoint")
        if self.pending is not None:
            self._complete_recovery(final=True)  # a failure during a recovery: report the first one as it ended
        choice = self.options.plan_provider(facts.failed)
        plan = choice.plan
        if set(plan.live_ranks()) != set(command.live) | self.done:
            self._fail(f"the plan provider returned a plan whose live workers {plan.live_ranks()} are not the "
                       f"live workers {sorted(command.live)}")
        if facts.restore_step is not None:
            self._forget_steps_from(facts.restore_step)
        self.store.set(Keys.plan(facts.generation), plan.to_json())
        self.jobs.put(Channels.ANNOUNCE, Announcement(
            facts.generation, tuple(sorted(command.live)), facts.redo_step, self.end_step,
            "; ".join(d.cause for d in facts.deaths), tuple(sorted(facts.joining)),
            -1 if facts.restore_step is None else facts.restore_step), facts.generation)
        for rank in facts.joining:
            # A replacement is timed from its admission, not from the last beat of the process it replaces.
            self.last_beat[rank] = time.time()
            self.beats.pop(rank, None)
            self.progress.pop(rank, None)
            self.member_from[rank] = facts.redo_step
            self.store.delete_key(Keys.join_ready(rank))
            self.store.set(Keys.join_generation(rank), str(facts.generation))
        self.plan = plan
        self.pending = _PendingRecovery(facts, choice, time.time(), command.live)

    def _forget_steps_from(self, step: int) -> None:
        """A checkpoint restore: steps from `step` on run again, so their records and checkpoint keys are stale."""
        for later in range(step, self.end_step):
            for rank in range(self.plan.num_replicas * self.plan.num_stages):
                self.store.delete_key(Keys.metrics(later, rank))
        for done in range(step + 1, self.end_step + 1):
            for stage in range(self.plan.num_stages):
                self.store.delete_key(Keys.checkpointed(done, stage))
        every = self.options.checkpoint.every
        self.pending_checkpoints = [d for d in range(step + 1, self.end_step + 1) if every > 0 and d % every == 0]
        self.next_step = min(self.next_step, step)
        self.previous_end = None

    def _fail(self, message: str) -> None:
        if not self.failing:
            self.failing = True
            self._drain()  # report the steps that completed before the failure
        _stop(self.processes)
        if self.options.cluster.nnodes > 1:
            self.store.set(Keys.ABORT_RUN, message)  # the other nodes' launchers stop their workers and report this
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
        resumed = [t.time for t in self._records(Channels.RESUMED, generation, live)]
        if facts.redo_step < self.end_step and len(resumed) < len(live) and not final:
            return
        self.pending = None
        if not facts.deaths and not facts.joining:
            return  # a drain whose joiner never came in (the run ended first): nothing happened
        joins = self._records(Channels.JOINED, generation, live)
        joined = [j.time for j in joins]
        formation = (f"{'/'.join(sorted({j.method for j in joins}))} {max(j.formation_s for j in joins):.3f} s"
                     if joins else "")
        causes, fault_times = [], []
        for death in facts.deaths:
            cause = death.cause
            fault = self.jobs.read(Channels.FAULT, death.rank)
            if fault is not None:
                self.jobs.delete(Channels.FAULT, death.rank)  # one record, one death: a later outside kill has none
                if self.wall0 <= fault.time <= death.time:
                    cause += f" during {fault.where}"
                    fault_times.append(fault.time)
            causes.append(cause)
        failure_time = min(fault_times) if fault_times else facts.started
        choice = pending.choice
        end = max(resumed) if resumed else time.time()
        transfers = self._records(Channels.TRANSFER, generation, sorted(facts.joining))
        migrations = self._records(Channels.MIGRATION, generation, live)
        # A join without a failure: the survivors' pause runs from their stop at the drain to their first action.
        paused_from = min((r.time for r in facts.reports), default=facts.started)
        recovery = Recovery(
            generation=generation, step=facts.redo_step + 1,
            workers=tuple("%d:%d" % self.plan.worker(d.rank) for d in facts.deaths), causes=tuple(causes),
            failed=tuple(sorted(facts.failed)), failure_time=failure_time,
            detected_s=(min(d.time for d in facts.deaths) - min(fault_times)) if fault_times and facts.deaths else None,
            plan_source=choice.source, plan_lookup_s=choice.seconds, plan_note=choice.note,
            formed_s=(max(joined) - pending.announced) if joined else 0.0,
            resumed_s=end - (failure_time if facts.deaths else paused_from), redone_actions=facts.redone_actions,
            redone_s=facts.redone_s, rolled_back=facts.rolled_back,
            joined=tuple("%d:%d" % self.plan.worker(r) for r in sorted(facts.joining)),
            transfer_bytes=sum(t.bytes for t in transfers),
            transfer_s=max((t.seconds for t in transfers), default=0.0),
            restored_step=facts.restore_step, steps_lost=facts.steps_lost,
            moved=tuple("%d:%d -> %d:%d" % (*self.plan.worker(d), *self.plan.worker(r)) for d, r in facts.moved),
            partition=tuple(choice.plan.partition), layers_moved=sum(m.layers_in for m in migrations),
            migration_bytes=sum(m.bytes for m in migrations) // 2,
            migration_s=max((m.seconds for m in migrations), default=0.0), formation=formation)
        self.recoveries.append(recovery)
        if self.options.progress:
            self.options.progress(recovery.line())
        if self.options.on_event:
            self.options.on_event(recovery)
        self.records.append({"event": "recovery", **asdict(recovery)})
        self._write_metrics()

    def _drain(self) -> None:
        """Report every step all live workers have finished, in order."""
        state = self.coordinator.state
        while self.next_step < self.end_step:
            live = [r for r in sorted(state.live) if self.member_from.get(r, 0) <= self.next_step]
            records = self._records(Channels.METRICS, self.next_step, live)
            if not live or len(records) < len(live):
                return
            metrics = self._step_metrics(self.next_step, records)
            self.previous_end = max(r.end for r in records)
            if self.options.debug.verify_replicas:
                _check_replicas(self.plan, metrics, self._fail)
            self.steps.append(metrics)
            self.records.append(asdict(metrics))
            if self.options.on_event:
                self.options.on_event(metrics)
            if len(self.steps) == 1:
                # Generation 0 has run a step, so every node's first launcher is in: a node launcher that starts from
                # now on is a repaired node and brings its workers back as replacements.
                self.store.set(Keys.RUNNING, "1")
            if self.options.progress:
                self.options.progress(f"step {metrics.step}/{self.end_step} loss {metrics.loss:.4f} "
                                      f"tokens/s {metrics.tokens_per_s:,.0f} period {metrics.period_s * 1e3:.1f} ms")
            self._write_metrics()
            self.next_step += 1

    def _write_metrics(self) -> None:
        if self.options.outputs.metrics_path:
            checkpoint.atomic_write_text(self.options.outputs.metrics_path,
                                         "".join(json.dumps(r) + "\n" for r in self.records))

    def _step_metrics(self, step: int, records: list[StepRecord]) -> StepMetrics:
        first = min(r.start for r in records)
        last = max(r.end for r in records)
        # Steady-state period: time between the completions of consecutive iterations (the first step: its span).
        period = last - self.previous_end if self.previous_end is not None else last - first
        losses = [r.stage_loss for r in records if r.stage_loss is not None]
        return StepMetrics(
            step=step + 1, loss=losses[0] if losses else 0.0,
            tokens_per_s=self.tokens_per_step / period if period > 0 else 0.0,
            period_s=period, step_time_s=last - first, elapsed_s=time.time() - self.wall0,
            grad_norm=grad_norm(records, self.plan.num_stages),
            worker_time_s={r.worker: r.end - r.start for r in records},
            digests={r.worker: r.digest for r in records if r.digest},
            worker_cpu_s={r.worker: r.cpu_s for r in records},
            generation=max(r.generation for r in records), end_time=last)

    def _mark_checkpoints(self) -> None:
        """Point `latest` at the newest step whose every stage shard is written (never at a partial one). Older
        pending steps go with it: a writer has one checkpoint in flight, so an older step still incomplete lost
        its writer and can no longer be written (its state is gone)."""
        # Only steps a worker can have reached (every worker is at most in next_step + 1) are looked up.
        complete = [d for d in self.pending_checkpoints if d <= self.next_step + 2
                    and self.store.check([Keys.checkpointed(d, s) for s in range(self.plan.num_stages)])]
        if not complete or not checkpoint.mark_latest(self.options.checkpoint.dir, complete[-1],
                                                      self.plan.num_stages, self.options.checkpoint.keep):
            return  # nothing new, or a shard is being written again (after a recovery): the next poll merges it
        self.pending_checkpoints = [d for d in self.pending_checkpoints if d > complete[-1]]
        self.coordinator.on_checkpoint(complete[-1])

    def _finish_nodes(self) -> None:
        """Multi-node: say the run is over; keep the store up until every node has said it is done."""
        if self.options.cluster.nnodes == 1:
            return
        self.store.set(Keys.FINISHED, "1")
        live = self.coordinator.state.live | self.done
        initial = self.plan_at_start.live_ranks()
        # A node is waited for while it has a live worker or its launcher still beats (a repaired node whose
        # replacements came too late to be admitted: they see the end and exit, then it says it is done too).
        now = time.time()
        beating = {n for n, t in self.node_last_beat.items() if now - t <= self.options.recovery.heartbeat_timeout_s}
        keys = [Keys.node_done(n) for n in range(1, self.options.cluster.nnodes) if n not in self.fenced_nodes
                and (set(node_ranks(initial, self.options.cluster.nnodes, n)) & live or n in beating)]
        deadline = time.time() + max(self.options.recovery.timeout_s, 60.0)
        while not self.store.check(keys) and time.time() < deadline:
            time.sleep(0.05)


def grad_norm(records: list[StepRecord], num_stages: int) -> float | None:
    """The global gradient norm of a step from its workers' records: the clipping norm when clipping, else the root of
    the stages' squared norms (one replica each: after the all-reduce every replica of a stage holds the same)."""
    norms = [r.grad_norm for r in records if r.grad_norm is not None]
    if norms:
        return norms[0]
    squares: dict[int, float] = {}
    for r in records:
        if r.grad_sq is not None:
            squares.setdefault(r.stage, r.grad_sq)
    if len(squares) < num_stages:
        return None  # a stage's record is missing (should not happen): no norm rather than a partial one
    return sum(squares[s] for s in range(num_stages)) ** 0.5


def _check_replicas(plan: Plan, metrics: StepMetrics, fail: Callable[[str], None]) -> None:
    """Fail the run if two live replicas of a stage hold different parameters after this step."""
    for stage in range(plan.num_stages):
        seen = {w: d for w, d in metrics.digests.items() if int(w.split(":")[1]) == stage}
        if len(set(seen.values())) > 1:
            fail(f"after step {metrics.step} the replicas of stage {stage} differ "
                 f"({', '.join(f'{w}={d[:12]}' for w, d in seen.items())}); the data-parallel all-reduce or the "
                 "optimizer is not deterministic across replicas")


def _follow(store: dist.Store, processes: dict[int, mp.process.BaseProcess], options: LaunchOptions,
            spawn: Callable[[int, bool], mp.process.BaseProcess]) -> None:
    """A node other than 0: report its workers' exits, carry out fences and respawns, stop when the run ends."""
    try:
        _follow_loop(store, processes, options, spawn)
    except StoreFenced:
        _stop(processes)
        raise RuntimeFailure(f"node {options.cluster.node_rank} was declared dead by the job's coordinator while it "
                             "did not respond (frozen or cut off), and the run went on without it; its workers have "
                             "been stopped. Start this node's launcher again (the same command) to re-join the run as a "
                             "repaired node") from None
    except dist.DistError:
        _stop(processes)
        raise RuntimeFailure(f"node {options.cluster.node_rank} lost contact with the job's store on node 0 "
                             f"({options.cluster.master_addr}:{options.cluster.master_port}): the run has ended or "
                             "node 0 is gone") \
            from None


def _follow_loop(store: dist.Store, processes: dict[int, mp.process.BaseProcess], options: LaunchOptions,
                 spawn: Callable[[int, bool], mp.process.BaseProcess]) -> None:
    reported: dict[int, int] = {}  # rank -> pid whose exit was reported
    for rank in processes:
        store.delete_key(Keys.fence(rank))
    while True:
        # Node 0 tells a frozen or cut-off node by its silence.
        store.add(Keys.node_heartbeat(options.cluster.node_rank), 1)
        for rank, process in list(processes.items()):
            if process.exitcode is not None and reported.get(rank) != process.pid:
                store.set(Keys.exited(rank), str(process.exitcode))
                reported[rank] = process.pid
                store.delete_key(Keys.fence(rank))
            elif process.exitcode is None and store.check([Keys.fence(rank)]):
                os.kill(process.pid, signal.SIGKILL)
            if process.exitcode is not None and store.check([Keys.respawn(rank)]):
                store.delete_key(Keys.respawn(rank))
                spawn(rank, True)
        if store.check([Keys.ABORT_RUN]):
            _stop(processes)
            raise RuntimeFailure(store.get(Keys.ABORT_RUN).decode())
        if store.check([Keys.FINISHED]) and all(p.exitcode is not None for p in processes.values()):
            store.set(Keys.node_done(options.cluster.node_rank), "1")
            return
        waiting = [p.sentinel for p in processes.values() if p.exitcode is None]
        if waiting:
            mp_connection.wait(waiting, timeout=0.1)
        else:
            time.sleep(0.1)


def _stop(processes: dict[int, mp.process.BaseProcess]) -> None:
    """Terminate every still-running worker (SIGTERM, then SIGKILL) and reap it: no orphans."""
    for p in processes.values():
        if p.exitcode is None:
            p.terminate()
            try:
                os.kill(p.pid, signal.SIGCONT)  # a frozen (SIGSTOPped) worker only acts on SIGTERM once continued
            except ProcessLookupError:
                pass
    deadline = time.time() + 3.0
    for p in processes.values():
        p.join(max(0.0, deadline - time.time()))
        if p.exitcode is None:
            p.kill()
            p.join(1.0)
