"""Cold replays plan less (issue 27 item 4), the same decisions: a plan that ended while its rules were ranked serves
the key with and without the search, and ReCycle+ does not plan the layout it leaves for a key whose move pays
against that layout's rate bound (nor, in a reshape, where the chosen layout's rate is above that bound), and
period_plan_for_key does not simulate again the plan the heuristic simulated."""

from __future__ import annotations

import itertools
import json

import pytest

import recycle.planner.api as planner_api
import recycle.traces.repartition as repartition
from recycle.config import Config, parse_config
from recycle.planner.api import clear_cache, period_plan_for_key
from recycle.planner.heuristic import RANKING_ENDED
from recycle.planner.options import PlannerOptions
from test_plan_cache import RAW  # the plan cache tests' 3x3 job: two layers per stage, a slower last stage

pytestmark = pytest.mark.timeout(120)


def _config(replicas: int = 3) -> Config:
    raw = json.loads(json.dumps(RAW))
    raw["topology"]["num_replicas"] = replicas
    return parse_config(raw, name="fewer-plans")


def test_a_plan_that_ended_while_ranking_serves_both_search_settings(monkeypatch) -> None:
    config = _config()
    shared = fresh = 0
    for key in itertools.product(range(3), repeat=3):
        for search in (True, False):
            clear_cache()
            first = period_plan_for_key(config, key, PlannerOptions(search=search))
            calls = []
            real = planner_api.schedule_heuristic
            monkeypatch.setattr(planner_api, "schedule_heuristic", lambda *a, **k: calls.append(1) or real(*a, **k))
            second = period_plan_for_key(config, key, PlannerOptions(search=not search))
            monkeypatch.setattr(planner_api, "schedule_heuristic", real)
            clear_cache()
            cold = period_plan_for_key(config, key, PlannerOptions(search=not search))
            assert second.to_dict() == cold.to_dict(), (key, search)  # byte for byte the plan made cold
            if RANKING_ENDED in first.meta.notes:
                assert second is first and not calls
                shared += 1
            else:
                assert calls  # planned again: the search may change it
                fresh += 1
    assert shared and fresh  # both paths ran
    clear_cache()


def _replay(config, trace, eager: bool, tmp_path, monkeypatch):
    """One cold replay with a fresh plan cache; eager: the current layout's rate planned wherever it was before."""
    from recycle.traces.experiments import JobSetup, run_job
    from recycle.traces.plan_cache import PlanCache

    if eager:
        monkeypatch.setattr(repartition._CurrentPartition, "_unplanned", lambda self, key: False)
    else:
        monkeypatch.undo()
    clear_cache()
    repartition._CHOICES.clear()
    cache = PlanCache(tmp_path / ("eager" if eager else "lazy"))
    result = run_job(config, trace, ("recycle", "recycle-plus", "fault-scaled"),
                     setup=JobSetup(slot_seconds=0.01), plan_cache=cache)
    runs = {name: (run.series, run.useful_samples, run.goodput) for name, run in result.runs.items()}
    decisions = [(e["time_s"], e["policy"], e["detail"].split(", rate")[0])
                 for e in result.extra["recycle_plus_policy"]]
    return runs, decisions, result.extra["recycle_plus_states"], cache.stats.misses, result.extra


@pytest.mark.parametrize("replicas,spec", [(6, "poisson:nodes=12,hours=24,mtbf_h=4,repair_h=1,seed=4"),
                                           (6, "poisson:nodes=16,hours=24,mtbf_h=6,repair_h=2,seed=1"),
                                           (4, "poisson:nodes=12,hours=24,mtbf_h=4,repair_h=1,seed=4")])
def test_recycle_plus_plans_fewer_layouts_and_decides_the_same(replicas, spec, tmp_path, monkeypatch) -> None:
    from recycle.traces.generate import parse_generate_spec

    config = _config(replicas)
    trace = parse_generate_spec(spec)
    eager = _replay(config, trace, True, tmp_path, monkeypatch)
    lazy = _replay(config, trace, False, tmp_path, monkeypatch)
    assert lazy[:3] == eager[:3]  # every system's series, samples and goodput; ReCycle+'s decisions and states
    assert lazy[3] < eager[3], (lazy[3], eager[3])  # fewer plans made
    clear_cache()


def test_the_returned_plan_is_not_simulated_again_and_is_the_same(monkeypatch) -> None:
    import recycle.sim.simulator as simulator

    config = _config()
    runs = {"reused": 0, "again": 0}
    real = simulator.simulate

    def plans(reuse: bool) -> list[dict]:
        counted = "reused" if reuse else "again"

        def spy(*args, **kwargs):
            runs[counted] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(planner_api, "simulate", spy)
        monkeypatch.setattr("recycle.planner.heuristic.simulate", spy)
        if not reuse:
            monkeypatch.setattr(planner_api, "simulated_timing", lambda plan: None)
        made = []
        for key in itertools.product(range(3), repeat=3):
            for options in (PlannerOptions(), PlannerOptions(search=False), PlannerOptions(staggered=False)):
                clear_cache()
                made.append(period_plan_for_key(config, key, options).to_dict())
        monkeypatch.undo()
        return made

    assert plans(True) == plans(False)  # byte for byte: period, makespan and notes as simulated again
    assert runs["reused"] < runs["again"]
    clear_cache()
