"""The torchft-like baseline model on hand-computed traces: a whole replica group drops out, the batch shrinks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from recycle.config import parse_config
from recycle.traces.jobsim import replay
from recycle.traces.mapping import UnitTimeline
from recycle.traces.model import JobContext, JobCosts
from recycle.traces.torchft_like import TorchftLike

# D=2 x S=2, M=2, one sample per micro-batch: a global batch of 4 samples; 4 GB of state per stage.
CONFIG = parse_config({"topology": {"num_replicas": 2, "num_stages": 2}, "workload": {"num_microbatches": 2},
                       "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
                       "memory": {"parameter_bytes": 10**9, "optimizer_state_bytes": 3 * 10**9}})
COSTS = JobCosts(torchft_detect_s=3, torchft_quorum_s=1, torchft_lost_step_fraction=1, torchft_restart_s=10,
                 torchft_heal_bytes_per_s=10**9, restart_s=50, fallback_checkpoint_interval_s=1e9)
FF = 2.0  # samples/s: one step of the global batch takes 2 s


def _timeline(points: list[tuple[float, set[int]]], end: float) -> UnitTimeline:
    return UnitTimeline(tuple(t for t, _ in points), tuple(frozenset(s) for _, s in points), end, 1, 1)


def _model(costs: JobCosts = COSTS) -> TorchftLike:
    return TorchftLike(JobContext(CONFIG, FF, 1.0, costs))


def test_two_event_trace_hand_computed() -> None:
    # Units 0,1 form group 0 and 2,3 group 1. Unit 3 fails at 100 (group 1 out) and is repaired at 200.
    model = _model()
    assert model.step_s == pytest.approx(2.0) and model.heal_s() == pytest.approx(4.0)
    run = replay(model, _timeline([(0, {0, 1, 2, 3}), (100, {0, 1, 2}), (200, {0, 1, 2, 3})], 300), FF)
    # 0-100 both groups (2/s); 100-103 heartbeat timeout, 103-105 the discarded step, 105-106 new quorum;
    # 106-210 one group (1/s: half the global batch); 200-210 group 1 relaunches (nobody waits);
    # 210-211 quorum, 211-215 heal (4 GB at 1 GB/s; everyone waits); 215-300 both groups.
    expected = 100 * 2 + 104 * 1 + 85 * 2
    assert run.processed_samples == pytest.approx(expected) and run.useful_samples == pytest.approx(expected)
    assert run.goodput == pytest.approx(expected / (300 * FF))
    assert run.lost_s["detection"] == pytest.approx(3) and run.lost_s["redone iteration"] == pytest.approx(2)
    assert run.lost_s["reconfiguration"] == pytest.approx(2) and run.lost_s["heal"] == pytest.approx(4)
    assert run.lost_s["degraded"] == pytest.approx(104 * 0.5)
    assert run.useful_samples / FF + sum(run.lost_s.values()) == pytest.approx(300)
    assert (106.0, pytest.approx(1.0)) in list(run.series) and run.series[-1] == (215.0, 2.0)
    assert model.group_log == [(0.0, 2), (100.0, 1), (210.0, 2)]  # the global batch: 4, then 2, then 4 samples


def test_a_spare_fills_the_broken_group_and_idle_losses_cost_nothing() -> None:
    # Unit 4 is a spare. Unit 1 fails at 100: group 0 is out, the spare joins unit 0 in it at once (relaunch 10 s,
    # then quorum + heal).
    model = _model()
    run = replay(model, _timeline([(0, {0, 1, 2, 3, 4}), (100, {0, 2, 3, 4})], 200), FF)
    # 100-106 pauses, 106-110 one group, 110-115 quorum + heal, 115-200 both groups
    assert run.processed_samples == pytest.approx(100 * 2 + 4 * 1 + 85 * 2)
    idle = _model()
    # Units 0..3 in groups, 4 a spare; losing the spare changes nothing.
    run = replay(idle, _timeline([(0, {0, 1, 2, 3, 4}), (50, {0, 1, 2, 3})], 100), FF)
    assert run.processed_samples == pytest.approx(200) and sum(run.lost_s.values()) == pytest.approx(0)


def test_every_group_out_rolls_back_and_restores_from_the_checkpoint() -> None:
    costs = replace(COSTS, fallback_checkpoint_interval_s=40)
    model = _model(costs)
    # Unit 0 fails at 50 (group 0 out), unit 3 at 60 (group 1 out: nobody holds the state), unit 0 back at 100.
    run = replay(model, _timeline([(0, {0, 1, 2, 3}), (50, {1, 2, 3}), (60, {1, 2}), (100, {0, 1, 2})], 300), FF)
    # 0-40 (80, checkpointed), 40-50 (20), 50-56 pauses, 56-60 at 1/s (4): the 24 since the checkpoint are lost.
    # Group 0 relaunches 100-110, restores from the checkpoint 110-160 (restart_s), runs at 1/s to 300 (140);
    # checkpoints are asynchronous (no pause).
    assert run.rollbacks == 1
    assert run.processed_samples == pytest.approx(80 + 20 + 4 + 140)
    assert run.useful_samples == pytest.approx(80 + 140)
    assert run.lost_s["restart"] == pytest.approx(50) and run.lost_s["heal"] == 0
    assert run.useful_samples / FF + sum(run.lost_s.values()) == pytest.approx(300)


def test_regrouping_pools_idle_survivors() -> None:
    # Units 0 and 3 fail together: each group loses a worker. Waiting for repairs, nothing runs; pooling the
    # survivors 1 and 2 forms one group again after its relaunch (restored from the checkpoint: no group held it).
    points = [(0, {0, 1, 2, 3}), (100, {1, 2})]
    waiting = replay(_model(), _timeline(points, 300), FF)
    pooled = replay(_model(replace(COSTS, torchft_regroup=True)), _timeline(points, 300), FF)
    assert waiting.processed_samples == pytest.approx(200)
    # 110 relaunch, 110-160 restore, 160-300 one group
    assert pooled.processed_samples == pytest.approx(200 + 140 * 1)


def test_bad_torchft_costs_are_refused() -> None:
    from recycle.errors import ConfigError

    with pytest.raises(ConfigError, match="torchft_heal_bytes_per_s = 0"):
        JobCosts(torchft_heal_bytes_per_s=0)
    with pytest.raises(ConfigError, match="torchft_lost_step_fraction = 2"):
        JobCosts(torchft_lost_step_fraction=2)
