"""Heuristic planner: event-driven list scheduling of one iteration under priority variants; keep the best plan."""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, replace
from enum import Enum
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from recycle.config import Config
from recycle.errors import PlanError
from recycle.ir.actions import Action, Kind
from recycle.ir.compact import CompactActions, new_action
from recycle.ir.costs import action_duration
from recycle.ir.dependencies import output_stage_table
from recycle.ir.plan import Plan, PlanMeta
from recycle.ir.validate import validate_plan
from recycle.planner.bounds import period_lower_bound
from recycle.planner.budget import LIST_SCHEDULE_COST, WorkBudget, search_work
from recycle.planner.deadline import improve_sequences
from recycle.planner.failures import canonical_failed
from recycle.planner.local_search import OrderEvaluator, improve_orders, stage_extents
from recycle.planner.memory_cap import memory_cap
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import balanced_routing, check_key, failed_routing, routing_candidates, worker_loads
from recycle.planner.settling import settling
from recycle.sim.simulator import simulate

if TYPE_CHECKING:  # numpy loads only when a large plan is scheduled (CLI start-up, small plans)
    from recycle.planner.vector_schedule import CompactSchedule

__all__ = ["Variant", "VARIANTS", "Order", "order_of", "schedule_heuristic", "schedule_failed", "list_schedule",
           "clear_schedules", "SIMULATE_ALL_LIMIT", "VECTOR_MIN_ACTIONS", "RANKING_ENDED",
           "simulated_timing"]

# Up to this many actions per iteration the best candidates are simulated and the best simulated period wins; above
# it the list schedule's own period estimate decides (simulating 100k actions costs ~0.6 s each).
SIMULATE_ALL_LIMIT = 20_000
# Above this many actions only the first variants are tried, to keep the D=32, S=16, M=64 case near one second.
_LARGE_LIMIT = 50_000
_LARGE_VARIANTS = 1
# Small instances also try this many random-priority schedules (fixed seeds, so plans are reproducible): on small
# uniform cases with a failure at stage 0 about one in six of them beats every fixed rule by a slot (see
# test_zero_overhead_where_the_bubbles_can_absorb_one_failure). Measured again with the search (issue 26): 6 gave
# the same gaps on the F != B != W screen but lost issue 10's screen case 274 (41 -> 42, the optimum is 40).
RANDOM_RESTARTS = 12
_RANDOM_RESTART_LIMIT = 5_000
# How many of the best-estimated distinct schedules are simulated (the estimate is exact for a coupled optimizer and
# close for a staggered one, so a few suffice: 2 and 4 gave the same gaps on the F != B != W screen, 450 cases).
_SIMULATED_CANDIDATES = 2
# Instances up to this many actions per iteration that the rules leave above the lower bound get a seeded local
# search (see _search): orphan swaps between survivors, each list-scheduled with the best rules, then single-action
# moves in the workers' orders. Its work is bounded by a budget in evaluated actions that grows with the plan
# (recycle.planner.budget.search_work), never by a clock, so a plan does not depend on the machine's load;
# ROUTING_SHARE of it goes to the orphan swaps (what they leave unspent goes to the order moves).
SEARCH_LIMIT = 3_000
ROUTING_SHARE = 0.5
_SEARCH_RULES = 3  # rules per orphan swap; tiny instances try more while a swap's share of the budget allows
_ROUTING_SWAPS = 60  # the swaps the rule count is planned for
ORDER_STARTS = 3  # order searches from this many distinct routings, sharing the order moves' budget
# The order start (0-based) whose share goes to deadline list schedules (recycle.planner.deadline) instead of order
# moves: the third, a rule schedule's routing (issue 26, seed 1 case 283: 80 -> 79, the proved optimum 78; on the
# first or second start they took the budget case 6's order moves need, 59 -> 60).
DEADLINE_START = 2

# From this many actions per iteration, deterministic rules on whole-unit costs are stepped in numpy (see
# recycle.planner.vector_schedule.vector_eligible); below it numpy's per-call cost outweighs what it saves.
VECTOR_MIN_ACTIONS = 4_000

