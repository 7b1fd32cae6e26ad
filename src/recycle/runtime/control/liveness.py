"""What the heartbeats tell node 0: the workers and node launchers that went silent, and the workers whose main thread
is stuck in one action while their heartbeat goes on."""

from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Callable, Collection

from recycle.runtime.control.coordinator import Progress, hung_workers, stale_heartbeats, track_progress
from recycle.runtime.protocol.channels import Channels, JobStore, Keys
from recycle.runtime.protocol.records import Beat, RecordError
from recycle.runtime.protocol.store.data import Feed

__all__ = ["Liveness", "NODE_BEATS", "RETURN_SPREAD_S", "node_beats_from"]

NODE_BEATS = Keys.NODE_HEARTBEATS.encode()  # the prefix of the node launchers' beat keys
# How far apart the nodes' beats may come back after this process's network does: a launcher's request in flight
# when the link went is retransmitted by TCP with a doubling backoff (a 15 s cut: the next retransmission came 14.6 s
# after the link was back, measured here) until its socket's timeout (the request's wait plus max(30 s, --timeout))
# drops it, and a connection dropped is made again every 5 s at most (StoreClient).
RETURN_SPREAD_S = 60.0


def _no_node_beats() -> Collection[int]:
    return ()


def node_beats_from(feed: Feed) -> Callable[[], list[int]]:
    """Liveness's `node_beats` from a store feed that notes the NODE_BEATS keys (quietly: see Feed)."""
    start = len(NODE_BEATS)
    return lambda: [int(key[start:]) for key in feed.touched()]


