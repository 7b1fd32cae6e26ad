"""Records per node: a node launcher hands its workers' stop reports to the coordinator as one NodeStops digest per
generation (control.node_digests.DigestForwarder), once every running worker of the node has reported or a short hold
after the first report (a frozen worker never reports), with late reports in a later digest, and writes them again to
a restarted coordinator; their Joined and Resumed records likewise, as NodeStarted digests."""

from __future__ import annotations

import json
import threading
import time

import pytest

from recycle.runtime.control.node_digests import DIGESTED_PREFIXES, KEPT_GENERATIONS, START_HOLD_S, DigestForwarder
from recycle.runtime.protocol.channels import Channels, JobStore, Keys
from recycle.runtime.protocol.records import (Joined, NodeStarted, NodeStops, RecordError, StoppedReport, Timestamp,
                                              from_json, to_json)
from recycle.runtime.protocol.store import LocalStore, StoreFenced, StoreUnavailable
from recycle.runtime.protocol.store.data import KeyValue

HOLD_S = 0.05


def _report(rank: int, generation: int = 1) -> StoppedReport:
    return StoppedReport(rank, generation, 4, 5, 3, 0.25, 7, 0.5, f"generation {generation} was aborted", 10.0 + rank,
                         weighed_current=rank % 2 == 1)


class _Node:
    """A node's store with its launcher's stop forwarder, and the coordinator's store it writes to."""

    def __init__(self, node: int = 3, running: tuple[int, ...] = (8, 9, 10)) -> None:
        self.data = KeyValue()
        self.workers = JobStore(LocalStore(self.data))  # what the node's workers write to
        self.forwarder = DigestForwarder(node, LocalStore(self.data), self.data.subscribe(DIGESTED_PREFIXES), HOLD_S)
        self.forwarder.running = frozenset(running)
        self.job_data = KeyValue()
        self.feed = self.job_data.subscribe((b"node_stopped/", b"node_started/"))
        self.jobs = JobStore(LocalStore(self.job_data))

    def report(self, rank: int, generation: int = 1) -> None:
        self.workers.put(Channels.STOPPED, _report(rank, generation), generation, rank)

    def forward(self, now: float) -> None:
        self.forwarder.take(now)
        self.forwarder.send(self.jobs, now)

    def start(self, rank: int, generation: int = 1, resumed: bool = True) -> None:
        """A worker's Joined record of `generation`, and its Resumed one (its first action) unless told not."""
        self.workers.put(Channels.JOINED, Joined(20.0 + rank, 0.5, "init"), generation, rank)
        if resumed:
            self.resume(rank, generation)

    def resume(self, rank: int, generation: int = 1) -> None:
        self.workers.put(Channels.RESUMED, Timestamp(30.0 + rank), generation, rank)

    def digests(self) -> list[NodeStops | NodeStarted]:
        """What the coordinator's store got since the last call, read once and deleted (as the coordinator does)."""
        out: list[NodeStops | NodeStarted] = []
        for key in self.feed.drain():
            kind, generation, node, seq = key.decode().split("/")
            channel = Channels.NODE_STOPPED if kind == "node_stopped" else Channels.NODE_STARTED
            digest = self.jobs.read(channel, int(generation), int(node), int(seq))  # type: ignore[attr-defined]
            assert digest is not None
            self.jobs.raw.delete_key(key.decode())
            out.append(digest)
        return out


def test_a_digest_round_trips_with_every_field_of_its_reports() -> None:
    digest = NodeStops(3, 1, (_report(8), _report(9)))
    assert from_json(NodeStops, to_json(digest)) == digest
    assert from_json(NodeStops, to_json(NodeStops(3, 1, ()))) == NodeStops(3, 1, ())
    with pytest.raises(RecordError, match="StoppedReport in a NodeStops record"):
        from_json(NodeStops, '{"kind": "node_stops", "node": 3, "generation": 1, "reports": [{"kind": "beat"}]}')
    with pytest.raises(RecordError, match="reports are int, not StoppedReport records as columns"):
        from_json(NodeStops, '{"kind": "node_stops", "node": 3, "generation": 1, "reports": 7}')


