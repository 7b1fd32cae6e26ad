"""Store flags through JobStore, and what node 0 reads from the heartbeats (Liveness), on an in-process store."""

from __future__ import annotations

import random
import select

import pytest

from recycle.runtime.control.liveness import NODE_BEATS, RETURN_SPREAD_S, Liveness, node_beats_from
from recycle.runtime.protocol.channels import (Channels, Flags, JobStore, Keys, launcher_identity, launcher_node,
                                               worker_identity)
from recycle.runtime.protocol.records import Beat
from recycle.runtime.protocol.store import LocalStore, StoreServer
from recycle.runtime.protocol.store.data import KeyValue, Waiter

TOKEN = "ab" * 24


def _jobs() -> tuple[JobStore, StoreServer]:
    server = StoreServer("127.0.0.1", 0, TOKEN).start()
    return JobStore(LocalStore(server.data, 5.0)), server


def _liveness(server: StoreServer, jobs: JobStore, nodes: range, heartbeat_s: float, timeout_s: float) -> Liveness:
    """A Liveness that learns the node beats from the store's feed, as the supervisor's does."""
    feed = server.data.subscribe((), quiet=(NODE_BEATS,))
    return Liveness(jobs, nodes, heartbeat_s, timeout_s, node_beats_from(feed))


def test_a_flag_is_raised_tested_read_and_lowered_under_its_key() -> None:
    jobs, server = _jobs()
    try:
        assert not jobs.is_set(Flags.FINISHED) and jobs.flag_text(Flags.EXITED, 3) is None
        jobs.raise_flag(Flags.FINISHED)
        jobs.raise_flag(Flags.EXITED, 3, text="-9")
        jobs.raise_flag(Flags.CHECKPOINTED, 4, 1)
        assert jobs.is_set(Flags.FINISHED) and jobs.flag_text(Flags.EXITED, 3) == "-9"
        assert jobs.raw.try_get(Keys.checkpointed(4, 1)) == b"1"  # the keys the workers read and write
        assert Flags.ABORT.name(2) == Keys.abort(2) and Flags.FINISHED.name() == Keys.FINISHED
        jobs.lower_flag(Flags.EXITED, 3)
        assert not jobs.is_set(Flags.EXITED, 3) and jobs.is_set(Flags.CHECKPOINTED, 4, 1)
    finally:
        server.close()


def _beat(jobs: JobStore, rank: int, beats: int, actions: int, phase: str = "compute") -> None:
    jobs.put(Channels.HEARTBEAT, Beat(beats, actions, phase, "inc"), rank)


def test_silent_and_hung_workers_and_silent_nodes() -> None:
    jobs, server = _jobs()
    try:
        watch = _liveness(server, jobs, nodes=range(1, 2), heartbeat_s=0.5, timeout_s=2.0)
        assert watch.due(0.0) and not watch.due(0.1) and watch.due(0.25)
        _beat(jobs, 0, 1, 5)
        _beat(jobs, 1, 1, 5)
        jobs.raw.add(Keys.node_heartbeat(1), 1)
        assert watch.silent_workers(frozenset({0, 1, 2}), 0.0) == [] and watch.silent_nodes(0.0) == []
        _beat(jobs, 0, 2, 5)  # beats, but still in the same action
        assert watch.silent_workers(frozenset({0, 1, 2}), 3.0) == [(1, 3.0)]  # 2 never beat: not counted yet
        assert watch.hung_workers(frozenset({0}), 3.0, limit_s=2.5) == [(0, 3.0)]
        assert watch.hung_workers(frozenset({0}), 4.0, limit_s=2.5) == []  # once
        assert watch.silent_nodes(2.5) == [(1, 2.5)] and watch.fenced_nodes == {1}
        assert watch.silent_nodes(5.0) == []  # fenced: not reported again
        jobs.raw.add(Keys.node_heartbeat(1), 1)  # a new launcher of node 1
        assert watch.silent_nodes(5.5) == [] and watch.fenced_nodes == set() and watch.beating_nodes(6.0) == {1}
        watch.admit(1, 6.0)
        assert watch.silent_workers(frozenset({1}), 7.0) == []  # timed from its admission
    finally:
        server.close()


def _node_beat(jobs: JobStore, *nodes: int) -> None:
    for node in nodes:
        jobs.raw.add(Keys.node_heartbeat(node), 1)


