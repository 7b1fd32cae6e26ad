"""The bytes of a generation's plan views after a mass failure, with the start every view shares (metadata and the
routing's exceptions) stored once, as the coordinator now stores it, against a copy of it in every worker's view, as
it stored them before: at 16,384 ranks with 171 whole nodes (pipelines) lost, 2.4 GB per copy of the views.

Run: .venv/bin/python benchmarks/bench_view_memory.py [--ranks 16384] [--lost-pipelines 171] [--whole]
  --whole also makes every view whole (the old list), to see the process's resident memory with it.
The plan is the one a user's plan library gives for the state (a key it does not hold: planned online by the
heuristic), as bench_control_plane's coordinator asked for it when its stand-ins fell behind their heartbeats.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_control_plane import bench_config, bench_library  # noqa: E402

from recycle.ir.worker_view import PlanViews  # noqa: E402
from recycle.schedules.fault_free import build_schedule  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16384)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--lost-pipelines", type=int, default=171)
    parser.add_argument("--whole", action="store_true")
    args = parser.parse_args(argv)
    D, S = args.ranks // args.stages, args.stages
    if not 0 < args.lost_pipelines < D // 2:
        raise SystemExit(f"error: --lost-pipelines {args.lost_pipelines} must be in [1, {D // 2})")
    base = build_schedule(bench_config(D, S, 8), "gpipe")
    library = bench_library(base, [frozenset({(1, 0)})])
    failed = frozenset({(1, 0)} | {(p, s) for p in range(D // 2, D // 2 + args.lost_pipelines) for s in range(S)})
    started = time.perf_counter()
    plan = library.lookup(failed).plan
    print(f"{args.ranks} ranks, {len(failed)} workers failed: the plan in {time.perf_counter() - started:.1f} s; "
          f"rss {rss_mb():.0f} MB")
    views = PlanViews(plan, PlanViews(base).prepare())
    live = plan.live_ranks()
    tails = sum(map(len, views.encoded_tails(live)))
    shared = len(views.shared)
    print(f"the start every view shares: {shared:,} B; the {len(live):,} workers' own parts: {tails / 1e6:.1f} MB")
    print(f"stored once: {(shared + tails) / 1e6:.1f} MB; in every view: {(shared * len(live) + tails) / 1e9:.2f} GB; "
          f"rss {rss_mb():.0f} MB")
    if args.whole:
        whole = views.encoded_views(live)
        print(f"every view whole ({sum(map(len, whole)) / 1e9:.2f} GB): rss {rss_mb():.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
