"""`recycle plan`: one failure state as text or JSON, a plan store, and clear exit-2 errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recycle.cli import main
from recycle.config import load_config
from recycle.ir.plan import Plan
from recycle.ir.validate import validate_plan
from recycle.planner.store import INDEX_NAME, PlanStore

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "toy.toml")


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", "--config", TOY, *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_the_promised_fields(capsys: pytest.CaptureFixture[str]) -> None:
    d = _json(capsys, "--fail", "1:2")
    for field in ("period", "peak_activations", "fault_free_period", "slowdown", "makespan", "lower_bound", "gap",
                  "solver", "status", "failure_key"):
        assert field in d, field
    assert d["failure_key"] == [0, 0, 1, 0]
    assert d["period"] <= 31  # decoupled + staggered: optimum 30
    assert d["slowdown"] == pytest.approx(d["period"] / d["fault_free_period"])
    assert d["gap"] == pytest.approx((d["period"] - d["lower_bound"]) / d["period"])
    assert d["fault_free_period"] == 30  # the paper's reference: fault-free 1F1B
    assert d["slowdown"] <= 31 / 30
    # The planner's own no-failure plan under the same options (decoupled, staggered, no cap) is faster than 1F1B.
    assert d["planner_fault_free_period"] < 30
    assert d["slowdown_vs_planner_fault_free"] == pytest.approx(d["period"] / d["planner_fault_free_period"])
    assert d["solver"] == "heuristic"


def test_options_reach_the_planner(capsys: pytest.CaptureFixture[str]) -> None:
    d = _json(capsys, "--fail", "1:2", "--no-decouple", "--no-stagger", "--memory-cap", "1f1b")
    assert d["decoupled"] is False and d["staggered"] is False
    assert d["memory_cap"] == [4, 3, 2, 1]
    assert d["period"] <= 42
    assert d["peak_activations_per_stage"] == [4, 3, 2, 1]
    assert d["decoupled_backwards"] == 0
    fault_free = _json(capsys, "--no-decouple", "--no-stagger", "--memory-cap", "1f1b")
    assert fault_free["period"] == d["fault_free_period"] == 30


def test_text_output_and_saved_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    saved = tmp_path / "plan.json"
    assert main(["plan", "--config", TOY, "--fail", "0:1", "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "period" in out and "lower bound" in out and "(0,1) DOWN" in out
    plan = validate_plan(Plan.from_json(saved.read_text()))
    assert plan.failed == frozenset({(0, 1)})


def test_gantt_is_written(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "plan.png"
    d = _json(capsys, "--fail", "1:2", "--gantt", str(png))
    assert png.is_file() and png.stat().st_size > 1000
    assert d["written"]["gantt"] == str(png)


def test_store_is_built_from_the_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "store"
    assert main(["plan", "--config", TOY, "--max-failures", "1", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "[5/5] key=" in captured.err
    assert (out / INDEX_NAME).is_file()
    store = PlanStore.load(out, load_config(TOY))
    assert len(store) == 5


@pytest.mark.parametrize("argv,message", [
    (["--fail", "7:0"], "outside the topology"),
    (["--fail", "0:2", "--fail", "1:2", "--fail", "2:2"], "checkpoint"),
    (["--fail", "1:2", "--memory-cap", "0"], "at least 1"),
    (["--max-failures", "1"], "--out"),
    (["--fail", "1:2", "--max-failures", "1", "--out", "x"], "exclusive"),
])
def test_bad_input_exits_2_with_a_message(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["plan", "--config", TOY, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err


def test_a_lost_stage_is_one_error_line_without_traceback(cli_error) -> None:
    assert "checkpoint" in cli_error(["plan", "--config", TOY, "--fail", "0:2", "--fail", "1:2", "--fail", "2:2"])


def test_json_counts_traffic_and_routing_choice(capsys: pytest.CaptureFixture[str]) -> None:
    traffic_aware = _json(capsys, "--fail", "0:1", "--fail", "1:2")
    assert traffic_aware["moved_microbatches"] == 12 and traffic_aware["moved_healthy"] == 0
    assert traffic_aware["cross_pipeline_messages"] == 12 * 2 * 2  # each orphan crosses in and out, F and B
    assert traffic_aware["cross_node_messages"] is None  # the toy config does not say which workers share a node
    relabelled = _json(capsys, "--fail", "0:1", "--fail", "1:2", "--routing", "canonical")
    assert relabelled["moved_healthy"] > 0


def test_compare_no_skips_the_fault_free_references(capsys: pytest.CaptureFixture[str]) -> None:
    d = _json(capsys, "--fail", "1:2", "--compare", "no")
    assert d["fault_free_period"] is None and d["slowdown"] is None and d["period"] == 30
    assert main(["plan", "--config", TOY, "--fail", "1:2", "--compare", "no"]) == 0
    assert "comparisons skipped" in capsys.readouterr().out


def test_no_search_gives_the_rules_only_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "miss.toml"
    config.write_text("[topology]\nnum_replicas = 4\nnum_stages = 4\n[workload]\nnum_microbatches = 4\n"
                      "[costs]\nforward = 2\nbackward_input = 1\nbackward_weight = 1\n")
    argv = ["plan", "--config", str(config), "--fail", "2:0", "--no-stagger", "--json"]
    assert main(argv) == 0
    searched = json.loads(capsys.readouterr().out)
    assert main([*argv, "--no-search"]) == 0
    rules = json.loads(capsys.readouterr().out)
    assert (searched["period"], rules["period"]) == (24, 25)  # the second miss, with and without search
