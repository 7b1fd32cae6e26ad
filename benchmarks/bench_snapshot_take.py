"""The pre-step snapshot's take alone on one stage of the `small` GPT preset: CPU and wall time per take, this tree
against another source tree (e.g. the commit before a change) in alternating processes, after the state's layout is
steady (three takes and AdamW steps first). Also the time of a plain copy of the same bytes, the floor.

    .venv/bin/python benchmarks/bench_snapshot_take.py --compare-with TREE [--runs 5 --rounds 4 --takes 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(rounds: int, takes: int) -> dict[str, list[float]]:
    """In this process (the recycle package on sys.path): ms per take, CPU and wall, per round; and the floor."""
    import torch

    from recycle.config import ModelSpec, Training
    from recycle.models.gpt import build_stage
    from recycle.runtime.state.optim import make_optimizer
    from recycle.runtime.state.rollback import StageSnapshot
    from recycle.runtime.state.stage_state import IterationPosition, StageState

    torch.set_num_threads(1)
    module = build_stage(ModelSpec(preset="small"), 4, 1, seed=0, dtype="float32", seq_len=64)
    optimizer = make_optimizer(module, Training(lr=1e-3))
    state = StageState(module, optimizer, 1, IterationPosition())
    snapshot = StageSnapshot(state)
    for iteration in range(3):
        snapshot.take(iteration)
        for p in module.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        state.position.applied = iteration
    flat = torch.cat([t.reshape(-1).float() for t in state.state_dict().values()])
    into = torch.empty_like(flat)
    result: dict[str, list[float]] = {"cpu": [], "wall": [], "floor": []}
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(takes):
            snapshot.take(3)
        result["wall"].append((time.perf_counter() - wall) / takes * 1e3)
        result["cpu"].append((time.process_time() - cpu) / takes * 1e3)
        floor = time.process_time()
        for _ in range(takes):
            into.copy_(flat)
        result["floor"].append((time.process_time() - floor) / takes * 1e3)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare-with", metavar="TREE", required=True, help="a source tree with src/recycle")
    parser.add_argument("--runs", type=int, default=5, help="alternating processes per tree")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per process")
    parser.add_argument("--takes", type=int, default=50, help="takes per round")
    parser.add_argument("--emit", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.emit:
        print(json.dumps(measure(args.rounds, args.takes)))
        return 0
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    trees = {"this": here, "other": os.path.join(os.path.abspath(args.compare_with), "src")}
    if not os.path.isdir(os.path.join(trees["other"], "recycle")):
        print(f"error: --compare-with {args.compare_with} has no src/recycle; pass a source tree", file=sys.stderr)
        return 2
    samples: dict[str, dict[str, list[float]]] = {name: {"cpu": [], "wall": [], "floor": []} for name in trees}
    for _ in range(args.runs):
        for name, src in trees.items():
            command = [sys.executable, os.path.abspath(__file__), "--emit", "--compare-with", args.compare_with,
                       f"--rounds={args.rounds}", f"--takes={args.takes}"]
            done = subprocess.run(command, env={**os.environ, "PYTHONPATH": src}, capture_output=True, text=True,
                                  timeout=600, check=True)
            for key, values in json.loads(done.stdout.strip().splitlines()[-1]).items():
                samples[name][key] += values
    print(f"load average {os.getloadavg()[0]:.1f}; ms per take ({args.runs} processes x {args.rounds} rounds of "
          f"{args.takes} takes per tree)")
    for name, tree in trees.items():
        row = "  ".join(f"{key} best {min(values):.3f} median {statistics.median(values):.3f}"
                        for key, values in samples[name].items())
        print(f"{name:5s} ({tree}): {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
