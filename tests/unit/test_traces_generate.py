"""Synthetic traces: the configured failure rate is reproduced, seeds are deterministic, presets have their shape."""

from __future__ import annotations

import pytest

from recycle.errors import TraceError
from recycle.traces.generate import (
    LLAMA3_DAYS,
    LLAMA3_INTERRUPTIONS,
    PAPER_GCP_HOURS,
    FailureModel,
    generate_trace,
    llama3_model,
    paper_gcp_shape,
    parse_generate_spec,
)
from recycle.traces.mapping import map_trace_to_units


def _up_node_hours(trace) -> float:
    points = trace.change_points()
    total = 0.0
    for i, (t, live) in enumerate(points):
        end = points[i + 1][0] if i + 1 < len(points) else trace.end_ms
        total += (end - t) / 3_600_000 * len(live)
    return total


@pytest.mark.parametrize("distribution", ["exponential", "weibull"])
def test_long_seeded_run_matches_the_configured_rate(distribution: str) -> None:
    model = FailureModel(num_nodes=100, duration_h=4000, mtbf_h=20.0, distribution=distribution, repair_mean_h=2.0,
                         seed=11)
    trace = generate_trace(model)
    observed = trace.num_removals() / _up_node_hours(trace)  # failures per node-hour of up time
    assert abs(observed / model.rate_per_node_hour - 1) < 0.05
    # repairs: every re-add follows its node's removal after ~repair_mean_h on average
    assert 0.8 < sum(1 for e in trace.events if e.action == "add") / trace.num_removals() <= 1.0


def test_llama3_preset_reproduces_419_interruptions_per_54_days() -> None:
    # Ten 54-day windows in one run: the Poisson noise of one window (+-20) would swamp a 5% check.
    trace = generate_trace(llama3_model(days=10 * LLAMA3_DAYS, seed=5))
    per_window = trace.num_removals() / 10
    assert abs(per_window / LLAMA3_INTERRUPTIONS - 1) < 0.05


def test_generation_is_deterministic_per_seed() -> None:
    model = FailureModel(num_nodes=20, duration_h=200, mtbf_h=30, seed=1)
    assert generate_trace(model).events == generate_trace(model).events
    other = FailureModel(num_nodes=20, duration_h=200, mtbf_h=30, seed=2)
    assert generate_trace(model).events != generate_trace(other).events


def test_never_repaired_nodes_only_leave() -> None:
    trace = generate_trace(FailureModel(num_nodes=10, duration_h=100, mtbf_h=20, repair_mean_h=0, seed=0))
    assert all(e.action == "remove" for e in trace.events)
    assert len({e.node for e in trace.events}) == trace.num_removals()


def test_paper_shape_averages_21_7_of_24_and_dips_to_15() -> None:
    timeline = map_trace_to_units(paper_gcp_shape())
    counts = [len(live) for live in timeline.live]
    assert max(counts) == 24 and min(counts) == 15
    assert abs(timeline.mean_live() - 21.71) < 0.01
    assert abs(timeline.end_s / 3600 - PAPER_GCP_HOURS) < 1e-9


def test_generate_spec_strings() -> None:
    trace = parse_generate_spec("poisson:nodes=12,hours=50,mtbf_h=10,repair_h=1,seed=4")
    assert len(trace.initial) == 12 and trace.end_ms == 50 * 3_600_000
    assert parse_generate_spec("weibull:nodes=5,days=2,mtbf_h=5,shape=0.5").end_ms == 48 * 3_600_000
    for bad, fragment in [("martian", "unknown kind"), ("poisson:nodes=3", "mtbf_h"),
                          ("poisson:mtbf_h=1,colour=red", "unknown key"), ("poisson:mtbf_h=x", "must be a number"),
                          ("poisson:mtbf_h=-1", "must be > 0"), ("llama3:nodes", "not key=value")]:
        with pytest.raises(TraceError, match=fragment):
            parse_generate_spec(bad)


def test_paper_gcp_spec_takes_a_placement_and_a_seed() -> None:
    spread = parse_generate_spec("paper-gcp:placement=spread,seed=1")
    assert spread.placement.startswith("spread (seed 1")
    assert spread.source == "generated:paper-gcp:placement=spread,seed=1"
    assert spread.events == paper_gcp_shape(seed=1, placement="spread").events
    assert parse_generate_spec("paper-gcp").events == paper_gcp_shape(seed=0).events  # default: random, seed 0
    # the caller's defaults (recycle simulate's --placement / --seed) apply when the spec names none
    assert parse_generate_spec("paper-gcp", placement="worst", seed=2).events == \
        paper_gcp_shape(seed=2, placement="worst").events
    assert parse_generate_spec("paper-gcp:placement=spread", placement="worst").placement.startswith("spread")
    # every placement keeps the counts (only which workers differs)
    for placement in ("random", "spread", "worst"):
        counts = [len(s) for s in map_trace_to_units(paper_gcp_shape(placement=placement)).live]
        assert max(counts) == 24 and min(counts) == 15
    with pytest.raises(TraceError, match="unknown"):
        parse_generate_spec("paper-gcp:placement=clustered")
