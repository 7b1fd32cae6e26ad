"""Local search over a list schedule's per-worker orders: moves evaluated by one iteration's as-soon-as-possible timing."""

from __future__ import annotations

import math
import random
from typing import Sequence

from recycle.config import Config
from recycle.ir.actions import Kind
from recycle.ir.dependencies import input_stage_table, output_stage_table
from recycle.planner.budget import WorkBudget

__all__ = ["OrderEvaluator", "improve_orders", "stage_extents"]

_F, _B, _W = 0, 1, 2  # the list scheduler's action codes (_B is a fused BW when not decoupled)
# The share of order moves drawn from the critical path's N5 moves (the rest: half on the bottleneck stage, half
# anywhere). Random single-action moves rarely hit the one swap on another stage that lets a late gradient through
# (issue 26, seed 1 case 283: one such swap took a rule schedule from 80 to the optimum 78). On the F != B != W
# screens each of 0.15, 0.25, 0.35 and 0.5 closed seed 1 case 6 and seed 0 case 94; 0.15, 0.35 and 0.5 also seed 1
# case 179 (57 -> 56); 0.25 instead took seed 1 case 283 from 81 to 80 (the largest gap left) and issue 10's
# screen case 87 from 31 to 30 (docs/planner.md, "Bottleneck-forward rule and critical-path moves").
CRITICAL_SHARE = 0.25


def stage_extents(timed: Sequence[Sequence[tuple[int, int, float, float]]], num_stages: int
                  ) -> tuple[list[float], list[float]]:
    """Per stage, the earliest start and the latest end over its workers' timed actions (inf / 0 when idle)."""
    first = [math.inf] * num_stages
    last = [0.0] * num_stages
    for rank, row in enumerate(timed):
        if row:
            s = rank % num_stages
            last[s] = max(last[s], row[-1][3])
            first[s] = min(first[s], row[0][2])
    return first, last


