"""Exact planner: CP-SAT solves one failure state (model: exact_model); keep it or the hint's orders; state the gap."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from recycle.config import Config
from recycle.errors import RecycleError
from recycle.ir.actions import Action, Kind
from recycle.ir.plan import Plan, PlanMeta
from recycle.ir.validate import validate_plan
from recycle.planner.bounds import period_lower_bound
from recycle.planner.exact_hint import check_hint, hint_schedule
from recycle.planner.exact_instance import Instance, TimeScale, build_instance, scale_for, time_scale
from recycle.planner.exact_model import PeriodModel
from recycle.planner.failures import canonical_failed
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import check_key
from recycle.sim.simulator import simulate
from recycle.sim.steady_state import min_period

__all__ = ["schedule_exact", "TimeScale", "time_scale", "ExactSolverError"]

# A schedule in the model's terms: start tick per (kind, stage, mb) and host replica per (stage, mb).
Schedule = tuple[dict[tuple[Kind, int, int], int], dict[tuple[int, int], int]]


class ExactSolverError(RecycleError):
    """CP-SAT found no schedule within its time limit and there was no hint to fall back on."""


def _sorted_per_worker(inst: Instance, hosts: dict[tuple[int, int], int], times: dict[tuple[Kind, int, int], int]
                       ) -> list[list[tuple[int, int, int, int, Action]]]:
    """Each worker's compute actions sorted by start (rank order; failed workers get empty lists)."""
    S = inst.S
    phase = {k: i for i, k in enumerate(inst.kinds)}
    per_worker: list[list[tuple[int, int, int, int, Action]]] = [[] for _ in range(inst.D * S)]
    for (kind, s, mb), t in times.items():
        end = t + inst.duration[(kind, s)]
        # Ties only happen with zero-length actions; F < B < W keeps the order legal for one micro-batch.
        per_worker[hosts[(s, mb)] * S + s].append((t, end, phase[kind], mb, Action(kind, s, mb)))
    for row in per_worker:
        row.sort()
    return per_worker


def _orders(inst: Instance, hosts: dict[tuple[int, int], int], times: dict[tuple[Kind, int, int], int]
            ) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[Action, ...], ...]]:
    """Routing table host[stage][mb] and per-worker action lists (sorted by start, OPT last) of a schedule."""
    S, total = inst.S, inst.D * inst.M
    host = tuple(tuple(hosts[(s, mb)] for mb in range(total)) for s in range(S))
    actions: list[tuple[Action, ...]] = []
    for rank, row in enumerate(_sorted_per_worker(inst, hosts, times)):
        replica, stage = divmod(rank, S)
        if replica < inst.key[stage]:
            actions.append(())
            continue
        actions.append(tuple(a for *_, a in row) + (Action(Kind.OPT, stage),))
    return host, tuple(actions)


def _steady_ticks(inst: Instance, staggered: bool, times: dict[tuple[Kind, int, int], int],
                  hosts: dict[tuple[int, int], int]) -> float:
    """The smallest model period (ticks) of a schedule's routing and orders."""
    rows = [[a for *_, a in row] for row in _sorted_per_worker(inst, hosts, times) if row]
    return min_period(rows, lambda a: inst.duration[(a.kind, a.stage)], inst.p2p, inst.opt, staggered)


def _respects_cap(peaks: tuple[int, ...], cap: tuple[int, ...] | None, num_stages: int) -> bool:
    return cap is None or all(p <= cap[r % num_stages] for r, p in enumerate(peaks))


@dataclass(frozen=True)
class _Hinted:
    """A hint plan and its schedule in the model's terms (start ticks, hosts, model period)."""

    plan: Plan
    times: dict[tuple[Kind, int, int], int]
    hosts: dict[tuple[int, int], int]
    ticks: int


