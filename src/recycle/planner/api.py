"""Public planner API: resolve memory caps, plan a failure key (cached) or a real failure set, fault-free period."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

from recycle.collector import collector_paused
from recycle.config import Config
from recycle.errors import PlanError
from recycle.ir.compact import CompactActions
from recycle.ir.plan import Plan
from recycle.planner.bounds import period_lower_bound
from recycle.planner.failures import canonical_failed, normalize
from recycle.planner.heuristic import (RANKING_ENDED, clear_schedules, schedule_failed, schedule_heuristic,
                                       simulated_timing)
from recycle.planner.memory_cap import memory_cap, resolve_memory_cap
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import check_key, traffic
from recycle.planner.settling import settling
from recycle.sim.simulator import simulate

__all__ = ["SOLVERS", "ROUTINGS", "resolve_memory_cap", "resolve_options", "plan_for_key", "period_plan_for_key",
           "plan_for_failed", "make_plan", "fault_free_period", "baseline_1f1b_period", "clear_cache"]

SOLVERS = ("heuristic", "exact")
_CACHE: dict[tuple, Plan] = {}
_CACHE_LIMIT = 512  # plans kept in-process; a D=6, S=4, f=3 store is 35
# ... and the workers of the plans kept, at most: a 16,384-worker plan takes ~30 MB, and a coordinator whose failed
# set grows node by node (a rack going down) plans each state beyond its library online: 512 of them were 15 GB.
_CACHE_WORKERS = 65_536


def resolve_options(config: Config, options: PlannerOptions) -> PlannerOptions:
    """The options with the memory cap made explicit (the config's budget when the options leave it open)."""
    return replace(options, memory_cap=memory_cap(config, options))


def _period_makespan(plan: Plan, config: Config) -> tuple[float, float, str]:
    """simulate(plan, config)'s period and makespan, and a note when the plan does not settle to a one-iteration
    period (the period is then the mean over whole cycles: `recycle.planner.settling`); for a large heuristic plan
    (CompactActions) read straight from its arrays by `recycle.sim.levels.time_compact` (the same floats), so no
    Action object is built."""
    if isinstance(plan.actions, CompactActions):
        from recycle.sim.levels import time_compact  # numpy: only for large plans

        timing = time_compact(config, plan.actions, plan.failed, plan.staggered)
        if timing is not None:
            return (*timing, "")
    result = simulate(plan, config)
    settled = settling(result)
    return settled.period, result.makespan, settled.note(result.period)


def _split(plan: Plan, config: Config, options: PlannerOptions) -> Plan:
    """The split plan (recycle.planner.split) when it is strictly faster than `plan`, else `plan` with a note; a
    split plan's lower bound is the bound for pieces down to one sample."""
    from recycle.planner.split import choose_split

    key = plan.meta.failure_key or normalize(plan.failed, config.num_replicas, config.num_stages).key
    return choose_split(plan, config, lambda candidate: _period_makespan(candidate, config),
                        period_lower_bound(config, key, options))


def _with_note(notes: str, note: str) -> str:
    return f"{notes}; {note}" if note else notes


def clear_cache() -> None:
    """Forget the plans (and the rule schedules behind them) cached in this process (tests and benchmarks use it
    to time cold planning)."""
    _CACHE.clear()
    clear_schedules()


def _schedule_exact(config: Config, key: tuple[int, ...], options: PlannerOptions, time_limit_s: float,
                    hint: Plan) -> Plan:
    from recycle.planner.exact import schedule_exact  # lazily: OR-Tools' import costs ~1 s

    return schedule_exact(config, key, options, time_limit_s, hint=hint)


@collector_paused()  # a 1,024-worker plan: millions of small tuples and actions, no cycles: ~15 % in collections
def plan_for_key(config: Config, key: Sequence[int], options: PlannerOptions = PlannerOptions(),
                 solver: str = "heuristic", time_limit_s: float = 10.0) -> Plan:
    """The canonical-layout plan for `key`, its meta filled with the simulator's numbers and the lower bound.

    solver="exact" runs the CP-SAT model warm-started from the heuristic plan and keeps whichever of the two has
    the better simulated period. Results are cached per (config fingerprint, key, options, solver, time limit).
    """
    if solver not in SOLVERS:
        raise PlanError(f"solver {solver!r} is unknown; choose one of {list(SOLVERS)}")
    if time_limit_s <= 0:
        raise PlanError(f"time limit {time_limit_s} s must be positive; pass e.g. --time-limit 10")
    key = check_key(config, key)
    options = resolve_options(config, options)
    cache_key = (config.fingerprint(), key, options, solver, float(time_limit_s) if solver == "exact" else 0.0)
    cached = _CACHE.get(cache_key)
    if cached is not None:
        return cached
    if options.split_microbatches:
        whole = plan_for_key(config, key, replace(options, split_microbatches=False), solver, time_limit_s)
        return _remember(cache_key, _split(whole, config, options))
    if config.topology.chunks_per_worker > 1:
        return _remember(cache_key, _chunked(config, canonical_failed(key), options, solver))

    plan = schedule_heuristic(config, key, options)
    period, makespan, settling_note = _period_makespan(plan, config)
    notes = _with_note(plan.meta.notes, settling_note)
    lower_bound = period_lower_bound(config, key, options)
    if solver == "exact":
        exact = _schedule_exact(config, key, options, time_limit_s, plan)
        exact_period, exact_makespan, exact_note = _period_makespan(exact, config)
        if exact_period <= period:
            plan, period, makespan = exact, exact_period, exact_makespan
            notes = _with_note(exact.meta.notes or f"exact solver (status {exact.meta.status})", exact_note)
        else:
            notes = (f"{notes}; exact solver returned period {exact_period:g} (status "
                     f"{exact.meta.status}), worse than the heuristic's {period:g}, so the heuristic plan "
                     "was kept")
        theirs = exact.meta.lower_bound
        if theirs is not None and theirs <= period + 1e-9:  # only a bound on this same simulated period
            lower_bound = max(lower_bound, theirs)
    plan = _key_meta(plan, config, key, options, solver, period, makespan, lower_bound, notes)
    _remember(cache_key, plan)
    return plan


def _key_meta(plan: Plan, config: Config, key: tuple[int, ...], options: PlannerOptions, solver: str, period: float,
              makespan: float, lower_bound: float, notes: str) -> Plan:
    """plan_for_key's meta: the simulated figures, the bound, the options' caps and the config's fingerprint."""
    if period < lower_bound <= period * (1 + 1e-9):
        lower_bound = period  # the same sum added in another order: float noise, not a broken bound
    return plan.with_meta(
        schedule="adaptive", decoupled=options.decoupled, failure_key=key,
        solver=plan.meta.solver or solver, status=plan.meta.status or "FEASIBLE",
        predicted_period=period, predicted_makespan=makespan, lower_bound=lower_bound,
        memory_cap=options.memory_cap or (), config_fingerprint=config.fingerprint(), notes=notes,
    )


@collector_paused()
def period_plan_for_key(config: Config, key: Sequence[int], options: PlannerOptions = PlannerOptions()) -> Plan:
    """A heuristic plan for `key` with `plan_for_key(config, key, options)`'s simulated period, made at less cost
    where it can be: `schedule_heuristic(..., period_only=True)` ends as soon as a schedule it is sure to pick
    reaches the lower bound (the plan may then be another one of the same period). For callers that use only the
    period: trace replays (issue 27). Cached like plan_for_key; a plan_for_key result already cached serves."""
    key = check_key(config, key)
    options = resolve_options(config, options)
    full_key = (config.fingerprint(), key, options, "heuristic", 0.0)
    cache_key = (config.fingerprint(), key, options, "period-only")
    cached = _CACHE.get(full_key) or _CACHE.get(cache_key)
    if cached is not None:
        return cached
    if options.split_microbatches:  # the whole plan's period-only path, then the split as plan_for_key tries it
        whole = period_plan_for_key(config, key, replace(options, split_microbatches=False))
        return _remember(cache_key, _split(whole, config, options) if any(key) else whole)
    # A plan that ended while its rules were ranked never reached the search: the same plan with or without it (a
    # replay plans a key with the search for ReCycle, then without it for ReCycle+'s screen of the configured
    # layout, and a screened partition again with it for the polish).
    other = _CACHE.get((config.fingerprint(), key, replace(options, search=not options.search), "period-only"))
    if other is not None and RANKING_ENDED in other.meta.notes:
        return _remember(cache_key, other)
    plan = schedule_heuristic(config, key, options, period_only=True)
    # The heuristic simulated the plan it returns (it ranks candidates by simulated period): not again.
    period, makespan, settling_note = simulated_timing(plan) or _period_makespan(plan, config)
    plan = _key_meta(plan, config, key, options, "heuristic", period, makespan,
                     period_lower_bound(config, key, options), _with_note(plan.meta.notes, settling_note))
    _remember(cache_key, plan)
    return plan


def _remember(cache_key: tuple, plan: Plan) -> Plan:
    """Keep `plan` under `cache_key`, forgetting the oldest plans beyond _CACHE_LIMIT plans or _CACHE_WORKERS
    workers in all (the newest is kept whatever its size)."""
    _CACHE.pop(cache_key, None)
    _CACHE[cache_key] = plan
    workers = sum(p.num_workers for p in _CACHE.values())
    while len(_CACHE) > 1 and (len(_CACHE) > _CACHE_LIMIT or workers > _CACHE_WORKERS):
        workers -= _CACHE.pop(next(iter(_CACHE))).num_workers  # oldest first
    return plan


def _chunked(config: Config, failed: frozenset[tuple[int, int]], options: PlannerOptions, solver: str) -> Plan:
    """The chunked planner's plan (several virtual stages per worker) on these failed ranks; only the heuristic
    knows chunks (the CP-SAT model has one stage per worker)."""
    if solver != "heuristic":
        raise PlanError(f"solver {solver!r} plans one stage per worker, but [topology] chunks_per_worker = "
                        f"{config.topology.chunks_per_worker}; use --solver heuristic (the chunked list scheduler) "
                        "or set chunks_per_worker = 1")
    from recycle.planner.chunked import schedule_chunked

    return schedule_chunked(config, failed, options)


ROUTINGS = ("traffic", "canonical")


def make_plan(config: Config, failed: Iterable[tuple[int, int]] = (), options: PlannerOptions = PlannerOptions(),
              solver: str = "heuristic", time_limit_s: float = 10.0, routing: str = "traffic") -> Plan:
    """A plan on the real ranks for a set of failed (replica, stage) workers.

    When one relabelling of pipelines maps the failures onto the canonical layout of their key (nested failed
    sets: one failure, several in one stage or one pipeline), the key's canonical plan is renamed onto the real
    ranks: only the failed workers' micro-batches leave their pipeline. Otherwise, with routing="traffic" (the
    default) and the heuristic solver, the real layout is planned directly (`schedule_failed`), which again moves
    only the failed workers' micro-batches; routing="canonical" (and the exact solver, whose model is canonical)
    relabels the key's plan per stage instead, which moves healthy micro-batches through other pipelines' workers
    (see `recycle.planner.routing.traffic`) and is often as fast, sometimes faster.

    The traffic-aware plan is returned only when it is as fast as the canonical one: where the canonical plan
    relabelled per stage has a lower simulated period, that plan is returned instead, and its
    meta.routing_fallback says so and why (a traffic-aware plan at the lower bound skips the comparison).
    """
    if routing not in ROUTINGS:
        raise PlanError(f"routing {routing!r} is unknown; choose one of {list(ROUTINGS)}")
    state = normalize(failed, config.num_replicas, config.num_stages)
    if config.topology.chunks_per_worker > 1:
        # Chunked plans are made on the real ranks directly (only the failed workers' micro-batches move).
        options = resolve_options(config, options)
        cache_key = (config.fingerprint(), "chunked", state.failed, options, solver)
        cached = _CACHE.get(cache_key)
        return cached if cached is not None else _remember(cache_key, _chunked(config, state.failed, options, solver))
    if state.symmetric or routing == "canonical" or solver != "heuristic":
        return state.to_real(plan_for_key(config, state.key, options, solver, time_limit_s))
    planned = plan_for_failed(config, state.failed, options)
    period, bound = planned.meta.predicted_period, planned.meta.lower_bound
    assert period is not None
    if bound is not None and period <= bound * (1 + 1e-9):
        return planned  # no plan is faster
    canonical = state.to_real(plan_for_key(config, state.key, options))
    faster = canonical.meta.predicted_period
    assert faster is not None
    if faster >= period * (1 - 1e-9):
        return planned
    moved = traffic(canonical.host, config.num_microbatches, canonical.failed)["moved_healthy"]
    reason = (f"canonical routing: period {faster:g} beats the traffic-aware plan's {period:g} "
              f"({100 * (period - faster) / faster:.1f} % slower), at the price of moving {moved} healthy "
              "(stage, micro-batch) pairs off their pipeline")
    return canonical.with_meta(routing_fallback=reason,
                               notes=f"{canonical.meta.notes}; canonical routing: faster than traffic-aware")


@collector_paused()
def plan_for_failed(config: Config, failed: frozenset[tuple[int, int]],
                    options: PlannerOptions = PlannerOptions()) -> Plan:
    """The traffic-aware heuristic plan on the real ranks of `failed`, meta filled like plan_for_key's (cached)."""
    options = resolve_options(config, options)
    fingerprint = config.fingerprint()
    cache_key = (fingerprint, "failed", frozenset(failed), options)
    cached = _CACHE.get(cache_key)
    if cached is not None:
        return cached
    if options.split_microbatches:
        whole = plan_for_failed(config, failed, replace(options, split_microbatches=False))
        return _remember(cache_key, _split(whole, config, options))
    if config.topology.chunks_per_worker > 1:  # the chunked list scheduler plans real ranks itself
        return _remember(cache_key, _chunked(config, frozenset(failed), options, "heuristic"))
    plan = schedule_failed(config, failed, options)
    key = plan.meta.failure_key
    period, makespan, settling_note = _period_makespan(plan, config)
    lower_bound = period_lower_bound(config, key, options)
    if period < lower_bound <= period * (1 + 1e-9):
        lower_bound = period
    plan = plan.with_meta(predicted_period=period, predicted_makespan=makespan,
                          lower_bound=lower_bound, memory_cap=options.memory_cap or (),
                          notes=_with_note(f"{plan.meta.notes}; traffic-aware routing on the real ranks",
                                           settling_note))
    return _remember(cache_key, plan)


def fault_free_period(config: Config, options: PlannerOptions = PlannerOptions()) -> float:
    """The simulated period of the planner's own plan for key (0, ..., 0) under the same options and cap."""
    period = plan_for_key(config, (0,) * config.num_stages, options).meta.predicted_period
    assert period is not None
    return period


def baseline_1f1b_period(config: Config, options: PlannerOptions = PlannerOptions()) -> float:
    """The simulated period of plain fault-free 1F1B (fused backward): the reference the paper's overheads use."""
    from recycle.schedules.fault_free import build_schedule

    config = config.one_chunk()  # the paper's reference has one stage per worker, whatever the config's chunks
    return simulate(build_schedule(config, "1f1b", staggered=options.staggered), config).period