def test_every_node_silent_at_once_is_held_and_none_is_fenced_when_they_come_back() -> None:
    """A coordinator apart from the nodes (hold_s > 0) that hears no node any more holds them, staggered last beats
    and all, reports none, and fences none when they beat again; without a hold the same silence is reported."""
    jobs, server = _jobs()
    try:
        watch = _liveness(server, jobs, nodes=range(0, 3), heartbeat_s=0.5, timeout_s=2.0)
        _node_beat(jobs, 0, 1, 2)
        assert watch.silent_nodes(0.0, hold_s=60) == []
        _node_beat(jobs, 2)  # node 2 last seen 0.6 s after the others: they fall due at different checks
        assert watch.silent_nodes(0.6, hold_s=60) == []
        assert watch.silent_nodes(2.1, hold_s=60) == [] and watch.holding == {0, 1, 2}
        assert watch.silent_nodes(2.7, hold_s=60) == [] and watch.silent_nodes(40.0, hold_s=60) == []
        assert watch.fenced_nodes == set() and watch.holding == {0, 1, 2}
        _node_beat(jobs, 0, 1, 2)  # the network is back
        assert watch.silent_nodes(41.0, hold_s=60) == [] and watch.holding == frozenset()
        assert watch.silent_nodes(42.5, hold_s=60) == [] and watch.fenced_nodes == set()
        assert [node for node, _ in watch.silent_nodes(44.0)] == [0, 1, 2]  # no hold: reported
    finally:
        server.close()


def test_a_held_node_that_does_not_follow_the_others_back_is_reported_and_so_is_a_hold_that_runs_out() -> None:
    jobs, server = _jobs()
    try:
        watch = _liveness(server, jobs, nodes=range(0, 3), heartbeat_s=0.5, timeout_s=2.0)
        _node_beat(jobs, 0, 1, 2)
        assert watch.silent_nodes(0.0, hold_s=100) == []
        assert watch.silent_nodes(2.5, hold_s=100) == [] and watch.holding == {0, 1, 2}
        _node_beat(jobs, 0, 1)  # node 2 does not come back
        assert watch.silent_nodes(10.0, hold_s=100) == [] and watch.holding == {2}
        for now in range(11, 10 + int(RETURN_SPREAD_S)):  # 0 and 1 beat on; 2 is still held
            _node_beat(jobs, 0, 1)
            assert watch.silent_nodes(float(now), hold_s=100) == [] and watch.holding == {2}
        _node_beat(jobs, 0, 1)
        assert watch.silent_nodes(10.0 + RETURN_SPREAD_S, hold_s=100) == [(2, 10.0 + RETURN_SPREAD_S)]
        assert watch.fenced_nodes == {2} and watch.holding == frozenset()

        watch = _liveness(server, jobs, nodes=range(0, 3), heartbeat_s=0.5, timeout_s=2.0)
        _node_beat(jobs, 0, 1, 2)
        assert watch.silent_nodes(0.0, hold_s=10) == []
        assert watch.silent_nodes(2.5, hold_s=10) == [] and watch.holding == {0, 1, 2}
        assert watch.silent_nodes(12.4, hold_s=10) == []
        assert [node for node, _ in watch.silent_nodes(12.5, hold_s=10)] == [0, 1, 2]  # the hold ran out
        assert watch.fenced_nodes == {0, 1, 2} and watch.holding == frozenset()
    finally:
        server.close()


def test_one_node_silent_while_another_beats_is_reported_at_once_even_with_a_hold() -> None:
    jobs, server = _jobs()
    try:
        watch = _liveness(server, jobs, nodes=range(0, 2), heartbeat_s=0.5, timeout_s=2.0)
        _node_beat(jobs, 0, 1)
        assert watch.silent_nodes(0.0, hold_s=60) == []
        _node_beat(jobs, 0)
        assert watch.silent_nodes(0.5, hold_s=60) == []
        _node_beat(jobs, 0)
        assert watch.silent_nodes(2.5, hold_s=60) == [(1, 2.5)] and watch.holding == frozenset()
    finally:
        server.close()


