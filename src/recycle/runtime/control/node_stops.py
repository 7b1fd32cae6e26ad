"""A node launcher's hand-off of its workers' stop reports: they write them to the node's own store, and a thread of
the launcher writes the coordinator one digest (NodeStops) per node and generation, so that a recovery's reports cost
the coordinator's store one request per node, not per worker. It keeps the newest generations' reports for a
restarted coordinator."""

from __future__ import annotations

import math
import threading
import time
from multiprocessing import connection as mp_connection
from typing import Any

from recycle.runtime.control.node_steps import take_once
from recycle.runtime.protocol.channels import Channels, JobStore
from recycle.runtime.protocol.records import NodeStops, StoppedReport
from recycle.runtime.protocol.store import StoreUnavailable
from recycle.runtime.protocol.store.data import Feed

__all__ = ["StopForwarder", "HOLD_S", "KEPT_GENERATIONS"]

# How long a digest waits for the node's other running workers once one has reported: they all watch the same abort
# key and report within milliseconds, but a frozen one never does (it must not hold the others back), and one that
# reports later goes in a digest of its own.
HOLD_S = 0.05
KEPT_GENERATIONS = 2  # generations whose reports are written again to a restarted coordinator


class StopForwarder:
    """Reads the stop reports written to the node's store (learned from its feed) and writes them on as digests:
    a generation's digest goes once every running worker of the node has reported to it, or HOLD_S after its first
    report came in; reports that come after it go in the next digest."""

    def __init__(self, node: int, node_store: Any, feed: Feed, hold_s: float = HOLD_S) -> None:
        self.node = node
        self.local = JobStore(node_store)
        self.feed = feed
        self.hold_s = hold_s
        self._lock = threading.Lock()  # between the forwarding thread and the follow loop (running, resend)
        self.held: dict[int, dict[int, StoppedReport]] = {}  # generation -> rank -> its report
        self.unsent: dict[int, set[int]] = {}  # generation -> ranks whose report the coordinator's store lacks
        self.since: dict[int, float] = {}  # generation -> when its oldest unsent report came in (monotonic)
        self.running: frozenset[int] = frozenset()  # the node's workers whose process runs (set by the follow loop)
        self.sent = 0  # digests written (each under a key of its own: the reader deletes what it read)
        self.error: BaseException | None = None  # what ended the thread (the store fenced this launcher)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self, now: float) -> None:
        """Move the reports written since the last look from the node's store into `held`."""
        for generation, rank, report in take_once(self.feed, self.local, Channels.STOPPED):
            with self._lock:
                self.held.setdefault(generation, {})[rank] = report
                self.unsent.setdefault(generation, set()).add(rank)
                self.since.setdefault(generation, now)
                for old in sorted(self.held)[:max(0, len(self.held) - KEPT_GENERATIONS)]:
                    del self.held[old]
                    self.unsent.pop(old, None)
                    self.since.pop(old, None)

    def due(self, now: float) -> list[int]:
        """The generations whose unsent reports go now."""
        with self._lock:
            return sorted(g for g in self.unsent
                          if self.running <= self.held[g].keys() or now >= self.since[g] + self.hold_s)

    def next_due(self) -> float:
        """When the next digest falls due at the latest (monotonic; inf when nothing waits)."""
        with self._lock:
            return min((since + self.hold_s for since in self.since.values()), default=math.inf)

    def send(self, jobs: JobStore, now: float) -> None:
        """Write a digest per generation that is due. Raises StoreUnavailable while the coordinator is away; what
        was not written is written on a later call."""
        for generation in self.due(now):
            with self._lock:
                ranks = sorted(self.unsent.get(generation, ()))
                reports = tuple(self.held[generation][rank] for rank in ranks)
                seq = self.sent
            if not reports:
                continue
            jobs.put(Channels.NODE_STOPPED, NodeStops(self.node, generation, reports), generation, self.node, seq)
            with self._lock:
                self.sent = max(self.sent, seq + 1)
                left = self.unsent.get(generation, set()) - set(ranks)
                if left:
                    self.unsent[generation] = left  # came in meanwhile: they go in the next digest
                    self.since[generation] = now
                else:
                    self.unsent.pop(generation, None)
                    self.since.pop(generation, None)

    def resend(self) -> None:
        """The coordinator's store is a new one (it restarted): every report held goes to it again, at once."""
        with self._lock:
            self.unsent = {generation: set(reports) for generation, reports in self.held.items()}
            self.since = {generation: -math.inf for generation in self.held}

    # -- the thread ----------------------------------------------------------------------------------------------
    def start(self, jobs: JobStore) -> None:
        """Forward from a thread of its own, on `jobs` (a connection no other thread uses): a report is written on
        as it comes in, not at the follow loop's next pass."""
        self._thread = threading.Thread(target=self._run, args=(jobs,), daemon=True, name="recycle-stop-forwarder")
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
