"""The job simulator charged as the runtime has it (issue 27, item 3): restores to the newest *complete* checkpoint
(by progress, after its write and merge), pauses and redone work fitted to a run's records, and the runtime's layout
rules; every expected number is worked out by hand in the comments."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from recycle.cli import main
from recycle.config import uniform_config
from recycle.traces.calibration import calibrate, iteration_work_units, read_metrics
from recycle.traces.jobsim import replay
from recycle.traces.mapping import UnitTimeline, map_trace_to_units
from recycle.traces.model import JobContext, JobCosts, StageLayout
from recycle.traces.reader import parse_event_lines
from recycle.traces.recycle_system import ReCycleSystem
from recycle.traces.runtime_layout import balancing_moves, return_slot
from recycle.traces.soak import SoakChange, machine_trace
from recycle.traces.throughput import ThroughputModel


def fake_period(key: tuple[int, ...]) -> float:
    return 10.0 + 5.0 * sum(key)  # slots; 1 slot = 1 s below


def _timeline(points: list[tuple[float, set[int]]], end: float) -> UnitTimeline:
    return UnitTimeline(tuple(t for t, _ in points), tuple(frozenset(s) for _, s in points), end, 1, 1)


def _recycle(costs: JobCosts) -> tuple[ReCycleSystem, float]:
    cfg = uniform_config(2, 2, 2)  # D=2, S=2, M=2: 4 samples per iteration; fault-free 10 s -> 0.4/s
    model = ThroughputModel(cfg, fake_period, 1.0, "fake")
    ctx = JobContext(cfg, model.fault_free(), 1.0, costs)
    return ReCycleSystem(ctx, model), ctx.fault_free_rate


# Units 0..3 hold (0,0), (0,1), (1,0), (1,1). Units 1 and 3 (every stage-1 replica) die at 41.
STAGE_LOST = _timeline([(0, {0, 1, 2, 3}), (41, {0, 2})], 100)


@pytest.mark.parametrize("runtime_layout", [False, True])
def test_a_restore_goes_back_to_the_newest_complete_checkpoint(runtime_layout: bool) -> None:
    costs = JobCosts(restart_s=5, checkpoint_every_steps=2, checkpoint_latency_s=3, fallback_checkpoint_cost_s=0,
                     reshape=False, runtime_layout=runtime_layout)
    system, ff = _recycle(costs)
    run = replay(system, STAGE_LOST, ff)
    # A checkpoint every 2 iterations = 8 samples = 20 s at 0.4/s: taken at 20 (8 samples) and 40 (16 samples),
    # restorable 3 s later. At 41 the one of 40 is still being written (until 43): the job restores the one of 20.
    # Useful at 41: 16.4 samples; 8.4 lost (21 s of fault-free training). Restore: 41-46 restart; both layouts put
    # one worker in each stage (planner: units 0, 2 laid out stage by stage; runtime: (1,0) moves to (1,1) in its
    # own pipeline), key (1, 1), period 20 s -> 0.2/s from 46 to 100: 10.8 samples.
    assert run.rollbacks == 1
    assert run.lost_s["lost work"] == pytest.approx(21)
    assert run.lost_s["restart"] == pytest.approx(5)
    assert run.useful_samples == pytest.approx(16.4 - 8.4 + 54 * 0.2)
    assert run.useful_samples / ff + sum(run.lost_s.values()) == pytest.approx(100)
    # Restorable at once (latency 0): back to the checkpoint of 40, 0.4 samples (1 s) lost.
    system, _ = _recycle(JobCosts(restart_s=5, checkpoint_every_steps=2, fallback_checkpoint_cost_s=0, reshape=False,
                                  runtime_layout=runtime_layout))
    instant = replay(system, STAGE_LOST, ff)
    assert instant.lost_s["lost work"] == pytest.approx(1)
    assert instant.useful_samples == pytest.approx(16 + 54 * 0.2)


def test_checkpoints_by_progress_stretch_in_a_degraded_state() -> None:
    # A checkpoint every iteration (4 samples). Unit 3 dies at 5 (detect, redo and switch free): key (0, 1), period
    # 15 s, 4/15 samples/s. Useful at 5: 2 samples; checkpoints at 4 samples (5 + 2 / (4/15) = 12.5 s), 8 (27.5 s),
    # 12 (42.5 s), 16 (57.5 s). Stage 1's last replica (unit 1) dies at 60: useful 16 + 2.5 * 4/15 = 16.667, back to
    # 16 (the checkpoint of 57.5 is complete: latency 2 s). 0.667 samples = 1.667 s of fault-free training lost.
    costs = JobCosts(detect_s=0, plan_switch_s=0, redo_fraction=0, restart_s=0, checkpoint_every_steps=1,
                     checkpoint_latency_s=2, reshape=False, runtime_layout=True)
    system, ff = _recycle(costs)
    run = replay(system, _timeline([(0, {0, 1, 2, 3}), (5, {0, 1, 2}), (60, {0, 2})], 61), ff)
    assert run.lost_s["lost work"] == pytest.approx((2.5 * 4 / 15) / 0.4)
    # By running time instead (the old fallback: every 10 s of running, the fault-free iteration), the checkpoint
    # of 60 s is taken exactly at the failure and restorable at once: nothing lost.
    system, _ = _recycle(JobCosts(detect_s=0, plan_switch_s=0, redo_fraction=0, restart_s=0,
                                  fallback_checkpoint_interval_s=10, reshape=False, runtime_layout=True))
    assert replay(system, _timeline([(0, {0, 1, 2, 3}), (5, {0, 1, 2}), (60, {0, 2})], 61), ff).lost_s[
        "lost work"] == pytest.approx(0, abs=1e-9)


def _records() -> list[dict]:
    """A run's --metrics records: steps every 10 s (period 10 s), two failures, a re-join and a restore."""
    steps = [{"step": k, "loss": 1.0, "tokens_per_s": 1.0, "period_s": 10.0, "step_time_s": 10.0,
              "elapsed_s": 10.0 * k, "generation": 0, "end_time": 1000.0 + 10 * k} for k in range(1, 11)]

    def recovery(step, workers, joined, failure_time, resumed, redone, restored=None):
        return {"event": "recovery", "generation": 1, "step": step, "workers": workers, "joined": joined,
                "failed": [], "failure_time": failure_time, "resumed_s": resumed, "redone_s": redone,
                "restored_step": restored, "steps_lost": 0, "moved": []}
    return steps + [
        # 2.5 s into step 4 (a quarter of its 10 s period); the record says 30 s of the iteration's 100 s of work
        # was thrown away: the share redone after it is min(0.25, 0.30) = 0.25.
        recovery(4, ["1:1"], [], 1032.5, 3.0, 30.0),
        # A hang noticed late: it struck as step 6 began (progress 0); the 80 s redone were done during its pause.
        recovery(7, ["0:1"], [], 1060.0, 5.0, 80.0),
        recovery(8, [], ["1:1"], 1075.0, 1.0, 0.0),
        recovery(9, ["0:0", "1:0"], [], 1088.0, 20.0, 4.0, restored=5),
    ]


