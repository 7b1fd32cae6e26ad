"""What a recovery sends each worker (issue 23): the whole plan, as before, against each worker's view of it
(ir.worker_view), side by side on the same re-routed plan (one worker failed) at each size: the coordinator's time to
encode, the bytes in the store and through it, and one worker's time to read and check what it gets. Then the same
for the completion that `--redo lost` sends (every survivor half-way through the iteration), with the coordinator's
time to compute it.

    .venv/bin/python benchmarks/bench_plan_views.py [--ranks 1024 --ranks 16384] [--stages 8 --microbatches 8]
    PYTHONPATH=OTHER_TREE/src .venv/bin/python benchmarks/bench_plan_views.py --completion-only --ranks 1024
    PYTHONPATH=OTHER_TREE/src .venv/bin/python benchmarks/bench_plan_views.py --views-only --ranks 16384
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_control_plane import bench_config, rerouted_plan  # noqa: E402

from recycle.ir import Plan  # noqa: E402
from recycle.ir.completion import Completion, WorkerProgress, complete_iteration  # noqa: E402
from recycle.schedules.fault_free import build_schedule  # noqa: E402


def completion_case(ranks: int, stages: int, microbatches: int) -> tuple[Plan, Plan, dict[int, WorkerProgress]]:
    """One worker of the middle stage dead, its micro-batches re-routed, every survivor half-way through."""
    base = build_schedule(bench_config(ranks // stages, stages, microbatches), "1f1b", staggered=True)
    plan = rerouted_plan(base, frozenset({(1, stages // 2)}))
    dead = base.rank(1, stages // 2)
    progress = {r: WorkerProgress(r, -1, 0, len(base.actions[r]) // 2) for r in base.live_ranks() if r != dead}
    return base, plan, progress


def completion_only(ranks: int, stages: int, microbatches: int) -> None:
    """The coordinator's time to compute the completion, and its SHA-256: runs on older trees too (PYTHONPATH)."""
    base, plan, progress = completion_case(ranks, stages, microbatches)
    started = time.perf_counter()
    completion = complete_iteration(base, plan, 0, progress)
    took = time.perf_counter() - started
    text = completion if isinstance(completion, str) else completion.to_json()
    print(f"{ranks:,} ranks: complete_iteration {took:.2f} s, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}",
          flush=True)


def views_only(ranks: int, stages: int, microbatches: int, rounds: int = 3) -> None:
    """A recovery's views as the coordinator encodes them on the path to its announcement: from the last
    generation's views (prepared beforehand), every live worker's view as bytes, CPU time (best of `rounds`) and
    the texts' SHA-256 (the same on every tree that makes the same views)."""
    from recycle.ir.worker_view import PlanViews

    base = build_schedule(bench_config(ranks // stages, stages, microbatches), "gpipe")
    previous = PlanViews(base).prepare()
    plan = rerouted_plan(base, frozenset({(1, stages // 2)}))
    best, digest = float("inf"), ""
    for _ in range(rounds):
        started = time.process_time()
        views = PlanViews(plan, previous)
        live = plan.live_ranks()
        # As the supervisor stores them: bytes in one pass where the tree has it (older trees: each view's text).
        encoded = views.encoded_views(live) if hasattr(views, "encoded_views") else \
            [views.json_for(rank).encode() for rank in live]
        best = min(best, time.process_time() - started)
        digest = hashlib.sha256(b"\n".join(encoded)).hexdigest()[:16]
    print(f"{ranks:,} ranks: every view's JSON {best:.3f} s of CPU (best of {rounds}), sha256 {digest}", flush=True)


def measure(ranks: int, stages: int, microbatches: int) -> dict[str, float]:
    from recycle.ir.completion import CompletionViews
    from recycle.ir.worker_view import PlanViews, read_worker_view

    base, plan, progress = completion_case(ranks, stages, microbatches)
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
    computing = time.perf_counter()
    completion = complete_iteration(base, plan, 0, progress)
    computed = time.perf_counter()
    assert not isinstance(completion, str), completion
    whole_completion = completion.to_json()
    completion_encoded = time.perf_counter()
    Completion.from_json(whole_completion, plan)
    completion_parsed = time.perf_counter()
    completion_views = CompletionViews(completion)
    completion_texts = {rank: completion_views.json_for(rank) for rank in live}
    completion_views_encoded = time.perf_counter()
    Completion.from_json(completion_texts[reader], plan, reader)
    completion_view_parsed = time.perf_counter()
    return {"ranks": ranks, "completion_compute_s": computed - computing,
            "completion_whole_bytes": len(whole_completion),
            "completion_whole_encode_s": completion_encoded - computed,
            "completion_whole_parse_s": completion_parsed - completion_encoded,
            "completion_views_encode_s": completion_views_encoded - completion_parsed,
            "completion_views_total_bytes": sum(len(t) for t in completion_texts.values()),
            "completion_view_max_bytes": max(len(t) for t in completion_texts.values()),
            "completion_view_parse_s": completion_view_parsed - completion_views_encoded,
            "whole_encode_s": encoded - started, "whole_bytes": len(whole),
            "whole_fanout_bytes": len(whole) * len(live), "whole_parse_s": parsed - encoded,
            "views_encode_s": views_encoded - parsed, "views_total_bytes": sum(len(t) for t in texts.values()),
            "view_max_bytes": max(len(t) for t in texts.values()), "view_parse_s": view_parsed - views_encoded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, action="append",
                        help="workers (repeatable; default 1024, 4096 and 16384)")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--completion-only", action="store_true",
                        help="only time complete_iteration and print its SHA-256 (also runs on trees before the views)")
    parser.add_argument("--views-only", action="store_true",
                        help="only time a recovery's plan views (from the last generation's) and print their SHA-256")
    args = parser.parse_args()
    sizes = args.ranks or [1024, 4096, 16384]
    for ranks in sizes:
        if ranks % args.stages or ranks // args.stages < 2:
            parser.error(f"--ranks {ranks} must be a multiple of --stages {args.stages}, with 2 or more replicas")
    if args.completion_only:
        for ranks in sizes:
            completion_only(ranks, args.stages, args.microbatches)
        return
    if args.views_only:
        for ranks in sizes:
            views_only(ranks, args.stages, args.microbatches)
        return
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
    print()
    print("| ranks | coordinator computes the completion | encodes: whole / every view | bytes one worker reads: "
          "whole / its view | one worker parses: whole / its view |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']:,} | {r['completion_compute_s']:.2f} s | {r['completion_whole_encode_s']:.2f} s / "
              f"{r['completion_views_encode_s']:.2f} s | {r['completion_whole_bytes'] / 1e6:.2f} MB / "
              f"{r['completion_view_max_bytes']:,} B | {r['completion_whole_parse_s'] * 1e3:.0f} ms / "
              f"{r['completion_view_parse_s'] * 1e3:.1f} ms |")
    print(json.dumps({"runs": rows}))


if __name__ == "__main__":
    main()
