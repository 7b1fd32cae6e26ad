"""Quick partition screens (issue 27 item 4): PlannerOptions.rules list-schedules only the first rules,
best_partition screens with them while polishing in full, the plan cache keeps them apart from full plans, and a
replay's ReCycle+ uses them unless asked for exact screens (`--exact-screens`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import recycle.planner.heuristic as heuristic
from recycle.config import parse_config
from recycle.errors import ConfigError
from recycle.planner.api import clear_cache, plan_for_key
from recycle.planner.heuristic import VARIANTS
from recycle.planner.options import PlannerOptions
from recycle.planner.partition import best_partition, partition_period
from recycle.traces.experiments import JobSetup, run_job
from recycle.traces.plan_cache import PlanCache, _options_dict
from recycle.traces.repartition import QUICK_SCREEN_RULES, PartitionModel
from test_plan_cache import RAW, SYSTEMS, _trace

pytestmark = pytest.mark.timeout(120)


def _config(replicas: int = 3):
    raw = json.loads(json.dumps(RAW))
    raw["topology"]["num_replicas"] = replicas
    return parse_config(raw, name="quick-screens")


@pytest.mark.parametrize("rules", [0, -1, 1.5, True])
def test_rules_must_be_a_whole_number_of_at_least_one(rules) -> None:
    with pytest.raises(ConfigError, match=r"PlannerOptions.rules .* must be a whole number >= 1"):
        PlannerOptions(rules=rules)


def test_rules_limit_the_list_schedules_to_the_first_rules(monkeypatch) -> None:
    config = _config()
    tried: list[str] = []
    real = heuristic.list_schedule

    def recording(*args, **kwargs):
        tried.append(args[-1].name)
        return real(*args, **kwargs)

    monkeypatch.setattr(heuristic, "list_schedule", recording)
    for rules in (1, 3):
        for key in ((1, 0, 0), (0, 1, 2), (2, 1, 0)):
            clear_cache()
            tried.clear()
            plan = plan_for_key(config, key, PlannerOptions(search=False, rules=rules))
            assert tried and set(tried) <= {v.name for v in VARIANTS[:rules]}, (rules, key, set(tried))
            assert plan.meta.predicted_period is not None
    clear_cache()
    tried.clear()
    plan_for_key(config, (1, 0, 0), PlannerOptions(search=False))
    assert len(set(tried)) > 3  # without `rules` every rule, the random restarts and the waiting rules too
    clear_cache()


def test_quick_screens_polish_in_full_and_report_the_full_periods() -> None:
    # Screens with the first rule only (their periods may be higher than every rule's), but the configured layout
    # and the partition polished are planned with the options as given: the choice's periods are the full
    # planner's, the same as the exact search reports for the configured layout.
    config = _config()
    options = PlannerOptions()
    for key in ((1, 0, 0), (0, 0, 2), (1, 1, 0), (0, 2, 1)):
        clear_cache()
        exact = best_partition(config, key, options, max_evaluations=8, polish=1)
        quick = best_partition(config, key, options, max_evaluations=8, polish=1, screen_rules=1)
        assert quick.configured_period == exact.configured_period
        assert quick.period == partition_period(config, key, quick.partition, options)
        assert quick.period <= quick.configured_period
        assert quick.changed == (quick.period < quick.configured_period)
    clear_cache()


def test_the_plan_cache_keeps_quick_screens_apart(tmp_path: Path) -> None:
    config = _config()
    assert "rules" not in _options_dict(PlannerOptions())  # entries made without it keep their names
    assert _options_dict(PlannerOptions(rules=2))["rules"] == 2
    cache = PlanCache(tmp_path / "plans")
    full = cache.period(config, (1, 0, 0), PlannerOptions(search=False))
    quick = cache.period(config, (1, 0, 0), PlannerOptions(search=False, rules=1))
    assert cache.stats.misses == 2 and cache.stats.written == 2
    again = PlanCache(tmp_path / "plans")
    assert again.period(config, (1, 0, 0), PlannerOptions(search=False, rules=1)) == quick
    assert again.period(config, (1, 0, 0), PlannerOptions(search=False)) == full
    assert again.stats.hits == 2 and again.stats.misses == 0


def test_partition_choices_name_their_screens() -> None:
    from recycle.traces.throughput import ThroughputModel

    config = _config()
    throughput = ThroughputModel(config, lambda key: 10.0, 1.0)
    assert "screen_rules" not in PartitionModel(throughput)._search()
    assert PartitionModel(throughput, screen_rules=1)._search()["screen_rules"] == 1


def test_a_replay_screens_quickly_unless_asked_for_exact_screens(tmp_path: Path, monkeypatch) -> None:
    config = _config()
    trace = _trace(tmp_path, config)
    screened: dict[bool, list[int | None]] = {}
    real = best_partition

    for exact in (False, True):
        seen: list[int | None] = []

        def recording(*args, **kwargs):
            seen.append(kwargs.get("screen_rules"))
            return real(*args, **kwargs)

        monkeypatch.setattr("recycle.traces.repartition.best_partition", recording)
        clear_cache()
        result = run_job(config, trace, SYSTEMS, setup=JobSetup(period_model="planner"),
                         plan_cache=PlanCache(tmp_path / f"plans-{exact}"), exact_screens=exact)
        assert result.runs["recycle-plus"].goodput > 0
        screened[exact] = seen
    assert screened[False] and set(screened[False]) == {QUICK_SCREEN_RULES}
    assert screened[True] and set(screened[True]) == {None}
    clear_cache()


def test_simulate_cli_exact_screens_flag_reaches_the_replay(tmp_path: Path, monkeypatch) -> None:
    import recycle.traces.experiments as experiments
    from recycle.cli import main
    from test_plan_cache import write_job

    config, trace = write_job(tmp_path)
    asked: list[bool] = []
    real = experiments.run_job
    monkeypatch.setattr(experiments, "run_job", lambda *a, **k: asked.append(k["exact_screens"]) or real(*a, **k))
    argv = ["simulate", "--config", str(config), "--trace", str(trace), "--slot-seconds", "0.01", "--systems",
            "recycle", "recycle-plus", "--no-plan-cache"]
    assert main([*argv, "--out", str(tmp_path / "quick")]) == 0
    assert main([*argv, "--out", str(tmp_path / "exact"), "--exact-screens"]) == 0
    assert asked == [False, True]
