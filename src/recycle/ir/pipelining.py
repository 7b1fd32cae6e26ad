"""Export a plan as torch.distributed.pipelining's compute-only schedule CSV (what `_PipelineScheduleRuntime._load_csv`
reads): one row per pipeline rank, one action per cell, `{stage}{F|I|W|B}{microbatch}`.

The format describes ONE pipeline (rank = stage here) over its own micro-batches 0..M-1; data parallelism lives
outside it. So a plan is exported per replica: replica r's row for stage s is worker (r, s)'s compute actions with
the micro-batches renumbered to r's local 0..M-1. A chunked plan's cells name chunks (torch's virtual stage
indices, e.g. rank 0 of a V-shape plan runs stages 0 and 2S-1); torch infers which rank holds which stage from the
rows, and its stages must be built with num_stages = S x chunks_per_worker. Our kinds map as F -> F, B (input-gradient) -> I, W -> W, fused BW
-> B. What the format cannot express, and the export therefore refuses or leaves out:
  * cross-pipeline re-routing: a replica with a failed worker, or one whose workers run another pipeline's
    micro-batches (or whose micro-batches run elsewhere), has no row set that torch's runtime could execute;
  * the optimizer: OPT (the stage's all-reduce and step, staggered or not) is dropped -- torch's runtime reduces
    gradients itself and the optimizer steps after `schedule.step()`.
"""

from __future__ import annotations

from recycle.errors import PlanError
from recycle.ir.actions import Kind
from recycle.ir.plan import Plan

__all__ = ["PIPELINING_KIND", "replica_problem", "expressible_replicas", "pipelining_rows", "pipelining_csv"]

PIPELINING_KIND = {Kind.F: "F", Kind.B: "I", Kind.W: "W", Kind.BW: "B"}


def replica_problem(plan: Plan, replica: int) -> str:
    """Why replica `replica`'s pipeline cannot be written in the format ("" when it can)."""
    if not 0 <= replica < plan.num_replicas:
        return f"replica {replica} is outside 0..{plan.num_replicas - 1}"
    down = sorted(s for p, s in plan.failed if p == replica)
    if down:
        return f"worker(s) {', '.join(f'{replica}:{s}' for s in down)} of replica {replica} are down"
    if plan.pieces:
        return "the plan splits micro-batches into pieces, which the format's whole micro-batches cannot express"
    M = plan.num_microbatches
    for s, row in enumerate(plan.host):  # one row per stage (per chunk when chunked)
        for mb, host in enumerate(row):
            if (host == replica) != (mb // M == replica):
                moved, where = (mb, host) if mb // M == replica else (mb, replica)
                return (f"micro-batch {moved} of replica {mb // M} runs stage {s} on replica {where} "
                        "(cross-pipeline re-routing)")
    return ""


def expressible_replicas(plan: Plan) -> list[int]:
    return [r for r in range(plan.num_replicas) if not replica_problem(plan, r)]


def pipelining_rows(plan: Plan, replica: int = 0) -> list[list[str]]:
    """Replica `replica`'s pipeline as rows of action strings (row s = stage s = pipeline rank s)."""
    problem = replica_problem(plan, replica)
    if problem:
        others = expressible_replicas(plan)
        hint = (f"export a replica that keeps to its own pipeline: --replica {others[0]} (of {others})" if others else
                "no replica of this plan keeps to its own pipeline")
        raise PlanError(f"torch.distributed.pipelining's CSV describes one pipeline over its own micro-batches and "
                        f"cannot express replica {replica}'s part of this plan: {problem}; {hint}. The recycle runtime "
                        "(recycle train --plan) runs the whole plan")
    base = replica * plan.num_microbatches
    return [[f"{a.stage}{PIPELINING_KIND[a.kind]}{a.mb - base}" for a in plan.worker_actions(replica, s)
             if a.kind is not Kind.OPT]
            for s in range(plan.num_stages)]


def pipelining_csv(plan: Plan, replica: int = 0) -> str:
    """The CSV text (no header, no quoting needed: cells are [0-9A-Z] only)."""
    return "".join(",".join(row) + "\n" for row in pipelining_rows(plan, replica))
