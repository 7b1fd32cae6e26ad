"""The reporter's pieces with plain values: recovery lines and records from structured fields, the replica check,
the --metrics file and the progress lines."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from recycle.runtime.control.reporter import (ChaosEvent, EvalMetrics, MetricsFile, ProgressSink, Recovery, Reporter,
                                              StepMetrics, replica_mismatch)
from recycle.runtime.protocol.records import StepRecord


def _recovery(**fields) -> Recovery:
    base = Recovery(generation=2, step=9, workers=("2:1",), causes=("worker 2:1 died",), failed=((0, 1), (2, 0)),
                    failure_time=0.0, detected_s=None, plan_source="heuristic", plan_lookup_s=0.002, formed_s=0.5,
                    resumed_s=1.25, redone_actions=4, redone_s=0.1, rolled_back=0, joined=("2:1",),
                    restored_step=8, steps_lost=2, moved=(((2, 0), (2, 1)),))
    return replace(base, **fields)


def test_a_reshape_is_told_from_its_workers_and_written_as_text_in_the_metrics_record() -> None:
    line = _recovery().line()
    assert line == ("step 9: worker 2:1 died; worker 2:0 moved to stage 1 as 2:1 (reshape); 2:1 re-joined (state "
                    "from the checkpoint); restored checkpoint step 8 (2 steps lost); plan for {stage 0: 1 down, "
                    "stage 1: 1 down} planned by the heuristic (2.0 ms); generation 2 in 0.50 s; redid 4 actions "
                    "(0.10 s of work); training resumed 1.25 s after its first sign")
    record = _recovery().record()
    assert record["event"] == "recovery" and record["moved"] == ["2:0 -> 2:1"]
    assert list(record)[1:] == list(Recovery.__dataclass_fields__)  # the fields in their order, as before
    json.dumps(record)


def _step_record(replica: int, stage: int, digest: str) -> StepRecord:
    return StepRecord(replica, stage, 0, 0.0, 1.0, 0.5, None, None, None, 1.0, digest)


def test_replicas_that_differ_stop_the_run_with_their_digests() -> None:
    same = [_step_record(0, 0, "a" * 16), _step_record(1, 0, "a" * 16), _step_record(0, 1, "b" * 16)]
    assert replica_mismatch(3, same, 2) is None
    message = replica_mismatch(3, same + [_step_record(1, 1, "c" * 16)], 2)
    assert message is not None and message.startswith(f"after step 3 the replicas of stage 1 differ (0:1={'b' * 12}, "
                                                       f"1:1={'c' * 12})")


def test_the_sinks_get_every_report_in_order(tmp_path: Path) -> None:
    lines: list[str] = []
    path = tmp_path / "metrics.jsonl"
    file = MetricsFile(str(path))
    reporter = Reporter([ProgressSink(lines.append, end_step=4), file], tokens_per_step=1000, num_stages=2, wall0=0.0,
                        gpus_per_worker=4)
    records = [StepRecord(0, 0, 0, 10.0, 10.5, 0.4, None, None, None, 1.0, lr=2e-4),
               StepRecord(0, 1, 0, 10.1, 11.0, 0.4, 1.0, 2.5, None, 3.0, lr=2e-4)]
    first = reporter.step_metrics(0, records)
    assert first.period_s == 1.0 and first.tokens_per_s == 1000.0 and first.loss == 2.5 and first.grad_norm == 2.0
    assert first.lr == 2e-4 and first.tokens_per_s_per_gpu == 125.0  # 2 live workers x 4 GPUs each
    reporter.step(first)
    reporter.chaos(ChaosEvent(time=11.0, kind="kill", step=1, workers=("0:1",)))
    assert len(path.read_text().splitlines()) == 2  # each record is appended as it happens
    later = [replace(r, start=r.start + 2.0, end=r.end + 2.0) for r in records]
    assert reporter.step_metrics(1, later).period_s == 2.0  # from the previous step's end
    reporter.restart()
    assert reporter.step_metrics(1, later).period_s == 1.0  # after a restore: its own span
    reporter.recovery(_recovery())
    assert lines[0] == "step 1/4 loss 2.5000 lr 2.00e-04 tokens/s 1,000 (125/GPU) period 1000.0 ms"
    assert lines[1] == "chaos at step 1: kill 0:1" and lines[2] == _recovery().line()
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert written[0]["lr"] == 2e-4 and written[0]["tokens_per_s_per_gpu"] == 125.0
    kinds = [json.loads(line).get("event", "step") for line in path.read_text().splitlines()]
    assert kinds == ["step", "chaos", "recovery"]
    assert isinstance(reporter.steps[0], StepMetrics) and list(reporter.recoveries) == [_recovery()]


def test_tokens_per_gpu_divide_by_the_workers_that_made_the_step() -> None:
    """A step made by 3 live workers of 2 GPUs each (one worker down): tokens/s over 6 GPUs."""
    reporter = Reporter([], tokens_per_step=1200, num_stages=2, wall0=0.0, gpus_per_worker=2)
    records = [StepRecord(p, s, 0, 0.0, 2.0, 0.1, None, None, None, 1.0) for p, s in ((0, 0), (0, 1), (1, 0))]
    metrics = reporter.step_metrics(0, records)
    assert metrics.tokens_per_s == 600.0 and metrics.tokens_per_s_per_gpu == 100.0


def test_an_evaluation_between_two_steps_is_not_in_the_next_steps_period() -> None:
    reporter = Reporter([], tokens_per_step=100, num_stages=1, wall0=0.0)
    reporter.step(reporter.step_metrics(0, [StepRecord(0, 0, 0, 0.0, 1.0, 0.1, None, None, None, 1.0)]))
    reporter.evaluation(EvalMetrics(1, 4.0, 2, 32, 0.5, 0, end_time=1.5))  # ran from 1.0 to 1.5
    second = reporter.step_metrics(1, [StepRecord(0, 0, 0, 1.5, 2.5, 0.1, None, None, None, 1.0)])
    assert second.period_s == 1.0 and second.tokens_per_s == 100.0
    reporter.evaluation(EvalMetrics(2, None, 0, 0, 0.0, 0, skipped="cut"))  # skipped: no time of its own
    assert reporter.step_metrics(2, [StepRecord(0, 0, 0, 2.5, 3.0, 0.1, None, None, None, 1.0)]).period_s == 0.5


def test_a_late_stop_report_is_named_in_the_recovery_line() -> None:
    """The announcement waits for every survivor's report: one stuck in an op of the old generation until its
    timeout is what a 30 s recovery looks like from the outside, so the line names it."""
    from recycle.config import parse_config
    from recycle.ir import PlanChoice
    from recycle.runtime.control.coordinator import Death, RecoveryFacts
    from recycle.runtime.control.reporter import GenerationRecords, measure_recovery
    from recycle.runtime.protocol.records import StoppedReport
    from recycle.schedules.fault_free import build_schedule

    config = parse_config({"topology": {"num_replicas": 2, "num_stages": 2}, "workload": {"num_microbatches": 2},
                           "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1}})
    plan = build_schedule(config, "1f1b")

    def report(rank: int, at: float) -> StoppedReport:
        return StoppedReport(rank, 0, 0, 1, 3, 0.1, 0, 0.0, "peer lost", at)

    def measured(late_at: float) -> Recovery:
        facts = RecoveryFacts(1, (Death(2, "worker 1:0 died", 100.0),), frozenset({(1, 0)}), 1, 3, 0.1, 0, 100.0,
                              (report(0, 100.01), report(3, late_at), report(1, 100.02)))
        records = GenerationRecords((late_at + 0.2,), (), (), (), {})
        return measure_recovery(facts, records, plan.worker, late_at + 0.05, PlanChoice(plan, "store", 0.0),
                                late_at + 1.0, 0.0)

    slow = measured(130.0)
    assert slow.last_report == ("1:1", 30.0)
    assert "the last stop report, from 1:1, came 30.00 s after the failure was detected" in slow.line()
    quick = measured(100.03)
    assert quick.last_report is not None and "last stop report" not in quick.line()