def schedule_exact(config: Config, key: tuple[int, ...], options: PlannerOptions, time_limit_s: float = 10.0,
                   hint: Plan | None = None, workers: int = 2, deterministic_limit: float | None = None) -> Plan:
    """Solve the routing and per-worker orders of failure key `key` (canonical layout) with CP-SAT.

    The model minimises the steady-state period of a schedule repeated every T (the paper's one-iteration
    surrogate); the plan's reported period is the simulator's. With a hint, CP-SAT starts from it, and the hint's
    orders are returned when CP-SAT finds nothing better. `deterministic_limit` also caps CP-SAT's deterministic
    time (its own work measure); with one worker and that limit reached first, the result is reproducible.
    """
    began = time.perf_counter()
    key = check_key(config, key)
    scale = scale_for(config, key)
    inst = build_instance(config, key, options, scale)
    model = PeriodModel(inst, options.staggered)
    hinted = _add_hint(model, hint, config, key) if hint is not None else None
    solver, status = _solve(model, time_limit_s, workers, deterministic_limit, hinted is not None)
    status_name = solver.status_name(status)
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    wall = time.perf_counter() - began
    bound = _proven_bound(solver, status, found, scale, inst)
    meta = PlanMeta(schedule="adaptive", decoupled=options.decoupled, failure_key=key, solver="exact",
                    status=status_name, lower_bound=bound, memory_cap=inst.cap or (),
                    config_fingerprint=config.fingerprint())
    notes = [f"CP-SAT {status_name} after {wall:.2f}s with {solver.parameters.num_workers} workers"]
    if not scale.exact:
        notes.append(f"durations rounded to 1/{scale.ticks_per_unit:g} time units")
    solution = model.extract(solver) if found else None
    candidate = _solution_plan(inst, solution, config, options, meta) if solution is not None else None
    chosen, chosen_ticks, schedule = candidate, solver.objective_value if found else math.inf, solution
    if hinted is not None:
        chosen, chosen_ticks, schedule = _prefer_hint(hinted, candidate, chosen_ticks, solution, config, options,
                                                      inst, meta, notes)
    if chosen is None or schedule is None:
        raise ExactSolverError(
            f"CP-SAT found no schedule for key {key} within {time_limit_s:g}s (status {status_name}); raise the time "
            "limit, pass a hint (e.g. the heuristic plan), or relax the memory cap")
    bound_ticks = solver.best_objective_bound if bound is not None else math.inf
    return _finish(chosen, chosen_ticks, schedule, bound, bound_ticks, inst, scale, config, options, notes)


def _add_hint(model: PeriodModel, hint: Plan, config: Config, key: tuple[int, ...]) -> _Hinted:
    """Check the hint, translate it to the model's terms and hint every variable from it."""
    check_hint(hint, config, key)
    times, hosts = hint_schedule(hint, model.inst)
    model.add_hint(times, hosts)
    return _Hinted(hint, times, hosts, model.periodic_ticks(times, hosts))


