"""A simulated timeline as typed records: which worker ran which action when, and whether it was re-routed."""

from __future__ import annotations

from dataclasses import dataclass

from recycle.ir.actions import Action, Kind
from recycle.ir.plan import Plan
from recycle.sim.simulator import SimResult

__all__ = ["TimedAction", "timed_actions"]


@dataclass(frozen=True, slots=True)
class TimedAction:
    rank: int
    replica: int
    stage: int
    iteration: int
    action: Action
    start: float
    end: float
    owner: int  # replica whose data shard the micro-batch belongs to (-1 for OPT)

    @property
    def rerouted(self) -> bool:
        """True when a peer replica runs this micro-batch because its own pipeline's worker is down."""
        return self.owner >= 0 and self.owner != self.replica

    @property
    def label(self) -> str:
        """Compact label without the stage (the row says it): "F7", "BW3", "OPT"; re-routed ones end in '*'."""
        a = self.action
        text = "OPT" if a.kind is Kind.OPT else f"{a.kind.value}{a.mb}"
        return text + ("*" if self.rerouted else "")


def timed_actions(result: SimResult, plan: Plan, iterations: set[int] | None = None) -> list[TimedAction]:
    """The recorded timeline of `result` (simulate(..., record=True)), optionally only some iterations."""
    if not result.timeline:
        raise ValueError("the simulation result has no timeline; run simulate(plan, config, record=True)")
    out = []
    parsed: dict[str, Action] = {}
    for rank, iteration, token, start, end in result.timeline:
        if iterations is not None and iteration not in iterations:
            continue
        action = parsed.get(token)
        if action is None:
            action = parsed[token] = Action.parse(token)
        replica, stage = plan.worker(rank)
        owner = plan.owner(action.mb) if action.kind is not Kind.OPT else -1
        out.append(TimedAction(rank, replica, stage, iteration, action, start, end, owner))
    return out
