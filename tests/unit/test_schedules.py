"""Fault-free schedules: closed-form makespans, ZB-H1 against 1F1B, memory peaks, and shape over replicas."""

from __future__ import annotations

import pytest

from recycle.config import uniform_config
from recycle.errors import ConfigError
from recycle.ir.actions import Kind
from recycle.schedules.fault_free import SCHEDULES, build_schedule
from recycle.sim.simulator import simulate

SWEEP = [(S, M) for S in range(2, 9) for M in range(S, 4 * S + 1)]
COSTS = [(1.0, 1.0, 1.0), (2.0, 3.0, 1.0)]  # (F, B, W): unit and non-unit


def _run(S: int, M: int, costs: tuple[float, float, float], name: str, D: int = 1):
    F, B, W = costs
    config = uniform_config(D, S, M, forward=F, backward_input=B, backward_weight=W)
    plan = build_schedule(config, name)
    return plan, simulate(plan, config, iterations=1)


@pytest.mark.parametrize("costs", COSTS)
def test_sweep_closed_forms_and_zb_h1_against_1f1b(costs: tuple[float, float, float]) -> None:
    F, B, W = costs
    for S, M in SWEEP:
        _, one_f_one_b = _run(S, M, costs, "1f1b")
        _, zb = _run(S, M, costs, "zb-h1")
        _, gpipe = _run(S, M, costs, "gpipe")
        where = f"S={S} M={M} F,B,W={costs}"
        assert one_f_one_b.makespan == (M + S - 1) * (F + B + W), where
        # ZB paper (W <= F): bubble (S-1)(F+B-W) instead of 1F1B's (S-1)(F+B+W).
        assert zb.makespan == M * (F + B + W) + (S - 1) * (F + B - W), where
        assert zb.makespan < one_f_one_b.makespan, where
        assert max(zb.peak_activations) <= max(one_f_one_b.peak_activations), where
        assert one_f_one_b.peak_activations == tuple(S - s for s in range(S)), where
        assert zb.peak_activations == (S,) * S, where  # stage s defers s W's: S in flight everywhere
        assert gpipe.peak_activations == (M,) * S, where


def test_zb_h1_beats_1f1b_when_weight_grad_is_slower_than_forward() -> None:
    # Outside the ZB paper's W <= F assumption the closed form no longer holds, but ZB-H1 still wins.
    for S, M in [(2, 2), (4, 6), (8, 16)]:
        _, one_f_one_b = _run(S, M, (1.0, 2.0, 2.0), "1f1b")
        _, decoupled = _run(S, M, (1.0, 2.0, 2.0), "1f1b-decoupled")
        _, zb = _run(S, M, (1.0, 2.0, 2.0), "zb-h1")
        assert zb.makespan < decoupled.makespan < one_f_one_b.makespan


def test_decoupled_1f1b_saves_the_weight_grads_on_the_critical_path() -> None:
    for S, M in [(2, 4), (4, 6), (6, 13)]:
        _, result = _run(S, M, (2.0, 3.0, 1.0), "1f1b-decoupled")
        assert result.makespan == (M + S - 1) * 6.0 - (S - 1) * 1.0
        assert result.peak_activations == tuple(S - s for s in range(S))


def test_zb_h1_order_defers_exactly_stage_many_weight_grads() -> None:
    plan, _ = _run(4, 8, (1.0, 1.0, 1.0), "zb-h1")
    for stage in range(4):
        acts = plan.actions[stage]
        kinds = [a.kind for a in acts[:-1]]
        assert kinds.count(Kind.F) == kinds.count(Kind.B) == kinds.count(Kind.W) == 8
        # F/B subsequence is 1F1B's; the trailing run of W's (the cool-down filler) is `stage` long, plus the one
        # that follows the last B.
        trailing = 0
        for a in reversed(acts[:-1]):
            if a.kind is not Kind.W:
                break
            trailing += 1
        assert trailing == stage + 1
        one_f_one_b = [a for a in build_schedule(uniform_config(1, 4, 8), "1f1b-decoupled").actions[stage]
                       if a.kind in (Kind.F, Kind.B)]
        assert [a for a in acts if a.kind in (Kind.F, Kind.B)] == one_f_one_b


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_replica_runs_the_same_order_on_its_own_shard(name: str) -> None:
    D, S, M = 3, 4, 5
    plan, result = _run(S, M, (1.0, 1.0, 1.0), name, D=D)
    for replica in range(D):
        for stage in range(S):
            ours = plan.actions[plan.rank(replica, stage)]
            base = plan.actions[plan.rank(0, stage)]
            assert [(a.kind, a.mb - replica * M if a.mb >= 0 else -1) for a in ours] == \
                   [(a.kind, a.mb) for a in base]
    assert plan.host == tuple(tuple(mb // M for mb in range(D * M)) for _ in range(S))
    _, single = _run(S, M, (1.0, 1.0, 1.0), name, D=1)
    assert result.makespan == single.makespan  # fault-free replicas never interact before the optimizer


def test_schedules_with_fewer_microbatches_than_stages_are_valid() -> None:
    S, M = 6, 2
    for name in SCHEDULES:
        plan, result = _run(S, M, (1.0, 1.0, 1.0), name)  # build_schedule validates (coverage, deadlock)
        per_worker = M * (3 if plan.meta.decoupled else 2) + 1
        assert plan.num_actions == S * per_worker, name
        assert max(result.peak_activations) == M, name
    _, one_f_one_b = _run(S, M, (1.0, 1.0, 1.0), "1f1b")
    assert one_f_one_b.makespan == (M + S - 1) * 3.0


def test_unknown_schedule_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="zb-h2.*choose one of"):
        build_schedule(uniform_config(1, 2, 2), "zb-h2")
