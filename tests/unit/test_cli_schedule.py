"""`recycle schedule` and `recycle demo` through the CLI entry point: JSON, table, files, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recycle.cli import main
from recycle.commands.demo import toy_config
from recycle.config import load_config
from recycle.ir import read_csv
from recycle.schedules.fault_free import build_schedule

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "toy.toml")


def _json(capsys, *args: str) -> dict:
    assert main(["schedule", "--config", TOY, "--json", *args]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object on one line
    return json.loads(out)


def test_json_has_the_documented_fields(capsys) -> None:
    d = _json(capsys, "--schedule", "1f1b")
    assert d["schedule"] == "1f1b" and d["optimizer"] == "coupled"
    assert (d["makespan"], d["period"], d["bubble_fraction"]) == (27.0, 30.0, pytest.approx(0.3))
    assert d["peak_activations"] == [4, 3, 2, 1] * 3
    assert d["num_workers"] == 12 and d["num_iterations"] == 4
    assert (d["num_replicas"], d["num_stages"], d["num_microbatches"], d["time_unit"]) == (3, 4, 6, "slot")
    staggered = _json(capsys, "--schedule", "zb-h1", "--staggered", "--iterations", "2")
    assert staggered["optimizer"] == "staggered" and staggered["schedule"] == "zb-h1"
    assert (staggered["makespan"], staggered["period"]) == (21.0, 24.0)


def test_table_and_grid(capsys) -> None:
    assert main(["schedule", "--config", TOY, "--schedule", "1f1b-decoupled"]) == 0
    out = capsys.readouterr().out
    assert "schedule          1f1b-decoupled (coupled optimizer)" in out
    assert "makespan          24 (first iteration 24)" in out
    assert "peak activations  4/3/2/1" in out
    assert "timeline of iteration 0: t = 0 .. 27" in out
    assert "(0,3) .   .   .   F0  B0  W0  F1" in out


def test_files_are_written(tmp_path, capsys) -> None:
    gantt, trace, csv = tmp_path / "g.png", tmp_path / "t.json", tmp_path / "p.csv"
    d = _json(capsys, "--schedule", "zb-h1", "--gantt", str(gantt), "--trace", str(trace), "--csv", str(csv),
              "--iterations", "3")
    assert d["written"] == {"csv": str(csv), "gantt": str(gantt), "trace": str(trace)}
    assert gantt.read_bytes()[:4] == b"\x89PNG"
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 3 * 12 * 19  # 3 iterations x 12 workers x (6 F + 6 B + 6 W + OPT)
    plan = read_csv(csv)
    expected = build_schedule(load_config(TOY), "zb-h1")
    assert plan.actions == expected.actions and plan.host == expected.host
    assert plan.meta.predicted_period == d["period"] and plan.meta.schedule == "zb-h1"


def test_bad_arguments_exit_2(tmp_path, capsys) -> None:
    assert main(["schedule", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["schedule", "--config", TOY, "--iterations", "0"]) == 2
    assert "--iterations = 0 must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["schedule", "--config", TOY, "--schedule", "zb-h9"])
    assert info.value.code == 2


def test_console_script_runs_without_traceback_on_errors(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[topology]\nnum_replicas = 2\nnum_stages = 2\n[workload]\nnum_microbatches = -1\n"
                   "[costs]\nforward = 1\nbackward_input = 1\nbackward_weight = 1\n")
    proc = subprocess.run([sys.executable, "-m", "recycle", "schedule", "--config", str(bad), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "[workload] num_microbatches = -1 must be >= 1" in proc.stderr and "Traceback" not in proc.stderr


def test_demo_writes_a_gantt_per_schedule(tmp_path, capsys) -> None:
    assert main(["demo", "--out", str(tmp_path / "demo"), "--only", "1"]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == [
        "gantt-toy-1f1b-decoupled.png", "gantt-toy-1f1b.png", "gantt-toy-gpipe.png", "gantt-toy-zb-h1.png"]
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in out.splitlines() if line[:1] in "g1z"}
    assert rows[("1f1b", "coupled")][:3] == ["27", "30", "0.300"]
    assert rows[("zb-h1", "staggered")][:3] == ["21", "24", "0.125"]
    assert rows[("gpipe", "coupled")][3] == "6/6/6/6"


def test_demo_rejects_unknown_sections(capsys) -> None:
    assert main(["demo", "--only", "9"]) == 2
    assert "--only '9' must list section numbers" in capsys.readouterr().err


def test_builtin_toy_equals_the_toy_file() -> None:
    assert toy_config().planning_dict() == load_config(TOY).planning_dict()
