"""Node 0's reports: each step's metrics and each recovery, measured from the workers' records, fed to event sinks."""

from __future__ import annotations

import itertools
import json
import operator
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

from recycle.fileio import append_text
from recycle.ir import PlanChoice, PlanSource
from recycle.runtime.control.coordinator import RecoveryFacts
from recycle.runtime.protocol.records import (FaultRecord, Joined, MigrationRecord, StepRecord, StepRows,
                                              TransferRecord)
from recycle.runtime.state import checkpoint

__all__ = ["StepMetrics", "EvalMetrics", "Recovery", "ChaosEvent", "EventSink", "ProgressSink", "MetricsFile",
           "Reporter", "GenerationRecords", "measure_recovery", "grad_norm", "learning_rate", "replica_mismatch",
           "REPORTS_KEPT", "last_reported_step", "worker_names"]

# The newest steps (and evaluations, recoveries, chaos events) a run keeps for its result: a 10^6-step run must not
# hold a million records in node 0's memory. The --metrics file and the other sinks get every one.
REPORTS_KEPT = 10_000
# A stop report later than this after the failure's detection is named in the recovery line (it holds the announcement).
SLOW_REPORT_S = 1.0

Worker = tuple[int, int]  # (replica, stage)


def _name(worker: Worker) -> str:
    return "%d:%d" % worker


@dataclass(frozen=True)
class StepMetrics:
    step: int  # 1-based count of completed steps
    loss: float
    tokens_per_s: float
    # End of this iteration minus the end of the previous one, or of the evaluation between them (the first step:
    # its own span); tokens/s follow it, so an evaluation does not count against the training's throughput.
    period_s: float
    step_time_s: float  # first start to last end over all workers
    elapsed_s: float
    grad_norm: float | None = None
    lr: float | None = None  # the learning rate of the step's optimizer steps (stage 0's, if the stages differed)
    lr_by_stage: tuple[float, ...] = ()  # each stage's learning rate, only when they differed (they should not)
    # tokens_per_s over the GPUs that made the step: its live workers x [topology] gpus_per_worker
    tokens_per_s_per_gpu: float = 0.0
    worker_time_s: dict[str, float] = field(default_factory=dict)  # "replica:stage" -> busy span of the iteration
    worker_cpu_s: dict[str, float] = field(default_factory=dict)  # "replica:stage" -> CPU seconds of the iteration
    digests: dict[str, str] = field(default_factory=dict)  # "replica:stage" -> parameter digest (verify_replicas)
    generation: int = 0
    end_time: float = 0.0  # wall clock when the last worker finished the step


@dataclass(frozen=True)
class EvalMetrics:
    """An evaluation on the held-out split ([training] eval_every), or why there is none."""

    step: int  # after this many steps (the step line's number)
    loss: float | None  # the mean loss over its micro-batches; None: skipped
    microbatches: int
    tokens: int
    seconds: float  # the writer's span from its first forward to the loss
    generation: int  # the generation that ran it
    redone: bool = False  # a failure made a later generation run it again (from the same weights)
    skipped: str = ""  # why it was not run to the end
    end_time: float = 0.0  # wall clock when the writer had the loss

    def record(self) -> dict[str, Any]:
        return {"event": "eval", **asdict(self)}

    def line(self) -> str:
        if self.loss is None:
            return f"eval after step {self.step}: skipped ({self.skipped})"
        again = f"; run again in generation {self.generation} after a failure" if self.redone else ""
        return (f"eval after step {self.step}: loss {self.loss:.4f} ({self.microbatches} micro-batches, "
                f"{self.tokens:,} tokens, {self.seconds:.2f} s{again})")