def test_nodes_silent_at_once_whose_connections_closed_are_dead_not_cut_off() -> None:
    """A node whose launcher's connections have all closed died (its kernel closed them): no hold."""
    jobs, server = _jobs()
    try:
        feed = server.data.subscribe((), quiet=(NODE_BEATS,))
        watch = Liveness(jobs, range(0, 2), 0.5, 2.0, node_beats_from(feed), connected_nodes=lambda: {0})
        _node_beat(jobs, 0, 1)
        assert watch.silent_nodes(0.0, hold_s=60) == []
        assert [node for node, _ in watch.silent_nodes(2.5, hold_s=60)] == [0, 1] and watch.holding == frozenset()
    finally:
        server.close()


def test_a_launchers_node_is_read_from_its_identity_and_no_other_identity_has_one() -> None:
    assert launcher_node(launcher_identity(12, "ab12")) == 12
    assert launcher_node(worker_identity(12, "ab12")) is None and launcher_node("launcher/x/1") is None


def test_a_frozen_worker_in_a_long_action_is_told_silent_not_hung() -> None:
    """Worker 0's beats showed one action for 1.5 s (a slow first optimizer step under load); then it ran two short
    steps between two beats, unseen, and was SIGSTOPped. At 3.0 s the action its beats last showed is past the 2.5 s
    hang limit counted up to now, but its beats showed it for 1.5 s only: it is not told hung ("its heartbeat goes
    on"), it is told silent once the 2 s heartbeat timeout has passed (CI saw the wrong word before this rule)."""
    jobs, server = _jobs()
    try:
        watch = Liveness(jobs, nodes=range(0), heartbeat_s=0.5, timeout_s=2.0)
        _beat(jobs, 0, 1, 5)
        assert watch.silent_workers(frozenset({0}), 0.0) == []
        _beat(jobs, 0, 2, 5)  # the same action, still beating; then frozen
        assert watch.silent_workers(frozenset({0}), 1.5) == []
        assert watch.silent_workers(frozenset({0}), 3.0) == []
        assert watch.hung_workers(frozenset({0}), 3.0, limit_s=2.5) == []  # last beat 1.5 s ago: going silent
        assert watch.silent_workers(frozenset({0}), 3.6) == [(0, pytest.approx(2.1))]
    finally:
        server.close()


def test_a_watcher_that_was_frozen_itself_does_not_blame_its_peers_for_the_gap() -> None:
    """The coordinator (or a node launcher) SIGSTOPped for 30 s: on waking, its peers' beats are 30 s old, but the
    silence was its own; they are judged from the gap's end, and one that stays silent is still caught."""
    jobs, server = _jobs()
    try:
        watch = _liveness(server, jobs, nodes=range(1, 2), heartbeat_s=0.5, timeout_s=2.0)
        assert watch.due(0.0)
        _beat(jobs, 0, 1, 5)
        jobs.raw.add(Keys.node_heartbeat(1), 1)
        assert watch.silent_workers(frozenset({0}), 0.0) == [] and watch.silent_nodes(0.0) == []
        assert watch.due(30.0)  # woken after 30 s
        assert watch.silent_workers(frozenset({0}), 30.0) == [] and watch.silent_nodes(30.0) == []
        assert watch.hung_workers(frozenset({0}), 30.0, limit_s=2.5) == []
        for tick in range(1, 9):  # awake, checking every 0.25 s; nothing comes from the peers: now it is theirs
            assert watch.due(30.0 + 0.25 * tick)
        assert [r for r, _ in watch.silent_workers(frozenset({0}), 32.0)] == [0]
        assert [n for n, _ in watch.silent_nodes(32.0)] == [1]
    finally:
        server.close()


def _scanned_silent_nodes(last: dict[int, float], fenced: set[int], beaten: set[int], now: float,
                          timeout_s: float) -> list[int]:
    """The node check as a scan of every node (the rule before the heap): the reference the heap must match."""
    for node in beaten:
        last[node] = now
        fenced.discard(node)
    silent = sorted(n for n in last if n not in fenced and now - last[n] > timeout_s)
    fenced.update(silent)
    return silent


