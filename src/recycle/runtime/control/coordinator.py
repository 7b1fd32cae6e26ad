"""The coordinator's decisions as a pure state machine: facts in (a worker died, stopped, hung, raised, a shard was
written, a plan was chosen), commands out (fence, abort a generation, announce the next one, respawn, mark a
checkpoint, fail the run). No processes, sockets or clocks of its own, so every transition is unit-tested with plain
values (tests/unit/test_coordinator.py)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Union

from recycle.ir.worker import Worker, workers_text
from recycle.runtime.protocol.records import StoppedReport

__all__ = ["Death", "Fence", "AbortGeneration", "Drain", "Respawn", "Move", "Announce", "FailRun", "MarkLatest",
           "Command", "RecoveryFacts", "RunState", "Checkpoints", "Repairs", "Coordinator", "describe_exit",
           "stale_heartbeats", "Progress", "track_progress", "hung_workers", "hang_limit_s"]


def describe_exit(exitcode: int) -> str:
    """How a process ended, in words: 'killed by SIGKILL', 'exited with code 3'."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def stale_heartbeats(last_beat: dict[int, float], ranks: frozenset[int], now: float, timeout_s: float) -> list[int]:
    """The ranks whose last heartbeat is older than `timeout_s` (a rank not yet seen counts from its entry)."""
    return sorted(r for r in ranks if r in last_beat and now - last_beat[r] > timeout_s)


@dataclass(frozen=True)
class Progress:
    """What the coordinator last saw of a worker's main thread, and since when it has not changed."""

    actions: int
    phase: str
    since: float


def track_progress(previous: Progress | None, actions: int, phase: str, now: float) -> Progress:
    """The progress after a beat that reports (`actions`, `phase`): `since` restarts whenever either changes."""
    if previous is not None and previous.actions == actions and previous.phase == phase:
        return previous
    return Progress(actions, phase, now)


def hung_workers(progress: dict[int, Progress], seen: Mapping[int, float], limit_s: float) -> list[int]:
    """The ranks whose main thread was seen computing one action for longer than `limit_s` while their heartbeat
    went on: `seen[rank]` is when its last beat was read, and the action counts up to that beat, not up to now (a
    worker frozen after its last beat is silent, not hung). A worker waiting on a peer ("comm") is not hung (the
    peer may be); a slow worker still starts actions."""
    return sorted(r for r, last in seen.items() if r in progress and progress[r].phase == "compute"
                  and last - progress[r].since > limit_s)


HANG_FLOOR_S = 10.0  # no automatic hang limit is shorter: a first action (allocation, warm-up) can take seconds
HANG_MARGIN = 20.0  # a hang: one action taking this many times the median step period


