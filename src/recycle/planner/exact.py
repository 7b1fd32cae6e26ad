"""Exact planner: a CP-SAT model that routes and orders one failure state's work to minimise the period."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Iterable

from ortools.sat.python import cp_model

from recycle.config import Config
from recycle.errors import PlanError, RecycleError
from recycle.ir.actions import Action, Kind
from recycle.ir.costs import action_duration
from recycle.ir.dependencies import boundary, input_stage, local_input, producer_kind
from recycle.ir.plan import Plan, PlanMeta
from recycle.ir.validate import check_plan_matches, validate_plan
from recycle.planner.bounds import period_lower_bound
from recycle.planner.failures import canonical_failed
from recycle.planner.memory_cap import memory_cap
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import check_key
from recycle.sim.simulator import simulate
from recycle.sim.steady_state import min_period

__all__ = ["schedule_exact", "TimeScale", "time_scale", "ExactSolverError"]

# Largest integer duration the model works with; coarser units only when exact ones would exceed it.
_MAX_TICKS = 10**6


class ExactSolverError(RecycleError):
    """CP-SAT found no schedule within its time limit and there was no hint to fall back on."""


@dataclass(frozen=True)
class TimeScale:
    """Config time units -> the model's integer ticks: ticks = round(value * ticks_per_unit)."""

    ticks_per_unit: float
    exact: bool  # False when durations had to be rounded to fit _MAX_TICKS

    def ticks(self, value: float) -> int:
        return int(round(value * self.ticks_per_unit))

    def units(self, ticks: float) -> float:
        return ticks / self.ticks_per_unit


def time_scale(values: Iterable[float], max_decimals: int = 6) -> TimeScale:
    """The coarsest integer grid on which every value is a whole number of ticks (gcd of the decimal forms)."""
    positive = [v for v in values if v > 0]
    if not positive:
        return TimeScale(1.0, True)
    for decimals in range(max_decimals + 1):
        factor = 10**decimals
        scaled = [v * factor for v in positive]
        if all(abs(x - round(x)) <= 1e-9 * max(1.0, x) for x in scaled):
            g = 0
            for x in scaled:
                g = math.gcd(g, int(round(x)))
            ticks_per_unit = factor / g
            if max(positive) * ticks_per_unit <= _MAX_TICKS:
                return TimeScale(ticks_per_unit, True)
            break
    # No exact grid small enough: round every duration to 1/_MAX_TICKS of the longest one.
    return TimeScale(_MAX_TICKS / max(positive), False)


@dataclass(frozen=True)
class _Instance:
    """The numbers the model is built from, all in ticks."""

    D: int
    S: int
    M: int
    key: tuple[int, ...]
    kinds: tuple[Kind, ...]  # phases of one micro-batch at one stage, in dependency order
    duration: dict[tuple[Kind, int], int]  # (kind, stage) -> ticks
    p2p: tuple[int, ...]  # per stage boundary s (s -> s+1 and back)
    opt: tuple[int, ...]  # per stage: all-reduce over the live replicas + optimizer step
    cap: tuple[int, ...] | None

    def hosts(self, stage: int, mb: int) -> tuple[int, ...]:
        """Candidate replicas: the owner if it is alive at this stage, else every live replica (re-routing)."""
        owner = mb // self.M
        if owner >= self.key[stage]:
            return (owner,)
        return tuple(range(self.key[stage], self.D))

    @property
    def last_kind(self) -> Kind:
        return self.kinds[-1]


def _instance(config: Config, key: tuple[int, ...], options: PlannerOptions, scale: TimeScale) -> _Instance:
    D, S, M = config.num_replicas, config.num_stages, config.num_microbatches
    c = config.costs
    duration: dict[tuple[Kind, int], int] = {}
    for s in range(S):
        for kind in (Kind.F, Kind.B, Kind.W, Kind.BW):
            duration[(kind, s)] = scale.ticks(action_duration(config, kind, s, D - key[s]))
        if math.isclose(c.backward_fused[s], c.backward_input[s] + c.backward_weight[s]):
            # Keep BW = B + W on the tick grid too, so a hint's fused backward splits without overlap.
            duration[(Kind.BW, s)] = duration[(Kind.B, s)] + duration[(Kind.W, s)]
    comm = config.communication
    return _Instance(
        D, S, M, key,
        (Kind.F, Kind.B, Kind.W) if options.decoupled else (Kind.F, Kind.BW),
        duration,
        tuple(scale.ticks(comm.p2p_time(s)) for s in range(S)),
        tuple(scale.ticks(action_duration(config, Kind.OPT, s, D - key[s])) for s in range(S)),
        memory_cap(config, options),
    )


