"""The heuristic's list scheduler stepped in numpy, one event time at a time: every free worker decides at once."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from recycle.config import Config
from recycle.ir.compact import CompactActions

__all__ = ["CompactSchedule", "ReadySets", "vector_list_schedule", "vector_eligible", "compact_actions"]

_F, _B, _W = 0, 1, 2  # the list scheduler's action codes (_B is a fused BW when the plan is not decoupled)
_EMPTY = np.iinfo(np.int64).max  # a removed ready item
# One numpy step (~50 array calls) costs what ~100 actions of the Python loop cost: on uniform shapes the numpy
# scheduler was 2-5x slower at 19-42 actions per estimated step, as fast at ~100 and 2-3x faster at ~200
# (`benchmarks/bench_planner_speed.py`, "crossover").
MIN_ACTIONS_PER_STEP = 100


@dataclass(frozen=True)
class CompactSchedule:
    """A list schedule as flat arrays, sorted by (rank, start): one row per action."""

    rank: np.ndarray
    code: np.ndarray
    mb: np.ndarray
    start: np.ndarray
    end: np.ndarray
    bounds: np.ndarray  # rank r's actions are rows bounds[r]:bounds[r + 1]

    def counts(self) -> list[int]:
        """Actions per rank."""
        return np.diff(self.bounds).tolist()

    def stage_extents(self, num_stages: int) -> tuple[list[float], list[float]]:
        """`recycle.planner.local_search.stage_extents` of these entries: per stage the earliest start and the
        latest end (inf / 0 when idle)."""
        first, last = [math.inf] * num_stages, [0.0] * num_stages
        busy = np.flatnonzero(np.diff(self.bounds) > 0)
        heads = self.start[self.bounds[busy]].tolist()
        tails = self.end[self.bounds[busy + 1] - 1].tolist()
        for rank, head, tail in zip(busy.tolist(), heads, tails):
            s = rank % num_stages
            last[s] = max(last[s], tail)
            first[s] = min(first[s], head)
        return first, last

    def entries(self) -> tuple[tuple[tuple[int, int, float, float], ...], ...]:
        """The per-rank (code, mb, start, end) tuples of the Python list scheduler."""
        rows = list(zip(self.code.tolist(), self.mb.tolist(), self.start.tolist(), self.end.tolist()))
        cut = self.bounds.tolist()
        return tuple(tuple(rows[cut[r]:cut[r + 1]]) for r in range(len(cut) - 1))


def vector_eligible(durations: Sequence[float], messages: Sequence[float], actions: int, steps: float) -> bool:
    """True when stepping time in numpy gives the Python scheduler's plan and is faster.

    Same plan: every duration is a whole number >= 1 and every message time a whole number >= 0 (all times are
    then exact integers, and an action started at t cannot make anything ready at t, so the workers deciding at
    one time are independent). Faster: a numpy step costs about as much as 100 actions of the Python loop, so
    the `actions` must be at least MIN_ACTIONS_PER_STEP times the estimated number of distinct event times
    (`steps`, e.g. the busiest worker's work plus one round trip, in whole units).
    """
    values = [*durations, *messages]
    if any(not math.isfinite(v) or v != int(v) or v < 0 for v in values) or min(durations) < 1:
        return False
    return actions >= MIN_ACTIONS_PER_STEP * steps


class ReadySets:
    """Per worker, the ready items of one kind with an int64 priority key each (smaller first; keys are unique).

    Worker r's items live in slots base[r]..base[r] + capacity[r] in arrival order; removed ones are marked
    _EMPTY, and lo[r] skips the removed prefix, so a pop scans only the live window lo[r]:hi[r].
    """

    def __init__(self, capacity: np.ndarray) -> None:
        base = np.zeros(len(capacity), dtype=np.int64)
        np.cumsum(capacity[:-1], out=base[1:])
        self.keys = np.full(int(capacity.sum()), _EMPTY, dtype=np.int64)
        self.lo = base.copy()
        self.hi = base.copy()
        self.count = np.zeros(len(capacity), dtype=np.int64)
        self.stamp = np.zeros(len(capacity), dtype=np.int64)  # scratch: detects a rank given several items

    def add(self, ranks: np.ndarray, keys: np.ndarray) -> None:
        """Insert keys[i] into ranks[i]'s set (a rank may appear several times)."""
        position = np.arange(len(ranks))
        self.stamp[ranks] = position
        if (self.stamp[ranks] == position).all():  # distinct ranks (the usual case): no sort needed
            self.keys[self.hi[ranks]] = keys
            self.hi[ranks] += 1
            self.count[ranks] += 1
            return
        order = np.argsort(ranks, kind="stable")
        ranks, keys = ranks[order], keys[order]
        unique, first, counts = np.unique(ranks, return_index=True, return_counts=True)
        within = np.arange(len(ranks)) - np.repeat(first, counts)
        self.keys[self.hi[ranks] + within] = keys
        self.hi[unique] += counts
        self.count[unique] += counts

    def pop_min(self, ranks: np.ndarray) -> np.ndarray:
        """Remove and return the smallest key of each of the (distinct, non-empty) ranks."""
        lo, hi = self.lo[ranks], self.hi[ranks]
        lengths = hi - lo
        offsets = np.zeros(len(ranks), dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        slots = np.repeat(lo - offsets, lengths) + np.arange(int(lengths.sum()))
        window = self.keys[slots]
        smallest = np.minimum.reduceat(window, offsets)
        self.keys[slots[window == np.repeat(smallest, lengths)]] = _EMPTY
        self.count[ranks] -= 1
        moving = ranks
        while len(moving):  # advance lo past the removed prefix
            here = self.lo[moving]
            moving = moving[(here < self.hi[moving]) & (self.keys[np.minimum(here, len(self.keys) - 1)] == _EMPTY)]
            self.lo[moving] += 1
        return smallest


def vector_list_schedule(num_replicas: int, num_stages: int, num_microbatches: int, host: Sequence[Sequence[int]],
                         durations: Sequence[tuple[float, float, float]], p2p: Sequence[float],
                         limit: Sequence[float], static_key: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
                         static_max: int, use_ready: bool, forward_first: bool,
                         alternate: bool, decoupled: bool) -> CompactSchedule:
    """The list schedule of `recycle.planner.heuristic.list_schedule` for a deterministic rule, time step by step.

    At each event time every free worker with something to do decides at once, with the Python scheduler's rule:
    a ready B first (with `alternate`: unless an F may run and the last F-or-B was a B), then an F below the
    worker's limit (with `forward_first`, or when no W waits), then a W. Ready F's and B's are taken smallest key
    first, key = (static_key(stage, replica, mb) (int64, at most `static_max`), ready time if `use_ready`, mb):
    the Python scheduler's heap order. W's are taken in the order of their B's. Only valid when `vector_eligible`
    (whole-unit times). Raises OverflowError when the keys would not fit in 64 bits.
    """
    stepper = _Stepper(num_replicas, num_stages, num_microbatches, host, durations, p2p, limit, static_key,
                       static_max, use_ready, forward_first, alternate, decoupled)
    while stepper.times:
        t = heapq.heappop(stepper.times)
        stepper.receive(t)
        rf, rb, rw = stepper.decide(t)
        if len(rf) or len(rb) or len(rw):
            stepper.start(t, rf, rb, rw)
    return stepper.schedule()


class _Stepper:
    """The state of one numpy list schedule: ready sets, W queues, busy times and live counts per rank, and the
    pending items by exact time (code -1: a completion, a time to decide at without an item)."""

    def __init__(self, D: int, S: int, M: int, host: Sequence[Sequence[int]],
                 durations: Sequence[tuple[float, float, float]], p2p: Sequence[float], limit: Sequence[float],
                 static_key: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray], static_max: int,
                 use_ready: bool, forward_first: bool, alternate: bool, decoupled: bool) -> None:
        n = D * S
        self.S, self.TM = S, D * M
        self.static_key, self.use_ready = static_key, use_ready
        self.forward_first, self.alternate, self.decoupled = forward_first, alternate, decoupled
        self.stage_of = np.arange(n, dtype=np.int64) % S
        self.replica_of = np.arange(n, dtype=np.int64) // S
        # [stage, mb] -> the rank that runs it
        self.dest_rank = np.asarray(host, dtype=np.int64) * S + np.arange(S, dtype=np.int64)[:, None]
        loads = np.bincount(self.dest_rank.ravel(), minlength=n)
        self.dur = np.asarray(durations, dtype=np.float64)  # [stage, code]
        self.p2p = np.asarray(p2p, dtype=np.float64)
        self.limit = np.asarray(limit, dtype=np.float64)
        self.ready_f, self.ready_b = ReadySets(loads), ReadySets(loads)
        self.w_mb = np.zeros(int(loads.sum()), dtype=np.int64)  # per rank a FIFO: W's run in the order of their B's
        self.w_head = np.zeros(n, dtype=np.int64)
        np.cumsum(loads[:-1], out=self.w_head[1:])
        self.w_tail = self.w_head.copy()
        self.busy = np.zeros(n)
        self.live = np.zeros(n, dtype=np.int64)
        self.last = np.full(n, -1, dtype=np.int64)
        # Keys must stay below _EMPTY. No time exceeds all the work plus every message, one after another: until
        # the iteration ends, some action runs or some message is on its way at every moment.
        horizon = int((loads * self.dur[self.stage_of].sum(axis=1)).sum()
                      + 2 * self.TM * S * self.p2p.max(initial=0.0)) + 1
        self.scale = horizon if use_ready else 1
        if (static_max + 1) * self.scale * self.TM >= _EMPTY:
            raise OverflowError("priority keys do not fit in 64 bits; use the Python list scheduler")
        self.pending: dict[float, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self.times: list[float] = []  # a heap of the pending times
        # The schedule, written in place: rank r's actions fill rows slot[r]... in start order (steps are in time
        # order and start at most one action per rank), up to its capacity.
        capacity = loads * (3 if decoupled else 2)
        self.base = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(capacity, out=self.base[1:])
        self.slot = self.base[:-1].copy()
        total = int(self.base[-1])
        self.rows = (np.zeros(total, dtype=np.int64), np.zeros(total, dtype=np.int64), np.zeros(total, dtype=np.int64),
                     np.zeros(total), np.zeros(total))  # rank, code, mb, start, end
        TM = self.TM
        self.queue(np.zeros(TM), self.dest_rank[0], np.zeros(TM, dtype=np.int64), np.arange(TM, dtype=np.int64))

    def schedule(self) -> CompactSchedule:
        """The rows written so far (all of them unless a worker stalled, which the caller reports)."""
        n = len(self.slot)
        filled = self.slot - self.base[:-1]
        bounds = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(filled, out=bounds[1:])
        rows = self.rows
        if bounds[-1] != self.base[-1]:  # keep the written rows only
            index = np.arange(int(self.base[-1]))
            written = index < np.repeat(self.slot, np.diff(self.base))
            rows = tuple(column[written] for column in rows)
        return CompactSchedule(*rows, bounds)

    def queue(self, when: np.ndarray, ranks: np.ndarray, codes: np.ndarray, mbs: np.ndarray) -> None:
        if not len(when):
            return
        if when.min() == when.max():  # one time (the usual case): no sort, no masks
            value = float(when[0])
            bucket = self.pending.get(value)
            if bucket is None:
                self.pending[value] = bucket = []
                heapq.heappush(self.times, value)
            bucket.append((ranks, codes, mbs))
            return
        for value in np.unique(when).tolist():
            pick = when == value
            bucket = self.pending.get(value)
            if bucket is None:
                self.pending[value] = bucket = []
                heapq.heappush(self.times, value)
            bucket.append((ranks[pick], codes[pick], mbs[pick]))

    def wake(self, when: np.ndarray) -> None:
        low, high = when.min(), when.max()
        for value in ((float(low),) if low == high else np.unique(when).tolist()):
            if value not in self.pending:
                self.pending[value] = []
                heapq.heappush(self.times, value)

    def receive(self, t: float) -> None:
        """Move the items that become ready at t into their workers' ready sets."""
        bucket = self.pending.pop(t)
        if not bucket:
            return
        ranks = np.concatenate([b[0] for b in bucket])
        codes = np.concatenate([b[1] for b in bucket])
        mbs = np.concatenate([b[2] for b in bucket])
        keys = self.static_key(self.stage_of[ranks], self.replica_of[ranks], mbs) * self.scale
        if self.use_ready:
            keys += int(t)
        keys = keys * self.TM + mbs
        is_f = codes == _F
        if is_f.any():
            self.ready_f.add(ranks[is_f], keys[is_f])
        if not is_f.all():
            self.ready_b.add(ranks[~is_f], keys[~is_f])

    def decide(self, t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The free ranks that start an F, a B and a W at t."""
        free = self.busy <= t
        has_b = self.ready_b.count > 0
        has_w = self.w_head < self.w_tail
        can_f = (self.ready_f.count > 0) & (self.live < self.limit)
        take_b = free & has_b
        if self.alternate:
            take_b &= ~(can_f & (self.last == _B))
        take_f = free & ~take_b & can_f
        if not self.forward_first:
            take_f &= ~has_w
        take_w = free & ~take_b & ~take_f & has_w
        return np.flatnonzero(take_f), np.flatnonzero(take_b), np.flatnonzero(take_w)

    def start(self, t: float, rf: np.ndarray, rb: np.ndarray, rw: np.ndarray) -> None:
        """Start the chosen actions at t, record them, and queue what they send and when their workers are free."""
        S, TM = self.S, self.TM
        mb_b = self.ready_b.pop_min(rb) % TM if len(rb) else rb
        mb_f = self.ready_f.pop_min(rf) % TM if len(rf) else rf
        mb_w = self.w_mb[self.w_head[rw]]
        self.w_head[rw] += 1
        self.live[rf] += 1
        self.live[rw] -= 1
        if not self.decoupled:
            self.live[rb] -= 1
        self.last[rb] = _B
        self.last[rf] = _F
        ranks = np.concatenate((rf, rb, rw))
        codes = np.concatenate((np.full(len(rf), _F), np.full(len(rb), _B), np.full(len(rw), _W)))
        mbs = np.concatenate((mb_f, mb_b, mb_w))
        stages = self.stage_of[ranks]
        ends = t + self.dur[stages, codes]
        self.busy[ranks] = ends
        rows = self.slot[ranks]
        self.slot[ranks] += 1
        for column, values in zip(self.rows, (ranks, codes, mbs, t, ends)):
            column[rows] = values
        self.wake(ends)
        if self.decoupled and len(rb):
            self.w_mb[self.w_tail[rb]] = mb_b
            self.w_tail[rb] += 1
        # Forward outputs go downstream (the last stage turns its own F into a B); input-gradients go upstream.
        f_end, f_stage = ends[:len(rf)], stages[:len(rf)]
        turn = f_stage == S - 1
        down = ~turn
        self.queue(f_end[down] + self.p2p[f_stage[down]], self.dest_rank[f_stage[down] + 1, mb_f[down]],
                   np.full(int(down.sum()), _F), mb_f[down])
        self.queue(f_end[turn], rf[turn], np.full(int(turn.sum()), _B), mb_f[turn])
        b_end, b_stage = ends[len(rf):len(rf) + len(rb)], stages[len(rf):len(rf) + len(rb)]
        up = b_stage > 0
        self.queue(b_end[up] + self.p2p[b_stage[up] - 1], self.dest_rank[b_stage[up] - 1, mb_b[up]],
                   np.full(int(up.sum()), _B), mb_b[up])


def compact_actions(config: Config, compact: CompactSchedule, decoupled: bool, merge: bool) -> CompactActions:
    """`recycle.planner.heuristic._to_actions` on a numpy list schedule: B;W pairs fused by the same rule in numpy
    (the same floats, compared in the same order), then one OPT at the end of every non-empty list."""
    S = config.num_stages
    TM = config.num_replicas * config.num_microbatches
    c = config.costs
    code, mb, start = compact.code, compact.mb, compact.start
    stage = compact.rank % S
    out_code = np.where(code == _B, 1 if decoupled else 3, code)  # KIND_CODES: F, B, W, BW, OPT
    keep = np.ones(len(code), dtype=bool)
    if merge and decoupled and len(code):
        fused = np.asarray(c.backward_fused, dtype=np.float64)
        split = np.asarray(c.backward_input, dtype=np.float64) + np.asarray(c.backward_weight, dtype=np.float64)
        fused_ok = fused <= split
        message = np.asarray([0.0] + [config.communication.p2p_time(s) for s in range(S - 1)])
        b_start = np.zeros(S * TM)
        is_b = code == _B
        b_start[(stage * TM + mb)[is_b]] = start[is_b]
        nxt = np.arange(1, len(code) + 1)
        has_next = nxt < compact.bounds[compact.rank + 1]  # the next row is on the same worker
        nxt = np.minimum(nxt, len(code) - 1)
        upstream_ok = (stage == 0) | (b_start[np.maximum(stage - 1, 0) * TM + mb]
                                      >= start + fused[stage] + message[stage])
        pair = (is_b & has_next & (code[nxt] == _W) & (mb[nxt] == mb) & fused_ok[stage] & upstream_ok)
        out_code = np.where(pair, 3, out_code)
        keep[np.flatnonzero(pair) + 1] = False
    counts = np.bincount(compact.rank[keep], minlength=len(compact.bounds) - 1)
    counts = counts + (counts > 0)  # the OPT
    bounds = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    total = int(bounds[-1])
    is_opt = np.zeros(total, dtype=bool)
    is_opt[bounds[1:][counts > 0] - 1] = True
    new_code = np.full(total, 4, dtype=np.int64)
    new_stage = np.repeat(np.arange(len(counts), dtype=np.int64) % S, counts)
    new_mb = np.full(total, -1, dtype=np.int64)
    new_code[~is_opt] = out_code[keep]
    new_mb[~is_opt] = mb[keep]
    return CompactActions(bounds, new_code, new_stage, new_mb)
