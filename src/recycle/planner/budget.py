"""Work budget of the planner's local search: evaluated actions counted, never seconds, so plans do not depend on load."""

from __future__ import annotations

__all__ = ["WorkBudget", "search_work", "SEARCH_EVALUATIONS", "SEARCH_WORK_FLOOR", "SEARCH_WORK_CAP",
           "LIST_SCHEDULE_COST"]

# The search of a plan may make SEARCH_EVALUATIONS whole-schedule evaluations, so its budget in evaluated actions
# grows with the plan (a bigger plan has more actions to move), between a floor (tiny plans: many cheap moves; a
# floor of 30,000 left two more misses of 4-6 % on the quality screen) and a cap that keeps the search of a
# 500-action plan near 0.1 s on one core (benchmarks/bench_planner_speed.py, "small plans"; docs/planner.md).
SEARCH_EVALUATIONS = 160
SEARCH_WORK_FLOOR = 60_000
SEARCH_WORK_CAP = 80_000
# A list schedule costs about twice the as-soon-as-possible timing of fixed orders per action (its event loop keeps
# ready heaps; measured 2.6 against 1.4 us per action at 480 actions), so one of its actions counts double.
LIST_SCHEDULE_COST = 2


def search_work(actions: int) -> int:
    """The budget, in evaluated actions, of the search of a plan with `actions` actions per iteration."""
    return min(max(SEARCH_EVALUATIONS * actions, SEARCH_WORK_FLOOR), SEARCH_WORK_CAP)


class WorkBudget:
    """Evaluated actions a search may still spend; a move is tried only when the budget can pay for it."""

    def __init__(self, units: int) -> None:
        self.left = max(0, int(units))
        self.spent = 0

    def afford(self, cost: int) -> bool:
        """Spend `cost` units and return True, or spend nothing and return False when fewer are left."""
        if cost > self.left:
            return False
        self.left -= cost
        self.spent += cost
        return True

    def share(self, fraction: float) -> "WorkBudget":
        """A budget of `fraction` of what is left, taken from this one (the rest stays here for later steps)."""
        part = int(self.left * fraction)
        self.left -= part
        self.spent += part
        return WorkBudget(part)

    def give_back(self, other: "WorkBudget") -> None:
        """Return what a share left unspent (a step that stopped early at the lower bound or ran out of moves)."""
        self.left += other.left
        self.spent -= other.left
        other.left = 0
