"""Replay a unit timeline over a training job for several systems: throughput over time, goodput, time lost by cause.

Definitions (seconds, samples):
* mean_throughput = (integral of the instantaneous rate over the trace) / duration -- the time-average of the
  plotted curve (what the paper reports as "average throughput"); it includes work later rolled back.
* goodput = useful samples / (duration x fault-free rate), where useful samples exclude work rolled back to a
  checkpoint. 1.0 = as much training as a job that never failed.
* time lost by cause: fault-free-equivalent seconds, so that duration = useful / fault-free rate + sum(lost);
  running at rate r < fault-free for dt loses (1 - r / fault-free) * dt.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from recycle.traces.mapping import UnitTimeline
from recycle.traces.model import CAUSES, CheckpointTiming, Decision, JobContext, SystemModel

__all__ = ["SystemRun", "replay", "replay_all", "JobResult", "rate_at", "compare_series", "binned"]

_EPS = 1e-9


@dataclass(frozen=True)
class SystemRun:
    """One system's replay: a step series of (time_s, samples/s) and the summary numbers."""

    name: str
    label: str
    series: tuple[tuple[float, float], ...]  # (time from which this rate holds, rate); pauses are rate 0
    steady: tuple[tuple[float, float], ...]  # the running rate (pauses ignored): what the system runs at
    duration_s: float
    processed_samples: float
    useful_samples: float
    fault_free_rate: float
    lost_s: dict[str, float]
    events: int  # changes the system reacted to
    rollbacks: int
    notes: tuple[str, ...] = ()

    @property
    def mean_throughput(self) -> float:
        return self.processed_samples / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def goodput(self) -> float:
        denom = self.duration_s * self.fault_free_rate
        return self.useful_samples / denom if denom > 0 else 0.0

    @property
    def unable_reason(self) -> str:
        """Why the system made no useful progress over the whole trace ("" when it did)."""
        if self.useful_samples > 0 or self.duration_s <= 0:
            return ""
        if self.processed_samples > 0:
            return ("all its progress was rolled back: no checkpoint completed before the next failure")
        first_note = self.notes[0].split(": ", 1)[1] if self.notes else ""
        cause = max(self.lost_s, key=lambda c: self.lost_s[c]) if self.lost_s else "down"
        if cause == "down":
            return f"cannot run: {first_note}" if first_note else "cannot run: too few live workers"
        return (f"never completes a {cause} pause: the next failure comes first ({self.lost_s[cause]:.0f} s lost to "
                f"{cause} in all)")

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "mean_throughput": self.mean_throughput,
            "goodput": self.goodput,
            "reason": self.unable_reason,
            "useful_samples": self.useful_samples,
            "processed_samples": self.processed_samples,
            "lost_s": {k: v for k, v in self.lost_s.items() if v > 0},
            "events": self.events,
            "rollbacks": self.rollbacks,
        }


