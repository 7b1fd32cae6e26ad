"""A worker's view of a plan (ir.worker_view): it holds everything that worker's executor reads (its actions, and the
send order of every worker that sends to it), it round-trips through JSON, it stays a few KB at scale, and malformed
views are refused with a clear error."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from recycle.config import parse_config
from recycle.errors import PlanError
from recycle.ir import worker_view as worker_view_module
from recycle.ir.dependencies import input_stage
from recycle.ir.plan import Plan
from recycle.ir.worker_view import PlanViews, _senders, read_worker_view, worker_view
from recycle.planner.api import make_plan
from recycle.runtime.protocol.messages import incoming, send_order
from recycle.schedules.fault_free import build_schedule


def _config(D: int, S: int, M: int, chunks: int = 1):
    return parse_config({"topology": {"num_replicas": D, "num_stages": S, "chunks_per_worker": chunks,
                                      **({"chunk_layout": "v"} if chunks == 2 else {})},
                         "workload": {"num_microbatches": M},
                         "costs": {"forward": 1.0, "backward_input": 1.2, "backward_weight": 0.7}})


def _plans() -> list[Plan]:
    config = _config(3, 3, 4)
    return [build_schedule(config, "1f1b", staggered=True),
            make_plan(config, [(0, 1)]),  # re-routed: stage 1's micro-batches of replica 0 move
            make_plan(config, [(0, 1), (2, 2)])]


@pytest.mark.parametrize("index", range(3))
def test_a_view_holds_what_its_worker_runs_and_receives(index: int) -> None:
    plan = _plans()[index]
    views = PlanViews(plan)
    for rank in plan.live_ranks():
        view = read_worker_view(views.json_for(rank), rank)
        assert view == worker_view(plan, rank)
        assert view.actions[rank] == plan.actions[rank] and view.host == plan.host and view.failed == plan.failed
        for action in plan.actions[rank]:
            message = incoming(plan, rank, action)
            assert incoming(view, rank, action) == message
            if message is not None:
                assert send_order(view, message.src, rank) == send_order(plan, message.src, rank)
        others = [r for r in range(plan.num_workers) if view.actions[r] and r != rank]
        assert len(others) < plan.num_workers - 1 or plan.num_workers <= 2  # it is a part, not the whole


def test_views_made_from_the_last_generations_are_the_views_made_afresh() -> None:
    """A recovery's views reuse the last generation's action tokens where a worker's list is unchanged: the JSON of
    every view is byte for byte the one made without them, chunked plans included."""
    plans = _plans() + [make_plan(_config(2, 2, 4, chunks=2), []), make_plan(_config(2, 2, 4, chunks=2), [(1, 0)])]
    for before, after in zip(plans, plans[1:]):
        previous = PlanViews(before).prepare()
        reused, fresh = PlanViews(after, previous), PlanViews(after)
        for rank in after.live_ranks():
            assert reused.json_for(rank) == fresh.json_for(rank)
            assert json.loads(fresh.json_for(rank))["view_actions"][str(rank)] == \
                " ".join(str(a) for a in after.actions[rank])  # the tokens as Action's str writes them


def _moved(plan: Plan, moves: list[tuple[int, int, int]]) -> Plan:
    """`plan` with each (row, mb, replica) of `moves`: micro-batch mb's actions at that stage (chunk) handed from its
    host to `replica` (appended to its list), as a provider that re-routes a few micro-batches changes a few lists
    (not a plan that runs: the views only copy what it says)."""
    host = [list(row) for row in plan.host]
    actions = [list(acts) for acts in plan.actions]
    for stage, mb, replica in moves:
        old, new = plan.chunk_rank(host[stage][mb], stage), plan.chunk_rank(replica, stage)
        if old != new:
            actions[new] += [a for a in actions[old] if (a.stage, a.mb) == (stage, mb)]
            actions[old] = [a for a in actions[old] if (a.stage, a.mb) != (stage, mb)]
            host[stage][mb] = replica
    return replace(plan, host=tuple(map(tuple, host)), actions=tuple(map(tuple, actions)))


@pytest.mark.parametrize("seed", range(4))
def test_views_carried_from_generation_to_generation_are_the_views_made_afresh(seed: int) -> None:
    """A random walk of failures, joins and re-routed micro-batches (planned plans of any shape in between, chunked
    and zero-bubble ones included): each generation's views, made from the last generation's only where they
    changed, are byte for byte the views made afresh, generation after generation."""
    rng = random.Random(seed)
    config = [_config(4, 3, 4), _config(2, 2, 4, chunks=2), _config(3, 4, 6)][seed % 3]
    base = make_plan(config, []) if seed != 3 else build_schedule(config, "zb-h1")
    workers = [(p, s) for p in range(base.num_replicas) for s in range(base.num_stages)]
    plan, views = base, PlanViews(base).prepare()
    for _ in range(12):
        step = rng.random()
        if step < 0.3:  # a planned plan for a random failure set
            failed = rng.sample(workers, rng.randint(0, 1)) + ([] if rng.random() < 0.5 else [(0, 0)])
            plan = make_plan(config, sorted(set(failed))) if seed != 3 else base
        elif step < 0.8:  # a few micro-batches move (to any replica, a dead one's list included)
            plan = _moved(plan, [(rng.randrange(len(plan.host)), rng.randrange(len(plan.host[0])),
                                  rng.randrange(plan.num_replicas)) for _ in range(rng.randint(1, 3))])
        else:
            plan = base  # everyone back
        views = PlanViews(plan, views)
        fresh = PlanViews(plan)
        for rank in range(plan.num_workers):
            assert views.encoded(rank) == fresh.encoded(rank) == fresh.json_for(rank).encode()
        live = plan.live_ranks()
        assert views.encoded_views(live) == [fresh.encoded(rank) for rank in live]
        if rng.random() < 0.3:
            views.prepare()  # (a prepared generation carries as well as an unprepared one's: both are walked)


def test_a_recovery_encodes_again_only_the_views_that_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """One micro-batch re-routed at a stage of a 32 x 4 plan: the lists of its old and new host change, and with
    them the views of the workers they send to and of those whose sender moved, a few of 128."""
    plan = build_schedule(_config(32, 4, 4), "1f1b", staggered=True)
    previous = PlanViews(plan).prepare()
    encoded: list[int] = []
    real = worker_view_module.view_tail
    monkeypatch.setattr(worker_view_module, "view_tail", lambda rank, *a: encoded.append(rank) or real(rank, *a))
    after = _moved(plan, [(2, 5, 7)])  # micro-batch 5 (replica 1's) runs on replica 7 at stage 2
    views = PlanViews(after, previous)
    for rank in after.live_ranks():
        assert views.encoded(rank) == PlanViews(after).encoded(rank)
        encoded.remove(rank)  # (the fresh views' own encodings)
    assert sorted(encoded) == sorted({after.rank(r, s) for r in (1, 7) for s in (1, 2, 3)})


def test_a_views_senders_follow_the_dependency_rule() -> None:
    """_senders (tables inlined for speed at 16,384 workers) names exactly the workers that input_stage and
    chunk_rank say each action waits for: plain, re-routed, zero-bubble and chunked (V layout) plans."""
    plans = _plans() + [make_plan(_config(2, 2, 4, chunks=2), []), make_plan(_config(2, 2, 4, chunks=2), [(1, 0)]),
                        make_plan(_config(3, 4, 6), [(1, 3)]), build_schedule(_config(2, 3, 4), "zb-h1")]
    assert any(plan.chunks == 2 for plan in plans) and any(plan.failed for plan in plans)
    for plan in plans:
        for rank in plan.live_ranks():
            expected = {rank} | {plan.chunk_rank(plan.host[src][a.mb], src) for a in plan.actions[rank]
                                 if (src := input_stage(a.kind, a.stage, plan.num_chunks)) is not None}
            assert _senders(plan, rank) == expected


def test_a_chunked_plans_view_round_trips() -> None:
    plan = make_plan(_config(2, 2, 4, chunks=2), [(1, 0)])
    views = PlanViews(plan)
    for rank in plan.live_ranks():
        assert read_worker_view(views.json_for(rank), rank) == worker_view(plan, rank)


def test_views_stay_small_where_the_plan_is_large() -> None:
    plan = build_schedule(_config(256, 4, 8), "1f1b", staggered=True)
    views = PlanViews(plan)
    whole = len(plan.to_json())
    assert max(len(views.json_for(r)) for r in (0, 517, 1023)) * 50 < whole


def _view(**changes) -> tuple[str, int]:
    plan = _plans()[1]
    raw = json.loads(PlanViews(plan).json_for(4))
    raw.update(changes)
    return json.dumps(raw), 4


@pytest.mark.parametrize("changes, match", [
    ({"view_of": 5}, r"worker 4's view of the plan is malformed .*not worker 4's view"),
    ({"host_moved": [[0, 99, 1]]}, r"routing entry \[0, 99, 1\] is outside the plan's shape"),
    ({"host_moved": [[0, 1, True]]}, r"outside the plan's shape"),
    ({"view_actions": {"-1": "0F0"}}, r"worker '-1' is outside the plan's 9 workers"),
    ({"view_actions": {"4": "0X0"}}, r"action token '0X0' is malformed"),
    ({"num_stages": 2.5}, r"not whole numbers"),
    ({"num_replicas": 1 << 20, "num_microbatches": 1 << 20}, r"too large"),
])
def test_a_malformed_view_is_refused_clearly(changes: dict, match: str) -> None:
    text, rank = _view(**changes)
    with pytest.raises(PlanError, match=match):
        read_worker_view(text, rank)
    with pytest.raises(PlanError, match="malformed"):
        read_worker_view("[1, 2]", 4)
