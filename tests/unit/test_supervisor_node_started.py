"""The coordinator's side of the start records' digests (control.supervisor): a node launcher's NodeStarted is read
once when the feed names it; its Resumed records count toward the recovery's completion beside those that workers
wrote themselves, and its records stand in for the per-worker keys in the recovery's report. Digests of a
generation whose recovery is not being reported are read and dropped."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from recycle.runtime.control.coordinator import RunState
from recycle.runtime.control.supervisor import Supervisor
from recycle.runtime.protocol.channels import Channels, JobStore, Keys
from recycle.runtime.protocol.records import Joined, NodeStarted, Timestamp
from recycle.runtime.protocol.store import LocalStore
from recycle.runtime.protocol.store.data import KeyValue


def _loop(pending_generation: int | None) -> Any:
    """The parts of a Supervisor that reading the feed uses, on a real store and feed."""
    data = KeyValue()
    store = LocalStore(data)
    loop = Supervisor.__new__(Supervisor)  # (its constructor needs a whole run: a plan, workers, options)
    pending = None if pending_generation is None else SimpleNamespace(facts=SimpleNamespace(generation=2))
    vars(loop).update(store=store, jobs=JobStore(store), feed=Supervisor.subscribe(data),
                      coordinator=SimpleNamespace(state=RunState(2, frozenset({1, 2, 3, 4}), frozenset())),
                      stopped_in={}, resumed_in={}, digested={}, started={}, arrived={}, flagged=set(),
                      pending=pending)
    return loop


def test_a_digests_records_complete_the_recovery_beside_a_workers_own_and_leave_no_key() -> None:
    loop = _loop(pending_generation=2)
    loop.jobs.put(Channels.NODE_STARTED, NodeStarted(0, 2, ((1, 5.0, 0.5, "init"), (2, 5.5, 0.25, "init")),
                                                     ((1, 6.0),)), 2, 0, 0)
    loop.jobs.put(Channels.RESUMED, Timestamp(6.5), 2, 3)  # the coordinator's own node: written by the worker itself
    loop.jobs.put(Channels.JOINED, Joined(5.25, 0.5, "init"), 2, 3)
    loop._take_feed()
    assert loop.resumed_in[2] == {1, 3}
    assert loop.store.try_get(Keys.node_started(2, 0, 0)) is None  # read once, deleted
    loop.jobs.put(Channels.NODE_STARTED, NodeStarted(0, 2, (), ((2, 7.0),)), 2, 0, 1)  # the rest, later
    loop._take_feed()
    assert loop.resumed_in[2] == {1, 2, 3}
    started = loop.started[2]
    assert [t.time for t in loop._records(Channels.RESUMED, 2, [1, 2, 3, 4], started.resumed)] == [6.0, 7.0, 6.5]
    assert loop._records(Channels.JOINED, 2, [1, 2, 3], started.joined) == \
        [Joined(5.0, 0.5, "init"), Joined(5.5, 0.25, "init"), Joined(5.25, 0.5, "init")]
    loop._forget_generation_records(2, [1, 2, 3], started)
    assert loop.store.try_get(Keys.resumed(2, 3)) is None and loop.store.try_get(Keys.joined(2, 3)) is None


def test_digests_of_a_generation_not_being_reported_and_unreadable_ones_are_dropped() -> None:
    loop = _loop(pending_generation=None)  # the run's first generation: no recovery to report
    loop.jobs.put(Channels.NODE_STARTED, NodeStarted(0, 0, ((1, 5.0, 0.5, "init"),), ((1, 6.0),)), 0, 0, 0)
    loop._take_feed()
    assert loop.started == {} and loop.resumed_in == {}
    assert loop.store.try_get(Keys.node_started(0, 0, 0)) is None
    loop = _loop(pending_generation=2)
    loop.store.set(Keys.node_started(2, 1, 0), '{"kind": "node_started", "node": 1, "generation": 2, "resumed": 7}')
    loop._take_feed()
    assert loop.started == {} and loop.resumed_in == {}
    assert loop.store.try_get(Keys.node_started(2, 1, 0)) is None
