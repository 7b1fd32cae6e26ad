"""Export a plan to the compute-only CSV that torch.distributed.pipelining's `_PipelineScheduleRuntime._load_csv`
reads: one row per pipeline rank (= stage here), cells like `0F3`, `1I3` (input-gradient), `1W3`, `2B0` (fused)."""

from __future__ import annotations

import csv
import io

from recycle.errors import PlanError
from recycle.ir.actions import Kind
from recycle.ir.plan import Plan

__all__ = ["pipelining_order", "to_pipelining_csv"]

# Our kinds -> pipelining's computation types. OPT has no counterpart: pipelining steps the optimizer outside the
# schedule (the caller's optimizer.step() after schedule.step()), so it is left out.
_CELL = {Kind.F: "F", Kind.B: "I", Kind.W: "W", Kind.BW: "B"}


def pipelining_order(plan: Plan, replica: int = 0) -> list[list[str]]:
    """Replica `replica`'s pipeline as pipelining's per-rank action lists (rank s runs stage s), micro-batches
    numbered 0..M-1 within the pipeline. A pipeline whose micro-batches are re-routed to other pipelines' workers (or
    whose workers run other pipelines' micro-batches) cannot be written: pipelining schedules one pipeline's own
    micro-batches on its own ranks, so cross-pipeline re-routing has no form there."""
    if not 0 <= replica < plan.num_replicas:
        raise PlanError(f"replica {replica} is outside the plan's {plan.num_replicas} pipelines (0.."
                        f"{plan.num_replicas - 1}); pass --replica R with R in that range")
    M = plan.num_microbatches
    rows: list[list[str]] = []
    for stage in range(plan.num_stages):
        if (replica, stage) in plan.failed:
            raise PlanError(f"worker {replica}:{stage} is down in this plan: pipeline {replica} has no rank for stage "
                            f"{stage}, and its micro-batches run on other pipelines' workers (cross-pipeline "
                            "re-routing), which torch.distributed.pipelining's schedule format cannot express; "
                            "export a pipeline whose workers are all up, or a fault-free plan")
        moved = [mb - replica * M for mb in range(replica * M, (replica + 1) * M) if plan.host[stage][mb] != replica]
        if moved:
            raise PlanError(f"pipeline {replica}'s micro-batches {moved} run on other pipelines' stage-{stage} workers "
                            "(cross-pipeline re-routing), which torch.distributed.pipelining's schedule format "
                            "cannot express; export a pipeline the failures do not touch, or a fault-free plan")
        row = []
        for action in plan.worker_actions(replica, stage):
            if action.kind is Kind.OPT:
                continue
            if plan.owner(action.mb) != replica:
                raise PlanError(f"worker {replica}:{stage} also runs micro-batch {action.mb} of pipeline "
                                f"{plan.owner(action.mb)} (cross-pipeline re-routing), which "
                                "torch.distributed.pipelining's schedule format cannot express; export a pipeline "
                                "the failures do not touch, or a fault-free plan")
            row.append(f"{stage}{_CELL[action.kind]}{action.mb - replica * M}")
        rows.append(row)
    return rows


def to_pipelining_csv(plan: Plan, replica: int = 0) -> str:
    """`pipelining_order` as CSV text (no header; one line per rank)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in pipelining_order(plan, replica):
        writer.writerow(row)
    return out.getvalue()
