"""Deadline list schedules: stage-0 sequences packed against the lower bound give every action a latest start."""

from __future__ import annotations

import heapq
import math
import random
from typing import Sequence

from recycle.ir.actions import Kind
from recycle.ir.dependencies import output_stage_table
from recycle.planner.budget import LIST_SCHEDULE_COST, WorkBudget
from recycle.planner.local_search import OrderEvaluator

__all__ = ["spread_sequences", "latest_starts", "deadline_orders", "improve_sequences", "SPREAD_WINDOW"]

_F, _B, _W = 0, 1, 2  # the list scheduler's action codes (_B is a fused BW when not decoupled)
Sequences = dict[int, list[int]]
Orders = list[list[tuple[int, int]]]
# How many earlier positions `spread_sequences` keeps a stage-0 pick's downstream workers marked as busy: a gradient
# comes back several forwards later, so two micro-batches sent a few positions apart still meet downstream.
SPREAD_WINDOW = 2


def spread_sequences(host: Sequence[Sequence[int]], num_replicas: int, num_stages: int, num_microbatches: int,
                     window: int = SPREAD_WINDOW) -> Sequences:
    """Per stage-0 worker the order of its micro-batches: position by position, busiest workers first, each takes
    the micro-batch whose downstream workers the picks of this and the last `window` positions use least (ties:
    the slot order: slot, then pipeline). Micro-batches sent together then return without queueing behind each
    other, which the busiest worker needs when its first gradient must come back after one round trip."""
    M, S = num_microbatches, num_stages
    left: Sequences = {}
    for mb in range(num_replicas * M):
        left.setdefault(host[0][mb], []).append(mb)
    for mbs in left.values():
        mbs.sort(key=lambda mb: (mb % M, mb))  # the slot, then the pipeline
    routes = {mb: {(s, host[s][mb]) for s in range(1, S)} for mbs in left.values() for mb in mbs}
    workers = sorted(left, key=lambda p: (-len(left[p]), p))
    out: Sequences = {p: [] for p in left}
    history: list[set[tuple[int, int]]] = []
    while any(left.values()):
        now: set[tuple[int, int]] = set()
        recent = set().union(*history[len(history) - window:]) if window else set()
        for p in workers:
            mbs = left[p]
            if not mbs:
                continue
            pick = min(range(len(mbs)), key=lambda i: (2 * len(routes[mbs[i]] & now) + len(routes[mbs[i]] & recent), i))
            mb = mbs.pop(pick)
            out[p].append(mb)
            now |= routes[mb]
        history.append(now)
    return out


def latest_starts(num_stages: int, dur: Sequence[tuple[float, float, float]], p2p: Sequence[float], decoupled: bool,
                  target: float, sequences: Sequences) -> dict[tuple[int, int, int], float]:
    """(code, stage, mb) -> latest start: each stage-0 worker runs its micro-batches' last actions (BW, or B and W)
    back to back in `sequences`' order, the last one ending at `target`; from there backwards along the route (the
    B's from stage 0 up to the last stage, then the F's down to stage 0)."""
    S = num_stages
    weight = dur[0][_W] if decoupled else 0.0
    tail = dur[0][_B] + weight
    latest: dict[tuple[int, int, int], float] = {}
    for mbs in sequences.values():
        for j, mb in enumerate(mbs):
            finish = target - (len(mbs) - 1 - j) * tail - weight
            for s in range(S):
                latest[(_B, s, mb)] = start = finish - dur[s][_B]
                finish = start - (p2p[s] if s + 1 < S else 0.0)
            for s in range(S - 1, -1, -1):
                latest[(_F, s, mb)] = start = finish - dur[s][_F]
                finish = start - (p2p[s - 1] if s > 0 else 0.0)
    return latest


