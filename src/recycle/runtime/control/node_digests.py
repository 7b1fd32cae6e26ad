"""A node launcher's hand-off of its workers' records of a generation: they write their stop reports, and their
Joined and Resumed records, to the node's own store, and a thread of the launcher writes the coordinator one digest
(NodeStops; NodeStarted) per node and generation as they come in, so that a recovery costs the coordinator's store a
request or two per node, not per worker. It keeps the newest generations' records for a restarted coordinator."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from typing import Any, Callable

from recycle.runtime.protocol.channels import Channel, Channels, JobStore
from recycle.runtime.protocol.records import NodeStarted, NodeStops, RecordError
from recycle.runtime.protocol.store import StoreUnavailable
from recycle.runtime.protocol.store.data import Feed

__all__ = ["DigestForwarder", "DIGESTED_PREFIXES", "HOLD_S", "START_HOLD_S", "KEPT_GENERATIONS"]

# How long a stop digest waits for the node's other running workers once one has reported: they all watch the same
# abort key and report within milliseconds, but a frozen one never does (it must not hold the others back), and one
# that reports later goes in a digest of its own.
HOLD_S = 0.05
# A start digest's: the workers' first actions spread over the pipeline's fill (the last stage's comes last), and
# nothing waits on these records but the recovery's report.
START_HOLD_S = 0.25
KEPT_GENERATIONS = 2  # generations whose records are written again to a restarted coordinator


@dataclass(frozen=True)
class _Flow:
    """One kind of digest: the workers' records it gathers (by key prefix), the one whose arrival completes a worker's
    part, the digest's channel and how it is made from the records (rank -> record, per prefix)."""

    inputs: dict[str, Channel[Any]]  # key prefix (before the first "/") -> the channel its records are on
    last: str  # a worker's part is in once this prefix's record is
    digest: Channel[Any]
    make: Callable[[int, int, dict[str, dict[int, Any]]], Any]  # (node, generation, records) -> the digest


def _stops(node: int, generation: int, records: dict[str, dict[int, Any]]) -> NodeStops:
    reports = records.get("stopped", {})
    return NodeStops(node, generation, tuple(reports[rank] for rank in sorted(reports)))


def _starts(node: int, generation: int, records: dict[str, dict[int, Any]]) -> NodeStarted:
    joined, resumed = records.get("joined", {}), records.get("resumed", {})
    return NodeStarted(node, generation,
                       tuple((rank, r.time, r.formation_s, r.method) for rank, r in sorted(joined.items())),
                       tuple((rank, r.time) for rank, r in sorted(resumed.items())))


_FLOWS = {"stops": _Flow({"stopped": Channels.STOPPED}, "stopped", Channels.NODE_STOPPED, _stops),
          "starts": _Flow({"joined": Channels.JOINED, "resumed": Channels.RESUMED}, "resumed", Channels.NODE_STARTED,
                          _starts)}
_FLOW_OF = {prefix: name for name, flow in _FLOWS.items() for prefix in flow.inputs}
DIGESTED_PREFIXES = tuple(f"{prefix}/".encode() for prefix in _FLOW_OF)  # what the node store's feed must note

_Part = tuple[str, int]  # (flow, generation)
_Item = tuple[str, int]  # (key prefix, rank)


