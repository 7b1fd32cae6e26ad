"""Map trace nodes onto worker units (a TP group of gpus_per_worker GPUs each), lay them out on the D x S grid, and
place an availability trace's failures on that grid (random, spread or worst)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Iterable

from recycle.errors import TraceError
from recycle.traces.reader import ADD, REMOVE, AvailabilityTrace, EventTrace, TraceEvent

__all__ = ["UnitTimeline", "map_trace_to_units", "StageLayout", "WorkerGrid", "PLACEMENTS", "place_availability"]

# How an availability trace's drops pick the failing workers (docs/traces.md, "Traces"):
#   random: seeded random live nodes (whatever stages they hold);
#   spread: one at a time, a worker of the stage with the most live replicas (ties: seeded);
#   worst:  one at a time, concentrated on one stage while it keeps >= 1 live replica (an adversarial bound).
PLACEMENTS = ("random", "spread", "worst")


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


class _Positions:
    """Node -> position -> worker units, exactly as `map_trace_to_units` assigns them (shared by the placement
    policies so that the node they pick is the worker they mean)."""

    def __init__(self, gpus_per_node: int, gpus_per_worker: int) -> None:
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
        self.occupied: set[int] = set()

    def join(self, node: str, excluded: set[int]) -> None:
        """The node takes the lowest free position, never one in `excluded` (freed at the same instant)."""
        p = 0
        while p in self.occupied or p in excluded:
            p += 1
        self.position[node] = p
        self.occupied.add(p)

    def leave(self, node: str) -> int:
        p = self.position.pop(node)
        self.occupied.discard(p)
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


def map_trace_to_units(trace: EventTrace, gpus_per_node: int = 1, gpus_per_worker: int = 1) -> UnitTimeline:
    """Give every node a position (the lowest free one when it joins) and derive the live unit set per change.

    A node that joins at the instant another leaves does not take the leaver's position, so the loss and the join
    stay visible as two different units (a replacement is a re-join, not "nothing happened").
    """
    pos = _Positions(gpus_per_node, gpus_per_worker)
    for node in sorted(trace.initial, key=_order):
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


@dataclass(frozen=True)
class WorkerGrid:
    """The job's worker grid, as a placement policy needs it: D x S workers, and how trace nodes become workers.

    `num_replicas = None` sizes D to the trace like `--replicas auto` (most units ever live // S).
    """

    num_stages: int
    num_replicas: int | None = None
    gpus_per_node: int = 1
    gpus_per_worker: int = 1

    def describe(self) -> str:
        d = "auto" if self.num_replicas is None else str(self.num_replicas)
        return (f"D={d} x S={self.num_stages}, {self.gpus_per_node} GPU(s) per node, {self.gpus_per_worker} per "
                "worker")


class _GridTracker:
    """ReCycle's view of the grid while counts are turned into events: the same node positions as
    `map_trace_to_units` and the same layout rules as `ReCycleSystem` (stage by stage at the start and after a
    restore; a joining unit fills an empty slot of the most depleted stage; a stage with no replica left is
    restored onto all live units). So the stage a policy picks is the stage that loses the worker in the replay."""

    def __init__(self, grid: WorkerGrid, initial: Iterable[str], max_nodes: int, source: str) -> None:
        self.pos = _Positions(grid.gpus_per_node, grid.gpus_per_worker)
        S = grid.num_stages
        D = grid.num_replicas if grid.num_replicas is not None else self.pos.max_units(max_nodes) // max(S, 1)
        if S < 1 or D < 1:
            raise TraceError(f"{source or 'trace'}: the placement grid ({grid.describe()}) has no worker: at most "
                             f"{self.pos.max_units(max_nodes)} unit(s) are live, need at least S = {S}")
        self.num_replicas, self.num_stages = D, S
        for node in sorted(initial, key=_order):
            self.pos.join(node, set())
        self.layout = StageLayout(D, S)
        self.live = self.pos.units()
        self.layout.place_all(self.live)
        self.down = False
        if min(self.counts()) == 0:
            self.down = len(self.live) < S

    def counts(self) -> list[int]:
        """Occupied slots per stage (a unit still copying its state counts: it was placed there)."""
        counts = [0] * self.num_stages
        for _, s in self.layout.slot:
            counts[s] += 1
        return counts

    def effect(self, node: str) -> tuple[tuple[int, ...], int]:
        """(stages of the working units this node's loss kills, sorted; spare units it kills)."""
        stages, spares = [], 0
        for u in self.pos.units_of(node):
            if u in self.layout.where:
                stages.append(self.layout.where[u][1])
            else:
                spares += 1
        return tuple(sorted(stages)), spares

    def counts_after(self, effect: tuple[tuple[int, ...], int], refill: bool = True) -> list[int]:
        """Occupied slots per stage after losing `effect` and (`refill`) refilling from the remaining spares."""
        stages, spare_loss = effect
        counts = self.counts()
        for s in stages:
            counts[s] -= 1
        spares = 0 if not refill else len(self.layout.spares) - spare_loss
        while spares > 0:
            open_stages = [s for s in range(self.num_stages) if counts[s] < self.num_replicas]
            if not open_stages:
                break
            s = min(open_stages, key=lambda st: (counts[st], st))
            counts[s] += 1
            spares -= 1
        return counts

    def drop(self, node: str) -> None:
        """A node leaves: its units leave the layout (the refill waits for `settle`, as within one change)."""
        self.pos.leave(node)
        live = self.pos.units()
        for u in self.live - live:
            self.layout.remove(u)
        self.live = live

    def join(self, nodes: Iterable[str]) -> None:
        """Nodes re-join (no position freed at this instant): their units become spares until `settle`."""
        for node in nodes:
            self.pos.join(node, set())
        live = self.pos.units()
        for u in sorted(live - self.live):
            self.layout.add_spare(u)
        self.live = live

    def settle(self) -> None:
        """End of one timestamp, as `ReCycleSystem.on_change`: spares fill the most depleted stages; a stage left
        with no placed replica (a unit that only now fills it is still copying: not a replica yet) is restored
        onto every live unit, stage by stage, once at least S are live."""
        if not self.down and min(self.counts()) > 0:
            self.layout.fill_from_spares(0.0, lambda stage: 0.0)
            return
        self.down = len(self.live) < self.num_stages
        if not self.down:
            self.layout.place_all(self.live)


def place_availability(trace: AvailabilityTrace, placement: str, grid: WorkerGrid, seed: int = 0,
                       capacity: int | None = None) -> EventTrace:
    """Turn counts into node events with a grid-aware placement (`spread` or `worst`, see PLACEMENTS).

    A drop removes nodes one at a time; each time, every live node is scored by the per-stage live replicas it
    leaves (occupied slots after the spares refill, as ReCycle's layout would have them):
    * spread keeps them as even as possible (the highest sorted count vector; for one worker per node: a worker of
      the stage with the most live replicas), then the fewest working units lost (a spare goes first);
    * worst makes them as uneven as possible (the lowest sorted count vector, i.e. the same stage again) while
      every stage keeps >= 1 replica, then the most working units lost.
    Ties are broken by `seed`. A rise re-adds the lowest-numbered absent nodes; ReCycle puts each re-joining unit
    into the stage with the fewest live replicas. Every choice is made on the grid ReCycle replays (the tracker
    mirrors `map_trace_to_units` and `ReCycleSystem`), so pass the job's grid.
    """
    if placement not in ("spread", "worst"):
        raise TraceError(f"placement {placement!r} is not grid-aware; use spread or worst (or random)")
    rng = random.Random(seed)
    total = capacity if capacity is not None else max(trace.live)
    if max(trace.live) > total:
        raise TraceError(f"{trace.source or 'trace'}: {max(trace.live)} live nodes exceed the capacity {total}")
    names = [f"node{i + 1}" for i in range(total)]
    live = list(names[: trace.live[0]])
    tracker = _GridTracker(grid, live, max(trace.live), trace.source)
    events: list[TraceEvent] = []
    for t, count in zip(trace.times_ms[1:], trace.live[1:]):
        removed: list[str] = []
        added: list[str] = []
        if count < len(live):
            for _ in range(len(live) - count):
                node = _pick(tracker, live, placement, rng)
                live.remove(node)
                removed.append(node)
                tracker.drop(node)  # one at a time: the next pick sees this loss
        elif count > len(live):
            present = set(live)
            added = [n for n in names if n not in present][: count - len(live)]
            live.extend(added)
            tracker.join(added)
        tracker.settle()
        for node in sorted(removed, key=_order):
            events.append(TraceEvent(t, REMOVE, node))
        events.extend(TraceEvent(t, ADD, node) for node in added)
    initial = frozenset(names[: trace.live[0]])
    return replace(EventTrace(tuple(events), initial, trace.end_ms, trace.source, trace.notes),
                   placement=f"{placement} (seed {seed}; grid {grid.describe()})", placement_grid=grid)


def _pick(tracker: _GridTracker, live: list[str], placement: str, rng: random.Random) -> str:
    """The live node a drop removes next under `placement` (ties broken by `rng`)."""
    by_effect: dict[tuple[tuple[int, ...], int], list[str]] = {}
    for node in live:
        by_effect.setdefault(tracker.effect(node), []).append(node)
    scored = []
    for effect, nodes in by_effect.items():
        counts = tracker.counts_after(effect)
        working = len(effect[0])
        if placement == "spread":
            score = (tuple(sorted(counts)), -working)  # higher is better
        else:  # worst: keep every stage alive if any choice does, then the most uneven counts, most workers lost
            alive = min(tracker.counts_after(effect, refill=False)) >= 1 or tracker.down
            score = (alive, tuple(-c for c in sorted(counts)), working)
        scored.append((score, nodes))
    best = max(score for score, _ in scored)
    ties = sorted((n for score, nodes in scored if score == best for n in nodes), key=_order)
    return ties[rng.randrange(len(ties))]
