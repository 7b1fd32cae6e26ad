"""Times a plan on a cost model over several iterations: period, makespan, idle fraction, peak activation memory."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate, chain
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Callable

from recycle.config import Config
from recycle.errors import PlanError
from recycle.ir.actions import Kind
from recycle.ir.costs import action_duration
from recycle.ir.dependencies import boundary, input_stage_table
from recycle.ir.plan import Plan
from recycle.ir.validate import check_plan_matches, format_grid
from recycle.sim.convergence import LEVEL_TIMER_MIN_ACTIONS, MAX_ITERATIONS, settled_period
from recycle.sim.convergence import converged as _converged

if TYPE_CHECKING:  # numpy is imported only for large plans
    from recycle.sim.levels import LevelTimer

__all__ = ["SimResult", "simulate"]


@dataclass(frozen=True)
class SimResult:
    """What one simulation measured. Per-worker tuples are in rank order; failed workers get 0 / 0.0."""

    period: float  # steady-state time between the starts of consecutive iterations
    # Steady-state iteration length, optimizer excluded. Coupled: first compute start to last compute end over all
    # workers (everyone waits for the barrier). Staggered: each stage runs its iteration on its own clock, so the
    # longest stage span (first compute start to last compute end among the stage's live replicas).
    makespan: float
    first_makespan: float  # the same for the first iteration (cold start)
    idle_fraction: tuple[float, ...]  # per worker: 1 - busy / period (busy includes the optimizer step)
    bubble_fraction: float  # mean idle fraction over live workers
    peak_activations: tuple[int, ...]  # per worker: max micro-batches held (F start .. W end, or BW end)
    peak_activation_bytes: tuple[int, ...]
    iteration_starts: tuple[float, ...]
    num_iterations: int
    num_actions: int  # actions simulated (all iterations)
    staggered: bool
    # Timeline for charts: (rank, iteration, token, start, end); empty unless record=True.
    timeline: tuple[tuple[int, int, str, float, float], ...] = field(default=(), repr=False)

    def to_dict(self, include_timeline: bool = False) -> dict[str, Any]:
        d = {
            "period": self.period,
            "makespan": self.makespan,
            "first_makespan": self.first_makespan,
            "bubble_fraction": self.bubble_fraction,
            "idle_fraction": list(self.idle_fraction),
            "peak_activations": list(self.peak_activations),
            "peak_activation_bytes": list(self.peak_activation_bytes),
            "iteration_starts": list(self.iteration_starts),
            "num_iterations": self.num_iterations,
            "num_actions": self.num_actions,
            "num_workers": len(self.idle_fraction),
            "optimizer": "staggered" if self.staggered else "coupled",
        }
        if include_timeline:
            d["timeline"] = [list(t) for t in self.timeline]
        return d


# Integer codes for the kinds: the flattened arrays in simulate() hold these instead of Kind members.
_KINDS = (Kind.F, Kind.B, Kind.W, Kind.BW, Kind.OPT)
_CODE = {k: i for i, k in enumerate(_KINDS)}
_F, _B, _W, _BW, _OPT = range(5)
_HELD_DELTA = (1, 0, -1, -1, 0)  # an activation slot is taken at F and released at W or BW
_KIND_OF, _STAGE_OF, _MB_OF = attrgetter("kind"), attrgetter("stage"), attrgetter("mb")


def _makespan(plan: Plan, compute_span: dict[int, tuple[int, int]], start: list[float], end: list[float]) -> float:
    """One iteration's makespan (see SimResult.makespan): over all workers when coupled, per stage when staggered."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for rank, span in compute_span.items():
        groups.setdefault(plan.worker(rank)[1] if plan.staggered else 0, []).append(span)
    return max((max(end[b] for _, b in spans) - min(start[a] for a, _ in spans) for spans in groups.values()),
               default=0.0)


