"""The chunked planner after failures (issue 26 item 1): greedy rules that keep a chunk activation of the cap for
later chunks (`guard`), and the key's canonical routing for non-nested failure sets, so the V-shape plan is at
least as fast as the one-chunk plan at the same cap (benchmarks/bench_chunks.py's two shapes it lost on)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from recycle.config import Config, parse_config
from recycle.errors import PlanError
from recycle.ir.validate import validate_plan
from recycle.planner import chunked
from recycle.planner.api import clear_cache, make_plan, plan_for_key
from recycle.planner.chunked import (ChunkVariant, canonical_chunked_routing, chunked_routing,
                                     list_schedule_chunked)
from recycle.planner.failures import normalize
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import worker_loads
from recycle.sim.simulator import simulate


def _config(D: int, S: int, M: int, chunks: int, f: float = 2.0, b: float = 3.0, w: float = 1.0) -> Config:
    return parse_config({"topology": {"num_replicas": D, "num_stages": S, "chunks_per_worker": chunks,
                                      "chunk_layout": "v" if chunks > 1 else "interleaved"},
                         "workload": {"num_microbatches": M},
                         "costs": {"forward": f, "backward_input": b, "backward_weight": w, "optimizer": 0.0}})


def _periods(D: int, S: int, M: int, failed: list[tuple[int, int]]) -> tuple[float, float, object]:
    """(one-chunk period, chunked V period, chunked plan) from make_plan at a cap of S full-stage activations."""
    options = PlannerOptions(staggered=False, memory_cap=(S,) * S)
    clear_cache()
    one = make_plan(_config(D, S, M, 1), failed, options)
    config = _config(D, S, M, 2)
    plan = validate_plan(make_plan(config, failed, options))
    assert plan.meta.predicted_period == simulate(plan, config).period
    clear_cache()
    return one.meta.predicted_period, plan.meta.predicted_period, plan


def test_the_guard_keeps_room_for_later_chunks_where_the_greedy_rule_deadlocks() -> None:
    # D=4 S=4 M=8, 1:1 and 2:0 down, cap 8 chunk activations: the greedy alternating rule fills survivors with
    # shallow chunks and cannot place the deep ones (tests/unit/test_chunks.py); one slot kept for them suffices.
    config = _config(4, 4, 8, 2, 1.0, 1.0, 1.0)
    failed = frozenset({(1, 1), (2, 0)})
    host = chunked_routing(config, failed)
    greedy = ChunkVariant("mb", "ready", alternate=True)
    with pytest.raises(PlanError, match="could not place every action"):
        list_schedule_chunked(config, failed, host, True, False, (8,) * 4, greedy)
    plan = validate_plan(list_schedule_chunked(config, failed, host, True, False, (8,) * 4, replace(greedy, guard=1)))
    assert max(simulate(plan, config).peak_activations) <= 8
    assert "/guard1" in plan.meta.notes


def test_the_guard_rules_close_the_first_shape_the_v_plan_lost_after_failures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # bench_chunks.py: D=3 S=5 M=10, F=2 B=3 W=1, 0:0 and 1:4 down (not nested), cap 5: 110.5 against the one-chunk
    # plan's 108 before. The guard rules alone reach 106 on the traffic-aware routings, the canonical routing 103.5.
    one, ours, plan = _periods(3, 5, 10, [(0, 0), (1, 4)])
    assert ours <= one, f"chunked {ours:g}, one chunk {one:g}"
    assert "/guard1" in plan.meta.notes
    monkeypatch.setattr(chunked, "FAILURE_VARIANTS", tuple(v for v in chunked.FAILURE_VARIANTS if not v.guard))
    assert _periods(3, 5, 10, [(0, 0), (1, 4)])[1] > one  # without them the loss comes back


def test_the_canonical_routing_closes_the_second_shape_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # bench_chunks.py: D=3 S=6 M=12, F=2 B=3 W=1, 0:2 and 2:3 down (not nested), cap 6: 129 against 125 before. The
    # one-chunk plan there is make_plan's canonical fall-back; the chunked planner now tries that routing too.
    one, ours, plan = _periods(3, 6, 12, [(0, 2), (2, 3)])
    assert ours <= one, f"chunked {ours:g}, one chunk {one:g}"
    assert plan.meta.routing_fallback.startswith("canonical routing: period ")
    assert "healthy (chunk, micro-batch) pairs" in plan.meta.routing_fallback
    assert "canonical routing: faster than traffic-aware" in plan.meta.notes
    assert '"routing_fallback"' in plan.to_json()
    # Without the canonical routing (only the traffic-aware ones) the loss comes back.
    monkeypatch.setattr(chunked, "canonical_chunked_routing", lambda config, failed: chunked_routing(config, failed))
    assert _periods(3, 6, 12, [(0, 2), (2, 3)])[1] > one


def test_the_canonical_chunked_routing_is_the_one_chunk_canonical_routing_on_every_chunk() -> None:
    config = _config(3, 4, 4, 2)
    failed = frozenset({(0, 0), (2, 3)})
    state = normalize(failed, 3, 4)
    assert not state.symmetric
    host = canonical_chunked_routing(config, failed)
    one = state.to_real(plan_for_key(config.one_chunk(), state.key, PlannerOptions())).host
    assert all(host[v] == one[w] for v, w in enumerate((0, 1, 2, 3, 3, 2, 1, 0)))  # V: chunk v on worker w
    loads = worker_loads(one, 3)
    for s in range(4):
        live = [loads[s][p] for p in range(3) if (p, s) not in failed]
        assert all(loads[s][p] == 0 for p in range(3) if (p, s) in failed)
        assert max(live) - min(live) <= 1 and sum(live) == 12


def test_a_nested_failure_set_never_takes_the_canonical_routing() -> None:
    # Nested sets: only the failed workers' micro-batches move, as before (the canonical routing is not tried).
    config = _config(3, 4, 4, 2)
    plan = make_plan(config, [(1, 1), (1, 2)], PlannerOptions(memory_cap=(4,) * 4))
    assert not plan.meta.routing_fallback
    for v, row in enumerate(plan.host):
        s = plan.chunk_stage(v)
        assert all(h == mb // 4 for mb, h in enumerate(row) if (mb // 4, s) not in plan.failed)
    clear_cache()