def test_calibration_fits_pauses_and_redone_work_to_the_records(tmp_path: Path) -> None:
    records = _records()
    # Checkpoints of steps 5 and 10: shards written 0.4 s and 0.6 s after the step ended, merged at 0.5 s and 0.9 s.
    for step, shard_at, merged_at in ((5, 0.4, 0.5), (10, 0.6, 0.9)):
        folder = tmp_path / "ckpt" / f"step{step:06d}"
        for stage in (0, 1):
            (folder / f"stage{stage}").mkdir(parents=True)
            shard = folder / f"stage{stage}" / "shard.json"
            shard.write_text("{}")
            end = 1000.0 + 10 * step
            os.utime(shard, (end + shard_at - 0.1 * (1 - stage), end + shard_at - 0.1 * (1 - stage)))
        (folder / "recycle.json").write_text("{}")
        os.utime(folder / "recycle.json", (1000.0 + 10 * step + merged_at,) * 2)
    fit = calibrate(records, iteration_work_s=100.0, checkpoint_dir=tmp_path / "ckpt")
    assert (fit.failures, fit.joins, fit.restores) == (2, 1, 1)
    assert fit.failure_pause_s == pytest.approx(4.0)  # (3 + 5) / 2
    assert fit.join_pause_s == pytest.approx(1.0) and fit.restore_pause_s == pytest.approx(20.0)
    assert fit.redo_fraction == pytest.approx((0.25 + 0.0) / 2)
    assert fit.checkpoint_every_steps == 5  # gcd(5, 10)
    assert fit.checkpoint_write_s == pytest.approx(0.5)  # median of 0.4, 0.6 (the slower stage's shard)
    assert fit.checkpoint_latency_s == pytest.approx(0.7)  # median of 0.5, 0.9
    costs = fit.costs(JobCosts(reshape=False, runtime_layout=True))
    # The simulator charges a failure detect + switch and a join the switch: switch = 1, detect = 4 - 1.
    assert costs.plan_switch_s == pytest.approx(1) and costs.detect_s == pytest.approx(3)
    assert costs.restart_s == pytest.approx(20) and costs.redo_fraction == pytest.approx(0.125)
    assert costs.checkpoint_every_steps == 5 and costs.checkpoint_latency_s == pytest.approx(0.7)

    # Replayed (1 slot = 1 s): unit 3 fails at 100: 100-103 detection; the redone share, 0.125 of the 4-sample
    # batch = 0.5 samples at the new state's 4/15 samples/s, 103-104.875; 104.875-105.875 plan switch; 105.875-150
    # at 4/15; it re-joins at 150: 150-151 switch; 151-200 at 0.4. (No stage is lost: the checkpoints cost nothing.)
    system, ff = _recycle(costs)
    run = replay(system, _timeline([(0, {0, 1, 2, 3}), (100, {0, 1, 2}), (150, {0, 1, 2, 3})], 200), ff)
    assert run.lost_s["detection"] == pytest.approx(3) and run.lost_s["redone iteration"] == pytest.approx(1.875)
    assert run.lost_s["plan switch"] == pytest.approx(2)
    assert run.useful_samples == pytest.approx(100 * 0.4 + (150 - 105.875) * 4 / 15 + 49 * 0.4)


