"""Work a cold replay no longer repeats (issue 27 item 4): each reuse must give exactly what recomputing gives."""

from __future__ import annotations

import itertools
import math
import random

import pytest

import recycle.planner.heuristic as heuristic
from recycle.config import Config, load_config, parse_config
from recycle.planner.api import clear_cache
from recycle.planner.budget import WorkBudget
from recycle.planner.heuristic import VARIANTS, _opt_durations, list_schedule, schedule_heuristic
from recycle.planner.local_search import OrderEvaluator, improve_orders
from recycle.planner.options import PlannerOptions
from recycle.planner.partition import _below, _bound, _fits, _floor, balanced_partition, layer_costs
from recycle.planner.routing import routing_candidates

pytestmark = pytest.mark.timeout(120)


def _uneven(D: int = 3, M: int = 3, capacity: int = 0) -> Config:
    """S=3, 7 layers as 3/2/2 with a heavier last stage; `capacity` > 0 makes memory rule partitions out."""
    raw = {
        "topology": {"num_replicas": D, "num_stages": 3},
        "workload": {"num_microbatches": M},
        "costs": {"forward": [3.0, 2.0, 4.0], "backward_input": [3.0, 2.0, 5.0], "backward_weight": [3.0, 2.0, 3.0]},
        "communication": {"allreduce_bandwidth": 1_000_000.0, "allreduce_latency": 0.1},
        "memory": {"parameter_bytes": [3_000_000, 2_000_000, 2_000_000], "activation_bytes": [1_000_000] * 3,
                   "capacity_bytes": capacity},
        "model": {"layers_per_stage": [3, 2, 2]},
    }
    return parse_config(raw, name="uneven")


def _walk_per_node(config, key, ceiling, options, costs, near, budget, bound_work):
    """The partition walk as it was before its floors and memory checks were tabled (computed at every node)."""
    from recycle.planner.bounds import split_unit

    S, total = len(costs.layers), sum(costs.layers)
    live = [config.num_replicas - k for k in key]
    found = []

    def walk(prefix, left):
        s = len(prefix)
        options_n = [left] if s == S - 1 else sorted(range(1, left - (S - 1 - s) + 1),
                                                     key=lambda n: (abs(n - near[s]), n))
        for n in options_n:
            if not budget.afford(1):
                return False
            if _floor(config, costs, s, n, live[s], options.decoupled, split_unit(config, options)) >= ceiling \
                    or not _fits(config, costs, s, n):
                continue
            if s == S - 1:
                if not budget.afford(bound_work):
                    return False
                partition = tuple(prefix + [n])
                value = _bound(config, key, partition, options, costs)
                if value < ceiling:
                    found.append((value, partition))
            elif not walk(prefix + [n], left - n):
                return False
        return True

    complete = walk([], total)
    found.sort()
    return found, complete


@pytest.mark.parametrize("capacity", [0, 9_000_000])
def test_the_tabled_partition_walk_visits_the_same_nodes(capacity) -> None:
    # The same partitions, in the same order, and the same budget spent node for node (a budget that runs out
    # mid-walk must stop both at the same node), with and without partitions ruled out by memory.
    config = _uneven(capacity=capacity)
    costs = layer_costs(config)
    options = PlannerOptions(search=False)
    for key in ((1, 0, 0), (0, 0, 2), (1, 1, 0), (2, 0, 1)):
        near = balanced_partition(config, key, costs)
        for ceiling in (0.0, 30.0, 45.0, 60.0, math.inf):
            for work in (10, 37, 400, 10_000):
                new_budget, old_budget = WorkBudget(work), WorkBudget(work)
                new = _below(config, key, ceiling, options, costs, near, new_budget, 3)
                old = _walk_per_node(config, key, ceiling, options, costs, near, old_budget, 3)
                assert new == old and new_budget.left == old_budget.left, (key, ceiling, work)


