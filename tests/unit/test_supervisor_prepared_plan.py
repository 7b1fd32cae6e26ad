"""The coordinator asks a repeatable plan provider (a plan library) for the next generation's plan as soon as it knows
the failed set, at the abort, and makes the plan's views while the survivors' reports come in: the announcement then
only writes them. A provider that is not repeatable is asked at the announcement only, and a failed set that changed
in between is asked again."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from recycle.config import parse_config
from recycle.ir import PlanChoice
from recycle.ir.worker_view import PlanViews
from recycle.planner.options import PlannerOptions
from recycle.planner.provider import PlanLibrary
from recycle.runtime.control.processes import WorkerProcesses
from recycle.runtime.control.supervisor import Supervisor
from recycle.runtime.options import ClusterOptions, LaunchOptions
from recycle.runtime.protocol.channels import Channels, JobStore, Keys
from recycle.runtime.protocol.records import Joined, StoppedReport, Timestamp
from recycle.runtime.protocol.store import LocalStore
from recycle.runtime.protocol.store.data import KeyValue
from recycle.schedules.fault_free import build_schedule

pytestmark = pytest.mark.timeout(60)

D, S, END = 4, 2, 100


class _Asked:
    """A plan provider that counts what it is asked (a plan library underneath)."""

    def __init__(self, library: PlanLibrary, repeatable: bool) -> None:
        self.library, self.repeatable, self.asked = library, repeatable, []

    def __call__(self, failed: frozenset[tuple[int, int]]) -> PlanChoice:
        self.asked.append(failed)
        return self.library.lookup(failed)


def _supervisor(repeatable: bool, replicas: int = D, max_failures: int = 2) -> tuple[Supervisor, _Asked, LocalStore]:
    config = parse_config({"topology": {"num_replicas": replicas, "num_stages": S},
                           "workload": {"num_microbatches": 2},
                           "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1}}, name="prepared")
    plan = build_schedule(config, "gpipe")
    provider = _Asked(PlanLibrary.build(config, PlannerOptions(), max_failures=max_failures), repeatable)
    data = KeyValue()
    store = LocalStore(data)

    def no_spawn(rank: int, joining: bool) -> Any:
        raise AssertionError("no worker runs here")

    options = LaunchOptions(steps=END, progress=None, plan_provider=provider,
                            cluster=ClusterOptions(master_port=29999, nnodes=replicas, token="ab" * 24, backend="gloo",
                                                   coordinator="self"))
    supervisor = Supervisor(config, plan, options, store, WorkerProcesses(JobStore(store), no_spawn), 0, END,
                            time.time(), feed=Supervisor.subscribe(data))
    supervisor.views = PlanViews(plan).prepare()
    return supervisor, provider, store


def _kill(supervisor: Supervisor, rank: int) -> None:
    supervisor._execute(supervisor.coordinator.on_death(rank, f"worker {rank} died", time.time()))


def _reports_in(supervisor: Supervisor) -> None:
    """Every live worker of the generation reports: the coordinator announces the next one."""
    state = supervisor.coordinator.state
    reports = [StoppedReport(r, state.generation, 3, 4, 0, 0.0, 0, 0.0, "aborted", time.time())
               for r in sorted(state.live)]
    supervisor._execute(supervisor.coordinator.on_stopped_all(reports, time.time()))


def _view(store: LocalStore, generation: int, rank: int) -> bytes | None:
    """Worker `rank`'s view as it reads it: the start all views share, then its own part."""
    shared, own = store.try_get(Keys.plan_shared(generation)), store.try_get(Keys.plan_view(generation, rank))
    return None if shared is None or own is None else shared + own


def test_the_plan_is_asked_for_at_the_abort_and_the_announcement_writes_its_views_as_made_afresh() -> None:
    supervisor, provider, store = _supervisor(repeatable=True)
    _kill(supervisor, 5)
    assert store.try_get(Keys.abort(0)) is not None and provider.asked == []
    supervisor._prepare_next()  # (the loop does this on each tick of a recovery)
    supervisor._prepare_next()
    assert provider.asked == [frozenset({(2, 1)})]  # once, while the reports are still to come
    _reports_in(supervisor)
    assert provider.asked == [frozenset({(2, 1)})]  # the announcement took the prepared plan
    assert store.try_get(Keys.announce(1)) is not None and supervisor.prepared is None
    plan = provider.library.lookup(frozenset({(2, 1)})).plan
    fresh = PlanViews(plan)
    for rank in plan.live_ranks():
        assert _view(store, 1, rank) == fresh.encoded(rank)
    assert supervisor.plan == plan