def test_calibration_reads_a_metrics_file_and_says_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _records()) + "\n{\"cut by a cra")
    assert len(read_metrics(path)) == 14  # the cut last line is skipped
    path.write_text(json.dumps({"event": "chaos"}) + "\n")
    with pytest.raises(Exception, match="no step records"):
        read_metrics(path)
    with pytest.raises(Exception, match="cannot read the runtime metrics"):
        read_metrics(tmp_path / "absent.jsonl")
    with pytest.raises(Exception, match="not as `recycle train --metrics` writes them .KeyError: 'resumed_s'"):
        calibrate([{k: v for k, v in r.items() if k != "resumed_s"} for r in _records()])
    with pytest.raises(Exception, match="is not a directory; pass the run's --checkpoint-dir"):
        calibrate(_records(), checkpoint_dir=tmp_path / "absent")
    assert iteration_work_units(uniform_config(3, 2, 2)) == 3 * 2 * 2 * 3  # D x M x stages x (F + B + W)


def test_the_runtime_layout_rules() -> None:
    layout = StageLayout(3, 2)
    layout.place_all(range(6))  # unit r at (r // 2, r % 2)
    for unit in (0, 2, 4):  # stage 0 loses every replica
        layout.remove(unit)
    # Counts (0, 3): the last replica of stage 1 with a free stage-0 slot in its pipeline moves, (2,1) -> (2,0);
    # then (1, 2) differ by one: done.
    assert balancing_moves(layout) == [((2, 1), (2, 0))]
    assert layout.where[5] == (2, 0) and layout.live_per_stage(0.0) == [1, 2]
    vacated = {(2, 0): (2, 1)}
    # The machine that died in (2,0) comes back: its slot is held by the donor, so it takes the donor's old slot.
    assert return_slot(layout, (2, 0), vacated) == (2, 1) and vacated == {}
    assert return_slot(layout, (0, 0), {}) == (0, 0)
    assert return_slot(layout, (2, 0), {}) is None  # held, and no donor slot: it waits as a spare


