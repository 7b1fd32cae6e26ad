"""The coordinator's decisions as a pure state machine: facts in (a worker died, stopped, hung, raised), commands
out (fence, abort a generation, announce the next one, fail the run). No processes, sockets or clocks of its own,
so every transition is unit-tested with plain values (tests/unit/test_coordinator.py)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field, replace
from typing import Union

from recycle.runtime.control import StoppedReport

__all__ = ["Death", "Fence", "AbortGeneration", "Announce", "FailRun", "Command", "RecoveryFacts", "RunState",
           "Coordinator", "describe_exit", "stale_heartbeats"]


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
class Death:
    rank: int
    cause: str  # "killed by SIGKILL", "stopped responding (no heartbeat for 3.0 s)", ...
    time: float  # when the coordinator learned it


# -- commands ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fence:
    """SIGKILL the worker (it may be frozen, not dead) so it can never send stale tensors again."""

    rank: int
    reason: str


@dataclass(frozen=True)
class AbortGeneration:
    """Tell every worker of `generation` to stop at its next action and report."""

    generation: int
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
    started: float  # when the coordinator first learned of the failure
    reports: tuple[StoppedReport, ...]


@dataclass(frozen=True)
class Announce:
    """Form generation `facts.generation` from `live`, on the plan for `facts.failed`, from `facts.redo_step`."""

    live: frozenset[int]
    facts: RecoveryFacts


@dataclass(frozen=True)
class FailRun:
    message: str


Command = Union[Fence, AbortGeneration, Announce, FailRun]


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


class Coordinator:
    """Decides what a failure means. Call the `on_*` methods with facts; execute the commands they return.

    Rules:
    - A worker that dies (any exit but 0, or a missed heartbeat, which is fenced) leaves the live set; its stage's
      surviving replicas take its micro-batches in the next generation. A stage with no replica left fails the run
      (nothing holds its weights: restore from a checkpoint).
    - A worker that raises an ordinary exception (not a communication error) fails the run: that is a bug or bad
      input that would recur on whichever replica re-ran the micro-batch.
    - Survivors stop and report; once every live worker of the generation has reported (or died), the next
      generation is announced. Every survivor rolls back to the end of the oldest iteration that some survivor has
      not yet applied, so all stages redo the same iterations (at most the one in flight).
    - Recoveries in which nobody died (a transient network error) are retried with the same workers, at most
      `max_retries` times in a row.
    """

    def __init__(self, num_replicas: int, num_stages: int, live: frozenset[int], failed: frozenset[tuple[int, int]],
                 end_step: int, report_timeout_s: float, max_retries: int = 3) -> None:
        self.num_replicas = num_replicas
        self.num_stages = num_stages
        self.end_step = end_step
        self.report_timeout_s = report_timeout_s
        self.max_retries = max_retries
        self.state = RunState(generation=0, live=frozenset(live), failed=frozenset(failed))

    def worker(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.num_stages)

    # -- facts ---------------------------------------------------------------------------------------------------
    def on_death(self, rank: int, cause: str, now: float, fence: bool = False) -> list[Command]:
        """A live worker is gone: its process ended, or it stopped responding (`fence`: kill it to be sure)."""
        state = self.state
        if rank not in state.live or state.finished:
            return []
        commands: list[Command] = [Fence(rank, cause)] if fence else []
        replica, stage = self.worker(rank)
        live = state.live - {rank}
        failed = state.failed | {(replica, stage)}
        self.state = replace(state, live=live, failed=failed, deaths=state.deaths + (Death(rank, cause, now),))
        if not any(divmod(r, self.num_stages)[1] == stage for r in live):
            self.state = replace(self.state, finished=True)
            lost = ", ".join(f"{p}:{s}" for p, s in sorted(failed) if s == stage)
            return commands + [FailRun(
                f"worker {replica}:{stage} {cause}, and it was the last live replica of stage {stage} (down: {lost}); "
                "nothing holds that stage's weights any more, so the run cannot continue by re-routing. Restart with "
                "--resume DIR from the last checkpoint (the workers still down can be left out with --down R:S)")]
        return commands + self._begin_recovery(now, f"worker {replica}:{stage} {cause}") + self._maybe_announce(now)

    def on_stopped(self, report: StoppedReport, now: float) -> list[Command]:
        """A worker left the current generation after a communication error or an abort."""
        state = self.state
        if state.finished or report.generation != state.generation or report.rank not in state.live:
            return []  # a late report of an older generation, or from a worker already counted as dead
        commands = self._begin_recovery(now, f"worker {'%d:%d' % self.worker(report.rank)} stopped: {report.error}")
        self.state = replace(self.state, reports={**self.state.reports, report.rank: report})
        return commands + self._maybe_announce(now)

    def on_done(self, rank: int, now: float) -> list[Command]:
        """A worker ran every step and exited cleanly. It counts as reported (with every step applied) if a failure
        at the very end, in the final barrier, starts a recovery it will never join."""
        state = self.state
        if rank not in state.live or state.finished:
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
            commands += self.on_death(rank, f"did not stop within {self.report_timeout_s:g} s of the failure", now,
                                      fence=True)
        return commands

    def on_finished(self) -> None:
        self.state = replace(self.state, finished=True)

    # -- transitions ---------------------------------------------------------------------------------------------
    def _begin_recovery(self, now: float, reason: str) -> list[Command]:
        if self.state.recovering:
            return []
        self.state = replace(self.state, recovering=True, recovery_started=now)
        return [AbortGeneration(self.state.generation, reason)]

    def _maybe_announce(self, now: float) -> list[Command]:
        state = self.state
        if not state.recovering or state.finished or not state.live <= set(state.reports) | state.done:
            return []
        retries = 0 if state.deaths else state.retries + 1
        if retries > self.max_retries:
            self.state = replace(state, finished=True)
            errors = "; ".join(sorted({r.error for r in state.reports.values()}))[:500]
            return [FailRun(f"workers lost contact {retries} times in a row without any worker failing ({errors}); "
                            "check the network between the nodes, or raise --timeout if the peers are only slow")]
        reports = [state.reports[r] for r in sorted(state.live) if r in state.reports]
        applied = [r.applied for r in reports] + [self.end_step - 1] * len(state.live & state.done - set(state.reports))
        redo = min(applied) + 1
        redone = sum(r.current_actions + (r.previous_actions if r.applied >= redo else 0) for r in reports)
        redone_s = sum(r.current_s + (r.previous_s if r.applied >= redo else 0.0) for r in reports)
        generation = state.generation + 1
        facts = RecoveryFacts(generation, state.deaths, state.failed, redo, redone, redone_s,
                              sum(r.applied >= redo for r in reports),
                              state.recovery_started if state.recovery_started is not None else now, tuple(reports))
        live = state.live - state.done  # finished workers exited: the rest only need to finish too (redo = end)
        self.state = RunState(generation=generation, live=live, failed=state.failed, retries=retries)
        return [Announce(live, facts)]
