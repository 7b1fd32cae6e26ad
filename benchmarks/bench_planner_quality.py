"""Heuristic vs exact (CP-SAT) planner: a seeded random screen over costs, shapes, failure sets and options.

Run: nice -n 15 .venv/bin/python benchmarks/bench_planner_quality.py [--cases 300] [--seed 0] [--time-limit 4]
     [--workers 2] [--only 12,40] [--verbose] [--draw {quality,distinct}] [--planner {heuristic,make_plan}]
     [--reference FILE]

Every case draws D, S, M, integer costs (F, B input, B weight, optimizer, sometimes a p2p latency), a failure set
(each stage keeps a live replica) and the options (decoupled/fused, staggered/coupled), then plans it twice, side
by side: the heuristic (`schedule_heuristic`, what `recycle plan` uses), then the exact CP-SAT solver warm-started
from the heuristic plan with a per-case time limit (so exact <= heuristic). Periods are the simulator's. The gap of
a case is (heuristic - exact) / exact; exact is the reference whether or not CP-SAT proved it optimal (when it did
not, the true gap may be larger: the status column says which). A "miss" is a case with gap > 0; each is printed
with the `recycle plan` command line that reproduces it.

--draw distinct (issue 26's screen) draws F, B input and B weight as three distinct costs from 1-4 (the same
shapes, failures and options otherwise) and --planner make_plan plans the real failure set with `make_plan`
(traffic-aware routing on the real ranks, or the canonical plan where that is faster: what `recycle plan`
returns), against CP-SAT on the failure key's canonical layout (a relabelling per stage maps its plans onto the
real ranks with the same timing). --reference FILE keeps each case's CP-SAT result (period, status) in a JSON
file and reuses it: the reference does not depend on the heuristic once CP-SAT has proved it optimal, so a change
to the heuristic can be screened again in about a minute instead of CP-SAT's 10-20.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace

from recycle.config import Config, parse_config
from recycle.planner.api import clear_cache, make_plan
from recycle.planner.bounds import period_lower_bound
from recycle.planner.exact import schedule_exact
from recycle.planner.failures import normalize
from recycle.planner.heuristic import schedule_heuristic
from recycle.planner.options import PlannerOptions

# Cases stay small enough for CP-SAT to prove most optima in a few seconds on 2 cores.
MAX_ACTIONS = 480  # D * S * M * (3 decoupled, 2 fused) per iteration


@dataclass(frozen=True)
class Case:
    D: int
    S: int
    M: int
    forward: int
    backward_input: int
    backward_weight: int
    optimizer: int
    p2p: float
    failed: tuple[tuple[int, int], ...]  # (replica, stage)
    options: PlannerOptions

    def config(self) -> Config:
        raw = {
            "topology": {"num_replicas": self.D, "num_stages": self.S},
            "workload": {"num_microbatches": self.M},
            "costs": {"forward": self.forward, "backward_input": self.backward_input,
                      "backward_weight": self.backward_weight, "optimizer": self.optimizer},
            "communication": {"p2p_latency": self.p2p},
        }
        return parse_config(raw, name="screen")

    def describe(self) -> str:
        return (f"D={self.D} S={self.S} M={self.M} F={self.forward} B={self.backward_input} W={self.backward_weight} "
                f"opt={self.optimizer} p2p={self.p2p:g} {options_name(self.options)} "
                f"fail {' '.join(f'{p}:{s}' for p, s in self.failed)}")

    def command(self) -> str:
        flags = " ".join(f"--fail {p}:{s}" for p, s in self.failed)
        flags += "" if self.options.decoupled else " --no-decouple"
        flags += "" if self.options.staggered else " --no-stagger"
        return (f"[costs] forward={self.forward} backward_input={self.backward_input} "
                f"backward_weight={self.backward_weight} optimizer={self.optimizer}, p2p_latency={self.p2p:g}, "
                f"D={self.D} S={self.S} M={self.M}: recycle plan {flags}")


def options_name(options: PlannerOptions) -> str:
    return ("dec" if options.decoupled else "fused") + ("+stag" if options.staggered else "+cpl")


def draw_case(rng: random.Random) -> Case:
    """One random case; shapes are redrawn until the instance is small enough for the exact reference."""
    while True:
        D = rng.randint(2, 6)
        S = rng.randint(2, 4)
        M = rng.randint(S // 2 + 1, 2 * S)
        decoupled = rng.random() < 0.75
        if D * S * M * (3 if decoupled else 2) <= MAX_ACTIONS:
            break
    options = PlannerOptions(decoupled=decoupled, staggered=rng.random() < 0.6)
    workers = [(p, s) for p in range(D) for s in range(S)]
    while True:
        failed = tuple(sorted(rng.sample(workers, rng.randint(1, min(3, D * S - S)))))
        if all(sum(1 for _, s in failed if s == st) < D for st in range(S)):
            break
    return Case(D, S, M, rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 2), rng.choice((0, 0, 1, 3)),
                rng.choice((0.0, 0.0, 0.0, 0.5)), failed, options)


def draw_distinct_case(rng: random.Random) -> Case:
    """draw_case's shapes, failures and options with F, B input and B weight three distinct costs from 1-4."""
    case = draw_case(rng)
    forward, backward_input, backward_weight = rng.sample([1, 2, 3, 4], 3)
    return replace(case, forward=forward, backward_input=backward_input, backward_weight=backward_weight)


def draw_cases(count: int, seed: int, draw: str = "quality") -> list[Case]:
    rng = random.Random(seed)
    drawer = draw_distinct_case if draw == "distinct" else draw_case
    return [drawer(rng) for _ in range(count)]


