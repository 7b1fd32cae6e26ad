"""The coordinator's CPU per worker step record (issue 23's steady-state CPU goal): one step's NodeSteps records of
every node, as the stand-in launchers of bench_control_plane write them, read the way the supervisor reads them
(NodeSteps.decode, or what an older tree has; HeldSteps.add; then the reporter's StepMetrics of the step), on this
tree and, with --before DIR, on another checkout of recycle, side by side in one run.

Run: .venv/bin/python benchmarks/bench_step_records.py [--ranks 4096] [--ranks-per-node 8] [--before /path/to/tree]
Each tree is measured in a process of its own (PYTHONPATH=TREE/src, the stand-ins' writer from TREE/benchmarks), by
process CPU time, the best of --repeats. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Runs inside the measured tree: argv = ranks, ranks per node, stages, repeats.
_MEASURE = r'''
import sys, time
ranks, per_node, stages, repeats = (int(a) for a in sys.argv[1:5])
import control_plane_nodes as nodes
from recycle.runtime.control.node_steps import HeldSteps
from recycle.runtime.control.reporter import Reporter
from recycle.runtime.protocol import records as rec

def batch(node):
    workers = [divmod(r, stages) for r in range(node * per_node, (node + 1) * per_node)]
    start = 1765036203.0 + node / 1000
    if hasattr(nodes, "node_steps_json"):
        return nodes.node_steps_json(node, 5, workers, 0, start, start + 2.0, stages - 1)
    lines = [nodes.step_json(r, s, 0, start, start + 2.0, s == stages - 1) for r, s in workers]  # per-worker format
    return b'{"kind": "node_steps", "node": %d, "step": 5, "records": [%s]}' % (node, b", ".join(lines))

batches = [batch(node) for node in range(ranks // per_node)]
# As the supervisor reads a batch in this tree (NodeSteps.decode; an older tree: its read_unchecked or from_json).
read_batch = getattr(rec.NodeSteps, "decode", None) or getattr(rec.NodeSteps, "read_unchecked", None) or \
    (lambda text: rec.from_json(rec.NodeSteps, text))
rank_of = lambda replica, stage: replica * stages + stage
best = [float("inf")] * 2
for _ in range(repeats):
    began = time.process_time()
    held = HeldSteps()
    for text in batches:
        held.add(read_batch(text), rank_of, 0)
    read = time.process_time()
    got = held.get(5)
    picks = [got[rank] for rank in range(ranks)]
    step = rec.StepRows.gather(picks) if hasattr(rec, "StepRows") else picks
    metrics = Reporter([], 1000, stages, 0.0).step_metrics(5, step)
    done = time.process_time()
    assert len(metrics.worker_time_s) == ranks
    best = [min(best[0], read - began), min(best[1], done - read)]
print(f"{1e6 * best[0] / ranks} {1e6 * best[1] / ranks}")
'''


def measure(tree: Path, ranks: int, per_node: int, stages: int, repeats: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree / 'benchmarks'}"}
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(ranks), str(per_node), str(stages), str(repeats)],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"error: measuring the tree at {tree} failed: {out.stderr.strip().splitlines()[-1]}")
    read_us, report_us = (float(v) for v in out.stdout.split())
    return {"read_us_per_record": read_us, "report_us_per_record": report_us, "total_us_per_record": read_us + report_us}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--before", type=Path, help="another recycle checkout to measure beside this one")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.ranks_per_node < 1 or args.ranks % args.ranks_per_node or args.ranks % args.stages:
        raise SystemExit(f"error: --ranks {args.ranks} must be a positive multiple of --ranks-per-node "
                         f"{args.ranks_per_node} and of --stages {args.stages}")
    if args.before is not None and not (args.before / "src" / "recycle").is_dir():
        raise SystemExit(f"error: --before {args.before} holds no src/recycle; give the root of a recycle checkout")
    trees = {"this tree": HERE.parent} | ({"before": args.before.resolve()} if args.before else {})
    rows = {name: measure(tree, args.ranks, args.ranks_per_node, args.stages, args.repeats)
            for name, tree in trees.items()}
    print(f"{args.ranks} ranks, {args.ranks_per_node} per node: coordinator CPU per worker step record (best of "
          f"{args.repeats}, process CPU time)")
    for name, row in rows.items():
        print(f"  {name:10} read {row['read_us_per_record']:6.2f} us + metrics {row['report_us_per_record']:5.2f} us"
              f" = {row['total_us_per_record']:6.2f} us")
    result: dict[str, object] = {"ranks": args.ranks, "ranks_per_node": args.ranks_per_node, **{
        f"{key}_{'after' if name == 'this tree' else 'before'}": value
        for name, row in rows.items() for key, value in row.items()}}
    if "before" in rows:
        ratio = rows["before"]["total_us_per_record"] / rows["this tree"]["total_us_per_record"]
        print(f"  before / this tree: {ratio:.2f}x")
        result["speedup"] = ratio
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
