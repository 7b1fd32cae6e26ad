"""Place an availability trace's failures: which nodes a drop in the live count removes (random, or on the job's
worker grid: spread or worst), turning counts into node events."""

from __future__ import annotations

import bisect
import heapq
import random
from typing import Iterable

from recycle.errors import TraceError
from recycle.traces.mapping import NodePositions, node_order
from recycle.traces.model import StageLayout
from recycle.traces.trace import (ADD, MAX_NODES_WHY, MAX_TRACE_EVENTS, MAX_TRACE_NODES, REMOVE, AvailabilityTrace,
                                  EventTrace, TraceEvent, WorkerGrid, check_replay_size)

__all__ = ["PLACEMENTS", "PLACEMENT_HELP", "availability_to_events", "place_availability"]

# How an availability trace's drops pick the failing workers (docs/traces.md, "Traces"):
#   random: seeded random live nodes (whatever stages they hold);
#   spread: one at a time, a worker of the stage with the most live replicas (ties: seeded);
#   worst:  one at a time, concentrated on one stage while it keeps >= 1 live replica (an adversarial bound).
PLACEMENTS = ("random", "spread", "worst")
MAX_GRID_PLACEMENT_WORK = 10_000_000  # node removals x nodes a grid-aware placement scores (~2.5 us each)

PLACEMENT_HELP = (
    "which workers an availability trace's drops remove (the trace has only counts): 'random' (seeded random live "
    "nodes, whatever their stages), 'spread' (one at a time, a worker of the stage with the most live replicas; "
    "ties by the seed), 'worst' (concentrated on one stage while it keeps >= 1 replica: an adversarial bound)"
)


def availability_to_events(trace: AvailabilityTrace, seed: int = 0, capacity: int | None = None,
                           placement: str = "random", grid: WorkerGrid | None = None) -> EventTrace:
    """Turn counts into node events. Which nodes fail matters to ReCycle (it decides the stages hit); an
    availability trace does not say, so `placement` decides, reproducibly (`seed`):

    * `random` (default): a drop removes randomly chosen live nodes; a rise re-adds the lowest-numbered absent ones.
    * `spread` / `worst`: grid-aware (`place_availability`); they need the job's worker `grid`, because which node
      holds which stage depends on it.
    """
    if placement not in PLACEMENTS:
        raise TraceError(f"placement {placement!r} is unknown; use one of {', '.join(PLACEMENTS)}")
    if placement != "random":
        if grid is None:
            raise TraceError(f"placement {placement!r} acts on the job's worker grid; pass grid= (the job's "
                             "stages, replicas and GPUs per node/worker)")
        return place_availability(trace, placement, grid, seed=seed, capacity=capacity)
    rng = random.Random(seed)
    names = _node_names(trace, capacity)
    _check_size(trace, len(names))
    # Nodes by index into `names` (node1, node2, ...: index order is node_order). `live` is kept sorted, so that
    # sampling it picks the same nodes as sampling the sorted live names; `absent` is a heap (lowest re-joins first).
    live = list(range(trace.live[0]))
    absent = list(range(trace.live[0], len(names)))
    events: list[TraceEvent] = []
    for t, count in zip(trace.times_ms[1:], trace.live[1:]):
        if count < len(live):
            for i in sorted(rng.sample(live, len(live) - count)):
                live.pop(bisect.bisect_left(live, i))
                heapq.heappush(absent, i)
                events.append(TraceEvent(t, REMOVE, names[i]))
        elif count > len(live):
            for _ in range(count - len(live)):
                i = heapq.heappop(absent)
                bisect.insort(live, i)
                events.append(TraceEvent(t, ADD, names[i]))
    initial = frozenset(names[: trace.live[0]])
    return EventTrace(tuple(events), initial, trace.end_ms, trace.source, trace.notes,
                      placement=f"random (seed {seed})")


def _node_names(trace: AvailabilityTrace, capacity: int | None) -> list[str]:
    """node1..nodeN for the `capacity` nodes (default: the most ever live); the first ones are live at time 0."""
    total = capacity if capacity is not None else max(trace.live)
    if max(trace.live) > total:
        raise TraceError(f"{trace.source or 'trace'}: {max(trace.live)} live nodes exceed the capacity {total}")
    if total > MAX_TRACE_NODES:
        raise TraceError(f"{trace.source or 'trace'}: {total:,} nodes is above the limit of {MAX_TRACE_NODES:,} "
                         f"({MAX_NODES_WHY}); check the live counts (they count nodes, not GPUs)")
    return [f"node{i + 1}" for i in range(total)]


def _check_size(trace: AvailabilityTrace, nodes: int, grid_aware: bool = False) -> None:
    """Before placing: the node events the counts make (every unit of a rise or drop is one) at most
    MAX_TRACE_EVENTS, the replay of the result within MAX_REPLAY_SIZE, and for a grid-aware placement (which
    scores every live node for each node it removes) removals x nodes within MAX_GRID_PLACEMENT_WORK."""
    source = trace.source or "trace"
    steps = [abs(b - a) for a, b in zip(trace.live, trace.live[1:])]
    if sum(steps) > MAX_TRACE_EVENTS:
        raise TraceError(f"{source}: its live counts rise and fall by {sum(steps):,} nodes in all, above the limit of "
                         f"{MAX_TRACE_EVENTS:,} node events for one trace (one event per node that leaves or "
                         "joins); cut the trace into shorter windows")
    check_replay_size(len(trace.times_ms), nodes, source, "cut the trace into shorter windows")
    removals = sum(a - b for a, b in zip(trace.live, trace.live[1:]) if b < a)
    if grid_aware and removals * nodes > MAX_GRID_PLACEMENT_WORK:
        raise TraceError(f"{source}: {removals:,} node removals x {nodes:,} nodes = {removals * nodes:,} is above the "
                         f"limit of {MAX_GRID_PLACEMENT_WORK:,} for a grid-aware placement (it scores every live node "
                         "for each removal, ~2.5 us each: ~25 s at the limit); use --placement random or a shorter "
                         "trace")


class _GridTracker:
    """ReCycle's view of the grid while counts are turned into events: the same node positions as
    `map_trace_to_units` and the same layout rules as `ReCycleSystem` (stage by stage at the start and after a
    restore; a joining unit fills an empty slot of the most depleted stage; a stage with no replica left is
    restored onto all live units). So the stage a policy picks is the stage that loses the worker in the replay."""

    def __init__(self, grid: WorkerGrid, initial: Iterable[str], max_nodes: int, source: str) -> None:
        self.pos = NodePositions(grid.gpus_per_node, grid.gpus_per_worker)
        S = grid.num_stages
        D = grid.num_replicas if grid.num_replicas is not None else self.pos.max_units(max_nodes) // max(S, 1)
        if S < 1 or D < 1:
            raise TraceError(f"{source or 'trace'}: the placement grid ({grid.describe()}) has no worker: at most "
                             f"{self.pos.max_units(max_nodes)} unit(s) are live, need at least S = {S}")
        self.num_replicas, self.num_stages = D, S
        for node in sorted(initial, key=node_order):
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
    names = _node_names(trace, capacity)
    _check_size(trace, len(names), grid_aware=True)
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
        for node in sorted(removed, key=node_order):
            events.append(TraceEvent(t, REMOVE, node))
        events.extend(TraceEvent(t, ADD, node) for node in added)
    initial = frozenset(names[: trace.live[0]])
    return EventTrace(tuple(events), initial, trace.end_ms, trace.source, trace.notes,
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
    ties = sorted((n for score, nodes in scored if score == best for n in nodes), key=node_order)
    return ties[rng.randrange(len(ties))]