def _moves(orders, rng, count):
    """`count` random single-action moves (rank, from, to) within a worker's order (deadlocks included)."""
    movable = [r for r, row in enumerate(orders) if len(row) > 1]
    for _ in range(count):
        rank = rng.choice(movable)
        i = rng.randrange(len(orders[rank]))
        j = rng.randrange(len(orders[rank]))
        if i != j:
            yield rank, i, j


@pytest.mark.parametrize("decoupled, staggered", [(True, True), (False, True), (True, False)])
def test_a_move_timed_from_the_old_timing_is_timed_as_from_scratch(decoupled, staggered) -> None:
    # Order moves re-time only the actions at or after the moved worker's free time: every entry (start and end,
    # to the last bit) and every deadlock must be what timing the whole orders gives.
    config = load_config("configs/gpt3-6.7b-a100.toml")
    rng = random.Random(7)
    checked = 0
    for key in ((1, 0, 0, 0), (0, 2, 0, 1), (0, 0, 0, 3)):
        host = routing_candidates(config, key)[0]
        timed = list_schedule(config, key, host, decoupled, staggered, None, VARIANTS[0])
        evaluator = OrderEvaluator(config, key, host, decoupled, staggered, None, _opt_durations(config, key))
        orders = [[(code, mb) for code, mb, _, _ in row] for row in timed.entries]
        base = evaluator.time(orders)
        assert base is not None
        for rank, i, j in _moves(orders, rng, 60):
            moved = [list(row) for row in orders]
            item = moved[rank].pop(i)
            moved[rank].insert(j, item)
            full = evaluator.time(moved)
            assert evaluator.time(moved, base, rank, min(i, j)) == full
            checked += full is not None
            if full is not None and rng.random() < 0.5:  # walk on: the next move starts from this one
                orders, base = moved, full
    assert checked > 50  # most moves are feasible: the comparison is not between two Nones


def test_improve_orders_gives_what_it_gave_timing_every_move_in_full(monkeypatch) -> None:
    config = load_config("configs/gpt3-6.7b-a100.toml")
    key = (0, 1, 0, 1)
    host = routing_candidates(config, key)[0]
    timed = list_schedule(config, key, host, True, True, None, VARIANTS[0])
    evaluator = OrderEvaluator(config, key, host, True, True, None, _opt_durations(config, key))
    quick = improve_orders(evaluator, timed.entries, WorkBudget(200_000), seed=3)
    full_time = OrderEvaluator.time
    monkeypatch.setattr(OrderEvaluator, "time", lambda self, orders, *rest: full_time(self, orders))
    assert improve_orders(evaluator, timed.entries, WorkBudget(200_000), seed=3) == quick


def _digest(plan) -> str:
    import json

    return json.dumps(plan.to_dict(), sort_keys=True)


@pytest.mark.parametrize("options", [PlannerOptions(), PlannerOptions(search=False, rules=2),
                                     PlannerOptions(decoupled=False)])
def test_kept_schedules_and_simulations_give_the_cold_plans(options, monkeypatch) -> None:
    # Plan every key of a job twice in a row (the second time every list schedule and simulation is kept from the
    # first) and once more cold: the same plan, byte for byte; and the kept ones were really used.
    config = _uneven()
    keys = [k for k in itertools.product(range(3), repeat=3) if any(k) and max(k) < 3]
    clear_cache()
    warm = {}
    for key in keys:
        schedule_heuristic(config, key, options, period_only=True)
        warm[key] = _digest(schedule_heuristic(config, key, options, period_only=True))
    calls = []
    real = heuristic._event_loop
    monkeypatch.setattr(heuristic, "_event_loop", lambda *a: calls.append(1) or real(*a))
    schedule_heuristic(config, keys[-1], options, period_only=True)
    assert not calls  # the last key's schedules were all kept
    for key in keys:
        clear_cache()
        assert _digest(schedule_heuristic(config, key, options, period_only=True)) == warm[key], key
    monkeypatch.setattr(heuristic, "_SCHEDULES_LIMIT", 0)
    monkeypatch.setattr(heuristic, "_SCORED_LIMIT", 0)
    clear_cache()
    for key in keys[:5]:
        assert _digest(schedule_heuristic(config, key, options, period_only=True)) == warm[key], key
