"""Deadline list schedules (recycle.planner.deadline): latest starts, spread sequences, the schedule and its search."""

from __future__ import annotations

import pytest

from recycle.config import Config, parse_config
from recycle.planner import deadline
from recycle.planner.budget import LIST_SCHEDULE_COST, WorkBudget
from recycle.planner.deadline import deadline_orders, improve_sequences, latest_starts, spread_sequences
from recycle.planner.heuristic import _opt_durations
from recycle.planner.local_search import OrderEvaluator
from recycle.planner.routing import routing_candidates

_F, _B, _W = 0, 1, 2


def _config(D: int, S: int, M: int, forward: int, backward_input: int, backward_weight: int) -> Config:
    return parse_config({"topology": {"num_replicas": D, "num_stages": S}, "workload": {"num_microbatches": M},
                         "costs": {"forward": forward, "backward_input": backward_input,
                                   "backward_weight": backward_weight, "optimizer": 0}}, name="deadline")


def test_latest_starts_pack_each_stage_zero_sequence_against_the_target() -> None:
    # Two stages, fused (F 2, BW 5, message 0.5 between the stages); worker 0 runs micro-batches 1 then 0 last.
    dur = [(2.0, 5.0, 1.0), (2.0, 5.0, 1.0)]
    latest = latest_starts(2, dur, [0.5, 0.0], False, 40.0, {0: [1, 0]})
    assert latest[(_B, 0, 0)] == 35.0 and latest[(_B, 0, 1)] == 30.0  # back to back, the last ending at 40
    assert latest[(_B, 1, 0)] == 35.0 - 0.5 - 5.0  # its message to stage 0 before it
    assert latest[(_F, 1, 0)] == latest[(_B, 1, 0)] - 2.0  # the loss turn-around on the same worker
    assert latest[(_F, 0, 0)] == latest[(_F, 1, 0)] - 0.5 - 2.0
    # Decoupled: the worker's B and W both count, and the last W (not the B) ends at the target.
    decoupled = latest_starts(2, [(2.0, 4.0, 1.0)] * 2, [0.0, 0.0], True, 40.0, {0: [1, 0]})
    assert decoupled[(_B, 0, 0)] == 40.0 - 1.0 - 4.0 and decoupled[(_B, 0, 1)] == 40.0 - 5.0 - 1.0 - 4.0


def test_spread_sequences_send_the_first_micro_batches_over_disjoint_workers() -> None:
    # Two pipelines of two stages: in slot order both stage-0 workers start with a micro-batch for stage-1 worker
    # 0 (micro-batches 0 and 2), so one would wait there for the other's forward and backward.
    assert spread_sequences(((0, 0, 1, 1), (0, 1, 0, 1)), 2, 2, 2) == {0: [0, 1], 1: [3, 2]}
    # Seed 1 case 283's key: every micro-batch in its stage-0 worker's sequence, once.
    config = _config(6, 4, 7, 2, 3, 1)
    for host in routing_candidates(config, (2, 1, 0, 0)):
        sequences = spread_sequences(host, 6, 4, 7)
        assert sorted(mb for mbs in sequences.values() for mb in mbs) == list(range(42))
        assert all(host[0][mb] == p for p, mbs in sequences.items() for mb in mbs)


def test_deadline_orders_run_every_action_within_the_cap() -> None:
    config = _config(3, 3, 4, 2, 3, 1)
    key = (1, 0, 0)
    host = routing_candidates(config, key)[0]
    dur = [(2.0, 3.0, 1.0)] * 3
    for decoupled, cap in ((True, None), (True, (2, 2, 2)), (False, (1, 1, 1))):
        sequences = spread_sequences(host, 3, 3, 4)
        latest = latest_starts(3, dur, [0.0] * 3, decoupled, 30.0, sequences)
        orders = deadline_orders(3, 3, 4, host, dur, [0.0] * 3, decoupled, cap, latest)
        per_mb = 3 if decoupled else 2
        for rank, row in enumerate(orders):
            hosted = sum(1 for q in host[rank % 3] if q == rank // 3)
            assert len(row) == per_mb * hosted
        evaluator = OrderEvaluator(config, key, host, decoupled, False, cap, _opt_durations(config, key))
        assert evaluator.time(orders) is not None  # a valid order: no deadlock, no worker over its cap


def test_improve_sequences_is_paid_from_its_budget_and_deterministic() -> None:
    config = _config(6, 4, 7, 2, 4, 1)
    key = (2, 1, 0, 0)
    host = routing_candidates(config, key)[1]
    evaluator = OrderEvaluator(config, key, host, False, False, None, _opt_durations(config, key))
    cost = (LIST_SCHEDULE_COST + 1) * 2 * 6 * 7 * 4  # a list schedule and its timing, fused: 336 actions
    assert improve_sequences(evaluator, host, 7, 78.0, WorkBudget(cost - 1)) is None
    one = WorkBudget(cost)
    only_start = improve_sequences(evaluator, host, 7, 78.0, one)
    assert only_start is not None and one.spent == cost
    budget = WorkBudget(20 * cost)
    result = improve_sequences(evaluator, host, 7, 78.0, budget)
    assert result is not None and budget.spent <= 20 * cost and budget.spent % cost == 0
    assert result[1] <= only_start[1]  # moves are kept only when they do not worsen
    assert result == improve_sequences(evaluator, host, 7, 78.0, WorkBudget(20 * cost))


def test_an_incomplete_deadline_schedule_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    # A schedule that left an action out (a stall) would time without it; improve_sequences must not take it.
    config = _config(3, 3, 4, 2, 3, 1)
    key = (1, 0, 0)
    host = routing_candidates(config, key)[0]
    evaluator = OrderEvaluator(config, key, host, True, False, None, _opt_durations(config, key))
    complete = deadline.deadline_orders

    def dropping(*args: object) -> list[list[tuple[int, int]]]:
        orders = complete(*args)  # type: ignore[arg-type]
        orders[-1] = orders[-1][:-1]  # the last worker's last W
        return orders

    assert improve_sequences(evaluator, host, 4, 30.0, WorkBudget(3 * (LIST_SCHEDULE_COST + 1) * 108)) is not None
    monkeypatch.setattr(deadline, "deadline_orders", dropping)
    assert improve_sequences(evaluator, host, 4, 30.0, WorkBudget(3 * (LIST_SCHEDULE_COST + 1) * 108)) is None
