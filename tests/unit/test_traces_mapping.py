"""Nodes -> worker units (GPUs per node vs per worker) and the D x S layout with spares and re-joins."""

from __future__ import annotations

import pytest

from recycle.errors import TraceError
from recycle.traces.mapping import StageLayout, map_trace_to_units
from recycle.traces.reader import parse_event_lines

LINES = ["0,add,a", "0,add,b", "0,add,c", "0,add,d", "1000,remove,b", "2000,add,e"]


def test_one_gpu_nodes_are_one_unit_each() -> None:
    tl = map_trace_to_units(parse_event_lines(LINES))
    assert [len(s) for s in tl.live] == [4, 3, 4]
    assert tl.times_s == (0.0, 1.0, 2.0)
    assert tl.live[1] == {0, 2, 3} and tl.live[2] == {0, 1, 2, 3}  # e takes b's free position later


def test_node_with_several_workers_loses_all_of_them() -> None:
    tl = map_trace_to_units(parse_event_lines(LINES), gpus_per_node=8, gpus_per_worker=4)
    assert [len(s) for s in tl.live] == [8, 6, 8]


def test_worker_spanning_nodes_dies_with_any_of_them() -> None:
    tl = map_trace_to_units(parse_event_lines(LINES), gpus_per_node=4, gpus_per_worker=8)
    assert [sorted(s) for s in tl.live] == [[0, 1], [1], [0, 1]]


def test_replacement_at_the_same_instant_is_not_hidden() -> None:
    tl = map_trace_to_units(parse_event_lines(["0,add,a", "0,add,b", "50,remove,a", "50,add,c"]))
    assert tl.live[0] == {0, 1} and tl.live[1] == {1, 2}  # unit 0 lost, a new unit joined


def test_incompatible_gpu_counts_are_refused() -> None:
    with pytest.raises(TraceError, match="multiple"):
        map_trace_to_units(parse_event_lines(LINES), gpus_per_node=6, gpus_per_worker=4)


def test_layout_refills_the_most_depleted_stage_with_a_transfer_delay() -> None:
    layout = StageLayout(3, 2)
    layout.place_all(range(8))
    assert len(layout.slot) == 6 and layout.spares == [6, 7]
    layout.remove(layout.slot[(0, 1)])
    layout.remove(layout.slot[(1, 1)])
    layout.remove(layout.slot[(2, 0)])
    assert layout.failed_workers(0.0) == {(0, 1), (1, 1), (2, 0)}
    filled = layout.fill_from_spares(10.0, lambda stage: 5.0)
    # stage 1 had one replica left, so it is refilled first; then both stages hold two and stage 0 wins the tie
    assert filled == [(0, 1), (2, 0)]
    assert layout.failed_workers(12.0) == {(0, 1), (1, 1), (2, 0)}  # still copying state
    assert layout.failed_workers(15.0) == {(1, 1)}
    assert layout.next_ready(12.0) == 15.0
