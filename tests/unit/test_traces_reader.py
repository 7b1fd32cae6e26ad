"""Trace reader: well-formed event and availability traces, every kind of messy input, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from recycle.errors import TraceError
from recycle.traces.placement import availability_to_events
from recycle.traces.reader import parse_availability_lines, parse_event_lines, read_trace
from recycle.traces.trace import AvailabilityTrace

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "traces"


def test_well_formed_trace_has_initial_cluster_and_changes() -> None:
    lines = ["0,add,n1", "0,add,n2", "0,add,n3", "1000,remove,n2", "5000,add,n2", "7000,remove,n1"]
    trace = parse_event_lines(lines)
    assert trace.initial == {"n1", "n2", "n3"}
    assert [(e.time_ms, e.action, e.node) for e in trace.events] == [
        (1000, "remove", "n2"), (5000, "add", "n2"), (7000, "remove", "n1")]
    points = trace.change_points()
    assert [(t, sorted(s)) for t, s in points] == [
        (0, ["n1", "n2", "n3"]), (1000, ["n1", "n3"]), (5000, ["n1", "n2", "n3"]), (7000, ["n2", "n3"])]
    assert trace.end_ms == 7000 and trace.num_removals() == 2 and trace.max_live() == 3
    assert trace.notes.messages() == []


def test_messy_input_is_fixed_and_counted() -> None:
    lines = [
        "time_ms,action,node",  # header
        "",
        "# a comment",
        "0,add,a", "0,add,b", "0,add,c",
        "3000,remove,b",
        "2000,remove,a",  # out of order
        "2000,remove,a",  # repeated remove
        "4000,add,c",  # add of a present node
        "   ",
        "5000,remove,c", "5000,add,c",  # leaves and re-joins at one instant
        "6000,add,a",
    ]
    trace = parse_event_lines(lines, source="messy.csv")
    n = trace.notes
    assert (n.header, n.blank_lines, n.comment_lines) == (True, 2, 1)
    assert n.out_of_order == 2  # both 2000 lines come after 3000
    assert n.repeated_removes == 1 and n.repeated_adds == 1
    assert n.cancelled_pairs == 1
    assert [(e.time_ms, e.action, e.node) for e in trace.events] == [
        (2000, "remove", "a"), (3000, "remove", "b"), (6000, "add", "a")]
    messages = " ".join(n.messages())
    assert "sorted stably" in messages and "not present" in messages and "already present" in messages


def test_simultaneous_events_apply_as_one_change() -> None:
    trace = parse_event_lines(["0,add,a", "0,add,b", "0,add,c", "10,remove,a", "10,remove,b", "10,add,d"])
    points = trace.change_points()
    assert len(points) == 2 and sorted(points[1][1]) == ["c", "d"]
    assert trace.notes.simultaneous_groups == 2  # t=0 and t=10


@pytest.mark.parametrize("lines,fragment", [
    (["0,add,a", "0,add,a"], "already present"),
    (["0,add,a", "5,remove,b"], "not present"),
    (["0,add,a", "9,remove,a", "5,add,b"], "earlier than the line before"),
])
def test_strict_mode_refuses_every_fix(lines: list[str], fragment: str) -> None:
    with pytest.raises(TraceError, match=fragment):
        parse_event_lines(lines, source="s.csv", strict=True)


@pytest.mark.parametrize("line,fragment", [
    ("10,remove", "has 2 field"),
    ("ten,remove,a", "is not a number"),
    ("-5,remove,a", ">= 0"),
    ("10,crash,a", "must be 'add' or 'remove'"),
    ("10,remove,", "empty node name"),
])
def test_bad_line_names_line_number_value_and_fix(line: str, fragment: str) -> None:
    with pytest.raises(TraceError) as info:
        parse_event_lines(["0,add,a", "", line], source="bad.csv")
    message = str(info.value)
    assert "bad.csv:3" in message and fragment in message


def test_empty_trace_and_missing_file_are_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no events"):
        parse_event_lines(["", "# nothing"])
    with pytest.raises(TraceError, match="does not exist"):
        read_trace(tmp_path / "nope.csv")


def test_availability_trace_round_trips_to_node_events(tmp_path: Path) -> None:
    path = tmp_path / "avail.csv"
    path.write_text("time_ms,live\n0,10\n1000,7\n1000,8\n2000,8\n3000,10\n4000,9\n")
    trace = read_trace(path, seed=3)
    counts = [len(live) for _, live in trace.change_points()]
    assert counts == [10, 8, 10, 9]  # the last sample at a timestamp wins; repeats are no change
    assert trace.end_ms == 4000
    again = read_trace(path, seed=3)
    assert again.events == trace.events  # seeded: reproducible
    with pytest.raises(TraceError, match="at time 0"):
        parse_availability_lines(["5,3"])


def test_availability_to_events_removes_then_readds() -> None:
    avail = AvailabilityTrace((0, 10, 20), (4, 2, 4), 30)
    trace = availability_to_events(avail, seed=1)
    assert [e.action for e in trace.events] == ["remove", "remove", "add", "add"]
    assert len(trace.initial) == 4


@pytest.mark.skipif(not TRACES.is_dir(), reason=f"shared traces not found at {TRACES} (they live beside the checkout)")
def test_real_traces_read_with_their_documented_statistics() -> None:
    p3 = read_trace(TRACES / "bamboo-ec2-p3.csv")
    assert p3.num_removals() == 167 and p3.max_live() == 32
    assert p3.notes.out_of_order == 0 and p3.notes.repeated_adds == 0 and p3.notes.repeated_removes == 0
    assert abs(p3.end_ms / 3_600_000 - 11.37) < 0.01
    synthetic = read_trace(TRACES / "oobleck-synthetic-1h.csv")
    assert len(synthetic.initial) == 30 and synthetic.num_removals() == 15
