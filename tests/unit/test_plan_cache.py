"""The replay's plan cache: hits and misses, invalidation by config and code version, corrupt or foreign entries
ignored (never trusted), the same results with and without it, and `recycle simulate`'s stdout kept to the summary."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import recycle.planner.api as planner_api
import recycle.traces.repartition as repartition
from recycle.api import load_trace, simulate_trace
from recycle.config import parse_config
from recycle.planner.options import PlannerOptions
from recycle.planner.partition import PARTITION_SEARCH_WORK, best_partition
from recycle.traces.experiments import JobSetup, run_job
from recycle.traces.plan_cache import PlanCache, code_version

pytestmark = pytest.mark.timeout(120)

LAYERS = [2, 2, 2]
RAW = {
    "time_unit": "slot",
    "topology": {"num_replicas": 3, "num_stages": 3},
    "workload": {"num_microbatches": 3},
    "costs": {"forward": [2.0, 2.0, 2.5], "backward_input": [2.0, 2.0, 2.5], "backward_weight": [2.0, 2.0, 2.0],
              "optimizer": 1.0},
    "memory": {"parameter_bytes": [2_000_000] * 3, "optimizer_state_bytes": [8_000_000] * 3},
    "communication": {"p2p_bandwidth": 1_000_000.0},
    "model": {"layers_per_stage": LAYERS},
}
# Nine workers (D=3 x S=3): single failures, two at once, returns: keys with and without a layer move.
TRACE = ("0,add,n0\n0,add,n1\n0,add,n2\n0,add,n3\n0,add,n4\n0,add,n5\n0,add,n6\n0,add,n7\n0,add,n8\n"
         "600000,remove,n0\n1800000,remove,n4\n3000000,add,n0\n4200000,remove,n8\n5400000,add,n4\n"
         "6600000,add,n8\n7200000,remove,n1\n9000000,add,n1\n")
SYSTEMS = ("recycle", "recycle-plus", "fault-scaled")


def _config(**workload):
    raw = json.loads(json.dumps(RAW))
    raw["workload"].update(workload)
    return parse_config(raw, name="cache-toy")


def _trace(tmp_path: Path, config):
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    return load_trace(config, path)


def _forget_in_process_plans() -> None:
    """Drop the planner's in-process caches so a run can only avoid planning through the disk."""
    planner_api.clear_cache()
    repartition._CHOICES.clear()


def _outcome(result) -> dict:
    """Everything a replay decides: per system its series and samples, ReCycle+'s decisions."""
    runs = {name: (run.series, run.useful_samples, run.processed_samples, run.goodput)
            for name, run in result.runs.items()}
    return {"runs": runs, "plus": result.extra["recycle_plus_policy"], "states": result.extra["recycle_plus_states"]}


@pytest.fixture()
def no_planning(monkeypatch):
    """Make any call into the heuristic planner fail: a warm run must read every plan from the cache."""

    def refuse(*args, **kwargs):
        raise AssertionError("planned although every plan is in the cache")

    def arm() -> None:
        monkeypatch.setattr(planner_api, "schedule_heuristic", refuse)

    return arm


def test_second_run_reads_every_plan_and_every_result_is_identical(tmp_path: Path, no_planning) -> None:
    config = _config()
    trace = _trace(tmp_path, config)
    _forget_in_process_plans()
    old = run_job(config, trace, SYSTEMS, setup=JobSetup(slot_seconds=0.01))  # the path without the cache
    _forget_in_process_plans()
    memo = simulate_trace(config, trace, systems=SYSTEMS, slot_seconds=0.01)  # once per run, nothing on disk
    assert memo.extra["plan_cache"]["folder"] is None and memo.extra["plan_cache"]["hits"] == 0
    _forget_in_process_plans()
    cold = simulate_trace(config, trace, systems=SYSTEMS, slot_seconds=0.01, plan_cache=tmp_path / "c")
    stats = cold.extra["plan_cache"]
    assert stats["hits"] == 0 and stats["misses"] > 0 and stats["written"] == stats["misses"]
    assert stats["rejected"] == 0
    assert any(p["partition"] != p["configured"] for p in cold.extra["partitions"])  # a layer move was weighed
    _forget_in_process_plans()
    no_planning()
    warm = simulate_trace(config, trace, systems=SYSTEMS, slot_seconds=0.01, plan_cache=tmp_path / "c")
    stats = warm.extra["plan_cache"]
    assert stats["misses"] == 0 and stats["hits"] > 0 and stats["rejected"] == 0 and stats["written"] == 0
    assert _outcome(old) == _outcome(memo) == _outcome(cold) == _outcome(warm)
    assert [p for p in warm.extra["partitions"]] == [p for p in cold.extra["partitions"]]


