"""One case of the F != B != W quality screen: whether moves that shift a micro-batch on every stage at once reach
CP-SAT's optimum from the order search's own starting schedules.

Run: nice -n 10 .venv/bin/python benchmarks/screen_case_chain_moves.py --seed 1 --case 283 [--evaluations 4000]

Exploratory (docs/planner.md, "Chain moves tried on case 283"); nothing here is used by the planner. make_plan runs
as usual; its order searches' starting points (routing and timed orders) are recorded, and from each the script
tries, with the order search's own evaluator (`local_search.OrderEvaluator`):

1. conflict chains, steepest descent: for a micro-batch and a kind (F or B), swap that action with the one before it
   on every worker the micro-batch visits where it waited for that worker (started the instant the one before
   ended); every (micro-batch, kind) is timed per step and the best taken while it does not worsen the score;
2. priority chains, steepest descent: re-insert a micro-batch's F..B chain, stage after stage, before the first
   action of each worker not yet started when it is ready (its stage-0 F kept in place, or put first);
3. pairs of priority chains: one micro-batch of each of the two busiest stage-0 workers;
4. time shifts, steepest descent: every worker's order re-sorted by start time, one micro-batch's actions counted
   `delta` earlier (delta in -9..9: promoted or demoted on every stage at once); then `--pairs` random pairs, one
   micro-batch promoted and another demoted, from the start;
5. the order search itself with `--evaluations` timings (its budget ~30 per start in make_plan), restarted in
   rounds of 40 timings from the best, with or without half of the rounds replaced by one random conflict chain.

`--lexicographic`: every step scores by the period, then every worker's end, largest first (so one of two workers at
the maximum finishing earlier counts as progress), instead of the order search's period and sum of stage spans.
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any, Sequence

from bench_planner_quality import draw_cases

from recycle.planner import heuristic
from recycle.planner import local_search as ls
from recycle.planner.api import clear_cache, make_plan
from recycle.planner.budget import WorkBudget
from recycle.planner.failures import normalize

Orders = list[list[tuple[int, int]]]
Timed = list[list[tuple[int, int, float, float]]]
_F, _B = 0, 1


class LexicographicEvaluator(ls.OrderEvaluator):
    """The order search's evaluator, scored by the period, then every worker's end, largest first."""

    def score(self, timed: Sequence[Sequence[tuple[int, int, float, float]]]) -> Any:
        period, _ = super().score(timed)
        return period, tuple(sorted((row[-1][3] for row in timed if row), reverse=True))


def conflict_chain(ev: ls.OrderEvaluator, orders: Orders, timed: Timed, mb: int, code: int) -> Orders | None:
    """`code`'s action of `mb` swapped with the one before it on every worker where it waited for that worker."""
    new = [list(row) for row in orders]
    changed = False
    for s in range(ev.S):
        rank = ev.host[s][mb] * ev.S + s
        row = new[rank]
        if (code, mb) not in row:
            continue
        p = row.index((code, mb))
        if p == 0 or row[p - 1][1] == mb or abs(timed[rank][p][2] - timed[rank][p - 1][3]) > 1e-9:
            continue
        row[p - 1], row[p] = row[p], row[p - 1]
        changed = True
    return new if changed else None


def priority_chain(ev: ls.OrderEvaluator, orders: Orders, timed: Timed, mb: int, front: bool) -> Orders:
    """`mb`'s F..B chain (fused or B only; W's stay) re-inserted before each worker's first action not started when
    it is ready (the workers' other times from `timed`); its stage-0 F kept in place, or first when `front`."""
    new = [list(row) for row in orders]
    chain = [(_F, s) for s in range(ev.S)] + [(_B, s) for s in reversed(range(ev.S))]
    ready = 0.0
    for n, (code, s) in enumerate(chain):
        rank = ev.host[s][mb] * ev.S + s
        row = new[rank]
        others = [e for e in timed[rank] if (e[0], e[1]) != (code, mb)]
        if n == 0 and not front:
            i = row.index((code, mb))
            start = timed[rank][i][2]
        else:
            i, prev_end = 0, 0.0
            while i < len(others) and others[i][2] < ready - 1e-9:
                prev_end = others[i][3]
                i += 1
            start = max(ready, prev_end)
        row.remove((code, mb))
        row.insert(i, (code, mb))
        finish = start + ev.dur[s][code]
        ready = finish + (ev.p2p[s] if code == _F and s < ev.S - 1 else ev.p2p[s - 1] if code == _B and s else 0.0)
    return new


def time_shift(timed: Timed, shifts: dict[int, float]) -> Orders:
    """Each worker's actions sorted by start time less shifts[mb]; a micro-batch's own F, B, W keep their order."""
    out: Orders = []
    for row in timed:
        order = [(c, m) for c, m, _, _ in sorted(row, key=lambda e: (e[2] - shifts.get(e[1], 0.0), e[2]))]
        places: dict[int, list[int]] = {}
        for i, (_, m) in enumerate(order):
            places.setdefault(m, []).append(i)
        for m, idx in places.items():
            for i, c in zip(idx, sorted(order[i][0] for i in idx)):
                order[i] = (c, m)
        out.append(order)
    return out


def descend(ev: ls.OrderEvaluator, orders: Orders, moves: Any, steps: int) -> float:
    """Steepest descent over `moves(orders, timed)` (candidate orders), plateaus allowed; the best period."""
    timed = ev.time(orders)
    assert timed is not None
    best = ev.score(timed)
    for _ in range(steps):
        scored = []
        for candidate in moves(orders, timed):
            t = ev.time(candidate) if candidate is not None else None
            if t is not None:
                scored.append((ev.score(t), candidate, t))
        if not scored:
            break
        score, candidate, t = min(scored, key=lambda x: x[0])
        if score > best:
            break
        best, orders, timed = score, candidate, t
    return best[0]