@dataclass(frozen=True)
class Recovery:
    """One survived failure, as measured."""

    generation: int  # the generation it started
    step: int  # 1-based step that was redone first
    workers: tuple[str, ...]  # "replica:stage" of the workers lost
    causes: tuple[str, ...]  # one line per worker lost
    failed: tuple[Worker, ...]  # every worker down after it
    failure_time: float  # the injected fault's time when known, else when it was detected (or the joiner was up)
    detected_s: float | None  # fault -> coordinator knows (None: an outside kill, whose moment is unknown)
    plan_source: PlanSource
    plan_lookup_s: float
    formed_s: float  # announcement -> every worker joined the new groups
    resumed_s: float  # failure (unknown moment: its detection; a join: the survivors' stop) -> first actions of the new plan
    redone_actions: int
    redone_s: float
    rolled_back: int  # survivors whose stage had already stepped the redone iteration (restored from a snapshot)
    lost_actions: int = 0  # the failed workers' actions of the iteration that may have finished (at most), if kept
    kept: str = ""  # "kept the survivors' work (...)" or why the whole iteration was redone (empty: --redo iteration)
    joined: tuple[str, ...] = ()  # "replica:stage" of workers re-admitted
    transfer_bytes: int = 0  # state moved to them from live replicas
    transfer_s: float = 0.0  # the longest transfer
    restored_step: int | None = None  # every worker loaded this checkpoint (a stage had lost every replica)
    steps_lost: int = 0
    moved: tuple[tuple[Worker, Worker], ...] = ()  # (donor, slot): live workers moved into a lost stage (reshape)
    partition: tuple[int, ...] = ()  # layers per stage after it, when the plan re-partitioned them (else empty)
    layers_moved: int = 0  # layers handed between stages at the switch (each counted once per receiving worker)
    migration_bytes: int = 0  # parameters and optimizer state sent for them
    migration_s: float = 0.0  # the slowest worker's exchange
    plan_note: str = ""  # the plan provider's reason for the plan (PlanChoice.note)
    formation: str = ""  # how the new generation's groups were made and the slowest worker's time ("init 0.031 s")
    # The survivor whose stop report came last, and when (s after the coordinator learned of the failure): the
    # announcement waits for every report, so a survivor stuck in an op of the old generation shows here first.
    last_report: tuple[str, float] | None = None

    def record(self) -> dict[str, Any]:
        """The recovery as a --metrics record: its fields, each move written "donor -> slot" ("1:0 -> 1:1")."""
        return {"event": "recovery", **asdict(self),
                "moved": [f"{_name(donor)} -> {_name(slot)}" for donor, slot in self.moved]}

    def line(self) -> str:
        what = list(self.causes)
        for donor, slot in self.moved:
            what.append(f"worker {_name(donor)} moved to stage {slot[1]} as {_name(slot)} (reshape)")
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
        if self.last_report is not None and self.last_report[1] > SLOW_REPORT_S:
            what.append(f"the last stop report, from {self.last_report[0]}, came {self.last_report[1]:.2f} s after "
                        "the failure was detected")
        return (f"step {self.step}: {'; '.join(what)}; {detected}plan for {{{state or 'none down'}}} {source} "
                f"({self.plan_lookup_s * 1e3:.1f} ms); generation {self.generation} in {self.formed_s:.2f} s"
                f"{f' (groups: {self.formation})' if self.formation else ''}; "
                f"redid {self.redone_actions} actions ({self.redone_s:.2f} s of work"
                f"{f'; {self.kept}' if self.kept else ''}); training resumed "
                f"{self.resumed_s:.2f} s {after}")


@dataclass(frozen=True)
class ChaosEvent:
    """What --chaos did at one step: killed or froze these workers ("replica:stage")."""

    time: float
    kind: str
    step: int
    workers: tuple[str, ...]

    def record(self) -> dict[str, Any]:
        return {"event": "chaos", "time": self.time, "kind": self.kind, "step": self.step,
                "workers": list(self.workers)}


class EventSink(Protocol):
    """Where node 0's reports go (the progress output, --metrics, --tensorboard), each as it is made."""

    def on_step(self, metrics: StepMetrics) -> None: ...

    def on_eval(self, evaluation: EvalMetrics) -> None: ...

    def on_recovery(self, recovery: Recovery) -> None: ...

    def on_chaos(self, event: ChaosEvent) -> None: ...


