"""Map trace nodes onto worker units (a TP group of gpus_per_worker GPUs each): which units are live over time."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from recycle.errors import TraceError
from recycle.traces.trace import ADD, EventTrace

__all__ = ["UnitTimeline", "NodePositions", "map_trace_to_units", "node_order"]

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


class NodePositions:
    """Node -> position -> worker units, exactly as `map_trace_to_units` assigns them (shared by the placement
    policies so that the node they pick is the worker they mean)."""

    def __init__(self, gpus_per_node: int, gpus_per_worker: int, keep_positions: bool = False) -> None:
        if gpus_per_node < 1 or gpus_per_worker < 1:
            raise TraceError(f"gpus_per_node = {gpus_per_node} and gpus_per_worker = {gpus_per_worker} must be >= 1")
        if gpus_per_node >= gpus_per_worker:
            if gpus_per_node % gpus_per_worker:
                raise TraceError(f"a node has {gpus_per_node} GPUs, which is not a multiple of gpus_per_worker = "
                                 f"{gpus_per_worker}; pick --gpus-per-node as a multiple of the worker size")
            self.units_per_node, self.nodes_per_unit = gpus_per_node // gpus_per_worker, 1
        else:
            if gpus_per_worker % gpus_per_node:
                raise TraceError(f"a worker needs {gpus_per_worker} GPUs, which is not a multiple of gpus_per_node "
                                 f"= {gpus_per_node}; pick --gpus-per-node that divides the worker size")
            self.units_per_node, self.nodes_per_unit = 1, gpus_per_worker // gpus_per_node
        self.position: dict[str, int] = {}
        # keep_positions: a node that comes back (the same name) takes its old position again when that is free, so
        # a repaired machine is the same unit (the runtime restarts a dead worker in its own slot).
        self.keep_positions = keep_positions
        self.last: dict[str, int] = {}
        self.occupied: set[int] = set()
        # The free positions: those in the heap `_free` (each freed by a leave) and every one from `_next` on, so a
        # join takes the lowest in O(log n), not by counting up from 0 (quadratic: 70 s for 65,536 nodes).
        self._free: list[int] = []
        self._next = 0

    def join(self, node: str, excluded: set[int]) -> None:
        """The node takes the lowest free position, never one in `excluded` (freed at the same instant)."""
        old = self.last.get(node) if self.keep_positions else None
        if old is not None and old not in self.occupied and old not in excluded and old in self._free:
            self._free.remove(old)
            heapq.heapify(self._free)
            self.position[node] = old
            self.occupied.add(old)
            return
        held = []
        while self._free and self._free[0] in excluded:
            held.append(heapq.heappop(self._free))
        if self._free:
            p = heapq.heappop(self._free)
        else:
            p = self._next
            self._next += 1
        for q in held:
            heapq.heappush(self._free, q)
        self.position[node] = p
        self.last[node] = p
        self.occupied.add(p)

    def leave(self, node: str) -> int:
        p = self.position.pop(node)
        self.occupied.discard(p)
        heapq.heappush(self._free, p)
        return p

    def _node_units(self, p: int) -> list[int]:
        if self.nodes_per_unit == 1:
            return [p * self.units_per_node + j for j in range(self.units_per_node)]
        return [p // self.nodes_per_unit]

    def _unit_live(self, u: int) -> bool:
        if self.nodes_per_unit == 1:
            return u // self.units_per_node in self.occupied
        return all(u * self.nodes_per_unit + k in self.occupied for k in range(self.nodes_per_unit))

    def units(self) -> frozenset[int]:
        if self.nodes_per_unit == 1:
            return frozenset(p * self.units_per_node + j for p in self.occupied for j in range(self.units_per_node))
        groups = {p // self.nodes_per_unit for p in self.occupied}
        return frozenset(u for u in groups
                         if all(u * self.nodes_per_unit + k in self.occupied for k in range(self.nodes_per_unit)))

    def units_of(self, node: str) -> list[int]:
        """The live units that die if this (live) node leaves."""
        return [u for u in self._node_units(self.position[node]) if self._unit_live(u)]

    def max_units(self, nodes: int) -> int:
        """Units when `nodes` nodes hold positions 0..nodes-1."""
        return nodes * self.units_per_node if self.nodes_per_unit == 1 else nodes // self.nodes_per_unit


def map_trace_to_units(trace: EventTrace, gpus_per_node: int = 1, gpus_per_worker: int = 1,
                       keep_positions: bool = False) -> UnitTimeline:
    """Give every node a position (the lowest free one when it joins) and derive the live unit set per change.

    A node that joins at the instant another leaves does not take the leaver's position, so the loss and the join
    stay visible as two different units (a replacement is a re-join, not "nothing happened"). With
    `keep_positions`, a node that left and comes back takes its old position again when it is free.
    """
    pos = NodePositions(gpus_per_node, gpus_per_worker, keep_positions)
    for node in sorted(trace.initial, key=node_order):
        pos.join(node, set())
    times = [0.0]
    live = [pos.units()]
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
                freed.add(pos.leave(e.node))
        for e in group:
            if e.action == ADD:
                pos.join(e.node, freed)
        current = pos.units()
        if current != live[-1]:
            times.append(t / 1000.0)
            live.append(current)
    return UnitTimeline(tuple(times), tuple(live), trace.end_ms / 1000.0, gpus_per_node, gpus_per_worker,
                        trace.source)


def node_order(name: str) -> tuple[int, str]:
    """Sort key for node names: by the number in the name (node2 before node10), then by name."""
    digits = "".join(ch for ch in name if ch.isdigit())
    return (int(digits) if digits else 0, name)