def test_config_change_and_code_change_are_misses(tmp_path: Path) -> None:
    config = _config()
    key = (1, 0, 0)
    first = PlanCache(tmp_path, code="v1")
    period = first.period(config, key)
    assert (first.stats.hits, first.stats.misses, first.stats.written) == (0, 1, 1)
    again = PlanCache(tmp_path, code="v1")
    assert again.period(config, key) == period and (again.stats.hits, again.stats.misses) == (1, 0)
    # Any planning value of the config: another micro-batch count, another cost.
    for changed in (_config(num_microbatches=4), parse_config({**json.loads(json.dumps(RAW)),
                                                               "costs": {**RAW["costs"], "optimizer": 2.0}})):
        other = PlanCache(tmp_path, code="v1")
        other.period(changed, key)
        assert (other.stats.hits, other.stats.misses) == (0, 1)
    # Other options are another question too.
    other = PlanCache(tmp_path, code="v1")
    other.period(config, key, PlannerOptions(staggered=False))
    assert (other.stats.hits, other.stats.misses) == (0, 1)
    # A new code version (another package version or planner source) misses every entry.
    newer = PlanCache(tmp_path, code="v2")
    assert newer.period(config, key) == period and (newer.stats.hits, newer.stats.misses) == (0, 1)


def test_code_version_follows_the_planner_sources(tmp_path: Path) -> None:
    (tmp_path / "planner").mkdir()
    source = tmp_path / "planner" / "heuristic.py"
    source.write_text("RULES = 1\n")
    before = code_version(tmp_path, [source])
    assert code_version(tmp_path, [source]) == before
    source.write_text("RULES = 2\n")
    assert code_version(tmp_path, [source]) != before
    import recycle

    assert code_version().startswith(f"{recycle.__version__}+")


def _entry_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.json"))