def step_line(m: StepMetrics, end_step: int) -> str:
    """A step's progress line: `step 3/20 loss 5.2515 lr 1.00e-03 tokens/s 6,180 (1,545/GPU) period 82.9 ms`."""
    lr = "" if m.lr is None else f" lr {m.lr:.2e}"
    if m.lr_by_stage:
        lr = " lr " + "/".join(f"{x:.2e}" for x in m.lr_by_stage) + " (per stage: they differ)"
    per_gpu = f" ({m.tokens_per_s_per_gpu:,.0f}/GPU)" if m.tokens_per_s_per_gpu else ""
    return (f"step {m.step}/{end_step} loss {m.loss:.4f}{lr} tokens/s {m.tokens_per_s:,.0f}{per_gpu} "
            f"period {m.period_s * 1e3:.1f} ms")


class ProgressSink:
    """One line per step, recovery and chaos event."""

    def __init__(self, say: Callable[[str], None], end_step: int) -> None:
        self.say, self.end_step = say, end_step

    def on_step(self, m: StepMetrics) -> None:
        self.say(step_line(m, self.end_step))

    def on_eval(self, evaluation: EvalMetrics) -> None:
        self.say(evaluation.line())

    def on_recovery(self, recovery: Recovery) -> None:
        self.say(recovery.line())

    def on_chaos(self, event: ChaosEvent) -> None:
        self.say(f"chaos at step {event.step}: {event.kind} {' '.join(event.workers)}")


class MetricsFile:
    """--metrics FILE: one JSON line per step, evaluation, recovery and chaos event, appended as it happens. The first
    record replaces a previous run's file whole (atomically); each later one is one append, so the cost of a record
    does not grow with the run. A restarted coordinator appends to its predecessor's file (`append`)."""

    def __init__(self, path: str, append: bool = False) -> None:
        self.path = path
        self.started = append

    def on_step(self, metrics: StepMetrics) -> None:
        self._write(asdict(metrics))

    def on_eval(self, evaluation: EvalMetrics) -> None:
        self._write(evaluation.record())

    def on_recovery(self, recovery: Recovery) -> None:
        self._write(recovery.record())

    def on_chaos(self, event: ChaosEvent) -> None:
        self._write(event.record())

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record) + "\n"
        if self.started:
            append_text(self.path, line)
        else:
            checkpoint.atomic_write_text(self.path, line)
            self.started = True


def last_reported_step(path: str) -> int | None:
    """The newest step (1-based) a --metrics file holds a step record of; None when it holds none (or is absent).
    Read from its end: a restarted coordinator never reports a step twice."""
    try:
        with open(path, "rb") as file:
            file.seek(0, 2)
            size = file.tell()
            file.seek(max(0, size - (1 << 20)))
            lines = file.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # a line cut by the predecessor's death, or the first one in the window
        if isinstance(record, dict) and "event" not in record and isinstance(record.get("step"), int):
            return int(record["step"])
    return None


Records = StepRows | list[StepRecord]  # a step's records: as the coordinator holds them, or one by one (tests)


def grad_norm(records: Records, num_stages: int) -> float | None:
    """The global gradient norm of a step from its workers' records: the clipping norm when clipping, else the root of
    the stages' squared norms (one replica each: after the all-reduce every replica of a stage holds the same)."""
    rows = StepRows.of(records)
    for norm in rows.grad_norm:
        if norm is not None:
            return norm
    squares: dict[int, float] = {}
    for stage, square in zip(rows.stage, rows.grad_sq):
        if square is not None:
            squares.setdefault(stage, square)
    if len(squares) < num_stages:
        return None  # a stage's record is missing (should not happen): no norm rather than a partial one
    return sum(squares[s] for s in range(num_stages)) ** 0.5


def learning_rate(records: Records, num_stages: int) -> tuple[float | None, tuple[float, ...]]:
    """(the step's learning rate, every stage's when they differ, else ()) from its workers' records. Each stage
    steps its own schedule (staggered optimizer); all stages follow the same [training] schedule, so they agree."""
    rows = StepRows.of(records)
    by_stage: dict[int, float] = {}
    for stage, lr in zip(rows.stage, rows.lr):
        if lr is not None:
            by_stage.setdefault(stage, lr)
    if not by_stage:
        return None, ()
    first = by_stage[min(by_stage)]
    if len(set(by_stage.values())) == 1:
        return first, ()
    return first, tuple(by_stage.get(s, float("nan")) for s in range(num_stages))