@lru_cache(maxsize=64)
def _rule_tables(S: int) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """The dependency rule (recycle.ir.dependencies) tabled per kind code and stage: the stage an action's message
    comes from (-1: none) and the p2p index of that message."""
    source_of = input_stage_table(_KINDS, S)
    return source_of, tuple(tuple(boundary(st, src) for st, src in enumerate(row)) for row in source_of)


def _dependencies(code: list[int], stage_of: list[int], mb_of: list[int], first: list[int], stop: list[int],
                  S: int, TM: int, p2p: list[float], inter: list[float],
                  node: Callable[[int], int]) -> tuple[list[int], list[float]]:
    """Per action: the global index of the action whose output it needs (-1 if none) and the message time added
    when producer and consumer are different workers (inter-node figures across nodes)."""
    total = len(code)
    rank_of = [0] * total
    for r, (lo, hi) in enumerate(zip(first, stop)):
        rank_of[lo:hi] = [r] * (hi - lo)
    # where[(kind code * S + stage) * TM + mb] = g of that compute action (-1: not in the plan)
    where = [-1] * (len(_KINDS) * S * TM)
    for g, (c, st, mb) in enumerate(zip(code, stage_of, mb_of)):
        if c != _OPT:
            where[(c * S + st) * TM + mb] = g
    source_of, edge_of = _rule_tables(S)
    dep = [-1] * total
    msg = [0.0] * total
    for g in range(total):
        c, st = code[g], stage_of[g]
        source = source_of[c][st]
        if source < 0:
            continue
        if c == _F:
            src = where[(_F * S + source) * TM + mb_of[g]]
        else:
            # The input-gradient comes from the source stage's B when decoupled there, else from its fused BW.
            src = where[(_B * S + source) * TM + mb_of[g]]
            if src < 0:
                src = where[(_BW * S + source) * TM + mb_of[g]]
        dep[g] = src
        if rank_of[src] != rank_of[g]:
            # Across nodes ([topology] workers_per_node) the inter-node latency and bandwidth apply.
            edge = edge_of[c][st]
            msg[g] = inter[edge] if node(rank_of[src]) != node(rank_of[g]) else p2p[edge]
    return dep, msg


@dataclass(frozen=True)
class _Flat:
    """Every worker's list flattened into one array of actions (global index g); worker r owns g in
    [first[r], stop[r]). Everything after the flattening works on these lists of ints and floats."""

    first: list[int]
    stop: list[int]
    code: list[int]
    stage_of: list[int]
    mb_of: list[int]
    dur: list[float]
    is_opt: list[bool]
    held_delta: list[int]  # activation slots: +1 at F, -1 at W / BW

    @property
    def total(self) -> int:
        return len(self.code)


def _flatten(plan: Plan, config: Config) -> _Flat:
    """The Action objects are read once, by C-level attrgetter maps."""
    S = plan.num_stages
    live_per_stage = [len(plan.live_replicas(s)) for s in range(S)]
    duration_of = [[action_duration(config, k, s, live_per_stage[s]) for s in range(S)] for k in _KINDS]
    if plan.chunks > 1:
        # A chunk's F, B and W take 1/C of its worker's stage costs (the config's costs are per worker); compute
        # actions are indexed by chunk, OPT (the worker's whole step) by the worker's stage.
        C, where = plan.chunks, plan.chunk_stages
        duration_of = [row if k is Kind.OPT else [row[where[v]] / C for v in range(plan.num_chunks)]
                       for k, row in zip(_KINDS, duration_of)]
    first: list[int] = []
    stop: list[int] = []
    for acts in plan.actions:
        first.append(stop[-1] if stop else 0)
        stop.append(first[-1] + len(acts))
    flat = list(chain.from_iterable(plan.actions))
    code = list(map(_CODE.__getitem__, map(_KIND_OF, flat)))
    stage_of = list(map(_STAGE_OF, flat))
    mb_of = list(map(_MB_OF, flat))
    dur = [duration_of[c][st] for c, st in zip(code, stage_of)]
    if plan.pieces:  # a piece of n of a micro-batch's m samples computes n/m of its F, B and W (messages: unscaled)
        dur = [d if c == _OPT else d * plan.work_fraction(mb) for d, c, mb in zip(dur, code, mb_of)]
    return _Flat(first, stop, code, stage_of, mb_of, dur, [c == _OPT for c in code], [_HELD_DELTA[c] for c in code])