def test_a_returning_node_keeps_its_position_when_asked() -> None:
    # a, b, c hold positions 0, 1, 2; a leaves, then c leaves and comes back.
    trace = parse_event_lines(["0,add,a", "0,add,b", "0,add,c", "10,remove,a", "20,remove,c", "30,add,c"])
    assert map_trace_to_units(trace).live[-1] == frozenset({0, 1})  # c takes the lowest free position, a's
    assert map_trace_to_units(trace, keep_positions=True).live[-1] == frozenset({1, 2})  # c takes its own back


@pytest.mark.timeout(10)
def test_a_machine_trace_keeps_the_simulator_in_the_runtime_state() -> None:
    D, S = 3, 2
    changes = [
        SoakChange(1.0, ((0, 1),), (), ((0, 1),)),
        # every stage-0 replica dies; the runtime moves 2:1 into 2:0 (reshape) and restores the checkpoint
        SoakChange(2.0, ((0, 0), (1, 0), (2, 0)), ((2, 0),), ((0, 0), (0, 1), (1, 0), (2, 1)),
                   moved=(((2, 1), (2, 0)),)),
        # the repaired machines: 2:0's comes back in the slot its donor left, 2:1
        SoakChange(3.0, (), ((0, 0), (0, 1), (1, 0), (2, 1)), ()),
        # both stages miss one replica; the runtime brings back stage 1's (the planner layout would fill stage 0)
        SoakChange(4.0, ((0, 0),), (), ((0, 0),)),
        SoakChange(5.0, ((1, 1),), (), ((0, 0), (1, 1))),
        SoakChange(6.0, (), ((1, 1),), ((0, 0),)),
        SoakChange(7.0, ((2, 1),), (), ((0, 0), (2, 1))),
    ]
    trace = machine_trace(changes, D, S, end_s=8.0)
    assert "2000,remove,n4" in trace.lines and "3000,add,n4" in trace.lines  # the donor n5 never leaves
    assert not any(line.endswith(",n5") for line in trace.lines[7:])
    assert trace.runtime_keys == ((0, 0), (0, 1), (2, 2), (0, 0), (1, 0), (1, 1), (1, 0), (1, 1))
    assert trace.sim_keys == trace.runtime_keys and trace.mismatched == 0 and trace.restores == 1


