"""Chrome trace-event JSON of a timed run ("X" complete events; pid = replica, tid = stage), which Perfetto opens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from recycle.fileio import atomic_write_text
from recycle.ir.plan import Plan
from recycle.report.timeline import timed_actions
from recycle.sim.simulator import SimResult

__all__ = ["chrome_trace_events", "write_chrome_trace"]


def chrome_trace_events(result: SimResult, plan: Plan, us_per_unit: float = 1.0) -> list[dict[str, Any]]:
    """Trace events: process/thread names, then one "X" event per action with times in microseconds.

    `us_per_unit` converts the config's time unit (1 for "us"; slots are written as 1 us each unless told).
    """
    events: list[dict[str, Any]] = []
    for replica in range(plan.num_replicas):
        events.append({"name": "process_name", "ph": "M", "pid": replica, "tid": 0,
                       "args": {"name": f"replica {replica}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": replica, "tid": 0,
                       "args": {"sort_index": replica}})
        for stage in range(plan.num_stages):
            down = " (down)" if (replica, stage) in plan.failed else ""
            events.append({"name": "thread_name", "ph": "M", "pid": replica, "tid": stage,
                           "args": {"name": f"stage {stage}{down}"}})
    for e in timed_actions(result, plan):
        events.append({
            "name": str(e.action),
            "cat": e.action.kind.value + (",rerouted" if e.rerouted else ""),
            "ph": "X",
            "ts": e.start * us_per_unit,
            "dur": (e.end - e.start) * us_per_unit,
            "pid": e.replica,
            "tid": e.stage,
            "args": {"iteration": e.iteration, "microbatch": e.action.mb, "owner_replica": e.owner,
                     "rerouted": e.rerouted},
        })
    return events


def write_chrome_trace(result: SimResult, plan: Plan, path: str | Path, us_per_unit: float = 1.0) -> Path:
    """Write {"traceEvents": [...]} atomically; open it at ui.perfetto.dev or chrome://tracing."""
    doc = {"traceEvents": chrome_trace_events(result, plan, us_per_unit), "displayTimeUnit": "ms",
           "otherData": {"num_replicas": plan.num_replicas, "num_stages": plan.num_stages,
                         "num_microbatches": plan.num_microbatches, "schedule": plan.meta.schedule,
                         "period": result.period, "makespan": result.makespan}}
    return atomic_write_text(path, json.dumps(doc, separators=(",", ":")))
