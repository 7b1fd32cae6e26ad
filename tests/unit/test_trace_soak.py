"""A runtime run's recoveries -> an event trace: the job simulator replays it in the runtime's failure states."""

from __future__ import annotations

import pytest

from recycle.config import uniform_config
from recycle.traces.jobsim import rate_at, replay
from recycle.traces.mapping import map_trace_to_units
from recycle.traces.model import JobContext, JobCosts
from recycle.traces.reader import parse_event_lines
from recycle.traces.recycle_system import ReCycleSystem
from recycle.traces.soak import SoakChange, soak_trace
from recycle.traces.throughput import ThroughputModel

D, S = 3, 2


def _replayed_keys(trace, changes):
    """The key ReCycle is in just after each change, read back from its replay (each key has its own period)."""
    config = uniform_config(D, S, 2)
    period = {}

    def period_fn(key):  # a distinct period per key, so the rate names the key
        return period.setdefault(tuple(key), 10.0 + len(period))

    model = ThroughputModel(config, period_fn, 1.0)
    ctx = JobContext(config, model.fault_free(), 1.0, JobCosts(detect_s=0, plan_switch_s=0, restart_s=0,
                                                                reshape=False))
    timeline = map_trace_to_units(parse_event_lines(trace.lines))
    run = replay(ReCycleSystem(ctx, model), timeline, ctx.fault_free_rate)
    by_rate = {model.throughput_for_key(k): k for k in period}
    keys = []
    for t in trace.times_s:
        rate = rate_at(run.steady, t + 0.0015)  # past a restore's 1 ms join
        keys.append(by_rate.get(rate) if rate > 0 else None)
    return keys


@pytest.mark.timeout(10)
def test_kills_and_rejoins_follow_the_runtime_workers() -> None:
    changes = [
        SoakChange(1.0, ((1, 0),), (), ((1, 0),)),
        SoakChange(2.0, ((0, 1),), (), ((0, 1), (1, 0))),
        SoakChange(3.0, ((2, 1),), ((0, 1),), ((1, 0), (2, 1))),  # a death and a join in one recovery
        SoakChange(4.0, (), ((1, 0), (2, 1)), ()),
    ]
    trace = soak_trace(changes, D, S, end_s=5.0)
    assert trace.lines[1:7] == tuple(f"0,add,n{r}" for r in range(6))
    assert "1000,remove,n2" in trace.lines and "2000,remove,n1" in trace.lines
    assert trace.runtime_keys == ((0, 0), (1, 0), (1, 1), (1, 1), (0, 0))
    assert trace.sim_keys == trace.runtime_keys and trace.mismatched == 0
    assert _replayed_keys(trace, changes) == list(trace.sim_keys)
    assert trace.lines[-1] == "5000,add,end-marker"


@pytest.mark.timeout(10)
def test_a_lost_stage_restores_before_its_replacement_joins() -> None:
    changes = [
        SoakChange(1.0, ((0, 1),), (), ((0, 1),)),
        # every stage-0 replica dies; one replacement comes back in the same recovery (the runtime restores)
        SoakChange(2.0, ((0, 0), (1, 0), (2, 0)), ((0, 0),), ((0, 1), (1, 0), (2, 0))),
        SoakChange(3.0, (), ((0, 1), (1, 0), (2, 0)), ()),
    ]
    trace = soak_trace(changes, D, S, end_s=4.0)
    assert trace.restores == 1
    assert "2001,add,n0.1" in trace.lines  # the join follows the deaths by 1 ms
    assert trace.runtime_keys[2] == (2, 1)
    assert _replayed_keys(trace, changes) == list(trace.sim_keys)
    assert trace.sim_keys[-1] == (0, 0)


@pytest.mark.timeout(10)
def test_a_rejoin_into_a_less_depleted_stage_is_reported() -> None:
    # Both stages miss one replica; the runtime brings back stage 1's, the simulator fills stage 0 first.
    changes = [
        SoakChange(1.0, ((0, 0),), (), ((0, 0),)),
        SoakChange(2.0, ((1, 1),), (), ((0, 0), (1, 1))),
        SoakChange(3.0, (), ((1, 1),), ((0, 0),)),
        SoakChange(4.0, ((2, 1),), (), ((0, 0), (2, 1))),
    ]
    trace = soak_trace(changes, D, S, end_s=5.0)
    assert trace.runtime_keys[3] == (1, 0) and trace.sim_keys[3] == (0, 1)
    assert trace.mismatched >= 1 and any("simulator key (0, 1)" in n for n in trace.notes)
    assert _replayed_keys(trace, changes) == list(trace.sim_keys)


def test_a_trace_needs_a_duration() -> None:
    with pytest.raises(ValueError, match="end_s = 0"):
        soak_trace([], D, S, end_s=0)
