"""Whether a tensor-parallel worker's T ranks stopped at the same point of an interrupted iteration: every rank but 0
posts where it stopped, and rank 0 compares the points with its own before it writes the worker's stop report.

Why: with `--redo lost` the survivors keep the work they did and run only a completion of the iteration
(ir.completion), planned from each worker's one stop report. The T ranks of a worker run the same actions, but they
meet only inside the TP collectives of a forward or backward, so one rank may have finished an action (its send, a
W with no TP collective, a step) that another had not when the generation was cut. Kept work is exact only when
every rank of every surviving worker holds the same actions done; otherwise the report says how they differ, and the
coordinator redoes the whole iteration (each rank rolls back on its own, which needs no agreement).
"""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from recycle.runtime.protocol.records import StoppedReport

__all__ = ["StopPoint", "stop_key", "post_stop_point", "tp_split"]


@dataclass(frozen=True)
class StopPoint:
    """Where one rank stopped: what a completion keeps of its work."""

    applied: int  # the last iteration whose optimizer step it applied
    iteration: int  # the iteration it was running
    finished: int  # actions of `iteration` it had finished (0 once the iteration was finished)
    weighed: bool  # its unfinished action is a BW whose weight-gradient it had accumulated
    reducing: bool  # it stopped inside its OPT after the stage all-reduce
    completing: bool  # it was running a completion's steps, not the plan's actions

    @classmethod
    def of(cls, report: StoppedReport) -> StopPoint:
        return cls(report.applied, report.iteration, report.current_actions, report.weighed_current,
                   report.reducing, report.completing)

    def describe(self) -> str:
        flags = [name for name, on in (("weighed", self.weighed), ("reducing", self.reducing),
                                       ("completing", self.completing)) if on]
        return (f"iteration {self.iteration} after {self.finished} action(s) (applied {self.applied}"
                + "".join(f", {flag}" for flag in flags) + ")")


def stop_key(generation: int, rank: int, tp_rank: int) -> str:
    """The store key where TP rank `tp_rank` (> 0) of worker `rank` posts where it left generation `generation`."""
    return f"tp_stop/{generation}/{rank}/{tp_rank}"


def post_stop_point(store: Any, generation: int, rank: int, tp_rank: int, point: StopPoint) -> None:
    store.set(stop_key(generation, rank, tp_rank), json.dumps(asdict(point)))


def _read(raw: bytes) -> StopPoint | None:
    try:
        return StopPoint(**json.loads(raw))
    except (ValueError, TypeError):
        return None


def tp_split(store: Any, generation: int, rank: int, degree: int, own: StopPoint, timeout_s: float) -> str:
    """TP rank 0 of worker `rank`: "" when each of its other ranks posted the stop point `own` (its own), else how
    they differ (the coordinator then redoes the whole iteration and says why). A rank that posts nothing within
    `timeout_s` counts as differing. The keys read are removed."""
    deadline = time.monotonic() + timeout_s
    split = ""
    for t in range(1, degree):
        key = stop_key(generation, rank, t)
        try:
            store.wait([key], datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except dist.DistStoreError:
            return split or f"TP rank {t} posted no stop point within {timeout_s:g} s"
        other = _read(store.get(key))
        store.delete_key(key)
        if other != own and not split:
            split = f"TP rank {t} stopped in {other.describe() if other else 'an unreadable state'}, TP rank 0 in " \
                    f"{own.describe()}"
    return split