def deadline_orders(num_replicas: int, num_stages: int, num_microbatches: int, host: Sequence[Sequence[int]],
                    dur: Sequence[tuple[float, float, float]], p2p: Sequence[float], decoupled: bool,
                    caps: Sequence[int] | None, latest: dict[tuple[int, int, int], float]) -> Orders:
    """Per rank the (code, mb) order of a list schedule by latest start: a free worker starts the ready F or B with
    the earlier latest start (a tie: the B; an F only below the worker's cap), else a W; an F that would delay a B
    with an earlier latest start already on its way waits (the worker runs a W that fits first, or idles)."""
    D, S = num_replicas, num_stages
    ranks = D * S
    arrivals: list[list[tuple[float, int, int, int]]] = [[] for _ in range(ranks)]
    ready_f: list[list[tuple[float, float, int]]] = [[] for _ in range(ranks)]
    ready_b: list[list[tuple[float, float, int]]] = [[] for _ in range(ranks)]
    ready_w: list[list[tuple[float, int]]] = [[] for _ in range(ranks)]
    busy, live = [0.0] * ranks, [0] * ranks
    limit = [math.inf if caps is None else caps[r % S] for r in range(ranks)]
    orders: Orders = [[] for _ in range(ranks)]
    events: list[tuple[float, int, int]] = []
    seq = 0
    for mb in range(D * num_microbatches):
        arrivals[host[0][mb] * S].append((0.0, seq, _F, mb))
        seq += 1
    for p in range(D):
        heapq.heappush(events, (0.0, seq, p * S))
        seq += 1
    send_f, send_b = output_stage_table((Kind.F, Kind.B), S)
    push, pop = heapq.heappush, heapq.heappop
    # The event loop and the hand-on of a finished F or B to its next worker are heuristic.py's list scheduler's,
    # written out again (not called): it is the inner loop of the search, paid per action; only the choice of the
    # ready action (by latest start) differs.
    while events:
        t, _, rank = pop(events)
        if busy[rank] > t:
            continue  # stale: its completion event decides
        stage = rank % S
        arr, rf, rb, rw = arrivals[rank], ready_f[rank], ready_b[rank], ready_w[rank]
        while arr and arr[0][0] <= t:
            ready, _, code, mb = pop(arr)
            push(rf if code == _F else rb, (latest[(code, stage, mb)], ready, mb))
        can_forward = bool(rf) and live[rank] < limit[rank]
        if rb and (not can_forward or rb[0][0] <= rf[0][0]):
            code = _B
        elif can_forward:
            code = _F
            due = [a[0] for a in arr if a[2] == _B and a[0] < t + dur[stage][_F]
                   and latest[(_B, stage, a[3])] < rf[0][0] + dur[stage][_F]]
            if due:
                code = _W if rw and t + dur[stage][_W] <= min(due) else -1
        else:
            code = _W if rw else -1
        if code < 0:
            if arr:
                push(events, (arr[0][0], seq, rank))
                seq += 1
            continue
        if code == _W:
            mb = pop(rw)[1]
            live[rank] -= 1
        else:
            mb = pop(rb if code == _B else rf)[-1]
        end = t + dur[stage][code]
        orders[rank].append((code, mb))
        busy[rank] = end
        push(events, (end, seq, rank))
        seq += 1
        if code == _F:
            live[rank] += 1
            nxt = send_f[stage]
            if nxt >= 0:
                dest, ready, arrival = host[nxt][mb] * S + nxt, end + p2p[stage], _F
            else:
                dest, ready, arrival = rank, end, _B  # the loss turn-around on the same worker
        elif code == _B:
            if decoupled:
                push(rw, (end, mb))
            else:
                live[rank] -= 1
            nxt = send_b[stage]
            if nxt < 0:
                continue
            dest, ready, arrival = host[nxt][mb] * S + nxt, end + p2p[nxt], _B
        else:
            continue
        push(arrivals[dest], (ready, seq, arrival, mb))
        push(events, (ready, seq + 1, dest))
        seq += 2
    return orders


def improve_sequences(evaluator: OrderEvaluator, host: Sequence[Sequence[int]], num_microbatches: int,
                      target: float, budget: WorkBudget, seed: int = 0
                      ) -> tuple[list[list[tuple[int, int, float, float]]], tuple[float, float]] | None:
    """Deadline list schedules from `spread_sequences`, then seeded moves of one micro-batch 1-3 places in one
    stage-0 worker's sequence (half of them on the workers with the most micro-batches), kept when the score
    (period estimate, every worker's end largest first, stage spans) does not worsen; every schedule (list
    schedule and timing) is paid from `budget`; stops at `target`. The best timed orders and their
    (estimate, spans), or None when the budget cannot pay for one schedule."""
    D, S, M = evaluator.D, evaluator.S, num_microbatches
    total = (3 if evaluator.decoupled else 2) * S * len(host[0])  # actions per iteration
    cost = max(1, (LIST_SCHEDULE_COST + 1) * total)  # a list schedule and its timing

    def evaluate(sequences: Sequences) -> tuple[tuple, list[list[tuple[int, int, float, float]]] | None]:
        latest = latest_starts(S, evaluator.dur, evaluator.p2p, evaluator.decoupled, target, sequences)
        orders = deadline_orders(D, S, M, host, evaluator.dur, evaluator.p2p, evaluator.decoupled, evaluator.caps,
                                 latest)
        # Every action once (a stalled schedule would leave some out, and the timing only sees what is there).
        timed = evaluator.time(orders) if sum(map(len, orders)) == total else None
        if timed is None:  # over a cap, or incomplete
            return (math.inf,), None
        period, spans = evaluator.score(timed)
        return (period, tuple(sorted((row[-1][3] for row in timed if row), reverse=True)), spans), timed

    if not budget.afford(cost):
        return None
    sequences = spread_sequences(host, D, S, M)
    best, best_timed = evaluate(sequences)
    rng = random.Random(seed)
    most = max(len(mbs) for mbs in sequences.values())
    busiest = [p for p, mbs in sequences.items() if len(mbs) == most]
    workers = sorted(sequences)
    for _ in range(2 * (budget.left // cost)):  # draws off the sequence's ends are not paid for: bound them too
        if best[0] <= target + 1e-9:
            break
        p = rng.choice(busiest) if rng.random() < 0.5 else rng.choice(workers)
        row = sequences[p]
        i = rng.randrange(len(row))
        j = i + rng.choice((-3, -2, -1, 1, 2, 3))
        if not 0 <= j < len(row):
            continue
        if not budget.afford(cost):
            break
        moved = row[:i] + row[i + 1:]
        moved.insert(j, row[i])
        trial = {**sequences, p: moved}
        score, timed = evaluate(trial)
        if score <= best:
            best, best_timed, sequences = score, timed, trial
    if best_timed is None:
        return None
    return best_timed, (best[0], best[2])
