"""The job simulator's ReCycle+ with micro-batches split into pieces (run_job / simulate_trace split_microbatches,
`recycle simulate --split-microbatches`): its rates are the split plans' periods, ReCycle's line is unchanged, and
the plan cache keys on the option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recycle.api import load_trace, simulate_trace
from recycle.config import parse_config
from recycle.planner.api import plan_for_key
from recycle.planner.options import PlannerOptions
from recycle.traces.experiments import JobSetup, run_job
from recycle.traces.plan_cache import PlanCache

pytestmark = pytest.mark.timeout(180)

SPLIT = PlannerOptions(split_microbatches=True)
# D=3 x S=3, M=3 micro-batches of 2 samples: 18 samples an iteration; slots of 1 s.
RAW = {
    "time_unit": "slot",
    "topology": {"num_replicas": 3, "num_stages": 3},
    "workload": {"num_microbatches": 3, "microbatch_size": 2},
    "costs": {"forward": [2.0, 2.0, 2.5], "backward_input": [2.0, 2.0, 2.5], "backward_weight": [2.0, 2.0, 2.0],
              "optimizer": 1.0},
    "memory": {"parameter_bytes": [2_000_000] * 3, "optimizer_state_bytes": [8_000_000] * 3},
    "communication": {"p2p_bandwidth": 1_000_000.0},
    "model": {"layers_per_stage": [2, 2, 2]},
}
# Nine workers; n4 (replica 1, stage 1) is out from 10 to 60 minutes: one failure state, key (0, 1, 0).
TRACE = "".join(f"0,add,n{i}\n" for i in range(9)) + "600000,remove,n4\n3600000,add,n4\n"


def _config():
    return parse_config(json.loads(json.dumps(RAW)), name="split-toy")


def _replay(tmp_path: Path, split: bool, cache: PlanCache | None = None):
    config = _config()
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    return run_job(config, load_trace(config, path), systems=("recycle", "recycle-plus"),
                   setup=JobSetup(reference="planner"), plan_cache=cache or PlanCache(None),
                   split_microbatches=split)


def _state(result, key):
    return next(s for s in result.extra["recycle_plus_states"] if tuple(s["key"]) == key)


def test_recycle_plus_runs_the_split_plans_period_and_recycle_keeps_whole_microbatches(tmp_path: Path) -> None:
    key = (0, 1, 0)
    config = _config()
    whole, split = plan_for_key(config, key), plan_for_key(config, key, SPLIT)
    # By hand: stage 1's two survivors share 9 micro-batches of 2 samples, 5 + 4 whole; split, 9 samples each.
    carried = {p: 0 for p in split.live_replicas(1)}
    for mb, replica in enumerate(split.host[1]):
        carried[replica] += split.pieces[mb].samples
    assert sorted(carried.values()) == [9, 9]
    assert split.meta.predicted_period < whole.meta.predicted_period
    plain, cut = _replay(tmp_path, False), _replay(tmp_path, True)
    assert not plain.extra["split_microbatches"] and cut.extra["split_microbatches"]
    # ReCycle+ split stays on the configured layers in that state (moving them is not faster than the split plan)
    # and runs 18 samples per split period of 1 s slots.
    state = _state(cut, key)
    assert tuple(state["partition"]) == (2, 2, 2)
    assert state["rate"] == pytest.approx(18 / split.meta.predicted_period, rel=1e-12)
    # Without the option, ReCycle+'s rate in that state is at most that of a whole plan's on some layout: lower here.
    assert _state(plain, key)["rate"] < state["rate"]
    assert cut.runs["recycle-plus"].goodput > plain.runs["recycle-plus"].goodput
    # ReCycle's line is the paper's: whole micro-batches, identical with and without the option.
    assert cut.runs["recycle"].series == plain.runs["recycle"].series
    assert cut.runs["recycle"].goodput == plain.runs["recycle"].goodput
    assert "split" in cut.runs["recycle-plus"].label and "split" not in cut.runs["recycle"].label


def test_the_plan_cache_keys_on_the_option_and_keeps_split_plans(tmp_path: Path) -> None:
    config, key = _config(), (0, 1, 0)
    first = PlanCache(tmp_path / "c", code="v1")
    whole, split = first.period(config, key), first.period(config, key, SPLIT)
    assert split < whole and (first.stats.misses, first.stats.written) == (2, 2)
    entries = {bool(e["inputs"]["options"].get("split_microbatches")): (path, e)
               for path in (tmp_path / "c").glob("*.json") for e in [json.loads(path.read_text())]}
    assert set(entries) == {False, True}
    # Entries made without the option keep their inputs (no new field: their names are unchanged).
    assert "split_microbatches" not in entries[False][1]["inputs"]["options"]
    assert entries[True][1]["value"]["pieces"]  # the split plan itself is kept, and re-simulated when read
    again = PlanCache(tmp_path / "c", code="v1")
    assert (again.period(config, key), again.period(config, key, SPLIT)) == (whole, split)
    assert (again.stats.hits, again.stats.misses, again.stats.rejected) == (2, 0, 0)
    # A split plan never answers the question without the option, even under that question's inputs.
    path, entry = entries[False]
    path.write_text(json.dumps({"inputs": entry["inputs"], "value": entries[True][1]["value"]}))
    tampered = PlanCache(tmp_path / "c", code="v1")
    assert tampered.period(config, key) == whole
    assert tampered.stats.rejected == 1 and "other options" in tampered.stats.reasons[0]


def test_a_replay_with_the_option_reads_its_own_entries_back(tmp_path: Path) -> None:
    cold = _replay(tmp_path, True, PlanCache(tmp_path / "c", code="v1"))
    warm = _replay(tmp_path, True, PlanCache(tmp_path / "c", code="v1"))
    stats = warm.extra["plan_cache"]
    assert stats["misses"] == 0 and stats["hits"] > 0 and stats["rejected"] == 0
    assert warm.runs["recycle-plus"].series == cold.runs["recycle-plus"].series


def test_simulate_cli_takes_split_microbatches(tmp_path: Path, capsys) -> None:
    from recycle.cli import main

    config = tmp_path / "job.toml"
    config.write_text(_toml(RAW))
    (tmp_path / "trace.csv").write_text(TRACE)
    args = ["simulate", "--config", str(config), "--trace", str(tmp_path / "trace.csv"), "--reference", "planner",
            "--systems", "recycle", "recycle-plus", "--no-plan-cache", "--json"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main([*args, "--out", str(tmp_path / "split"), "--split-microbatches"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert _goodput(split, "recycle-plus") > _goodput(whole, "recycle-plus")
    assert _goodput(split, "recycle") == _goodput(whole, "recycle")


def _goodput(summary: dict, name: str) -> float:
    return float(summary[name]["goodput"])


def _toml(raw: dict) -> str:
    lines = []
    for table, values in raw.items():
        if not isinstance(values, dict):
            lines.insert(0, f"{table} = {json.dumps(values)}")
            continue
        lines.append(f"[{table}]")
        lines += [f"{name} = {json.dumps(value)}" for name, value in values.items()]
    return "\n".join(lines) + "\n"


def test_split_microbatches_with_the_closed_form_estimate_is_one_error_line(tmp_path: Path, cli_error) -> None:
    config = tmp_path / "job.toml"
    config.write_text(_toml(RAW))
    (tmp_path / "trace.csv").write_text(TRACE)
    line = cli_error(["simulate", "--config", str(config), "--trace", str(tmp_path / "trace.csv"), "--out",
                      str(tmp_path / "o"), "--period-model", "estimate", "--split-microbatches", "--no-plan-cache"])
    assert "--split-microbatches needs the planner's periods, but the period source is 'closed-form estimate'" in line
    assert "use --period-model planner" in line
