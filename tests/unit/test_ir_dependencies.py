"""The one dependency rule, the one cost model and the one activation cap, checked against each of their users."""

from __future__ import annotations

import pytest

from recycle.config import parse_config, uniform_config
from recycle.errors import ConfigError
from recycle.ir import Action, Kind, validate_plan
from recycle.ir.costs import action_duration
from recycle.ir.dependencies import (input_stage, input_stage_table, local_input, output_stage, output_stage_table,
                                     producer)
from recycle.ir.validate import dependencies
from recycle.planner.failures import canonical_failed, normalize
from recycle.planner.memory_cap import budget_memory_cap, memory_cap
from recycle.planner.options import PlannerOptions
from recycle.runtime.protocol.messages import incoming, outgoing
from recycle.runtime.worker.emulate import action_cost
from recycle.schedules.fault_free import build_schedule

S = 4


@pytest.mark.parametrize("kind", [Kind.F, Kind.B, Kind.BW, Kind.W, Kind.OPT])
def test_input_and_output_stages_are_the_two_ends_of_one_message(kind: Kind) -> None:
    for s in range(S):
        src = input_stage(kind, s, S)
        if src is not None:
            assert abs(src - s) == 1 and output_stage(kind, src, S) == s
        dst = output_stage(kind, s, S)
        if dst is not None:
            assert input_stage(kind, dst, S) == s
    assert [input_stage(kind, s, S) for s in range(S)] == [None if x < 0 else x
                                                            for x in input_stage_table((kind,), S)[0]]
    assert [output_stage(kind, s, S) for s in range(S)] == [None if x < 0 else x
                                                             for x in output_stage_table((kind,), S)[0]]


def test_the_rule_in_words() -> None:
    assert [input_stage(Kind.F, s, S) for s in range(S)] == [None, 0, 1, 2]
    assert [input_stage(Kind.B, s, S) for s in range(S)] == [1, 2, 3, None]
    assert [input_stage(Kind.BW, s, S) for s in range(S)] == [1, 2, 3, None]
    assert all(input_stage(k, s, S) is None for k in (Kind.W, Kind.OPT) for s in range(S))
    assert [local_input(Kind.B, s, S) for s in range(S)] == [None, None, None, Kind.F]  # the loss turn-around
    assert local_input(Kind.W, 1, S) is Kind.B and local_input(Kind.F, 3, S) is None


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "gpipe"])
def test_validator_and_runtime_messages_derive_the_same_edges(schedule: str) -> None:
    # The validator's producer and the runtime's incoming message name the same sender; a backward waits for a B
    # where the next stage is decoupled, for a BW where it is fused.
    plan = validate_plan(build_schedule(uniform_config(2, S, 4), schedule))
    checked = 0
    for rank, acts in enumerate(plan.actions):
        for a in acts:
            message = incoming(plan, rank, a)
            deps = dependencies(plan, a)
            assert (message is None) == (not deps)
            if message is None:
                continue
            (src, action, _), = deps
            assert src == message.src and action == producer(plan, a)
            assert action in plan.actions[src]
            assert outgoing(plan, src, action) == message
            checked += 1
    assert checked == 2 * (S - 1) * 2 * 4


def test_emulated_costs_are_the_cost_model() -> None:
    config = uniform_config(3, S, 2, forward=1.5, backward_input=2.0, backward_weight=0.5, optimizer=3.0)
    plan = build_schedule(config, "1f1b-decoupled", staggered=True)
    for kind in (Kind.F, Kind.B, Kind.W):
        assert action_cost(config, plan, Action(kind, 1, 0)) == action_duration(config, kind, 1, 3)
    assert action_cost(config, plan, Action(Kind.OPT, 2)) == action_duration(config, Kind.OPT, 2, 3)


def test_canonical_failed_is_the_normalized_layout() -> None:
    state = normalize([(2, 1), (0, 1), (1, 3)], 3, S)
    assert state.key == (0, 2, 0, 1)
    assert canonical_failed(state.key) == state.canonical_failed() == {(0, 1), (1, 1), (0, 3)}


def test_memory_cap_from_options_or_budget() -> None:
    raw = {"topology": {"num_replicas": 2, "num_stages": 2}, "workload": {"num_microbatches": 3},
           "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
           "memory": {"activation_bytes": [100, 200], "capacity_bytes": 200}}
    config = parse_config(raw)
    assert budget_memory_cap(config) == (2, 1)
    assert memory_cap(config, PlannerOptions()) == (2, 1)
    assert memory_cap(config, PlannerOptions(memory_cap=(5, 4))) == (5, 4)
    assert memory_cap(uniform_config(2, 2, 3), PlannerOptions()) is None
    with pytest.raises(ConfigError, match=r"memory cap \[4\] must list one integer >= 1 per stage \(2 stages\)"):
        memory_cap(config, PlannerOptions(memory_cap=(4,)))