# The note of a period_only plan that ended while the rules were ranked: made before the search would start, so
# the same plan whatever options.search says (planner.api.period_plan_for_key serves it for both).
RANKING_ENDED = "the rules after the first schedules estimated at the lower bound not tried (period_only)"

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
    wait_for_backward: an F that would delay a B already on its way to this worker (its message arrives before
      the F would end) waits for it: the worker runs a W that fits before the B, or idles. Not work-conserving,
      which no other rule can express (issue 26: optima idle a stage briefly to return the gradient sooner).
    wait_strict: wait_for_backward, and a W that would delay a B on its way waits too (a W has no consumer and
      can run later), and a worker about to start an F lets the other workers due at the same instant decide
      first (a B one of them starts then is on its way as well). Closes issue 26's screen case 15 (32 -> the
      optimum 31), where the plain rule started an F at the instant the downstream worker started the B.
    first_stage_forward: at the first stage, a ready F runs before a ready B (that B sends nothing: its input
      gradient has no consumer), so a first-stage worker feeds the pipeline as long as it may start an F.
    bottleneck_forward: on the workers with the most work per iteration (load times F + B + W), a ready F runs
      before a ready B: the bottleneck keeps a queue of returning B's, so it never idles once its last F is out,
      and the B's it has left cover that F's round trip (issue 26's seed 1 case 212: 75 -> the bound 73).
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
    wait_for_backward: bool = False
    wait_strict: bool = False
    first_stage_forward: bool = False
    bottleneck_forward: bool = False


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
# Rules small instances also try when the other rules and the search leave them above the lower bound: the two
# slot-order rules, waiting for a backward on its way. Of six waiting rules (the first five and
# slot-order-forward-first), only these two won a plan on the F != B != W screen (4 of 450 cases), so the others
# were dropped: each costs a list schedule per routing. Then two strict ones (`wait_strict`): they close seed 0
# case 15 of that screen (32 -> the proved 31), bring case 123 from 36 to 35 and open no miss on its 450 cases.
WAITING_VARIANTS: tuple[Variant, ...] = (
    *(replace(v, name=f"{v.name}-wait-for-backward", wait_for_backward=True) for v in (VARIANTS[0], VARIANTS[16])),
    *(replace(v, name=f"{v.name}-wait-strict", wait_strict=True) for v in (VARIANTS[0], VARIANTS[1])),
)

# Small instances also try these rules (after the random restarts, so they win only where they are strictly
# better). The first stage's B has no consumer (its input gradient goes nowhere), so there a ready F runs before
# it: the worker feeds the pipeline while it can and its B's fill the time the last F's round trip takes. CP-SAT's
# proved optimum of issue 26's seed 1 case 6 (non-nested, fused, coupled: 59) runs every busiest first-stage worker
# that way; the other rules stop at 61-64 there, this one reaches 60 (+1.7 %). The second rule does the same on
# the workers with the most work: seed 1 case 212 (staggered, the one live stage-1 worker hosts all 9 micro-batches)
# goes from 75 to the proved 73, the bound, with every base rule given the flag.
FIRST_STAGE_VARIANTS: tuple[Variant, ...] = (
    Variant("slot-order-alternate-first-stage-forward", alternate=True, slot_order=True, first_stage_forward=True),
    Variant("slot-order-alternate-bottleneck-forward", alternate=True, slot_order=True, bottleneck_forward=True),
)


class Order(Enum):
    """How a worker orders its ready F's and B's: the heap key of each item (the micro-batch id breaks ties)."""

    ARRIVAL = "arrival"  # (ready time, mb)
    URGENT = "urgent"  # (-urgency, ready time, mb): micro-batches bound for the most loaded workers first
    BY_ID = "by-id"  # (mb,)
    RANDOM = "random"  # (a seeded random number, mb)
    OWN_FIRST = "own-first"  # (re-routed, ready time, mb): the worker's own micro-batches first
    SLOT = "slot"  # (mb mod M, re-routed, ready time, mb): the fault-free schedule's order


def order_of(variant: Variant) -> Order:
    """The ready-item order a variant's flags select (the first that applies: seed, own_first, slot_order,
    by_id, urgent_first)."""
    if variant.seed is not None:
        return Order.RANDOM
    if variant.own_first:
        return Order.OWN_FIRST
    if variant.slot_order:
        return Order.SLOT
    if variant.by_id:
        return Order.BY_ID
    return Order.URGENT if variant.urgent_first else Order.ARRIVAL


@dataclass(frozen=True, eq=False)
class _Timed:
    """A list schedule and its period estimate: per rank the (code, mb, start, end) entries in start order
    (`rows`, from the Python scheduler) or the same as flat arrays (`compact`, from the numpy one)."""

    rows: tuple[tuple[tuple[int, int, float, float], ...], ...] | None
    estimate: float
    compact: CompactSchedule | None = None

    @cached_property
    def entries(self) -> tuple[tuple[tuple[int, int, float, float], ...], ...]:
        if self.rows is not None:
            return self.rows
        assert self.compact is not None
        return self.compact.entries()


@dataclass(frozen=True)
class _Setting:
    """What one list schedule needs besides the routing: per stage (F, B-or-BW, W) durations and the p2p time
    after it, per rank the live micro-batch limit, the ready-item order and the variant's kind rules."""

    D: int
    S: int
    M: int
    dur: tuple[tuple[float, float, float], ...]
    p2p: tuple[float, ...]
    limit: tuple[float, ...]
    loads: tuple[tuple[int, ...], ...]
    order: Order
    forward_first: bool
    alternate: bool
    decoupled: bool
    wait_for_backward: bool = False
    wait_strict: bool = False
    first_stage_forward: bool = False
    forward_ranks: tuple[bool, ...] = ()  # per rank: a ready F before a ready B (bottleneck_forward); () none


def _setting(config: Config, host: Sequence[Sequence[int]], decoupled: bool, caps: Sequence[int] | None,
             variant: Variant) -> _Setting:
    D, S, M = config.num_replicas, config.num_stages, config.num_microbatches
    c = config.costs
    dur = tuple((c.forward[s], c.backward_input[s] if decoupled else c.backward_fused[s], c.backward_weight[s])
                for s in range(S))
    loads = worker_loads(host, D)
    limit = [math.inf] * (D * S)
    for p in range(D):
        for s in range(S):
            cap = math.inf if caps is None else caps[s]
            if variant.soft_cap is not None and loads[s][p]:
                window = math.ceil((S - s) * loads[s][p] / M) + variant.soft_cap
                cap = min(cap, window)
            limit[p * S + s] = cap
    return _Setting(D, S, M, dur, tuple(config.communication.p2p_time(s) for s in range(S)), tuple(limit),
                    tuple(tuple(row) for row in loads), order_of(variant), variant.forward_first, variant.alternate,
                    decoupled, variant.wait_for_backward or variant.wait_strict, variant.wait_strict,
                    variant.first_stage_forward, _forward_ranks(D, S, dur, loads, decoupled, variant))


def _forward_ranks(D: int, S: int, dur: Sequence[tuple[float, float, float]], loads: Sequence[Sequence[int]],
                   decoupled: bool, variant: Variant) -> tuple[bool, ...]:
    """Per rank, whether a ready F runs before a ready B there (`bottleneck_forward`: the ranks with the most work
    per iteration); () when no rank does."""
    if not variant.bottleneck_forward:
        return ()
    work = [loads[s][p] * (dur[s][0] + dur[s][1] + (dur[s][2] if decoupled else 0.0))
            for p in range(D) for s in range(S)]
    top = max(work)
    return tuple(w >= top - 1e-9 for w in work)


def list_schedule(config: Config, key: Sequence[int], host: Sequence[Sequence[int]], decoupled: bool,
                  staggered: bool, caps: Sequence[int] | None, variant: Variant) -> _Timed:
    """Schedule one iteration event by event: whenever a worker is free it starts its best ready action.

    Readiness follows the plan's dependencies (F chain forward, B chain backward with message times from the config,
    W after its B on the same worker). Live micro-batches are counted in list order from F to W (BW when fused),
    exactly as the simulator counts them, and an F is only started below the worker's cap. Large instances with
    whole-unit costs are stepped in numpy (`recycle.planner.vector_schedule`: the same schedule, tested equal).
    """
    inputs = (config.fingerprint(), tuple(key), tuple(map(tuple, host)), decoupled, staggered,
              tuple(caps) if caps is not None else None, variant)
    kept = _SCHEDULES.get(inputs)
    if kept is not None:
        _SCHEDULES.move_to_end(inputs)
        return kept
    setting = _setting(config, host, decoupled, caps, variant)
    compact = _vector_schedule(setting, host) if _use_vector(setting) else None
    if compact is None:
        rng = random.Random(variant.seed) if setting.order is Order.RANDOM else None
        rows = _event_loop(setting, host, _item_maker(setting, host, rng), rng)
        _check_complete(setting, [len(row) for row in rows], variant, caps)
        timed = _Timed(rows, _estimate(config, key, rows, staggered))
        if _SCHEDULES_LIMIT > 0:  # only Python schedules: immutable tuples (a numpy one's arrays are not)
            _SCHEDULES[inputs] = timed
            if len(_SCHEDULES) > _SCHEDULES_LIMIT:
                _SCHEDULES.popitem(last=False)
        return timed
    _check_complete(setting, compact.counts(), variant, caps)
    return _Timed(None, _estimate_compact(config, key, compact, staggered), compact)


def _check_complete(setting: _Setting, counts: Sequence[int], variant: Variant, caps: Sequence[int] | None) -> None:
    """Raise when a worker did not run all its actions (cannot happen for a cap >= 1: a scheduler bug guard)."""
    per_mb = 3 if setting.decoupled else 2
    S = setting.S
    for p in range(setting.D):
        for s in range(S):
            want = setting.loads[s][p] * per_mb
            if counts[p * S + s] != want:
                raise PlanError(f"heuristic scheduler stalled on worker ({p},{s}): scheduled {counts[p * S + s]} of "
                                f"{want} actions (variant {variant.name}, caps {caps})")


def _use_vector(setting: _Setting) -> bool:
    """The numpy scheduler for deterministic rules where it is exact and faster (see `vector_eligible`)."""
    per_mb = 3 if setting.decoupled else 2
    actions = per_mb * setting.D * setting.M * setting.S
    if setting.order is Order.RANDOM or setting.wait_for_backward or setting.first_stage_forward \
            or setting.forward_ranks or actions < VECTOR_MIN_ACTIONS:
        return False
    from recycle.planner.vector_schedule import vector_eligible

    busiest = max(load * sum(setting.dur[s]) for s, row in enumerate(setting.loads) for load in row)
    round_trip = sum(f + b + 2 * m for (f, b, _), m in zip(setting.dur, setting.p2p))
    durations = [d for row in setting.dur for d in (row if setting.decoupled else row[:2])]
    return vector_eligible(durations, setting.p2p, actions, busiest + round_trip)


def _vector_schedule(setting: _Setting, host: Sequence[Sequence[int]]) -> CompactSchedule | None:
    """`vector_list_schedule` with the setting's order as an int64 key (None: the keys would overflow)."""
    import numpy as np

    from recycle.planner.vector_schedule import vector_list_schedule

    D, S, M = setting.D, setting.S, setting.M
    order = setting.order
    static_max = 0
    urgency = None
    if order is Order.SLOT:
        static_max = 2 * M
    elif order is Order.OWN_FIRST:
        static_max = 1
    elif order is Order.BY_ID:
        static_max = D * M
    elif order is Order.URGENT:
        urgency = np.asarray(_urgency(setting, host), dtype=np.int64)
        static_max = int(urgency.max(initial=0))

    def static_key(stage: np.ndarray, replica: np.ndarray, mb: np.ndarray) -> np.ndarray:
        rerouted = (mb // M != replica).astype(np.int64)
        if order is Order.SLOT:
            return (mb % M) * 2 + rerouted
        if order is Order.OWN_FIRST:
            return rerouted
        if order is Order.BY_ID:
            return mb.copy()
        if order is Order.URGENT:
            assert urgency is not None
            return static_max - urgency[stage, mb]
        return np.zeros(len(mb), dtype=np.int64)

    try:
        return vector_list_schedule(D, S, M, host, setting.dur, setting.p2p, setting.limit, static_key, static_max,
                                    order is not Order.BY_ID, setting.forward_first, setting.alternate,
                                    setting.decoupled)
    except OverflowError:
        return None


def _urgency(setting: _Setting, host: Sequence[Sequence[int]]) -> list[list[int]]:
    """urgency[s][mb]: the load of the heaviest worker micro-batch mb visits at stage s or later."""
    S, total = setting.S, setting.D * setting.M
    urgency = [[0] * total for _ in range(S)]
    for mb in range(total):
        worst = 0
        for s in range(S - 1, -1, -1):
            worst = max(worst, setting.loads[s][host[s][mb]])
            urgency[s][mb] = worst
    return urgency


def _item_maker(setting: _Setting, host: Sequence[Sequence[int]], rng: random.Random | None
                ) -> Callable[[int, int, float, int], tuple]:
    """item(rank, stage, ready, mb): the ready-heap entry of an arrived F or B under the setting's order."""
    M, S = setting.M, setting.S
    order = setting.order
    if order is Order.SLOT:
        return lambda rank, stage, ready, mb: (mb % M, mb // M != rank // S, ready, mb)
    if order is Order.ARRIVAL:
        return lambda rank, stage, ready, mb: (ready, mb)
    if order is Order.URGENT:
        urgency = _urgency(setting, host)
        return lambda rank, stage, ready, mb: (-urgency[stage][mb], ready, mb)
    if order is Order.BY_ID:
        return lambda rank, stage, ready, mb: (mb,)
    if order is Order.OWN_FIRST:  # re-routed micro-batches after the worker's own
        return lambda rank, stage, ready, mb: (mb // M != rank // S, ready, mb)
    assert rng is not None
    draw = rng.random
    return lambda rank, stage, ready, mb: (draw(), mb)


# A random rule's choices: the kinds that may run, in (B, F, W) order, indexed by 4 * has_b + 2 * can_forward +
# has_w (a table look-up instead of building the list per decision; rng.choice draws the same from equal lists).
_RANDOM_KINDS: tuple[tuple[int, ...], ...] = tuple(
    tuple(k for k, ok in ((_B, i & 4), (_F, i & 2), (_W, i & 1)) if ok) for i in range(8))


def _event_loop(setting: _Setting, host: Sequence[Sequence[int]], item: Callable[[int, int, float, int], tuple],
                rng: random.Random | None) -> tuple[tuple[tuple[int, int, float, float], ...], ...]:
    """The Python list scheduler: per rank the (code, mb, start, end) entries in start order. A random rule
    (`rng`) draws its item keys and its kinds from one stream.

    One function on purpose (~90 lines): its body runs once per action and idle wake-up, and moving its parts into
    calls cost ~15 % on the toy. A free worker runs a ready B first (with `alternate`: not twice in a row when an
    F may run), then an F below its limit (with `forward_first`, or when no W waits), then a W.
    """
    D, S = setting.D, setting.S
    n_ranks = D * S
    dur, p2p, limit, decoupled = setting.dur, setting.p2p, setting.limit, setting.decoupled
    forward_first, alternate, wait = setting.forward_first, setting.alternate, setting.wait_for_backward
    strict = setting.wait_strict
    first_forward = setting.first_stage_forward
    forward_ranks = setting.forward_ranks or (False,) * n_ranks  # bottleneck_forward's ranks
    arrivals: list[list[tuple[float, int, int, int]]] = [[] for _ in range(n_ranks)]  # (ready, seq, F or B, mb)
    ready_f: list[list[tuple]] = [[] for _ in range(n_ranks)]  # heaps of item() tuples, the mb last
    ready_b: list[list[tuple]] = [[] for _ in range(n_ranks)]
    ready_w: list[list[tuple[float, int]]] = [[] for _ in range(n_ranks)]
    busy_until = [0.0] * n_ranks
    live = [0] * n_ranks
    last = [-1] * n_ranks  # the code of each worker's previous F or B
    deferred = [-1.0] * n_ranks  # the instant a waiting rule last let the other due workers decide first
    entries: list[list[tuple[int, int, float, float]]] = [[] for _ in range(n_ranks)]
    # Pending wake-ups, in (time, push order): a heap of distinct times and, per time, its ranks in push order.
    # Float keys compare much faster than (time, seq, rank) tuples, and the order is the same.
    times: list[float] = [0.0]
    due_at: dict[float, deque[int]] = {0.0: deque()}
    seq = 0
    for p in range(D):
        for mb in (mb for mb, q in enumerate(host[0]) if q == p):  # stage 0's micro-batches, in id order
            arrivals[p * S].append((0.0, seq, _F, mb))
            seq += 1
        due_at[0.0].append(p * S)
    push, pop = heapq.heappush, heapq.heappop  # local names: this loop runs once per action and idle wake-up
    random_kinds, choice = _RANDOM_KINDS, (rng.choice if rng is not None else None)
    # Where a finished F's and B's message goes (recycle.ir.dependencies), tabled per stage; -1: none.
    send_f, send_b = output_stage_table((Kind.F, Kind.B), S)
    while times:
        t = times[0]
        due = due_at[t]
        rank = due.popleft()
        if not due:
            pop(times)
            del due_at[t]
        if busy_until[rank] > t:
            continue  # stale: the worker is busy; its completion event decides next
        stage = rank % S
        arr = arrivals[rank]
        rf, rb, rw = ready_f[rank], ready_b[rank], ready_w[rank]
        while arr and arr[0][0] <= t:
            ready, _, code, mb = pop(arr)  # an F or a B (W's go straight to `rw`, see below)
            push(rf if code == _F else rb, item(rank, stage, ready, mb))
        can_forward = bool(rf) and live[rank] < limit[rank]
        if rng is not None:
            allowed = random_kinds[(4 if rb else 0) + (2 if can_forward else 0) + (1 if rw else 0)]
            code = choice(allowed) if allowed else -1
        elif rb and not (alternate and can_forward and last[rank] == _B) \
                and not ((first_forward and stage == 0 or forward_ranks[rank]) and can_forward):
            code = _B
        elif can_forward and (forward_first or not rw):
            code = _F
        else:
            code = _W if rw else -1
        if wait and code == _F:
            if strict and t in due_at and deferred[rank] != t:
                # Workers due at this same instant decide first: a B one of them starts now is on its way too.
                deferred[rank] = t
                due_at[t].append(rank)
                continue
            soon = min((a[0] for a in arr if a[2] == _B), default=math.inf)
            if soon < t + dur[stage][_F]:  # the F would delay a B on its way: a W that fits, or wait for the B
                code = _W if rw and t + dur[stage][_W] <= soon else -1
        elif strict and code == _W:
            soon = min((a[0] for a in arr if a[2] == _B), default=math.inf)
            if soon < t + dur[stage][_W]:  # nor does a W: it can run later, the B's gradient is awaited upstream
                code = -1
        if code < 0:
            if arr:
                wake = arr[0][0]
                waiting_ranks = due_at.get(wake)
                if waiting_ranks is not None:
                    waiting_ranks.append(rank)
                else:
                    due_at[wake] = deque((rank,))
                    push(times, wake)
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
        waiting_ranks = due_at.get(end)
        if waiting_ranks is not None:
            waiting_ranks.append(rank)
        else:
            due_at[end] = deque((rank,))
            push(times, end)
        seq += 1
        if code == _F:
            live[rank] += 1
            nxt = send_f[stage]
            if nxt >= 0:
                dest, ready, arrival_code = host[nxt][mb] * S + nxt, end + p2p[stage], _F  # boundary(stage, nxt)
            else:
                dest, ready, arrival_code = rank, end, _B  # loss turn-around on the same worker (local_input)
        elif code == _B:
            if decoupled:
                # The W goes straight into the ready heap, not through the arrivals: the worker decides nothing
                # before `end` (its events until then are stale), and at `end` it would hold the same item.
                push(rw, (end, mb))
            else:
                live[rank] -= 1
            nxt = send_b[stage]
            if nxt < 0:
                continue
            dest, ready, arrival_code = host[nxt][mb] * S + nxt, end + p2p[nxt], _B  # boundary(stage, nxt)
        else:
            continue
        push(arrivals[dest], (ready, seq, arrival_code, mb))
        seq += 1
        if dest != rank and ready >= busy_until[dest]:
            waiting_ranks = due_at.get(ready)
            if waiting_ranks is not None:
                waiting_ranks.append(dest)
            else:
                due_at[ready] = deque((dest,))
                push(times, ready)
    return tuple(tuple(row) for row in entries)


def _opt_durations(config: Config, key: Sequence[int]) -> list[float]:
    D = config.num_replicas
    return [action_duration(config, Kind.OPT, s, D - k) for s, k in enumerate(key)]


def _estimate(config: Config, key: Sequence[int], entries: Sequence[Sequence[tuple[int, int, float, float]]],
              staggered: bool) -> float:
    """The period if every iteration repeated this one's timing (coupled: exact; staggered: an estimate)."""
    return _estimate_from(config, key, stage_extents(entries, config.num_stages), staggered)


def _estimate_compact(config: Config, key: Sequence[int], compact: CompactSchedule, staggered: bool) -> float:
    """_estimate of a numpy list schedule (the same extents: each rank's first start and last end)."""
    return _estimate_from(config, key, compact.stage_extents(config.num_stages), staggered)


def _estimate_from(config: Config, key: Sequence[int], extents: tuple[list[float], list[float]],
                   staggered: bool) -> float:
    opt = _opt_durations(config, key)
    first, end = extents
    if not staggered:
        return max(end) + max(opt)
    # Stage s steps after its last action and must be done before its first forward of the next iteration, which
    # comes `first[s]` after the next iteration's start.
    return max(end[s] + opt[s] - first[s] for s in range(config.num_stages))


def _to_actions(config: Config, timed: _Timed, host: Sequence[Sequence[int]], decoupled: bool,
                merge: bool) -> Sequence[tuple[Action, ...]]:
    """Turn a list schedule into per-worker action lists; with `merge`, fuse B;W pairs that gain nothing split.

    A B immediately followed by its own W is fused into one BW when the fused kernel is no slower and the
    input-gradient's consumer upstream started late enough not to notice the later send (always at stage 0, whose
    input-gradient goes nowhere). Fused backward is what the paper uses wherever decoupling does not help. A numpy
    list schedule gives CompactActions (the same lists, built as Action objects only when read).
    """
    if timed.compact is not None:
        from recycle.planner.vector_schedule import compact_actions

        return compact_actions(config, timed.compact, decoupled, merge)
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
    new = new_action
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


def schedule_heuristic(config: Config, key: Sequence[int], options: PlannerOptions = PlannerOptions(),
                       variants: Sequence[Variant] = VARIANTS, period_only: bool = False) -> Plan:
    """A validated plan for the canonical layout of `key` (failed = replicas 0..k_s-1 of stage s).

    Every variant (plus, for small instances, RANDOM_RESTARTS random-priority ones and FIRST_STAGE_VARIANTS) is
    list-scheduled on each
    routing candidate and ranked by its own period estimate. With `options.search` (the default), small instances
    whose best estimate is above the analytic lower bound are then improved by a seeded local search (`_search`:
    orphan swaps between survivors, then moves in the per-worker orders); small instances still above the bound
    also try WAITING_VARIANTS. The best few distinct schedules (with and without B/W fusion) are simulated and
    the best simulated period wins (ties: lower peak activations, then the earlier candidate). Very large
    instances skip the simulation and take the best estimate.
    meta.notes names the winning variant.

    period_only (issue 27: a caller that uses only the period, a trace replay): estimates are never below the
    lower bound (each is the period of a feasible periodic schedule) and ties rank by the order the rules are
    tried, so once schedules with an estimate at the bound appear, the first of them rank first, no search or
    waiting rule runs, and the first _SIMULATED_CANDIDATES of them are the ones simulated. The first is simulated
    at once: when its period is at the bound too, its plan is returned (possibly another plan than the full
    planner's; the same period, nothing beats the bound); when the second appears, the plan the full planner
    would pick from the two is returned. Either way the other rules are not tried. Otherwise the planner goes on
    exactly as without the flag (the same plan).
    """
    key = check_key(config, key)
    failed = canonical_failed(key)
    if options.rules is not None and variants is VARIANTS:
        variants = VARIANTS[:options.rules]  # a screen: these rules alone (no restarts, first-stage or waiting rules)
    small = (3 if options.decoupled else 2) * config.num_replicas * config.num_microbatches * config.num_stages \
        <= _RANDOM_RESTART_LIMIT
    routings = routing_candidates(config, key) if small else (balanced_routing(config, key),)
    return _schedule(config, key, failed, routings, options, variants, period_only)


def schedule_failed(config: Config, failed: Iterable[tuple[int, int]], options: PlannerOptions = PlannerOptions(),
                    variants: Sequence[Variant] = VARIANTS) -> Plan:
    """A validated plan on the real ranks of a failure set, routed by `failed_routing` (only the failed workers'
    micro-batches leave their pipeline); the same rules and search as `schedule_heuristic`."""
    failed = frozenset(failed)
    D, S = config.num_replicas, config.num_stages
    key = check_key(config, [sum(1 for p, st in failed if st == s) for s in range(S)])
    if any(not (0 <= p < D and 0 <= s < S) for p, s in failed):
        raise PlanError(f"failed workers {sorted(failed)} lie outside the {D}x{S} topology")
    small = (3 if options.decoupled else 2) * D * config.num_microbatches * S <= _RANDOM_RESTART_LIMIT
    first = failed_routing(config, failed)
    second = failed_routing(config, failed, slot_major=True) if small else first
    routings = (first,) if second == first else (first, second)
    return _schedule(config, key, failed, routings, options, variants)


def _schedule(config: Config, key: tuple[int, ...], failed: frozenset[tuple[int, int]],
              routings: Sequence[tuple[tuple[int, ...], ...]], options: PlannerOptions, variants: Sequence[Variant],
              period_only: bool = False) -> Plan:
    """schedule_heuristic's body for any failure set and routing candidates (see there)."""
    _SIMULATED_TIMINGS.clear()  # only this call's plans (each holds its actions alive)
    D, S, M = config.num_replicas, config.num_stages, config.num_microbatches
    caps = memory_cap(config, options)
    per_iteration = (3 if options.decoupled else 2) * D * M * S
    waiting = per_iteration <= _RANDOM_RESTART_LIMIT and variants is VARIANTS
    if per_iteration > _LARGE_LIMIT:
        variants = variants[:_LARGE_VARIANTS]
    elif waiting:
        variants = (*variants, *(Variant(f"random-{seed}", seed=seed) for seed in range(RANDOM_RESTARTS)),
                    *FIRST_STAGE_VARIANTS)
    simulate_top = _SIMULATED_CANDIDATES if per_iteration <= SIMULATE_ALL_LIMIT else 0

    search = options.search and per_iteration <= SEARCH_LIMIT
    probe = period_only and simulate_top > 0  # the first schedules at the bound may end the planning (see there)
    bound = period_lower_bound(config, key, options) if waiting or search or probe else math.inf
    ranked: list[_Candidate] = []
    seen: set[int] = set()

    at_estimate_bound: list[_Candidate] = []  # period_only: the first schedules whose estimate is at the bound
    simulated: dict[tuple[int, bool], tuple[tuple, Plan]] = {}  # period_only: the first one's simulations, reused

    def probed() -> Plan | None:
        """period_only: a plan with the full planner's period once the newest candidate settles it, else None."""
        if not (probe and len(at_estimate_bound) < simulate_top and ranked[-1].estimate <= bound * (1 + 1e-9)):
            return None
        at_estimate_bound.append(ranked[-1])
        plan = _best_simulated(config, key, failed, options, caps, at_estimate_bound, simulated)
        assert plan.meta.predicted_period is not None
        if plan.meta.predicted_period <= bound or len(at_estimate_bound) == simulate_top:
            return plan  # at the bound; or the very candidates the full planner simulates: its own plan
        return None

    def rank(rules: Sequence[Variant]) -> Plan | None:
        for r, host in enumerate(routings):
            for variant in rules:
                if r and variant.seed is not None:
                    continue  # random restarts only on the first routing
                timed = list_schedule(config, key, host, options.decoupled, options.staggered, caps, variant)
                if len(variants) * len(routings) == 1:  # nothing to de-duplicate (large instances: skip the hash)
                    ranked.append(_Candidate(timed.estimate, 0, variant.name, host, timed))
                else:
                    signature = hash((timed.entries, host))
                    if signature in seen:  # several rules often produce the same schedule
                        continue
                    seen.add(signature)
                    ranked.append(_Candidate(timed.estimate, len(ranked), variant.name, host, timed))
                found = probed()
                if found is not None:
                    return found
        return None

    # The rule schedules depend on neither options.search nor period_only: a replay plans a key without the search
    # (ReCycle+'s partition screen) and with it, and the second plan reuses the first's schedules (_RANKED).
    shared = (config.fingerprint(), key, failed, tuple(routings), options.decoupled, options.staggered,
              tuple(caps) if caps is not None else None, tuple(variants))
    reused = _RANKED.get(shared)
    if reused is not None:
        _RANKED.move_to_end(shared)
        at_bound = None
        for candidate in reused[0]:
            ranked.append(candidate)
            at_bound = probed()
            if at_bound is not None:
                break
        ranked[:] = reused[0]
        seen = set(reused[1])
    else:
        at_bound = rank(variants)
        if at_bound is None:
            _RANKED[shared] = (tuple(ranked), frozenset(seen))
            if len(_RANKED) > _RANKED_LIMIT:
                _RANKED.popitem(last=False)
    if at_bound is not None:
        return validate_plan(at_bound.with_meta(notes=f"{at_bound.meta.notes}; {RANKING_ENDED}"))
    if not ranked:
        raise PlanError("schedule_heuristic needs at least one variant")
    ranked.sort(key=lambda c: (c.estimate, c.order))
    if search:
        if ranked[0].estimate > bound * (1 + 1e-9):
            budget = WorkBudget(search_work(per_iteration))
            found = _search(config, key, failed, options, caps, ranked, variants, bound, budget)
            ranked = sorted([*found, *ranked], key=lambda c: (c.estimate, c.order))
    if waiting and ranked[0].estimate > bound * (1 + 1e-9):
        # Small plans still above the bound also try the waiting rules. They join the candidates after the
        # search, which starts from the work-conserving rules' schedules as before (measured: starting it from a
        # waiting schedule closed no more misses and opened one), and rank after them on a tie.
        rank(WAITING_VARIANTS)
        ranked.sort(key=lambda c: (c.estimate, c.order))

    if simulate_top == 0:
        # Not re-validated: the list schedule that produced it already executed exactly these dependencies and
        # counts (it raises on a stall), and _to_actions only fuses adjacent B;W pairs; validate_plan would add
        # ~40 % at D=64, S=16, M=128. tests/unit/test_planner_heuristic.py validates plans from this path.
        return _build(config, key, failed, options, caps, ranked[0], merge=True)
    return validate_plan(_best_simulated(config, key, failed, options, caps, ranked[:simulate_top]))


def _build(config: Config, key: tuple[int, ...], failed: frozenset[tuple[int, int]], options: PlannerOptions,
           caps: Sequence[int] | None, candidate: _Candidate, merge: bool) -> Plan:
    """The plan of a ranked list schedule (with `merge`: B;W pairs fused where that gains nothing split)."""
    actions = _to_actions(config, candidate.timed, candidate.host, options.decoupled, merge)
    return Plan(config.num_replicas, config.num_stages, config.num_microbatches, candidate.host, actions, failed,
                options.staggered, PlanMeta(
                    schedule="adaptive", decoupled=options.decoupled, failure_key=key, solver="heuristic",
                    status="HEURISTIC", memory_cap=caps or (), config_fingerprint=config.fingerprint(),
                    notes=f"heuristic variant {candidate.name}{'' if merge else ' (no B/W fusion)'}"))


def _best_simulated(config: Config, key: tuple[int, ...], failed: frozenset[tuple[int, int]],
                    options: PlannerOptions, caps: Sequence[int] | None, candidates: Sequence[_Candidate],
                    simulated: dict[tuple[int, bool], tuple[tuple, Plan]] | None = None) -> Plan:
    """The candidate plan (each with and, when decoupled, without B/W fusion) with the best simulated period, its
    predicted period and makespan filled in. `simulated` (keyed by the candidate's id and the fusion flag) keeps
    each scored plan for a later call on the same candidates, which then simulates only the new ones."""
    best: tuple[tuple, Plan] | None = None
    for candidate in candidates:
        for merge in ((True, False) if options.decoupled else (True,)):
            scored = simulated.get((id(candidate), merge)) if simulated is not None else None
            if scored is None:
                inputs = (config.fingerprint(), key, failed, options.decoupled, options.staggered,
                          tuple(caps) if caps is not None else None, candidate.name, candidate.host,
                          candidate.timed.entries, merge)
                kept = _SCORED.get(inputs)
                if kept is None:
                    plan = _build(config, key, failed, options, caps, candidate, merge)
                    result = simulate(plan, config)
                    # Ranked by the mean period over whole cycles (a plan whose iteration times alternate is not
                    # credited with a mean over part of a cycle), then settled plans first.
                    settled = settling(result)
                    kept = (settled.period, settled.cycle != 1, max(result.peak_activations),
                            plan.with_meta(predicted_period=settled.period, predicted_makespan=result.makespan),
                            result.makespan, settled.note(result.period))
                    if _SCORED_LIMIT > 0:
                        _SCORED[inputs] = kept
                        if len(_SCORED) > _SCORED_LIMIT:
                            _SCORED.popitem(last=False)
                else:
                    _SCORED.move_to_end(inputs)
                period, unsettled, peak, plan, makespan, note = kept
                scored = ((period, unsettled, peak, candidate.order, not merge), plan)
                _SIMULATED_TIMINGS[id(plan.actions)] = (plan.actions, period, makespan, note)
                if simulated is not None:
                    simulated[(id(candidate), merge)] = scored
            if best is None or scored[0] < best[0]:
                best = scored
    assert best is not None
    return best[1]


@dataclass(frozen=True)
class _Candidate:
    """A ranked list schedule: its estimate, a tie-breaking order, the rule that made it and its routing."""

    estimate: float
    order: int
    name: str
    host: tuple[tuple[int, ...], ...]
    timed: _Timed


# The rule schedules of the last few plans (per config, key, failure set, routings, options but the search, caps and
# rules), reused by a plan of the same inputs: a replay plans each key of ReCycle+'s partition screen twice, without
# and with the search. A few entries cover one partition search; each holds ~50 schedules (a few MB at D=20).
_RANKED: OrderedDict[tuple, tuple[tuple[_Candidate, ...], frozenset[int]]] = OrderedDict()
_RANKED_LIMIT = 12

# Every Python list schedule of the last _SCHEDULES_LIMIT distinct inputs (config, key, routing, options' flags, caps,
# rule), reused as it is: a list schedule is a deterministic function of them (a random rule seeds its own stream).
# A replay asks for the same schedule in several plans: a partition screen's two rules and then the polish of the
# same layout, the upper bound's first rule and then the key's plan, an orphan swap's routing seen before (399 of
# the 7,835 list schedules of a cold bamboo-ec2-p3 replay). ~100 kB each at D=8, S=4, M=8.
_SCHEDULES: OrderedDict[tuple, _Timed] = OrderedDict()
_SCHEDULES_LIMIT = 256

# The scored simulations of the last _SCORED_LIMIT candidates _best_simulated built (keyed by everything its plan is
# built from and simulated with): (simulated period, not cycle-settled, peak activations, plan, makespan, settling
# note). A screen and the plan of the same key often simulate the same candidates (246 of 1,484 simulations of the
# same replay). The candidate's rank order is not part of it: it is added per call.
_SCORED: OrderedDict[tuple, tuple[float, bool, int, Plan, float, str]] = OrderedDict()
_SCORED_LIMIT = 64


# The simulated (period, makespan, settling note) of the plans _best_simulated scored in the current _schedule call,
# by the identity of their action lists (kept alive here): `simulated_timing` gives them to planner.api, which would
# otherwise simulate the returned plan once more (the same deterministic simulation).
_SIMULATED_TIMINGS: dict[int, tuple[object, float, float, str]] = {}


def simulated_timing(plan: Plan) -> tuple[float, float, str] | None:
    """(period, makespan, settling note) of `plan` as the last schedule_heuristic call simulated it (the values
    `simulate` and `settling` give for it), or None when it did not simulate these actions."""
    found = _SIMULATED_TIMINGS.get(id(plan.actions))
    if found is None or found[0] is not plan.actions:
        return None
    return found[1], found[2], found[3]


def clear_schedules() -> None:
    """Forget the rule schedules and simulations kept for reuse (planner.api.clear_cache: cold planning in tests and
    benchmarks)."""
    _RANKED.clear()
    _SCHEDULES.clear()
    _SCORED.clear()


def _search(config: Config, key: tuple[int, ...], failed: frozenset[tuple[int, int]], options: PlannerOptions,
            caps: Sequence[int] | None, ranked: Sequence[_Candidate], variants: Sequence[Variant],
            bound: float, budget: WorkBudget) -> list[_Candidate]:
    """Seeded local search from the best candidates within `budget`; returns the improved candidates (possibly
    none).

    1. Routing: swap the hosts of two orphans of one stage, or move an orphan from a survivor with the higher load
       to one with the lower (loads stay balanced), and list-schedule the change with the rules of the best
       candidates; keep changes that do not worsen the best estimate. The issue's misses
       (unequal F/B/W costs) were all routings where a survivor received the same slot of several lost pipelines.
    2. Orders: `improve_orders` moves single actions within a worker's order, timed as soon as possible, from
       ORDER_STARTS distinct routings one after another (step 1's best, the routings of the same estimate it
       passed through, newest first, then the rule schedules'), each with an equal share of what is left: the
       rules often give every balanced routing the same estimate, and the order moves then end at different
       periods on them (issue 26's screen: 28 from step 1's best routing, the optimum 26 from the third). The
       start DEADLINE_START gets deadline list schedules (`recycle.planner.deadline.improve_sequences`) instead,
       which move stage-0 orders together with the downstream ones.
    Both stop at the analytic lower bound. Step 1 may spend ROUTING_SHARE of the budget, step 2 the rest.
    """
    routing_budget = budget.share(ROUTING_SHARE)
    rules = _search_rules(config, options, ranked, variants, routing_budget.left)
    best, found, visited = _search_routing(config, key, failed, options, caps, ranked[0], rules, bound,
                                           routing_budget)
    budget.give_back(routing_budget)
    if best.estimate > bound * (1 + 1e-9):
        starts = [best]
        for candidate in [*visited, *ranked]:  # other routings: the swaps' plateau, then the rule schedules
            if len(starts) == ORDER_STARTS:
                break
            if all(candidate.host != start.host for start in starts):
                starts.append(candidate)
        for n, start in enumerate(starts):
            share = budget.share(1 / (len(starts) - n))
            search_start = _search_deadlines if n == DEADLINE_START else _search_orders
            moved = search_start(config, key, options, caps, start, bound, share)
            budget.give_back(share)
            if moved is not None:
                found.append(moved)
                if moved.estimate <= bound * (1 + 1e-9):
                    break
    # Search results rank ahead of equal-estimate rule schedules (they are at least as good on the estimate).
    return [replace(c, order=-len(found) + i) for i, c in enumerate(found)]


def _search_rules(config: Config, options: PlannerOptions, ranked: Sequence[_Candidate],
                  variants: Sequence[Variant], work: int) -> list[Variant]:
    """The rules a routing change is list-scheduled with: those of the best candidates, best first, as many as
    `work` (the swaps' budget) pays for over _ROUTING_SWAPS swaps, and at least _SEARCH_RULES."""
    by_name = {v.name: v for v in variants}
    per_iteration = (3 if options.decoupled else 2) * config.num_replicas * config.num_microbatches * config.num_stages
    want = max(_SEARCH_RULES, work // (_ROUTING_SWAPS * LIST_SCHEDULE_COST * per_iteration))
    rules: list[Variant] = []
    for candidate in ranked:  # the rules in the order of their best schedule
        variant = by_name.get(candidate.name)
        if variant is not None and variant not in rules:
            rules.append(variant)
        if len(rules) == want:
            break
    return rules


def _search_routing(config: Config, key: tuple[int, ...], failed: frozenset[tuple[int, int]],
                    options: PlannerOptions, caps: Sequence[int] | None, start: _Candidate, rules: Sequence[Variant],
                    bound: float, budget: WorkBudget) -> tuple[_Candidate, list[_Candidate]]:
    """Step 1 of _search: seeded orphan swaps and moves from `start`, each paid from `budget` (one list schedule
    per rule); (the best candidate, the improving ones)."""
    rng = random.Random(0)
    best = start
    host = [list(row) for row in best.host]
    M, D = config.num_microbatches, config.num_replicas
    orphans = [[mb for mb in range(D * M) if (mb // M, s) in failed] for s in range(config.num_stages)]
    live = [[p for p in range(D) if (p, s) not in failed] for s in range(config.num_stages)]
    orphan_stages = [s for s, k in enumerate(key) if k > 0]
    found: list[_Candidate] = []
    visited: list[_Candidate] = []  # routings of the best estimate the swaps passed through, newest first
    per_iteration = sum(len(row) for row in start.timed.entries)
    cost = max(1, LIST_SCHEDULE_COST * per_iteration * len(rules))
    for _ in range(2 * (budget.left // cost)):  # draws that change nothing are not paid for: bound them too
        if best.estimate <= bound * (1 + 1e-9) or not orphan_stages or budget.left < cost:
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
        budget.afford(cost)  # left >= cost: checked above
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
            visited.clear()
        else:
            visited.insert(0, best)
        best = improved
    if best is not start and not found:
        found.append(best)
    return best, found, visited


def _search_orders(config: Config, key: tuple[int, ...], options: PlannerOptions, caps: Sequence[int] | None,
                   best: _Candidate, bound: float, budget: WorkBudget) -> _Candidate | None:
    """Step 2 of _search: single-action moves within the workers' orders of `best`, timed as soon as possible,
    down to the lower bound or until `budget` is spent; the result if it beats `best`."""
    evaluator = OrderEvaluator(config, key, best.host, options.decoupled, options.staggered, caps,
                               _opt_durations(config, key))
    entries, score = improve_orders(evaluator, best.timed.entries, budget, seed=0, target=bound)
    if score[0] >= best.estimate:
        return None
    timed = _Timed(tuple(tuple(row) for row in entries), score[0])
    return _Candidate(score[0], -1, f"{best.name} + order moves", best.host, timed)


def _search_deadlines(config: Config, key: tuple[int, ...], options: PlannerOptions, caps: Sequence[int] | None,
                      start: _Candidate, bound: float, budget: WorkBudget) -> _Candidate | None:
    """Deadline list schedules on `start`'s routing (`recycle.planner.deadline.improve_sequences`, target the lower
    bound) within `budget`; the result if it beats `start`."""
    evaluator = OrderEvaluator(config, key, start.host, options.decoupled, options.staggered, caps,
                               _opt_durations(config, key))
    result = improve_sequences(evaluator, start.host, config.num_microbatches, bound, budget)
    if result is None or result[1][0] >= start.estimate:
        return None
    entries, score = result
    timed = _Timed(tuple(tuple(row) for row in entries), score[0])
    return _Candidate(score[0], -1, f"{start.name} + deadline schedules", start.host, timed)