class _Ledger:
    """Integrates one system's rate over time, serving pauses and checkpoints; keeps the loss identity exact."""

    def __init__(self, fault_free: float, checkpoint: tuple[float, float] | None,
                 timing: CheckpointTiming = CheckpointTiming()) -> None:
        self.ff = fault_free
        self.checkpoint = checkpoint
        self.timing = timing
        self.ckpt_useful = 0.0  # useful samples at the newest complete checkpoint (the start counts as one)
        self.pending: deque[tuple[float, float]] = deque()  # (restorable from, useful samples) being written
        self.t = 0.0
        self.rate = 0.0
        self.overhead: tuple[tuple[str, float], ...] = ()
        self.down_cause = "down"
        self.pauses: deque[list] = deque()
        self.processed = 0.0
        self.useful = 0.0
        self.run_since_ckpt = 0.0
        self.lost = {c: 0.0 for c in CAUSES}
        self.series: list[tuple[float, float]] = []
        self.steady: list[tuple[float, float]] = []
        self.rollbacks = 0

    def _mark(self, rate: float) -> None:
        if self.series and abs(self.series[-1][0] - self.t) < _EPS:
            self.series[-1] = (self.t, rate)
            if len(self.series) > 1 and self.series[-2][1] == rate:
                self.series.pop()
        elif not self.series or self.series[-1][1] != rate:
            self.series.append((self.t, rate))

    def apply(self, d: Decision) -> None:
        running_rate = self.rate
        self.rate = max(0.0, d.rate)
        self.overhead = d.overhead
        self.down_cause = d.down_cause
        if d.rollback:
            self._completed(self.t)
            lost = self.useful - self.ckpt_useful
            if self.timing.expected_loss and self.timing.every_samples > 0:
                # A failure at a uniformly random point of the interval: half an interval since the newest
                # checkpoint taken, plus the one (or more) taken but not complete within the latency.
                lost = min(self.useful, self.timing.every_samples / 2 + self.timing.latency_s * running_rate)
                self.ckpt_useful = self.useful - lost
            if lost > 0:
                self.useful = self.ckpt_useful
                self.lost["lost work"] += lost / self.ff if self.ff > 0 else 0.0
            self.pending.clear()  # checkpoints still being written when the state was lost never complete
            self.rollbacks += 1
        if d.checkpoint_now:
            self.pending.clear()
            self.ckpt_useful = self.useful
            self.run_since_ckpt = 0.0
        for cause, seconds in d.pauses:
            if seconds > 0:
                self.pauses.append([cause, seconds])
        if not self.steady or self.steady[-1][1] != self.rate:
            self.steady.append((self.t, self.rate))
        self._mark(0.0 if self.pauses else self.rate)

    def _completed(self, now: float) -> None:
        """Checkpoints whose write and merge are done by `now` become the newest complete one."""
        while self.pending and self.pending[0][0] <= now + _EPS:
            self.ckpt_useful = self.pending.popleft()[1]

    def _take_checkpoint(self) -> None:
        self.run_since_ckpt = 0.0
        self._completed(self.t)
        if self.timing.latency_s > 0:
            self.pending.append((self.t + self.timing.latency_s, self.useful))
        else:
            self.ckpt_useful = self.useful

    def _until_checkpoint(self) -> float:
        """Seconds of running at the current rate until the next checkpoint is due (inf: none)."""
        if self.checkpoint is None:
            return math.inf
        every = self.timing.every_samples
        if every > 0:
            # At every multiple of `every` samples of progress since the job's start, as the runtime counts steps
            # (a restore counts again from the restored checkpoint's step).
            progress = self.useful + self.timing.done_at_start
            next_at = (math.floor(progress / every + _EPS) + 1) * every
            return max(0.0, next_at - progress) / self.rate
        return self.checkpoint[0] - self.run_since_ckpt

    def advance(self, until: float) -> None:
        while self.t < until - _EPS:
            if self.pauses:
                pause = self.pauses[0]
                dt = min(pause[1], until - self.t)
                self.lost[pause[0]] = self.lost.get(pause[0], 0.0) + dt
                self.t += dt
                pause[1] -= dt
                if pause[1] <= _EPS:
                    self.pauses.popleft()
                    self._mark(0.0 if self.pauses else self.rate)
                continue
            if self.rate <= 0:
                self.lost[self.down_cause] = self.lost.get(self.down_cause, 0.0) + (until - self.t)
                self.t = until
                continue
            dt = until - self.t
            due = False
            left = self._until_checkpoint()
            if left <= dt + _EPS:
                dt, due = max(0.0, left), True
            gained = self.rate * dt
            self.processed += gained
            self.useful += gained
            self.run_since_ckpt += dt
            if self.ff > 0:
                explained = 0.0
                for cause, lost_rate in self.overhead:
                    self.lost[cause] = self.lost.get(cause, 0.0) + lost_rate * dt / self.ff
                    explained += lost_rate
                self.lost["degraded"] += max(0.0, self.ff - self.rate - explained) * dt / self.ff
            self.t += dt
            if due:
                assert self.checkpoint is not None
                self._take_checkpoint()  # the checkpoint captures the state at its start
                if self.checkpoint[1] > 0:
                    self.pauses.appendleft(["checkpoint", self.checkpoint[1]])
                    self._mark(0.0)