def worker_names(rows: StepRows) -> list[str]:
    """Each row's worker as "replica:stage" (str(Worker))."""
    return [f"{replica}:{stage}" for replica, stage in zip(rows.replica, rows.stage)]


def replica_mismatch(step: int, records: Records, num_stages: int) -> str | None:
    """Why the run must stop when two live replicas of a stage hold different parameters after `step` (1-based)
    (verify_replicas); None when they all agree."""
    rows = StepRows.of(records)
    names = worker_names(rows)
    for stage in range(num_stages):
        seen = {name: digest for name, s, digest in zip(names, rows.stage, rows.digest) if digest and s == stage}
        if len(set(seen.values())) > 1:
            return (f"after step {step} the replicas of stage {stage} differ "
                    f"({', '.join(f'{w}={d[:12]}' for w, d in seen.items())}); the data-parallel all-reduce or the "
                    "optimizer is not deterministic across replicas")
    return None


@dataclass(frozen=True)
class GenerationRecords:
    """What the workers of a new generation wrote about getting there, and the fault records of its deaths."""

    resumed: tuple[float, ...]  # when each worker started its first action
    joins: tuple[Joined, ...]
    transfers: tuple[TransferRecord, ...]  # of the workers admitted
    migrations: tuple[MigrationRecord, ...]
    faults: dict[int, FaultRecord]  # rank -> the fault record of its death, when one was recorded


def measure_recovery(facts: RecoveryFacts, records: GenerationRecords, worker: Callable[[int], Worker],
                     announced: float, choice: PlanChoice, now: float, wall0: float) -> Recovery:
    """The recovery that `facts` started, timed from the records (`choice`: the plan it switched to).
    A death is timed from its fault record when one was made during the run and before the death was seen."""
    causes, fault_times = [], []
    for death in facts.deaths:
        cause = death.cause
        fault = records.faults.get(death.rank)
        if fault is not None and wall0 <= fault.time <= death.time:
            cause += f" during {fault.where}"
            fault_times.append(fault.time)
        causes.append(cause)
    if facts.lost_contact:
        causes.append(f"no worker failed: {facts.lost_contact}; the live workers formed their groups again")
    failure_time = min(fault_times) if fault_times else facts.started
    end = max(records.resumed) if records.resumed else now
    joins = records.joins
    formation = (f"{'/'.join(sorted({j.method for j in joins}))} {max(j.formation_s for j in joins):.3f} s"
                 if joins else "")
    # A join without a failure: the survivors' pause runs from their stop at the drain to their first action.
    paused_from = min((r.time for r in facts.reports), default=facts.started)
    last = max(facts.reports, key=lambda r: r.time, default=None)
    last_report = None if last is None or not facts.deaths else \
        (_name(worker(last.rank)), last.time - min(d.time for d in facts.deaths))
    migrations, transfers = records.migrations, records.transfers
    return Recovery(
        generation=facts.generation, step=facts.redo_step + 1,
        workers=tuple(_name(worker(d.rank)) for d in facts.deaths), causes=tuple(causes),
        failed=tuple(sorted(facts.failed)), failure_time=failure_time,
        detected_s=(min(d.time for d in facts.deaths) - min(fault_times)) if fault_times and facts.deaths else None,
        plan_source=choice.source, plan_lookup_s=choice.seconds, plan_note=choice.note,
        formed_s=(max(j.time for j in joins) - announced) if joins else 0.0,
        resumed_s=end - (failure_time if facts.deaths else paused_from), redone_actions=facts.redone_actions,
        redone_s=facts.redone_s, rolled_back=facts.rolled_back, lost_actions=facts.lost_actions, kept=facts.kept,
        joined=tuple(_name(worker(r)) for r in sorted(facts.joining)),
        transfer_bytes=sum(t.bytes for t in transfers), transfer_s=max((t.seconds for t in transfers), default=0.0),
        restored_step=facts.restore_step, steps_lost=facts.steps_lost,
        moved=tuple((worker(d), worker(r)) for d, r in facts.moved),
        partition=tuple(choice.plan.partition), layers_moved=sum(m.layers_in for m in migrations),
        migration_bytes=sum(m.bytes for m in migrations) // 2,
        migration_s=max((m.seconds for m in migrations), default=0.0), formation=formation, last_report=last_report)