def nested(case: Case) -> bool:
    """Whether one relabelling of pipelines maps the failures onto their key's canonical layout."""
    return normalize(case.failed, case.D, case.S).symmetric


def _load_reference(path: str) -> dict[str, dict]:
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _save_reference(path: str, reference: dict[str, dict]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(reference, f, indent=0, sort_keys=True)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300, help="how many random cases (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="screen seed (default 0)")
    parser.add_argument("--time-limit", type=float, default=4.0, help="CP-SAT seconds per case (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="CP-SAT worker threads (default 2)")
    parser.add_argument("--only", default="", help="comma-separated case indices to run (default: all)")
    parser.add_argument("--verbose", action="store_true", help="one line per case")
    parser.add_argument("--draw", choices=("quality", "distinct"), default="quality",
                        help="quality: F, B 1-3, W 1-2 (default); distinct: F != B != W from 1-4 (issue 26)")
    parser.add_argument("--planner", choices=("heuristic", "make_plan"), default="heuristic",
                        help="heuristic: schedule_heuristic on the canonical key (default); make_plan: the real "
                             "failure set, as `recycle plan` plans it")
    parser.add_argument("--reference", default="", metavar="FILE",
                        help="JSON file of CP-SAT results per case: read, and extended with new cases")
    args = parser.parse_args(argv)
    cases = draw_cases(args.cases, args.seed, args.draw)
    reference = _load_reference(args.reference)
    chosen = [int(i) for i in args.only.split(",") if i] or list(range(len(cases)))

    rows = []
    heur_times = []
    unsettled = 0  # plans that never settle to a one-iteration period (recycle.planner.settling says so in notes)
    began = time.perf_counter()
    for n, i in enumerate(chosen):
        case = cases[i]
        config = case.config()
        key = normalize(case.failed, case.D, case.S).key
        clear_cache()
        t0 = time.perf_counter()
        if args.planner == "make_plan":
            planned = make_plan(config, case.failed, case.options)
        else:
            planned = schedule_heuristic(config, key, case.options)
        heur_times.append(time.perf_counter() - t0)
        h = planned.meta.predicted_period
        name = f"{case.describe()} t={args.time_limit:g} w={args.workers}"
        if name not in reference:
            hint = planned if args.planner == "heuristic" else schedule_heuristic(config, key, case.options)
            exact = schedule_exact(config, key, case.options, time_limit_s=args.time_limit, hint=hint,
                                   workers=args.workers)
            reference[name] = {"period": exact.meta.predicted_period, "status": exact.meta.status}
            if args.reference:
                _save_reference(args.reference, reference)
        e, status = min(reference[name]["period"], h), reference[name]["status"]
        gap = (h - e) / e
        bound = period_lower_bound(config, key, case.options)
        fallback = bool(getattr(planned.meta, "routing_fallback", ""))
        unsettled += "-iteration cycle" in planned.meta.notes or "not periodic" in planned.meta.notes
        rows.append((i, case, key, h, e, status, gap, bound, fallback))
        if args.verbose or gap > 0:
            print(f"#{i:<4} {case.describe():<70} heur {h:>6g} exact {e:>6g} {status:<8} "
                  f"gap {gap:>6.1%}  ({heur_times[-1] * 1e3:.0f} ms){' canonical fall-back' if fallback else ''}",
                  flush=True)
        elif (n + 1) % 50 == 0:
            print(f"... {n + 1}/{len(chosen)} cases, {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)

    if args.reference:
        _save_reference(args.reference, reference)
    gaps = [r[6] for r in rows]
    proved = [r for r in rows if r[5] == "OPTIMAL"]
    misses = [r for r in rows if r[6] > 1e-12]
    at_bound = sum(1 for r in rows if r[3] <= r[7] * (1 + 1e-9))
    print(f"\n{len(rows)} cases (seed {args.seed}) in {time.perf_counter() - began:.0f} s; CP-SAT "
          f"{args.time_limit:g} s per case, {args.workers} workers; exact proved optimal in {len(proved)}")
    print(f"heuristic time per case: mean {statistics.mean(heur_times) * 1e3:.0f} ms, max "
          f"{max(heur_times) * 1e3:.0f} ms;"
          f" heuristic at the analytic lower bound in {at_bound}; plans without a one-iteration period: {unsettled}")
    print(f"heuristic gap over the exact plan: mean {statistics.mean(gaps):.2%}, max {max(gaps):.2%}; misses (gap > 0) "
          f"{len(misses)}, over 2 %: {sum(1 for g in gaps if g > 0.02)}")
    if proved:
        pg = [r[6] for r in proved]
        print(f"over the {len(proved)} proved optima: mean {statistics.mean(pg):.2%}, max {max(pg):.2%}")
    for label, group in (("nested", [r for r in rows if nested(r[1])]),
                         ("not nested", [r for r in rows if not nested(r[1])])):
        if group:
            gg = [r[6] for r in group]
            print(f"{label}: {len(group)} cases, mean gap {statistics.mean(gg):.2%}, max {max(gg):.2%}, misses "
                  f"{sum(1 for g in gg if g > 1e-12)}"
                  + (f", canonical fall-backs {sum(1 for r in group if r[8])}" if args.planner == "make_plan" else ""))
    for i, case, key, h, e, status, gap, *_ in sorted(misses, key=lambda r: -r[6])[:10]:
        print(f"  #{i}: heuristic {h:g} vs exact {e:g} ({status}) = +{gap:.1%}"
              f"{'' if nested(case) else ' (not nested)'}: {case.command()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
