"""Failure patterns: the plan library serves failures in different pipelines at different stages with a plan that
moves only the failed workers' micro-batches off their pipeline (one relabelling of pipelines), as fast as the
key's plan relabelled per stage."""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

import pytest

from recycle.config import parse_config
from recycle.ir.actions import Action
from recycle.ir.compact import KIND_CODES, CompactActions
from recycle.ir.validate import validate_plan
from recycle.planner.api import plan_for_key
from recycle.planner.failures import normalize
from recycle.planner.options import PlannerOptions
from recycle.planner.patterns import enumerate_patterns, pattern_of, rename_replicas, row_classes
from recycle.planner.provider import PlanLibrary
from recycle.planner.routing import traffic
from recycle.sim.simulator import simulate

pytestmark = pytest.mark.timeout(120)


def _config(D: int, S: int, M: int):
    return parse_config({"topology": {"num_replicas": D, "num_stages": S}, "workload": {"num_microbatches": M},
                         "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1}}, name=f"pat-{D}x{S}")


def test_patterns_hand_counted() -> None:
    # D=3, S=2, up to 2 failures: {0}, {1}, {0,1}, {0}{0}, {0}{1}, {1}{1}; only {0}{1} is not nested.
    patterns = list(enumerate_patterns(3, 2, 2))
    assert sorted(p.lost for p in patterns) == sorted([
        ((0,), (), ()), ((1,), (), ()), ((0, 1), (), ()), ((0,), (0,), ()), ((0,), (1,), ()), ((1,), (1,), ())])
    nested = [p.lost for p in patterns if normalize(p.canonical_failed(), 3, 2).symmetric]
    assert len(nested) == 5 and ((0,), (1,), ()) not in nested
    # A stage may not lose every replica: D=2, S=1 has {0} only ({0}{0} would empty the stage).
    assert [p.lost for p in enumerate_patterns(2, 1, 2)] == [((0,), ())]


def test_pattern_of_orders_replicas_by_their_losses() -> None:
    pattern = pattern_of({(2, 0), (2, 3), (0, 1)}, 4, 4)
    assert pattern.lost == ((0, 3), (1,), (), ()) and pattern.perm == (2, 0, 1, 3)
    assert {(pattern.perm[c], s) for c, s in pattern.canonical_failed()} == {(2, 0), (2, 3), (0, 1)}


def test_every_failure_set_moves_only_failed_workers_microbatches() -> None:
    D, S, M = 3, 3, 3
    config = _config(D, S, M)
    library = PlanLibrary.build(config, PlannerOptions(), max_failures=2)
    assert library.patterns  # e.g. 0:0 and 1:1: no single relabelling of pipelines covers it
    workers = [(p, s) for p in range(D) for s in range(S)]
    for size in (1, 2):
        for failed in map(frozenset, combinations(workers, size)):
            found = library.lookup(failed)
            plan = found.plan
            assert plan.failed == failed and found.source == "store"
            validate_plan(plan)
            moved = traffic(plan.host, M, failed)
            assert moved["moved_healthy"] == 0, (sorted(failed), moved)
            assert moved["moved_microbatches"] == len(failed) * M
            keyed = library.store.plan_for_key(normalize(failed, D, S).key)
            assert simulate(plan, config).period <= keyed.meta.predicted_period * (1 + 1e-9)


def test_renaming_a_compact_plan_equals_renaming_its_actions() -> None:
    """A large plan keeps its actions as flat arrays (ir.compact): renaming pipelines works on the arrays and
    gives exactly the Action lists the object path gives."""
    config = _config(4, 3, 4)
    state = normalize({(2, 1), (2, 2)}, 4, 3)
    plan = plan_for_key(config, state.key)
    rows = [tuple(row) for row in plan.actions]
    bounds = [0]
    for row in rows:
        bounds.append(bounds[-1] + len(row))
    flat = [a for row in rows for a in row]
    compact = CompactActions(bounds, [KIND_CODES.index(a.kind) for a in flat], [a.stage for a in flat],
                             [a.mb for a in flat])
    fast = rename_replicas(replace(plan, actions=compact), state.perm[0], state.failed)
    slow = rename_replicas(replace(plan, actions=tuple(rows)), state.perm[0], state.failed)
    assert isinstance(fast.actions, CompactActions) and state.perm[0] != (0, 1, 2, 3)
    assert tuple(fast.actions) == tuple(slow.actions) and fast.host == slow.host
    validate_plan(fast)


def _renamed_action_by_action(plan, perm, failed):
    """rename_replicas as it was: every action renamed, every routing entry moved one at a time (the reference)."""
    D, S, M = plan.num_replicas, plan.num_stages, plan.num_microbatches
    rename = [perm[mb // M] * M + mb % M for mb in range(D * M)] + list(range(D * M, plan.num_microbatch_ids))
    actions = [()] * (D * S)
    for c in range(D):
        for s in range(S):
            actions[perm[c] * S + s] = tuple(a if a.mb < 0 else Action(a.kind, a.stage, rename[a.mb])
                                             for a in plan.actions[c * S + s])
    host = []
    for row in plan.host:
        real = [0] * len(rename)
        for mb, c in enumerate(row):
            real[rename[mb]] = perm[c]
        host.append(tuple(real))
    pieces = list(plan.pieces)
    for mb, piece in enumerate(plan.pieces):
        pieces[rename[mb]] = replace(piece, source=rename[piece.source])
    return replace(plan, host=tuple(host), actions=tuple(actions), failed=failed, pieces=tuple(pieces))


@pytest.mark.parametrize("options", [PlannerOptions(), PlannerOptions(split_microbatches=True)],
                         ids=["whole", "split"])
def test_renaming_takes_the_stored_list_of_the_rank_a_list_lands_on_and_equals_renaming_each_action(options) -> None:
    """A list holding only its own pipeline's micro-batches lands on a rank whose stored list is the same up to the
    renaming: that list is taken as it is (no Action built); lists with another pipeline's micro-batches are renamed
    action by action. The plan is the one renaming every action gives, for every pattern and relabelling."""
    D, S, M = 4, 3, 4
    config = _config(D, S, M)
    library = PlanLibrary.build(config, options, max_failures=2)
    seen_taken = seen_renamed = 0
    workers = [(p, s) for p in range(D) for s in range(S)]
    for size in (1, 2):
        for failed in map(frozenset, combinations(workers, size)):
            state = normalize(failed, D, S)
            if state.symmetric:
                stored, perm = library.store.plan_for_key(state.key), state.perm[0]
            else:
                pattern = pattern_of(failed, D, S)
                stored, perm = library.patterns.get(pattern.lost), pattern.perm
                if stored is None:
                    continue
            plan = rename_replicas(stored, perm, failed)
            assert plan == _renamed_action_by_action(stored, perm, failed)
            validate_plan(plan)
            classes = row_classes(stored)
            for c in range(D):
                for s in range(S):
                    target = perm[c] * S + s
                    if classes[c * S + s] >= 0 and classes[c * S + s] == classes[target]:
                        assert plan.actions[target] is stored.actions[target]
                        seen_taken += 1
                    elif stored.actions[c * S + s]:
                        seen_renamed += 1
    assert seen_taken > 0 and seen_renamed > 0  # both ways were taken


def test_the_librarys_lists_share_their_actions_so_plans_compare_as_objects() -> None:
    """PlanLibrary holds its plans with shared Actions: two lookups' lists hold the same Action objects wherever
    they run the same work (the coordinator compares each generation's lists with the last one's)."""
    D, S = 4, 3
    library = PlanLibrary.build(_config(D, S, 4), PlannerOptions(), max_failures=2)
    one, two = library.lookup(frozenset({(1, 0)})).plan, library.lookup(frozenset({(1, 0), (2, 1)})).plan
    same = [r for r in range(D * S) if one.actions[r] == two.actions[r] and one.actions[r]]
    assert same and all(a is b for r in same for a, b in zip(one.actions[r], two.actions[r]))
