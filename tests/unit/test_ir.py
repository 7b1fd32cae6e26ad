"""Plan IR: token and CSV round trips, CSV errors, atomic writes, and the validator's rejections with marked grids."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from recycle.config import uniform_config
from recycle.errors import PlanError
from recycle.ir import (Action, Kind, Plan, PlanMeta, dump_csv, format_grid, load_csv, read_csv, validate_plan,
                        write_csv)
from recycle.schedules.fault_free import SCHEDULES, build_schedule


def rerouted_plan() -> Plan:
    """D=2, S=2, M=2 with worker (1,1) down: its micro-batches 2 and 3 run on the peer (0,1)."""
    actions = [
        [Action.parse(t) for t in "0F0 0F1 0BW0 0BW1 0OPT".split()],
        [Action.parse(t) for t in "1F0 1F1 1F2 1F3 1BW0 1BW1 1BW2 1BW3 1OPT".split()],
        [Action.parse(t) for t in "0F2 0F3 0BW2 0BW3 0OPT".split()],
        [],
    ]
    plan = Plan.from_worker_lists(2, 2, 2, actions, failed={(1, 1)}, staggered=True,
                                  meta=PlanMeta(schedule="hand", failure_key=(0, 1), memory_cap=(4, 4),
                                                predicted_period=12.5, notes="a, b = c"))
    return validate_plan(plan)


def _all_plans() -> list[Plan]:
    plans = [rerouted_plan()]
    for D, S, M in [(1, 2, 3), (3, 4, 6), (2, 5, 11)]:
        config = uniform_config(D, S, M)
        for name in sorted(SCHEDULES):
            for staggered in (False, True):
                plans.append(build_schedule(config, name, staggered=staggered))
    return plans


def test_every_token_of_every_schedule_round_trips() -> None:
    count = 0
    for plan in _all_plans():
        for acts in plan.actions:
            for a in acts:
                assert Action.parse(str(a)) == a
                count += 1
    assert count > 1000


@pytest.mark.parametrize("token", ["", "F1", "1F", "1X2", "1OPT3", "-1F2", "1F1.5", "1BW", "1 F 2"])
def test_malformed_tokens_are_rejected_with_the_expected_form(token: str) -> None:
    with pytest.raises(PlanError, match="expected|needs a micro-batch|takes no micro-batch"):
        Action.parse(token)


def test_parse_known_tokens() -> None:
    assert Action.parse("2F7") == Action(Kind.F, 2, 7)
    assert Action.parse("0BW3") == Action(Kind.BW, 0, 3)
    assert Action.parse("1OPT") == Action(Kind.OPT, 1)
    assert str(Action(Kind.W, 12, 345)) == "12W345"


def test_csv_round_trip_gives_an_equal_plan() -> None:
    for plan in _all_plans():
        text = dump_csv(plan)
        again = load_csv(text)
        assert again == plan
        assert dump_csv(again) == text


def test_csv_format_header_and_rows() -> None:
    plan = rerouted_plan()
    lines = dump_csv(plan).splitlines()
    header = {line[2:].split("=", 1)[0]: line[2:].split("=", 1)[1] for line in lines if line.startswith("# ")
              and "=" in line}
    assert header["num_replicas"] == "2" and header["num_stages"] == "2" and header["num_microbatches"] == "2"
    assert header["staggered"] == "true" and header["failed"] == "1:1"
    rows = [line for line in lines if not line.startswith("#")]
    assert rows[0] == "rank,replica,stage,actions"
    assert rows[2] == "1,0,1,1F0 1F1 1F2 1F3 1BW0 1BW1 1BW2 1BW3 1OPT"
    assert rows[4] == "3,1,1,"  # the failed worker: no actions
    assert load_csv(dump_csv(plan)).host == ((0, 0, 1, 1), (0, 0, 0, 0))  # routing derived from the forwards


def test_csv_write_is_atomic_and_reads_back(tmp_path) -> None:
    plan = build_schedule(uniform_config(2, 3, 4), "zb-h1")
    path = write_csv(plan, tmp_path / "sub" / "plan.csv")
    assert read_csv(path) == plan
    assert os.listdir(tmp_path / "sub") == ["plan.csv"]  # no temp file left behind


@pytest.mark.parametrize("mutate,message", [
    (lambda t: t.replace("# num_stages=2\n", ""), "num_stages=...' is missing"),
    (lambda t: t.replace("2,1,0,", "2,0,1,"), "rank 2 is worker 1:0"),
    (lambda t: t.replace("# staggered=true", "# staggered=yes"), "must be true or false"),
    (lambda t: t.replace("# failed=1:1", "# failed=1-1"), "write replica:stage"),
    (lambda t: t.replace("1F3", "1Q3"), "malformed"),
    (lambda t: t.replace("# num_replicas=2", "# num_replicas=two"), "not an integer"),
    (lambda t: t + "0,0,0,0F0\n", "second row"),
    (lambda t: t.replace('"notes"', '"colour"'), "unknown entries"),
])
def test_csv_errors_name_the_line_and_the_fix(mutate, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        load_csv(mutate(dump_csv(rerouted_plan())), source="p.csv")


def test_read_csv_of_a_missing_file_says_how_to_make_one(tmp_path) -> None:
    with pytest.raises(PlanError, match="does not exist.*--csv"):
        read_csv(tmp_path / "nope.csv")


def _with_actions(plan: Plan, rank: int, tokens: str) -> Plan:
    actions = list(plan.actions)
    actions[rank] = tuple(Action.parse(t) for t in tokens.split())
    return replace(plan, actions=tuple(actions))


def test_validator_rejects_a_deadlock_and_marks_the_blocked_cells() -> None:
    plan = build_schedule(uniform_config(1, 4, 6), "1f1b")
    order = [str(a) for a in plan.actions[0]]
    assert order[:5] == ["0F0", "0F1", "0F2", "0F3", "0BW0"]
    # Swap 0F1 and 0BW0: 0BW0 needs 1BW0, which (in stage 1's order) comes after 1F1, which needs 0F1.
    order[1], order[4] = order[4], order[1]
    broken = _with_actions(plan, 0, " ".join(order))
    with pytest.raises(PlanError) as info:
        validate_plan(broken)
    text = str(info.value)
    assert "plan deadlocks" in text
    assert "(0, 0) waits at 0BW0 for 1BW0 on (0, 1)" in text
    assert "(0,0) 0F0 >0BW0< 0F2" in text  # the grid row, offending cell marked
    assert ">1BW0<" not in text and ">1F1<" in text  # stage 1 is blocked at its F1, waiting for 0F1


def test_validator_rejects_a_microbatch_processed_twice() -> None:
    plan = build_schedule(uniform_config(2, 2, 2), "1f1b")
    twice = _with_actions(plan, 2, "0F2 0F0 0F3 0BW2 0BW3 0OPT")  # replica 1 also runs replica 0's micro-batch 0
    with pytest.raises(PlanError) as info:
        validate_plan(twice)
    text = str(info.value)
    assert "micro-batch 0 is processed twice at stage 0" in text
    assert "(0,0) >0F0<" in text and "(1,0) 0F2 >0F0<" in text


def test_validator_rejects_order_and_routing_errors() -> None:
    plan = build_schedule(uniform_config(1, 2, 2), "1f1b-decoupled")
    with pytest.raises(PlanError, match="before its forward"):
        validate_plan(_with_actions(plan, 0, "0B0 0F0 0W0 0F1 0B1 0W1 0OPT"))
    with pytest.raises(PlanError, match="needs 0B1 earlier"):
        validate_plan(_with_actions(plan, 0, "0F0 0B0 0W0 0F1 0W1 0B1 0OPT"))
    with pytest.raises(PlanError, match="exactly one 0OPT"):
        validate_plan(_with_actions(plan, 0, "0F0 0B0 0W0 0F1 0B1 0W1"))
    with pytest.raises(PlanError, match="no forward"):
        validate_plan(_with_actions(plan, 0, "0F0 0B0 0W0 0OPT"))


def test_format_grid_marks_cells_and_shows_down_workers() -> None:
    grid = format_grid(rerouted_plan(), marks=[(1, 2)])
    assert "(0,1) 1F0 1F1 >1F2< 1F3" in grid
    assert "(1,1) DOWN" in grid
