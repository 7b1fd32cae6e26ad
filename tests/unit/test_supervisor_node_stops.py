"""The coordinator's side of the stop reports' digests (control.supervisor): a node launcher's NodeStops is read once
when the feed names it, and its reports reach the coordinator's decision with those that workers wrote themselves,
in rank order, only for the generation under way and for live workers that have not reported yet."""

from __future__ import annotations

from typing import Any

from recycle.runtime.control.coordinator import RunState
from recycle.runtime.control.supervisor import Supervisor
from recycle.runtime.protocol.channels import Channels, JobStore, Keys
from recycle.runtime.protocol.records import NodeStops, StoppedReport
from recycle.runtime.protocol.store import LocalStore
from recycle.runtime.protocol.store.data import KeyValue


def _report(rank: int, generation: int = 1) -> StoppedReport:
    return StoppedReport(rank, generation, 4, 5, 0, 0.0, 0, 0.0, f"generation {generation} was aborted", 1.0)


class _Coordinator:
    """Takes the reports the supervisor hands it."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.handed: list[list[StoppedReport]] = []

    def on_stopped_all(self, reports: list[StoppedReport], now: float) -> list[Any]:
        self.handed.append(reports)
        return []


def _loop(live: set[int], generation: int = 1, reported: tuple[int, ...] = ()) -> Any:
    """The parts of a Supervisor these two steps of its loop use, on a real store and feed."""
    data = KeyValue()
    store = LocalStore(data)
    state = RunState(generation, frozenset(live), frozenset(), reports={r: _report(r, generation) for r in reported})
    loop = Supervisor.__new__(Supervisor)  # (its constructor needs a whole run: a plan, workers, options)
    vars(loop).update(store=store, jobs=JobStore(store), feed=Supervisor.subscribe(data),
                      coordinator=_Coordinator(state), stopped_in={}, resumed_in={}, digested={}, arrived={},
                      flagged=set())
    return loop


def _tick(loop: Any) -> None:
    loop._take_feed()
    loop._stopped_reports(0.0)


def test_digests_and_a_workers_own_report_reach_the_decision_once_in_rank_order() -> None:
    loop = _loop(live={1, 2, 3, 4, 5, 6}, reported=(6,))
    loop.jobs.put(Channels.NODE_STOPPED, NodeStops(1, 1, (_report(4), _report(5), _report(6))), 1, 1, 0)
    loop.jobs.put(Channels.STOPPED, _report(3), 1, 3)  # the coordinator's own node: written by the worker itself
    loop.jobs.put(Channels.NODE_STOPPED, NodeStops(0, 1, (_report(1),)), 1, 0, 0)
    _tick(loop)
    # 6 had reported already; 2 has not (it comes in a later digest).
    assert loop.coordinator.handed == [[_report(1), _report(3), _report(4), _report(5)]]
    assert loop.store.try_get(Keys.node_stopped(1, 1, 0)) is None  # read once, deleted
    loop.jobs.put(Channels.NODE_STOPPED, NodeStops(0, 1, (_report(2),)), 1, 0, 1)
    _tick(loop)
    assert loop.coordinator.handed[-1] == [_report(2)]
    _tick(loop)
    assert len(loop.coordinator.handed) == 2  # nothing new: no call


def test_stale_generations_dead_workers_and_unreadable_digests_are_left_out() -> None:
    loop = _loop(live={1, 2}, generation=2)
    loop.jobs.put(Channels.NODE_STOPPED, NodeStops(0, 1, (_report(1, 1),)), 1, 0, 0)  # the generation before
    loop.jobs.put(Channels.NODE_STOPPED, NodeStops(0, 2, (_report(9, 2), _report(1, 1))), 2, 0, 1)  # 9 is not live
    loop.store.set(Keys.node_stopped(2, 1, 0), '{"kind": "node_stops", "node": 1}')  # another version's
    _tick(loop)
    assert [r for reports in loop.coordinator.handed for r in reports] == []  # (an empty look, as for own reports)
    # Every digest named is read once and gone, whether or not it counted.
    assert all(loop.store.try_get(Keys.node_stopped(*key)) is None for key in ((1, 0, 0), (2, 0, 1), (2, 1, 0)))
    loop.jobs.put(Channels.NODE_STOPPED, NodeStops(1, 3, (_report(2, 3),)), 3, 1, 1)  # ahead: kept for its turn
    _tick(loop)
    loop.coordinator.state = RunState(3, frozenset({1, 2}), frozenset())
    loop._stopped_reports(0.0)
    assert loop.coordinator.handed[-1] == [_report(2, 3)]
