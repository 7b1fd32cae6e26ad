"""The plan-provider protocol between the planner and the runtime: a failure state in, a plan and its origin out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from recycle.ir.plan import Plan

__all__ = ["PlanSource", "PlanChoice", "PlanProvider"]

# "store": precomputed before the run; "heuristic": planned online when the state came; "re-partition planner": a
# plan that also moves layers between stages (planner.provider.RepartitioningProvider).
PlanSource = Literal["store", "heuristic", "re-partition planner"]


@dataclass(frozen=True)
class PlanChoice:
    """A plan for a failure state, where it came from and how long getting it took."""

    plan: Plan  # on the real ranks
    source: PlanSource
    seconds: float
    note: str = ""  # why this plan (e.g. a layer re-partition decision), printed with the recovery


class PlanProvider(Protocol):
    """Given every (replica, stage) that is down, the plan to run. The command layer builds one from the planner
    (planner.provider); the runtime only calls it, so it never imports the planner.

    A provider with a true `repeatable` attribute (planner.provider.PlanLibrary) gives the same plan for the same
    failed set whenever it is asked, and a call changes nothing: the coordinator then asks as soon as it knows the
    failed set (at the abort) and makes the plan's views while the survivors' reports come in, not after."""

    def __call__(self, failed: frozenset[tuple[int, int]], /) -> PlanChoice: ...
