"""What a recovery sends each worker (issue 23): the whole plan, as before, against each worker's view of it
(ir.worker_view), side by side on the same re-routed plan (one worker failed) at each size: the coordinator's time to
encode, the bytes in the store and through it, and one worker's time to read and check what it gets.

    .venv/bin/python benchmarks/bench_plan_views.py [--ranks 1024 --ranks 16384] [--stages 8 --microbatches 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_control_plane import bench_config, rerouted_plan  # noqa: E402

from recycle.ir import Plan  # noqa: E402
from recycle.ir.worker_view import PlanViews, read_worker_view  # noqa: E402
from recycle.schedules.fault_free import build_schedule  # noqa: E402


def measure(ranks: int, stages: int, microbatches: int) -> dict[str, float]:
    plan = rerouted_plan(build_schedule(bench_config(ranks // stages, stages, microbatches), "1f1b", staggered=True),
                         frozenset({(1, stages // 2)}))
    live = plan.live_ranks()
    started = time.perf_counter()
    whole = plan.to_json()
    encoded = time.perf_counter()
    Plan.from_json(whole)
    parsed = time.perf_counter()
    views = PlanViews(plan)
    texts = {rank: views.json_for(rank) for rank in live}
    views_encoded = time.perf_counter()
    reader = live[len(live) // 2 + 1]  # a worker of a stage whose micro-batches were re-routed to it, or near
    read_worker_view(texts[reader], reader)
    view_parsed = time.perf_counter()
    return {"ranks": ranks, "whole_encode_s": encoded - started, "whole_bytes": len(whole),
            "whole_fanout_bytes": len(whole) * len(live), "whole_parse_s": parsed - encoded,
            "views_encode_s": views_encoded - parsed, "views_total_bytes": sum(len(t) for t in texts.values()),
            "view_max_bytes": max(len(t) for t in texts.values()), "view_parse_s": view_parsed - views_encoded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, action="append", help="workers (repeatable; default 1024 and 16384)")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    sizes = args.ranks or [1024, 16384]
    for ranks in sizes:
        if ranks % args.stages or ranks // args.stages < 2:
            parser.error(f"--ranks {ranks} must be a multiple of --stages {args.stages}, with 2 or more replicas")
    rows = []
    print("| ranks | coordinator encodes: whole plan / every view | bytes one worker reads: whole / its view | "
          "store sends in all: whole x workers / all views | one worker parses: whole / its view |")
    print("|---|---|---|---|---|")
    for ranks in sizes:
        r = measure(ranks, args.stages, args.microbatches)
        rows.append(r)
        print(f"| {ranks:,} | {r['whole_encode_s']:.2f} s / {r['views_encode_s']:.2f} s | "
              f"{r['whole_bytes'] / 1e6:.2f} MB / {r['view_max_bytes']:,} B | "
              f"{r['whole_fanout_bytes'] / 1e9:.2f} GB / {r['views_total_bytes'] / 1e6:.1f} MB | "
              f"{r['whole_parse_s'] * 1e3:.0f} ms / {r['view_parse_s'] * 1e3:.1f} ms "
              f"({r['whole_parse_s'] / r['view_parse_s']:.0f}x) |", flush=True)
    print(json.dumps({"runs": rows}))


if __name__ == "__main__":
    main()
