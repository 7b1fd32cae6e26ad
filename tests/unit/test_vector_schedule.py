"""The numpy list scheduler and compact plans: the same schedules, actions and simulated numbers as the Python path."""

from __future__ import annotations

import dataclasses
import json
import pickle
import random

import pytest

from recycle.config import Config, uniform_config
from recycle.ir.compact import CompactActions
from recycle.ir.plan import Plan
from recycle.ir.validate import validate_plan
from recycle.planner import heuristic
from recycle.planner.heuristic import VARIANTS, Order, Variant, order_of
from recycle.planner.routing import failed_routing
from recycle.planner.vector_schedule import vector_eligible
from recycle.sim.levels import time_compact
from recycle.sim.simulator import simulate


def _random_case(rng: random.Random) -> tuple[Config, frozenset[tuple[int, int]]]:
    """A small whole-unit config (costs 1-3, p2p 0-2) and 0-3 failures that leave every stage a live replica."""
    D, S = rng.randint(2, 6), rng.randint(2, 5)
    config = uniform_config(D, S, rng.randint(1, 2 * S), forward=rng.randint(1, 3),
                            backward_input=rng.randint(1, 3), backward_weight=rng.randint(1, 2),
                            optimizer=rng.choice([0, 3]))
    latency = float(rng.choice([0, 1, 2]))
    config = dataclasses.replace(config, communication=dataclasses.replace(config.communication, p2p_latency=latency))
    while True:
        failed = frozenset(rng.sample([(p, s) for p in range(D) for s in range(S)], rng.randint(0, 3)))
        if all(sum(1 for _, st in failed if st == s) < D for s in range(S)):
            return config, failed


def _compact_timed(config: Config, key: tuple[int, ...], host, decoupled: bool, caps, variant: Variant,
                   staggered: bool = True) -> heuristic._Timed:
    setting = heuristic._setting(config, host, decoupled, caps, variant)
    compact = heuristic._vector_schedule(setting, host)
    assert compact is not None
    return heuristic._Timed(None, heuristic._estimate_compact(config, key, compact, staggered), compact)


@pytest.mark.timeout(60)
def test_vector_scheduler_matches_the_python_scheduler() -> None:
    """Every deterministic rule, capped or not, split or fused backward, with p2p times: the same entries and
    estimate (the Python loop is the reference; random rules always use it)."""
    rng = random.Random(7)
    compared = 0
    for case in range(6):
        config, failed = _random_case(rng)
        S = config.num_stages
        key = tuple(sum(1 for _, st in failed if st == s) for s in range(S))
        host = failed_routing(config, failed)
        for decoupled in (True, False):
            caps = rng.choice([None, tuple(rng.randint(1, 4) for _ in range(S))])
            for variant in VARIANTS[case % 2::2]:  # each rule in three of the cases
                setting = heuristic._setting(config, host, decoupled, caps, variant)
                rows = heuristic._event_loop(setting, host, heuristic._item_maker(setting, host, None), None)
                timed = _compact_timed(config, key, host, decoupled, caps, variant)
                assert timed.entries == rows, (config.name, sorted(failed), decoupled, caps, variant.name)
                assert timed.estimate == heuristic._estimate(config, key, rows, True)
                compared += 1
    assert compared == 6 * len(VARIANTS)


def test_vector_eligible_needs_whole_units_and_many_actions_per_step() -> None:
    assert vector_eligible([1.0, 2.0, 1.0], [0.0, 1.0], 100_000, 400)
    assert not vector_eligible([1.0, 2.5, 1.0], [0.0], 100_000, 400)  # a fraction: times are not exact integers
    assert not vector_eligible([1.0, 1.0], [0.5], 100_000, 400)
    assert not vector_eligible([1.0, 0.0], [0.0], 100_000, 400)  # zero duration: same-time decisions interact
    assert not vector_eligible([1.0, 1.0], [0.0], 100_000, 10_000)  # too few actions per step to pay off


def test_only_large_whole_unit_instances_with_fixed_rules_use_numpy() -> None:
    def uses(config: Config, variant: Variant = VARIANTS[0]) -> bool:
        host = failed_routing(config, frozenset({(0, 1)}))
        return heuristic._use_vector(heuristic._setting(config, host, True, None, variant))

    assert uses(uniform_config(32, 16, 64))
    assert not uses(uniform_config(32, 16, 64), Variant("random", seed=1))  # one random stream: the Python loop
    assert not uses(uniform_config(4, 4, 8))  # 384 actions: below VECTOR_MIN_ACTIONS
    assert not uses(uniform_config(32, 16, 64, forward=1.5))  # not whole units


def test_orders_of_the_variants() -> None:
    assert order_of(VARIANTS[0]) is Order.SLOT
    assert order_of(Variant("x")) is Order.ARRIVAL
    assert order_of(Variant("x", urgent_first=True)) is Order.URGENT
    assert order_of(Variant("x", by_id=True, urgent_first=True)) is Order.BY_ID
    assert order_of(Variant("x", own_first=True, slot_order=True)) is Order.OWN_FIRST
    assert order_of(Variant("x", seed=3, slot_order=True)) is Order.RANDOM