def test_a_digests_reports_travel_as_one_column_per_field_each_checked() -> None:
    text = to_json(NodeStops(3, 1, (_report(8), _report(9))))
    columns = json.loads(text)["reports"]
    assert columns["kind"] == "stop_rows" and columns["rank"] == [8, 9] and columns["weighed_current"] == [False, True]
    assert [r.weighed_current for r in from_json(NodeStops, text).reports] == [False, True]

    def read(**change: object) -> NodeStops:
        return from_json(NodeStops, json.dumps({**json.loads(text), "reports": {**columns, **change}}))

    with pytest.raises(RecordError, match="hold '8' in the column 'rank', which takes int"):
        read(rank=["8", 9])
    with pytest.raises(RecordError, match="hold True in the column 'applied'"):
        read(applied=[True, 4])
    with pytest.raises(RecordError, match="lack the column 'time' of 2 values"):
        read(time=[1.0])
    with pytest.raises(RecordError, match="lack the column 'error'"):
        read(error=None)
    with pytest.raises(RecordError, match="have kind 'step_rows', not 'stop_rows'"):
        read(kind="step_rows")
    assert read(current_s=[0, 1]).reports[1].current_s == 1  # a float column takes an int
    older = {k: v for k, v in columns.items() if k != "tp_split"}  # a field with a default: an older writer's
    assert from_json(NodeStops, json.dumps({**json.loads(text), "reports": older})).reports[0].tp_split == ""


def test_one_digest_goes_as_soon_as_every_running_worker_reported() -> None:
    node = _Node()
    node.report(8)
    node.report(9)
    node.forward(0.0)
    assert node.digests() == []  # worker 10 runs and has not reported: the digest waits for it
    node.report(10)
    node.forward(0.001)  # well inside the hold
    assert node.digests() == [NodeStops(3, 1, (_report(8), _report(9), _report(10)))]
    assert node.data.get(Keys.stopped(1, 8).encode()) is None  # read once from the node's store
    node.forward(1.0)
    assert node.digests() == []  # nothing twice


def test_a_frozen_worker_holds_the_digest_back_for_the_hold_only_and_a_late_report_goes_in_another() -> None:
    node = _Node()
    node.report(8)
    node.report(10)
    node.forward(0.0)
    assert node.digests() == []
    assert node.forwarder.next_due() == pytest.approx(HOLD_S)
    node.forward(HOLD_S)  # worker 9 (frozen: running, silent) is not waited for longer
    assert node.digests() == [NodeStops(3, 1, (_report(8), _report(10)))]
    node.report(9)  # it reports after all: a digest of its own (every running worker is in now: at once)
    node.forward(HOLD_S + 0.001)
    assert node.digests() == [NodeStops(3, 1, (_report(9),))]


def test_workers_that_exited_are_not_waited_for_and_generations_go_apart() -> None:
    node = _Node(running=(8, 9))  # worker 10 was killed: its node saw it exit
    node.report(8)
    node.report(9)
    node.report(8, generation=2)
    node.forward(0.0)
    assert node.digests() == [NodeStops(3, 1, (_report(8), _report(9)))]  # generation 2 waits for worker 9
    node.forward(HOLD_S)
    assert node.digests() == [NodeStops(3, 2, (_report(8, 2),))]


def test_a_restarted_coordinators_store_gets_the_newest_generations_again() -> None:
    node = _Node(running=(8,))
    for generation in range(1, 2 + KEPT_GENERATIONS):
        node.report(8, generation)
        node.forward(float(generation))
    assert len(node.digests()) == 1 + KEPT_GENERATIONS
    node.forwarder.resend()
    node.forward(100.0)
    assert [d.generation for d in node.digests()] == list(range(2, 2 + KEPT_GENERATIONS))


