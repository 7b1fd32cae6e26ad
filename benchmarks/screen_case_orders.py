"""One case of the F != B != W quality screen: the heuristic's and CP-SAT's orders side by side, CP-SAT on the
heuristic's own routing, and a beam search over the critical path's N5 moves from each routing's rule schedules.

Run: nice -n 10 .venv/bin/python benchmarks/screen_case_orders.py --seed 1 --case 283 [--time-limit 30]
     [--beam-width 20 --beam-depth 14] [--timeline]

docs/planner.md, "Why case 283 stays at 80", comes from this script: the busiest stage-0 workers' timelines, CP-SAT's
optimum on the key and on the heuristic's routing (host literals fixed, the owner symmetry breaking off: a fixed
routing may contradict it), and whether moves of one worker's order at a time (the order search's critical-path
moves, every worker at the maximum, ranked by period, workers at the maximum, stage spans) reach the optimum.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from bench_planner_quality import draw_cases

from recycle.config import Config
from recycle.ir.plan import Plan
from recycle.planner import exact_model, heuristic
from recycle.planner import local_search as ls
from recycle.planner.exact import schedule_exact
from recycle.planner.failures import normalize
from recycle.planner.memory_cap import memory_cap
from recycle.planner.options import PlannerOptions
from recycle.sim.simulator import simulate

Orders = list[list[tuple[int, int]]]


def timeline(plan: Plan, config: Config, stages: int) -> None:
    """Each worker of the first `stages` stages: its end and its actions with their start in a steady iteration."""
    result = simulate(plan, config, record=True)
    iteration = result.num_iterations - 2
    rows: dict[int, list[tuple[float, str]]] = {}
    for rank, it, token, start, _ in result.timeline:
        if it == iteration and "OPT" not in token:
            rows.setdefault(rank, []).append((start, token))
    t0 = min(start for row in rows.values() for start, _ in row)
    S = config.num_stages
    for rank in sorted(rows, key=lambda r: (r % S, r // S)):
        if rank % S < stages:
            row = sorted(rows[rank])
            print(f"  {rank // S}:{rank % S} " + " ".join(f"{token[1:]}@{start - t0:g}" for start, token in row))


def fixed_routing_exact(config: Config, key: tuple[int, ...], options: PlannerOptions, host: Sequence[Sequence[int]],
                        time_limit: float) -> Plan:
    """schedule_exact with every re-routed (stage, mb)'s host literal fixed to `host` and no symmetry breaking."""
    build, breaking = exact_model.PeriodModel._build, exact_model.PeriodModel._symmetry_breaking

    def fixed_build(self: exact_model.PeriodModel) -> None:
        build(self)
        for (s, mb), literals in self.present.items():
            for replica, literal in literals.items():
                self.model.add(literal == int(host[s][mb] == replica))

    exact_model.PeriodModel._build = fixed_build  # type: ignore[method-assign]
    exact_model.PeriodModel._symmetry_breaking = lambda self: None  # type: ignore[method-assign]
    try:
        return schedule_exact(config, key, options, time_limit_s=time_limit)
    finally:
        exact_model.PeriodModel._build, exact_model.PeriodModel._symmetry_breaking = build, breaking


def _moves(evaluator: ls.OrderEvaluator, timed: Sequence[Sequence[tuple[int, int, float, float]]]
           ) -> list[tuple[int, int, int]]:
    """N5 moves of the critical paths of every worker that ends at the maximum."""
    top = max(row[-1][3] for row in timed if row)
    moves = set()
    for rank, row in enumerate(timed):
        if row and abs(row[-1][3] - top) < 1e-9:
            for r, lo, hi in evaluator.critical_blocks(timed, rank):
                moves.update(((r, lo, lo + 1), (r, hi, hi - 1)))
    return sorted(moves)


def _moved(orders: Orders, move: tuple[int, int, int]) -> Orders | None:
    rank, i, j = move
    row = orders[rank]
    item = row[i]
    if any(other[1] == item[1] for other in row[min(i, j):max(i, j) + 1] if other is not item):
        return None  # would cross its own partner
    new = [list(r) for r in orders]
    new[rank] = row[:i] + row[i + 1:]
    new[rank].insert(j, item)
    return new