def _solve(model: PeriodModel, time_limit_s: float, workers: int, deterministic_limit: float | None,
           hinted: bool) -> tuple[cp_model.CpSolver, int]:
    """Run CP-SAT on the model; return the solver (for values and bounds) and its status."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = max(1, int(workers))
    if deterministic_limit is not None:
        solver.parameters.max_deterministic_time = float(deterministic_limit)
    if hinted:
        # CP-SAT's presolve fixes symmetric literals (e.g. interchangeable healthy replicas) its own way, which
        # makes a complete hint infeasible and discards it (measured: docs/planner.md, Exact solver, "Hint").
        solver.parameters.symmetry_level = 0
    return solver, solver.solve(model.model)


def _proven_bound(solver: cp_model.CpSolver, status: int, found: bool, scale: TimeScale,
                  inst: Instance) -> float | None:
    """CP-SAT's lower bound on the model period in time units (None when it has none), kept a bound when the
    durations were rounded."""
    bound = scale.units(solver.best_objective_bound) if found or status == cp_model.UNKNOWN else None
    if bound is not None and not math.isfinite(bound):
        bound = None
    if bound is not None and not scale.exact:
        # Rounded durations: a chain of n actions and messages may be off by n/2 ticks; keep the bound a bound.
        actions = inst.D * inst.M * inst.S * len(inst.kinds)
        bound = max(0.0, bound - scale.units(0.5 * (2 * actions + 1)))
    return bound


def _solution_plan(inst: Instance, solution: Schedule, config: Config, options: PlannerOptions,
                   meta: PlanMeta) -> Plan:
    """The validated plan of a CP-SAT solution, with its simulated period and makespan."""
    host, actions = _orders(inst, solution[1], solution[0])
    failed = canonical_failed(inst.key)
    plan = validate_plan(Plan(inst.D, inst.S, inst.M, host, actions, failed, options.staggered, meta))
    sim = simulate(plan, config)
    return plan.with_meta(predicted_period=sim.period, predicted_makespan=sim.makespan)


def _prefer_hint(hinted: _Hinted, candidate: Plan | None, candidate_ticks: float, solution: Schedule | None,
                 config: Config, options: PlannerOptions, inst: Instance, meta: PlanMeta, notes: list[str]
                 ) -> tuple[Plan | None, float, Schedule | None]:
    """The hint's orders instead of CP-SAT's plan when they fit the cap and simulate no slower (or CP-SAT found
    none): (plan, model period in ticks, schedule) of the one chosen; notes say why."""
    hinted_plan = replace(hinted.plan, staggered=options.staggered)
    hint_sim = simulate(hinted_plan, config)
    usable = _respects_cap(hint_sim.peak_activations, inst.cap, inst.S)
    if usable and (candidate is None or hint_sim.period <= candidate.meta.predicted_period):
        why = "found no schedule" if candidate is None else "found nothing better"
        notes.append(f"returned the hint's orders: CP-SAT {why}")
        chosen = replace(hinted_plan, meta=replace(meta, predicted_period=hint_sim.period,
                                                   predicted_makespan=hint_sim.makespan))
        return chosen, hinted.ticks, (hinted.times, hinted.hosts)
    if not usable:
        notes.append("hint exceeds the memory cap, used only as a starting point")
    return candidate, candidate_ticks, solution


def _finish(chosen: Plan, chosen_ticks: float, schedule: Schedule, bound: float | None, bound_ticks: float,
            inst: Instance, scale: TimeScale, config: Config, options: PlannerOptions, notes: list[str]) -> Plan:
    """The returned plan's status and notes. Its orders' own best periodic timing (a hint's as-soon-as-possible
    timing, or a FEASIBLE solution's, need not be it) is a cheap LP: OPTIMAL when it meets the proven bound, also
    when CP-SAT was cut off but its incumbent or the hint was already optimal."""
    steady = _steady_ticks(inst, options.staggered, *schedule)
    steady_known = math.isfinite(steady)
    chosen_ticks = min(chosen_ticks, steady)
    status = "OPTIMAL" if chosen_ticks <= bound_ticks + 1e-6 * max(1.0, bound_ticks) else "FEASIBLE"
    analytic = period_lower_bound(config, inst.key, options)
    if status != "OPTIMAL" and chosen.meta.predicted_period <= analytic * (1 + 1e-9):
        status = "OPTIMAL"  # the simulated period meets a bound on every plan's simulated period
        notes.append(f"simulated period meets the analytic lower bound {analytic:g}")
    model_period = scale.units(chosen_ticks)
    gap = (model_period - bound) / model_period if bound is not None and model_period > 0 else math.nan
    notes.append(f"steady-state period {'' if steady_known else '<= '}{model_period:g}, bound "
                 f"{bound if bound is not None else math.nan:g}, gap {gap:.1%}, simulated period "
                 f"{chosen.meta.predicted_period:g}")
    if steady_known and chosen.meta.predicted_period < model_period * (1 - 1e-6):
        # Staggered plans can measure faster over the simulator's first iterations than in their steady state.
        notes.append("the simulated period (iterations 1-3) is below the steady state: start-up transient")
    return chosen.with_meta(status=status, notes="; ".join(notes))