class DigestForwarder:
    """Reads the records written to the node's store (learned from its feed) and writes them on as digests: a
    generation's digest goes once every running worker of the node has its part in (its stop report; its Resumed
    record), or a hold after its first record came in (HOLD_S for stops, START_HOLD_S for starts); records that come
    after it go in the next digest."""

    def __init__(self, node: int, node_store: Any, feed: Feed, hold_s: float = HOLD_S,
                 start_hold_s: float = START_HOLD_S) -> None:
        self.node = node
        self.local = JobStore(node_store)
        self.feed = feed
        self.hold_s = {"stops": hold_s, "starts": start_hold_s}
        self._lock = threading.Lock()  # between the forwarding thread and the follow loop (running, resend)
        self.held: dict[_Part, dict[_Item, Any]] = {}  # (flow, generation) -> (prefix, rank) -> its record
        self.unsent: dict[_Part, set[_Item]] = {}  # what the coordinator's store lacks
        self.since: dict[_Part, float] = {}  # when its oldest unsent record came in (monotonic)
        self.running: frozenset[int] = frozenset()  # the node's workers whose process runs (set by the follow loop)
        self.sent = 0  # digests written (each under a key of its own: the reader deletes what it read)
        self.error: BaseException | None = None  # what ended the thread (the store fenced this launcher)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, now: float) -> None:
        """Move the records written since the last look from the node's store into `held` (each read once and
        deleted there)."""
        for key in self.feed.drain():
            prefix, generation_text, rank_text = key.decode().split("/")
            flow = _FLOW_OF.get(prefix)
            if flow is None:
                continue
            generation, rank = int(generation_text), int(rank_text)
            channel = _FLOWS[flow].inputs[prefix]
            try:
                record = self.local.read(channel, generation, rank)
            except RecordError:
                record = None  # only this job's workers can write here; a record of another version is no record
            self.local.raw.delete_key(channel.key(generation, rank))
            if record is None:
                continue
            with self._lock:
                part = (flow, generation)
                self.held.setdefault(part, {})[(prefix, rank)] = record
                self.unsent.setdefault(part, set()).add((prefix, rank))
                self.since.setdefault(part, now)
                ours = sorted(g for f, g in self.held if f == flow)
                for old in ours[:max(0, len(ours) - KEPT_GENERATIONS)]:
                    self.held.pop((flow, old))
                    self.unsent.pop((flow, old), None)
                    self.since.pop((flow, old), None)

    def due(self, now: float) -> list[_Part]:
        """The (flow, generation) parts whose unsent records go now."""
        with self._lock:
            return sorted(part for part in self.unsent if now >= self.since[part] + self.hold_s[part[0]]
                          or self.running <= {rank for prefix, rank in self.held[part]
                                              if prefix == _FLOWS[part[0]].last})

    def next_due(self) -> float:
        """When the next digest falls due at the latest (monotonic; inf when nothing waits)."""
        with self._lock:
            return min((since + self.hold_s[part[0]] for part, since in self.since.items()), default=math.inf)

    def send(self, jobs: JobStore, now: float) -> None:
        """Write a digest per part that is due. Raises StoreUnavailable while the coordinator is away; what was not
        written is written on a later call."""
        for part in self.due(now):
            flow_name, generation = part
            flow = _FLOWS[flow_name]
            with self._lock:
                items = sorted(self.unsent.get(part, ()))
                records: dict[str, dict[int, Any]] = {}
                for prefix, rank in items:
                    records.setdefault(prefix, {})[rank] = self.held[part][(prefix, rank)]
                seq = self.sent
            if not items:
                continue
            jobs.put(flow.digest, flow.make(self.node, generation, records), generation, self.node, seq)
            with self._lock:
                self.sent = max(self.sent, seq + 1)
                left = self.unsent.get(part, set()) - set(items)
                if left:
                    self.unsent[part] = left  # came in meanwhile: they go in the next digest
                    self.since[part] = now
                else:
                    self.unsent.pop(part, None)
                    self.since.pop(part, None)

    def resend(self) -> None:
        """The coordinator's store is a new one (it restarted): every record held goes to it again, at once."""
        with self._lock:
            self.unsent = {part: set(records) for part, records in self.held.items()}
            self.since = {part: -math.inf for part in self.held}

    # -- the thread ----------------------------------------------------------------------------------------------
    def start(self, jobs: JobStore) -> None:
        """Forward from a thread of its own, on `jobs` (a connection no other thread uses): a record is written on
        as it comes in, not at the follow loop's next pass."""
        self._thread = threading.Thread(target=self._run, args=(jobs,), daemon=True, name="recycle-digest-forwarder")
        self._thread.start()

    def stop(self) -> None:
        """End the thread (within one wait of at most 0.5 s, or 2 s if a store call holds it: then it ends quietly
        by itself, the launcher's stores closed under it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _run(self, jobs: JobStore) -> None:
        retry_at = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                wait_s = min(0.5, max(0.0, max(self.next_due(), retry_at) - now))
                mp_connection.wait([self.feed.fileno()], timeout=wait_s)
                now = time.monotonic()
                self.take(now)
                if now < retry_at:
                    continue
                try:
                    self.send(jobs, now)
                except StoreUnavailable:
                    retry_at = now + 0.1  # the coordinator is away: written once it answers (resend, if it restarted)
        except BaseException as exc:
            if not self._stop.is_set():
                self.error = exc  # the store fenced this launcher: the follow loop raises it