def _scale_for(config: Config, key: tuple[int, ...]) -> TimeScale:
    """The tick grid of every duration, message time and step of failure key `key`."""
    D, S = config.num_replicas, config.num_stages
    values = [action_duration(config, kind, s, D - key[s]) for kind in Kind for s in range(S)]
    values += [config.communication.p2p_time(s) for s in range(S)]
    return time_scale(values)


class _PeriodModel:
    """Interval variables per action, optional intervals for re-routed hosts, period objective (paper §3.5)."""

    def __init__(self, inst: _Instance, staggered: bool) -> None:
        self.inst = inst
        self.staggered = staggered
        self.model = cp_model.CpModel()
        self.start: dict[tuple[Kind, int, int], cp_model.IntVar] = {}
        self.present: dict[tuple[int, int], dict[int, cp_model.IntVar]] = {}  # re-routed (stage, mb) only
        self.first: dict[tuple[int, int], cp_model.IntVar] = {}  # staggered: worker -> first start
        self.stage_end: dict[int, cp_model.IntVar] = {}
        self.horizon = self._horizon()
        self.period = self.model.new_int_var(0, self.horizon, "period")
        self._build()

    def _horizon(self) -> int:
        """A period every instance can reach: all work in one global sequence, then the longest step."""
        inst = self.inst
        per_mb = sum(inst.duration[(k, s)] for s in range(inst.S) for k in inst.kinds)
        return inst.D * inst.M * (per_mb + 2 * sum(inst.p2p)) + max(inst.opt)

    def end(self, kind: Kind, stage: int, mb: int) -> cp_model.LinearExprT:
        return self.start[(kind, stage, mb)] + self.inst.duration[(kind, stage)]

    def literal(self, stage: int, mb: int, replica: int) -> cp_model.IntVar | None:
        """The presence literal of (stage, mb) on `replica`; None when the host is fixed."""
        return self.present.get((stage, mb), {}).get(replica)

    def _build(self) -> None:
        inst, m = self.inst, self.model
        D, S, M = inst.D, inst.S, inst.M
        total = D * M
        compute: dict[tuple[int, int], list] = {}  # worker -> intervals for AddNoOverlap
        memory: dict[tuple[int, int], list] = {}  # worker -> F-start..last-end intervals for AddCumulative
        load: dict[tuple[int, int], list] = {}  # worker -> busy-time terms (redundant bound on the period)
        for s in range(S):
            work = sum(inst.duration[(k, s)] for k in inst.kinds)
            for mb in range(total):
                for kind in inst.kinds:
                    self.start[(kind, s, mb)] = m.new_int_var(0, self.horizon, f"{s}{kind.value}{mb}")
                hosts = inst.hosts(s, mb)
                if len(hosts) > 1:
                    lits = {h: m.new_bool_var(f"host_{s}_{mb}_{h}") for h in hosts}
                    m.add_exactly_one(lits.values())
                    self.present[(s, mb)] = lits
                first, last = inst.kinds[0], inst.last_kind
                for h in hosts:
                    lit = self.literal(s, mb, h)
                    for kind in inst.kinds:
                        d = inst.duration[(kind, s)]
                        name = f"{s}{kind.value}{mb}@{h}"
                        if lit is None:
                            iv = m.new_fixed_size_interval_var(self.start[(kind, s, mb)], d, name)
                        else:
                            iv = m.new_optional_fixed_size_interval_var(self.start[(kind, s, mb)], d, lit, name)
                        compute.setdefault((h, s), []).append(iv)
                    load.setdefault((h, s), []).append(work if lit is None else work * lit)
                    if inst.cap is not None:
                        size = m.new_int_var(0, self.horizon, f"held_{s}_{mb}_{h}")
                        begin, finish = self.start[(first, s, mb)], self.end(last, s, mb)
                        if lit is None:
                            iv = m.new_interval_var(begin, size, finish, f"mem_{s}_{mb}@{h}")
                        else:
                            iv = m.new_optional_interval_var(begin, size, finish, lit, f"mem_{s}_{mb}@{h}")
                        memory.setdefault((h, s), []).append(iv)
        for ivs in compute.values():
            m.add_no_overlap(ivs)
        if inst.cap is not None:
            for (h, s), ivs in memory.items():
                if inst.cap[s] < len(ivs):
                    m.add_cumulative(ivs, [1] * len(ivs), inst.cap[s])
        self._precedences()
        self._symmetry_breaking()
        self._objective(load)

    def _precedences(self) -> None:
        inst, m = self.inst, self.model
        S, total = inst.S, inst.D * inst.M
        decoupled = Kind.W in inst.kinds  # every (stage, mb) alike in the model
        for mb in range(total):
            for s in range(S):
                for kind in inst.kinds:
                    source = input_stage(kind, s, S)
                    if source is not None:
                        # A message from the neighbouring stage, always another worker: pay the p2p time.
                        needed = self.end(producer_kind(kind, decoupled), source, mb)
                        m.add(self.start[(kind, s, mb)] >= needed + inst.p2p[boundary(s, source)])
                        continue
                    local = local_input(kind, s, S)  # the loss turn-around; W after its B
                    if local is not None:
                        m.add(self.start[(kind, s, mb)] >= self.end(local, s, mb))

    def _symmetry_breaking(self) -> None:
        """The micro-batches of one owner are interchangeable (same candidate hosts at every stage, same costs),
        so any schedule can be relabelled so that their stage-0 forwards start in index order. Only one stage is
        ordered: orders at later stages may legitimately differ, so fixing more would cut off optima."""
        inst, m = self.inst, self.model
        d = inst.duration[(Kind.F, 0)]
        for owner in range(inst.D):
            fixed_host = len(inst.hosts(0, owner * inst.M)) == 1
            for j in range(owner * inst.M, (owner + 1) * inst.M - 1):
                # Same worker: strictly one after the other; several candidate hosts: ties are allowed.
                gap = d if fixed_host else 0
                m.add(self.start[(Kind.F, 0, j)] + gap <= self.start[(Kind.F, 0, j + 1)])

    def _objective(self, load: dict[tuple[int, int], list]) -> None:
        inst, m = self.inst, self.model
        S, total = inst.S, inst.D * inst.M
        last = inst.last_kind
        if not self.staggered:
            # Coupled optimizer: every worker restarts after the slowest stage's step; iteration starts at 0.
            step = max(inst.opt)
            for s in range(S):
                for mb in range(total):
                    m.add(self.period >= self.end(last, s, mb) + step)
            for terms in load.values():
                m.add(self.period >= sum(terms) + step)
        else:
            # Staggered: stage s steps after its last replica's last action (the all-reduce), then each of its
            # workers starts the next iteration T after it started this one (paper §3.5, item 8).
            for s in range(S):
                end_s = m.new_int_var(0, self.horizon, f"stage_end_{s}")
                self.stage_end[s] = end_s
                for mb in range(total):
                    m.add(end_s >= self.end(last, s, mb))
                for h in range(inst.key[s], inst.D):
                    first = m.new_int_var(0, self.horizon, f"first_{h}_{s}")
                    self.first[(h, s)] = first
                    for mb in range(total):
                        if h not in inst.hosts(s, mb):
                            continue
                        lit = self.literal(s, mb, h)
                        c = m.add(first <= self.start[(Kind.F, s, mb)])
                        if lit is not None:
                            c.only_enforce_if(lit)
                    m.add(self.period + first >= end_s + inst.opt[s])
                    m.add(self.period >= sum(load[(h, s)]) + inst.opt[s])
        m.minimize(self.period)

    # -- hints ------------------------------------------------------------------------------------------------
    def add_hint(self, times: dict[tuple[Kind, int, int], int], hosts: dict[tuple[int, int], int]) -> None:
        """Hint every start, host literal and derived variable from one schedule (in this model's kinds)."""
        m = self.model
        for k, var in self.start.items():
            m.add_hint(var, times[k])
        for (s, mb), lits in self.present.items():
            for h, lit in lits.items():
                m.add_hint(lit, 1 if hosts[(s, mb)] == h else 0)
        period = self.periodic_ticks(times, hosts)
        if self.staggered:
            for var, value in self._derived_hints(times, hosts):
                m.add_hint(var, value)
        m.add_hint(self.period, min(period, self.horizon))

    def _stage_end_and_first(self, times: dict[tuple[Kind, int, int], int], hosts: dict[tuple[int, int], int]
                             ) -> tuple[list[int], dict[tuple[int, int], int]]:
        inst, total = self.inst, self.inst.D * self.inst.M
        last = inst.last_kind
        stage_end = [max(times[(last, s, mb)] + inst.duration[(last, s)] for mb in range(total))
                     for s in range(inst.S)]
        first = {(h, s): min(times[(Kind.F, s, mb)] for mb in range(total) if hosts[(s, mb)] == h)
                 for s in range(inst.S) for h in range(inst.key[s], inst.D)}
        return stage_end, first

    def _derived_hints(self, times: dict[tuple[Kind, int, int], int], hosts: dict[tuple[int, int], int]):
        stage_end, first = self._stage_end_and_first(times, hosts)
        yield from ((self.stage_end[s], v) for s, v in enumerate(stage_end))
        yield from ((self.first[w], v) for w, v in first.items())

    def periodic_ticks(self, times: dict[tuple[Kind, int, int], int], hosts: dict[tuple[int, int], int]) -> int:
        """The model's period T of one schedule: the smallest T its constraints allow for these start times."""
        inst = self.inst
        stage_end, first = self._stage_end_and_first(times, hosts)
        if not self.staggered:
            return max(stage_end) + max(inst.opt)
        return max(stage_end[s] + inst.opt[s] - f for (_, s), f in first.items())

    # -- extraction -------------------------------------------------------------------------------------------
    def extract(self, solver: cp_model.CpSolver) -> tuple[dict[tuple[Kind, int, int], int], dict[tuple[int, int], int]]:
        """Start ticks and hosts of a solution."""
        inst = self.inst
        hosts: dict[tuple[int, int], int] = {}
        for s in range(inst.S):
            for mb in range(inst.D * inst.M):
                candidates = inst.hosts(s, mb)
                if len(candidates) == 1:
                    hosts[(s, mb)] = candidates[0]
                else:
                    hosts[(s, mb)] = next(h for h in candidates if solver.boolean_value(self.present[(s, mb)][h]))
        return {k: solver.value(v) for k, v in self.start.items()}, hosts


