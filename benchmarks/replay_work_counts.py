"""Work a cold replay does, counted rather than timed (the same on a loaded machine): simulator runs, config dumps
(`Config.planning_dict`: fingerprints, plan-cache keys), list schedules; with its CPU seconds and every goodput.

Run: nice -n 10 .venv/bin/python benchmarks/replay_work_counts.py [--trace oobleck-synthetic-30m] [--screens exact|N]
     (set PYTHONPATH to another tree's src/ to count that tree's work; the counters wrap functions both have)

--screens: ReCycle+'s partition screens with every rule (`exact`: `run_job(..., exact_screens=True)`) or with the
first N rules (sets `repartition.QUICK_SCREEN_RULES` for this process); default: the tree's own default.

Job: as benchmarks/bench_replay.py's cold column (the config sized to the trace, every default system, the plan
cache in a fresh temporary folder, the planner's in-process caches emptied first).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import recycle.config as config_module
import recycle.planner.api as planner_api
import recycle.planner.heuristic as heuristic
import recycle.traces.repartition as repartition
from recycle.config import load_config
from recycle.traces.experiments import SYSTEM_NAMES, JobSetup, find_traces_dir, run_job
from recycle.traces.plan_cache import PlanCache
from recycle.traces.reader import read_trace

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "gpt3-6.7b-a100.toml"))
    parser.add_argument("--trace", default="oobleck-synthetic-30m",
                        help="a shipped trace's name, or a --generate spec (e.g. poisson:nodes=80,...)")
    parser.add_argument("--screens", default=None, help="exact, or N: the first N rules per partition screen")
    args = parser.parse_args(argv)
    screens: dict[str, bool] = {}
    if args.screens == "exact":
        screens["exact_screens"] = True
    elif args.screens is not None:
        if not args.screens.isdigit() or int(args.screens) < 1:
            print(f"error: --screens {args.screens!r} must be exact or a whole number >= 1", file=sys.stderr)
            return 2
        repartition.QUICK_SCREEN_RULES = int(args.screens)  # read by run_job when it builds ReCycle+
    folder = find_traces_dir(ROOT)
    if folder is None:
        print("error: no ../shared/data/traces beside the checkout", file=sys.stderr)
        return 2
    counts = {"simulator runs": 0, "config dumps": 0, "list schedules": 0}

    def counted(owner: object, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            counts[label] += 1
            return inner(*a, **k)
        setattr(owner, name, wrapper)

    counted(heuristic, "simulate", "simulator runs")
    counted(planner_api, "simulate", "simulator runs")
    counted(heuristic, "list_schedule", "list schedules")
    counted(config_module.Config, "planning_dict", "config dumps")
    config = load_config(args.config)
    if ":" in args.trace:
        from recycle.traces.generate import parse_generate_spec

        trace = parse_generate_spec(args.trace)
    else:
        trace = read_trace(folder / f"{args.trace}.csv")
    planner_api.clear_cache()
    repartition._CHOICES.clear()
    with tempfile.TemporaryDirectory(prefix="replay-work-") as tmp:
        began = time.process_time()
        result = run_job(config, trace, SYSTEM_NAMES, setup=JobSetup(replicas="auto"), plan_cache=PlanCache(tmp),
                         **screens)
        cpu = time.process_time() - began
    print(f"{args.trace}: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + f"; {cpu:.1f} CPU s")
    print("goodput: " + ", ".join(f"{name} {run.goodput!r}" for name, run in result.runs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
