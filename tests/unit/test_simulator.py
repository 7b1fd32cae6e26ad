"""Simulator: the paper's toy numbers, and an independent re-check of every recorded timeline (ASAP, deps, memory)."""

from __future__ import annotations

import functools
from collections import defaultdict
from pathlib import Path

import pytest

from recycle.config import Config, load_config, parse_config, uniform_config
from recycle.errors import PlanError
from recycle.ir import Action, Kind, Plan, PlanMeta, validate_plan
from recycle.ir.costs import action_duration
from recycle.schedules.fault_free import SCHEDULES, build_schedule
from recycle.sim.simulator import simulate

TOY = Path(__file__).resolve().parents[2] / "configs" / "toy.toml"


@pytest.mark.parametrize("staggered", [False, True])
def test_toy_1f1b_matches_the_paper(staggered: bool) -> None:
    config = load_config(TOY)
    result = simulate(build_schedule(config, "1f1b", staggered=staggered), config)
    assert result.makespan == 27 and result.first_makespan == 27
    assert result.period == 30
    assert result.bubble_fraction == pytest.approx(0.30)
    assert result.idle_fraction == pytest.approx((0.3,) * 12)  # busy 6*(1+2) + 3 of every 30 slots
    assert result.peak_activations == (4, 3, 2, 1) * 3
    assert result.num_iterations == 4 and result.num_actions == 3 * 4 * 13 * 4


def _comm_config(with_comm: bool = True) -> Config:
    """D=3, S=4, M=6 with uneven forwards; p2p 0.5 + 2/4 = 1 per message and a 300-byte ring all-reduce."""
    raw = {"topology": {"num_replicas": 3, "num_stages": 4}, "workload": {"num_microbatches": 6},
           "costs": {"forward": [1, 1.5, 1, 2], "backward_input": 1, "backward_weight": 0.5, "optimizer": 3},
           "memory": {"activation_bytes": 10}}
    if with_comm:
        raw["communication"] = {"p2p_latency": 0.5, "p2p_bandwidth": 4.0, "activation_message_bytes": 2,
                                "allreduce_latency": 0.25, "allreduce_bandwidth": 100.0, "gradient_bytes": 300}
    return parse_config(raw, name="comm")


def rerouted_plan(staggered: bool) -> Plan:
    """D=2, S=2, M=2 with worker (1,1) down: its micro-batches 2 and 3 run on the peer (0,1)."""
    actions = [
        [Action.parse(t) for t in "0F0 0F1 0B0 0W0 0B1 0W1 0OPT".split()],
        [Action.parse(t) for t in "1F0 1F2 1B0 1F1 1B2 1F3 1B1 1B3 1W0 1W2 1W1 1W3 1OPT".split()],
        [Action.parse(t) for t in "0F2 0F3 0B2 0W2 0B3 0W3 0OPT".split()],
        [],
    ]
    return validate_plan(Plan.from_worker_lists(2, 2, 2, actions, failed={(1, 1)}, staggered=staggered,
                                                meta=PlanMeta(schedule="hand", decoupled=True)))


