"""The restartable coordinator's pieces with fakes: a worker's outbox (writes wait while the store is away, and a new
store gets back what it lacks) and the restarted coordinator's rebuild of the run (a pure function)."""

from __future__ import annotations

import threading
import time

import pytest

from recycle.runtime.control.resync import is_restart, rebuild
from recycle.runtime.protocol.channels import Channels, Keys
from recycle.runtime.protocol.records import (Announcement, FaultRecord, NodeHello, RecordError, StepRecord,
                                              WorkerResync, from_json)
from recycle.runtime.protocol.store import StoreFenced, StoreUnavailable
from recycle.runtime.worker.outbox import KEPT, Outbox


class FakeStore:
    """A store that can be taken away and brought back, empty (a restarted coordinator's) or not."""

    def __init__(self, instance: str = "a") -> None:
        self.data: dict[str, bytes] = {Keys.STORE_INSTANCE: instance.encode()}
        self.away = False
        self.log: list[str] = []

    def restart(self, instance: str) -> None:
        self.data = {Keys.STORE_INSTANCE: instance.encode()}
        self.away = False

    def _check(self) -> None:
        if self.away:
            raise StoreUnavailable("the store is away")

    def set(self, key: str, value: bytes) -> None:
        self._check()
        self.data[key] = value
        self.log.append(key)

    def add(self, key: str, value: int) -> int:
        self._check()
        total = int(self.data.get(key, b"0")) + value
        self.data[key] = str(total).encode()
        self.log.append(key)
        return total

    def try_get(self, key: str) -> bytes | None:
        self._check()
        return self.data.get(key)


def COUNT(generation: int) -> str:
    """A key the outbox adds to (op "add"), kept for a new store like the join kind."""
    return f"count/{generation}"


def _step(step: int) -> StepRecord:
    return StepRecord(0, 1, 0, float(step), step + 0.5, 0.1, None, None, None, 1.0)


def _status() -> WorkerResync:
    return WorkerResync(3, "training", 7, 1234, "abc")


def test_writes_go_straight_through_while_the_store_answers() -> None:
    store, outbox = FakeStore(), Outbox(5, _status)
    outbox.sync(store)
    outbox.put(store, Channels.METRICS, _step(0), 0, 5, kind="metrics", order=0)
    outbox.write(store, COUNT(0), "1", kind="join", op="add")
    assert from_json(StepRecord, store.data[Keys.metrics(0, 5)]) == _step(0)
    assert store.data[COUNT(0)] == b"1"
    assert not outbox.needs_sync()


def test_writes_wait_in_order_while_the_store_is_away_and_go_out_when_it_is_back() -> None:
    store, outbox = FakeStore(), Outbox(5, _status)
    outbox.sync(store)
    store.away = True
    for step in range(3):
        outbox.put(store, Channels.METRICS, _step(step), step, 5, kind="metrics", order=step)
    outbox.put(store, Channels.FAULT, FaultRecord(1.0, "x", "kill"), 5)
    assert outbox.down and outbox.needs_sync()
    with pytest.raises(StoreUnavailable):
        outbox.sync(store)  # still away
    store.away = False
    store.log.clear()
    assert outbox.sync(store) is False  # the same store: only what waited is written, in order
    assert store.log == [Keys.metrics(0, 5), Keys.metrics(1, 5), Keys.metrics(2, 5), Keys.fault(5)]
    assert not outbox.needs_sync()
    # The next write goes straight through again.
    outbox.put(store, Channels.METRICS, _step(3), 3, 5, kind="metrics", order=3)
    assert Keys.metrics(3, 5) in store.data


def test_a_new_store_gets_back_every_kept_write_and_where_the_worker_stands() -> None:
    store, outbox = FakeStore("first"), Outbox(5, _status)
    outbox.sync(store)
    for step in range(3):
        outbox.put(store, Channels.METRICS, _step(step), step, 5, kind="metrics", order=step)
    outbox.write(store, COUNT(2), "1", kind="join", op="add")
    outbox.remember(Keys.announce(2), b'{"kind": "announce"}', "announce")
    outbox.put(store, Channels.FAULT, FaultRecord(1.0, "x", "kill"), 5)
    store.away = True
    outbox.down = True  # the watcher's own call found it away
    store.restart("second")
    assert outbox.sync(store) is True
    assert set(store.data) == {Keys.STORE_INSTANCE, Keys.metrics(0, 5), Keys.metrics(1, 5), Keys.metrics(2, 5),
                               COUNT(2), Keys.announce(2), Keys.resync(5)}  # the fault was not kept
    assert store.data[COUNT(2)] == b"1"  # an add is made once per store
    assert from_json(WorkerResync, store.data[Keys.resync(5)]) == _status()
    assert outbox.resyncs == 1 and outbox.oldest_record() == 0