def hang_limit_s(explicit_s: float | None, step_periods: list[float], timeout_s: float) -> float:
    """How long one action may run before its worker counts as hung: `explicit_s` (--hang-timeout) when given, else
    HANG_MARGIN times the median step period seen so far (one action is a small part of a step), never below
    HANG_FLOOR_S; before the first step, the op timeout (nothing is known about the run's speed yet)."""
    if explicit_s is not None:
        return explicit_s
    if not step_periods:
        return max(HANG_FLOOR_S, timeout_s)
    ordered = sorted(step_periods)
    return max(HANG_FLOOR_S, HANG_MARGIN * ordered[len(ordered) // 2])


@dataclass(frozen=True)
class Death:
    rank: int
    cause: str  # "killed by SIGKILL", "stopped responding (no heartbeat for 3.0 s)", ...
    time: float  # when the coordinator learned it


# -- commands ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fence:
    """Shut the worker out of the store (whatever it does from now on is refused, so it can never write a key the job
    reads or join a later generation) and SIGKILL it where its launcher can (it may be frozen, not dead)."""

    rank: int
    reason: str


@dataclass(frozen=True)
class AbortGeneration:
    """Tell every worker of `generation` to stop at its next action and report."""

    generation: int
    reason: str


@dataclass(frozen=True)
class Drain:
    """Ask every worker of `generation` to stop at the iteration boundary before `stop_before` (a 0-based step) and
    report (to admit joiners)."""

    generation: int
    reason: str
    stop_before: int


@dataclass(frozen=True)
class Respawn:
    """Start replacement workers for these ranks (a stage lost every replica: they restore from a checkpoint)."""

    ranks: frozenset[int]
    reason: str


@dataclass(frozen=True)
class Move:
    """Reshape: stop `donor` (a live worker of a stage that has replicas to spare) and start `rank` (the slot of a
    stage that lost every replica, in the donor's pipeline, on the same node) in its place; it restores from the
    checkpoint like everyone else."""

    donor: int
    rank: int
    reason: str


@dataclass(frozen=True)
class RecoveryFacts:
    """What one recovery found and decided (the launcher adds timings and prints it)."""

    generation: int  # the new generation
    deaths: tuple[Death, ...]
    failed: frozenset[tuple[int, int]]  # every worker down now, as (replica, stage)
    redo_step: int
    redone_actions: int  # finished actions that the roll-back throws away
    redone_s: float
    rolled_back: int  # survivors that had already applied redo_step's optimizer step and restored their snapshot
    started: float  # when the coordinator first learned of the failure (or of the joiner)
    reports: tuple[StoppedReport, ...]
    joining: frozenset[int] = frozenset()  # ranks re-admitted in this generation
    restore_step: int | None = None  # every worker loads this checkpoint (a stage had lost every replica)
    steps_lost: int = 0  # applied steps thrown away by the restore
    moved: tuple[tuple[int, int], ...] = ()  # (donor rank, rank it now runs as): the reshape of a lost stage
    lost_actions: int = 0  # the failed workers' actions of the interrupted iteration that may have finished (if kept)
    kept: str = ""  # whether the survivors kept the interrupted iteration's work, and why not (the launcher's word)
    # Why the generation was formed again although no worker died and none joined (workers lost contact, e.g. a
    # collective timed out): empty otherwise. Such a recovery is reported too: it costs the run its timeout.
    lost_contact: str = ""


@dataclass(frozen=True)
class Announce:
    """Form generation `facts.generation` from `live`, on the plan for `facts.failed`, from `facts.redo_step`."""

    live: frozenset[int]
    facts: RecoveryFacts


@dataclass(frozen=True)
class FailRun:
    message: str


@dataclass(frozen=True)
class MarkLatest:
    """Every stage's shard of the checkpoint after `step` steps is written: merge it and point `latest` at it; once
    that is done, say so with on_checkpoint (it can fail while a writer saves the step again: then it comes again)."""

    step: int


Command = Union[Fence, AbortGeneration, Drain, Respawn, Move, Announce, FailRun, MarkLatest]


@dataclass(frozen=True)
class RunState:
    """The run as data. `live` are the ranks of the current generation not known to be dead."""

    generation: int
    live: frozenset[int]
    failed: frozenset[tuple[int, int]]
    recovering: bool = False
    finished: bool = False
    deaths: tuple[Death, ...] = ()  # of the recovery under way
    reports: dict[int, StoppedReport] = field(default_factory=dict)  # of the recovery under way, by rank
    done: frozenset[int] = frozenset()  # ranks that finished every step and exited
    recovery_started: float | None = None
    retries: int = 0  # recoveries in a row in which no worker died
    joining: frozenset[int] = frozenset()  # replacement workers that are up and waiting to be admitted
    restore: bool = False  # this recovery restores from the latest checkpoint
    aborted: bool = False  # AbortGeneration was sent for this generation
    latest_checkpoint: int | None = None  # the newest complete checkpoint (steps done)
    moved: tuple[tuple[int, int], ...] = ()  # of the recovery under way: (donor rank, rank it now runs as)
    moving: frozenset[int] = frozenset()  # ranks of `moved` whose new process is not up yet (the restore waits)
    stop_reason: str = ""  # why the recovery under way stopped the generation (its first sign)


class Checkpoints:
    """Which checkpoints the run still waits for and which of their stage shards are written: a step is complete
    (ready to be marked `latest`) once every stage's shard of it is, never before."""

    def __init__(self, num_stages: int, every: int, start_step: int, end_step: int) -> None:
        self.num_stages, self.every, self.end_step = num_stages, every, end_step
        self.pending = self._due_after(start_step)
        self.written: set[tuple[int, int]] = set()  # (done steps, stage) of pending steps

    def _due_after(self, step: int) -> list[int]:
        return [d for d in range(step + 1, self.end_step + 1) if self.every > 0 and d % self.every == 0]

    def awaited(self, next_step: int) -> list[tuple[int, int]]:
        """The shards (done steps, stage) not yet seen written, of steps a worker can have reached: every worker is
        at most in next_step + 1, so it can have written at most done step next_step + 2."""
        return [(d, s) for d in self.pending if d <= next_step + 2 for s in range(self.num_stages)
                if (d, s) not in self.written]

    def newest_complete(self, shards: Iterable[tuple[int, int]]) -> int | None:
        """With `shards` written too, the newest pending step whose every shard is written (None: none is)."""
        self.written.update(shards)
        complete = [d for d in self.pending if all((d, s) in self.written for s in range(self.num_stages))]
        return complete[-1] if complete else None

    def marked(self, step: int) -> None:
        """`latest` points at `step`. Older pending steps go with it: a writer has one checkpoint in flight, so an
        older step still incomplete lost its writer and can no longer be written (its state is gone)."""
        self.pending = [d for d in self.pending if d > step]
        self.written = {(d, s) for d, s in self.written if d > step}

    def restart_from(self, step: int) -> None:
        """A checkpoint restore: the steps after `step` run again, and so are written again."""
        self.pending = self._due_after(step)
        self.written = {(d, s) for d, s in self.written if d <= step}


class Repairs:
    """When dead workers of node 0 come back: a repair time per rank (--respawn-after, chaos) and scripted re-joins
    at a step. A repaired machine takes the slot a reshape's donor left empty when a moved worker holds its own."""

    def __init__(self, local: frozenset[int], respawn_after_s: float | None,
                 rejoins: Iterable[tuple[int, int]]) -> None:
        self.local, self.respawn_after_s = local, respawn_after_s
        self.at: dict[int, float] = {}  # rank -> when to bring it back
        self.vacated: dict[int, int] = {}  # a lost stage's slot -> the slot its reshape donor left empty
        self.rejoins = sorted(rejoins, key=lambda item: item[1])  # (rank, 0-based step)

    def due(self, now: float, next_step: int, failed: frozenset[int], running: frozenset[int]) -> list[int]:
        """The ranks to start again now, given the failed ranks and the local ones whose process runs."""
        ranks: list[int] = []
        for rank, at in sorted(self.at.items()):
            if now < at:
                continue
            if self.vacated.get(rank) in failed:
                del self.at[rank]
                ranks.append(self.vacated.pop(rank))
            elif rank in failed:
                del self.at[rank]
                ranks.append(rank)
            elif rank not in running:
                del self.at[rank]  # nothing to repair
            # else: a frozen worker not yet declared dead: repaired once it is
        while self.rejoins and next_step >= self.rejoins[0][1]:
            rank, _ = self.rejoins.pop(0)
            if rank in failed and rank in self.local:
                ranks.append(rank)
        return ranks


class Coordinator:
    """Decides what a failure means. Call the `on_*` methods with facts; execute the commands they return.

    Rules:
    - A worker that dies (any exit but 0, or a missed heartbeat, which is fenced) leaves the live set; its stage's
      surviving replicas take its micro-batches in the next generation.
    - A stage with no replica left has lost its weights: with a complete checkpoint every worker restores it, and
      the lost stage is refilled: with `reshape`, by moving live workers from the fullest stages into free slots
      of the emptiest ones, each within its own pipeline, until the stages' worker counts differ by at most one
      (no spare machine needed: the live workers are re-laid out as evenly as a D' = live // S layout would hold
      them, the global batch is unchanged, and every worker restores the checkpoint anyway, so a move costs
      nothing extra), otherwise (or with no stage to spare) by respawning the dead workers (a repaired machine).
      Without a checkpoint the run fails with a message that says so.
    - A replacement worker that is up waits until the others stop at an iteration boundary, then joins the next
      generation and receives its stage's state from a live replica (or the checkpoint, when restoring).
    - A worker that raises an ordinary exception (not a communication error) fails the run: that is a bug or bad
      input that would recur on whichever replica re-ran the micro-batch.
    - Survivors stop and report; once every live worker of the generation has reported (or died), the next
      generation is announced. Every survivor rolls back to the end of the oldest iteration that some survivor has
      not yet applied, so all stages redo the same iterations (at most the one in flight).
    - Recoveries in which nobody died (a transient network error) are retried with the same workers, at most
      `max_retries` times in a row.
    - A plan for the new generation must run exactly its workers (and those that finished); otherwise the run fails.
    - Steps are reported in order, each once every member has finished it; a replacement is a member from its redo
      step on. A checkpoint is complete once every stage's shard is written.
    - With `respawn_after_s`, a local worker whose process failed is started again after that delay (a stand-in for
      repair); scripted `rejoins` bring a worker back once the reports reach their step.
    """

    def __init__(self, num_replicas: int, num_stages: int, live: frozenset[int], failed: frozenset[tuple[int, int]],
                 end_step: int, report_timeout_s: float, max_retries: int = 3, checkpoint_every: int = 0,
                 reshape: bool = True, start_step: int | None = None, local: frozenset[int] = frozenset(),
                 respawn_after_s: float | None = None, rejoins: Iterable[tuple[int, int]] = ()) -> None:
        self.num_replicas = num_replicas
        self.num_stages = num_stages
        self.end_step = end_step
        self.checkpointing = checkpoint_every > 0
        self.reshape = reshape
        self.report_timeout_s = report_timeout_s
        self.max_retries = max_retries
        # A checkpointing run can always restore its start: step 0 is a pure function of the seed, a resumed run's
        # start is the checkpoint it resumed from. So a stage lost before the first checkpoint completes is survived.
        self.state = RunState(generation=0, live=frozenset(live), failed=frozenset(failed),
                              latest_checkpoint=start_step if self.checkpointing else None)
        self.next_step = start_step or 0  # the 0-based step reported next
        self.done: frozenset[int] = frozenset()  # ranks that finished every step and exited, over all generations
        self.member_from: dict[int, int] = {}  # rank -> first step it reports (a replacement: its redo step)
        self.announced: RecoveryFacts | None = None  # the generation announced, until its plan is chosen
        self.checkpoints = Checkpoints(num_stages, checkpoint_every, self.next_step, end_step)
        self.repairs = Repairs(local, respawn_after_s, rejoins)

    def adopt(self, generation: int, live: frozenset[int], done: frozenset[int], next_step: int,
              member_from: Iterable[tuple[int, int]], latest_checkpoint: int | None) -> None:
        """A restarted coordinator takes the run over as its workers told it (control.resync.rebuild): `generation`
        with its members `live` (`done` of them finished), steps reported from `next_step`."""
        failed = frozenset(self.worker(r) for r in range(self.num_replicas * self.num_stages) if r not in live)
        latest = latest_checkpoint if latest_checkpoint is not None else self.state.latest_checkpoint
        self.state = RunState(generation=generation, live=live, failed=failed, done=done,
                              latest_checkpoint=latest if self.checkpointing else None)
        self.done = done
        self.next_step = next_step
        self.member_from = dict(member_from)
        self.checkpoints = Checkpoints(self.num_stages, self.checkpoints.every,
                                       next_step if latest is None else min(latest, next_step), self.end_step)

    def worker(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.num_stages)

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.num_stages + stage

    def members(self, step: int) -> list[int]:
        """The live ranks whose record of `step` (0-based) it takes to report it."""
        return [r for r in sorted(self.state.live) if self.member_from.get(r, 0) <= step]

    def participants(self) -> frozenset[int]:
        """Every rank of the run that has not died: the live ones and those that finished."""
        return self.state.live | self.done

    # -- facts ---------------------------------------------------------------------------------------------------
    def on_death(self, rank: int, cause: str, now: float, fence: bool = False) -> list[Command]:
        """A live worker is gone: its process ended, or it stopped responding (`fence`: kill it to be sure)."""
        state = self.state
        if rank not in state.live and (rank in state.joining or rank in state.moving):
            # A replacement (or a moved worker's new process) died before it was admitted.
            self.state = replace(state, joining=state.joining - {rank}, moving=state.moving - {rank})
            return ([Fence(rank, cause)] if fence else []) + self._maybe_announce(now)
        if rank not in state.live or state.finished:
            return []
        commands: list[Command] = [Fence(rank, cause)] if fence else []
        replica, stage = self.worker(rank)
        live = state.live - {rank}
        failed = state.failed | {(replica, stage)}
        self.state = replace(state, live=live, failed=failed, deaths=state.deaths + (Death(rank, cause, now),))
        if not any(self.worker(r)[1] == stage for r in live):
            lost = workers_text((w for w in failed if w[1] == stage), ", ", most=8)
            what = (f"{cause}, and it was the last live replica of stage {stage} (down: {lost}); nothing holds that "
                    "stage's weights any more")
            if not self.checkpointing or self.state.latest_checkpoint is None:
                self.state = replace(self.state, finished=True)
                why = ("and this run writes no checkpoints (pass --checkpoint-dir DIR to let the run restore by "
                       "itself)" if not self.checkpointing else "and no checkpoint is complete yet")
                return commands + [FailRun(
                    f"{what}, {why}. Restart with --resume DIR from a checkpoint if you have one (workers still down "
                    "can be left out with --down R:S)")]
            self.state = replace(self.state, restore=True)
            restoring = f"restoring checkpoint step {self.state.latest_checkpoint}"
            moves = self._balancing_moves() if self.reshape else []
            for donor, target in moves:
                commands += self._move(donor, target, f"{what}: {restoring}")
            if any(self.worker(r)[1] == stage for r in self.state.joining | self.state.moving):
                pass  # a replacement (or a moved worker) for the stage is up or starting: it restores the checkpoint
            else:
                respawn = frozenset(self.rank(p, s) for p, s in failed if s == stage) - self.state.joining
                commands += [Respawn(respawn, f"{what}: {restoring}")]
        return commands + self._begin_recovery(now, cause) + self._maybe_announce(now)

    def _balancing_moves(self) -> list[tuple[int, int]]:
        """Moves (donor rank, slot rank) that even out the stages' worker counts: repeatedly, the last live replica
        of the fullest stage (ties: the lowest stage) that has a free slot of the emptiest stage (ties: the lowest)
        in its own pipeline moves there, while the two counts differ by two or more. A free slot is a failed one
        that no replacement or earlier move is filling. Each move lowers the sum of squared counts: it ends."""
        state = self.state
        donors = set(state.live)
        holders = [{r for r in state.live | state.joining | state.moving if self.worker(r)[1] == s}
                   for s in range(self.num_stages)]
        taken = state.joining | state.moving
        free = {self.rank(p, s) for p, s in state.failed} - taken
        moves: list[tuple[int, int]] = []
        while True:
            counts = [len(h) for h in holders]
            target_stage = min(range(self.num_stages), key=lambda s: (counts[s], s))
            options = [(counts[self.worker(r)[1]], -self.worker(r)[1], r) for r in donors
                       if counts[self.worker(r)[1]] - counts[target_stage] >= 2
                       and self.rank(self.worker(r)[0], target_stage) in free]
            if not options:
                return moves
            _, _, donor = max(options)
            replica, donor_stage = self.worker(donor)
            target = self.rank(replica, target_stage)
            moves.append((donor, target))
            donors.discard(donor)
            free.discard(target)
            holders[donor_stage].discard(donor)
            holders[target_stage].add(target)

    def _move(self, donor: int, rank: int, reason: str) -> list[Command]:
        """Take `donor` out of the live set (its slot becomes a failed one) and start `rank` (a slot of its own
        pipeline) in its place."""
        replica, donor_stage = self.worker(donor)
        stage = self.worker(rank)[1]
        state = self.state
        self.state = replace(state, live=state.live - {donor}, failed=state.failed | {(replica, donor_stage)},
                             moved=state.moved + ((donor, rank),), moving=state.moving | {rank})
        self.repairs.vacated[rank] = donor
        return [Move(donor, rank, f"{reason}; worker {Worker(replica, donor_stage)} moves to stage {stage} (reshape: no "
                                  "spare machine needed)")]

    def on_join_ready(self, rank: int, now: float) -> list[Command]:
        """A replacement worker for `rank` is up. It is admitted at the next iteration boundary."""
        state = self.state
        if state.finished or rank in state.live or rank in state.joining:
            return []
        if self.worker(rank) not in state.failed:
            return []
        if state.live <= state.done:
            return []  # every live worker has finished the run: no generation is left to admit it into
        self.state = replace(state, joining=state.joining | {rank}, moving=state.moving - {rank})
        if state.recovering:
            return self._maybe_announce(now)
        self.state = replace(self.state, recovering=True, recovery_started=now)
        # Every worker is at most in next_step + 1 now: the one after is a boundary each can still stop at.
        return [Drain(state.generation, f"worker {'%d:%d' % self.worker(rank)} is back", self.next_step + 3)]

    def on_shards_written(self, shards: Iterable[tuple[int, int]]) -> list[Command]:
        """These stage shards (done steps, stage) are written (of those `awaited_shards` asked about; none is a
        poll): mark the newest checkpoint whose every shard is, until on_checkpoint says it is marked."""
        step = self.checkpoints.newest_complete(shards)
        return [] if step is None else [MarkLatest(step)]

    def awaited_shards(self) -> list[tuple[int, int]]:
        """The stage shards (done steps, stage) worth looking for now."""
        return self.checkpoints.awaited(self.next_step)

    def on_checkpoint(self, done_steps: int) -> None:
        """The checkpoint of `done_steps` is complete and marked `latest`."""
        latest = self.state.latest_checkpoint
        self.state = replace(self.state, latest_checkpoint=done_steps if latest is None else max(latest, done_steps))
        self.checkpoints.marked(done_steps)

    def on_step_reported(self, step: int) -> None:
        """Every member's record of `step` (0-based) is in and the step is reported."""
        self.next_step = step + 1

    def on_plan_chosen(self, live_ranks: list[int]) -> list[Command]:
        """The plan provider's plan for the generation just announced runs `live_ranks`. Refused (the run fails)
        unless they are its live workers and those that finished. Accepted: its replacements report from the redo
        step on, and a restore reports (and checkpoints) the steps after its checkpoint again."""
        facts = self.announced
        assert facts is not None, "on_plan_chosen without an announced generation"
        if set(live_ranks) != self.participants():
            self.state = replace(self.state, finished=True)
            return [FailRun(f"the plan provider returned a plan whose live workers {live_ranks} are not the live "
                            f"workers {sorted(self.state.live)}")]
        self.announced = None
        for rank in facts.joining:
            self.member_from[rank] = facts.redo_step
        if facts.restore_step is not None:
            self.next_step = min(self.next_step, facts.restore_step)
            self.checkpoints.restart_from(facts.restore_step)
        return []

    def on_crashed(self, rank: int, now: float) -> None:
        """A worker's process ended in failure (not fenced, not done): a local one comes back after respawn_after_s."""
        if rank in self.repairs.local and self.repairs.respawn_after_s is not None:
            self.repairs.at[rank] = now + self.repairs.respawn_after_s

    def on_repair_planned(self, rank: int, at: float) -> None:
        """A local worker's machine is repaired at `at` (chaos: the repair of what it broke)."""
        self.repairs.at[rank] = at

    def on_repair_check(self, now: float, running: frozenset[int]) -> list[Command]:
        """Time passes; `running`: the local ranks whose process runs. Respawn the workers whose repair is due."""
        failed = frozenset(self.rank(p, s) for p, s in self.state.failed)
        return [Respawn(frozenset({rank}), "its machine is repaired")
                for rank in self.repairs.due(now, self.next_step, failed, running)]

    def on_stopped(self, report: StoppedReport, now: float) -> list[Command]:
        """A worker left the current generation after a communication error or an abort."""
        return self.on_stopped_all([report], now)

    def on_stopped_all(self, reports: list[StoppedReport], now: float) -> list[Command]:
        """Workers left the current generation (the reports that came in since the last look, in rank order): the
        same as one on_stopped per report, with one copy of the state and one check for the announcement, not one
        per report (at 16,384 workers that was quadratic)."""
        state = self.state
        # A late report of an older generation, or from a worker already counted as dead, is left out.
        fresh = [r for r in reports if r.generation == state.generation and r.rank in state.live]
        if state.finished or not fresh:
            return []
        # While draining for a joiner, reports are expected; otherwise a report is the first sign of a failure.
        first = fresh[0]
        commands = [] if state.recovering else \
            self._begin_recovery(now, f"worker {'%d:%d' % self.worker(first.rank)} stopped: {first.error}")
        self.state = replace(self.state, reports={**self.state.reports, **{r.rank: r for r in fresh}})
        return commands + self._maybe_announce(now)

    def on_done(self, rank: int, now: float) -> list[Command]:
        """A worker ran every step and exited cleanly. It counts as reported (with every step applied) if a failure
        at the very end, in the final barrier, starts a recovery it will never join."""
        state = self.state
        if rank not in state.live:
            return []
        self.done |= {rank}
        if state.finished:
            return []
        self.state = replace(state, done=state.done | {rank})
        return self._maybe_announce(now)

    def on_error(self, rank: int, description: str) -> list[Command]:
        """A worker raised an exception that is not a communication error: stop the run with `description`."""
        if self.state.finished:
            return []
        self.state = replace(self.state, finished=True)
        return [FailRun(description)]

    def on_tick(self, now: float) -> list[Command]:
        """Time passes: a live worker that has not reported within report_timeout_s of the failure is hung."""
        state = self.state
        if not state.recovering or state.finished or state.recovery_started is None:
            return []
        if now - state.recovery_started <= self.report_timeout_s:
            return []
        commands: list[Command] = []
        for rank in sorted(state.live - set(state.reports) - state.done):
            replica, stage = self.worker(rank)
            commands += self.on_death(rank, f"worker {replica}:{stage} (rank {rank}) did not stop within "
                                      f"{self.report_timeout_s:g} s of the failure (fenced)", now, fence=True)
        if self.state.restore and not self.state.finished and not commands:
            if self.state.moving and self._every_stage_held():
                # Moved workers that evened out the stages are slow to start: go on without them; they are
                # admitted later like any replacement.
                self.state = replace(self.state, moving=frozenset())
                return self._maybe_announce(now)
            self.state = replace(self.state, finished=True)
            return [FailRun(f"a stage lost every replica and no replacement worker came up within "
                            f"{self.report_timeout_s:g} s to restore checkpoint step {self.state.latest_checkpoint}; "
                            "restart with --resume from the checkpoint directory")]
        return commands

    def on_finished(self) -> None:
        self.state = replace(self.state, finished=True)

    def _every_stage_held(self) -> bool:
        """Every stage has a live worker or an admitted-at-the-boundary replacement."""
        held = {self.worker(r)[1] for r in self.state.live | self.state.joining}
        return len(held) == self.num_stages

    # -- transitions ---------------------------------------------------------------------------------------------
    def _begin_recovery(self, now: float, reason: str) -> list[Command]:
        """Stop the generation now (a drain for a joiner becomes an abort when something fails meanwhile)."""
        if self.state.aborted:
            return []
        started = self.state.recovery_started if self.state.recovering else now
        self.state = replace(self.state, recovering=True, aborted=True, recovery_started=started,
                             stop_reason=self.state.stop_reason or reason)
        return [AbortGeneration(self.state.generation, reason)]

    def _maybe_announce(self, now: float) -> list[Command]:
        state = self.state
        if not state.recovering or state.finished:
            return []
        # (counted first: the set test below walks every live rank, and runs on each look at new reports)
        if len(state.reports) + len(state.done) < len(state.live) or not state.live <= set(state.reports) | state.done:
            return []
        if state.restore and (state.moving or not self._every_stage_held()):
            return []  # wait for every moved worker and a replacement in every lost stage (on_tick: timeout)
        retries = 0 if state.deaths or state.joining else state.retries + 1
        if retries > self.max_retries:
            self.state = replace(state, finished=True)
            errors = "; ".join(sorted({r.error for r in state.reports.values()}))[:500]
            return [FailRun(f"workers lost contact {retries} times in a row without any worker failing ({errors}); "
                            "check the network between the nodes, or raise --timeout if the peers are only slow")]
        if not state.live:
            # Every other worker has finished the run and exited (a replacement got ready, or died, too late to be
            # admitted): there is no generation left to form.
            self.state = replace(state, recovering=False, joining=frozenset())
            return []
        reports = [state.reports[r] for r in sorted(state.live) if r in state.reports]
        applied = [r.applied for r in reports] + [self.end_step - 1] * len(state.live & state.done - set(state.reports))
        redo = min(applied) + 1
        steps_lost = 0
        if state.restore:
            assert state.latest_checkpoint is not None
            steps_lost = max(applied) + 1 - state.latest_checkpoint
            redo = state.latest_checkpoint
        rolled = [r for r in reports if r.applied >= redo]
        redone = sum(r.current_actions for r in reports) + sum(r.previous_actions for r in rolled)
        redone_s = sum(r.current_s for r in reports) + sum(r.previous_s for r in rolled)
        # Finished workers exited: the rest only need to finish too (redo = end); a joiner is only worth admitting
        # while there are steps left to run together.
        joining = state.joining if redo < self.end_step else frozenset()
        live = (state.live - state.done) | joining
        failed = state.failed - {self.worker(r) for r in joining}
        generation = state.generation + 1
        facts = RecoveryFacts(generation, state.deaths, failed, redo, redone, redone_s, len(rolled),
                              state.recovery_started if state.recovery_started is not None else now, tuple(reports),
                              joining=joining, restore_step=redo if state.restore else None, steps_lost=steps_lost,
                              moved=state.moved, lost_contact=state.stop_reason if retries else "")
        self.state = RunState(generation=generation, live=live, failed=failed, retries=retries,
                              joining=state.joining - joining, latest_checkpoint=state.latest_checkpoint)
        self.announced = facts
        return [Announce(live, facts)]
