"""The heuristic's list scheduler stepped time by time in numpy: every free worker decides at once (whole-unit costs)."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = ["CompactSchedule", "ReadySets", "vector_list_schedule", "vector_eligible"]

_F, _B, _W = 0, 1, 2  # the list scheduler's action codes (_B is a fused BW when the plan is not decoupled)
_EMPTY = np.iinfo(np.int64).max  # a removed ready item
# Measured on uniform shapes: one numpy step (~40 array calls) costs what ~50 actions of the Python loop cost.
MIN_ACTIONS_PER_STEP = 50
MIN_ACTIONS = 4_000


@dataclass(frozen=True)
class CompactSchedule:
    """A list schedule as flat arrays, sorted by (rank, start): one row per action."""

    rank: np.ndarray
    code: np.ndarray
    mb: np.ndarray
    start: np.ndarray
    end: np.ndarray
    bounds: np.ndarray  # rank r's actions are rows bounds[r]:bounds[r + 1]

    def entries(self) -> tuple[tuple[tuple[int, int, float, float], ...], ...]:
        """The per-rank (code, mb, start, end) tuples of the Python list scheduler."""
        rows = list(zip(self.code.tolist(), self.mb.tolist(), self.start.tolist(), self.end.tolist()))
        cut = self.bounds.tolist()
        return tuple(tuple(rows[cut[r]:cut[r + 1]]) for r in range(len(cut) - 1))


def vector_eligible(durations: Sequence[float], messages: Sequence[float], actions: int, steps: float) -> bool:
    """True when stepping time in numpy gives the Python scheduler's plan and is faster.

    Same plan: every duration is a whole number >= 1 and every message time a whole number >= 0 (all times are
    then exact integers, and an action started at t cannot make anything ready at t, so the workers deciding at
    one time are independent). Faster: a numpy step costs about as much as 50 actions of the Python loop, so
    the `actions` must be at least MIN_ACTIONS_PER_STEP times the estimated number of distinct event times
    (`steps`, e.g. the busiest worker's work plus one round trip, in whole units).
    """
    values = [*durations, *messages]
    if any(not math.isfinite(v) or v != int(v) or v < 0 for v in values) or min(durations) < 1:
        return False
    return actions >= MIN_ACTIONS and actions >= MIN_ACTIONS_PER_STEP * steps


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

    def add(self, ranks: np.ndarray, keys: np.ndarray) -> None:
        """Insert keys[i] into ranks[i]'s set (a rank may appear several times)."""
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
    first, key = (static_key(stage, replica, mb) (int64, at most `static_max`), ready time if `use_ready`, mb): the Python scheduler's
    heap order. W's are taken in the order of their B's. Only valid when `vector_eligible` (whole-unit times).
    """
    D, S, M = num_replicas, num_stages, num_microbatches
    TM, n = D * M, D * S
    host_arr = np.asarray(host, dtype=np.int64)  # [stage, mb]
    stage_of = np.arange(n, dtype=np.int64) % S
    replica_of = np.arange(n, dtype=np.int64) // S
    dest_rank = host_arr * S + np.arange(S, dtype=np.int64)[:, None]  # [stage, mb] -> the rank that runs it
    loads = np.bincount(dest_rank.ravel(), minlength=n)
    dur = np.asarray(durations, dtype=np.float64)  # [stage, code]
    p2p_arr = np.asarray(p2p, dtype=np.float64)
    limit_arr = np.asarray(limit, dtype=np.float64)
    ready_f, ready_b = ReadySets(loads), ReadySets(loads)
    w_mb = np.zeros(int(loads.sum()), dtype=np.int64)  # per rank a FIFO: W's run in the order of their B's
    w_head = np.zeros(n, dtype=np.int64)
    np.cumsum(loads[:-1], out=w_head[1:])
    w_tail = w_head.copy()
    busy = np.zeros(n)
    live = np.zeros(n, dtype=np.int64)
    last = np.full(n, -1, dtype=np.int64)
    # Keys must stay below _EMPTY. No time exceeds all the work plus every message, one after another: until
    # the iteration ends, some action runs or some message is on its way at every moment.
    horizon = int((loads * dur[stage_of].sum(axis=1)).sum() + 2 * TM * S * p2p_arr.max(initial=0.0)) + 1
    scale = horizon if use_ready else 1
    if (static_max + 1) * scale * TM >= _EMPTY:
        raise OverflowError("priority keys do not fit in 64 bits; use the Python list scheduler")

    pending: dict[float, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}  # ready time -> (rank, code, mb)
    times: list[float] = []

    def later(when: np.ndarray, ranks: np.ndarray, codes: np.ndarray, mbs: np.ndarray) -> None:
        for value in np.unique(when).tolist():
            pick = when == value
            bucket = pending.get(value)
            if bucket is None:
                pending[value] = bucket = []
                heapq.heappush(times, value)
            bucket.append((ranks[pick], codes[pick], mbs[pick]))

    def wake(when: np.ndarray) -> None:  # completions: a time to decide at, no item
        for value in np.unique(when).tolist():
            if value not in pending:
                pending[value] = []
                heapq.heappush(times, value)

    later(np.zeros(TM), dest_rank[0], np.zeros(TM, dtype=np.int64), np.arange(TM, dtype=np.int64))
    out: list[tuple[np.ndarray, ...]] = []
    while times:
        t = heapq.heappop(times)
        bucket = pending.pop(t)
        if bucket:
            ranks = np.concatenate([b[0] for b in bucket])
            codes = np.concatenate([b[1] for b in bucket])
            mbs = np.concatenate([b[2] for b in bucket])
            keys = static_key(stage_of[ranks], replica_of[ranks], mbs) * scale
            if use_ready:
                keys += int(t)
            keys = keys * TM + mbs
            is_f = codes == _F
            if is_f.any():
                ready_f.add(ranks[is_f], keys[is_f])
            if not is_f.all():
                ready_b.add(ranks[~is_f], keys[~is_f])
        free = busy <= t
        has_b = ready_b.count > 0
        has_w = w_head < w_tail
        can_f = (ready_f.count > 0) & (live < limit_arr)
        take_b = free & has_b
        if alternate:
            take_b &= ~(can_f & (last == _B))
        take_f = free & ~take_b & can_f
        if not forward_first:
            take_f &= ~has_w
        take_w = free & ~take_b & ~take_f & has_w
        rb, rf, rw = np.flatnonzero(take_b), np.flatnonzero(take_f), np.flatnonzero(take_w)
        if not (len(rb) or len(rf) or len(rw)):
            continue
        mb_b = ready_b.pop_min(rb) % TM if len(rb) else rb
        mb_f = ready_f.pop_min(rf) % TM if len(rf) else rf
        mb_w = w_mb[w_head[rw]]
        w_head[rw] += 1
        live[rf] += 1
        live[rw] -= 1
        if not decoupled:
            live[rb] -= 1
        last[rb] = _B
        last[rf] = _F
        ranks = np.concatenate((rf, rb, rw))
        codes = np.concatenate((np.full(len(rf), _F), np.full(len(rb), _B), np.full(len(rw), _W)))
        mbs = np.concatenate((mb_f, mb_b, mb_w))
        stages = stage_of[ranks]
        ends = t + dur[stages, codes]
        busy[ranks] = ends
        out.append((ranks, codes, mbs, np.full(len(ranks), t), ends))
        wake(ends)
        if decoupled and len(rb):
            w_mb[w_tail[rb]] = mb_b
            w_tail[rb] += 1
        # Forward outputs go downstream (the last stage turns its own F into a B); input-gradients go upstream.
        f_end, f_stage = ends[:len(rf)], stages[:len(rf)]
        turn = f_stage == S - 1
        down = ~turn
        later(f_end[down] + p2p_arr[f_stage[down]], dest_rank[f_stage[down] + 1, mb_f[down]],
              np.full(int(down.sum()), _F), mb_f[down])
        later(f_end[turn], rf[turn], np.full(int(turn.sum()), _B), mb_f[turn])
        b_end, b_stage = ends[len(rf):len(rf) + len(rb)], stages[len(rf):len(rf) + len(rb)]
        up = b_stage > 0
        later(b_end[up] + p2p_arr[b_stage[up] - 1], dest_rank[b_stage[up] - 1, mb_b[up]],
              np.full(int(up.sum()), _B), mb_b[up])
    return _compact(out, n)


def _compact(out: list[tuple[np.ndarray, ...]], n: int) -> CompactSchedule:
    """The recorded steps sorted by (rank, start): steps are in time order, so a stable sort by rank suffices."""
    ranks, codes, mbs, starts, ends = (np.concatenate([step[i] for step in out]) if out else np.zeros(0)
                                       for i in range(5))
    order = np.argsort(ranks, kind="stable")
    bounds = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(ranks.astype(np.int64), minlength=n), out=bounds[1:])
    return CompactSchedule(ranks[order].astype(np.int64), codes[order].astype(np.int64), mbs[order].astype(np.int64),
                           starts[order].astype(np.float64), ends[order].astype(np.float64), bounds)
