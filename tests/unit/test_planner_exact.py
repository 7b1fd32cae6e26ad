"""The CP-SAT planner reproduces the paper's toy numbers, proves them optimal, respects caps and uses hints."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from recycle.config import load_config, parse_config, uniform_config
from recycle.errors import ConfigError, FailureStateError, PlanError
from recycle.ir.actions import Kind
from recycle.ir.validate import validate_plan
from recycle.planner.exact import ExactSolverError, schedule_exact, time_scale
from recycle.planner.failures import normalize
from recycle.planner.options import PlannerOptions
from recycle.schedules.fault_free import build_schedule
from recycle.sim.simulator import simulate
from recycle.sim.steady_state import steady_state_period

TOY = Path(__file__).resolve().parents[2] / "configs" / "toy.toml"
CAP_1F1B = (4, 3, 2, 1)


@pytest.fixture(scope="module")
def toy():
    return load_config(TOY)


@pytest.fixture(scope="module")
def toy_key(toy):
    # The paper's failure: worker (replica 1, stage 2); canonically stage 2 has one failed replica.
    return normalize([(1, 2)], toy.num_replicas, toy.num_stages).key


def _compute_window(plan, config) -> float:
    """Steady-state iteration: last compute end minus first compute start over all workers."""
    result = simulate(plan, config, record=True)
    last = result.num_iterations - 1
    spans = [(start, end) for _, it, token, start, end in result.timeline if it == last and "OPT" not in token]
    return max(e for _, e in spans) - min(s for s, _ in spans)


def _stage_peers(plan, stage: int) -> list[int]:
    return [plan.rank(p, stage) for p in plan.live_replicas(stage)]


def test_key_is_the_paper_failure(toy_key):
    assert toy_key == (0, 0, 1, 0)


@pytest.mark.parametrize(
    "failed, options, period, window",
    [
        ([], PlannerOptions(decoupled=False, staggered=False), 30.0, 27.0),  # fault-free 1F1B
        ([(1, 2)], PlannerOptions(decoupled=False, staggered=False), 36.0, 33.0),  # adaptive, coupled
        ([(1, 2)], PlannerOptions(decoupled=True, staggered=False), 32.0, 29.0),  # + decoupled backprop
    ],
    ids=["fault-free", "coupled", "decoupled"],
)
def test_toy_coupled_optimizer_optima(toy, failed, options, period, window):
    key = normalize(failed, toy.num_replicas, toy.num_stages).key
    plan = schedule_exact(toy, key, options, time_limit_s=10.0)
    validate_plan(plan)
    result = simulate(plan, toy)
    assert plan.meta.status == "OPTIMAL"
    assert plan.meta.solver == "exact"
    assert result.period == period == plan.meta.predicted_period
    assert plan.meta.lower_bound == pytest.approx(period)  # proved: the solver's bound meets the simulator's period
    # Coupled optimizer: the period is the compute window plus the 3-slot step.
    assert _compute_window(plan, toy) == window
    assert result.makespan <= window
    kinds = {a.kind for acts in plan.actions for a in acts}
    assert (Kind.BW not in kinds) if options.decoupled else (Kind.B not in kinds and Kind.W not in kinds)
    assert plan.staggered is False and plan.meta.failure_key == key


def test_toy_zero_overhead_with_staggered_optimizer(toy, toy_key):
    plan = schedule_exact(toy, toy_key, PlannerOptions(decoupled=True, staggered=True), time_limit_s=10.0)
    result = simulate(plan, toy)
    assert plan.meta.status == "OPTIMAL"
    assert plan.staggered is True
    # Zero overhead: the same period and per-worker makespan as fault-free 1F1B.
    fault_free = simulate(build_schedule(toy, "1f1b"), toy)
    assert (result.period, result.makespan) == (fault_free.period, fault_free.makespan) == (30.0, 27.0)
    # The stage-2 peers carry 9 micro-batches each with no idle time; that needs more live activations than 1F1B.
    peers = _stage_peers(plan, 2)
    assert all(result.idle_fraction[r] == pytest.approx(0.0) for r in peers)
    assert min(result.peak_activations[r] for r in peers) > fault_free.peak_activations[toy.num_stages * 0 + 2] == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_toy_coupled_under_1f1b_memory_cap(toy, toy_key):
    options = PlannerOptions(decoupled=False, staggered=False, memory_cap=CAP_1F1B)
    plan = schedule_exact(toy, toy_key, options, time_limit_s=15.0)
    result = simulate(plan, toy)
    assert plan.meta.status in ("OPTIMAL", "FEASIBLE")
    assert result.period == 39.0 and _compute_window(plan, toy) == 36.0  # the paper's 36-slot adaptive schedule
    for rank, peak in enumerate(result.peak_activations):
        assert peak <= CAP_1F1B[rank % toy.num_stages]
    assert plan.meta.memory_cap == CAP_1F1B
    # The bound is at least the uncapped optimum and never above the plan found.
    assert 36.0 <= plan.meta.lower_bound <= result.period


def test_memory_cap_is_enforced_and_costs_period():
    # A cap of 1 everywhere serialises each worker's micro-batches: valid, respected, and slower than no cap.
    options = PlannerOptions(decoupled=True, staggered=True, memory_cap=(1, 1))
    small = uniform_config(2, 2, 2, optimizer=1.0)
    plan = schedule_exact(small, (0, 1), options, time_limit_s=10.0)
    result = simulate(plan, small)
    assert max(result.peak_activations) == 1
    free = schedule_exact(small, (0, 1), PlannerOptions(decoupled=True, staggered=True), time_limit_s=10.0)
    assert plan.meta.status == free.meta.status == "OPTIMAL"
    assert result.period > free.meta.predicted_period


def test_config_capacity_is_the_default_cap():
    raw = {
        "topology": {"num_replicas": 2, "num_stages": 2},
        "workload": {"num_microbatches": 3},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1, "optimizer": 1},
        "memory": {"activation_bytes": [100, 200], "capacity_bytes": 200},
    }
    config = parse_config(raw)
    plan = schedule_exact(config, (1, 0), PlannerOptions(), time_limit_s=10.0)
    result = simulate(plan, config)
    assert plan.meta.memory_cap == (2, 1)
    assert result.peak_activations[plan.rank(1, 0)] <= 2 and result.peak_activations[plan.rank(0, 1)] <= 1


def test_hint_that_cannot_be_beaten_is_returned(toy):
    hint = build_schedule(toy, "1f1b")
    plan = schedule_exact(toy, (0, 0, 0, 0), PlannerOptions(decoupled=False, staggered=False), time_limit_s=10.0,
                          hint=hint)
    assert plan.actions == hint.actions and plan.host == hint.host
    assert plan.meta.status == "OPTIMAL" and plan.meta.solver == "exact" and plan.meta.predicted_period == 30.0
    assert "hint" in plan.meta.notes


def test_no_solution_raises_without_hint_and_falls_back_to_hint(toy, toy_key):
    with pytest.raises(ExactSolverError, match="no schedule"):
        schedule_exact(toy, toy_key, PlannerOptions(decoupled=False, staggered=False), time_limit_s=0.0)
    # Fused-backward 1F1B as the hint of a decoupled search: feasible, not optimal (decoupling can beat 30).
    hint = build_schedule(toy, "1f1b")
    plan = schedule_exact(toy, (0, 0, 0, 0), PlannerOptions(decoupled=True, staggered=False), time_limit_s=0.0,
                          hint=hint)
    assert plan.actions == hint.actions and plan.meta.predicted_period == 30.0
    # The plan returned is the hint, a feasible but unproven plan; the notes keep CP-SAT's own status.
    assert plan.meta.status == "FEASIBLE" and "CP-SAT UNKNOWN" in plan.meta.notes


def test_hint_improves_or_matches(toy, toy_key):
    heuristic = pytest.importorskip("recycle.planner.heuristic")
    options = PlannerOptions(decoupled=True, staggered=False)
    hint = heuristic.schedule_heuristic(toy, toy_key, options)
    plan = schedule_exact(toy, toy_key, options, time_limit_s=10.0, hint=hint)
    assert plan.meta.predicted_period <= simulate(hint, toy).period
    assert plan.meta.predicted_period == 32.0 and plan.meta.status == "OPTIMAL"


def test_hint_for_another_layout_is_rejected(toy, toy_key):
    with pytest.raises(PlanError, match="canonical layout"):
        schedule_exact(toy, toy_key, PlannerOptions(), hint=build_schedule(toy, "1f1b"))


def test_bad_keys_and_caps_are_user_errors(toy):
    with pytest.raises(FailureStateError, match="stage 1"):
        schedule_exact(toy, (0, 3, 0, 0), PlannerOptions())
    with pytest.raises(FailureStateError, match="4 stages"):
        schedule_exact(toy, (0, 1), PlannerOptions())
    with pytest.raises(ConfigError, match="one integer >= 1 per stage"):
        schedule_exact(toy, (0, 1, 0, 0), PlannerOptions(memory_cap=(4, 3)))


def test_communication_and_uneven_costs_match_the_simulator():
    # p2p latency, all-reduce and fractional costs: the model's period (integer ticks) equals the simulator's.
    raw = {
        "topology": {"num_replicas": 3, "num_stages": 3},
        "workload": {"num_microbatches": 3},
        "costs": {"forward": [1.0, 1.5, 1.0], "backward_input": [1.0, 1.5, 2.0], "backward_weight": 0.5,
                  "optimizer": [1.0, 2.0, 0.5]},
        "communication": {"p2p_latency": 0.25, "allreduce_latency": 0.5},
    }
    config = parse_config(raw)
    for options in (PlannerOptions(decoupled=True, staggered=True), PlannerOptions(decoupled=False,
                                                                                   staggered=False)):
        plan = schedule_exact(config, (1, 0, 2), options, time_limit_s=10.0)
        result = simulate(plan, config)
        assert plan.meta.status == "OPTIMAL"
        assert result.period == pytest.approx(plan.meta.lower_bound)
        # Stage 2 lost two of three replicas: its survivor does all 9 micro-batches' work plus its step.
        work = 9 * (1.0 + 2.0 + 0.5) if options.decoupled else 9 * (1.0 + 2.5)
        # Steps: stage 2 alone has no all-reduce (0.5); coupled waits for stage 1's (2 + 4 ring steps x 0.5).
        step = 0.5 if options.staggered else 4.0
        assert result.period >= work + step


def test_time_scale_finds_the_coarsest_exact_grid():
    assert time_scale([1.0, 0.5, 2.5]).ticks_per_unit == 2.0
    us = time_scale([1200.0, 3400.0, 600.0])
    assert us.exact and us.ticks(1200.0) == 6 and us.units(17) == pytest.approx(3400.0)
    rough = time_scale([math.pi, 1.0])
    assert not rough.exact and rough.ticks(math.pi) == 10**6


def _long_run_period(plan, config, iterations: int = 40, window: int = 12) -> float:
    starts = simulate(plan, config, iterations=iterations).iteration_starts
    return (starts[-1] - starts[-1 - window]) / window


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("staggered", [False, True])
def test_steady_state_period_is_the_simulators_long_run(toy, schedule, staggered):
    # The CP-SAT model's period (one iteration repeated every T) must be what the simulator converges to.
    plan = build_schedule(toy, schedule, staggered=staggered)
    assert steady_state_period(plan, toy) == pytest.approx(_long_run_period(plan, toy))


def test_steady_state_period_of_planned_states_with_communication():
    heuristic = pytest.importorskip("recycle.planner.heuristic")
    config = uniform_config(4, 4, 8, forward=1.0, backward_input=1.5, backward_weight=0.5, optimizer=2.0)
    raw = config.to_dict()
    raw["communication"]["p2p_latency"] = 0.3
    raw["communication"]["allreduce_latency"] = 0.25
    config = parse_config(raw)
    for key in [(0, 1, 0, 0), (1, 0, 0, 2)]:
        for options in (PlannerOptions(), PlannerOptions(decoupled=False, staggered=False)):
            plan = heuristic.schedule_heuristic(config, key, options)
            assert steady_state_period(plan, config) == pytest.approx(_long_run_period(plan, config))
