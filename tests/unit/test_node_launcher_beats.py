"""A node launcher that follows a coordinator elsewhere beats once per heartbeat interval, and between two beats waits
on the coordinator's word in one request, cut short when one of its workers ends: the store's requests per node grow
with the beat rate, and the coordinator needs only a few beats per timeout to tell a silent node."""

from __future__ import annotations

import socket
import threading
import time
import types

from recycle.runtime.control.launcher import NodeWatch, _follow_once, _Following
from recycle.runtime.options import LaunchOptions, with_keywords
from recycle.runtime.protocol.channels import Channels, Flags, JobStore, Keys
from recycle.runtime.protocol.records import Beat
from recycle.runtime.protocol.store.client import LocalStore
from recycle.runtime.protocol.store.data import KeyValue


class _Workers:
    ranks = [2, 3]

    def exitcode(self, rank: int) -> int | None:
        return None

    def pid(self, rank: int) -> int:
        return 100 + rank

    def running_sentinels(self) -> list[int]:
        return []


class _Quiet:
    """The node watch, the step forwarder and the stop forwarder, doing nothing."""

    error = None
    running: frozenset[int] = frozenset()

    def check(self, *args: object) -> None: ...

    def forward(self, *args: object) -> None: ...

    def due_in_s(self) -> float:
        return 0.0


def _beats(jobs: JobStore) -> int:
    return int(jobs.raw.try_get(Keys.node_heartbeat(0)) or 0)


def test_a_following_launcher_beats_once_per_heartbeat_interval_and_at_once_for_a_restarted_coordinator() -> None:
    jobs = JobStore(LocalStore(KeyValue()))
    options = with_keywords(LaunchOptions(), dict(heartbeat_s=0.5, heartbeat_timeout_s=4.0))
    following, quiet = _Following(), _Quiet()
    for rank in _Workers.ranks:  # told to fence nobody: every pass waits out its 0.1 s on the coordinator's word
        following.killed[rank] = None
    passes = [0.125 * i for i in range(17)]  # 2 s of a loop's passes (binary fractions: exact sums)
    for now in passes:
        assert not _follow_once(jobs, _Workers(), options, None,  # type: ignore[arg-type]
                                following, quiet, quiet, quiet, now)
    assert _beats(jobs) == 5  # at 0, 0.5, 1.0, 1.5 and 2.0 s: not 17
    following.forget()  # a restarted coordinator's store is empty: the next pass beats whatever the interval
    assert not _follow_once(jobs, _Workers(), options, None,  # type: ignore[arg-type]
                            following, quiet, quiet, quiet, 2.125)
    assert _beats(jobs) == 6
    # A short timeout beats at least 4 times in it, whatever the interval.
    jobs2 = JobStore(LocalStore(KeyValue()))
    short = with_keywords(LaunchOptions(), dict(heartbeat_s=0.5, heartbeat_timeout_s=1.0))
    following2 = _Following(killed={rank: None for rank in _Workers.ranks})
    for now in passes[:9]:
        _follow_once(jobs2, _Workers(), short, None, following2, quiet, quiet, quiet, now)  # type: ignore[arg-type]
    assert _beats(jobs2) == 5  # every 0.25 s over 1 s
    assert not jobs.is_set(Flags.EXITED, 2)


class _CountingStore(LocalStore):
    def __init__(self, data: KeyValue) -> None:
        super().__init__(data)
        self.waits: list[float] = []

    def wait_any(self, keys: list[str], timeout_s: float, wake=(),  # type: ignore[no-untyped-def]
                 beat=None) -> int | None:
        self.waits.append(timeout_s)
        return super().wait_any(keys, timeout_s, wake, beat)


class _EndingWorkers(_Workers):
    """Worker 3's process ends when `end` is set: its sentinel turns readable."""

    def __init__(self) -> None:
        self.sentinel, self.ender = socket.socketpair()
        self.ended = False

    def exitcode(self, rank: int) -> int | None:
        return -9 if rank == 3 and self.ended else None

    def running_sentinels(self) -> list[int]:
        return [] if self.ended else [self.sentinel.fileno()]

    def end(self) -> None:
        self.ended = True
        self.ender.send(b"x")


