"""Replay speed (issue 27 item 4): the first rule schedule's estimate bounds the heuristic planner's simulated period
from above, so a key (or a moved layout) it proves at or under the floor a replay holds rates to gets that floor
without a plan, and every rate and decision of a replay stays the one the plans give."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_plan_cache import RAW, SYSTEMS, _config, _outcome, _trace

import recycle.traces.repartition as repartition
from recycle.config import Config, load_config, parse_config
from recycle.planner.api import clear_cache, period_plan_for_key, plan_for_key
from recycle.planner.heuristic import SIMULATE_ALL_LIMIT
from recycle.planner.options import PlannerOptions
from recycle.planner.upper_bound import period_upper_bound
from recycle.traces.experiments import JobSetup, run_job
from recycle.traces.plan_cache import PlanCache
from recycle.traces.throughput import ThroughputModel

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


def _toy(costs: dict | None = None, **more) -> Config:
    raw = json.loads(json.dumps(RAW))
    if costs:
        raw["costs"].update(costs)
    for section, values in more.items():
        raw.setdefault(section, {}).update(values)
    return parse_config(raw, name="bound-toy")


CONFIGS = {
    "toy": _toy(),
    "skewed": _toy({"forward": [1.0, 3.0, 2.0], "backward_input": [2.0, 1.0, 3.5], "backward_weight": [0.5, 2.5, 1.0],
                    "optimizer": [1.0, 4.0, 0.5]}, communication={"p2p_latency": 0.7}),
    "four-stages": _toy({"forward": [1.0, 1.0, 1.0, 1.5], "backward_input": [1.0, 1.0, 1.0, 1.5],
                         "backward_weight": [1.0, 1.0, 1.0, 1.0], "optimizer": 2.0},
                        topology={"num_replicas": 3, "num_stages": 4}, workload={"num_microbatches": 4},
                        memory={"parameter_bytes": [2_000_000] * 4, "optimizer_state_bytes": [8_000_000] * 4},
                        model={"layers_per_stage": [2, 2, 2, 2]}),
}
OPTIONS = {
    "decoupled, staggered": PlannerOptions(),
    "decoupled, coupled step": PlannerOptions(staggered=False),
    "fused, staggered": PlannerOptions(decoupled=False),
    "capped at 2": PlannerOptions(memory_cap=(2, 2, 2)),
}


def _keys(config) -> list[tuple[int, ...]]:
    D, S = config.num_replicas, config.num_stages
    return [k for k in itertools.product(range(D), repeat=S) if sum(k) <= (3 if S == 3 else 2)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("options_name", sorted(OPTIONS))
def test_the_first_rule_schedule_bounds_the_planned_period_of_every_key(name: str, options_name: str) -> None:
    config, options = CONFIGS[name], OPTIONS[options_name]
    if options.memory_cap is not None:
        options = replace(options, memory_cap=options.memory_cap[:1] * config.num_stages)
    clear_cache()
    tight = 0
    for key in _keys(config):
        bound = period_upper_bound(config, key, options)
        assert bound is not None, key
        full = plan_for_key(config, key, options).meta.predicted_period
        quick = period_plan_for_key(config, key, options).meta.predicted_period
        assert full is not None and quick is not None
        assert full == quick
        assert full <= bound, (key, full, bound)
        tight += full >= bound * (1 - 1e-6)  # the rules often reach no better than the first: a tight bound
    assert tight > 0
    clear_cache()


def test_the_bound_holds_on_the_gpt3_config_at_eight_replicas() -> None:
    config = load_config(ROOT / "configs" / "gpt3-6.7b-a100.toml").with_topology(num_replicas=8)
    clear_cache()
    for key in ((0, 0, 0, 0), (1, 0, 0, 0), (0, 2, 0, 1), (3, 1, 2, 2)):
        bound = period_upper_bound(config, key)
        period = period_plan_for_key(config, key).meta.predicted_period
        assert bound is not None and period is not None and period <= bound, (key, period, bound)
    clear_cache()


def test_no_bound_where_the_argument_does_not_apply() -> None:
    config = CONFIGS["toy"]
    assert period_upper_bound(config, (1, 0, 0), PlannerOptions(split_microbatches=True)) is None
    chunked = _toy(topology={"num_replicas": 3, "num_stages": 3, "chunks_per_worker": 2})
    assert period_upper_bound(chunked, (1, 0, 0)) is None
    slow_link = _toy(topology={"num_replicas": 3, "num_stages": 3, "workers_per_node": 3},
                     communication={"p2p_bandwidth": 1_000_000.0, "inter_node_latency": 5.0})
    assert period_upper_bound(slow_link, (1, 0, 0)) is None
    same_link = _toy(topology={"num_replicas": 3, "num_stages": 3, "workers_per_node": 3})
    assert period_upper_bound(same_link, (1, 0, 0)) is not None
    big = _toy(workload={"num_microbatches": SIMULATE_ALL_LIMIT})
    assert period_upper_bound(big, (1, 0, 0)) is None
    assert period_upper_bound(config, (3, 0, 0)) is None  # no replica of stage 0 left: the planner raises


def test_a_key_proved_at_the_floor_gets_it_without_a_plan() -> None:
    config = _config()
    asked: list[tuple[int, ...]] = []

    def planned(key: tuple[int, ...]) -> float:
        asked.append(key)
        return 7.0

    caps: dict[tuple[int, ...], float] = {(1, 0, 0): 9.0, (0, 1, 0): 10.0, (0, 0, 1): 11.0}
    model = ThroughputModel(config, planned, 1.0, floor_period=10.0, period_cap=lambda key: caps[key],
                            period_bound=lambda key: 12.0 if key == (0, 0, 1) else 1.0)
    assert model.period((1, 0, 0)) == 10.0 and model.period((0, 1, 0)) == 10.0  # proved at or under the floor
    assert asked == []
    assert model.period((0, 0, 1)) == 10.0 and asked == [(0, 0, 1)]  # the lower bound rules the floor out: planned
    assert model.keys_at_floor == 2 and model.keys_planned == 3
    no_floor = ThroughputModel(config, planned, 1.0, period_cap=lambda key: 0.0)
    assert no_floor.period((1, 0, 0)) == 7.0  # no floor, nothing to prove


def _without_bounds(monkeypatch) -> None:
    import recycle.planner.upper_bound as upper_bound

    monkeypatch.setattr(upper_bound, "period_upper_bound", lambda *a, **k: None)
    monkeypatch.setattr(repartition, "period_upper_bound", lambda *a, **k: None)


@pytest.mark.parametrize("reference", ["1f1b", "planner"])
@pytest.mark.parametrize("floor_cost", [1.0, 0.55])
def test_a_replay_decides_the_same_with_and_without_the_upper_bounds(tmp_path: Path, monkeypatch, reference: str,
                                                                      floor_cost: float) -> None:
    # floor_cost scales stage 2's costs: at 0.55 the 1F1B floor sits among the keys' planned periods (some above,
    # some below), at 1.0 above most of them.
    config = _toy({"forward": [2.0, 2.0, 2.5 * floor_cost], "backward_input": [2.0, 2.0, 2.5 * floor_cost]})
    trace = _trace(tmp_path, config)
    outcomes, floored, plans = [], [], []
    moved: list[bool] = []  # whether each moved layout's full plan was settled by a bound
    real = repartition.PartitionModel._at_floor_bound
    for use in (True, False):
        clear_cache()
        repartition._CHOICES.clear()
        with monkeypatch.context() as patch:
            def watched(self, *args):
                bound = real(self, *args)
                moved.append(bound is not None)
                return bound

            patch.setattr(repartition.PartitionModel, "_at_floor_bound", watched)
            if not use:
                _without_bounds(patch)
            result = run_job(config, trace, SYSTEMS, setup=JobSetup(period_model="planner", reference=reference),
                             plan_cache=PlanCache(tmp_path / f"plans-{reference}-{floor_cost}-{use}"))
        outcomes.append((_outcome(result), result.extra["partitions"], result.extra["keys_planned"]))
        floored.append(result.extra["keys_at_floor_unplanned"])
        plans.append(result.extra["plan_cache"]["misses"])
    assert outcomes[0] == outcomes[1]
    assert floored[1] == 0
    if reference == "1f1b":
        assert floored[0] > 0 and plans[0] < plans[1]  # keys proved at the 1F1B floor were not planned
        assert any(moved)  # and moved layouts proved at their floor (polishes, decisions' rates)
    clear_cache()
    repartition._CHOICES.clear()

