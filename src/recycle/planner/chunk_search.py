"""Local search over a chunked plan's per-worker orders: single-action moves, timed as soon as possible for one
iteration, kept when the makespan (then the sum of the workers' end times) does not get worse."""

from __future__ import annotations

import random
from typing import Sequence

from recycle.config import Config
from recycle.ir.actions import Action, Kind
from recycle.ir.costs import action_duration
from recycle.ir.plan import Plan

__all__ = ["ChunkOrderTimer", "improve_chunked"]

_INF = float("inf")


class ChunkOrderTimer:
    """Times fixed per-worker orders of a chunked plan (OPT left out) as early as the dependencies allow: F of chunk v
    after F of v-1, a backward after the next chunk's (the last chunk's after its own F), W after its B, one action
    at a time per worker, p2p time between different workers. Orders that deadlock, run W before its B or exceed a
    worker's cap (chunk activations, F .. W or BW) score infinity."""

    def __init__(self, plan: Plan, config: Config, caps: Sequence[int] | None) -> None:
        self.plan = plan
        S, C = plan.num_stages, plan.chunks
        self.S, self.V = S, plan.num_chunks
        where = plan.chunk_stages
        live = [len(plan.live_replicas(s)) for s in range(S)]
        self.dur = {k: [action_duration(config, k, where[v], live[where[v]]) / C for v in range(self.V)]
                    for k in (Kind.F, Kind.B, Kind.W, Kind.BW)}
        self.p2p = [config.communication.p2p_time(where[v]) for v in range(self.V)]
        self.caps = caps

    def score(self, orders: Sequence[Sequence[Action]]) -> tuple[float, float]:
        """(makespan, sum of the workers' last ends); (inf, inf) for an infeasible order."""
        plan, S, V, dur, p2p = self.plan, self.S, self.V, self.dur, self.p2p
        if self.caps is not None:
            for r, acts in enumerate(orders):
                held, cap = 0, self.caps[r % S]
                for a in acts:
                    if a.kind is Kind.F:
                        held += 1
                        if held > cap:
                            return _INF, _INF
                    elif a.kind is Kind.W or a.kind is Kind.BW:
                        held -= 1
        end: dict[tuple[Kind, int, int], float] = {}
        ptr = [0] * len(orders)
        free = [0.0] * len(orders)
        host, decoupled = plan.host, plan.decoupled_pairs
        progress = True
        remaining = sum(len(a) for a in orders)
        while progress and remaining:
            progress = False
            for r, acts in enumerate(orders):
                i, t = ptr[r], free[r]
                while i < len(acts):
                    a = acts[i]
                    kind, v, mb = a.kind, a.stage, a.mb
                    if kind is Kind.F:
                        src = (Kind.F, v - 1, mb) if v > 0 else None
                    elif kind is Kind.W:
                        src = (Kind.B, v, mb)
                    elif v == V - 1:
                        src = (Kind.F, v, mb)
                    else:
                        src = (Kind.B if (v + 1, mb) in decoupled else Kind.BW, v + 1, mb)
                    if src is not None:
                        at = end.get(src)
                        if at is None:
                            break
                        u = src[1]
                        if u != v and host[u][mb] * S + plan.chunk_stages[u] != r:
                            at += p2p[min(u, v)]
                        if at > t:
                            t = at
                    t += dur[kind][v]
                    end[(kind, v, mb)] = t
                    i += 1
                    remaining -= 1
                    progress = True
                ptr[r], free[r] = i, t
        if remaining:
            return _INF, _INF
        return max(free), sum(free)


def improve_chunked(plan: Plan, config: Config, caps: Sequence[int] | None, evaluations: int, seed: int = 0) -> Plan:
    """`evaluations` random single-action moves (up to 4 places within a worker's order, seeded: deterministic),
    each kept when the timer's score does not get worse; returns the plan with the improved orders."""
    timer = ChunkOrderTimer(plan, config, caps)
    orders = [[a for a in acts if a.kind is not Kind.OPT] for acts in plan.actions]
    best = timer.score(orders)
    rng = random.Random(seed)
    busy = [r for r, acts in enumerate(orders) if len(acts) > 1]
    if not busy or best[0] == _INF:
        return plan
    for _ in range(evaluations):
        r = rng.choice(busy)
        acts = orders[r]
        i = rng.randrange(len(acts))
        j = min(len(acts) - 1, max(0, i + rng.choice((-4, -3, -2, -1, 1, 2, 3, 4))))
        if i == j:
            continue
        moved = acts[:]
        moved.insert(j, moved.pop(i))
        orders[r] = moved
        score = timer.score(orders)
        if score <= best:
            best = score
        else:
            orders[r] = acts
    actions = tuple(tuple(o) + tuple(a for a in acts if a.kind is Kind.OPT) for o, acts in zip(orders, plan.actions))
    return Plan(plan.num_replicas, plan.num_stages, plan.num_microbatches, plan.host, actions, plan.failed,
                plan.staggered, plan.meta, plan.partition, plan.chunks, plan.chunk_layout)