class OrderEvaluator:
    """Times fixed per-worker orders as early as the dependencies allow and scores them like the list scheduler.

    Dependencies: F(s-1) -> F(s) after a p2p message, F(S-1) -> B(S-1) on the same worker, B(s+1) -> B(s) after a
    message, B -> W on the same worker; one action at a time per worker. Orders that deadlock or exceed a worker's
    activation cap (counted F start .. W end, or BW end when fused) score infinity.
    """

    def __init__(self, config: Config, key: Sequence[int], host: Sequence[Sequence[int]], decoupled: bool,
                 staggered: bool, caps: Sequence[int] | None, opt: Sequence[float]) -> None:
        self.S = config.num_stages
        self.D = config.num_replicas
        self.total = self.D * config.num_microbatches
        c = config.costs
        self.p2p = [config.communication.p2p_time(s) for s in range(self.S)]
        self.dur = [(c.forward[s], c.backward_input[s] if decoupled else c.backward_fused[s], c.backward_weight[s])
                    for s in range(self.S)]
        # The dependency rule (recycle.ir.dependencies), tabled per code (_F, _B, _W): the stage an action's message
        # comes from and the stage its own message goes to, -1: none.
        kinds = (Kind.F, Kind.B, Kind.W)
        self.needs = input_stage_table(kinds, self.S)
        self.sends = output_stage_table(kinds, self.S)
        self.host = host
        self.decoupled = decoupled
        self.staggered = staggered
        self.caps = caps
        self.opt = list(opt)

    def _id(self, code: int, stage: int, mb: int) -> int:
        return (code * self.S + stage) * self.total + mb

    def time(self, orders: Sequence[Sequence[tuple[int, int]]],
             base: Sequence[Sequence[tuple[int, int, float, float]]] | None = None, moved_rank: int = -1,
             moved_from: int = 0) -> list[list[tuple[int, int, float, float]]] | None:
        """Per rank the (code, mb, start, end) entries of `orders` timed as soon as possible; None on deadlock.

        `base`: the timing of orders that differ from `orders` only on `moved_rank` from position `moved_from` on
        (one move); its actions that start before that rank's free time at `moved_from` are taken as they are and
        only the rest is timed (the same timing: docs/planner.md, "Order moves re-time only what they can move")."""
        S, total, host, p2p, dur = self.S, self.total, self.host, self.p2p, self.dur
        needs_f, needs_b = self.needs[_F], self.needs[_B]
        sends = self.sends
        end = [-1.0] * (3 * S * total)
        free = [0.0] * len(orders)
        pos = [0] * len(orders)
        out: list[list[tuple[int, int, float, float]]] = [[] for _ in orders]
        live = [0] * len(orders)
        stack = [r for r in range(len(orders)) if orders[r]]
        remaining = sum(len(o) for o in orders)
        if base is not None and moved_from > 0:
            # Every action that started before `cutoff` depends (through its worker and its inputs) only on actions
            # that started before it too, and none of them is at or after the move (those start at `cutoff` or
            # later): its start and end are the same under both orders.
            cutoff = base[moved_rank][moved_from - 1][3]
            freed = _W if self.decoupled else _B  # the code that releases a live micro-batch
            for rank, kept in enumerate(base):
                stage = rank % S
                k = 0
                for code, mb, start, finish in kept:
                    if start >= cutoff:
                        break
                    end[(code * S + stage) * total + mb] = finish
                    if code == _F:
                        live[rank] += 1
                    elif code == freed:
                        live[rank] -= 1
                    k += 1
                if k:
                    out[rank] = list(kept[:k])
                    pos[rank] = k
                    free[rank] = kept[k - 1][3]
                    remaining -= k
        while stack:
            rank = stack.pop()
            row = orders[rank]
            stage = rank % S
            cap = math.inf if self.caps is None else self.caps[stage]
            while pos[rank] < len(row):
                code, mb = row[pos[rank]]
                if code == _F:
                    source = needs_f[stage]
                    if source < 0:
                        ready = 0.0
                    else:
                        dep = end[(0 * S + source) * total + mb]
                        if dep < 0:
                            break
                        ready = dep + p2p[source]  # boundary(stage, source)
                    if live[rank] >= cap:
                        return None
                    live[rank] += 1
                elif code == _B:
                    source = needs_b[stage]
                    if source < 0:  # the last stage: after its own F (the loss turn-around, local_input)
                        dep = end[(0 * S + stage) * total + mb]
                        ready = dep
                    else:
                        dep = end[(1 * S + source) * total + mb]
                        ready = dep + p2p[stage]  # boundary(stage, source)
                    if dep < 0:
                        break
                    if not self.decoupled:
                        live[rank] -= 1
                else:
                    ready = end[(1 * S + stage) * total + mb]
                    if ready < 0:
                        break
                    live[rank] -= 1
                start = max(free[rank], ready)
                finish = start + dur[stage][code]
                end[(code * S + stage) * total + mb] = finish
                free[rank] = finish
                out[rank].append((code, mb, start, finish))
                pos[rank] += 1
                remaining -= 1
                # Wake the worker that waits on this action's message (the next stage's F, the previous stage's B).
                dest = sends[code][stage]
                if dest >= 0:
                    stack.append(host[dest][mb] * S + dest)
        return out if remaining == 0 else None

    def critical_blocks(self, timed: Sequence[Sequence[tuple[int, int, float, float]]], rank: int
                        ) -> list[tuple[int, int, int]]:
        """The critical path that ends with `rank`'s last action, as (rank, first, last) position ranges of
        consecutive actions that each started the instant the one before on the same worker ended."""
        S, p2p = self.S, self.p2p
        where: dict[tuple[int, int, int], tuple[int, int]] = {}
        for r, row in enumerate(timed):
            s = r % S
            for i, (code, mb, _, _) in enumerate(row):
                where[(code, s, mb)] = (r, i)
        blocks: list[tuple[int, int, int]] = []
        pos = len(timed[rank]) - 1
        hi = pos
        while pos >= 0:
            row = timed[rank]
            code, mb, start, _ = row[pos]
            if pos > 0 and abs(row[pos - 1][3] - start) < 1e-9:
                pos -= 1  # waited for its own worker: the block goes on
                continue
            if hi > pos:
                blocks.append((rank, pos, hi))
            stage = rank % S
            if code == _F:
                source = self.needs[_F][stage]
                dep = (_F, source, mb) if source >= 0 else None
                lag = p2p[source] if source >= 0 else 0.0
            elif code == _B:
                source = self.needs[_B][stage]
                dep = (_B, source, mb) if source >= 0 else (_F, stage, mb)
                lag = p2p[stage] if source >= 0 else 0.0
            else:
                dep, lag = (_B, stage, mb), 0.0
            if dep is None or dep not in where:
                break
            r, i = where[dep]
            if abs(timed[r][i][3] + lag - start) > 1e-9:
                break  # started later than its message: nothing before it is critical
            rank, pos = r, i
            hi = pos
        return blocks

    def score(self, timed: Sequence[Sequence[tuple[int, int, float, float]]]) -> tuple[float, float]:
        """(period estimate, sum of per-stage spans): the list scheduler's estimate, then a tie-breaker that rewards
        finishing earlier (it lets the search cross plateaus of equal estimate)."""
        S = self.S
        first, last = stage_extents(timed, S)
        spans = sum(last[s] - first[s] for s in range(S) if first[s] < math.inf)
        if not self.staggered:
            return max(last) + max(self.opt), spans
        return max(last[s] + self.opt[s] - first[s] for s in range(S) if first[s] < math.inf), spans


