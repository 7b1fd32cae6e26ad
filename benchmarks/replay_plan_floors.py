"""Which plans a cold replay still makes, and whether any of them could be skipped by a floor: each plan by kind
(a partition screen, a moved layout's full plan: polish or rate, a configured layout's key), its CPU seconds, and
whether its planned period is at or under the floor its rate is capped at (the 1F1B reference for the configured
layout, `PartitionModel.moved_floor()` for a moved one). A plan at or under its floor is one an upper bound could
have settled unplanned (docs/planner.md, "An upper bound from the first rule schedule"); one above it is a period a
decision uses as it is. Also counts the list schedules and candidate simulations served from the planner's kept
ones (heuristic._SCHEDULES, heuristic._SCORED).

Run: nice -n 10 .venv/bin/python benchmarks/replay_plan_floors.py [--trace bamboo-ec2-p3|NAME|SPEC]

Job: as benchmarks/bench_replay.py's cold column (the config sized to the trace, every default system, the paper's
1F1B reference, the plan cache in a fresh temporary folder, the planner's in-process caches emptied first).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import sys
import tempfile
import time
from pathlib import Path

import recycle.planner.api as planner_api
import recycle.planner.heuristic as heuristic
from recycle.config import load_config
from recycle.traces.experiments import SYSTEM_NAMES, JobSetup, find_traces_dir, run_job
from recycle.traces.generate import parse_generate_spec
from recycle.traces.plan_cache import PlanCache
from recycle.traces.reader import read_trace

ROOT = Path(__file__).resolve().parents[1]
LONG_SPEC = "poisson:nodes=80,hours=48,mtbf_h=18,repair_h=0.5,seed=0"


def _kind_and_floor(options) -> tuple[str, float | None]:
    """The caller's kind of plan and the floor its rate is capped at, read from the models up the stack."""
    for info in inspect.stack()[2:40]:
        owner = info.frame.f_locals.get("self")
        if owner is not None and hasattr(owner, "moved_floor"):
            return ("screen" if not options.search else "moved layout"), owner.moved_floor()
        if owner is not None and hasattr(owner, "period_cap") and hasattr(owner, "floor_period"):
            return "configured layout", owner.floor_period
    return "other", None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="bamboo-ec2-p3", help="a shipped trace's name, long-400, or a generator "
                        "spec")
    parser.add_argument("--config", default=str(ROOT / "configs" / "gpt3-6.7b-a100.toml"))
    args = parser.parse_args(argv)
    folder = find_traces_dir(ROOT)
    if args.trace == "long-400":
        trace = parse_generate_spec(LONG_SPEC)
    elif folder is not None and (folder / f"{args.trace}.csv").exists():
        trace = read_trace(folder / f"{args.trace}.csv")
    else:
        trace = parse_generate_spec(args.trace)

    plans: collections.Counter[tuple[str, bool]] = collections.Counter()
    seconds: dict[tuple[str, bool], float] = collections.defaultdict(float)
    depth = [0]
    real = planner_api.period_plan_for_key

    def counted(config, key, options=planner_api.PlannerOptions(), *rest, **named):
        kind, floor = _kind_and_floor(options) if depth[0] == 0 else ("", None)
        depth[0] += 1
        start = time.process_time()
        try:
            plan = real(config, key, options, *rest, **named)
        finally:
            depth[0] -= 1
        if kind:
            period = plan.meta.predicted_period
            at = floor is not None and period is not None and kind != "screen" and period <= floor
            plans[kind, at] += 1
            seconds[kind, at] += time.process_time() - start
        return plan

    kept: collections.Counter[tuple[str, bool]] = collections.Counter()
    for name in ("_SCHEDULES", "_SCORED"):
        table = getattr(heuristic, name)

        class Counting(type(table)):  # type: ignore[misc]
            def get(self, key, default=None, _name=name):
                found = super().get(key, default)
                kept[_name, found is not None] += 1
                return found

        setattr(heuristic, name, Counting())
    planner_api.period_plan_for_key = counted
    planner_api.clear_cache()
    with tempfile.TemporaryDirectory(prefix="replay-plan-floors-") as tmp:
        start = time.process_time()
        run_job(load_config(args.config), trace, SYSTEM_NAMES, setup=JobSetup(replicas="auto"),
                plan_cache=PlanCache(Path(tmp) / "plans"))
        cpu = time.process_time() - start
    print(f"{args.trace}: cold replay {cpu:.1f} CPU s (counting included)")
    print("| plans of | at or under its floor | plans | CPU s |")
    print("|---|---|---|---|")
    for (kind, at), count in sorted(plans.items()):
        print(f"| {kind} | {'n/a (ranks partitions)' if kind == 'screen' else 'yes' if at else 'no'} | {count} | "
              f"{seconds[kind, at]:.1f} |")
    for name, what in (("_SCHEDULES", "list schedules"), ("_SCORED", "candidate simulations")):
        print(f"{what}: {kept[name, True]} of {kept[name, True] + kept[name, False]} served from the kept ones")
    return 0


if __name__ == "__main__":
    sys.exit(main())