def replay(system: SystemModel, timeline: UnitTimeline, fault_free_rate: float) -> SystemRun:
    """Replay one system over the timeline (see the module docstring for the definitions)."""
    ledger = _Ledger(fault_free_rate, system.checkpoint, getattr(system, "checkpoint_timing", CheckpointTiming()))
    first = system.start(0.0, timeline.live[0])
    ledger.apply(first)
    wake = first.wake_at
    events = 0
    notes: list[str] = [f"0s: {first.note}"] if first.note else []
    i = 1
    end = timeline.end_s
    while True:
        next_trace = timeline.times_s[i] if i < len(timeline.times_s) else math.inf
        next_wake = wake if wake is not None else math.inf
        t = min(next_trace, next_wake, end)
        ledger.advance(t)
        if t >= end:
            break
        if next_wake <= t:
            d = system.on_wake(t)
            ledger.apply(d)
            wake = d.wake_at
            events += 1
        if next_trace <= t:
            prev, live = timeline.live[i - 1], timeline.live[i]
            d = system.on_change(t, live, frozenset(prev - live), frozenset(live - prev))
            ledger.apply(d)
            wake = d.wake_at if d.wake_at is not None else (wake if wake is not None and wake > t else None)
            if d.note:
                notes.append(f"{t:.0f}s: {d.note}")
            i += 1
            events += 1
    ledger.series = [(t, r) for t, r in ledger.series if t <= end]
    return SystemRun(system.name, system.label, tuple(ledger.series), tuple(ledger.steady), end, ledger.processed,
                     ledger.useful, fault_free_rate, dict(ledger.lost), events, ledger.rollbacks, tuple(notes))


@dataclass(frozen=True)
class JobResult:
    """All systems replayed over one trace for one job."""

    runs: dict[str, SystemRun]
    fault_free_rate: float
    timeline: UnitTimeline
    context: JobContext
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "fault_free_throughput": self.fault_free_rate,
            "duration_s": self.timeline.end_s,
            "mean_live_workers": self.timeline.mean_live(),
            "workers": self.context.num_workers,
            "systems": {name: run.to_dict() for name, run in self.runs.items()},
            **self.extra,
        }


def replay_all(systems: Sequence[SystemModel], timeline: UnitTimeline, ctx: JobContext,
               progress: Callable[[str], None] | None = None) -> JobResult:
    """Replay every system over the same timeline."""
    runs: dict[str, SystemRun] = {}
    for system in systems:
        if progress:
            progress(f"replaying {system.label} over {len(timeline.times_s)} change point(s)")
        runs[system.name] = replay(system, timeline, ctx.fault_free_rate)
    return JobResult(runs, ctx.fault_free_rate, timeline, ctx)


def rate_at(series: Sequence[tuple[float, float]], t: float) -> float:
    """The rate of a step series at time t (the last step starting at or before t)."""
    value = series[0][1] if series else 0.0
    for start, rate in series:
        if start > t + _EPS:
            break
        value = rate
    return value


def compare_series(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]], end: float
                   ) -> tuple[float, float]:
    """(worst a - b, fraction of time with a < b) over [0, end) for two step series."""
    cuts = sorted({t for t, _ in a} | {t for t, _ in b} | {0.0})
    cuts = [t for t in cuts if t < end] + [end]
    worst = math.inf
    below = 0.0
    ia = ib = 0
    ra = a[0][1] if a else 0.0
    rb = b[0][1] if b else 0.0
    for k in range(len(cuts) - 1):
        t = cuts[k]
        while ia < len(a) and a[ia][0] <= t + _EPS:
            ra = a[ia][1]
            ia += 1
        while ib < len(b) and b[ib][0] <= t + _EPS:
            rb = b[ib][1]
            ib += 1
        worst = min(worst, ra - rb)
        if ra < rb - 1e-12:
            below += cuts[k + 1] - t
    return worst, below / end if end > 0 else 0.0


def binned(series: Sequence[tuple[float, float]], end: float, bin_s: float) -> list[tuple[float, float]]:
    """Average rate of a step series over consecutive bins of `bin_s` seconds: (bin start, mean rate)."""
    out: list[tuple[float, float]] = []
    if end <= 0 or bin_s <= 0 or not series:
        return out
    k = 0
    t = 0.0
    while t < end - _EPS:
        stop = min(t + bin_s, end)
        area = 0.0
        while k + 1 < len(series) and series[k + 1][0] <= t + _EPS:
            k += 1
        j = k
        cursor = t
        while cursor < stop - _EPS:
            nxt = series[j + 1][0] if j + 1 < len(series) else math.inf
            seg_end = min(stop, nxt)
            area += series[j][1] * (seg_end - cursor)
            cursor = seg_end
            if seg_end >= nxt - _EPS:
                j += 1
        out.append((t, area / (stop - t)))
        t = stop
    return out
