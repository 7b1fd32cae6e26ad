"""Vectorized iteration timing for large plans: actions grouped by dependency level, each level timed in numpy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Sequence

import numpy as np

from recycle.config import Config
from recycle.ir.actions import Kind
from recycle.ir.compact import KIND_CODES, CompactActions
from recycle.ir.costs import action_duration
from recycle.ir.dependencies import input_stage_table
from recycle.sim.convergence import LEVEL_TIMER_MIN_ACTIONS, MAX_ITERATIONS, converged, settled_period

__all__ = ["LevelTimer", "build_level_timer", "flat_dependencies", "time_compact"]


@dataclass(frozen=True)
class LevelTimer:
    """The iteration DAG of a flattened plan, ordered by level (longest path in edges from a source).

    Nodes are the N actions plus one barrier node per all-reduce group. Every level only depends on earlier
    levels, so one iteration is a loop over levels with a handful of numpy operations each, instead of a Python
    step per action. The arithmetic is the simulator's own, operation for operation: an action starts at
    max(its worker's free time, producer end + message) and ends at start + duration (float64 both ways), so the
    times are bit-identical to the per-action loop in `recycle.sim.simulator`.
    """

    num_actions: int
    num_ranks: int
    bounds: tuple[tuple[int, int, int, int], ...]  # per level: compute slice, then OPT slice, in the sorted arrays
    group_levels: tuple[np.ndarray, ...]  # per level: the barrier nodes that level completes
    idx: np.ndarray  # action index, level-sorted (compute actions of a level first, then its OPTs)
    prev: np.ndarray  # index into `free` (N + rank: the worker's free time at the iteration start) of each action
    dep: np.ndarray  # index into `end` (N: a -inf sentinel) of the producer
    msg: np.ndarray
    dur: np.ndarray
    opt_group: np.ndarray  # for OPT entries: the barrier node's group
    opt_hold: np.ndarray  # for OPT entries: how long the worker stays busy after the barrier begins
    member_prev: tuple[np.ndarray, ...]  # per group: `free` indices of what its members did before their OPT
    last: np.ndarray  # per rank: the last action (-1: none); the worker is free after it for the next iteration

    def run(self, free_at_start: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One iteration: start and end per action, and each rank's free time at its end."""
        N = self.num_actions
        free = np.empty(N + self.num_ranks)
        free[N:] = free_at_start
        end = np.empty(N + 1)
        end[N] = -np.inf
        start = np.empty(N)
        begin = np.empty(len(self.member_prev))
        idx, prev, dep, msg, dur = self.idx, self.prev, self.dep, self.msg, self.dur
        for (lo, mid, hi, _), groups in zip(self.bounds, self.group_levels):
            if mid > lo:
                i = idx[lo:mid]
                t = np.maximum(free[prev[lo:mid]], end[dep[lo:mid]] + msg[lo:mid])
                start[i] = t
                t = t + dur[lo:mid]
                end[i] = t
                free[i] = t
            for g in groups:
                begin[g] = free[self.member_prev[g]].max()
            if hi > mid:
                i = idx[mid:hi]
                b = begin[self.opt_group[mid:hi]]
                start[i] = b
                end[i] = b + dur[mid:hi]
                free[i] = b + self.opt_hold[mid:hi]
        after = free[N:].copy()
        has = self.last >= 0
        after[has] = free[self.last[has]]
        return start, end[:N], after


def build_level_timer(num_ranks: int, first: Sequence[int], stop: Sequence[int], is_opt: Sequence[bool],
                      dep: Sequence[int], msg: Sequence[float], dur: Sequence[float],
                      groups: dict[int, tuple[int, ...]], staggered: bool) -> LevelTimer | None:
    """The level structure of one iteration, or None when the plan is outside this timer's scope (a rank whose
    list does not end with its only OPT, a group member without actions) or deadlocks; the caller then uses the
    per-action loop, which also reports deadlocks."""
    N = len(dur)
    live = sorted(groups)
    rank_of = np.repeat(np.arange(num_ranks, dtype=np.int64), np.asarray(stop) - np.asarray(first))
    opt_mask = np.asarray(is_opt, dtype=bool)
    layout = _opt_layout(num_ranks, stop, live, groups, rank_of, opt_mask)
    if layout is None:
        return None
    opt_rank, group_ids, gid_of = layout
    G = len(group_ids)
    first_arr = np.asarray(first, dtype=np.int64)
    index = np.arange(N, dtype=np.int64)
    is_first = index == first_arr[rank_of] if N else np.zeros(0, dtype=bool)
    prev = np.where(is_first, N + rank_of, index - 1)
    dep_arr = np.asarray(dep, dtype=np.int64)
    opt_group = np.full(N, -1, dtype=np.int64)
    for r in live:
        opt_group[opt_rank[r]] = gid_of[r]
    src, dst, member_prev = _edges(N, index, is_first, prev, dep_arr, opt_mask, opt_group, opt_rank, group_ids)
    leveled = _levels(src, dst, N + G)
    if leveled is None:
        return None  # a cycle: the plan deadlocks
    level, depth = leveled

    # Sort actions by (level, OPT last within the level); barrier nodes keep their own levels.
    action_level = level[:N]
    sort_key = action_level * 2 + opt_mask
    sorted_idx = np.argsort(sort_key, kind="stable")
    keys = sort_key[sorted_idx]
    dep_ext = np.where(dep_arr >= 0, dep_arr, N)
    msg_arr = np.asarray(msg, dtype=np.float64)
    dur_arr = np.asarray(dur, dtype=np.float64)
    longest = np.zeros(G)
    for r in live:
        gid = gid_of[r]
        longest[gid] = max(longest[gid], dur_arr[opt_rank[r]])
    hold = dur_arr.copy() if staggered else np.where(opt_mask, longest[np.maximum(opt_group, 0)], 0.0)
    bounds = []
    group_levels = []
    group_level = level[N:]
    boundaries = np.searchsorted(keys, np.arange(2 * depth + 1))
    for d in range(depth):
        lo, mid, hi = (int(x) for x in boundaries[2 * d:2 * d + 3])
        bounds.append((lo, mid, hi, d))
        group_levels.append(np.flatnonzero(group_level == d))
    stop_arr = np.asarray(stop, dtype=np.int64)
    last = np.where(stop_arr > first_arr, stop_arr - 1, -1)
    return LevelTimer(N, num_ranks, tuple(bounds), tuple(group_levels), sorted_idx, prev[sorted_idx],
                      dep_ext[sorted_idx], msg_arr[sorted_idx], dur_arr[sorted_idx], opt_group[sorted_idx],
                      hold[sorted_idx], tuple(member_prev), last)


def _opt_layout(num_ranks: int, stop: Sequence[int], live: list[int], groups: dict[int, tuple[int, ...]],
                rank_of: np.ndarray, opt_mask: np.ndarray
                ) -> tuple[dict[int, int], dict[tuple[int, ...], int], dict[int, int]] | None:
    """Each live rank's OPT index (its list must end with its only OPT), an id per all-reduce group (every
    member must have actions) and each live rank's group id; None outside that scope."""
    opts_per_rank = np.bincount(rank_of[opt_mask], minlength=num_ranks)
    opt_rank: dict[int, int] = {}
    for r in live:
        if opts_per_rank[r] != 1 or not opt_mask[stop[r] - 1]:
            return None
        opt_rank[r] = stop[r] - 1
    group_ids: dict[tuple[int, ...], int] = {}
    gid_of: dict[int, int] = {}
    seen: dict[int, int] = {}  # id(group tuple) -> group id: callers share one tuple per group, hash each once
    for r in live:
        group = groups[r]
        gid = seen.get(id(group))
        if gid is None:
            if any(m not in opt_rank for m in group):
                return None
            gid = seen[id(group)] = group_ids.setdefault(group, len(group_ids))
        gid_of[r] = gid
    return opt_rank, group_ids, gid_of


def _edges(N: int, index: np.ndarray, is_first: np.ndarray, prev: np.ndarray, dep_arr: np.ndarray,
           opt_mask: np.ndarray, opt_group: np.ndarray, opt_rank: dict[int, int],
           group_ids: dict[tuple[int, ...], int]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Edges into action nodes (prev -> g for compute; barrier -> OPT) and into barrier nodes (member prev -> it),
    as (sources, destinations), and per group the `free` indices of what its members did before their OPT."""
    src_list = []
    dst_list = []
    compute = ~opt_mask
    has_prev = compute & ~is_first
    src_list.append(index[has_prev] - 1)
    dst_list.append(index[has_prev])
    has_dep = compute & (dep_arr >= 0)
    src_list.append(dep_arr[has_dep])
    dst_list.append(index[has_dep])
    opts = index[opt_mask]
    src_list.append(N + opt_group[opts])
    dst_list.append(opts)
    member_prev = []
    for group in group_ids:  # in id order (insertion order)
        gid = group_ids[group]
        members = np.asarray([opt_rank[m] for m in group], dtype=np.int64)
        member_prev.append(prev[members])
        inner = members[~is_first[members]] - 1
        src_list.append(inner)
        dst_list.append(np.full(len(inner), N + gid, dtype=np.int64))
    return np.concatenate(src_list), np.concatenate(dst_list), member_prev


def _levels(src: np.ndarray, dst: np.ndarray, node_count: int) -> tuple[np.ndarray, int] | None:
    """Each node's level (longest path in edges from a source) and the number of levels, by a vectorized Kahn
    pass; None when some node is never reached (a cycle)."""
    indeg = np.bincount(dst, minlength=node_count)
    order = np.argsort(src, kind="stable")
    succ = dst[order]
    indptr = np.zeros(node_count + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=node_count), out=indptr[1:])
    level = np.full(node_count, -1, dtype=np.int64)
    stamp = np.empty(node_count, dtype=np.int64)
    frontier = np.flatnonzero(indeg == 0)
    depth = 0
    while len(frontier):
        level[frontier] = depth
        lo, hi = indptr[frontier], indptr[frontier + 1]
        counts = hi - lo
        total = int(counts.sum())
        if total:
            offsets = np.repeat(lo - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
            targets = succ[offsets + np.arange(total)]
            np.subtract.at(indeg, targets, 1)
            ready = targets[indeg[targets] == 0]
            # A node whose two inputs were both in this frontier appears twice: keep one copy (whichever
            # position's stamp survived; cheaper than np.unique's sort or hash).
            position = np.arange(len(ready))
            stamp[ready] = position
            frontier = ready[stamp[ready] == position]
        else:
            frontier = frontier[:0]
        depth += 1
    if (level < 0).any():
        return None
    return level, depth


def flat_dependencies(code: Sequence[int], stage_of: Sequence[int], mb_of: Sequence[int], first: Sequence[int],
                      stop: Sequence[int], S: int, TM: int, p2p: Sequence[float], inter: Sequence[float],
                      node_of: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """`recycle.sim.simulator._dependencies` in numpy (the same rule, tested equal): producer index per action
    (-1: none) and the message time (p2p, inter-node across nodes, 0 on the same worker)."""
    F, B, BW, OPT = 0, 1, 3, 4  # the simulator's kind codes (F, B, W, BW, OPT)
    code_a = np.asarray(code, dtype=np.int64)
    stage_a = np.asarray(stage_of, dtype=np.int64)
    mb_a = np.asarray(mb_of, dtype=np.int64)
    N = len(code_a)
    rank_of = np.repeat(np.arange(len(first), dtype=np.int64), np.asarray(stop) - np.asarray(first))
    where = np.full(5 * S * TM, -1, dtype=np.int64)
    compute = code_a != OPT
    where[((code_a * S + stage_a) * TM + mb_a)[compute]] = np.flatnonzero(compute)
    # The dependency rule (recycle.ir.dependencies), tabled: the stage each action's message comes from, -1: none.
    kinds = (Kind.F, Kind.B, Kind.W, Kind.BW, Kind.OPT)
    source = np.asarray(input_stage_table(kinds, S), dtype=np.int64).reshape(len(kinds), S)[code_a, stage_a]
    dep = np.full(N, -1, dtype=np.int64)
    boundary = np.minimum(stage_a, source)
    forward = (code_a == F) & (source >= 0)
    dep[forward] = where[(F * S + source[forward]) * TM + mb_a[forward]]
    backward = (code_a != F) & (source >= 0)
    src = where[(B * S + source[backward]) * TM + mb_a[backward]]
    fused = where[(BW * S + source[backward]) * TM + mb_a[backward]]
    dep[backward] = np.where(src < 0, fused, src)
    msg = np.zeros(N)
    has = np.flatnonzero(dep >= 0)
    producer_rank = rank_of[dep[has]]
    consumer_rank = rank_of[has]
    nodes = np.asarray(node_of, dtype=np.int64)
    across = np.where(nodes[producer_rank] != nodes[consumer_rank], np.asarray(inter, dtype=np.float64)[boundary[has]],
                      np.asarray(p2p, dtype=np.float64)[boundary[has]])
    msg[has] = np.where(producer_rank != consumer_rank, across, 0.0)
    return dep, msg


def time_compact(config: Config, actions: CompactActions, failed: AbstractSet[tuple[int, int]],
                 staggered: bool) -> tuple[float, float] | None:
    """`simulate(plan, config)`'s period and makespan for a plan whose actions are CompactActions, read straight
    from its arrays (no Action objects): the simulator's steps for a large plan, in the same order with the same
    floats (tests/unit/test_vector_schedule.py checks equality). None when the simulator would not use the level
    timer (small plans) or the timer does not apply; the caller then simulates."""

    D, S = config.num_replicas, config.num_stages
    n, TM = D * S, D * config.num_microbatches
    bounds = np.asarray(actions.bounds, dtype=np.int64)
    code = np.asarray(actions.code, dtype=np.int64)
    stage = np.asarray(actions.stage, dtype=np.int64)
    if len(code) < LEVEL_TIMER_MIN_ACTIONS or len(bounds) != n + 1:
        return None
    live_replicas = [[p for p in range(D) if (p, s) not in failed] for s in range(S)]
    duration_of = np.asarray([[action_duration(config, k, s, len(live_replicas[s])) for s in range(S)]
                              for k in KIND_CODES])
    dur = duration_of[code, stage]
    first, stop = bounds[:-1], bounds[1:]
    comm = config.communication
    node = config.topology.node
    dep, msg = flat_dependencies(code, stage, actions.mb, first, stop, S, TM, [comm.p2p_time(s) for s in range(S)],
                                 [comm.inter_node_time(s) for s in range(S)], [node(r) for r in range(n)])
    is_opt = code == 4
    live = [r for r in range(n) if stop[r] > first[r]]
    if staggered:
        by_stage = [tuple(p * S + s for p in live_replicas[s]) for s in range(S)]
        groups = {r: by_stage[r % S] for r in live}
    else:
        everyone = tuple(live)
        groups = {r: everyone for r in live}
    timer = build_level_timer(n, first.tolist(), stop.tolist(), is_opt, dep, msg, dur, groups, staggered)
    if timer is None:
        return None
    opt_list = is_opt.tolist()
    spans: dict[int, list[tuple[int, int]]] = {}  # makespan group (stage when staggered) -> compute spans
    for r in live:
        lo, hi = int(first[r]), int(stop[r]) - 1
        while lo <= hi and opt_list[lo]:
            lo += 1
        while hi >= lo and opt_list[hi]:
            hi -= 1
        if lo <= hi:
            spans.setdefault(r % S if staggered else 0, []).append((lo, hi))
    heads = [int(first[r]) for r in live]
    free: Sequence[float] = [0.0] * n
    starts: list[float] = []
    makespans: list[float] = []
    for _ in range(MAX_ITERATIONS):
        start, end, free = timer.run(free)
        starts.append(float(start[heads].min()))
        makespans.append(float(max((max(end[b] for _, b in group) - min(start[a] for a, _ in group)
                                    for group in spans.values()), default=0.0)))
        if converged(starts):
            break
    return settled_period(starts), makespans[-1]
