"""Nodes -> worker units (GPUs per node vs per worker) and the D x S layout with spares and re-joins."""

from __future__ import annotations

import pytest

from recycle.errors import TraceError
from recycle.traces.mapping import map_trace_to_units
from recycle.traces.model import StageLayout
from recycle.traces.placement import availability_to_events
from recycle.traces.reader import parse_event_lines
from recycle.traces.trace import AvailabilityTrace, WorkerGrid

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


# -- availability counts -> failing workers: the placement policies act on the grid ReCycle replays ----------------

def _stage_counts_over_replay(trace, config, gpus_per_node: int = 1) -> list[tuple[int, list[int]]]:
    """(live units, occupied slots per stage) after every change, as ReCycle's own layout has them."""
    from recycle.traces.model import JobContext, JobCosts
    from recycle.traces.recycle_system import ReCycleSystem
    from recycle.traces.throughput import ThroughputModel

    timeline = map_trace_to_units(trace, gpus_per_node, config.topology.gpus_per_worker)
    model = ThroughputModel(config, lambda key: 10.0 + sum(key), 1.0, "fake")
    system = ReCycleSystem(JobContext(config, model.fault_free(), 1.0, JobCosts()), model)

    def counts() -> list[int]:
        return [sum(1 for (_, s) in system.layout.slot if s == st) for st in range(config.num_stages)]

    system.start(0.0, timeline.live[0])
    out = [(len(timeline.live[0]), counts())]
    for i in range(1, len(timeline.times_s)):
        prev, live = timeline.live[i - 1], timeline.live[i]
        system.on_change(timeline.times_s[i], live, prev - live, live - prev)
        out.append((len(live), counts()))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_spread_placement_keeps_recycles_stages_balanced(seed: int) -> None:
    from recycle.config import uniform_config
    from recycle.traces.generate import paper_gcp_shape

    trace = paper_gcp_shape(seed=seed, placement="spread")
    assert trace.placement.startswith("spread") and trace.placement_grid == WorkerGrid(4, 6)
    history = _stage_counts_over_replay(trace, uniform_config(6, 4, 8))
    for live, counts in history:
        assert sum(counts) == live and max(counts) - min(counts) <= 1, (live, counts)
    assert sorted(dict(history)[15]) == [3, 4, 4, 4]  # at the dip: k_s = 3 in one stage, 2 in the others


def test_worst_placement_concentrates_on_one_stage_but_never_empties_it() -> None:
    from recycle.config import uniform_config
    from recycle.traces.generate import paper_gcp_shape

    history = _stage_counts_over_replay(paper_gcp_shape(seed=0, placement="worst"), uniform_config(6, 4, 8))
    assert all(min(counts) >= 1 for _, counts in history)
    assert sorted(dict(history)[15]) == [1, 2, 6, 6]  # 9 down: 5 of one stage, 4 of a second one
    first_21 = next(counts for live, counts in history if live == 21)
    assert sorted(first_21) == [3, 6, 6, 6]  # the first three losses all hit one stage


def test_spread_removes_spares_first_and_balances_multi_worker_nodes() -> None:
    from recycle.config import uniform_config
    # 10 one-GPU nodes on a 2 x 4 grid: 2 spares, which go before any working worker.
    trace = availability_to_events(AvailabilityTrace((0, 10, 20), (10, 8, 7), 30), placement="spread",
                                   grid=WorkerGrid(num_stages=4, num_replicas=2))
    history = _stage_counts_over_replay(trace, uniform_config(2, 4, 2))
    assert [c for _, c in history][:2] == [[2, 2, 2, 2], [2, 2, 2, 2]] and sum(history[2][1]) == 7
    # 2-GPU nodes holding two 1-GPU workers each (stages 0+1 or 2+3 of one replica): the second loss must take the
    # other pair of stages, or two stages would be left with no replica.
    grid = WorkerGrid(num_stages=4, num_replicas=2, gpus_per_node=2)
    for seed in range(4):
        trace = availability_to_events(AvailabilityTrace((0, 10, 20), (4, 3, 2), 30), seed=seed,
                                       placement="spread", grid=grid)
        assert _stage_counts_over_replay(trace, uniform_config(2, 4, 2), gpus_per_node=2)[-1] == (4, [1, 1, 1, 1])


def test_placement_acts_on_workers_that_span_nodes() -> None:
    # 2-GPU workers on 1-GPU nodes: 8 nodes = 4 workers (D=2, S=2). After one node is lost its partner holds no
    # worker, so spread takes the partner next (no further worker lost: no change at all for the job); worst takes
    # a live worker's node.
    avail = AvailabilityTrace((0, 10, 20), (8, 7, 6), 30)
    for placement, workers in (("spread", [4, 3]), ("worst", [4, 3, 2])):
        grid = WorkerGrid(num_stages=2, num_replicas=2, gpus_per_worker=2)
        trace = availability_to_events(avail, placement=placement, grid=grid)
        assert [len(s) for s in map_trace_to_units(trace, 1, 2).live] == workers


def test_placement_errors() -> None:
    avail = AvailabilityTrace((0, 10), (4, 3), 20)
    with pytest.raises(TraceError, match="unknown"):
        availability_to_events(avail, placement="clustered", grid=WorkerGrid(4, 1))
    with pytest.raises(TraceError, match="grid"):
        availability_to_events(avail, placement="spread")
    with pytest.raises(TraceError, match="no worker"):
        availability_to_events(avail, placement="spread", grid=WorkerGrid(num_stages=8))