def test_a_failed_set_that_changed_after_the_plan_was_asked_for_is_asked_again() -> None:
    supervisor, provider, store = _supervisor(repeatable=True)
    _kill(supervisor, 5)
    supervisor._prepare_next()
    _kill(supervisor, 2)  # another worker dies while the reports come in
    _reports_in(supervisor)
    assert provider.asked == [frozenset({(2, 1)}), frozenset({(2, 1), (1, 0)})]
    plan = provider.library.lookup(frozenset({(2, 1), (1, 0)})).plan
    assert supervisor.plan == plan
    assert _view(store, 1, 7) == PlanViews(plan).encoded(7)


def test_a_provider_that_is_not_repeatable_is_asked_at_the_announcement_only() -> None:
    supervisor, provider, store = _supervisor(repeatable=False)
    _kill(supervisor, 5)
    supervisor._prepare_next()
    assert provider.asked == []
    _reports_in(supervisor)
    assert provider.asked == [frozenset({(2, 1)})] and store.try_get(Keys.announce(1)) is not None


def test_a_generations_views_hold_the_routing_once_not_once_per_worker() -> None:
    """The routing's exceptions grow with the micro-batches the failures moved; every view starts with them. Stored
    once (Keys.plan_shared) and not in each worker's key: a copy per view made a generation's views workers x moved
    (16,384 views after a rack's loss: the coordinator's process past 20 GB, OOM-killed)."""
    supervisor, provider, store = _supervisor(repeatable=True, replicas=16, max_failures=1)
    for replica in range(1, 9):  # eight pipelines lose their first stage: a state beyond the library's (online)
        _kill(supervisor, replica * S)
    supervisor._prepare_next()
    _reports_in(supervisor)
    plan = supervisor.plan
    assert len(plan.failed) == 8 and store.try_get(Keys.announce(1)) is not None
    fresh = PlanViews(plan)
    moved = sum(replica != plan.owner(mb) for row in plan.host for mb, replica in enumerate(row))
    assert moved >= 8 * 2  # (each lost worker's micro-batches at least)
    live = plan.live_ranks()
    common = os.path.commonprefix([fresh.encoded(rank) for rank in live])  # what every view starts with
    assert b"host_moved" in common
    with store.data.lock:
        stored = sum(len(value) for key, value in store.data._data.items() if key.startswith(b"gen1/plan"))
    assert stored < len(live) * len(common)  # the generation's views hold it once, not once per worker
    shared = store.try_get(Keys.plan_shared(1))
    assert shared == fresh.shared and b"host_moved" in shared
    own = {rank: store.try_get(Keys.plan_view(1, rank)) for rank in plan.live_ranks()}
    for rank, part in own.items():
        assert part is not None and b"host_moved" not in part
        assert shared + part == fresh.encoded(rank)  # the worker reads the same view


def test_the_store_holds_no_more_keys_after_each_of_many_recoveries() -> None:
    """Each recovery's records of every worker (joined, resumed) are read once and leave the store, and the views of
    two generations back are deleted: over many recoveries the store stays the same size (before, two keys per worker
    and recovery stayed for the whole run: 32,768 a recovery at 16,384 workers)."""
    supervisor, _, store = _supervisor(repeatable=True, replicas=8, max_failures=1)
    sizes = []
    for replica in range(1, 6):  # a failure in another pipeline each time (beyond the library's 1: online)
        _kill(supervisor, replica * S + replica % S)
        supervisor._prepare_next()
        _reports_in(supervisor)
        generation = supervisor.coordinator.state.generation
        for rank in sorted(supervisor.coordinator.state.live):  # every worker of the new generation is in
            supervisor.jobs.put(Channels.JOINED, Joined(time.time(), 0.01, "init"), generation, rank)
            supervisor.jobs.put(Channels.RESUMED, Timestamp(time.time()), generation, rank)
        supervisor._take_feed()
        supervisor._complete_recovery()
        assert supervisor.pending is None and len(supervisor.reporter.recoveries) == replica
        sizes.append(store.data.num_keys())
    assert sizes[2:] == [sizes[2]] * 3, sizes  # (two generations' views kept: steady from the third on)
