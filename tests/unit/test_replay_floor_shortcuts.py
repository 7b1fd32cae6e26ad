"""Replay speed (issue 27 item 4): ReCycle+ skips the layer-partition search of a key whose configured layout is
already at the floor every moved layout is held to, and the choice, its rates and every decision of a replay are
the ones the full search gives; the garbage collector is paused while the systems replay and restored after."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_plan_cache import SYSTEMS, _config, _outcome, _trace

import recycle.traces.repartition as repartition
from recycle.planner.api import clear_cache
from recycle.planner.options import PlannerOptions
from recycle.traces.experiments import JobSetup, run_job
from recycle.traces.plan_cache import PlanCache
from recycle.traces.repartition import PartitionModel
from recycle.traces.throughput import ThroughputModel, planner_period_fn

pytestmark = pytest.mark.timeout(300)

KEYS = ((1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (0, 1, 1), (2, 0, 0), (0, 0, 2), (1, 0, 1))


def _models(floor: float | None) -> tuple[PartitionModel, PartitionModel]:
    """Two ReCycle+ partition models over one planner-backed rate model: the second never takes the shortcut."""
    config = _config()
    throughput = ThroughputModel(config, planner_period_fn(config, PlannerOptions()), 1.0, floor_period=floor)
    fast = PartitionModel(throughput, screen_rules=2)
    full = PartitionModel(throughput, screen_rules=2)
    full.settled_at_floor = lambda key: False  # type: ignore[method-assign]
    return fast, full


@pytest.mark.parametrize("floor_at", ["none", "low", "middle", "high"])
def test_a_key_at_the_floor_gets_the_full_searchs_choice_without_a_search(monkeypatch, floor_at: str) -> None:
    clear_cache()
    repartition._CHOICES.clear()
    config = _config()
    raw = sorted(planner_period_fn(config, PlannerOptions())(key) for key in KEYS)
    floor = {"none": None, "low": raw[0] * 0.5, "middle": raw[len(raw) // 2], "high": raw[-1] * 2}[floor_at]
    fast, full = _models(floor)
    searched: list[tuple[int, ...]] = []
    real = repartition.best_partition
    monkeypatch.setattr(repartition, "best_partition",
                        lambda config, key, *a, **k: searched.append(tuple(key)) or real(config, key, *a, **k))
    shortcut = 0
    for key in KEYS:
        settled = fast.settled_at_floor(key)
        searched.clear()
        chosen = fast.choice(key)
        assert (searched == []) == settled, (key, settled, searched)
        shortcut += settled
        assert chosen == full.choice(key), key
        assert fast.rate(key, chosen) == full.rate(key, full.choice(key))
        mine, theirs = fast.choices()[key], full.choices()[key]
        assert (mine.partition, mine.period, mine.configured_period, mine.balanced, mine.ideal_period) == \
            (theirs.partition, theirs.period, theirs.configured_period, theirs.balanced, theirs.ideal_period)
        assert mine.evaluated == (0 if settled else theirs.evaluated)
    # Settled exactly where the configured layout's floored period is at most a moved layout's floor.
    ff = planner_period_fn(config, PlannerOptions())((0, 0, 0))
    lowest = ff if floor is None else max(ff, floor)
    period = planner_period_fn(config, PlannerOptions())
    assert shortcut == sum(max(period(key), floor or 0.0) <= lowest for key in KEYS)
    if floor_at == "high":
        assert shortcut == len(KEYS)
    if floor_at == "middle":
        assert 0 < shortcut < len(KEYS)
    clear_cache()
    repartition._CHOICES.clear()


def test_the_fault_free_key_never_takes_the_shortcut() -> None:
    fast, _ = _models(10 ** 12)
    assert not fast.settled_at_floor((0, 0, 0))
    assert fast.choice((0, 0, 0)) == fast.configured


@pytest.mark.parametrize("reference", ["1f1b", "planner"])
def test_a_replay_decides_the_same_with_and_without_the_shortcut(tmp_path: Path, monkeypatch, reference: str) -> None:
    config = _config()
    trace = _trace(tmp_path, config)
    outcomes = []
    taken: list[int] = []
    real = PartitionModel.settled_at_floor
    for use in (True, False):
        clear_cache()
        repartition._CHOICES.clear()
        seen: list[bool] = []
        monkeypatch.setattr(PartitionModel, "settled_at_floor",
                            lambda self, key: (seen.append(real(self, key)) or seen[-1]) and use)
        result = run_job(config, trace, SYSTEMS, setup=JobSetup(period_model="planner", reference=reference),
                         plan_cache=PlanCache(tmp_path / f"plans-{reference}-{use}"))
        outcomes.append((_outcome(result), [{k: v for k, v in p.items() if k != "evaluated"}
                                            for p in result.extra["partitions"]]))
        taken.append(sum(seen))
    assert outcomes[0] == outcomes[1]
    if reference == "1f1b":
        assert taken[0] > 0  # the toy job has keys at the 1F1B floor: the shortcut was taken and changed nothing
    clear_cache()
    repartition._CHOICES.clear()


def test_the_garbage_collector_is_off_while_systems_replay_and_restored_after(tmp_path: Path, monkeypatch) -> None:
    import gc

    import recycle.traces.experiments as experiments

    config = _config()
    trace = _trace(tmp_path, config)
    states: list[bool] = []
    real = experiments.replay_all
    monkeypatch.setattr(experiments, "replay_all", lambda *a, **k: states.append(gc.isenabled()) or real(*a, **k))
    assert gc.isenabled()
    run_job(config, trace, ("recycle",), setup=JobSetup(period_model="planner"), plan_cache=PlanCache(None))
    assert states == [False] and gc.isenabled()

    def failing(*args, **kwargs):
        raise RuntimeError("replay failed")

    monkeypatch.setattr(experiments, "replay_all", failing)
    with pytest.raises(RuntimeError, match="replay failed"):
        run_job(config, trace, ("recycle",), setup=JobSetup(period_model="planner"), plan_cache=PlanCache(None))
    assert gc.isenabled()
    gc.disable()
    try:  # a caller that turned it off keeps it off
        monkeypatch.setattr(experiments, "replay_all", real)
        run_job(config, trace, ("recycle",), setup=JobSetup(period_model="planner"), plan_cache=PlanCache(None))
        assert not gc.isenabled()
    finally:
        gc.enable()
