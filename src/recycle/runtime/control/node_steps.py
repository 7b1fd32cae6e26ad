"""A node launcher's hand-off of its workers' step records: they write them to the node's own store, and the launcher
gives the coordinator one NodeSteps record per step and node, so that the coordinator's reads and its store's
traffic grow with the nodes, not the workers. It keeps the newest steps for a restarted coordinator."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator, TypeVar

from recycle.runtime.protocol.channels import Channel, Channels, JobStore
from recycle.runtime.protocol.records import NodeSteps, PackedRows, RecordError, StepRecord
from recycle.runtime.protocol.store.data import Feed
from recycle.runtime.worker.outbox import KEPT

__all__ = ["StepForwarder", "HeldSteps", "KEPT_STEPS", "take_once"]

R = TypeVar("R")

# Steps whose records a launcher keeps to write again to a restarted coordinator. A worker tells that coordinator the
# oldest step it wrote a record of among its newest KEPT["metrics"] (WorkerResync.oldest_record); its node's other
# workers may be a step or two ahead of it, so the launcher keeps a few more steps than that.
KEPT_STEPS = KEPT["metrics"] + 8


def take_once(feed: Feed, local: JobStore, channel: Channel[R]) -> Iterator[tuple[int, int, R]]:
    """The records of `channel` (keyed by two numbers: step and rank, or generation and rank) that the node's workers
    wrote since the feed's last drain, each read once and deleted from the node's store; a key written twice yields
    its record once."""
    for key in feed.drain():
        _, first_text, rank_text = key.decode().split("/")
        first, rank = int(first_text), int(rank_text)
        try:
            record = local.read(channel, first, rank)
        except RecordError:
            record = None  # only this job's workers can write here; a record of another version is no record
        local.raw.delete_key(channel.key(first, rank))
        if record is not None:
            yield first, rank, record


class StepForwarder:
    """Reads the step records written to the node's store (learned from its feed), hands them on per step."""

    def __init__(self, node: int, node_store: Any, feed: Feed) -> None:
        self.node = node
        self.local = JobStore(node_store)
        self.feed = feed
        self.held: dict[int, dict[int, StepRecord]] = {}  # step -> rank -> its record (the newest KEPT_STEPS steps)
        self.unsent: dict[int, set[int]] = {}  # step -> ranks whose record the coordinator's store lacks
        self.sent = 0  # NodeSteps records written (each under a key of its own: a reader may delete what it read)
        self.dropped = 0  # steps pushed out of `held` before they could be sent (an outage longer than KEPT_STEPS)

    def take(self) -> None:
        """Move the records written since the last look from the node's store into `held`."""
        for step, rank, record in take_once(self.feed, self.local, Channels.METRICS):
            self.held.setdefault(step, {})[rank] = record
            self.unsent.setdefault(step, set()).add(rank)
        for step in sorted(self.held)[:max(0, len(self.held) - KEPT_STEPS)]:
            del self.held[step]
            if self.unsent.pop(step, None):
                self.dropped += 1

    def send(self, jobs: JobStore) -> None:
        """One NodeSteps per step with records not sent yet. Raises StoreUnavailable while the coordinator is away;
        what was not written is written on a later call."""
        for step in sorted(self.unsent):
            held = self.held[step]
            rows = PackedRows.of([held[rank] for rank in sorted(self.unsent[step])])
            jobs.put(Channels.NODE_METRICS, NodeSteps(self.node, step, rows), step, self.node, self.sent)
            del self.unsent[step]
            self.sent += 1

    def forward(self, jobs: JobStore) -> None:
        self.take()
        self.send(jobs)

    def resend(self) -> None:
        """The coordinator's store is a new one (it restarted): every step held goes to it again."""
        self.unsent = {step: set(records) for step, records in self.held.items()}


class HeldSteps:
    """The coordinator's side: the records that came in NodeSteps, per step, until the step is reported. A record
    of a step that a recovery runs again, made in a generation before that recovery's, is stale and left out: a
    launcher may hand one on after the recovery (it writes each step again with every record it holds)."""

    def __init__(self) -> None:
        # step -> rank -> its row in a batch's columns (a row is read only when its step is reported)
        self.records: dict[int, dict[int, tuple[PackedRows, int]]] = {}
        self.fresh_from: list[tuple[int, int]] = []  # (first step, generation) per recovery that runs steps again

    def add(self, batch: NodeSteps, rank_of: Callable[[int, int], int], next_step: int) -> list[int]:
        """Take `batch`'s current records of a step not reported yet (`next_step` is the first one not reported);
        the ranks whose record came in."""
        if batch.step < next_step:
            return []
        rows, floor = batch.rows, self.fresh_generation(batch.step)
        replicas, stages, generations = rows.replica, rows.stage, rows.generation
        held = self.records.setdefault(batch.step, {})
        if min(generations, default=floor) >= floor:
            ranks = list(map(rank_of, replicas, stages))
            held.update(zip(ranks, zip(itertools.repeat(rows), range(len(ranks)))))
            return ranks
        current = [i for i, generation in enumerate(generations) if generation >= floor]
        ranks = list(map(rank_of, map(replicas.__getitem__, current), map(stages.__getitem__, current)))
        held.update(zip(ranks, zip(itertools.repeat(rows), current)))
        return ranks

    def fresh_generation(self, step: int) -> int:
        """The oldest generation whose record of `step` is current."""
        if not self.fresh_from:
            return 0  # (no recovery has run steps again: every record is current)
        return max((generation for first, generation in self.fresh_from if step >= first), default=0)

    def forget_from(self, step: int, generation: int) -> None:
        """Steps from `step` on run again in `generation`: the records held of them are stale."""
        self.records = {s: records for s, records in self.records.items() if s < step}
        self.fresh_from = [(first, g) for first, g in self.fresh_from if first < step] + [(step, generation)]

    def get(self, step: int) -> dict[int, tuple[PackedRows, int]]:
        return self.records.get(step, {})

    def pop(self, step: int) -> None:
        self.records.pop(step, None)
