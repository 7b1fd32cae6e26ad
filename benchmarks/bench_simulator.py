"""Times `simulate` (one iteration) of fault-free 1F1B-decoupled at three sizes, up to D=64, S=16, M=128.

Run: .venv/bin/python benchmarks/bench_simulator.py [--compare-with COMMIT]
Prints, per size, the number of simulated actions, the best-of-N wall time, actions per second and the cost per
action relative to the smallest size. "read µs/a" is the cost of merely reading kind, stage and mb of every action
of the plan: it grows with size the same way, because the plan's objects outgrow the CPU caches, which is the part
of the growth that is memory, not the simulator's algorithm (O(1) work per action).
With --compare-with, the simulator as of that commit (read with `git show`) is timed side by side on the same
plans, and the two results are checked to be identical.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recycle.config import uniform_config
from recycle.schedules.fault_free import build_schedule
from recycle.sim.simulator import simulate

SIZES = [(8, 4, 16), (16, 8, 64), (64, 16, 128)]  # (D, S, M); the largest is ~394k actions
REPEATS = [20, 5, 2]  # best of N: the machine is shared, the minimum is the least disturbed run
LIMIT_S = 10.0  # the largest size must simulate in under this many seconds


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _simulator_at(commit: str):
    """Load src/recycle/sim/simulator.py as it was at `commit` as a separate module."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{commit}:src/recycle/sim/simulator.py"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    folder = Path(tempfile.mkdtemp(prefix="bench-sim-"))
    path = folder / "simulator_previous.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("simulator_previous", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["simulator_previous"] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module.simulate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare-with", metavar="COMMIT", help="also time the simulator of this git commit")
    args = parser.parse_args()
    previous = _simulator_at(args.compare_with) if args.compare_with else None

    head = (f"{'D':>4}{'S':>4}{'M':>5}{'actions':>10}{'build+validate s':>18}{'simulate s':>12}{'actions/s':>12}"
            f"{'s/a vs smallest':>17}{'read µs/a':>11}")
    if previous:
        head += f"{'previous s':>12}{'speed-up':>10}"
    print(head)
    base = None
    largest = 0.0
    for (D, S, M), repeats in zip(SIZES, REPEATS):
        config = uniform_config(D, S, M, forward=1.0, backward_input=1.0, backward_weight=1.0, optimizer=2.0)
        t = time.perf_counter()
        plan = build_schedule(config, "1f1b-decoupled", staggered=True)
        build_s = time.perf_counter() - t
        result = simulate(plan, config, iterations=1)
        sim_s = _best(lambda: simulate(plan, config, iterations=1), repeats)
        n = result.num_actions
        read_s = _best(lambda: [(a.kind, a.stage, a.mb) for acts in plan.actions for a in acts], repeats)
        per_action = sim_s / n
        base = base or per_action
        largest = sim_s
        line = (f"{D:>4}{S:>4}{M:>5}{n:>10}{build_s:>18.2f}{sim_s:>12.3f}{n / sim_s:>12,.0f}"
                f"{per_action / base:>17.2f}{read_s / n * 1e6:>11.2f}")
        if previous:
            old = previous(plan, config, iterations=1, record=True)
            new = simulate(plan, config, iterations=1, record=True)
            if old.to_dict(include_timeline=True) != new.to_dict(include_timeline=True):
                print(f"RESULTS DIFFER from {args.compare_with} at D={D} S={S} M={M}")
                return 1
            old_s = _best(lambda: previous(plan, config, iterations=1), repeats)
            line += f"{old_s:>12.3f}{old_s / sim_s:>9.2f}x"
        print(line)
    status = "OK" if largest < LIMIT_S else "TOO SLOW"
    print(f"largest size: {largest:.2f} s (limit {LIMIT_S:g} s): {status}"
          + (f"; results identical to {args.compare_with}" if previous else ""))
    return 0 if largest < LIMIT_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