class _AwayStore(LocalStore):
    """A coordinator's store that is away until `back` is set."""

    def __init__(self, data: KeyValue) -> None:
        super().__init__(data)
        self.back = threading.Event()

    def set(self, key: str, value: object) -> None:
        if not self.back.is_set():
            raise StoreUnavailable("the coordinator is away")
        super().set(key, value)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_the_thread_writes_a_digest_as_reports_come_in_and_after_the_coordinator_is_back() -> None:
    """The launcher's thread wakes on the node store's feed (not on the follow loop's next pass), and keeps a digest
    the coordinator's store could not take until it answers again."""
    node = _Node(running=(8, 9))
    node.forwarder.start(node.jobs)
    try:
        node.report(8)
        node.report(9)
        deadline = time.monotonic() + 10.0
        while not node.job_data.num_keys() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert node.digests() == [NodeStops(3, 1, (_report(8), _report(9)))]
        away = _AwayStore(node.job_data)
        node.forwarder.stop()
        node.forwarder = DigestForwarder(3, LocalStore(node.data), node.data.subscribe(DIGESTED_PREFIXES), HOLD_S)
        node.forwarder.running = frozenset((8, 9))
        node.forwarder.start(JobStore(away))
        node.report(8, generation=2)
        node.report(9, generation=2)
        time.sleep(0.3)
        assert node.digests() == []  # away: kept
        away.back.set()
        deadline = time.monotonic() + 10.0
        while not node.job_data.num_keys() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert node.digests() == [NodeStops(3, 2, (_report(8, 2), _report(9, 2)))]
        assert node.forwarder.error is None
    finally:
        node.forwarder.stop()


class _FencedStore(LocalStore):
    """A coordinator's store that has fenced this launcher."""

    def set(self, key: str, value: object) -> None:
        raise StoreFenced("this process was fenced by the job's coordinator")


@pytest.mark.timeout(30)
def test_a_fenced_launchers_thread_ends_and_hands_the_fence_to_the_follow_loop() -> None:
    node = _Node(running=(8,))
    node.forwarder.start(JobStore(_FencedStore(node.job_data)))
    try:
        node.report(8)
        deadline = time.monotonic() + 10.0
        while node.forwarder.error is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert isinstance(node.forwarder.error, StoreFenced)
    finally:
        node.forwarder.stop()


def _joined(*ranks: int) -> tuple[tuple[int, float, float, str], ...]:
    return tuple((rank, 20.0 + rank, 0.5, "init") for rank in ranks)


def _resumed(*ranks: int) -> tuple[tuple[int, float], ...]:
    return tuple((rank, 30.0 + rank) for rank in ranks)


def test_a_generations_start_goes_as_one_digest_once_every_running_worker_resumed() -> None:
    node = _Node()
    node.start(8)
    node.start(9)
    node.start(10, resumed=False)  # the last stage's first action comes last
    node.forward(0.0)
    assert node.digests() == []
    node.resume(10)
    node.forward(0.01)
    digest = node.digests()
    assert digest == [NodeStarted(3, 1, _joined(8, 9, 10), _resumed(8, 9, 10))]
    assert isinstance(digest[0], NodeStarted)
    assert digest[0].resumed_records[9] == Timestamp(39.0)
    assert digest[0].joined_records[10] == Joined(30.0, 0.5, "init")
    assert node.data.get(Keys.joined(1, 8).encode()) is None and node.data.get(Keys.resumed(1, 8).encode()) is None


def test_a_start_waits_for_the_longer_hold_and_stops_and_starts_of_a_generation_go_apart() -> None:
    node = _Node(running=(8, 9))
    node.start(8)
    node.start(9, resumed=False)
    node.report(8, generation=1)
    node.report(9, generation=1)
    node.forward(0.0)
    assert node.digests() == [NodeStops(3, 1, (_report(8), _report(9)))]  # every running worker's report is in
    node.forward(HOLD_S)
    assert node.digests() == []  # a start's hold is longer: first actions spread over the pipeline's fill
    assert node.forwarder.next_due() == pytest.approx(START_HOLD_S)
    node.forward(START_HOLD_S)
    assert node.digests() == [NodeStarted(3, 1, _joined(8, 9), _resumed(8))]
    node.resume(9)
    node.forward(START_HOLD_S + 0.01)
    assert node.digests() == [NodeStarted(3, 1, (), _resumed(9))]


def test_a_start_digest_with_a_row_of_another_shape_is_refused_naming_it() -> None:
    good = NodeStarted(3, 1, _joined(8), _resumed(8))
    assert from_json(NodeStarted, to_json(good)) == good
    with pytest.raises(RecordError, match="joined rows"):
        from_json(NodeStarted, to_json(good).replace('"init"', "7"))
    with pytest.raises(RecordError, match="resumed rows"):
        from_json(NodeStarted, to_json(good).replace("[[8, 38.0]]", '[[8, "soon"]]'))
    with pytest.raises(RecordError, match="resumed rows"):
        from_json(NodeStarted, to_json(good).replace("[[8, 38.0]]", "7"))
