"""The planner's in-process plan cache is bounded by the workers of the plans it keeps, not only by their count: a
coordinator at 16,384 workers whose failed set grows node by node plans each state beyond its library online
(~30 MB a plan), and 512 of them would not fit in memory."""

from __future__ import annotations

import pytest

import recycle.planner.api as planner_api
from recycle.config import parse_config
from recycle.planner.api import plan_for_key, resolve_options
from recycle.planner.options import PlannerOptions

pytestmark = pytest.mark.timeout(60)


def test_the_plans_kept_hold_at_most_the_cache_s_workers_the_newest_always(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_config({"topology": {"num_replicas": 4, "num_stages": 2}, "workload": {"num_microbatches": 2},
                           "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1}}, name="cache-bound")
    options = resolve_options(config, PlannerOptions())
    monkeypatch.setattr(planner_api, "_CACHE", {})
    monkeypatch.setattr(planner_api, "_CACHE_WORKERS", 20, raising=False)  # two plans of 8 workers
    keys = [(1, 0), (0, 1), (1, 1), (2, 0), (0, 2)]
    plans = [plan_for_key(config, key, options, "heuristic") for key in keys]
    kept = list(planner_api._CACHE.values())
    assert sum(plan.num_workers for plan in kept) <= 20 and len(kept) == 2
    assert kept[-1] is plans[-1]  # the newest stays, and is served from the cache again
    assert plan_for_key(config, keys[-1], options, "heuristic") is plans[-1]