def test_corrupt_foreign_or_tampered_entries_are_ignored_and_rebuilt(tmp_path: Path) -> None:
    config = _config()
    seed = PlanCache(tmp_path, code="v1")
    truth = {key: seed.period(config, key) for key in ((1, 0, 0), (0, 1, 0))}
    files = {}
    for path in _entry_files(tmp_path):
        entry = json.loads(path.read_text())
        files[tuple(entry["inputs"]["key"])] = path
    a, b = files[(1, 0, 0)], files[(0, 1, 0)]
    original_a = a.read_bytes()

    def reread(key) -> PlanCache:
        cache = PlanCache(tmp_path, code="v1")
        assert cache.period(config, key) == truth[key]  # always the planner's answer
        return cache

    cases = {
        "not JSON": b"\x80\x04\x95 a pickle is never loaded",
        "truncated": original_a[: len(original_a) // 2],
        "NaN": original_a.replace(b'"value":{', b'"value":NaN,"x":{', 1),
        "foreign": b.read_bytes(),  # another key's entry under this name
    }
    for what, data in cases.items():
        a.write_bytes(data)
        cache = reread((1, 0, 0))
        assert (cache.stats.rejected, cache.stats.misses, cache.stats.written) == (1, 1, 1), what
        assert a.read_bytes() == original_a, what  # rebuilt: the planner's plan again
    # Inputs right, plan wrong: a micro-batch dropped from a worker's list fails validate_plan.
    entry = json.loads(original_a)
    rank = next(r for r, line in enumerate(entry["value"]["actions"]) if line)
    entry["value"]["actions"][rank] = " ".join(entry["value"]["actions"][rank].split()[1:])
    a.write_text(json.dumps(entry))
    cache = reread((1, 0, 0))
    assert cache.stats.rejected == 1 and "invalid" in cache.stats.reasons[0]
    # Inputs right, plan for another failure set (a valid plan of key (0, 1, 0)): rejected.
    other = json.loads(b.read_text())
    entry = json.loads(original_a)
    entry["value"] = other["value"]
    a.write_text(json.dumps(entry))
    cache = reread((1, 0, 0))
    assert cache.stats.rejected == 1
    # A lying predicted period is not read: the period is re-simulated from the plan.
    entry = json.loads(original_a)
    entry["value"]["meta"]["predicted_period"] = 0.001
    a.write_text(json.dumps(entry))
    cache = reread((1, 0, 0))
    assert (cache.stats.hits, cache.stats.rejected) == (1, 0)
    # A link planted in place of an entry is not followed.
    a.unlink()
    os.symlink(b, a)
    cache = reread((1, 0, 0))
    assert cache.stats.rejected == 1 and not a.is_symlink() and a.read_bytes() == original_a


def test_a_tampered_partition_choice_is_rejected(tmp_path: Path) -> None:
    config = _config()
    trace = _trace(tmp_path, config)
    _forget_in_process_plans()
    first = simulate_trace(config, trace, systems=("recycle-plus",), slot_seconds=0.01, plan_cache=tmp_path / "c")
    choices = [p for p in _entry_files(tmp_path / "c") if json.loads(p.read_text())["inputs"]["kind"] ==
               "partition-choice"]
    moved = [p for p in choices if (v := json.loads(p.read_text())["value"])["partition"] != v["configured"]]
    assert moved
    entry = json.loads(moved[0].read_text())
    entry["value"]["partition"] = [1, 1, 4] if entry["value"]["partition"] != [1, 1, 4] else [4, 1, 1]
    moved[0].write_text(json.dumps(entry))
    _forget_in_process_plans()
    second = simulate_trace(config, trace, systems=("recycle-plus",), slot_seconds=0.01, plan_cache=tmp_path / "c")
    assert second.extra["plan_cache"]["rejected"] == 1
    assert _outcome(second) == _outcome(first)  # the choice was made again, not taken from the entry


def test_partition_search_is_bounded_by_work_not_time() -> None:
    config = _config()
    full = best_partition(config, (1, 0, 0), polish=1, max_evaluations=8)
    assert full.complete and PARTITION_SEARCH_WORK >= 100_000
    starved = best_partition(config, (1, 0, 0), polish=1, max_evaluations=8, work=3)
    assert not starved.complete and sum(starved.partition) == sum(LAYERS)
    assert best_partition(config, (1, 0, 0), polish=1, max_evaluations=8, work=3) == starved  # deterministic


def test_rate_bounds_never_undercut_the_rate(tmp_path: Path) -> None:
    config = _config()
    trace = _trace(tmp_path, config)
    cache = PlanCache(tmp_path / "c")
    from recycle.traces.experiments import _partition_model
    from recycle.traces.throughput import ThroughputModel, make_period_fn
    from recycle.planner.bounds import period_lower_bound

    period_fn, label = make_period_fn(config, cache=cache)
    model = ThroughputModel(config, period_fn, 0.01, label,
                            period_bound=lambda key: period_lower_bound(config, key) * (1 - 1e-9))
    partitions, why = _partition_model(config, model, PlannerOptions(), label, cache)
    assert not why and partitions is not None and trace.events
    for key in ((1, 0, 0), (0, 1, 1), (0, 0, 2), (1, 1, 1)):
        assert model.rate_bound(key) >= model.throughput_for_key(key)
        assert partitions.rate_bound(key) >= partitions.rate(key, partitions.choice(key)) * (1 - 1e-12)
        assert partitions.rate_bound(key, (1, 2, 3)) >= partitions.rate(key, (1, 2, 3)) * (1 - 1e-12)
    # Next run: the choices are in the cache; the bound reads them without entering them in this run's choices.
    again = PlanCache(tmp_path / "c")
    period_fn, label = make_period_fn(config, cache=again)
    model = ThroughputModel(config, period_fn, 0.01, label,
                            period_bound=lambda key: period_lower_bound(config, key) * (1 - 1e-9))
    warm, _ = _partition_model(config, model, PlannerOptions(), label, again)
    assert warm is not None
    bounds = {key: warm.rate_bound(key) for key in ((1, 0, 0), (0, 1, 1), (0, 0, 2), (1, 1, 1))}
    assert warm.choices() == {} and again.stats.misses == 0 and again.stats.hits > 0
    for key, bound in bounds.items():
        assert bound >= partitions.rate(key, partitions.choice(key)) * (1 - 1e-12)


def write_job(tmp_path: Path) -> tuple[Path, Path]:
    """RAW as a TOML config file and TRACE as a CSV file in `tmp_path`, for the CLI."""
    config = tmp_path / "job.toml"
    lines = ['name = "cache-toy"', 'time_unit = "slot"']
    for section, values in RAW.items():
        if isinstance(values, dict):
            lines.append(f"[{section}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    config.write_text("\n".join(lines) + "\n")
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    return config, trace


def test_simulate_cli_stdout_is_the_summary_and_the_cache_is_reported(tmp_path: Path, capsys) -> None:
    from recycle.cli import main

    config, trace = write_job(tmp_path)
    argv = ["simulate", "--config", str(config), "--trace", str(trace), "--out", str(tmp_path / "o"),
            "--slot-seconds", "0.01", "--plan-cache", str(tmp_path / "cache")]
    _forget_in_process_plans()
    assert main(argv) == 0
    first = capsys.readouterr()
    assert main(argv) == 0
    second = capsys.readouterr()
    assert first.out == second.out
    out = first.out.splitlines()
    systems = ("recycle ", "recycle-plus ", "fault-free ", "fault-scaled ", "checkpoint-restart ", "oobleck ",
               "bamboo ", "torchft-like ")
    assert [line.split()[0] for line in out[:8]] == [s.strip() for s in systems]
    assert all(line.startswith(("best ReCycle line", "ReCycle+ made")) for line in out[8:]) and len(out) <= 10
    assert "plan cache" not in first.out and "repartition" not in first.out
    assert f"plan cache {tmp_path / 'cache'}: 0 read" in first.err
    assert f"plan cache {tmp_path / 'cache'}: " in second.err and " 0 planned, 0 rejected" in second.err
    report = (tmp_path / "o" / "report.md").read_text()
    assert f"- plan cache `{tmp_path / 'cache'}`:" in report and "0 planned" in report
    assert main([*argv[:-2], "--no-plan-cache"]) == 0
    assert capsys.readouterr().out == first.out


def test_a_plan_cache_that_is_not_a_folder_is_one_error_line(tmp_path: Path, cli_error) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    line = cli_error(["simulate", "--config", str(Path(__file__).resolve().parents[2] / "configs" / "toy.toml"),
                      "--generate", "poisson:nodes=12,hours=2,mtbf_h=2,repair_h=0.5,seed=1", "--out",
                      str(tmp_path / "o"), "--plan-cache", str(blocker)])
    assert f"--plan-cache {blocker}" in line and "--no-plan-cache" in line


def test_reshapes_ruled_out_by_the_bound_leave_every_decision_unchanged() -> None:
    from recycle.traces.generate import parse_generate_spec

    raw = json.loads(json.dumps(RAW))
    raw["topology"]["num_replicas"] = 4
    config = parse_config(raw, name="cache-toy-d4")
    trace = parse_generate_spec("poisson:nodes=12,hours=12,mtbf_h=6,repair_h=1,seed=2")
    _forget_in_process_plans()
    old = run_job(config, trace, SYSTEMS, setup=JobSetup(slot_seconds=0.01))
    _forget_in_process_plans()
    new = simulate_trace(config, trace, systems=SYSTEMS, slot_seconds=0.01)
    assert _outcome(new) == _outcome(old)
    # Fewer layer searches: a weighed reshape whose bound could not pay was never searched.
    assert len(new.extra["partitions"]) < len(old.extra["partitions"])
    assert {tuple(p["key"]) for p in new.extra["partitions"]} < {tuple(p["key"]) for p in old.extra["partitions"]}


def test_a_cache_that_cannot_be_written_costs_the_next_run_not_this_one(tmp_path: Path, monkeypatch) -> None:
    import recycle.traces.plan_cache as plan_cache
    from recycle.errors import OutputError

    def full(*args, **kwargs):
        raise OutputError("disk full")

    monkeypatch.setattr(plan_cache, "atomic_write_text", full)
    lines: list[str] = []
    cache = PlanCache(tmp_path, code="v1", progress=lines.append, progress_every=1)
    assert cache.period(_config(), (1, 0, 0)) > 0 and cache.period(_config(), (0, 1, 0)) > 0
    assert cache.stats.written == 0 and cache.stats.reasons == ["not written: disk full"]
    assert lines == ["planning: 1 plan(s) and partition choice(s) made, 0 read from the cache",
                     "planning: 2 plan(s) and partition choice(s) made, 0 read from the cache"]
