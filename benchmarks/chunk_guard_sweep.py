"""The sweep that chose the chunked planner's guard rules (planner/chunked.py, FAILURE_VARIANTS): a greedy cover over
failure cases held out from benchmarks/bench_chunks.py.

Run: nice -n 10 .venv/bin/python benchmarks/chunk_guard_sweep.py [--seed 7]   (2-4 min here)

24 cases: D x S x M in 4x4x8, 3x5x5, 4x6x6, 2x4x8, 3x4x8, 4x5x10, one and two random failures (seeded), unit and
F=2 B=3 W=1 costs, V layout, coupled optimizer, a cap of S full-stage activations. Every case list-schedules the
rules without a guard (CHUNK_VARIANTS and the FAILURE_VARIANTS without one) on the three traffic-aware routings and,
for a non-nested set, the canonical routing; and the 120 guard-1 rules (every forward and backward order, W
threshold 0-2, alternating or not, no reserve) on the id-order routing and the canonical one. Then guard rules are
picked greedily, each time the one that lowers the sum of the 24 best simulated periods most, while one does.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import replace

from bench_chunks import COSTS, config

from recycle.errors import PlanError
from recycle.planner import chunked
from recycle.planner.failures import normalize
from recycle.planner.options import PlannerOptions
from recycle.sim.simulator import simulate

SHAPES = [(4, 4, 8), (3, 5, 5), (4, 6, 6), (2, 4, 8), (3, 4, 8), (4, 5, 10)]


def draw_cases(seed: int) -> list[tuple[int, int, int, tuple[tuple[int, int], ...], str]]:
    rng = random.Random(seed)
    cases = []
    for D, S, M in SHAPES:
        workers = [(p, s) for p in range(D) for s in range(S)]
        for count in (1, 2):
            while True:
                failed = tuple(sorted(rng.sample(workers, count)))
                if all(sum(1 for _, s in failed if s == stage) < D for stage in range(S)):
                    break
            cases.extend((D, S, M, failed, label) for label in COSTS)
    return cases


def periods(D: int, S: int, M: int, failed: tuple[tuple[int, int], ...], label: str,
            guards: list[chunked.ChunkVariant]) -> dict[tuple[str, str], float]:
    """Simulated period per (rule name, routing name); rules that stall under the cap are left out."""
    cfg = config(D, S, M, COSTS[label], 2, "v")
    failed_set = frozenset(failed)
    caps = chunked.chunk_caps(cfg, PlannerOptions(staggered=False, memory_cap=(S,) * S))
    routings = {"id": chunked.chunked_routing(cfg, failed_set),
                "slot": chunked.chunked_routing(cfg, failed_set, slot_major=True),
                "rotated": chunked.chunked_routing(cfg, failed_set, rotate=True)}
    if not normalize(failed_set, D, S).symmetric:
        routings["canonical"] = chunked.canonical_chunked_routing(cfg, failed_set)
    found: dict[tuple[str, str], float] = {}

    def run(rule: chunked.ChunkVariant, routing: str) -> None:
        try:
            plan = chunked.list_schedule_chunked(cfg, failed_set, routings[routing], True, False, caps, rule)
        except PlanError:
            return
        found[(rule.name, routing)] = simulate(plan, cfg).period

    for rule in chunked.CHUNK_VARIANTS + tuple(v for v in chunked.FAILURE_VARIANTS if not v.guard):
        for routing in routings:
            run(rule, routing)
    for rule in guards:
        for routing in ("id", "canonical"):
            if routing in routings:
                run(rule, routing)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    guards = [replace(v, guard=1) for v in chunked.ALL_CHUNK_VARIANTS if not v.reserve and v.w_first_at in (0, 1, 2)]
    names = sorted({g.name for g in guards})
    results = []
    for case in draw_cases(args.seed):
        found = periods(*case, guards)
        results.append(found)
        print(f"{case}: without guard {min(p for (n, _), p in found.items() if '/guard' not in n):g}, "
              f"best {min(found.values()):g}", flush=True)

    def total(chosen: list[str]) -> float:
        return sum(min(p for (n, _), p in found.items() if "/guard" not in n or n in chosen) for found in results)

    chosen: list[str] = []
    print(f"sum of the best periods: without guard rules {total([]):g}, with all {len(names)} {total(names):g}")
    while True:
        now = total(chosen)
        gains = sorted(((now - total([*chosen, n]), n) for n in names if n not in chosen), key=lambda g: (-g[0], g[1]))
        if not gains or gains[0][0] <= 1e-9:
            break
        chosen.append(gains[0][1])
        print(f"pick {gains[0][1]}: gain {gains[0][0]:g}, sum {now - gains[0][0]:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
