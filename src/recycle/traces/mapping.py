"""Map trace nodes onto worker units (a worker = a TP group of gpus_per_worker GPUs) and lay units out on the D x S grid."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from recycle.errors import TraceError
from recycle.traces.reader import ADD, EventTrace

__all__ = ["UnitTimeline", "map_trace_to_units", "StageLayout"]


@dataclass(frozen=True)
class UnitTimeline:
    """Which worker units are live over time: `live[i]` from `times_s[i]` until the next change (or `end_s`).

    A unit is one worker's worth of GPUs. A node with g GPUs holds g / gpus_per_worker units; when a worker needs
    more GPUs than a node has, it spans gpus_per_worker / g nodes and is live only while all of them are.
    """

    times_s: tuple[float, ...]
    live: tuple[frozenset[int], ...]
    end_s: float
    gpus_per_node: int
    gpus_per_worker: int
    source: str = ""

    @property
    def max_live(self) -> int:
        return max(len(s) for s in self.live)

    def mean_live(self) -> float:
        """Time-averaged number of live units."""
        total = 0.0
        for i, live in enumerate(self.live):
            nxt = self.times_s[i + 1] if i + 1 < len(self.times_s) else self.end_s
            total += (nxt - self.times_s[i]) * len(live)
        return total / self.end_s if self.end_s > 0 else float(len(self.live[0]))


def map_trace_to_units(trace: EventTrace, gpus_per_node: int = 1, gpus_per_worker: int = 1) -> UnitTimeline:
    """Give every node a position (the lowest free one when it joins) and derive the live unit set per change.

    A node that joins at the instant another leaves does not take the leaver's position, so the loss and the join
    stay visible as two different units (a replacement is a re-join, not "nothing happened").
    """
    if gpus_per_node < 1 or gpus_per_worker < 1:
        raise TraceError(f"gpus_per_node = {gpus_per_node} and gpus_per_worker = {gpus_per_worker} must be >= 1")
    if gpus_per_node >= gpus_per_worker:
        if gpus_per_node % gpus_per_worker:
            raise TraceError(f"a node has {gpus_per_node} GPUs, which is not a multiple of gpus_per_worker = "
                             f"{gpus_per_worker}; pick --gpus-per-node as a multiple of the worker size")
        units_per_node, nodes_per_unit = gpus_per_node // gpus_per_worker, 1
    else:
        if gpus_per_worker % gpus_per_node:
            raise TraceError(f"a worker needs {gpus_per_worker} GPUs, which is not a multiple of gpus_per_node = "
                             f"{gpus_per_node}; pick --gpus-per-node that divides the worker size")
        units_per_node, nodes_per_unit = 1, gpus_per_worker // gpus_per_node

    position: dict[str, int] = {}
    occupied: set[int] = set()

    def take(excluded: set[int]) -> int:
        p = 0
        while p in occupied or p in excluded:
            p += 1
        return p

    def units() -> frozenset[int]:
        if nodes_per_unit == 1:
            return frozenset(p * units_per_node + j for p in occupied for j in range(units_per_node))
        groups = {p // nodes_per_unit for p in occupied}
        return frozenset(u for u in groups if all(u * nodes_per_unit + k in occupied for k in range(nodes_per_unit)))

    for node in sorted(trace.initial, key=_order):
        position[node] = take(set())
        occupied.add(position[node])
    times = [0.0]
    live = [units()]
    i = 0
    events = trace.events
    while i < len(events):
        t = events[i].time_ms
        freed: set[int] = set()
        group = []
        while i < len(events) and events[i].time_ms == t:
            group.append(events[i])
            i += 1
        for e in group:  # removes first: the reader lists them first within a timestamp
            if e.action != ADD:
                p = position.pop(e.node)
                occupied.discard(p)
                freed.add(p)
        for e in group:
            if e.action == ADD:
                position[e.node] = take(freed)
                occupied.add(position[e.node])
        current = units()
        if current != live[-1]:
            times.append(t / 1000.0)
            live.append(current)
    return UnitTimeline(tuple(times), tuple(live), trace.end_ms / 1000.0, gpus_per_node, gpus_per_worker,
                        trace.source)


def _order(name: str) -> tuple[int, str]:
    digits = "".join(ch for ch in name if ch.isdigit())
    return (int(digits) if digits else 0, name)


class StageLayout:
    """Which unit holds worker (replica, stage); spare units wait; a unit may still be receiving its state.

    Mutable on purpose: a system model owns one and updates it as units fail and join.
    """

    def __init__(self, num_replicas: int, num_stages: int) -> None:
        self.num_replicas = num_replicas
        self.num_stages = num_stages
        self.slot: dict[tuple[int, int], int] = {}  # (replica, stage) -> unit
        self.where: dict[int, tuple[int, int]] = {}
        self.ready_at: dict[int, float] = {}  # unit -> time its state transfer ends (absent: ready)
        self.spares: list[int] = []

    # -- queries --------------------------------------------------------------------------------------------
    def ready_workers(self, now: float) -> set[tuple[int, int]]:
        return {w for w, u in self.slot.items() if self.ready_at.get(u, -1.0) <= now}

    def failed_workers(self, now: float) -> set[tuple[int, int]]:
        """Grid positions without a ready unit (empty, or still receiving state)."""
        ready = self.ready_workers(now)
        return {(p, s) for p in range(self.num_replicas) for s in range(self.num_stages) if (p, s) not in ready}

    def stage_live(self, stage: int, now: float) -> int:
        return self.live_per_stage(now)[stage]

    def live_per_stage(self, now: float) -> list[int]:
        """Ready workers per stage."""
        counts = [0] * self.num_stages
        for (_, s), u in self.slot.items():
            if self.ready_at.get(u, -1.0) <= now:
                counts[s] += 1
        return counts

    def next_ready(self, now: float) -> float | None:
        pending = [t for t in self.ready_at.values() if t > now]
        return min(pending) if pending else None

    # -- updates --------------------------------------------------------------------------------------------
    def place_all(self, units: Iterable[int], replicas: int | None = None) -> None:
        """Fresh layout (job start or restore): fill stage by stage so stages stay balanced, rest are spares."""
        self.slot.clear()
        self.where.clear()
        self.ready_at.clear()
        ordered = sorted(units)
        use = self.num_replicas if replicas is None else replicas
        it = iter(ordered)
        placed: set[int] = set()
        for p in range(use):
            for s in range(self.num_stages):
                u = next(it, None)
                if u is None:
                    break
                self.slot[(p, s)] = u
                self.where[u] = (p, s)
                placed.add(u)
        self.spares = [u for u in ordered if u not in placed]

    def remove(self, unit: int) -> tuple[int, int] | None:
        """A unit died: free its slot (returned) or drop it from the spares."""
        self.ready_at.pop(unit, None)
        if unit in self.where:
            w = self.where.pop(unit)
            del self.slot[w]
            return w
        if unit in self.spares:
            self.spares.remove(unit)
        return None

    def add_spare(self, unit: int) -> None:
        if unit not in self.where and unit not in self.spares:
            self.spares.append(unit)

    def fill_from_spares(self, now: float, transfer_s, replicas: Iterable[int] | None = None) -> list[tuple[int, int]]:
        """Put spares into empty slots, most-depleted stage first; each needs `transfer_s(stage)` seconds of state
        transfer from a live peer before it counts as a worker. Returns the slots filled."""
        filled = []
        rows = list(range(self.num_replicas)) if replicas is None else list(replicas)
        while self.spares:
            empty = [(p, s) for p in rows for s in range(self.num_stages) if (p, s) not in self.slot]
            if not empty:
                break
            live_per_stage = {s: sum(1 for (p, st) in self.slot if st == s) for s in range(self.num_stages)}
            p, s = min(empty, key=lambda w: (live_per_stage[w[1]], w[1], w[0]))
            u = self.spares.pop(0)
            self.slot[(p, s)] = u
            self.where[u] = (p, s)
            delay = transfer_s(s)
            if delay > 0:
                self.ready_at[u] = now + delay
            filled.append((p, s))
        return filled