def _sorted_per_worker(inst: _Instance, hosts: dict[tuple[int, int], int], times: dict[tuple[Kind, int, int], int]
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


def _orders(inst: _Instance, hosts: dict[tuple[int, int], int], times: dict[tuple[Kind, int, int], int]
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


def _steady_ticks(inst: _Instance, staggered: bool, times: dict[tuple[Kind, int, int], int],
                  hosts: dict[tuple[int, int], int]) -> float:
    """The smallest model period (ticks) of a schedule's routing and orders."""
    rows = [[a for *_, a in row] for row in _sorted_per_worker(inst, hosts, times) if row]
    return min_period(rows, lambda a: inst.duration[(a.kind, a.stage)], inst.p2p, inst.opt, staggered)


def _asap_ticks(plan: Plan, inst: _Instance) -> dict[tuple[Kind, int, int], int]:
    """Start tick of every compute action when the plan's orders run as soon as possible on the model's integer
    durations (one iteration; the same rule as the simulator, so the hint is exactly feasible in the model)."""
    S = inst.S
    ends: dict[tuple[Kind, int, int], int] = {}
    starts: dict[tuple[Kind, int, int], int] = {}
    pointer = [0] * len(plan.actions)
    free = [0] * len(plan.actions)
    decoupled = plan.decoupled_pairs
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(plan.actions):
            while pointer[rank] < len(acts) and acts[pointer[rank]].kind is not Kind.OPT:
                a = acts[pointer[rank]]
                ready = free[rank]
                source = input_stage(a.kind, a.stage, S)
                if source is not None:
                    dep = (producer_kind(a.kind, (source, a.mb) in decoupled), source, a.mb)
                    if dep not in ends:
                        break
                    ready = max(ready, ends[dep] + inst.p2p[boundary(a.stage, source)])
                k = (a.kind, a.stage, a.mb)
                starts[k] = ready
                ends[k] = free[rank] = ready + inst.duration[(a.kind, a.stage)]
                pointer[rank] += 1
                progress = True
    return starts


def _hint_schedule(hint: Plan, inst: _Instance) -> tuple[dict[tuple[Kind, int, int], int], dict[tuple[int, int], int]]:
    """Start ticks and hosts of the hint's orders, relabelled to satisfy the symmetry breaking and translated to
    the model's kinds (a fused BW becomes B then W; B and W become one BW at B's start)."""
    raw = _asap_ticks(hint, inst)
    M = inst.M
    relabel: dict[int, int] = {}
    for owner in range(inst.D):
        mbs = range(owner * M, (owner + 1) * M)
        for j, mb in enumerate(sorted(mbs, key=lambda mb: (raw[(Kind.F, 0, mb)], mb))):
            relabel[mb] = owner * M + j
    times: dict[tuple[Kind, int, int], int] = {}
    hosts: dict[tuple[int, int], int] = {}
    for s in range(inst.S):
        for mb in range(inst.D * M):
            new = relabel[mb]
            hosts[(s, new)] = hint.host[s][mb]
            f = raw[(Kind.F, s, mb)]
            times[(Kind.F, s, new)] = f
            if (Kind.BW, s, mb) in raw:
                bw = raw[(Kind.BW, s, mb)]
                b, w = bw, bw + inst.duration[(Kind.B, s)]
            else:
                b, w = raw[(Kind.B, s, mb)], raw[(Kind.W, s, mb)]
                bw = b
            if Kind.BW in inst.kinds:
                times[(Kind.BW, s, new)] = bw
            else:
                times[(Kind.B, s, new)] = b
                times[(Kind.W, s, new)] = w
    return times, hosts


def _check_hint(hint: Plan, config: Config, key: tuple[int, ...]) -> None:
    check_plan_matches(hint, config.num_replicas, config.num_stages, config.num_microbatches, "the hint plan")
    canonical = canonical_failed(key)
    if hint.failed != canonical:
        raise PlanError(f"the hint plan has failed workers {sorted(hint.failed)}, but the exact solver plans the "
                        f"canonical layout of key {key} (failed {sorted(canonical)}); pass a hint made for the same "
                        "config and key (e.g. schedule_heuristic(config, key, options))")
    validate_plan(hint)


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
    scale = _scale_for(config, key)
    inst = _instance(config, key, options, scale)
    model = _PeriodModel(inst, options.staggered)
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


def _add_hint(model: _PeriodModel, hint: Plan, config: Config, key: tuple[int, ...]) -> _Hinted:
    """Check the hint, translate it to the model's terms and hint every variable from it."""
    _check_hint(hint, config, key)
    times, hosts = _hint_schedule(hint, model.inst)
    model.add_hint(times, hosts)
    return _Hinted(hint, times, hosts, model.periodic_ticks(times, hosts))


def _solve(model: _PeriodModel, time_limit_s: float, workers: int, deterministic_limit: float | None,
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
                  inst: _Instance) -> float | None:
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


def _solution_plan(inst: _Instance, solution: tuple[dict[tuple[Kind, int, int], int], dict[tuple[int, int], int]],
                   config: Config, options: PlannerOptions, meta: PlanMeta) -> Plan:
    """The validated plan of a CP-SAT solution, with its simulated period and makespan."""
    host, actions = _orders(inst, solution[1], solution[0])
    failed = canonical_failed(inst.key)
    plan = validate_plan(Plan(inst.D, inst.S, inst.M, host, actions, failed, options.staggered, meta))
    sim = simulate(plan, config)
    return plan.with_meta(predicted_period=sim.period, predicted_makespan=sim.makespan)


def _prefer_hint(hinted: _Hinted, candidate: Plan | None, candidate_ticks: float, solution, config: Config,
                 options: PlannerOptions, inst: _Instance, meta: PlanMeta, notes: list[str]):
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


def _finish(chosen: Plan, chosen_ticks: float, schedule, bound: float | None, bound_ticks: float, inst: _Instance,
            scale: TimeScale, config: Config, options: PlannerOptions, notes: list[str]) -> Plan:
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
