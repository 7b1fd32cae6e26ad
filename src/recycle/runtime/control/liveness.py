"""What the heartbeats tell node 0: the workers and node launchers that went silent, and the workers whose main thread
is stuck in one action while their heartbeat goes on."""

from __future__ import annotations

from dataclasses import replace

from recycle.runtime.control.coordinator import Progress, hung_workers, stale_heartbeats, track_progress
from recycle.runtime.protocol.channels import Channels, JobStore, Keys
from recycle.runtime.protocol.records import Beat, RecordError

__all__ = ["Liveness"]


class Liveness:
    """The beats seen so far, by worker and by node launcher, and when each last changed."""

    def __init__(self, jobs: JobStore, nodes: range, heartbeat_s: float, timeout_s: float) -> None:
        self.jobs, self.nodes, self.heartbeat_s, self.timeout_s = jobs, nodes, heartbeat_s, timeout_s
        self.beats: dict[int, tuple[str, int]] = {}  # rank -> (incarnation, beats) of its last beat seen
        self.last_beat: dict[int, float] = {}
        self.progress: dict[int, Progress] = {}  # rank -> its main thread's progress (hang detection)
        self.node_beats: dict[int, int] = {}
        self.node_last_beat: dict[int, float] = {}
        self.fenced_nodes: set[int] = set()
        self.next_check = 0.0
        self.last_check: float | None = None

    def due(self, now: float) -> bool:
        """Twice per heartbeat interval: reading every beat on each poll would load the store for nothing.

        If this process itself did not run for a while (it was frozen, SIGSTOPped, or starved), the peers' silence
        over that gap is its own: their clocks move on by the gap, so that a watcher that wakes up does not declare
        every peer dead (whose beats it could not read, or that could not reach its store, meanwhile)."""
        if now < self.next_check:
            return False
        if self.last_check is not None and now - self.last_check > self.timeout_s / 2:
            self._forgive(now - self.last_check - self.heartbeat_s / 2)
        self.last_check = now
        self.next_check = now + self.heartbeat_s / 2
        return True

    def _forgive(self, gap: float) -> None:
        for rank in self.last_beat:
            self.last_beat[rank] += gap
        for node in self.node_last_beat:
            self.node_last_beat[node] += gap
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

    def silent_nodes(self, now: float) -> list[tuple[int, float]]:
        """The node launchers silent past the timeout, with how long they have been; counted as fenced from now
        on, until a new launcher of that node beats."""
        for node in self.nodes:
            raw = self.jobs.raw.try_get(Keys.node_heartbeat(node))
            if raw is not None and raw.isdigit() and int(raw) != self.node_beats.get(node):
                self.node_beats[node] = int(raw)
                self.node_last_beat[node] = now
                self.fenced_nodes.discard(node)  # a fenced launcher cannot beat: this is its node's new launcher
        nodes = frozenset(n for n in self.nodes if n not in self.fenced_nodes)
        silent = stale_heartbeats(self.node_last_beat, nodes, now, self.timeout_s)
        self.fenced_nodes.update(silent)
        return [(node, now - self.node_last_beat[node]) for node in silent]

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