@pytest.mark.timeout(60)
def test_compact_actions_match_the_python_action_lists() -> None:
    """B/W fusion in numpy gives the same per-worker lists as _to_actions on the Python entries."""
    rng = random.Random(11)
    for _ in range(6):
        config, failed = _random_case(rng)
        if rng.random() < 0.5:  # a fused kernel faster than B + W at some stages: fusion then depends on timing
            fused = tuple(float(rng.randint(1, 4)) for _ in range(config.num_stages))
            config = dataclasses.replace(config, costs=dataclasses.replace(config.costs, backward_fused=fused))
        S = config.num_stages
        key = tuple(sum(1 for _, st in failed if st == s) for s in range(S))
        host = failed_routing(config, failed)
        for decoupled in (True, False):
            for variant in VARIANTS[:3]:
                timed = _compact_timed(config, key, host, decoupled, None, variant)
                rows = heuristic._Timed(timed.entries, timed.estimate)
                for merge in (True, False):
                    compact = heuristic._to_actions(config, timed, host, decoupled, merge)
                    assert isinstance(compact, CompactActions)
                    assert compact == heuristic._to_actions(config, rows, host, decoupled, merge)


def _large_plan(staggered: bool, decoupled: bool = True, workers_per_node: int = 0) -> tuple[Plan, Config]:
    """A plan above the simulator's level-timer threshold, with CompactActions."""
    config = uniform_config(6, 4, 96, forward=1, backward_input=2, backward_weight=1, optimizer=3.0)
    if workers_per_node:
        config = dataclasses.replace(
            config, topology=dataclasses.replace(config.topology, workers_per_node=workers_per_node),
            communication=dataclasses.replace(config.communication, p2p_latency=1.0, inter_node_latency=2.0))
    failed = frozenset({(1, 0), (4, 2)})
    key = (1, 0, 1, 0)
    host = failed_routing(config, failed)
    timed = _compact_timed(config, key, host, decoupled, None, VARIANTS[0], staggered)
    actions = heuristic._to_actions(config, timed, host, decoupled, merge=True)
    assert isinstance(actions, CompactActions)
    return Plan(6, 4, 96, host, actions, failed, staggered), config


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staggered, decoupled, workers_per_node",
                         [(True, True, 0), (False, True, 0), (True, False, 0), (True, True, 8), (False, True, 4)])
def test_time_compact_gives_the_simulators_period_and_makespan(staggered: bool, decoupled: bool,
                                                               workers_per_node: int) -> None:
    plan, config = _large_plan(staggered, decoupled, workers_per_node)
    assert plan.num_actions >= 4_000  # the simulator's level timer applies
    timing = time_compact(config, plan.actions, plan.failed, plan.staggered)
    validate_plan(plan)
    result = simulate(plan, config)
    assert timing == (result.period, result.makespan)


def test_compact_actions_read_like_the_tuple_of_action_tuples() -> None:
    plan, config = _large_plan(True)
    actions = plan.actions
    assert isinstance(actions, CompactActions)
    rows = tuple(tuple(row) for row in actions)
    assert len(actions) == len(rows) == 24
    assert actions[5] == rows[5] and actions[-1] == rows[-1] and actions[2:4] == rows[2:4]
    assert actions == rows and rows == actions and hash(actions) == hash(rows)
    assert pickle.loads(pickle.dumps(actions)) == rows
    twin = dataclasses.replace(plan, actions=rows)
    assert twin == plan and twin.to_json() == plan.to_json()
    assert Plan.from_dict(json.loads(plan.to_json())) == plan


def test_a_stalled_schedule_keeps_only_the_written_rows() -> None:
    """Before any step nothing is written: every rank has zero actions (the caller then reports the stall)."""
    from recycle.planner.vector_schedule import _Stepper

    config = uniform_config(2, 2, 2)
    host = failed_routing(config, frozenset())
    stepper = _Stepper(2, 2, 2, host, [(1.0, 1.0, 1.0)] * 2, [0.0, 0.0], [4.0] * 4,
                       lambda stage, replica, mb: mb * 0, 0, True, True, False, True)
    schedule = stepper.schedule()
    assert schedule.counts() == [0, 0, 0, 0] and len(schedule.code) == 0


@pytest.mark.timeout(120)
def test_large_compact_plans_from_the_heuristic_are_valid() -> None:
    """Above SIMULATE_ALL_LIMIT the heuristic skips validate_plan; a plan from the numpy path passes it."""
    from recycle.planner.api import plan_for_key
    from recycle.planner.bounds import period_lower_bound
    from recycle.planner.options import PlannerOptions

    config = uniform_config(32, 8, 32, optimizer=2.0)
    key = (0, 1, 0, 0, 0, 0, 2, 0)
    plan = plan_for_key(config, key)
    assert isinstance(plan.actions, CompactActions) and plan.num_actions > heuristic.SIMULATE_ALL_LIMIT
    validate_plan(plan)
    assert simulate(plan, config).period == plan.meta.predicted_period
    assert plan.meta.predicted_period >= period_lower_bound(config, key, PlannerOptions()) * (1 - 1e-9)
