"""Heuristic planner: event-driven list scheduling of one iteration under priority variants; keep the best plan."""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from recycle.config import Config
from recycle.errors import PlanError
from recycle.ir.actions import Action, Kind
from recycle.ir.plan import Plan, PlanMeta
from recycle.ir.validate import validate_plan
from recycle.planner.options import PlannerOptions
from recycle.planner.bounds import period_lower_bound
from recycle.planner.local_search import OrderEvaluator, improve_orders, stage_extents
from recycle.planner.routing import (balanced_routing, check_key, failed_routing, routing_candidates,
                                    worker_loads)
from recycle.sim.simulator import action_duration, simulate

__all__ = ["Variant", "VARIANTS", "schedule_heuristic", "schedule_failed", "list_schedule", "capacity_cap", "stage_caps",
           "SIMULATE_ALL_LIMIT"]

# Up to this many actions per iteration the best candidates are simulated and the best simulated period wins; above
# it the list schedule's own period estimate decides (simulating 100k actions costs ~0.6 s each).
SIMULATE_ALL_LIMIT = 20_000
# Above this many actions only the first variants are tried, to keep the D=32, S=16, M=64 case near one second.
_LARGE_LIMIT = 50_000
_LARGE_VARIANTS = 1
# Small instances also try this many random-priority schedules (fixed seeds, so plans are reproducible): on small
# uniform cases with a failure at stage 0 about one in six of them beats every fixed rule by a slot (see
# test_zero_overhead_where_the_bubbles_can_absorb_one_failure).
RANDOM_RESTARTS = 12
_RANDOM_RESTART_LIMIT = 5_000
# How many of the best-estimated distinct schedules are simulated (the estimate is exact for a coupled optimizer and
# close for a staggered one, so a few suffice).
_SIMULATED_CANDIDATES = 4
# Instances up to this many actions per iteration that the rules leave above the lower bound get a seeded local
# search (see _search): ROUTING_SWAPS orphan swaps, each list-scheduled with the _SEARCH_RULES best rules, then
# ORDER_MOVES single-action moves. Measured on the random screen of benchmarks/bench_planner_quality.py.
SEARCH_LIMIT = 3_000
ROUTING_SWAPS = 60
_SEARCH_RULES = 3
_SEARCH_BUDGET = 150_000  # scheduled actions per routing search: tiny instances try every rule on each swap
ORDER_MOVES = 600
# Instances up to this many actions per iteration still above the lower bound after the search get a short CP-SAT
# polish warm-started from the best plan (one worker, a deterministic-time limit: reproducible). It closed every
# miss the search left on the screen (8 of 300, 2.5-3.6 %) at 0.25 deterministic seconds; bigger instances skip it,
# and so do capped ones (the analytic bound ignores caps, so they look open, and CP-SAT rarely improves them in time).
POLISH_LIMIT = 500
POLISH_DETERMINISTIC_S = 0.25
_POLISH_WALL_S = 5.0  # a safety net on a heavily loaded machine; normally the deterministic limit ends first

_F, _B, _W = 0, 1, 2  # action codes inside the scheduler (_B is a fused BW when the plan is not decoupled)


@dataclass(frozen=True)
class Variant:
    """One priority rule for the list scheduler; a ready B (input-gradient, critical path) always goes first.

    forward_first: with both an F and a W available, run the F (fill the pipeline) rather than the W (1F1B-like).
    urgent_first: among ready F's and B's, micro-batches whose path crosses the most loaded workers go first.
    soft_cap: None, or extra live micro-batches allowed over the 1F1B peak (S - s), scaled up by the worker's load;
      a tighter cap than memory requires, which keeps pipelines in lockstep and often shortens the makespan.
    by_id: order ready F's and B's by micro-batch id instead of arrival time.
    alternate: when both an F and a B are ready, run the kind the worker did not run last (1F1B's steady state),
      so an overloaded worker keeps feeding its downstream instead of bursting B's and starving it.
    own_first: among ready F's and B's, a worker's own micro-batches (owner == host) before re-routed ones, so the
      pipelines behind it start their round trips at once.
    slot_order: among ready F's and B's, the micro-batch's slot in its own pipeline (mb mod M) first: the order
      the fault-free schedule would run it, which spreads re-routed micro-batches evenly over time so the pipeline
      that lost them downstream receives them at a steady rate.
    seed: not None for a random rule (random order of ready actions, random kind among the allowed ones): random
      restarts for small instances, and varied valid plans for testing the lower bound.
    """

    name: str
    forward_first: bool = True
    urgent_first: bool = False
    soft_cap: int | None = None
    by_id: bool = False
    alternate: bool = False
    own_first: bool = False
    slot_order: bool = False
    seed: int | None = None


