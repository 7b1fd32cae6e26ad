"""Misses of issue 26's quality screen (F != B != W, nested and not) closed by the wait-for-backward rules (plain and
strict) and by order searches from several routings; the misses left, guarded against getting worse."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from recycle.config import Config, parse_config
from recycle.ir.validate import validate_plan
from recycle.planner import heuristic, local_search
from recycle.planner.api import clear_cache, make_plan
from recycle.planner.failures import normalize
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import balanced_routing
from recycle.sim.simulator import simulate


def _config(D: int, S: int, M: int, forward: int, backward_input: int, backward_weight: int,
            optimizer: int, p2p: float = 0.0) -> Config:
    return parse_config({"topology": {"num_replicas": D, "num_stages": S}, "workload": {"num_microbatches": M},
                         "costs": {"forward": forward, "backward_input": backward_input,
                                   "backward_weight": backward_weight, "optimizer": optimizer},
                         "communication": {"p2p_latency": p2p}}, name="screen")


# `bench_planner_quality.py --draw distinct --planner make_plan` (seed 0) cases, with CP-SAT's proved optimum
# (4 s, 2 workers) and make_plan's period before the wait-for-backward rules.
SCREEN_MISSES = [
    # case 111: nested (one pipeline, two stages), decoupled, staggered: 36 before, the optimum 35
    (dict(D=4, S=3, M=3, forward=4, backward_input=1, backward_weight=2, optimizer=3), [(2, 1), (2, 2)],
     PlannerOptions(), 35.0, 36.0),
    # case 237: not nested (three failures in two stages, three pipelines), decoupled, coupled: 57 before (+3.6 %)
    (dict(D=6, S=4, M=4, forward=3, backward_input=2, backward_weight=4, optimizer=1), [(0, 0), (1, 0), (3, 1)],
     PlannerOptions(staggered=False), 55.0, 57.0),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape, failed, options, optimum, before", SCREEN_MISSES)
def test_screen_misses_are_within_two_percent_of_the_proved_optimum(
        shape: dict, failed: list, options: PlannerOptions, optimum: float, before: float,
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(**shape)
    clear_cache()
    plan = validate_plan(make_plan(config, failed, options))
    period = plan.meta.predicted_period
    assert period == simulate(plan, config).period
    assert optimum <= period <= optimum * 1.02, f"period {period:g}, CP-SAT's proved optimum {optimum:g}"
    assert period < before
    # Without the waiting rules the miss comes back: the test is about them, not about a lucky search. (The deadline
    # list schedules reach case 237's 56 without them too, so they are off here as well.)
    monkeypatch.setattr(heuristic, "WAITING_VARIANTS", ())
    monkeypatch.setattr(heuristic, "DEADLINE_START", heuristic.ORDER_STARTS)
    clear_cache()
    assert make_plan(config, failed, options).meta.predicted_period == before
    clear_cache()


@pytest.mark.timeout(120)
def test_strict_waiting_rules_close_a_non_nested_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    # Case 15 of the same screen: not nested (three pipelines, three stages), decoupled, staggered; CP-SAT proves
    # 31 (4 s). The plain waiting rule starts stage 1's F at the very instant stage 2 starts the B it should wait
    # for, then fills the gap before the next B with a W that delays it: 32 (+3.2 %) with every other mechanism.
    config = _config(D=3, S=3, M=2, forward=4, backward_input=1, backward_weight=3, optimizer=3)
    failed = [(0, 0), (2, 1), (2, 2)]
    assert not normalize(failed, 3, 3).symmetric
    clear_cache()
    plan = validate_plan(make_plan(config, failed))
    assert plan.meta.predicted_period == simulate(plan, config).period == 31.0
    assert "wait-strict" in plan.meta.notes
    monkeypatch.setattr(heuristic, "WAITING_VARIANTS",
                        tuple(v for v in heuristic.WAITING_VARIANTS if not v.wait_strict))
    clear_cache()
    assert make_plan(config, failed).meta.predicted_period == 32.0
    clear_cache()


def _violations(config: Config, entries: tuple[tuple[tuple[int, int, float, float], ...], ...],
                codes: tuple[int, ...] = (heuristic._F,)) -> list[str]:
    """Actions of `codes` (F's by default) that run while a B whose message was already on its way to the same
    worker arrives (its producer started strictly before them): what the waiting rules forbid."""
    S = config.num_stages
    p2p = [config.communication.p2p_time(s) for s in range(S)]
    timing: dict[tuple[int, int, int], tuple[float, float]] = {}
    for rank, row in enumerate(entries):
        for code, mb, start, end in row:
            timing[(code, rank % S, mb)] = (start, end)
    found = []
    for rank, row in enumerate(entries):
        s = rank % S
        arrivals = []
        for code, mb, _, _ in row:
            if code != heuristic._B:
                continue
            if s == S - 1:  # the loss turn-around: its F on this same worker
                producer = timing[(heuristic._F, s, mb)]
                arrivals.append((producer[0], producer[1]))
            else:
                producer = timing[(heuristic._B, s + 1, mb)]
                arrivals.append((producer[0], producer[1] + p2p[s]))
        for code, mb, start, end in row:
            if code in codes:
                found += [f"rank {rank} {'FBW'[code]}{mb} at {start:g}-{end:g} delays a B arriving at {arrival:g}"
                          for sent, arrival in arrivals if sent < start and start < arrival < end]
    return found


@pytest.mark.timeout(120)
def test_order_moves_from_several_routings_reach_the_proved_optimum(monkeypatch: pytest.MonkeyPatch) -> None:
    # Case 0 of the same screen: nested (one pipeline, two stages), decoupled, staggered. Every balanced routing the
    # orphan swaps pass through has the rules' estimate 28; the order moves reach the optimum 26 (CP-SAT proves it
    # in 20 s) from the third routing they start from, and stay at 28 from the swaps' best alone. (The strict
    # waiting rules reach 26 as well; they are left out here so the test is about the order moves.)
    config = _config(D=5, S=3, M=2, forward=3, backward_input=1, backward_weight=4, optimizer=0)
    failed = [(4, 0), (4, 2)]
    monkeypatch.setattr(heuristic, "WAITING_VARIANTS",
                        tuple(v for v in heuristic.WAITING_VARIANTS if not v.wait_strict))
    clear_cache()
    plan = validate_plan(make_plan(config, failed))
    assert plan.meta.predicted_period == simulate(plan, config).period == 26.0
    assert "order moves" in plan.meta.notes
    monkeypatch.setattr(heuristic, "ORDER_STARTS", 1)
    clear_cache()
    assert make_plan(config, failed).meta.predicted_period == 28.0
    clear_cache()


@pytest.mark.timeout(120)
def test_waiting_rules_never_start_a_forward_that_delays_a_backward_on_its_way() -> None:
    rng = random.Random(7)
    waited = plain_violations = 0
    for _ in range(12):
        D, S, M = rng.randint(2, 5), rng.randint(2, 4), rng.randint(2, 6)
        forward, backward_input, backward_weight = rng.sample([1, 2, 3, 4], 3)
        config = _config(D, S, M, forward, backward_input, backward_weight, rng.choice((0, 1, 3)))
        key = normalize([(rng.randrange(D), rng.randrange(S))], D, S).key
        host = balanced_routing(config, key)
        decoupled = rng.random() < 0.75
        for variant in heuristic.WAITING_VARIANTS:
            timed = heuristic.list_schedule(config, key, host, decoupled, True, None, variant)
            # The strict rules hold their W's too.
            codes = (heuristic._F, heuristic._W) if variant.wait_strict else (heuristic._F,)
            assert _violations(config, timed.entries, codes) == []
            plain = heuristic.list_schedule(config, key, host, decoupled, True, None,
                                            replace(variant, wait_for_backward=False, wait_strict=False))
            waited += timed.entries != plain.entries
            plain_violations += bool(_violations(config, plain.entries))
        # Plans built from the waiting rules alone are valid (schedule_heuristic validates what it returns).
        plan = heuristic.schedule_heuristic(config, key, PlannerOptions(decoupled=decoupled, search=False),
                                            variants=heuristic.WAITING_VARIANTS)
        assert simulate(plan, config).period == plan.meta.predicted_period
    assert waited > 0, "the waiting rules never changed a schedule: the check above tests nothing"
    # The plain rules do start such F's: the property is the waiting rule's, not every list schedule's.
    assert plain_violations > 0


# The misses the seed-0 screen (`bench_planner_quality.py --draw distinct --planner make_plan`, 300 cases) leaves
# after the strict waiting rules: (shape, failed, options, CP-SAT's best (4 s, 2 workers), proved optimal,
# make_plan's period now; case 237, +1.8 %, is in SCREEN_MISSES). Guards: no plan gets slower, none beats a proved
# optimum (that would be a broken simulator or model), the same plan twice.
REMAINING_MISSES = [
    # (case 94, not nested, 82 against the proved 81, is closed by the critical-path moves: see below)
    # case 123: nested, 35 against CP-SAT's best 34 without a proof (+2.9 %)
    ((5, 4, 4, 2, 1, 3, 3), [(3, 0), (3, 2)], PlannerOptions(), 34.0, False, 35.0),
    # case 47: not nested, 40 against CP-SAT's best 39 without a proof (+2.6 %)
    ((6, 3, 3, 4, 2, 1, 3), [(2, 0), (4, 1), (5, 0)], PlannerOptions(), 39.0, False, 40.0),
    # Seed 1, 300 cases (issue 26 items 2 and 3, after the first-stage-forward rule):
    # case 179: nested, fused, coupled: 58 before the rule, 57 against the proved 56 (+1.8 %)
    ((6, 3, 5, 4, 1, 2, 0), [(0, 0), (0, 1), (4, 0)], PlannerOptions(decoupled=False, staggered=False), 56.0, True,
     57.0),
    # case 161: nested, 70, the proved optimum (71 before the deadline schedules); case 147: not nested, coupled,
    # 75 against the proved 74
    ((5, 4, 6, 4, 2, 1, 0), [(0, 0), (0, 1), (3, 1)], PlannerOptions(), 70.0, True, 70.0),
    ((3, 4, 5, 3, 4, 1, 1, 0.5), [(0, 0), (0, 1), (2, 2)], PlannerOptions(staggered=False), 74.0, True, 75.0),
    # Against CP-SAT's best without a proof (4 s): cases 170 (26 / 25), 181 (52 / 50), 189 (52 / 52; 54 before the
    # deadline schedules), 97 (40 / 39)
    ((6, 4, 3, 2, 1, 3, 0), [(0, 1)], PlannerOptions(), 25.0, False, 26.0),
    ((4, 4, 4, 4, 2, 1, 1), [(1, 2)], PlannerOptions(), 50.0, False, 52.0),
    ((3, 4, 4, 1, 3, 4, 3, 0.5), [(0, 2), (0, 3)], PlannerOptions(), 52.0, False, 52.0),
    ((6, 4, 4, 2, 1, 4, 3), [(3, 0)], PlannerOptions(), 39.0, False, 40.0),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape, failed, options, best, proved, now", REMAINING_MISSES)
def test_remaining_screen_misses_do_not_get_worse(shape: tuple, failed: list, options: PlannerOptions, best: float,
                                                  proved: bool, now: float) -> None:
    config = _config(*shape)
    clear_cache()
    plan = validate_plan(make_plan(config, failed, options))
    clear_cache()
    assert make_plan(config, failed, options).to_json() == plan.to_json()  # deterministic: work, not seconds
    period = plan.meta.predicted_period
    assert period == simulate(plan, config).period
    assert period <= now, f"period {period:g}, was {now:g} (CP-SAT's best {best:g})"
    if proved:
        assert best <= period <= best * 1.02
    clear_cache()


@pytest.mark.timeout(120)
def test_first_stage_forward_rule_closes_the_fused_coupled_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    # Seed 1 case 6 of the screen: not nested (three pipelines, two stages), fused backward, coupled optimizer; 61
    # (the canonical fall-back) against CP-SAT's proved 59, the lower bound: the busiest stage-0 workers never idle.
    # CP-SAT's optimum runs their F's before their B's (a stage-0 B sends nothing); the rule that does so reaches 60
    # (+1.7 %) on the real ranks, no longer falling back, and the critical-path order moves then 59. Without the rule
    # the miss comes back.
    config = _config(6, 3, 5, 4, 2, 1, 3)
    failed, options = [(0, 0), (1, 1), (4, 0)], PlannerOptions(decoupled=False, staggered=False)
    assert not normalize(failed, 6, 3).symmetric
    clear_cache()
    plan = validate_plan(make_plan(config, failed, options))
    period = plan.meta.predicted_period
    assert period == simulate(plan, config).period
    assert 59.0 <= period <= 59.0 * 1.02, f"period {period:g}, CP-SAT's proved optimum 59"
    assert "first-stage-forward" in plan.meta.notes and not plan.meta.routing_fallback
    monkeypatch.setattr(heuristic, "FIRST_STAGE_VARIANTS", ())
    clear_cache()
    assert make_plan(config, failed, options).meta.predicted_period > period  # 60 (61 before the critical moves)
    clear_cache()


def test_first_stage_forward_runs_stage_zero_forwards_before_backwards() -> None:
    # The rule's property: no stage-0 worker starts a B while it could start an F (below its cap, one arrived).
    config = _config(4, 3, 8, 1, 1, 1, 0)  # the first B returns (at 7) while F's still wait (10-11 per worker)
    key = (1, 0, 0)
    host = balanced_routing(config, key)
    variant = heuristic.FIRST_STAGE_VARIANTS[0]
    timed = heuristic.list_schedule(config, key, host, False, False, None, variant)
    plain = heuristic.list_schedule(config, key, host, False, False, None,
                                    replace(variant, first_stage_forward=False))
    for rank, row in enumerate(timed.entries):
        if rank % 3 == 0 and row:  # stage 0 (rank 0 failed): every F is there at once and no cap holds them back
            half = len(row) // 2
            assert [code for code, *_ in row] == [heuristic._F] * half + [heuristic._B] * half, rank
    assert timed.entries != plain.entries


@pytest.mark.timeout(120)
def test_deadline_schedules_bring_the_nested_fused_coupled_miss_within_two_percent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Seed 1 case 283 of the screen: nested (0:0 1:0 1:1), fused backward, coupled optimizer; 80 against CP-SAT's
    # proved 78, the bound (+2.6 %). 78 needs each busiest stage-0 worker's F's back to back and then its BW's back to
    # back, so its first gradient must return after exactly one round trip and every later one in time for its
    # slot: the stage-0 orders permuted together with the downstream ones, which no move of one worker's order
    # reaches (docs/planner.md, "Why case 283 stays at 80"). The deadline list schedules on the third order start's
    # routing (latest starts from the stage-0 sequences packed against the bound, the sequences spread over
    # disjoint downstream workers, then moved) reach 79 (+1.3 %). Without them the miss comes back.
    config = _config(6, 4, 7, 2, 4, 1, 0)
    failed, options = [(0, 0), (1, 0), (1, 1)], PlannerOptions(decoupled=False, staggered=False)
    clear_cache()
    plan = validate_plan(make_plan(config, failed, options))
    period = plan.meta.predicted_period
    assert period == simulate(plan, config).period
    assert 78.0 <= period <= 78.0 * 1.02, f"period {period:g}, CP-SAT's proved optimum 78"
    assert "deadline schedules" in plan.meta.notes
    clear_cache()
    assert make_plan(config, failed, options).to_json() == plan.to_json()  # deterministic: work, not seconds
    monkeypatch.setattr(heuristic, "DEADLINE_START", heuristic.ORDER_STARTS)  # no start gets them
    clear_cache()
    assert make_plan(config, failed, options).meta.predicted_period == 80.0
    clear_cache()


@pytest.mark.timeout(120)
def test_bottleneck_forward_rule_closes_the_staggered_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    # Seed 1 case 212 of the screen: nested (two stage-1 failures and one at stage 2), decoupled, staggered; 75
    # against CP-SAT's proved 73, the bound: the one live stage-1 worker hosts all 9 micro-batches (72 of work) and
    # may never idle. CP-SAT's optimum runs its F's ahead of its B's, so the B's it has left cover the last F's
    # round trip; alternating F and B there left it waiting for the last B. Without the rule the miss comes back.
    config = _config(3, 3, 3, 4, 3, 1, 1, 0.5)
    failed, options = [(0, 1), (0, 2), (1, 1)], PlannerOptions()
    clear_cache()
    plan = validate_plan(make_plan(config, failed, options))
    period = plan.meta.predicted_period
    assert period == simulate(plan, config).period == 73.0, f"period {period:g}, CP-SAT's proved optimum 73"
    assert "bottleneck-forward" in plan.meta.notes
    clear_cache()
    assert make_plan(config, failed, options).to_json() == plan.to_json()
    monkeypatch.setattr(heuristic, "FIRST_STAGE_VARIANTS",
                        tuple(v for v in heuristic.FIRST_STAGE_VARIANTS if not v.bottleneck_forward))
    clear_cache()
    # The deadline list schedules reach the bound without the rule too (a second way to it) ...
    assert make_plan(config, failed, options).meta.predicted_period == 73.0
    # ... and without both the miss comes back.
    monkeypatch.setattr(heuristic, "DEADLINE_START", heuristic.ORDER_STARTS)
    clear_cache()
    assert make_plan(config, failed, options).meta.predicted_period == 75.0
    clear_cache()


def test_bottleneck_forward_runs_the_busiest_workers_forwards_before_backwards() -> None:
    # The rule's property: on the workers with the most work, no B starts while an F has arrived and may start
    # (no cap here); elsewhere the plain rule's order holds. Case 212's key: stage 1's one live worker is it.
    config = _config(3, 3, 3, 4, 3, 1, 1, 0.5)
    key = (0, 2, 1)
    host = balanced_routing(config, key)
    variant = next(v for v in heuristic.FIRST_STAGE_VARIANTS if v.bottleneck_forward)
    timed = heuristic.list_schedule(config, key, host, True, True, None, variant)
    plain = heuristic.list_schedule(config, key, host, True, True, None, replace(variant, bottleneck_forward=False))
    busiest = 2 * 3 + 1  # worker (2, 1): all 9 micro-batches at stage 1
    arrived = {}  # mb -> when its F could start on the busiest worker (its stage-0 F's end + the message)
    for rank, row in enumerate(timed.entries):
        if rank % 3 == 0:
            for code, mb, _, end in row:
                if code == heuristic._F:
                    arrived[mb] = end + 0.5
    row = timed.entries[busiest]
    started_f = set()
    for code, mb, start, _ in row:
        if code == heuristic._B:
            waiting = [m for m, t in arrived.items() if t <= start and m not in started_f]
            assert not waiting, f"B of {mb} at {start:g} while F's of {waiting} had arrived"
        elif code == heuristic._F:
            started_f.add(mb)
    assert timed.entries[busiest] != plain.entries[busiest]
    assert timed.estimate < plain.estimate


# Misses the critical-path order moves close (issue 26: swaps at the ends of the critical path's blocks): (shape,
# failed, options, CP-SAT's proved optimum, make_plan's period without those moves).
CRITICAL_MOVE_MISSES = [
    # seed 1 case 6: not nested, fused, coupled: 60 (after the first-stage-forward rule) -> the optimum 59
    ((6, 3, 5, 4, 2, 1, 3), [(0, 0), (1, 1), (4, 0)], PlannerOptions(decoupled=False, staggered=False), 59.0, 60.0),
    # seed 0 case 94: not nested, decoupled, staggered: 82 -> the optimum 81
    ((2, 3, 5, 3, 4, 1, 1), [(0, 1), (1, 0)], PlannerOptions(), 81.0, 82.0),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape, failed, options, optimum, before", CRITICAL_MOVE_MISSES)
def test_critical_path_moves_close_screen_misses(shape: tuple, failed: list, options: PlannerOptions,
                                                optimum: float, before: float,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(*shape)
    clear_cache()
    plan = validate_plan(make_plan(config, failed, options))
    period = plan.meta.predicted_period
    assert period == simulate(plan, config).period == optimum
    assert "order moves" in plan.meta.notes
    clear_cache()
    assert make_plan(config, failed, options).to_json() == plan.to_json()
    monkeypatch.setattr(local_search, "CRITICAL_SHARE", 0.0)
    clear_cache()
    assert make_plan(config, failed, options).meta.predicted_period == before
    clear_cache()


def test_critical_blocks_form_a_chain_of_waits() -> None:
    # The critical path the moves work on: from the last action of the given worker back through actions that
    # each waited for the one before on their worker (inside a block) or for their message (between blocks).
    config = _config(6, 4, 7, 2, 4, 1, 0)
    key = (2, 1, 0, 0)
    host = balanced_routing(config, key)
    timed = heuristic.list_schedule(config, key, host, False, False, None, heuristic.VARIANTS[0])
    evaluator = local_search.OrderEvaluator(config, key, host, False, False, None, [0.0] * 4)
    rows = evaluator.time([[(code, mb) for code, mb, _, _ in row] for row in timed.entries])
    assert rows is not None
    last = max(range(len(rows)), key=lambda r: rows[r][-1][3] if rows[r] else -1)
    blocks = evaluator.critical_blocks(rows, last)
    assert blocks and blocks[0][0] == last and blocks[0][2] == len(rows[last]) - 1
    for rank, lo, hi in blocks:
        assert lo < hi
        for i in range(lo + 1, hi + 1):  # each waited for its worker
            assert rows[rank][i][2] == rows[rank][i - 1][3]
        _, mb, start, _ = rows[rank][lo]
        # ... and the block's first did not wait for its worker but for its message (no p2p time here)
        assert lo == 0 or rows[rank][lo - 1][3] < start
        assert start == 0 or any(other_mb == mb and end == start for row in rows for _, other_mb, _, end in row)
    assert any(rank % 4 != 0 for rank, _, _ in blocks), "the path reaches past the bottleneck stage"