class GatedStore(FakeStore):
    """A store whose writes of one key wait until the test lets them through (a slow round trip)."""

    def __init__(self, gated: str) -> None:
        super().__init__()
        self.gated, self.open, self.entered = gated, threading.Event(), threading.Event()
        self.lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        if key == self.gated:
            self.entered.set()
            assert self.open.wait(10)
        with self.lock:
            super().set(key, value)

    def add(self, key: str, value: int) -> int:
        with self.lock:
            return super().add(key, value)


def _until(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.005)
    assert condition(), "timed out"  # type: ignore[operator]


def test_a_background_write_does_not_wait_for_the_store_and_later_writes_keep_their_order() -> None:
    store = GatedStore(Keys.metrics(0, 5))
    outbox = Outbox(5, _status)
    outbox.sync(store)
    outbox.start_writer(store)
    outbox.put(store, Channels.METRICS, _step(0), 0, 5, kind="metrics", order=0, background=True)  # returns at once
    assert store.entered.wait(10)  # the writer thread is inside the slow write
    # The training thread goes on: its next writes must not overtake the step record.
    outbox.write(store, COUNT(0), "1", kind="join", op="add")
    outbox.put(store, Channels.FAULT, FaultRecord(1.0, "x", "kill"), 5)
    assert store.log == []
    store.open.set()
    outbox.wait_sent()
    assert store.log == [Keys.metrics(0, 5), COUNT(0), Keys.fault(5)]
    assert not outbox.needs_sync() and outbox.oldest_record() == 0  # the step record is kept for a new store
    # Nothing queued: a write goes straight through again, and a background one is written by the thread.
    outbox.put(store, Channels.FAULT, FaultRecord(2.0, "y", "kill"), 6)
    assert store.log[-1] == Keys.fault(6)
    outbox.put(store, Channels.METRICS, _step(1), 1, 5, kind="metrics", order=1, background=True)
    _until(lambda: Keys.metrics(1, 5) in store.data)


def test_flush_waits_for_a_write_queued_behind_a_background_one_unless_the_store_is_away() -> None:
    store = GatedStore(Keys.metrics(0, 5))
    outbox = Outbox(5, _status)
    outbox.sync(store)
    outbox.start_writer(store)
    outbox.put(store, Channels.METRICS, _step(0), 0, 5, kind="metrics", order=0, background=True)
    assert store.entered.wait(10)
    outbox.put(store, Channels.FAULT, FaultRecord(1.0, "x", "kill"), 5)  # queued behind the step record
    threading.Timer(0.2, store.open.set).start()
    outbox.flush(timeout_s=10)
    assert store.log == [Keys.metrics(0, 5), Keys.fault(5)]  # what a fault injection needs before it fires
    away = FakeStore()
    idle = Outbox(6, _status)
    idle.sync(away)
    away.away = True
    idle.put(away, Channels.FAULT, FaultRecord(1.0, "x", "kill"), 6)  # finds the store away: queued
    started = time.monotonic()
    idle.flush(timeout_s=10)
    assert time.monotonic() - started < 1.0 and idle.down  # does not wait for a store that is away


def test_a_background_write_that_finds_the_store_away_waits_for_the_watchers_sync() -> None:
    store, outbox = FakeStore(), Outbox(5, _status)
    outbox.sync(store)
    outbox.start_writer(store)
    store.away = True
    outbox.put(store, Channels.METRICS, _step(0), 0, 5, kind="metrics", order=0, background=True)
    _until(lambda: outbox.down)
    outbox.put(store, Channels.FAULT, FaultRecord(1.0, "x", "kill"), 5)  # queues behind it
    store.away = False
    assert outbox.sync(store) is False
    assert store.log == [Keys.metrics(0, 5), Keys.fault(5)] and not outbox.needs_sync()


class FencingStore(FakeStore):
    def set(self, key: str, value: bytes) -> None:
        raise StoreFenced("this worker was fenced")


