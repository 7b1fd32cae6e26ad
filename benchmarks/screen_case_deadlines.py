"""Cases of the F != B != W quality screen: what the deadline list schedules (`recycle.planner.deadline`) reach on
each routing and search seed, and at what cost.

Run: nice -n 10 .venv/bin/python benchmarks/screen_case_deadlines.py --seed 1 --case 283 [--evaluations 200]
     [--seeds 10]

make_plan runs as usual (its period and CPU time are printed); then, per routing (the canonical layout's heuristic
routing and `routing_candidates`' for a nested set, `failed_routing`'s otherwise), `improve_sequences` with a budget
of `--evaluations` schedules and search seeds 0..`--seeds`-1 (make_plan uses seed 0 on its third order start, with
that start's share of the work budget): the best period, how many schedules it took to reach the lower bound, and
the CPU time per schedule. docs/planner.md, "Deadline list schedules (case 283 within 2 %; issue 26 item 2)".
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from bench_planner_quality import Case, draw_cases

from recycle.config import Config
from recycle.planner.api import clear_cache, make_plan
from recycle.planner.bounds import period_lower_bound
from recycle.planner.budget import LIST_SCHEDULE_COST, WorkBudget
from recycle.planner.deadline import improve_sequences
from recycle.planner.failures import normalize
from recycle.planner.heuristic import _opt_durations, schedule_heuristic
from recycle.planner.local_search import OrderEvaluator
from recycle.planner.memory_cap import memory_cap
from recycle.planner.routing import failed_routing, routing_candidates

Host = Sequence[Sequence[int]]


def routings(case: Case, config: Config, key: tuple[int, ...]) -> list[tuple[str, Host]]:
    """(label, routing): the heuristic's own first, then the candidates the rules start from (distinct)."""
    if normalize(case.failed, case.D, case.S).symmetric:
        labelled = [("schedule_heuristic's routing", schedule_heuristic(config, key, case.options).host),
                    *((f"routing candidate {n}", host) for n, host in enumerate(routing_candidates(config, key)))]
    else:
        failed = frozenset(case.failed)
        labelled = [("failed_routing", failed_routing(config, failed)),
                    ("failed_routing, slot-major", failed_routing(config, failed, slot_major=True))]
    found: list[tuple[str, Host]] = []
    for label, host in labelled:
        if all(tuple(map(tuple, host)) != tuple(map(tuple, other)) for _, other in found):
            found.append((label, host))
    return found


def study(case: Case, number: int, evaluations: int, seeds: int) -> None:
    config, options = case.config(), case.options
    key = normalize(case.failed, case.D, case.S).key
    caps = memory_cap(config, options)
    bound = period_lower_bound(config, key, options)
    clear_cache()
    began = time.process_time()
    plan = make_plan(config, case.failed, options)
    print(f"case {number}: {case.describe()}; key {key}; bound {bound:g}; make_plan {plan.meta.predicted_period:g} "
          f"({time.process_time() - began:.2f} s CPU; {plan.meta.notes})")
    actions = (3 if options.decoupled else 2) * case.D * case.M * case.S
    cost = (LIST_SCHEDULE_COST + 1) * actions  # what improve_sequences pays per schedule
    for label, host in routings(case, config, key):
        evaluator = OrderEvaluator(config, key, host, options.decoupled, options.staggered, caps,
                                   _opt_durations(config, key))
        periods, reached = [], []
        began = time.process_time()
        spent = 0
        for seed in range(seeds):
            budget = WorkBudget(evaluations * cost)
            result = improve_sequences(evaluator, host, case.M, bound, budget, seed=seed)
            assert result is not None
            spent += budget.spent
            periods.append(result[1][0])
            if result[1][0] <= bound + 1e-9:
                reached.append(budget.spent // cost)
        per_schedule = (time.process_time() - began) / max(1, spent // cost)
        print(f"  {label}: per seed {' '.join(f'{p:g}' for p in periods)}; at the bound in {len(reached)} of "
              f"{seeds} seeds after {reached} schedules; {1000 * per_schedule:.2f} ms CPU per schedule")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1, help="screen seed (default 1)")
    parser.add_argument("--case", default="283", help="comma-separated case indices (default 283)")
    parser.add_argument("--evaluations", type=int, default=200, help="schedules per search (default 200)")
    parser.add_argument("--seeds", type=int, default=10, help="search seeds per routing (default 10)")
    args = parser.parse_args(argv)
    numbers = [int(n) for n in args.case.split(",")]
    cases = draw_cases(max(numbers) + 1, args.seed, "distinct")
    for number in numbers:
        study(cases[number], number, args.evaluations, args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
