"""The coordinator asks a repeatable plan provider (a plan library) for the next generation's plan as soon as it knows
the failed set, at the abort, and makes the plan's views while the survivors' reports come in: the announcement then
only writes them. A provider that is not repeatable is asked at the announcement only, and a failed set that changed
in between is asked again."""

from __future__ import annotations

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
from recycle.runtime.protocol.channels import JobStore, Keys
from recycle.runtime.protocol.records import StoppedReport
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


def _supervisor(repeatable: bool) -> tuple[Supervisor, _Asked, LocalStore]:
    config = parse_config({"topology": {"num_replicas": D, "num_stages": S}, "workload": {"num_microbatches": 2},
                           "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1}}, name="prepared")
    plan = build_schedule(config, "gpipe")
    provider = _Asked(PlanLibrary.build(config, PlannerOptions(), max_failures=2), repeatable)
    data = KeyValue()
    store = LocalStore(data)

    def no_spawn(rank: int, joining: bool) -> Any:
        raise AssertionError("no worker runs here")

    options = LaunchOptions(steps=END, progress=None, plan_provider=provider,
                            cluster=ClusterOptions(master_port=29999, nnodes=D, token="ab" * 24, backend="gloo",
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
        assert store.try_get(Keys.plan_view(1, rank)) == fresh.encoded(rank)
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
    assert store.try_get(Keys.plan_view(1, 7)) == PlanViews(plan).encoded(7)


def test_a_provider_that_is_not_repeatable_is_asked_at_the_announcement_only() -> None:
    supervisor, provider, store = _supervisor(repeatable=False)
    _kill(supervisor, 5)
    supervisor._prepare_next()
    assert provider.asked == []
    _reports_in(supervisor)
    assert provider.asked == [frozenset({(2, 1)})] and store.try_get(Keys.announce(1)) is not None
