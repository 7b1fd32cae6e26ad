"""Plans that do not settle to a one-iteration period: found, priced by whole cycles and explained (issue 26)."""

from __future__ import annotations

import pytest

from recycle.config import Config, parse_config
from recycle.planner.api import clear_cache, make_plan, plan_for_failed
from recycle.planner.options import PlannerOptions
from recycle.planner.settling import settling
from recycle.sim.convergence import MAX_ITERATIONS
from recycle.sim.simulator import simulate

# Seed 0 case 183 of `bench_planner_quality.py --draw distinct --planner make_plan`: not nested, decoupled,
# staggered. The traffic-aware plan's iteration times alternate 63, 60 for ever; an average of its last 15 gaps reads
# 61.4, the plan's throughput is one iteration per 61.5 (what the simulator reports).
UNSETTLED = dict(D=5, S=4, M=8, forward=3, backward_input=1, backward_weight=2, optimizer=0)
UNSETTLED_FAILED = frozenset({(1, 0), (4, 2), (4, 3)})


def _config(D: int, S: int, M: int, forward: int, backward_input: int, backward_weight: int,
            optimizer: int) -> Config:
    return parse_config({"topology": {"num_replicas": D, "num_stages": S}, "workload": {"num_microbatches": M},
                         "costs": {"forward": forward, "backward_input": backward_input,
                                   "backward_weight": backward_weight, "optimizer": optimizer}}, name="settling")


@pytest.mark.timeout(120)
def test_a_plan_that_alternates_is_priced_by_whole_cycles_and_says_why() -> None:
    config = _config(**UNSETTLED)
    clear_cache()
    plan = plan_for_failed(config, UNSETTLED_FAILED, PlannerOptions())
    result = simulate(plan, config)
    assert result.num_iterations == MAX_ITERATIONS  # never three equal gaps in a row
    gaps = [b - a for a, b in zip(result.iteration_starts, result.iteration_starts[1:])]
    assert gaps[-4:] == [gaps[-2], gaps[-1]] * 2 and gaps[-1] != gaps[-2]
    found = settling(result)
    # The simulator itself reports the mean over the whole cycle (it used to read 61.4, an odd number of gaps).
    assert found.cycle == 2 and found.period == result.period == (gaps[-1] + gaps[-2]) / 2
    half = len(result.iteration_starts) // 2
    last_half = (result.iteration_starts[-1] - result.iteration_starts[half]) / (len(gaps) - half)
    assert last_half < result.period
    assert plan.meta.predicted_period == found.period
    assert "2-iteration cycle" in plan.meta.notes and f"{found.period:g}" in plan.meta.notes
    # make_plan compares the routings by that mean: the canonical plan here settles and is faster.
    chosen = make_plan(config, sorted(UNSETTLED_FAILED))
    assert settling(simulate(chosen, config)).cycle == 1
    assert f"traffic-aware plan's {found.period:g}" in chosen.meta.routing_fallback
    clear_cache()


@pytest.mark.timeout(120)
def test_settled_plans_keep_the_simulators_period() -> None:
    config = _config(**UNSETTLED)
    clear_cache()
    for options in (PlannerOptions(), PlannerOptions(staggered=False)):
        plan = make_plan(config, [(1, 0)], options)
        result = simulate(plan, config)
        assert settling(result).cycle == 1
        assert plan.meta.predicted_period == result.period
        assert "cycle" not in plan.meta.notes
    clear_cache()


def test_settled_period_is_the_mean_over_whole_cycles() -> None:
    """The shared rule (simulator, level timer, settling): converged -> last gap; a cycle -> its mean, whatever the
    parity of the number of gaps; no cycle -> the last half's mean."""
    from recycle.sim.convergence import repeat, settled_period

    def starts_of(gaps: list[float]) -> list[float]:
        starts = [0.0]
        for g in gaps:
            starts.append(starts[-1] + g)
        return starts

    alternating = starts_of([70.0] + [63.0, 60.0] * 15)  # 31 gaps, 32 starts: the simulator's MAX_ITERATIONS
    assert repeat(alternating) == (2, (63.0, 60.0))
    assert settled_period(alternating) == 61.5
    three = starts_of([50.0, 40.0] + [10.0, 20.0, 30.0] * 6)
    assert repeat(three)[0] == 3 and settled_period(three) == 20.0
    assert settled_period(starts_of([9.0, 5.0, 5.0, 5.0])) == 5.0
    drifting = starts_of([float(i) for i in range(1, 32)])
    assert repeat(drifting) == (0, ())
    assert settled_period(drifting) == (drifting[-1] - drifting[16]) / 15
