"""Outputs of a timed run: text grid (slot and scaled), Gantt PNG (re-routed work hatched), Chrome trace."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from recycle.config import load_config, uniform_config
from recycle.ir import Action, Plan, validate_plan
from recycle.report import chrome_trace_events, timed_grid, write_chrome_trace, write_gantt
from recycle.report.gantt import REROUTED_HATCH, gantt_figure
from recycle.schedules.fault_free import build_schedule
from recycle.sim.simulator import simulate

ROOT = Path(__file__).resolve().parents[2]


def rerouted_plan() -> Plan:
    """D=2, S=2, M=2 with worker (1,1) down: its micro-batches 2 and 3 run on the peer (0,1)."""
    lists = ["0F0 0F1 0BW0 0BW1 0OPT", "1F0 1F2 1BW0 1F1 1BW2 1F3 1BW1 1BW3 1OPT", "0F2 0F3 0BW2 0BW3 0OPT", ""]
    actions = [[Action.parse(t) for t in line.split()] for line in lists]
    return validate_plan(Plan.from_worker_lists(2, 2, 2, actions, failed={(1, 1)}))


def _toy(name: str = "1f1b", iterations: int = 2):
    config = load_config(ROOT / "configs" / "toy.toml")
    plan = build_schedule(config, name)
    return plan, simulate(plan, config, iterations=iterations, record=True)


def test_slot_grid_of_toy_1f1b() -> None:
    plan, result = _toy()
    lines = timed_grid(result, plan).splitlines()
    assert lines[0] == "timeline of iteration 0: t = 0 .. 30"
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:-1]}
    assert len(rows) == 12
    # 4-character cells ("BW17"): stage 3 starts after three idle slots, then alternates F and a 2-slot BW.
    assert rows["(0,3)"][:9] == [".", ".", ".", "F0", "BW0", "-", "F1", "BW1", "-"]
    assert rows["(2,0)"][:4] == ["F12", "F13", "F14", "F15"]
    assert rows["(0,0)"][-3:] == ["OPT", "-", "-"]
    assert all(len(cells) == 30 for cells in rows.values())


def test_slot_grid_marks_rerouted_and_down_workers() -> None:
    plan = rerouted_plan()
    result = simulate(plan, uniform_config(2, 2, 2), iterations=1, record=True)
    grid = timed_grid(result, plan)
    assert "(1,1) DOWN" in grid
    peer = next(line for line in grid.splitlines() if line.startswith("(0,1)"))
    assert "F2*" in peer and "BW3*" in peer and "F0*" not in peer


def test_scaled_grid_for_microsecond_configs() -> None:
    config = load_config(ROOT / "configs" / "gpt3-6.7b-a100.toml")
    plan = build_schedule(config, "zb-h1")
    result = simulate(plan, config, iterations=1, record=True)
    lines = timed_grid(result, plan, columns=60).splitlines()
    rows = [line for line in lines if line.startswith("(")]
    assert len(rows) == 24
    assert all(len(row.split()[1]) == 60 for row in rows)
    first = rows[0].split()[1]
    assert first.startswith("F") and first.rstrip(".").endswith("O") and set(first) <= set("FBWO.")
    assert "1 column = " in lines[-1]


def test_gantt_png_is_written_atomically(tmp_path) -> None:
    plan, result = _toy("zb-h1")
    path = write_gantt(result, plan, tmp_path / "charts" / "g.png", title="toy zb-h1", time_unit="slot")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
    assert os.listdir(path.parent) == ["g.png"]


def test_gantt_hatches_exactly_the_rerouted_bars() -> None:
    import matplotlib.pyplot as plt

    plan = rerouted_plan()
    result = simulate(plan, uniform_config(2, 2, 2), iterations=1, record=True)
    fig = gantt_figure(result, plan)
    try:
        bars = [c for c in fig.axes[0].collections if c.get_paths()]
        hatched = [c for c in bars if c.get_hatch() == REROUTED_HATCH]
        # One hatched group per (row, kind): F and BW of micro-batches 2, 3 on the peer (0,1), row 1.
        assert len(hatched) == 2
        assert all(p.get_extents().y0 >= 0.5 and p.get_extents().y1 <= 1.5 for c in hatched for p in c.get_paths())
        texts = [t.get_text() for t in fig.axes[0].texts]
        assert "DOWN" in texts
    finally:
        plt.close(fig)
    fault_free, ff_result = _toy()
    fig = gantt_figure(ff_result, fault_free)
    try:
        assert not [c for c in fig.axes[0].collections if c.get_hatch() == REROUTED_HATCH]
    finally:
        plt.close(fig)


def test_chrome_trace_events(tmp_path) -> None:
    plan = rerouted_plan()
    result = simulate(plan, uniform_config(2, 2, 2), iterations=2, record=True)
    path = write_chrome_trace(result, plan, tmp_path / "t.json", us_per_unit=1000.0)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(result.timeline) == 2 * plan.num_actions
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[(1, 1)] == "stage 1 (down)" and names[(0, 1)] == "stage 1"
    f2 = next(e for e in complete if e["name"] == "1F2" and e["args"]["iteration"] == 0)
    assert (f2["pid"], f2["tid"]) == (0, 1) and f2["args"]["rerouted"] and f2["cat"] == "F,rerouted"
    start, end = next((s, e) for r, it, tok, s, e in result.timeline if tok == "1F2" and it == 0)
    assert f2["ts"] == start * 1000.0 and f2["dur"] == (end - start) * 1000.0
    assert all(not e["args"]["rerouted"] for e in complete if e["pid"] == 1)


def test_outputs_need_a_recorded_timeline() -> None:
    config = uniform_config(1, 2, 2)
    plan = build_schedule(config, "1f1b")
    with pytest.raises(ValueError, match="record=True"):
        chrome_trace_events(simulate(plan, config), plan)