# The first variant is the one large instances use alone: best or tied-best in every option combination measured.
VARIANTS: tuple[Variant, ...] = (
    Variant("slot-order-alternate", alternate=True, slot_order=True),
    Variant("alternate", alternate=True),
    Variant("forward-first"),
    Variant("backward-first", forward_first=False),
    Variant("urgent-forward-first", urgent_first=True),
    Variant("urgent-backward-first", forward_first=False, urgent_first=True),
    Variant("1f1b-window", soft_cap=0),
    Variant("1f1b-window+1", soft_cap=1),
    Variant("urgent-1f1b-window", urgent_first=True, soft_cap=0),
    Variant("urgent-1f1b-window+1", urgent_first=True, soft_cap=1),
    Variant("by-id-forward-first", by_id=True),
    Variant("by-id-1f1b-window", by_id=True, soft_cap=0),
    Variant("urgent-alternate", alternate=True, urgent_first=True),
    Variant("alternate-1f1b-window+1", alternate=True, soft_cap=1),
    Variant("urgent-alternate-1f1b-window+1", alternate=True, urgent_first=True, soft_cap=1),
    Variant("own-first-alternate", alternate=True, own_first=True),
    Variant("slot-order-forward-first", slot_order=True),
    Variant("slot-order-alternate-1f1b-window+1", alternate=True, slot_order=True, soft_cap=1),
)


