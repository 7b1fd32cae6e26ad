"""Each baseline model on a hand-computed case."""

from __future__ import annotations

import math

import pytest

from recycle.config import load_config, parse_config, uniform_config
from recycle.traces.baselines import (
    BambooLike,
    CheckpointRestart,
    FaultScaled,
    OobleckLike,
    bamboo_fits,
    oobleck_iteration_time,
    oobleck_min_template,
    pipeline_time,
)
from recycle.traces.jobsim import replay
from recycle.traces.mapping import UnitTimeline
from recycle.traces.model import JobContext, JobCosts
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _timeline(points: list[tuple[float, set[int]]], end: float) -> UnitTimeline:
    return UnitTimeline(tuple(t for t, _ in points), tuple(frozenset(s) for _, s in points), end, 1, 1)


def test_pipeline_time_formula() -> None:
    assert pipeline_time([1, 1, 1, 1], 4) == 3 * 1 + 4  # (M-1) * max + sum
    assert pipeline_time([1, 2, 1], 4) == 3 * 2 + 4  # one worker carries two stages


def test_fault_scaled_is_proportional_and_capped() -> None:
    ctx = JobContext(uniform_config(6, 4, 8), 12.0, 1.0)
    model = FaultScaled(ctx)
    assert model.start(0, frozenset(range(18))).rate == pytest.approx(12.0 * 18 / 24)
    assert model.start(0, frozenset(range(30))).rate == pytest.approx(12.0)  # spares do not count


def test_checkpoint_restart_hand_computed() -> None:
    # D=2, S=2, fault-free 10 samples/s; checkpoint every 40 s of training costing 5 s; detect 2 s, restart 20 s.
    costs = JobCosts(detect_s=2, restart_s=20, checkpoint_interval_s=40, checkpoint_cost_s=5)
    ctx = JobContext(uniform_config(2, 2, 4), 10.0, 1.0, costs)
    run = replay(CheckpointRestart(ctx), _timeline([(0, {0, 1, 2, 3}), (100, {1, 2, 3})], 200), 10.0)
    # 0-40 run, 40-45 ckpt, 45-85 run, 85-90 ckpt, 90-100 run (100 samples since the checkpoint, rolled back);
    # 100-102 detect, 102-122 restart with D'=1 (5/s); 122-152 run, 152-157 ckpt, 157-197 run, 197-200 ckpt.
    assert run.processed_samples == pytest.approx(900 + 350)
    assert run.useful_samples == pytest.approx(800 + 350)
    assert run.lost_s["lost work"] == pytest.approx(10)
    assert run.lost_s["checkpoint"] == pytest.approx(18)
    assert run.lost_s["restart"] == pytest.approx(20) and run.lost_s["detection"] == pytest.approx(2)
    assert run.lost_s["degraded"] == pytest.approx(35)
    assert run.goodput == pytest.approx(1150 / 2000)
    assert run.useful_samples / 10 + sum(run.lost_s.values()) == pytest.approx(200)


def test_checkpoint_restart_ignores_spare_loss_and_grows_on_rejoin() -> None:
    costs = JobCosts(detect_s=1, restart_s=10, checkpoint_interval_s=1000, checkpoint_cost_s=4)
    ctx = JobContext(uniform_config(2, 2, 4), 10.0, 1.0, costs)
    # 5 units: unit 4 is a spare; losing it changes nothing. Losing 0 -> 1 pipeline; 0 back -> 2 again.
    tl = _timeline([(0, {0, 1, 2, 3, 4}), (10, {0, 1, 2, 3}), (20, {1, 2, 3}), (50, {0, 1, 2, 3})], 100)
    run = replay(CheckpointRestart(ctx), tl, 10.0)
    assert run.rollbacks == 1
    # 0-20 full (200), 20-21 detect, 21-31 restart, 31-50 at 5/s (95), 50-54 ckpt, 54-64 restart, 64-100 full (360)
    assert run.processed_samples == pytest.approx(200 + 95 + 360)
    # the crash at 20 rolls back the 200 samples made since t=0 (no checkpoint yet); growing checkpoints first
    assert run.useful_samples == pytest.approx(95 + 360)
    assert run.lost_s["lost work"] == pytest.approx(20.0)
    assert run.lost_s["restart"] == pytest.approx(20.0) and run.lost_s["checkpoint"] == pytest.approx(4.0)