class Liveness:
    """The beats seen so far, by worker and by node launcher, and when each last changed.

    The node launchers' beats are not read key by key: `node_beats()` says which nodes beat since its last call (the
    store's feed notes their keys), and a node is looked at again only when its silence could have passed the timeout
    (a heap of the times each node was last seen beating), so a check costs the nodes that beat or fell due, not a
    read per node (docs/cluster.md, "How the control plane scales with nodes")."""

    def __init__(self, jobs: JobStore, nodes: range, heartbeat_s: float, timeout_s: float,
                 node_beats: Callable[[], Collection[int]] = _no_node_beats,
                 check_every_s: float | None = None,
                 connected_nodes: Callable[[], Collection[int]] | None = None) -> None:
        self.jobs, self.nodes, self.heartbeat_s, self.timeout_s = jobs, nodes, heartbeat_s, timeout_s
        # The nodes whose launcher holds a connection to the store open (None: not known). A node whose connections
        # all closed has died (its kernel closed them); a cut or a freeze closes nothing.
        self.connected_nodes = connected_nodes
        self.check_every_s = heartbeat_s / 2 if check_every_s is None else check_every_s
        self.node_beats = node_beats
        self.beats: dict[int, tuple[str, int]] = {}  # rank -> (incarnation, beats) of its last beat seen
        self.last_beat: dict[int, float] = {}
        self.progress: dict[int, Progress] = {}  # rank -> its main thread's progress (hang detection)
        self.node_last_beat: dict[int, float] = {}  # node -> when its beat was last seen (a look's time)
        # (node_last_beat when pushed, node): one entry per node seen and not fenced; an entry older than the node's
        # newest beat is pushed again with it when it falls due.
        self._node_due: list[tuple[float, int]] = []
        self.fenced_nodes: set[int] = set()
        # The nodes not reported although silent past the timeout (silent_nodes' hold_s), and until when.
        self.holding: frozenset[int] = frozenset()
        self.hold_began = self.hold_until = 0.0
        self.next_check = 0.0
        self.last_check: float | None = None

    def due(self, now: float) -> bool:
        """Every `check_every_s` (twice per heartbeat interval unless told): reading every beat on each poll would load
        the store for nothing.

        If this process itself did not run for a while (it was frozen, SIGSTOPped, or starved), the peers' silence
        over that gap is its own: their clocks move on by the gap, so that a watcher that wakes up does not declare
        every peer dead (whose beats it could not read, or that could not reach its store, meanwhile)."""
        if now < self.next_check:
            return False
        if self.last_check is not None and now - self.last_check > self.timeout_s / 2:
            self._forgive(now - self.last_check - self.check_every_s)
        self.last_check = now
        self.next_check = now + self.check_every_s
        return True

    def _forgive(self, gap: float) -> None:
        for rank in self.last_beat:
            self.last_beat[rank] += gap
        for node in self.node_last_beat:
            self.node_last_beat[node] += gap
        self._node_due = [(seen + gap, node) for seen, node in self._node_due]  # (one shift keeps the heap order)
        self.progress = {r: replace(p, since=p.since + gap) for r, p in self.progress.items()}

    def silent_workers(self, live: frozenset[int], now: float) -> list[tuple[int, float]]:
        """Read the beats of `live`; those silent past the timeout, with how long they have been."""
        for rank in live:
            beat = self._beat(rank)
            if beat is not None and (beat.incarnation, beat.beats) != self.beats.get(rank):
                self.beats[rank] = (beat.incarnation, beat.beats)
                self.last_beat[rank] = now
                self.progress[rank] = track_progress(self.progress.get(rank), beat.actions, beat.phase, now)
        return [(r, now - self.last_beat[r]) for r in stale_heartbeats(self.last_beat, live, now, self.timeout_s)]

    def hung_workers(self, ranks: frozenset[int], now: float, limit_s: float) -> list[tuple[int, float]]:
        """Those of `ranks` whose beats show one action computing for longer than `limit_s`, with for how long (each
        reported once). Judged up to the last beat, not up to now: a worker frozen (SIGSTOPped) just after a slow
        action whose beats were last read at its start is not told hung, "its heartbeat goes on", when nothing of it
        goes on; it is told silent once the heartbeat timeout passes. (The beats sample the main thread every
        heartbeat interval: steps shorter than that can run between two beats unseen. CI saw it: a first optimizer
        step of 2 s, two fast steps between beats, then the freeze.)"""
        last = {r: self.last_beat[r] for r in ranks if r in self.last_beat}
        return [(r, last[r] - self.progress.pop(r).since) for r in hung_workers(self.progress, last, limit_s)]

    def any_hung(self, ranks: frozenset[int], limit_s: float) -> bool:
        """Whether hung_workers would name one of `ranks` at `limit_s` (it reports nobody: a look ahead)."""
        last = {r: self.last_beat[r] for r in ranks if r in self.last_beat}
        return bool(hung_workers(self.progress, last, limit_s))

    def silent_nodes(self, now: float, hold_s: float = 0.0) -> list[tuple[int, float]]:
        """The node launchers silent past the timeout, with how long they have been; counted as fenced from now
        on, until a new launcher of that node beats.

        `hold_s` > 0 (a coordinator apart from the nodes, each of which waits as long for it): when every node still
        running is silent at once, this process has more likely lost its own network than they have all failed, and
        declaring them dead would end the run (nothing would be left to train): they are held (`holding`), not
        reported, for up to `hold_s`. Once one of them beats again (the network is back), the others have
        RETURN_SPREAD_S (or the timeout, if longer) more to follow, as their connections come back one by one; then
        those still silent are reported."""
        beaten = [node for node in self.node_beats() if node in self.nodes]
        seen = self.node_last_beat
        for node in beaten:
            if node not in seen or node in self.fenced_nodes:
                # First seen, or a fenced launcher's node beats (a fenced one cannot: this is its new launcher).
                self.fenced_nodes.discard(node)
                heapq.heappush(self._node_due, (now, node))
        seen.update(dict.fromkeys(beaten, now))
        due, timeout, silent = self._node_due, self.timeout_s, []
        while due and now - due[0][0] > timeout:
            _, node = heapq.heappop(due)
            if now - seen[node] > timeout:
                silent.append(node)
            else:
                heapq.heappush(due, (seen[node], node))  # it beat since: due again one timeout after that
        silent = self._hold(silent, now, hold_s)
        self.fenced_nodes.update(silent)
        return [(node, now - seen[node]) for node in sorted(silent)]

    def _hold(self, silent: list[int], now: float, hold_s: float) -> list[int]:
        """`silent` less the nodes held (silent_nodes' `hold_s`). A hold begins when a node falls silent while every
        node still running has missed two beats or more (they beat every timeout / 4 at most), so that the nodes a
        cut silenced at once are held together, whichever check each falls due at; and only if no silent node's
        connections have all closed (`connected_nodes`: such a node is dead, not cut off)."""
        seen, timeout = self.node_last_beat, self.timeout_s
        if hold_s > 0 and silent and not self.holding:
            running = [node for node in seen if node not in self.fenced_nodes]
            if all(now - seen[node] > timeout / 2 for node in running) and \
                    (self.connected_nodes is None or set(silent) <= set(self.connected_nodes())):
                self.holding, self.hold_began, self.hold_until = frozenset(running), now, now + hold_s
        if not self.holding:
            return silent
        back = {node for node in self.holding if seen[node] >= self.hold_began}
        if back:  # the network is back: the others follow within RETURN_SPREAD_S, or are reported
            self.hold_until = min(self.hold_until, now + max(timeout, RETURN_SPREAD_S))
            self.holding -= back
        if now >= self.hold_until or not self.holding:
            self.holding = frozenset()
            return silent
        for node in silent:
            if node in self.holding:
                heapq.heappush(self._node_due, (seen[node], node))  # due at once: looked at again at every check
        return [node for node in silent if node not in self.holding]

    def nodes_seen(self, now: float) -> None:
        """Every node counts as seen beating now (a restarted coordinator: silence counts from the restart)."""
        for node in self.nodes:
            if node not in self.node_last_beat and node not in self.fenced_nodes:
                heapq.heappush(self._node_due, (now, node))
            self.node_last_beat[node] = now

    def beating_nodes(self, now: float) -> set[int]:
        return {n for n, t in self.node_last_beat.items() if now - t <= self.timeout_s}

    def forget(self, rank: int) -> None:
        """A new process runs as `rank`: it is watched from its first beat on."""
        self.last_beat.pop(rank, None)
        self.beats.pop(rank, None)
        self.progress.pop(rank, None)

    def admit(self, rank: int, now: float) -> None:
        """A replacement is timed from its admission, not from the last beat of the process it replaces."""
        self.last_beat[rank] = now
        self.beats.pop(rank, None)
        self.progress.pop(rank, None)

    def _beat(self, rank: int) -> Beat | None:
        try:
            return self.jobs.read(Channels.HEARTBEAT, rank)
        except RecordError:
            return None  # only the job's own processes can write it; a malformed beat is no beat
