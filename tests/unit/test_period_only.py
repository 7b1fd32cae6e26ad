"""Replay planning at less cost (issue 27): period_only ends once the schedules estimated at the lower bound settle the
full planner's period (the first simulates at the bound, or the first two are the ones it would simulate), and a key
planned without and then with the search reuses the rule schedules (the same plan as planned cold)."""

from __future__ import annotations

import itertools
import json

import pytest

import recycle.planner.heuristic as heuristic
from recycle.config import Config, parse_config
from recycle.planner.api import clear_cache, period_plan_for_key, plan_for_key
from recycle.planner.options import PlannerOptions
from test_plan_cache import RAW  # the plan cache tests' 3x3 job: two layers per stage, a slower last stage

pytestmark = pytest.mark.timeout(120)


def _config() -> Config:
    return parse_config(json.loads(json.dumps(RAW)), name="period-only")


def test_period_only_gives_the_full_planners_period_on_every_key() -> None:
    config = _config()
    ended_early = went_on = 0
    for key in itertools.product(range(3), repeat=3):
        for options in (PlannerOptions(), PlannerOptions(search=False), PlannerOptions(staggered=False)):
            clear_cache()
            quick = period_plan_for_key(config, key, options)
            clear_cache()
            full = plan_for_key(config, key, options)
            assert quick.meta.predicted_period == full.meta.predicted_period, (key, options)
            if "period_only" in quick.meta.notes:
                ended_early += 1
                # At the bound, or the two schedules the full planner simulates: then its very plan.
                assert quick.meta.predicted_period == quick.meta.lower_bound or \
                    _without_notes(quick) == _without_notes(full)
            else:
                went_on += 1
                assert quick.to_dict() == full.to_dict()  # not at the bound: the full planner's own plan
    assert ended_early > 0 and went_on > 0  # both paths ran
    clear_cache()


def test_the_search_plan_reuses_the_screens_schedules_and_is_the_cold_plan(monkeypatch) -> None:
    config = _config()
    # A key the first rule leaves above the bound (found by the test above's fallback path).
    key = next(k for k in itertools.product(range(3), repeat=3)
               if _above_bound(config, k))
    clear_cache()
    cold = plan_for_key(config, key, PlannerOptions()).to_dict()
    clear_cache()
    calls = []
    real = heuristic.list_schedule
    monkeypatch.setattr(heuristic, "list_schedule", lambda *a, **k: calls.append(1) or real(*a, **k))
    plan_for_key(config, key, PlannerOptions(search=False))
    screen_calls = len(calls)
    calls.clear()
    warm = plan_for_key(config, key, PlannerOptions()).to_dict()
    assert warm == cold
    assert len(calls) < screen_calls  # the rule schedules were not made again (the search makes its own)
    clear_cache()


def _without_notes(plan) -> dict:
    data = plan.to_dict()
    data["meta"] = {k: v for k, v in data["meta"].items() if k != "notes"}
    return data


def _above_bound(config: Config, key: tuple[int, ...]) -> bool:
    clear_cache()
    plan = plan_for_key(config, key, PlannerOptions(search=False))
    assert plan.meta.predicted_period is not None and plan.meta.lower_bound is not None
    return plan.meta.predicted_period > plan.meta.lower_bound


def test_a_cold_replay_decides_as_the_full_planner_and_the_warm_replay(tmp_path) -> None:
    """The replay's cache plans with period_only (some plans end early, some go on) and shares rule schedules; every
    system's series, samples and goodput, and ReCycle+'s decisions, are those of the path without the cache
    (plan_for_key's plans) and of the warm replay that reads the stored plans back."""
    import recycle.traces.repartition as repartition
    from recycle.traces.experiments import JobSetup, run_job
    from recycle.traces.generate import parse_generate_spec
    from recycle.traces.plan_cache import PlanCache

    raw = json.loads(json.dumps(RAW))
    raw["topology"]["num_replicas"] = 4
    config = parse_config(raw, name="period-only-replay")
    trace = parse_generate_spec("poisson:nodes=12,hours=6,mtbf_h=6,repair_h=1,seed=2")
    systems = ("recycle", "recycle-plus", "fault-scaled")

    def replay(cache):
        clear_cache()
        repartition._CHOICES.clear()
        result = run_job(config, trace, systems, setup=JobSetup(slot_seconds=0.01), plan_cache=cache)
        runs = {name: (run.series, run.useful_samples, run.goodput) for name, run in result.runs.items()}
        return runs, result.extra["recycle_plus_policy"]

    old = replay(None)
    cold = replay(PlanCache(tmp_path / "plans"))
    notes = [json.loads(p.read_text())["value"].get("meta", {}).get("notes", "")
             for p in (tmp_path / "plans").glob("*.json")]
    assert any("period_only" in n for n in notes) and any(n and "period_only" not in n for n in notes)
    warm = replay(PlanCache(tmp_path / "plans"))
    assert cold == old == warm
    clear_cache()
