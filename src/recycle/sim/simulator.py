"""Times a plan on a cost model over several iterations: period, makespan, idle fraction, peak activation memory."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from recycle.config import Config
from recycle.errors import PlanError
from recycle.ir.actions import Kind
from recycle.ir.plan import Plan
from recycle.ir.validate import format_grid

__all__ = ["SimResult", "simulate", "action_duration"]


@dataclass(frozen=True)
class SimResult:
    """What one simulation measured. Per-worker tuples are in rank order; failed workers get 0 / 0.0."""

    period: float  # steady-state time between the starts of consecutive iterations
    makespan: float  # steady-state iteration: max over workers of (last compute end - first compute start)
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


def action_duration(config: Config, kind: Kind, stage: int, num_live: int) -> float:
    """Duration of one action on the config's cost model (OPT = the stage's all-reduce plus its optimizer step)."""
    c = config.costs
    if kind is Kind.F:
        return c.forward[stage]
    if kind is Kind.B:
        return c.backward_input[stage]
    if kind is Kind.W:
        return c.backward_weight[stage]
    if kind is Kind.BW:
        return c.backward_fused[stage]
    return config.communication.allreduce_time(stage, num_live) + c.optimizer[stage]


def _check_matches(plan: Plan, config: Config) -> None:
    got = (plan.num_replicas, plan.num_stages, plan.num_microbatches)
    want = (config.num_replicas, config.num_stages, config.num_microbatches)
    if got != want:
        raise PlanError(f"plan is for (D, S, M) = {got} but the config {config.name!r} has {want}; make the plan "
                        "from this config")


def simulate(plan: Plan, config: Config, iterations: int = 4, record: bool = False) -> SimResult:
    """Run `iterations` back-to-back iterations of the plan and measure them.

    Each worker runs its list in order; an action starts when its worker is free and its inputs have arrived
    (producer end + p2p latency + bytes / bandwidth when producer and consumer differ). OPT waits for the whole
    all-reduce group (its stage's live replicas when staggered; every live worker when coupled, and then every
    worker's next iteration waits for the slowest step). The plan is assumed valid (see validate_plan).
    """
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    _check_matches(plan, config)
    S = plan.num_stages
    n = plan.num_workers
    comm = config.communication

    # Flatten each worker's list into parallel arrays; index every compute action by (kind, stage, mb).
    kinds: list[list[Kind]] = []
    durations: list[list[float]] = []
    deps: list[list[tuple[int, int, float]]] = []  # per action: (producer rank, producer position, message time)
    where: dict[tuple[Kind, int, int], tuple[int, int]] = {}
    live_per_stage = [len(plan.live_replicas(s)) for s in range(S)]
    for rank, acts in enumerate(plan.actions):
        kinds.append([a.kind for a in acts])
        durations.append([action_duration(config, a.kind, a.stage, live_per_stage[a.stage]) for a in acts])
        for i, a in enumerate(acts):
            if a.kind is not Kind.OPT:
                where[(a.kind, a.stage, a.mb)] = (rank, i)
    decoupled = plan.decoupled_pairs
    p2p = [comm.p2p_time(s) for s in range(S)]
    for rank, acts in enumerate(plan.actions):
        row: list[tuple[int, int, float]] = []
        for a in acts:
            dep: tuple[int, int, float] = (-1, -1, 0.0)
            s, mb = a.stage, a.mb
            if a.kind is Kind.F and s > 0:
                src, pos = where[(Kind.F, s - 1, mb)]
                dep = (src, pos, p2p[s - 1] if src != rank else 0.0)
            elif a.kind in (Kind.B, Kind.BW) and s < S - 1:
                kind = Kind.B if (s + 1, mb) in decoupled else Kind.BW
                src, pos = where[(kind, s + 1, mb)]
                dep = (src, pos, p2p[s] if src != rank else 0.0)
            row.append(dep)
        deps.append(row)

    live = [r for r in range(n) if plan.actions[r]]
    if plan.staggered:
        groups = {r: tuple(plan.rank(p, plan.worker(r)[1]) for p in plan.live_replicas(plan.worker(r)[1]))
                  for r in live}
    else:
        everyone = tuple(live)
        groups = {r: everyone for r in live}

    free = [0.0] * n
    starts_it: list[float] = []
    makespans: list[float] = []
    timeline: list[tuple[int, int, str, float, float]] = []
    tokens = [[str(a) for a in acts] for acts in plan.actions] if record else []
    for it in range(iterations):
        start = [[math.nan] * len(k) for k in kinds]
        end = [[math.nan] * len(k) for k in kinds]
        ptr = [0] * n
        waiting: dict[tuple[int, int], list[int]] = defaultdict(list)
        arrived: dict[tuple[int, ...], list[int]] = defaultdict(list)
        ready = list(live)
        while ready:
            rank = ready.pop()
            k_row, d_row, dep_row, s_row, e_row = kinds[rank], durations[rank], deps[rank], start[rank], end[rank]
            i = ptr[rank]
            t = free[rank]
            while i < len(k_row):
                if k_row[i] is Kind.OPT:
                    group = groups[rank]
                    members = arrived[group]
                    members.append(rank)
                    if len(members) == len(group):
                        begin = max(free[g] for g in group)
                        longest = max(durations[g][ptr[g]] for g in group)
                        for g in group:
                            j = ptr[g]
                            start[g][j] = begin
                            end[g][j] = begin + durations[g][j]
                            # Coupled: nobody starts the next iteration before the slowest step ends.
                            free[g] = begin + (durations[g][j] if plan.staggered else longest)
                            ptr[g] = j + 1
                    break
                src, pos, msg = dep_row[i]
                if src >= 0:
                    dep_end = end[src][pos]
                    if dep_end != dep_end:  # NaN: producer not done yet
                        waiting[(src, pos)].append(rank)
                        break
                    arrival = dep_end + msg
                    if arrival > t:
                        t = arrival
                s_row[i] = t
                t += d_row[i]
                e_row[i] = t
                i += 1
                ptr[rank] = i
                free[rank] = t
                for w in waiting.pop((rank, i - 1), ()):
                    ready.append(w)
        unfinished = [r for r in live if ptr[r] < len(kinds[r])]
        if unfinished:
            heads = [(r, ptr[r]) for r in unfinished]
            raise PlanError("plan deadlocks in simulation (validate it first); blocked heads marked:\n"
                            + format_grid(plan, heads))
        it_start = min(start[r][0] for r in live)
        starts_it.append(it_start)
        span = 0.0
        for r in live:
            comp = [j for j, k in enumerate(kinds[r]) if k is not Kind.OPT]
            if comp:
                span = max(span, end[r][comp[-1]] - start[r][comp[0]])
        makespans.append(span)
        if record:
            for r in live:
                for j, tok in enumerate(tokens[r]):
                    timeline.append((r, it, tok, start[r][j], end[r][j]))

    if iterations >= 3:
        period = (starts_it[-1] - starts_it[1]) / (iterations - 2)
    elif iterations == 2:
        period = starts_it[1] - starts_it[0]
    else:
        period = max(free[r] for r in live) - starts_it[0]

    idle = []
    peaks = []
    peak_bytes = []
    for r in range(n):
        if r not in groups:
            idle.append(0.0)
            peaks.append(0)
            peak_bytes.append(0)
            continue
        busy = sum(durations[r])
        idle.append(max(0.0, 1.0 - busy / period) if period > 0 else 0.0)
        held = peak = 0
        for k in kinds[r]:
            if k is Kind.F:
                held += 1
                peak = max(peak, held)
            elif k is Kind.W or k is Kind.BW:
                held -= 1
        peaks.append(peak)
        peak_bytes.append(peak * config.memory.activation_bytes[plan.worker(r)[1]])
    live_idle = [idle[r] for r in live]
    return SimResult(
        period=period,
        makespan=makespans[-1],
        first_makespan=makespans[0],
        idle_fraction=tuple(idle),
        bubble_fraction=sum(live_idle) / len(live_idle),
        peak_activations=tuple(peaks),
        peak_activation_bytes=tuple(peak_bytes),
        iteration_starts=tuple(starts_it),
        num_iterations=iterations,
        num_actions=plan.num_actions * iterations,
        staggered=plan.staggered,
        timeline=tuple(timeline),
    )