def beam(evaluator: ls.OrderEvaluator, orders: Orders, width: int, depth: int, target: float) -> tuple[float, int]:
    """(best period, moves) of a beam search over `_moves`, ranked by (period, workers at the max, stage spans)."""
    level: list[tuple[tuple, Orders]] = [((), orders)]
    seen: set[int] = set()
    best = (evaluator.score(evaluator.time(orders))[0], 0)
    for step in range(1, depth + 1):
        found: list[tuple[tuple, Orders]] = []
        for _, current in level:
            timed = evaluator.time(current)
            assert timed is not None
            for move in _moves(evaluator, timed):
                new = _moved(current, move)
                signature = hash(tuple(map(tuple, new))) if new is not None else None
                if new is None or signature in seen:
                    continue
                seen.add(signature)
                result = evaluator.time(new)
                if result is None:
                    continue
                period, spans = evaluator.score(result)
                top = max(row[-1][3] for row in result if row)
                at_max = sum(1 for row in result if row and abs(row[-1][3] - top) < 1e-9)
                found.append(((period, at_max, spans), new))
        found.sort(key=lambda f: f[0])
        level = found[:width]
        if level and level[0][0][0] < best[0]:
            best = (level[0][0][0], step)
        if not level or best[0] <= target + 1e-9:
            break
    return best


def rule_beams(config: Config, key: tuple[int, ...], options: PlannerOptions, host: Sequence[Sequence[int]],
               label: str, width: int, depth: int, target: float) -> None:
    """Every rule's list schedule on `host`, then the beam from the three best."""
    evaluator = ls.OrderEvaluator(config, key, host, options.decoupled, options.staggered,
                                  memory_cap(config, options), heuristic._opt_durations(config, key))
    rules = [*heuristic.VARIANTS, *heuristic.WAITING_VARIANTS, *heuristic.FIRST_STAGE_VARIANTS]
    scheduled = sorted(((heuristic.list_schedule(config, key, host, options.decoupled, options.staggered,
                                                 memory_cap(config, options), rule), rule.name)
                        for rule in rules), key=lambda t: (t[0].estimate, t[1]))
    for timed, name in scheduled[:3]:
        orders = [[(code, mb) for code, mb, _, _ in row] for row in timed.entries]
        period, moves = beam(evaluator, orders, width, depth, target)
        print(f"{label}: rule {name} {timed.estimate:g} -> beam {period:g} after {moves} moves")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--case", type=int, default=283)
    parser.add_argument("--time-limit", type=float, default=30.0, help="CP-SAT seconds (each of two solves)")
    parser.add_argument("--beam-width", type=int, default=20)
    parser.add_argument("--beam-depth", type=int, default=14)
    parser.add_argument("--timeline", action="store_true", help="print the orders of all stages but the last")
    args = parser.parse_args(argv)
    case = draw_cases(args.case + 1, args.seed, "distinct")[args.case]
    config, options = case.config(), case.options
    key = normalize(case.failed, case.D, case.S).key
    print(f"case {args.case} (seed {args.seed}): {case.describe()}; key {key}")
    began = time.perf_counter()
    planned = heuristic.schedule_heuristic(config, key, options)
    print(f"heuristic {planned.meta.predicted_period:g} ({planned.meta.notes}; {time.perf_counter() - began:.2f} s)")
    began = time.perf_counter()
    optimum = schedule_exact(config, key, options, time_limit_s=args.time_limit, hint=planned)
    print(f"CP-SAT on the key: {optimum.meta.predicted_period:g} {optimum.meta.status} "
          f"({time.perf_counter() - began:.1f} s)")
    began = time.perf_counter()
    fixed = fixed_routing_exact(config, key, options, planned.host, args.time_limit)
    print(f"CP-SAT on the heuristic's routing: {fixed.meta.predicted_period:g} {fixed.meta.status} "
          f"({time.perf_counter() - began:.1f} s)")
    if args.timeline:
        for label, plan in (("heuristic", planned), ("CP-SAT, heuristic's routing", fixed), ("CP-SAT", optimum)):
            print(f"{label}:")
            timeline(plan, config, config.num_stages - 1)
    target = min(optimum.meta.predicted_period or 0.0, fixed.meta.predicted_period or 0.0)
    for label, host in (("heuristic's routing", planned.host), ("CP-SAT's routing", optimum.host)):
        rule_beams(config, key, options, host, label, args.beam_width, args.beam_depth, target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