class Reporter:
    """Builds each step's metrics from its workers' records and hands every report to the sinks, in order. It keeps
    only the newest REPORTS_KEPT of each kind (a run's result; the sinks had them all), so that node 0's memory does
    not grow with the number of steps."""

    def __init__(self, sinks: list[EventSink], tokens_per_step: int, num_stages: int, wall0: float,
                 gpus_per_worker: int = 1, kept: int | None = None) -> None:
        self.sinks, self.tokens_per_step, self.num_stages, self.wall0 = sinks, tokens_per_step, num_stages, wall0
        self.gpus_per_worker = gpus_per_worker
        kept = REPORTS_KEPT if kept is None else kept
        self.steps: deque[StepMetrics] = deque(maxlen=kept)
        self.evaluations: deque[EvalMetrics] = deque(maxlen=kept)
        self.recoveries: deque[Recovery] = deque(maxlen=kept)
        self.chaos_events: deque[ChaosEvent] = deque(maxlen=kept)
        self.steps_reported = 0  # all of them, kept or not
        self.previous_end: float | None = None

    def step_metrics(self, step: int, records: Records) -> StepMetrics:
        """The metrics of 0-based `step` from every member's record (the next step's period starts at its end).
        It works on the records' columns: at thousands of workers an object per record cost most of the
        coordinator's CPU."""
        rows = StepRows.of(records)
        first = min(rows.start)
        last = max(rows.end)
        # Steady-state period: time between the completions of consecutive iterations (the first step: its span).
        period = last - self.previous_end if self.previous_end is not None else last - first
        self.previous_end = last
        loss = next((loss for loss in rows.stage_loss if loss is not None), 0.0)
        lr, lr_by_stage = learning_rate(rows, self.num_stages)
        tokens_per_s = self.tokens_per_step / period if period > 0 else 0.0
        names = worker_names(rows)
        gpus = len(set(names)) * self.gpus_per_worker  # the live workers that made the step
        return StepMetrics(
            step=step + 1, loss=loss, tokens_per_s=tokens_per_s,
            tokens_per_s_per_gpu=tokens_per_s / gpus if gpus else 0.0,
            period_s=period, step_time_s=last - first, elapsed_s=time.time() - self.wall0,
            grad_norm=grad_norm(rows, self.num_stages), lr=lr, lr_by_stage=lr_by_stage,
            worker_time_s=dict(zip(names, map(operator.sub, rows.end, rows.start))),
            digests={name: digest for name, digest in zip(names, rows.digest) if digest},
            worker_cpu_s=dict(zip(names, rows.cpu_s)),
            generation=max(rows.generation), end_time=last)

    def restart(self) -> None:
        """A checkpoint restore: the steps run again, the first of them timed by its own span."""
        self.previous_end = None

    def recent_periods(self, count: int) -> list[float]:
        """The periods of the newest `count` steps reported (oldest first)."""
        return [m.period_s for m in itertools.islice(reversed(self.steps), count)][::-1]

    def step(self, metrics: StepMetrics) -> None:
        self.steps.append(metrics)
        self.steps_reported += 1
        for sink in self.sinks:
            sink.on_step(metrics)

    def evaluation(self, evaluation: EvalMetrics) -> None:
        """Report an evaluation; the next step's period starts at its end (it ran between the two steps)."""
        if self.previous_end is not None and evaluation.loss is not None:
            self.previous_end = max(self.previous_end, evaluation.end_time)
        self.evaluations.append(evaluation)
        for sink in self.sinks:
            sink.on_eval(evaluation)

    def recovery(self, recovery: Recovery) -> None:
        self.recoveries.append(recovery)
        for sink in self.sinks:
            sink.on_recovery(recovery)

    def chaos(self, event: ChaosEvent) -> None:
        self.chaos_events.append(event)
        for sink in self.sinks:
            sink.on_chaos(event)