def test_cli_calibrates_from_a_runtime_metrics_file(tmp_path: Path, capsys) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(r) for r in _records()) + "\n")
    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,a\n0,add,b\n0,add,c\n0,add,d\n60000,remove,b\n120000,add,b\n180000,add,end\n")
    toy = str(Path(__file__).resolve().parents[2] / "configs" / "toy.toml")
    assert main(["simulate", "--config", toy, "--trace", str(trace), "--systems", "recycle", "--no-plan-cache",
                 "--runtime-layout", "--calibrate-from", str(metrics), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "calibrated from" in err and "failure pause 4.000 s (mean of 2)" in err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["costs"]["detect_s"] == pytest.approx(3) and summary["costs"]["runtime_layout"] is True
    assert main(["simulate", "--config", toy, "--trace", str(trace), "--calibrate-checkpoints", str(tmp_path),
                 "--out", str(tmp_path / "out2")]) == 2
    assert capsys.readouterr().err.startswith("error: --calibrate-checkpoints DIR needs --calibrate-from")
    assert main(["simulate", "--config", toy, "--trace", str(trace), "--calibrate-from", str(tmp_path / "none"),
                 "--out", str(tmp_path / "out3")]) == 2
    assert "cannot read the runtime metrics" in capsys.readouterr().err
    assert main(["simulate", "--config", toy, "--trace", str(trace), "--restore-expected-loss", "--out",
                 str(tmp_path / "out4")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: restore_expected_loss needs checkpoint_every_steps > 0") and err.count("\n") == 1


def test_checkpoints_count_from_the_jobs_start() -> None:
    # A checkpoint every 2 iterations (8 samples). The trace starts 1 iteration into the job (4 samples done), so
    # the first checkpoint (the job's step 2) is 4 samples = 10 s in. Stage 1 is lost at 15 s: useful 6 samples,
    # back to 4: 2 samples = 5 s of fault-free training lost. Counted from the trace's start instead, the first
    # checkpoint would be at 20 s: everything (6 samples, 15 s) lost.
    timeline = _timeline([(0, {0, 1, 2, 3}), (15, {0, 2})], 20)
    for done, lost in ((1, 5.0), (0, 15.0)):
        system, ff = _recycle(JobCosts(restart_s=0, checkpoint_every_steps=2, steps_done_at_start=done,
                                       reshape=False, runtime_layout=True))
        assert replay(system, timeline, ff).lost_s["lost work"] == pytest.approx(lost)


def test_runtime_layout_waits_for_a_machine_when_no_stage_can_spare_one() -> None:
    # Units 1, 2, 3 die at 10: unit 0 alone holds stage 0, stage 1 is empty, and no stage has two to spare: down
    # (the runtime waits for a repaired machine). Unit 3 comes back at 30 into its own slot (1,1): restore 30-35,
    # key (1, 1) at 0.2/s until 50. A checkpoint every iteration (4 samples = 10 s) was taken at 10: nothing lost.
    # Useful: 4 + 15 * 0.2 = 7 samples; down 20 s, restart 5 s, degraded 15 * (1 - 0.2 / 0.4) = 7.5 s.
    costs = JobCosts(restart_s=5, checkpoint_every_steps=1, reshape=False, runtime_layout=True)
    system, ff = _recycle(costs)
    run = replay(system, _timeline([(0, {0, 1, 2, 3}), (10, {0}), (30, {0, 3})], 50), ff)
    assert run.useful_samples == pytest.approx(7)
    assert run.lost_s["down"] == pytest.approx(20) and run.lost_s["restart"] == pytest.approx(5)
    assert run.lost_s["lost work"] == pytest.approx(0, abs=1e-9)
    assert run.useful_samples / ff + sum(run.lost_s.values()) == pytest.approx(50)
    assert [policy for _, policy, _ in system.policy_log] == ["adapt", "down", "restore"]


def test_a_restore_can_be_charged_its_expected_loss() -> None:
    # As test_a_restore_goes_back_to_the_newest_complete_checkpoint, but charged the expectation over where the
    # failure falls in the interval: half of it (4 samples) plus the latency's worth at the running rate (3 s x
    # 0.4 = 1.2 samples): 5.2 samples = 13 s lost, whatever the replay's own phase (it would lose 8.4 here).
    costs = JobCosts(restart_s=5, checkpoint_every_steps=2, checkpoint_latency_s=3, restore_expected_loss=True,
                     reshape=False, runtime_layout=True)
    system, ff = _recycle(costs)
    run = replay(system, STAGE_LOST, ff)
    assert run.lost_s["lost work"] == pytest.approx(13)
    assert run.useful_samples == pytest.approx(16.4 - 5.2 + 54 * 0.2)
    assert run.useful_samples / ff + sum(run.lost_s.values()) == pytest.approx(100)
    with pytest.raises(Exception, match="restore_expected_loss needs checkpoint_every_steps > 0"):
        JobCosts(restore_expected_loss=True)