def _opt_groups(plan: Plan, live: list[int]) -> dict[int, tuple[int, ...]]:
    """Per live rank, the ranks whose OPT it meets: its stage's live replicas when staggered, else every live one."""
    if plan.staggered:
        by_stage = {s: tuple(plan.rank(p, s) for p in plan.live_replicas(s)) for s in range(plan.num_stages)}
        return {r: by_stage[plan.worker(r)[1]] for r in live}
    everyone = tuple(live)
    return {r: everyone for r in live}


def _compute_spans(live: list[int], flat: _Flat) -> dict[int, tuple[int, int]]:
    """rank -> (first compute g, last compute g): the per-worker makespan endpoints."""
    spans = {}
    for r in live:
        lo, hi = flat.first[r], flat.stop[r] - 1
        while lo <= hi and flat.is_opt[lo]:
            lo += 1
        while hi >= lo and flat.is_opt[hi]:
            hi -= 1
        if lo <= hi:
            spans[r] = (lo, hi)
    return spans


def simulate(plan: Plan, config: Config, iterations: int | None = None, record: bool = False) -> SimResult:
    """Run back-to-back iterations of the plan and measure them.

    `iterations=None` (the default) runs until the schedule is periodic (three equal gaps between iteration starts;
    staggered plans can take several iterations to settle) or MAX_ITERATIONS, and the period is the last gap, or
    when the iteration times never became equal the mean over their last whole cycle (`convergence.settled_period`;
    the mean of the last half of the gaps if no cycle shows). A fixed `iterations` runs exactly that many.

    Each worker runs its list in order; an action starts when its worker is free and its inputs have arrived
    (producer end + p2p latency + bytes / bandwidth when producer and consumer differ). OPT waits for the whole
    all-reduce group (its stage's live replicas when staggered; every live worker when coupled, and then every
    worker's next iteration waits for the slowest step). The plan is assumed valid (see validate_plan).
    """
    adaptive = iterations is None
    if iterations is None:
        iterations = MAX_ITERATIONS
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    topology = config.topology
    check_plan_matches(plan, config.num_replicas, config.num_stages, config.num_microbatches,
                       chunks=topology.chunks_per_worker, chunk_layout=topology.chunk_layout)
    flat = _flatten(plan, config)
    live = [r for r in range(plan.num_workers) if plan.actions[r]]
    run = _Run(plan, config, flat, live, _opt_groups(plan, live), _compute_spans(live, flat), record)
    # The level timer knows one chunk per worker only; chunked plans take the per-action loop.
    vectorize = flat.total >= LEVEL_TIMER_MIN_ACTIONS and not record and plan.chunks == 1
    timer = run.level_timer() if vectorize else None
    if timer is not None:
        run.iterate_levels(timer, iterations, adaptive)
    else:
        run.iterate(iterations, adaptive)
    period = _period(run.starts, adaptive, run.free, live)
    return _result(plan, config, flat, run, period)