def _check_timeline(plan: Plan, config: Config, result) -> None:
    """Re-derive the simulator's rules from its own timeline: each action starts as soon as its worker is free
    and its input has arrived; OPT starts together across its all-reduce group; peaks match the intervals."""
    S = plan.num_stages
    comm = config.communication
    by_iter: dict[int, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for rank, it, token, start, end in result.timeline:
        by_iter[it][rank].append((Action.parse(token), start, end))
    live = [r for r in range(plan.num_workers) if plan.actions[r]]
    free = {r: 0.0 for r in live}
    num_live = {s: len(plan.live_replicas(s)) for s in range(S)}
    for it in range(result.num_iterations):
        rows = by_iter[it]
        assert sorted(rows) == live
        end_of: dict[tuple[Kind, int, int], tuple[int, float]] = {}
        for r in live:
            assert [a for a, _, _ in rows[r]] == list(plan.actions[r])  # every action once, in list order
            for a, start, end in rows[r]:
                assert end - start == pytest.approx(action_duration(config, a.kind, a.stage, num_live[a.stage]))
                if a.kind is not Kind.OPT:
                    end_of[(a.kind, a.stage, a.mb)] = (r, end)
        opt_start: dict[int, float] = {}
        for r in live:
            t = free[r]
            for a, start, end in rows[r]:
                if a.kind is Kind.OPT:
                    assert start >= t - 1e-9
                    opt_start[r] = start
                    break
                ready = t
                producer = None
                if a.kind is Kind.F and a.stage > 0:
                    producer, msg_stage = (Kind.F, a.stage - 1, a.mb), a.stage - 1
                elif a.kind in (Kind.B, Kind.BW) and a.stage < S - 1:
                    kind = Kind.B if (Kind.B, a.stage + 1, a.mb) in end_of else Kind.BW
                    producer, msg_stage = (kind, a.stage + 1, a.mb), a.stage
                if producer is not None:
                    src, produced = end_of[producer]
                    arrival = produced + (comm.p2p_time(msg_stage) if src != r else 0.0)
                    ready = max(ready, arrival)
                assert start == pytest.approx(ready), f"iteration {it} worker {plan.worker(r)} {a}"
                t = end
        # OPT: together across the group, as soon as the last member is ready.
        groups = defaultdict(list)
        for r in live:
            groups[plan.worker(r)[1] if plan.staggered else -1].append(r)
        for members in groups.values():
            starts = {opt_start[r] for r in members}
            assert len(starts) == 1
            last_compute = max(rows[r][-2][2] for r in members)
            assert starts.pop() == pytest.approx(max(last_compute, max(free[r] for r in members)))
            ends = [rows[r][-1][2] for r in members]
            for r in members:
                free[r] = rows[r][-1][2] if plan.staggered else max(ends)
    # Peak activations from the intervals: held from F start to W (or BW) end, maximum at any start instant.
    for r in live:
        spans = {}
        for a, start, end in by_iter[0][r]:
            if a.kind is Kind.F:
                spans[a.mb] = [start, None]
            elif a.kind in (Kind.W, Kind.BW):
                spans[a.mb][1] = end
        peak = max(sum(1 for s0, s1 in spans.values() if s0 <= t < s1) for t, _ in spans.values())
        assert peak == result.peak_activations[r]
        stage = plan.worker(r)[1]
        assert result.peak_activation_bytes[r] == peak * config.memory.activation_bytes[stage]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("staggered", [False, True])
def test_timelines_obey_the_rules(name: str, staggered: bool) -> None:
    for config in (load_config(TOY), _comm_config(), uniform_config(2, 3, 7, 2.0, 3.0, 1.0, optimizer=1.5)):
        plan = build_schedule(config, name, staggered=staggered)
        result = simulate(plan, config, iterations=3, record=True)
        _check_timeline(plan, config, result)


@pytest.mark.parametrize("staggered", [False, True])
def test_rerouted_plan_timeline_obeys_the_rules(staggered: bool) -> None:
    config = uniform_config(2, 2, 2, optimizer=2.0)
    plan = rerouted_plan(staggered)
    result = simulate(plan, config, iterations=3, record=True)
    _check_timeline(plan, config, result)
    assert result.peak_activations == (2, 4, 2, 0)  # the peer holds both pipelines' micro-batches
    assert result.idle_fraction[3] == 0.0 and len(result.idle_fraction) == 4


def test_coupled_period_is_makespan_plus_the_slowest_step_and_iterations_repeat() -> None:
    config = _comm_config()
    plan = build_schedule(config, "1f1b")
    result = simulate(plan, config, iterations=5)
    opt = max(action_duration(config, Kind.OPT, s, 3) for s in range(4))
    assert opt == 3 + config.communication.allreduce_time(0, 3) == 3 + 4 * 0.25 + 4 / 3 * 300 / 100
    starts = result.iteration_starts
    gaps = {round(b - a, 9) for a, b in zip(starts, starts[1:])}
    assert gaps == {result.period}  # fault-free: every iteration is the same
    assert result.period == pytest.approx(result.makespan + opt)


def test_communication_only_delays() -> None:
    free, slow = _comm_config(with_comm=False), _comm_config()
    assert slow.communication.p2p_time(0) == 1.0
    for name in SCHEDULES:
        a = simulate(build_schedule(free, name), free)
        b = simulate(build_schedule(slow, name), slow)
        # At least the first forward's trip down and the last backward's trip up cross 3 boundaries each.
        assert b.makespan >= a.makespan + 2 * 3 * 1.0, name
        assert b.period > a.period, name


def test_simulate_rejects_a_plan_for_another_config_and_bad_iterations() -> None:
    plan = build_schedule(uniform_config(2, 2, 2), "1f1b")
    with pytest.raises(PlanError, match="plan is for D=2, S=2, M=2 but the config has D=2, S=2, M=3"):
        simulate(plan, uniform_config(2, 2, 3))
    with pytest.raises(ValueError):
        simulate(plan, uniform_config(2, 2, 2), iterations=0)


def test_one_iteration_period_is_the_whole_iteration() -> None:
    config = load_config(TOY)
    result = simulate(build_schedule(config, "1f1b"), config, iterations=1)
    assert result.period == 30 and result.makespan == 27


def test_simulating_an_unvalidated_deadlocked_plan_raises_with_the_blocked_heads() -> None:
    from dataclasses import replace

    config = uniform_config(1, 2, 2)
    plan = build_schedule(config, "1f1b")
    # Stage 0 runs 0BW0 before 0F1, but stage 1 needs 0F1 before its 1BW0 (1F0 1F1 1BW0 ...): a cycle.
    stage1 = tuple(Action.parse(t) for t in "1F0 1F1 1BW0 1BW1 1OPT".split())
    stage0 = tuple(Action.parse(t) for t in "0F0 0BW0 0F1 0BW1 0OPT".split())
    broken = replace(plan, actions=(stage0, stage1))
    with pytest.raises(PlanError, match=r"deadlocks in simulation") as info:
        simulate(broken, config)
    assert "(0,0) 0F0 >0BW0<" in str(info.value) and "(0,1) 1F0 >1F1<" in str(info.value)


def test_messages_between_nodes_pay_the_inter_node_cost() -> None:
    """D=2, S=2, M=1, 1F1B: one chain F0 -> F1 -> BW1 -> BW0 (1 + 1 + 2 + 2 slots) with two messages."""
    from recycle.config import parse_config
    from recycle.schedules.fault_free import build_schedule

    def makespan(**topology: int) -> float:
        raw = {"topology": {"num_replicas": 2, "num_stages": 2, **topology}, "workload": {"num_microbatches": 1},
               "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
               "communication": {"p2p_latency": 1, "inter_node_latency": 10}}
        config = parse_config(raw)
        return simulate(build_schedule(config, "1f1b"), config).makespan

    assert makespan() == 6 + 2 * 1  # no node information: every message at the p2p latency
    assert makespan(workers_per_node=2) == 6 + 2 * 1  # each pipeline on its own node: nothing crosses
    assert makespan(workers_per_node=1) == 6 + 2 * 10  # every worker alone: both messages cross nodes


@functools.cache
def _plans_for_timer_checks() -> list[tuple[Plan, Config]]:
    from recycle.planner.api import make_plan
    from recycle.planner.options import PlannerOptions

    nodes = parse_config({"topology": {"num_replicas": 4, "num_stages": 3, "workers_per_node": 2},
                          "workload": {"num_microbatches": 5},
                          "costs": {"forward": 1.5, "backward_input": 2.25, "backward_weight": 0.75, "optimizer": 2},
                          "communication": {"p2p_latency": 0.5, "inter_node_latency": 3.25}})
    cases = []
    for config in (load_config(TOY), nodes, uniform_config(5, 4, 6, optimizer=1.0)):
        for name in SCHEDULES:
            for staggered in (False, True):
                cases.append((build_schedule(config, name, staggered=staggered), config))
        # search=False: the priority rules alone (fast); the search's plans are no different to time.
        for options in (PlannerOptions(search=False), PlannerOptions(staggered=False, search=False),
                        PlannerOptions(decoupled=False, search=False)):
            for failed in ([(1, 2)], [(0, 1), (1, 2)], [(2, 0), (0, 2), (1, 1)]):
                cases.append((make_plan(config, failed, options), config))
                cases.append((make_plan(config, failed, options, routing="canonical"), config))
    return cases


@pytest.mark.timeout(60)
def test_level_timer_gives_the_per_action_loops_results_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large plans are timed by recycle.sim.levels; forced on small ones, every number must be bit-identical."""
    import recycle.sim.simulator as simulator

    for plan, config in _plans_for_timer_checks():
        for iterations in (None, 1, 3):
            monkeypatch.setattr(simulator, "LEVEL_TIMER_MIN_ACTIONS", 1 << 60)
            loop = simulate(plan, config, iterations=iterations)
            monkeypatch.setattr(simulator, "LEVEL_TIMER_MIN_ACTIONS", 0)
            assert simulate(plan, config, iterations=iterations) == loop


def test_numpy_dependencies_equal_the_loops() -> None:
    from itertools import chain

    from recycle.sim.levels import flat_dependencies
    from recycle.sim.simulator import _CODE, _dependencies

    for plan, config in _plans_for_timer_checks():
        S, TM = plan.num_stages, plan.total_microbatches
        flat = list(chain.from_iterable(plan.actions))
        code = [_CODE[a.kind] for a in flat]
        stages, mbs = [a.stage for a in flat], [a.mb for a in flat]
        lengths = [len(acts) for acts in plan.actions]
        first = [sum(lengths[:r]) for r in range(len(lengths))]
        stop = [f + n for f, n in zip(first, lengths)]
        comm, node = config.communication, config.topology.node
        p2p = [comm.p2p_time(s) for s in range(S)]
        inter = [comm.inter_node_time(s) for s in range(S)]
        dep, msg = _dependencies(code, stages, mbs, first, stop, S, TM, p2p, inter, node)
        dep_np, msg_np = flat_dependencies(code, stages, mbs, first, stop, S, TM, p2p, inter,
                                           [node(r) for r in range(plan.num_workers)])
        assert dep_np.tolist() == dep and msg_np.tolist() == msg


def test_a_deadlocked_plan_still_raises_with_the_level_timer_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import recycle.sim.simulator as simulator

    monkeypatch.setattr(simulator, "LEVEL_TIMER_MIN_ACTIONS", 0)
    test_simulating_an_unvalidated_deadlocked_plan_raises_with_the_blocked_heads()