def improve_orders(evaluator: OrderEvaluator, entries: Sequence[Sequence[tuple[int, int, float, float]]],
                   budget: WorkBudget, seed: int = 0, target: float = -math.inf
                   ) -> tuple[list[list[tuple[int, int, float, float]]], tuple[float, float]]:
    """Hill-climb on per-worker orders from a list schedule's `entries`; return the best timed orders and score.

    A move takes one action of a worker and re-inserts it up to four places earlier or later in the same worker's
    order (never past its own B/W partner), or, CRITICAL_SHARE of the time, swaps the first two or the last two
    actions of a block of the critical path (`_critical_moves`). Moves that do not worsen the score (period
    estimate, then the sum of stage spans) are kept. Of the other moves, workers on the bottleneck stage (the one
    whose span sets the estimate) are picked half of the time. Each move's timing spends the plan's action count
    from `budget` (the starting orders' timing is free); stops when the budget cannot pay for another move, after
    twice as many draws as it could pay for (draws that cross a partner are not timed), or when the estimate
    reaches `target` (a lower bound). Seeded and counted in work, never seconds, so the result is
    reproducible whatever the machine's load.
    """
    rng = random.Random(seed)
    orders = [[(code, mb) for code, mb, _, _ in row] for row in entries]
    timed = evaluator.time(orders)
    if timed is None:  # cannot happen for a list schedule; keep the input
        return [list(row) for row in entries], (math.inf, math.inf)
    best = evaluator.score(timed)
    best_timed = timed
    S = evaluator.S
    movable = [r for r, row in enumerate(orders) if len(row) > 1]
    if not movable:
        return best_timed, best
    cost = max(1, sum(len(row) for row in orders))
    bottleneck: list[int] | None = None  # the bottleneck stage's movable ranks, until the best changes
    critical: list[tuple[int, int, int]] | None = None  # the best's critical-path moves, until the best changes
    for _ in range(2 * (budget.left // cost)):
        if best[0] <= target + 1e-9:
            break
        draw = rng.random()
        if draw < CRITICAL_SHARE:
            if critical is None:
                critical = _critical_moves(evaluator, best_timed)
            if not critical:
                continue
            rank, i, j = rng.choice(critical)
            row = orders[rank]
        else:
            if draw < (1 + CRITICAL_SHARE) / 2:
                if bottleneck is None:
                    stage = _bottleneck_stage(best_timed, evaluator)
                    bottleneck = [r for r in movable if r % S == stage] or movable
                pool = bottleneck
            else:
                pool = movable
            rank = rng.choice(pool)
            row = orders[rank]
            i = rng.randrange(len(row))
            j = i + rng.choice((-4, -3, -2, -1, 1, 2, 3, 4))
            if not 0 <= j < len(row):
                continue
        item = row[i]
        lo, hi = min(i, j), max(i, j)
        if any(other[1] == item[1] for other in row[lo:hi + 1] if other is not item):
            continue  # would cross its own F/B/W partner on this worker: never valid
        if not budget.afford(cost):
            break
        candidate = row[:i] + row[i + 1:]
        candidate.insert(j, item)
        orders[rank] = candidate
        timed = evaluator.time(orders, best_timed, rank, lo)  # best_timed: the timing of the orders before the move
        score = evaluator.score(timed) if timed is not None else (math.inf, math.inf)
        if score <= best:
            best, best_timed, bottleneck, critical = score, timed, None, None
        else:
            orders[rank] = row
    return best_timed, best


def _critical_moves(evaluator: OrderEvaluator, timed: Sequence[Sequence[tuple[int, int, float, float]]]
                    ) -> list[tuple[int, int, int]]:
    """(rank, from, to) moves that swap the first two or the last two actions of a block on the critical path
    that ends the bottleneck stage's latest worker (the N5 neighbourhood of job-shop scheduling)."""
    S = evaluator.S
    stage = _bottleneck_stage(timed, evaluator)
    rank = max((r for r, row in enumerate(timed) if row and r % S == stage), key=lambda r: timed[r][-1][3])
    moves = set()
    for r, lo, hi in evaluator.critical_blocks(timed, rank):
        moves.add((r, lo, lo + 1))
        moves.add((r, hi, hi - 1))
    return sorted(moves)


def _bottleneck_stage(timed: Sequence[Sequence[tuple[int, int, float, float]]], evaluator: OrderEvaluator) -> int:
    S = evaluator.S
    first, last = stage_extents(timed, S)
    if evaluator.staggered:
        return max(range(S), key=lambda s: last[s] + evaluator.opt[s] - first[s] if first[s] < math.inf else -1)
    return max(range(S), key=lambda s: last[s])