def test_the_node_check_from_the_heap_decides_as_a_scan_of_every_node() -> None:
    """Random beats of 40 nodes (some stop, some come back as new launchers, the watcher itself is sometimes frozen
    for longer than half the timeout): the heap's decisions equal the scan's at every look."""
    rng = random.Random(7)
    timeout_s = 2.0
    beaten: set[int] = set()
    watch = Liveness(JobStore(LocalStore(KeyValue(), 1.0)), range(1, 41), 0.5, timeout_s, lambda: beaten)
    last: dict[int, float] = {}
    fenced: set[int] = set()
    previous: float | None = None
    now = 0.0
    stopped: set[int] = set()
    decided = 0
    for _ in range(3000):
        now += rng.choice([0.25, 0.25, 0.25, 0.3, 0.6, 1.7])
        if rng.random() < 0.02:
            stopped ^= {rng.randrange(1, 41)}  # a node goes quiet, or (a new launcher) beats again
        beaten = {n for n in range(0, 41) if n not in stopped and rng.random() < 0.6}  # 0: not a watched node
        if not watch.due(now):
            continue
        if previous is not None and now - previous > timeout_s / 2:  # the watcher's own gap is forgiven
            for node in last:
                last[node] += now - previous - 0.25
        previous = now
        expected = _scanned_silent_nodes(last, fenced, beaten & set(range(1, 41)), now, timeout_s)
        got = watch.silent_nodes(now)
        assert [n for n, _ in got] == expected, now
        assert all(silent == pytest.approx(now - last[n]) for n, silent in got)
        assert watch.fenced_nodes == fenced
        decided += len(got)
    assert decided > 20  # the walk did declare nodes silent


def test_the_node_check_reads_no_key_and_looks_only_at_the_nodes_due() -> None:
    """2,048 nodes that all beat: a look reads nothing from the store, and pops the heap only when one falls due."""

    class CountingStore(LocalStore):
        reads = 0

        def try_get(self, key: str) -> bytes | None:
            CountingStore.reads += 1
            return super().try_get(key)

    nodes = range(2048)
    watch = Liveness(JobStore(CountingStore(KeyValue(), 1.0)), nodes, 0.5, 5.0, lambda: nodes)
    for tick in range(100):
        assert watch.silent_nodes(0.25 * tick) == []
    assert CountingStore.reads == 0 and len(watch._node_due) == 2048


def test_a_quiet_feed_notes_each_key_once_and_wakes_nobody() -> None:
    data = KeyValue()
    feed = data.subscribe((b"exit/",), quiet=(NODE_BEATS,))
    try:
        for _ in range(3):
            data.add(Keys.node_heartbeat(4).encode(), 1)
        data.add(Keys.node_heartbeat(9).encode(), 1)
        assert not select.select([feed], [], [], 0)[0]  # no wake-up for a beat
        assert feed.touched() == {b"node_hb/4", b"node_hb/9"} and feed.touched() == set()
        assert node_beats_from(feed)() == []
        data.set(b"exit/3", b"-9")
        assert select.select([feed], [], [], 1.0)[0] and feed.drain() == [b"exit/3"]
    finally:
        feed.close()


@pytest.mark.parametrize("keys", [
    [b"gen3/plan/0", b"gen3/plan/1", b"gen3/plan/2"],  # under no prefix of the feed's (the common prefix says so)
    [b"exit/1", b"gen3/plan/0", b"node_hb/2", b"exit/1", b"node_hb/2", b"silent/4"],  # mixed
    [b"e", b"exit/7", b"exi"],  # the common prefix is shorter than a watched one
])
def test_a_multi_set_tells_each_feed_its_keys_as_sets_one_by_one_would(keys: list[bytes]) -> None:
    """KeyValue.multi_set hands its keys to the feeds in one call (Feed.publish_many): each feed drains and notes
    the same keys in the same order as after a set per key, and the waits on them are answered."""
    one_by_one, at_once = KeyValue(), KeyValue()
    feeds = [data.subscribe((b"exit/", b"silent/"), quiet=(NODE_BEATS,)) for data in (one_by_one, at_once)]
    fired: list[int] = []
    waiter = Waiter(tuple(keys[-1:]), True, fired.append)
    try:
        assert not at_once.register(waiter)
        for key in keys:
            one_by_one.set(key, b"1")
        at_once.multi_set([(key, b"1") for key in keys])
        watched = [k for k in keys if k.startswith((b"exit/", b"silent/"))]
        assert bool(select.select([feeds[1]], [], [], 0)[0]) == bool(watched)  # woken by a watched key only
        assert feeds[1].drain() == feeds[0].drain() == watched
        assert feeds[1].touched() == feeds[0].touched() == {k for k in keys if k.startswith(NODE_BEATS)}
        assert fired == [0] and at_once.check(keys)
    finally:
        for feed in feeds:
            feed.close()