def test_a_fence_met_by_the_writer_is_raised_to_the_next_write() -> None:
    store, outbox = FencingStore(), Outbox(5, _status)
    outbox.start_writer(store)
    outbox.put(store, Channels.METRICS, _step(0), 0, 5, kind="metrics", order=0, background=True)
    _until(lambda: outbox._writer_error is not None)
    with pytest.raises(StoreFenced):
        outbox.put(store, Channels.FAULT, FaultRecord(1.0, "x", "kill"), 5)
    with pytest.raises(StoreFenced):
        outbox.wait_sent()


def test_kept_writes_are_bounded_and_the_unsent_ones_pushed_out_are_counted() -> None:
    store, outbox = FakeStore(), Outbox(0, _status)
    outbox.sync(store)
    store.away = True
    steps = KEPT["metrics"] + 5
    for step in range(steps):
        outbox.put(store, Channels.METRICS, _step(step), step, 0, kind="metrics", order=step)
    assert outbox.dropped == 5 and outbox.oldest_record() == 5
    store.away = False
    outbox.sync(store)
    assert Keys.metrics(4, 0) not in store.data and Keys.metrics(5, 0) in store.data
    outbox.forget(Keys.metrics(5, 0))
    assert outbox.oldest_record() == 6


def _resync(generation: int, phase: str, oldest: int) -> WorkerResync:
    return WorkerResync(generation, phase, oldest, 1, "x")


def test_a_restart_is_told_by_a_node_whose_workers_train() -> None:
    assert not is_restart({0: NodeHello("fresh"), 1: NodeHello("fresh")})
    assert is_restart({0: NodeHello("fresh"), 1: NodeHello("running", (2, 3))})


def test_rebuild_in_generation_0_reports_from_the_first_step_every_member_holds() -> None:
    hellos = {0: NodeHello("running", (0, 1, 2, 3))}
    resyncs = {0: _resync(0, "training", 5), 1: _resync(0, "training", 4), 2: _resync(0, "training", 6),
               3: _resync(0, "training", 5)}
    rebuilt = rebuild(frozenset(range(4)), hellos, resyncs, lambda g: None, None, 0, 20, reported_through=3)
    assert (rebuilt.generation, rebuilt.live, rebuilt.done, rebuilt.next_step) == (0, frozenset(range(4)),
                                                                                   frozenset(), 6)
    assert rebuilt.lost_steps == (3, 6)  # steps 4-6 (1-based) ran unrecorded
    # Nothing lost when the metrics file already has them.
    assert rebuild(frozenset(range(4)), hellos, resyncs, lambda g: None, None, 0, 20, 6).lost_steps is None


def test_rebuild_takes_the_newest_generation_from_its_announcement_with_its_replacements() -> None:
    announcement = Announcement(2, (0, 1, 3), redo_step=9, end_step=20, reason="x", joining=(3,))
    hellos = {0: NodeHello("running", (0, 1, 3), ((2, -9),))}
    resyncs = {0: _resync(2, "training", 10), 1: _resync(1, "stopped", 10), 3: _resync(2, "training", 9),
               4: _resync(0, "admitting", 0)}
    rebuilt = rebuild(frozenset(range(4)), hellos, resyncs, {2: announcement}.get, 8, 0, 20, None)
    assert rebuilt.generation == 2 and rebuilt.live == frozenset({0, 1, 3})
    assert rebuilt.member_from == ((3, 9),) and rebuilt.latest_checkpoint == 8
    assert rebuilt.next_step == 10


def test_rebuild_counts_finished_members_and_those_whose_records_are_gone() -> None:
    hellos = {0: NodeHello("running", (0, 1), ((2, 0), (3, 0)))}
    resyncs = {0: _resync(0, "training", 18), 1: _resync(0, "training", 18), 2: _resync(0, "finished", 17)}
    rebuilt = rebuild(frozenset(range(4)), hellos, resyncs, lambda g: None, None, 0, 20, None)
    assert rebuilt.done == frozenset({2, 3}) and rebuilt.unrecorded == frozenset({3})
    assert rebuilt.next_step == 18
    # Every member finished and none kept its records: nothing is left to report.
    gone = rebuild(frozenset(range(2)), {0: NodeHello("running", (), ((0, 0), (1, 0)))}, {}, lambda g: None, None,
                   0, 20, 12)
    assert gone.next_step == 20 and gone.unrecorded == frozenset({0, 1})


def test_rebuild_without_the_generations_announcement_is_an_error() -> None:
    with pytest.raises(RecordError, match="generation 3"):
        rebuild(frozenset(range(2)), {0: NodeHello("running", (0, 1))}, {0: _resync(3, "training", 4)},
                lambda g: None, None, 0, 20, None)