class _Watch(_Quiet):
    def __init__(self, every_s: float) -> None:
        self.every_s, self.next_at = every_s, time.monotonic()

    def check(self, *args: object) -> None:
        if time.monotonic() >= self.next_at:
            self.next_at = time.monotonic() + self.every_s

    def due_in_s(self) -> float:
        return self.next_at - time.monotonic()


def test_between_two_beats_a_launcher_waits_once_and_a_worker_that_ends_cuts_the_wait_short() -> None:
    store = _CountingStore(KeyValue())
    jobs = JobStore(store)
    options = with_keywords(LaunchOptions(), dict(heartbeat_s=0.4, heartbeat_timeout_s=4.0))
    workers, watch, quiet = _EndingWorkers(), _Watch(0.4), _Quiet()
    following = _Following(killed={rank: None for rank in _Workers.ranks})
    started = time.monotonic()
    while time.monotonic() - started < 1.9:
        _follow_once(jobs, workers, options, None, following, watch, quiet, quiet,  # type: ignore[arg-type]
                     time.monotonic())
    passes = len(store.waits)
    assert 4 <= passes <= 7, store.waits  # ~one per 0.4 s interval (was one per 0.1 s: 19)
    assert 4 <= _beats(jobs) <= 6
    assert max(store.waits) > 0.3
    threading.Timer(0.1, workers.end).start()
    before = time.monotonic()
    _follow_once(jobs, workers, options, None, following, watch, quiet, quiet,  # type: ignore[arg-type]
                 time.monotonic())
    assert time.monotonic() - before < 0.3  # woken by the sentinel, not at the next beat
    assert not jobs.is_set(Flags.EXITED, 3)
    _follow_once(jobs, workers, options, None, following, watch, quiet, quiet,  # type: ignore[arg-type]
                 time.monotonic())
    assert jobs.is_set(Flags.EXITED, 3)  # the next pass reports it
    workers.sentinel.close()
    workers.ender.close()


class _LimitReads(LocalStore):
    def __init__(self, data: KeyValue) -> None:
        super().__init__(data)
        self.limit_reads = 0

    def try_get(self, key: str) -> bytes | None:
        self.limit_reads += key == Keys.HANG_LIMIT
        return super().try_get(key)


def test_the_node_watch_reads_the_hang_limit_once_per_timeout_and_again_before_it_condemns() -> None:
    """Not once per check (every heartbeat interval): a worker over the limit it last read is judged on the
    coordinator's limit of now (raised for a slower plan: not hung), and a lowered limit counts within a timeout."""
    node = types.SimpleNamespace(data=KeyValue())  # the node's own store: its workers' beats
    beats = JobStore(LocalStore(node.data))
    store = _LimitReads(KeyValue())
    jobs = JobStore(store)
    options = with_keywords(LaunchOptions(), dict(heartbeat_s=0.5, heartbeat_timeout_s=4.0))
    watch = NodeWatch(node, options)  # type: ignore[arg-type]
    store.set(Keys.HANG_LIMIT, "3")
    for tick in range(21):  # 10 s, a check every 0.5 s; worker 2 computes one action all along, worker 3 works
        now = 0.5 * tick
        if tick == 4:
            store.set(Keys.HANG_LIMIT, "10")  # raised at 2 s
        if tick == 10:
            store.set(Keys.HANG_LIMIT, "2")  # lowered at 5 s
        beats.put(Channels.HEARTBEAT, Beat(tick + 1, 5, "compute", "a"), 2)
        beats.put(Channels.HEARTBEAT, Beat(tick + 1, tick, "compute", "a"), 3)
        watch.check(jobs, _Workers(), now)
        told = jobs.flag_text(Flags.SILENT, 2)
        assert (told is None) == (now < 7.5), (now, told)  # read at 0, 3.5 (over 3: read again: 10), 7.5 (2)
    assert "over the 2.0 s limit" in (jobs.flag_text(Flags.SILENT, 2) or "")
    assert not jobs.is_set(Flags.SILENT, 3)
    assert store.limit_reads == 3  # against 21, one per check
