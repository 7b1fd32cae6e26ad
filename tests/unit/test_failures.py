"""Failure normalization: keys, counts, relabelling invariance and the mapping of canonical plans onto real ranks."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from recycle.config import load_config, uniform_config
from recycle.errors import FailureStateError
from recycle.ir.validate import validate_plan
from recycle.planner.api import make_plan, plan_for_failed, plan_for_key
from recycle.planner.failures import count_failure_sets, enumerate_keys, normalize, parse_worker
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import failed_routing, traffic
from recycle.sim.simulator import simulate

TOY = Path(__file__).resolve().parents[2] / "configs" / "toy.toml"


def test_testbed_has_35_keys_for_2325_failure_sets() -> None:
    D, S, F = 6, 4, 3
    keys = list(enumerate_keys(D, S, F))
    assert len(keys) == 35 == len(set(keys))
    assert count_failure_sets(D, S, F) == 2325
    # Brute force: every set of at most 3 of the 24 workers normalizes to one of the 35 keys, each set once.
    workers = [(p, s) for p in range(D) for s in range(S)]
    seen = {}
    total = 0
    for size in range(F + 1):
        for failed in itertools.combinations(workers, size):
            key = normalize(failed, D, S).key
            seen[key] = seen.get(key, 0) + 1
            total += 1
    assert total == 2325
    assert set(seen) == set(keys)


def test_relabelled_failure_sets_share_a_key_and_a_period() -> None:
    config = uniform_config(4, 3, 5, optimizer=1.0)
    options = PlannerOptions()
    rng = random.Random(7)
    for failed in ([(1, 1)], [(0, 0), (3, 2)], [(2, 1), (3, 1)], [(0, 0), (1, 1), (2, 2)]):
        base = normalize(failed, 4, 3)
        periods = set()
        for _ in range(4):
            perms = [rng.sample(range(4), 4) for _ in range(3)]  # an independent relabelling per stage
            moved = [(perms[s][p], s) for p, s in failed]
            state = normalize(moved, 4, 3)
            assert state.key == base.key
            plan = make_plan(config, moved, options)
            assert plan.failed == frozenset(moved)
            periods.add(simulate(plan, config).period)
        assert len(periods) == 1, f"relabellings of {failed} gave periods {periods}"


def test_real_plan_runs_only_on_live_workers() -> None:
    config = load_config(TOY)
    failed = [(2, 0), (1, 2)]
    plan = validate_plan(make_plan(config, failed))
    for p, s in failed:
        assert plan.worker_actions(p, s) == ()
        assert p not in plan.host[s]
    canonical = plan_for_key(config, normalize(failed, 3, 4).key)
    assert simulate(plan, config).period == canonical.meta.predicted_period


def test_a_stage_without_survivors_needs_a_checkpoint() -> None:
    with pytest.raises(FailureStateError, match="checkpoint"):
        normalize([(0, 2), (1, 2), (2, 2)], 3, 4)
    with pytest.raises(FailureStateError, match="checkpoint"):
        make_plan(load_config(TOY), [(0, 2), (1, 2), (2, 2)])


@pytest.mark.parametrize("text", ["7:0", "0:4", "x", "1-2", ""])
def test_bad_worker_text_is_rejected(text: str) -> None:
    with pytest.raises(FailureStateError):
        parse_worker(text, 3, 4)


def test_parse_worker_reads_replica_then_stage() -> None:
    assert parse_worker(" 1:2 ", 3, 4) == (1, 2)


@pytest.mark.parametrize("failed, symmetric", [
    ([(1, 2)], True),  # the paper's toy failure
    ([(2, 0), (2, 3)], True),  # two stages of one pipeline
    ([(0, 1), (2, 1)], True),  # two replicas of one stage
    ([(0, 1), (1, 2)], False),  # different pipelines at different stages: no single relabelling exists
    ([(0, 0), (1, 1), (2, 2)], False),
    ([(0, 1), (1, 2), (2, 3), (0, 3)], False),
])
def test_only_failed_workers_microbatches_leave_their_pipeline(failed, symmetric) -> None:
    toy = load_config(TOY)
    M = toy.num_microbatches
    state = normalize(failed, toy.num_replicas, toy.num_stages)
    assert state.symmetric is symmetric
    plan = validate_plan(make_plan(toy, failed))
    canonical = plan_for_key(toy, state.key)
    assert simulate(plan, toy).period <= simulate(canonical, toy).period * 1.02

    def moved(p) -> set[tuple[int, int]]:
        return {(s, mb) for s in range(toy.num_stages) for mb in range(p.total_microbatches) if p.host[s][mb] != mb // M}

    # A re-route is needed exactly where the owner's worker at that stage is down, and nothing else moves.
    needed = {(s, mb) for s in range(toy.num_stages) for mb in range(plan.total_microbatches)
              if (mb // M, s) in plan.failed}
    assert moved(plan) == needed
    counts = traffic(plan.host, M, plan.failed)
    assert counts["moved_microbatches"] == len(needed) and counts["moved_healthy"] == 0
    relabelled = validate_plan(make_plan(toy, failed, routing="canonical"))
    if symmetric:
        assert moved(relabelled) == needed
    else:  # the per-stage relabelling of the canonical plan also moves some healthy micro-batches
        assert len(moved(relabelled)) > len(needed)
        assert traffic(relabelled.host, M, relabelled.failed)["moved_healthy"] > 0


def test_traffic_counts_cross_pipeline_messages() -> None:
    toy = load_config(TOY)
    M = toy.num_microbatches
    # Pipeline 0 lost stage 1: its 6 micro-batches cross pipelines into and out of stage 1 (F and B each way).
    host = failed_routing(toy, frozenset({(0, 1)}))
    assert traffic(host, M, frozenset({(0, 1)})) == {"moved_microbatches": 6, "moved_healthy": 0,
                                                     "cross_pipeline_messages": 6 * 2 * 2}
    # Losing the last stage: one boundary each way.
    host = failed_routing(toy, frozenset({(0, 3)}))
    assert traffic(host, M, frozenset({(0, 3)}))["cross_pipeline_messages"] == 6 * 2


@pytest.mark.timeout(60)
def test_random_failure_sets_move_only_the_failed_workers_microbatches() -> None:
    config = uniform_config(4, 3, 3, optimizer=1.0)
    rng = random.Random(5)
    workers = [(p, s) for p in range(4) for s in range(3)]
    checked = 0
    while checked < 12:
        failed = rng.sample(workers, rng.randint(1, 4))
        if any(sum(1 for _, st in failed if st == s) == 4 for s in range(3)):
            continue  # a stage without survivors needs a checkpoint, not a plan
        options = PlannerOptions(search=False)
        plan = validate_plan(make_plan(config, failed, options))
        counts = traffic(plan.host, 3, plan.failed)
        if plan.meta.routing_fallback:  # the canonical relabelling was faster, so make_plan returned it and said so
            kept = plan_for_failed(config, frozenset(failed), options)
            assert plan.meta.predicted_period < kept.meta.predicted_period, failed
            counts = traffic(kept.host, 3, kept.failed)
        assert counts["moved_healthy"] == 0, failed
        assert counts["moved_microbatches"] == 3 * len(failed), failed
        checked += 1