def capacity_cap(config: Config) -> tuple[int, ...] | None:
    """Live micro-batches per worker that fit the config's activation budget, per stage (None: unlimited)."""
    capacity = config.memory.capacity_bytes
    if capacity <= 0:
        return None
    return tuple(max(1, capacity // max(1, b)) for b in config.memory.activation_bytes)


def stage_caps(config: Config, options: PlannerOptions) -> tuple[int, ...] | None:
    """The hard activation cap per stage that plans must respect: the options' cap, else the config's budget."""
    cap = options.memory_cap if options.memory_cap is not None else capacity_cap(config)
    if cap is None:
        return None
    cap = tuple(int(c) for c in cap)
    if len(cap) != config.num_stages or any(c < 1 for c in cap):
        raise PlanError(f"memory cap {list(cap)} must give one count >= 1 per stage ({config.num_stages} stages); "
                        "every worker must be able to hold at least one micro-batch")
    return cap


@dataclass(frozen=True)
class _Timed:
    """A list schedule: per rank the (code, mb, start, end) entries in start order, and its period estimate."""

    entries: tuple[tuple[tuple[int, int, float, float], ...], ...]
    estimate: float


def list_schedule(config: Config, key: Sequence[int], host: Sequence[Sequence[int]], decoupled: bool,
                  staggered: bool, caps: Sequence[int] | None, variant: Variant) -> _Timed:
    """Schedule one iteration event by event: whenever a worker is free it starts its best ready action.

    Readiness follows the plan's dependencies (F chain forward, B chain backward with message times from the config,
    W after its B on the same worker). Live micro-batches are counted in list order from F to W (BW when fused),
    exactly as the simulator counts them, and an F is only started below the worker's cap.
    """
    D, S, M = config.num_replicas, config.num_stages, config.num_microbatches
    c = config.costs
    comm = config.communication
    p2p = [comm.p2p_time(s) for s in range(S)]
    dur = [(c.forward[s], c.backward_input[s] if decoupled else c.backward_fused[s], c.backward_weight[s])
           for s in range(S)]
    loads = worker_loads(host, D)
    total = D * M
    n_ranks = D * S

    limit = [math.inf] * n_ranks
    for p in range(D):
        for s in range(S):
            cap = math.inf if caps is None else caps[s]
            if variant.soft_cap is not None and loads[s][p]:
                window = math.ceil((S - s) * loads[s][p] / M) + variant.soft_cap
                cap = min(cap, window)
            limit[p * S + s] = cap

    # Ready F's and B's sit in heaps of tuples whose last entry is the micro-batch id.
    if variant.seed is not None:
        order_mode = 3
    elif variant.own_first:
        order_mode = 4
    elif variant.slot_order:
        order_mode = 5
    else:
        order_mode = 2 if variant.by_id else 1 if variant.urgent_first else 0
    rng = random.Random(variant.seed)

    # Urgency: the heaviest worker a micro-batch visits at or after each stage (feed the bottleneck early).
    urgency = [[0] * total for _ in range(S)]
    if order_mode == 1:
        for mb in range(total):
            worst = 0
            for s in range(S - 1, -1, -1):
                worst = max(worst, loads[s][host[s][mb]])
                urgency[s][mb] = worst

    arrivals: list[list[tuple[float, int, int, int]]] = [[] for _ in range(n_ranks)]  # (ready, seq, F or B, mb)
    ready_f: list[list[tuple]] = [[] for _ in range(n_ranks)]
    ready_b: list[list[tuple]] = [[] for _ in range(n_ranks)]
    ready_w: list[list[tuple[float, int]]] = [[] for _ in range(n_ranks)]
    busy_until = [0.0] * n_ranks
    live = [0] * n_ranks
    entries: list[list[tuple[int, int, float, float]]] = [[] for _ in range(n_ranks)]
    # Pending wake-ups, in (time, push order): a heap of distinct times and, per time, its ranks in push order.
    # Float keys compare much faster than (time, seq, rank) tuples, and the order is the same.
    times: list[float] = [0.0]
    events: dict[float, deque[int]] = {0.0: deque()}
    seq = 0

    hosted_first: list[list[int]] = [[] for _ in range(D)]  # stage 0's micro-batches per replica, in id order
    for mb, p in enumerate(host[0]):
        hosted_first[p].append(mb)
    for p in range(D):
        rank = p * S
        for mb in hosted_first[p]:
            arrivals[rank].append((0.0, seq, _F, mb))
            seq += 1
        heapq.heapify(arrivals[rank])
        events[0.0].append(rank)
        seq += 1
    forward_first = variant.forward_first
    alternate = variant.alternate
    last = [-1] * n_ranks  # the code of each worker's previous F or B
    push, pop = heapq.heappush, heapq.heappop  # local names: this loop runs once per action and idle wake-up
    stage_of = [rank % S for rank in range(n_ranks)]
    replica_of = [rank // S for rank in range(n_ranks)]
    last_stage = S - 1

    while times:
        t = times[0]
        due = events[t]
        rank = due.popleft()
        if not due:
            pop(times)
            del events[t]
        if busy_until[rank] > t:
            continue  # stale: the worker is busy; its completion event decides next
        stage = stage_of[rank]
        arr = arrivals[rank]
        rf, rb, rw = ready_f[rank], ready_b[rank], ready_w[rank]
        while arr and arr[0][0] <= t:
            ready, _, code, mb = pop(arr)  # an F or a B (W's go straight to `rw`, see below)
            if order_mode == 5:
                item: tuple = (mb % M, mb // M != replica_of[rank], ready, mb)
            elif order_mode == 0:
                item = (ready, mb)
            elif order_mode == 1:
                item = (-urgency[stage][mb], ready, mb)
            elif order_mode == 2:
                item = (mb,)
            elif order_mode == 4:
                item = (mb // M != replica_of[rank], ready, mb)  # re-routed micro-batches after the worker's own
            else:
                item = (rng.random(), mb)
            push(rf if code == _F else rb, item)
        code = -1
        can_forward = bool(rf) and live[rank] < limit[rank]
        if rb and not (alternate and can_forward and last[rank] == _B):
            code = _B
        elif can_forward and (forward_first or not rw):
            code = _F
        elif rw:
            code = _W
        if order_mode == 3:
            allowed = [k for k, ok in ((_B, rb), (_F, can_forward), (_W, rw)) if ok]
            code = rng.choice(allowed) if allowed else -1
        if code < 0:
            if arr:
                wake = arr[0][0]
                if wake in events:
                    events[wake].append(rank)
                else:
                    events[wake] = deque((rank,))
                    push(times, wake)
                seq += 1
            continue
        if code == _W:
            mb = pop(rw)[1]
            live[rank] -= 1
        else:
            mb = pop(rb if code == _B else rf)[-1]
            last[rank] = code
        end = t + dur[stage][code]
        entries[rank].append((code, mb, t, end))
        busy_until[rank] = end
        if end in events:
            events[end].append(rank)
        else:
            events[end] = deque((rank,))
            push(times, end)
        seq += 1
        if code == _F:
            live[rank] += 1
            if stage < last_stage:
                dest = host[stage + 1][mb] * S + stage + 1
                ready = end + p2p[stage]
                push(arrivals[dest], (ready, seq, _F, mb))
                if ready >= busy_until[dest]:
                    if ready in events:
                        events[ready].append(dest)
                    else:
                        events[ready] = deque((dest,))
                        push(times, ready)
                seq += 2
            else:
                push(arr, (end, seq, _B, mb))  # loss turn-around on the same worker
                seq += 1
        elif code == _B:
            if decoupled:
                # The W goes straight into the ready heap, not through the arrivals: the worker decides nothing
                # before `end` (its events until then are stale), and at `end` it would hold the same item.
                push(rw, (end, mb))
                seq += 1
            else:
                live[rank] -= 1
            if stage > 0:
                dest = host[stage - 1][mb] * S + stage - 1
                ready = end + p2p[stage - 1]
                push(arrivals[dest], (ready, seq, _B, mb))
                if ready >= busy_until[dest]:
                    if ready in events:
                        events[ready].append(dest)
                    else:
                        events[ready] = deque((dest,))
                        push(times, ready)
                seq += 2

    per_mb = 3 if decoupled else 2
    for p in range(D):
        for s in range(S):
            want = loads[s][p] * per_mb
            got = len(entries[p * S + s])
            if got != want:  # cannot happen for a cap >= 1; guard against a scheduler bug producing a bad plan
                raise PlanError(f"heuristic scheduler stalled on worker ({p},{s}): scheduled {got} of {want} actions "
                                f"(variant {variant.name}, caps {caps})")
    return _Timed(tuple(tuple(e) for e in entries), _estimate(config, key, entries, staggered))


def _opt_durations(config: Config, key: Sequence[int]) -> list[float]:
    D = config.num_replicas
    return [action_duration(config, Kind.OPT, s, D - k) for s, k in enumerate(key)]


def _estimate(config: Config, key: Sequence[int], entries: Sequence[Sequence[tuple[int, int, float, float]]],
              staggered: bool) -> float:
    """The period if every iteration repeated this one's timing (coupled: exact; staggered: an estimate)."""
    S = config.num_stages
    opt = _opt_durations(config, key)
    first, end = stage_extents(entries, S)
    if not staggered:
        return max(end) + max(opt)
    # Stage s steps after its last action and must be done before its first forward of the next iteration, which
    # comes `first[s]` after the next iteration's start.
    return max(end[s] + opt[s] - first[s] for s in range(S))


def _to_actions(config: Config, timed: _Timed, host: Sequence[Sequence[int]], decoupled: bool,
                merge: bool) -> tuple[tuple[Action, ...], ...]:
    """Turn a list schedule into per-worker action lists; with `merge`, fuse B;W pairs that gain nothing split.

    A B immediately followed by its own W is fused into one BW when the fused kernel is no slower and the
    input-gradient's consumer upstream started late enough not to notice the later send (always at stage 0, whose
    input-gradient goes nowhere). Fused backward is what the paper uses wherever decoupling does not help.
    """
    S = config.num_stages
    TM = config.num_replicas * config.num_microbatches
    c = config.costs
    p2p = [config.communication.p2p_time(s) for s in range(S)]
    b_start: list[float] = []  # [s * TM + mb]: when B of mb started at stage s
    if merge and decoupled:
        b_start = [0.0] * (S * TM)
        for rank, row in enumerate(timed.entries):
            base = rank % S * TM
            for code, mb, start, _ in row:
                if code == _B:
                    b_start[base + mb] = start
    kinds = (Kind.F, Kind.B if decoupled else Kind.BW, Kind.W)
    new = _new_action
    out = []
    for rank, row in enumerate(timed.entries):
        if not row:
            out.append(())
            continue
        s = rank % S
        acts: list[Action] = []
        append = acts.append
        fused_ok = merge and decoupled and c.backward_fused[s] <= c.backward_input[s] + c.backward_weight[s]
        if not fused_ok:
            for code, mb, _, _ in row:
                append(new(kinds[code], s, mb))
        else:
            fused = c.backward_fused[s]
            upstream = (s - 1) * TM
            message = p2p[s - 1] if s else 0.0
            last = len(row) - 1
            i = 0
            while i <= last:
                code, mb, start, _ = row[i]
                if code == _B and i < last:
                    following = row[i + 1]
                    if (following[0] == _W and following[1] == mb
                            and (s == 0 or b_start[upstream + mb] >= start + fused + message)):
                        append(new(Kind.BW, s, mb))
                        i += 2
                        continue
                append(new(kinds[code], s, mb))
                i += 1
        append(Action(Kind.OPT, s))
        out.append(tuple(acts))
    return tuple(out)


_NEW = object.__new__
_SET_KIND, _SET_STAGE, _SET_MB = Action.kind.__set__, Action.stage.__set__, Action.mb.__set__  # type: ignore[attr-defined]


def _new_action(kind: Kind, stage: int, mb: int) -> Action:
    """Action(kind, stage, mb) without the frozen dataclass's __init__ (it sets each slot through
    object.__setattr__): about twice as fast, which matters for the ~400k actions of a 1,024-worker plan."""
    action = _NEW(Action)
    _SET_KIND(action, kind)
    _SET_STAGE(action, stage)
    _SET_MB(action, mb)
    return action


def schedule_heuristic(config: Config, key: Sequence[int], options: PlannerOptions = PlannerOptions(),
                       variants: Sequence[Variant] = VARIANTS) -> Plan:
    """A validated plan for the canonical layout of `key` (failed = replicas 0..k_s-1 of stage s).

    Every variant (plus, for small instances, RANDOM_RESTARTS random-priority ones) is list-scheduled on each
    routing candidate and ranked by its own period estimate. With `options.search` (the default), small instances
    whose best estimate is above the analytic lower bound are then improved by a seeded local search (`_search`:
    orphan swaps between survivors, then moves in the per-worker orders). The best few distinct schedules (with
    and without B/W fusion) are simulated and the best simulated period wins (ties: lower peak activations, then
    the earlier candidate). With `options.search`, instances up to POLISH_LIMIT actions still above the bound get a
    short CP-SAT polish (`_polish`). Very large instances skip the simulation and take the best estimate.
    meta.notes names the winning variant.
    """
    key = check_key(config, key)
    failed = frozenset((c, s) for s, k in enumerate(key) for c in range(k))
    small = (3 if options.decoupled else 2) * config.num_replicas * config.num_microbatches * config.num_stages \
        <= _RANDOM_RESTART_LIMIT
    routings = routing_candidates(config, key) if small else (balanced_routing(config, key),)
    return _schedule(config, key, failed, routings, options, variants, canonical=True)


def schedule_failed(config: Config, failed: Iterable[tuple[int, int]], options: PlannerOptions = PlannerOptions(),
                    variants: Sequence[Variant] = VARIANTS) -> Plan:
    """A validated plan on the real ranks of a failure set, routed by `failed_routing` (only the failed workers'
    micro-batches leave their pipeline); the same rules and search as `schedule_heuristic`, without the CP-SAT
    polish (the exact model plans canonical layouts only)."""
    failed = frozenset(failed)
    D, S = config.num_replicas, config.num_stages
    key = check_key(config, [sum(1 for p, st in failed if st == s) for s in range(S)])
    if any(not (0 <= p < D and 0 <= s < S) for p, s in failed):
        raise PlanError(f"failed workers {sorted(failed)} lie outside the {D}x{S} topology")
    small = (3 if options.decoupled else 2) * D * config.num_microbatches * S <= _RANDOM_RESTART_LIMIT
    first = failed_routing(config, failed)
    second = failed_routing(config, failed, slot_major=True) if small else first
    routings = (first,) if second == first else (first, second)
    return _schedule(config, key, failed, routings, options, variants, canonical=False)


def _schedule(config: Config, key: tuple[int, ...], failed: frozenset[tuple[int, int]],
              routings: Sequence[tuple[tuple[int, ...], ...]], options: PlannerOptions, variants: Sequence[Variant],
              canonical: bool) -> Plan:
    """schedule_heuristic's body for any failure set and routing candidates (see there)."""
    D, S, M = config.num_replicas, config.num_stages, config.num_microbatches
    caps = stage_caps(config, options)
    per_iteration = (3 if options.decoupled else 2) * D * M * S
    if per_iteration > _LARGE_LIMIT:
        variants = variants[:_LARGE_VARIANTS]
    elif per_iteration <= _RANDOM_RESTART_LIMIT and variants is VARIANTS:
        variants = (*variants, *(Variant(f"random-{seed}", seed=seed) for seed in range(RANDOM_RESTARTS)))
    simulate_top = _SIMULATED_CANDIDATES if per_iteration <= SIMULATE_ALL_LIMIT else 0
    fingerprint = config.fingerprint()

    ranked: list[_Candidate] = []
    seen: set[int] = set()
    for r, host in enumerate(routings):
        for order, variant in enumerate(variants):
            if r and variant.seed is not None:
                continue  # random restarts only on the first routing
            timed = list_schedule(config, key, host, options.decoupled, options.staggered, caps, variant)
            if len(variants) * len(routings) == 1:  # nothing to de-duplicate (large instances: skip the hash)
                ranked.append(_Candidate(timed.estimate, 0, variant.name, host, timed))
                continue
            signature = hash((timed.entries, host))
            if signature not in seen:  # several rules often produce the same schedule
                seen.add(signature)
                ranked.append(_Candidate(timed.estimate, len(ranked), variant.name, host, timed))
    if not ranked:
        raise PlanError("schedule_heuristic needs at least one variant")
    ranked.sort(key=lambda c: (c.estimate, c.order))
    search = options.search and per_iteration <= SEARCH_LIMIT
    bound = period_lower_bound(config, key, options) if search else math.inf
    if search:
        if ranked[0].estimate > bound * (1 + 1e-9):
            found = _search(config, key, failed, options, caps, ranked, variants, bound)
            ranked = sorted([*found, *ranked], key=lambda c: (c.estimate, c.order))

    def build(candidate: _Candidate, merge: bool) -> Plan:
        actions = _to_actions(config, candidate.timed, candidate.host, options.decoupled, merge)
        return Plan(D, S, M, candidate.host, actions, failed, options.staggered, PlanMeta(
            schedule="adaptive", decoupled=options.decoupled, failure_key=key, solver="heuristic",
            status="HEURISTIC", memory_cap=caps or (), config_fingerprint=fingerprint,
            notes=f"heuristic variant {candidate.name}{'' if merge else ' (no B/W fusion)'}"))

    if simulate_top == 0:
        # Not re-validated: the list schedule that produced it already executed exactly these dependencies and
        # counts (it raises on a stall), and _to_actions only fuses adjacent B;W pairs; validate_plan would add
        # ~40 % at D=64, S=16, M=128. tests/unit/test_planner_heuristic.py validates plans from this path.
        return build(ranked[0], merge=True)
    best: tuple[tuple, Plan] | None = None
    for candidate in ranked[:simulate_top]:
        for merge in ((True, False) if options.decoupled else (True,)):
            plan = build(candidate, merge)
            result = simulate(plan, config)
            score = (result.period, max(result.peak_activations), candidate.order, not merge)
            if best is None or score < best[0]:
                best = (score, plan.with_meta(predicted_period=result.period, predicted_makespan=result.makespan))
    assert best is not None
    chosen = validate_plan(best[1])
    if search and canonical and caps is None and per_iteration <= POLISH_LIMIT and best[0][0] > bound * (1 + 1e-9):
        chosen = _polish(config, key, options, chosen)
    return chosen


def _polish(config: Config, key: tuple[int, ...], options: PlannerOptions, plan: Plan) -> Plan:
    """CP-SAT warm-started from `plan` for POLISH_DETERMINISTIC_S deterministic seconds on one worker; the better
    of the two by simulated period (the plan keeps solver "heuristic"; the notes say the polish won)."""
    from recycle.planner.exact import schedule_exact  # lazily: OR-Tools loads only for small plans that get polished

    polished = schedule_exact(config, key, options, _POLISH_WALL_S, hint=plan, workers=1,
                              deterministic_limit=POLISH_DETERMINISTIC_S)
    assert plan.meta.predicted_period is not None and polished.meta.predicted_period is not None
    if polished.meta.predicted_period >= plan.meta.predicted_period:
        return plan
    return replace(polished, meta=replace(plan.meta, predicted_period=polished.meta.predicted_period,
                                          predicted_makespan=polished.meta.predicted_makespan,
                                          notes=f"{plan.meta.notes} + CP-SAT polish ({POLISH_DETERMINISTIC_S:g} "
                                                "deterministic s)"))


@dataclass(frozen=True)
class _Candidate:
    """A ranked list schedule: its estimate, a tie-breaking order, the rule that made it and its routing."""

    estimate: float
    order: int
    name: str
    host: tuple[tuple[int, ...], ...]
    timed: _Timed


def _search(config: Config, key: tuple[int, ...], failed: frozenset[tuple[int, int]], options: PlannerOptions,
            caps: Sequence[int] | None, ranked: Sequence[_Candidate], variants: Sequence[Variant],
            bound: float) -> list[_Candidate]:
    """Seeded local search from the best candidates; returns the improved candidates (possibly none).

    1. Routing: swap the hosts of two orphans of one stage, or move an orphan from a survivor with the higher load
       to one with the lower (loads stay balanced), and list-schedule the change with the rules of the best
       candidates; keep changes that do not worsen the best estimate. The issue's misses
       (unequal F/B/W costs) were all routings where a survivor received the same slot of several lost pipelines.
    2. Orders: `improve_orders` moves single actions within a worker's order, timed as soon as possible.
    Both stop at the analytic lower bound.
    """
    rng = random.Random(0)
    by_name = {v.name: v for v in variants}
    per_iteration = (3 if options.decoupled else 2) * config.num_replicas * config.num_microbatches * config.num_stages
    want = max(_SEARCH_RULES, _SEARCH_BUDGET // (ROUTING_SWAPS * per_iteration))
    rules: list[Variant] = []
    for candidate in ranked:  # the rules in the order of their best schedule
        variant = by_name.get(candidate.name)
        if variant is not None and variant not in rules:
            rules.append(variant)
        if len(rules) == want:
            break
    best = ranked[0]
    host = [list(row) for row in best.host]
    M, D = config.num_microbatches, config.num_replicas
    orphans = [[mb for mb in range(D * M) if (mb // M, s) in failed] for s in range(config.num_stages)]
    live = [[p for p in range(D) if (p, s) not in failed] for s in range(config.num_stages)]
    orphan_stages = [s for s, k in enumerate(key) if k > 0]
    found: list[_Candidate] = []
    for _ in range(ROUTING_SWAPS):
        if best.estimate <= bound * (1 + 1e-9) or not orphan_stages:
            break
        s = rng.choice(orphan_stages)
        a = rng.choice(orphans[s])
        old = host[s][a]
        if rng.random() < 0.5:  # swap two orphans' hosts
            b = rng.choice(orphans[s])
            if host[s][a] == host[s][b]:
                continue
            host[s][a], host[s][b] = host[s][b], host[s][a]
        else:  # move an orphan from a survivor with the higher load to one with the lower (still balanced)
            loads = [host[s].count(p) for p in range(D)]
            lighter = [p for p in live[s] if loads[p] < loads[old]]
            if not lighter:
                continue
            b = -1
            host[s][a] = rng.choice(lighter)
        trial = tuple(tuple(row) for row in host)
        improved = None
        for variant in rules:
            timed = list_schedule(config, key, trial, options.decoupled, options.staggered, caps, variant)
            if timed.estimate <= best.estimate and (improved is None or timed.estimate < improved.estimate):
                improved = _Candidate(timed.estimate, -1, f"{variant.name} + orphan swaps", trial, timed)
        if improved is None:
            if b >= 0:
                host[s][a], host[s][b] = host[s][b], host[s][a]
            else:
                host[s][a] = old
            continue
        if improved.estimate < best.estimate:
            found.append(improved)
        best = improved
    if best is not ranked[0] and not found:
        found.append(best)
    if best.estimate > bound * (1 + 1e-9):
        evaluator = OrderEvaluator(config, key, best.host, options.decoupled, options.staggered, caps,
                                   _opt_durations(config, key))
        entries, score = improve_orders(evaluator, best.timed.entries, ORDER_MOVES, seed=0, target=bound)
        if score[0] < best.estimate:
            timed = _Timed(tuple(tuple(row) for row in entries), score[0])
            found.append(_Candidate(score[0], -1, f"{best.name} + order moves", best.host, timed))
    # Search results rank ahead of equal-estimate rule schedules (they are at least as good on the estimate).
    return [replace(c, order=-len(found) + i) for i, c in enumerate(found)]