class _Run:
    """The state of one simulation across iterations: worker clocks, iteration starts and makespans, timeline."""

    def __init__(self, plan: Plan, config: Config, flat: _Flat, live: list[int], groups: dict[int, tuple[int, ...]],
                 compute_span: dict[int, tuple[int, int]], record: bool) -> None:
        self.plan, self.config, self.flat = plan, config, flat
        self.live, self.groups, self.compute_span, self.record = live, groups, compute_span, record
        self.free = [0.0] * plan.num_workers
        self.starts: list[float] = []
        self.makespans: list[float] = []
        self.timeline: list[tuple[int, int, str, float, float]] = []
        self.dep: list[int] = []
        self.msg: list[float] = []

    def _links(self) -> tuple[list[float], list[float]]:
        """Message times per stage boundary (per chunk boundary when chunked: chunk v's output is priced as its
        worker's stage output; a boundary inside one worker sends nothing)."""
        comm = self.config.communication
        source = self.plan.chunk_stages
        return [comm.p2p_time(s) for s in source], [comm.inter_node_time(s) for s in source]

    def level_timer(self) -> LevelTimer | None:
        """The level-vectorized timer for a large plan (recycle.sim.levels; numpy, imported only here), or None when
        the plan is outside its scope or deadlocks; the per-action loop then runs (it reports deadlocks)."""
        from recycle.sim.levels import build_level_timer, flat_dependencies

        plan, f = self.plan, self.flat
        p2p, inter = self._links()
        node = self.config.topology.node
        dep_arr, msg_arr = flat_dependencies(f.code, f.stage_of, f.mb_of, f.first, f.stop, plan.num_stages,
                                             plan.num_microbatch_ids, p2p, inter,
                                             [node(r) for r in range(plan.num_workers)])
        timer = build_level_timer(plan.num_workers, f.first, f.stop, f.is_opt, dep_arr, msg_arr, f.dur, self.groups,
                                  plan.staggered)
        if timer is None:
            self.dep, self.msg = dep_arr.tolist(), msg_arr.tolist()
        return timer

    def iterate_levels(self, timer: LevelTimer, iterations: int, adaptive: bool) -> None:
        """Large plans: the same times from the level-vectorized timer (bit-identical, see recycle.sim.levels)."""
        head_actions = [self.flat.first[r] for r in self.live]
        free_now = self.free
        for _ in range(iterations):
            start_v, end_v, free_now = timer.run(free_now)
            self.starts.append(float(start_v[head_actions].min()))
            self.makespans.append(float(_makespan(self.plan, self.compute_span, start_v, end_v)))
            if adaptive and _converged(self.starts):
                break
        self.free = [float(x) for x in free_now]

    def iterate(self, iterations: int, adaptive: bool) -> None:
        """The per-action event loop, one iteration at a time."""
        f, plan = self.flat, self.plan
        if not self.dep:
            p2p, inter = self._links()
            self.dep, self.msg = _dependencies(f.code, f.stage_of, f.mb_of, f.first, f.stop, plan.num_chunks,
                                               plan.num_microbatch_ids, p2p, inter, self.config.topology.node)
        tokens = [str(a) for acts in plan.actions for a in acts] if self.record else []
        heads = [f.first[r] for r in self.live]
        for it in range(iterations):
            start, end = self._one_iteration()
            self.starts.append(min([start[g] for g in heads]))
            self.makespans.append(_makespan(plan, self.compute_span, start, end))
            if self.record:
                for r in self.live:
                    for j in range(f.first[r], f.stop[r]):
                        self.timeline.append((r, it, tokens[j], start[j], end[j]))
            if adaptive and _converged(self.starts):
                break

    def _one_iteration(self) -> tuple[list[float], list[float]]:
        """Start and end of every action in the next iteration; each worker starts at its `free` time."""
        f, dep, msg, free, groups = self.flat, self.dep, self.msg, self.free, self.groups
        first, stop, is_opt, dur = f.first, f.stop, f.is_opt, f.dur
        start = [0.0] * f.total
        end = [-1.0] * f.total  # -1: not run yet (times are never negative)
        ptr = list(first)
        waiting: dict[int, list[int]] = {}
        arrived: dict[tuple[int, ...], list[int]] = defaultdict(list)
        ready = list(self.live)
        while ready:
            rank = ready.pop()
            i = ptr[rank]
            last = stop[rank]
            t = free[rank]
            while i < last:
                if is_opt[i]:
                    ptr[rank] = i
                    free[rank] = t
                    group = groups[rank]
                    members = arrived[group]
                    members.append(rank)
                    if len(members) == len(group):
                        self._step(group, ptr, start, end)
                    break
                d = dep[i]
                if d >= 0:
                    produced = end[d]
                    if produced < 0.0:  # producer not done yet: park until it is
                        ptr[rank] = i
                        free[rank] = t
                        if d in waiting:
                            waiting[d].append(rank)
                        else:
                            waiting[d] = [rank]
                        break
                    arrival = produced + msg[i]
                    if arrival > t:
                        t = arrival
                start[i] = t
                t += dur[i]
                end[i] = t
                woken = waiting.pop(i, None)
                if woken:
                    ready.extend(woken)
                i += 1
            else:
                ptr[rank] = i
                free[rank] = t
        self._check_finished(ptr)
        return start, end

    def _step(self, group: tuple[int, ...], ptr: list[int], start: list[float], end: list[float]) -> None:
        """Every member of an all-reduce group has reached its OPT: the group steps together, from the moment the
        last one arrived."""
        free, dur, staggered = self.free, self.flat.dur, self.plan.staggered
        begin = max([free[m] for m in group])
        longest = max([dur[ptr[m]] for m in group])
        for m in group:
            j = ptr[m]
            start[j] = begin
            end[j] = begin + dur[j]
            # Coupled: nobody starts the next iteration before the slowest step ends.
            free[m] = begin + (dur[j] if staggered else longest)
            ptr[m] = j + 1

    def _check_finished(self, ptr: list[int]) -> None:
        """Raise with the blocked heads marked if some worker could not reach the end of its list."""
        first, stop = self.flat.first, self.flat.stop
        unfinished = [r for r in self.live if ptr[r] < stop[r]]
        if unfinished:
            heads = [(r, ptr[r] - first[r]) for r in unfinished]
            raise PlanError("plan deadlocks in simulation (validate it first); blocked heads marked:\n"
                            + format_grid(self.plan, heads))


