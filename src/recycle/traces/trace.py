"""Failure traces as values: node add/remove events, live-node counts, what the reader fixed, and the worker grid
a placement of failures was made for."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ADD", "REMOVE", "TraceEvent", "TraceNotes", "EventTrace", "AvailabilityTrace", "WorkerGrid",
           "MAX_TRACE_NODES", "MAX_TRACE_LINES", "MAX_TRACE_EVENTS", "MAX_REPLAY_SIZE", "MAX_NODES_WHY",
           "check_replay_size"]

ADD, REMOVE = "add", "remove"

# Bounds on what a trace may make the reader, a generator or the replay allocate (issue 21, item 3).
MAX_TRACE_NODES = 65_536  # distinct nodes of an event trace, or a live count of an availability trace
MAX_NODES_WHY = "4x the 16,384 GPUs of Llama 3's largest job, one node each"
MAX_TRACE_LINES = 2_000_000  # data lines of one trace file (the reader keeps ~0.2 KB per line until it is cleaned)
MAX_TRACE_EVENTS = 2_000_000  # node events of a generated trace, or of an availability trace's placed drops
# The replay keeps the live unit set at every change point (~50 bytes per live unit): change points x most live
# units is bounded (measured: a million change points over 64 units replay in 3.1 GB and 2 minutes).
MAX_REPLAY_SIZE = 80_000_000


def check_replay_size(change_points: int, live_units: int, source: str, fix: str) -> None:
    """Refuse a replay of `change_points` changes over up to `live_units` live units above MAX_REPLAY_SIZE."""
    if change_points * live_units > MAX_REPLAY_SIZE:
        from recycle.errors import TraceError

        raise TraceError(f"{source or 'trace'}: {change_points:,} change points x {live_units:,} live units = "
                         f"{change_points * live_units:,} is above the limit of {MAX_REPLAY_SIZE:,} for one replay (it "
                         f"keeps the live set at every change point, ~50 bytes per unit: ~4 GB at the limit); {fix}")


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One node joining (`add`) or leaving (`remove`) the job at `time_ms`."""

    time_ms: int
    action: str  # "add" or "remove"
    node: str


@dataclass(frozen=True)
class TraceNotes:
    """What the reader did to messy input, counted, so that nothing is fixed silently."""

    blank_lines: int = 0
    comment_lines: int = 0
    header: bool = False
    out_of_order: int = 0  # lines whose time is earlier than the line before (the trace was sorted stably)
    repeated_removes: int = 0  # remove of a node that is not present (dropped)
    repeated_adds: int = 0  # add of a node that is already present (dropped)
    simultaneous_groups: int = 0  # timestamps carrying more than one event (applied together, as one change)
    cancelled_pairs: int = 0  # remove and re-add (or add and remove) of one node at one timestamp (no change)
    superseded: int = 0  # availability lines earlier than the line before: they replace the samples from their time

    def messages(self) -> list[str]:
        """Human-readable warnings, one per kind of fix that was applied."""
        out = []
        if self.out_of_order:
            out.append(f"{self.out_of_order} line(s) were out of time order; the trace was sorted stably by time")
        if self.superseded:
            out.append(f"{self.superseded} sample(s) were earlier than the line before; each replaced the samples "
                       "recorded from its time on (file order is the order of observation: nothing is reordered, so "
                       "repeated readings cannot create false flaps)")
        if self.repeated_removes:
            out.append(f"{self.repeated_removes} 'remove' event(s) named a node that was not present; ignored")
        if self.repeated_adds:
            out.append(f"{self.repeated_adds} 'add' event(s) named a node that was already present; ignored")
        if self.cancelled_pairs:
            out.append(f"{self.cancelled_pairs} node(s) left and re-joined at the same instant; counted as no change")
        if self.blank_lines:
            out.append(f"{self.blank_lines} blank line(s) skipped")
        return out


@dataclass(frozen=True)
class EventTrace:
    """A cleaned event trace: events sorted by time, every event a real change of the live node set.

    `initial` holds the nodes present at time 0 (a trace that starts by adding every node at t=0 describes the
    initial cluster, not re-joins). `end_ms` is the end of the observation window (the last event unless given).
    For a trace made from availability counts, `placement` says how the failing nodes were chosen and
    `placement_grid` is the worker grid a grid-aware placement was made for (None for random placement).
    """

    events: tuple[TraceEvent, ...]
    initial: frozenset[str]
    end_ms: int
    source: str = ""
    notes: TraceNotes = field(default_factory=TraceNotes)
    placement: str = ""
    placement_grid: WorkerGrid | None = None

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset(self.initial) | frozenset(e.node for e in self.events)

    def change_points(self) -> list[tuple[int, frozenset[str]]]:
        """(time_ms, live node set) at 0 and after each group of simultaneous events."""
        live = set(self.initial)
        points: list[tuple[int, frozenset[str]]] = [(0, frozenset(live))]
        i = 0
        while i < len(self.events):
            t = self.events[i].time_ms
            while i < len(self.events) and self.events[i].time_ms == t:
                e = self.events[i]
                (live.add if e.action == ADD else live.discard)(e.node)
                i += 1
            if t == 0:
                points[0] = (0, frozenset(live))
            else:
                points.append((t, frozenset(live)))
        return points

    def max_live(self) -> int:
        return max(len(live) for _, live in self.change_points())

    def num_removals(self) -> int:
        return sum(1 for e in self.events if e.action == REMOVE)


@dataclass(frozen=True)
class AvailabilityTrace:
    """A count of live nodes over time: `live[i]` nodes from `times_ms[i]` until the next sample."""

    times_ms: tuple[int, ...]
    live: tuple[int, ...]
    end_ms: int
    source: str = ""
    notes: TraceNotes = field(default_factory=TraceNotes)


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