def hill_climb(ev: ls.OrderEvaluator, entries: Sequence[Sequence[tuple[int, int, float, float]]], seed: int,
               evaluations: int, chain_share: float, target: float) -> float:
    """improve_orders in rounds of 40 timings, a random conflict chain instead of a round `chain_share` of the
    time; the best period."""
    rng = random.Random(seed)
    cost = sum(len(row) for row in entries)
    timed = [list(row) for row in entries]
    orders = [[(c, m) for c, m, _, _ in row] for row in timed]
    best = ev.score(timed)
    for _ in range(evaluations // 40):
        if best[0] <= target + 1e-9:
            break
        if rng.random() < chain_share:
            candidate = conflict_chain(ev, orders, timed, rng.randrange(ev.total), rng.randrange(2))
            if candidate is None:
                continue
            t = ev.time(candidate)
            if t is not None and ev.score(t) <= best:
                orders, timed, best = candidate, t, ev.score(t)
            continue
        t, score = ls.improve_orders(ev, timed, WorkBudget(40 * cost), seed=rng.randrange(10 ** 6), target=target)
        if score <= best:
            timed, best = [list(row) for row in t], score
            orders = [[(c, m) for c, m, _, _ in row] for row in timed]
    return best[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--case", type=int, default=283)
    parser.add_argument("--evaluations", type=int, default=4000)
    parser.add_argument("--restarts", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=3000)
    parser.add_argument("--lexicographic", action="store_true")
    args = parser.parse_args(argv)
    case = draw_cases(args.case + 1, args.seed, "distinct")[args.case]
    config, options = case.config(), case.options
    print(f"case {args.case} (seed {args.seed}): {case.describe()}; key {normalize(case.failed, case.D, case.S).key}")

    starts: list[tuple[Any, ...]] = []
    search_orders = heuristic._search_orders

    def recording(config_: Any, key: Any, options_: Any, caps: Any, best: Any, bound: float, budget: Any) -> Any:
        starts.append((key, best.host, best.timed.entries, caps, bound, best.name, budget.left))
        return search_orders(config_, key, options_, caps, best, bound, budget)

    heuristic._search_orders = recording  # type: ignore[assignment]
    try:
        clear_cache()
        period = make_plan(config, case.failed, options).meta.predicted_period
    finally:
        heuristic._search_orders = search_orders
        clear_cache()
    print(f"make_plan: {period:g}")
    for key, host, entries, caps, bound, name, left in starts:
        evaluator = LexicographicEvaluator if args.lexicographic else ls.OrderEvaluator
        ev = evaluator(config, key, host, options.decoupled, options.staggered, caps,
                       heuristic._opt_durations(config, key))
        orders = [[(c, m) for c, m, _, _ in row] for row in entries]
        timed = ev.time(orders)
        assert timed is not None
        S = ev.S
        print(f"start {name!r}: {ev.score(timed)[0]:g} (bound {bound:g}, make_plan's budget {left} actions)")
        conflict = descend(ev, orders, lambda o, t: (conflict_chain(ev, o, t, mb, code) for mb in range(ev.total)
                                                     for code in (_F, _B)), 30)
        priority = descend(ev, orders, lambda o, t: (priority_chain(ev, o, t, mb, front) for mb in range(ev.total)
                                                     for front in (False, True)), 10)
        print(f"  conflict chains, steepest descent: {conflict:g}; priority chains: {priority:g}")
        deltas = (-9, -6, -4, -2, 2, 4, 6, 9)
        shifted = descend(ev, orders, lambda o, t: (time_shift(t, {mb: d}) for mb in range(ev.total)
                                                    for d in deltas), 12)
        rng = random.Random(0)
        shift_pairs: dict[float, int] = {}
        for _ in range(args.pairs):
            a, b = rng.randrange(ev.total), rng.randrange(ev.total)
            t = ev.time(time_shift(timed, {a: rng.choice((2, 4, 6, 9, 14)), b: -rng.choice((2, 4, 6, 9))}))
            if t is not None:
                p = ev.score(t)[0]
                shift_pairs[p] = shift_pairs.get(p, 0) + 1
        print(f"  time shifts, steepest descent: {shifted:g}; random promote/demote pairs: best {min(shift_pairs):g} "
              f"({shift_pairs[min(shift_pairs)]} of {sum(shift_pairs.values())})")
        busy = sorted((r for r in range(0, len(orders), S)), key=lambda r: -len(orders[r]))[:2]
        pairs: dict[float, int] = {}
        firsts = [[m for c, m in orders[r] if c == _F] for r in busy]
        for a in firsts[0]:
            for b in firsts[1]:
                for fa in (False, True):
                    for fb in (False, True):
                        o = priority_chain(ev, orders, timed, a, fa)
                        t = ev.time(o)
                        if t is None:
                            continue
                        o = priority_chain(ev, o, t, b, fb)
                        t = ev.time(o)
                        if t is not None:
                            p = ev.score(t)[0]
                            pairs[p] = pairs.get(p, 0) + 1
        print(f"  pairs of priority chains on stage-0 workers {[r // S for r in busy]}: best {min(pairs):g} "
              f"({pairs[min(pairs)]} of {sum(pairs.values())})")
        for share in (0.0, 0.5):
            found = [hill_climb(ev, entries, seed, args.evaluations, share, bound) for seed in range(args.restarts)]
            print(f"  order search, {args.evaluations} timings, chain share {share}: "
                  + " ".join(f"{p:g}" for p in found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