def _period(starts: list[float], adaptive: bool, free: list[float], live: list[int]) -> float:
    """The steady-state period from the iteration starts (see simulate)."""
    iterations = len(starts)
    if adaptive:
        return settled_period(starts)
    if iterations >= 3:
        return (starts[-1] - starts[1]) / (iterations - 2)
    if iterations == 2:
        return starts[1] - starts[0]
    return max(free[r] for r in live) - starts[0]


def _result(plan: Plan, config: Config, flat: _Flat, run: _Run, period: float) -> SimResult:
    """Per-worker idle fractions and activation peaks, packed with the run's figures."""
    idle = []
    peaks = []
    peak_bytes = []
    for r in range(plan.num_workers):
        if r not in run.groups:
            idle.append(0.0)
            peaks.append(0)
            peak_bytes.append(0)
            continue
        lo, hi = flat.first[r], flat.stop[r]
        busy = sum(flat.dur[lo:hi])
        idle.append(max(0.0, 1.0 - busy / period) if period > 0 else 0.0)
        peak = max(0, max(accumulate(flat.held_delta[lo:hi]), default=0))  # running count, its maximum
        peaks.append(peak)  # chunked plans: in chunk activations, each 1/C of the worker's activation_bytes
        stage = plan.worker(r)[1]
        # Plus the region a checkpointed stage rebuilds inside one backward (0 without checkpointing).
        rebuilt = config.memory.recompute_bytes[stage] if peak > 0 else 0
        peak_bytes.append(peak * config.memory.activation_bytes[stage] // plan.chunks + rebuilt)
    live_idle = [idle[r] for r in run.live]
    iterations = len(run.starts)
    return SimResult(
        period=period,
        makespan=run.makespans[-1],
        first_makespan=run.makespans[0],
        idle_fraction=tuple(idle),
        bubble_fraction=sum(live_idle) / len(live_idle),
        peak_activations=tuple(peaks),
        peak_activation_bytes=tuple(peak_bytes),
        iteration_starts=tuple(run.starts),
        num_iterations=iterations,
        num_actions=plan.num_actions * iterations,
        staggered=plan.staggered,
        timeline=tuple(run.timeline),
    )