def test_oobleck_iteration_time_by_hand() -> None:
    # 8 live workers, 16 micro-batches, C = 4 per micro-batch through the model, templates 2..8 workers:
    # P = 4 pipelines of 2: T = 4 * (1 + 12 / 8) = 10; P = 1 of 8: 4 * (1 + 15 / 8) = 11.5 -> 10 is best.
    assert oobleck_iteration_time(8, 16, 4.0, 2, 8) == pytest.approx(10.0)
    assert oobleck_iteration_time(6, 16, 4.0, 2, 8) == pytest.approx(4 * (1 + 13 / 6))
    assert math.isinf(oobleck_iteration_time(1, 16, 4.0, 2, 8))


def test_oobleck_min_template_from_memory() -> None:
    raw = {"topology": {"num_replicas": 2, "num_stages": 2}, "workload": {"num_microbatches": 4},
           "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
           "memory": {"parameter_bytes": 10 * 10**9, "optimizer_state_bytes": 40 * 10**9,
                      "activation_bytes": 10 * 10**9}}
    cfg = parse_config(raw)
    # state 100 GB, activations of the whole model 20 GB, 80 GB device: 100 / n <= 60 -> n >= 2
    assert oobleck_min_template(cfg, 80 * 10**9) == 2
    assert oobleck_min_template(uniform_config(2, 2, 4), 80 * 10**9) == 1  # no memory info: anything fits


def test_oobleck_rate_and_pauses() -> None:
    # D=2, S=4, M=8, each stage F+B+W = 1 (C = 4), 16 micro-batches, no memory info (templates from 1 worker).
    cfg = uniform_config(2, 4, 8, forward=0.5, backward_input=0.25, backward_weight=0.25)
    costs = JobCosts(detect_s=3, oobleck_reconfig_s=7)
    ctx = JobContext(cfg, 10.0, 1.0, costs)
    model = OobleckLike(ctx)
    # 8 workers: 8 pipelines of 1, T = 4 * (1 + 8 / 8) = 8; 6 workers: T = 4 * (1 + 10 / 6) = 10.667
    assert model.rate(6) == pytest.approx(10.0 * 8 / (4 * (1 + 10 / 6)))
    run = replay(model, _timeline([(0, set(range(8))), (100, set(range(6))), (200, set(range(8)))], 300), 10.0)
    assert run.lost_s["detection"] == pytest.approx(3)  # only the failure is detected
    assert run.lost_s["reconfiguration"] == pytest.approx(14)  # one per change, no copy time (infinite bandwidth)
    assert run.processed_samples == pytest.approx(100 * 10 + 90 * model.rate(6) + 93 * 10)


def test_bamboo_does_not_fit_the_6_7b_config() -> None:
    fits, why = bamboo_fits(load_config(CONFIGS / "gpt3-6.7b-a100.toml"), 80 * 10**9)
    assert not fits and "GB" in why
    assert bamboo_fits(uniform_config(2, 4, 8), 80 * 10**9) == (True, "")
    ctx = JobContext(load_config(CONFIGS / "gpt3-6.7b-a100.toml"), 10.0, 1e-6)
    run = replay(BambooLike(ctx), _timeline([(0, set(range(24)))], 50), 10.0)
    assert run.processed_samples == 0 and run.lost_s["down"] == pytest.approx(50)


def test_bamboo_takeover_slowdown_and_fatal_adjacent_loss() -> None:
    # D=2, S=4, M=4, stage cost 1: fault-free pipeline 3*1 + 4 = 7. Fault-free rate 10, redundancy 25%.
    cfg = uniform_config(2, 4, 4, forward=0.5, backward_input=0.25, backward_weight=0.25)
    costs = JobCosts(detect_s=1, bamboo_reconfig_s=4, restart_s=20, bamboo_rc_overhead=0.25,
                     fallback_checkpoint_interval_s=1e9)
    ctx = JobContext(cfg, 10.0, 1.0, costs)
    model = BambooLike(ctx)
    assert model.start(0, frozenset(range(8))).rate == pytest.approx(7.5)
    # unit 2 holds (0, 2): its predecessor (0, 1) takes stage 2 over -> loads [1, 2, 1]: 3*2 + 4 = 10
    d = model.on_change(10, frozenset(range(8)) - {2}, frozenset({2}), frozenset())
    assert d.rate == pytest.approx(7.5 * 7 / 10)
    assert d.pauses == (("detection", 1), ("reconfiguration", 4))
    # unit 1 holds (0, 1): stages 1 and 2 of pipeline 0 both gone -> fatal: restart with D' = 6 // 4 = 1
    d = model.on_change(20, frozenset(range(8)) - {1, 2}, frozenset({1}), frozenset())
    assert d.rollback and ("restart", 20) in d.pauses
    assert d.rate == pytest.approx(7.5 * 1 / 2)
