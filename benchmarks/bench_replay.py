"""Replay speed: every default system over each shipped trace and a 400-change-point trace, the path before the plan
cache, the plan cache before issue 27 item 4's cold-replay work and the current one (cold and warm cache) side by
side in one run, with the ratios and a check that every system's goodput is unchanged.

Run: nice -n 10 .venv/bin/python benchmarks/bench_replay.py [--config configs/gpt3-6.7b-a100.toml] [--traces NAME ...]
     [--no-old] [--no-before]

Job: the config sized to each trace (`--replicas auto`: D = most live nodes // S, at most 20 here), every default
system (ReCycle+ included), the default costs. Columns, all measured in this process one after the other (wall
seconds; CPU seconds of this process beside the cold ones, since the machine is shared):
* old: `run_job(..., plan_cache=None)`: the planner's in-process caches only, every weighed key planned by
  `plan_for_key` (the path before the plan cache), rule schedules not shared between plans;
* before: the plan cache in a fresh folder as it was before the cold-replay work: every key planned in full by
  `plan_for_key` (`PlanCache(period_only=False)`), rule schedules not shared (`heuristic._RANKED_LIMIT = 0`);
* cold: the plan cache in a fresh folder now: `period_plan_for_key` (a plan ends at the first schedule the planner
  is sure to pick once it reaches the lower bound) and a key planned without and then with the search reuses its
  rule schedules;
* warm: the same folder again, in-process caches emptied: every plan read from disk and validated;
* CLI warm: the whole `recycle simulate` command (new process: imports, trace, report and plot) on the warm cache.
The planner's caches are emptied before each column. "goodput same": every system's goodput identical in all columns
("yes"), else the largest relative difference when it is float noise (<= 1e-9: a plan that ends at the lower bound
may simulate a few ulps away from the full planner's plan, which sits at the same bound), and whether any decision
of ReCycle or ReCycle+ (policy logs, states run in) differs.
The long trace is generated deterministically (Poisson failures of 80 nodes over 48 h, seed 0: 397 change points,
D = 20); the shipped traces come from ../shared/data/traces beside the checkout.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import recycle.planner.api as planner_api
import recycle.planner.heuristic as heuristic
import recycle.traces.repartition as repartition
from recycle.config import load_config
from recycle.traces.experiments import SYSTEM_NAMES, JobSetup, find_traces_dir, run_job
from recycle.traces.generate import parse_generate_spec
from recycle.traces.plan_cache import PlanCache
from recycle.traces.reader import read_trace

ROOT = Path(__file__).resolve().parents[1]
LONG_SPEC = "poisson:nodes=80,hours=48,mtbf_h=18,repair_h=0.5,seed=0"


def _cold_process() -> None:
    planner_api.clear_cache()
    repartition._CHOICES.clear()


def _timed(config, trace, cache: PlanCache | None, share_schedules: bool = True):
    """(wall s, CPU s, result) of one replay with every in-process planner cache emptied first."""
    _cold_process()
    limit = heuristic._RANKED_LIMIT
    heuristic._RANKED_LIMIT = limit if share_schedules else 0
    try:
        start, cpu = time.perf_counter(), time.process_time()
        result = run_job(config, trace, SYSTEM_NAMES, setup=JobSetup(replicas="auto"), plan_cache=cache)
        return time.perf_counter() - start, time.process_time() - cpu, result
    finally:
        heuristic._RANKED_LIMIT = limit


def _goodputs(result) -> dict[str, float]:
    return {name: run.goodput for name, run in result.runs.items()}


def _decisions(result) -> tuple:
    """Every decision of ReCycle and ReCycle+: policy logs (rates to 0.01 samples/s) and the states ReCycle+ ran in."""
    extra = result.extra
    return (extra["recycle_policy"], extra["recycle_plus_policy"],
            [(s["key"], s["partition"]) for s in extra["recycle_plus_states"]])


def _cli_seconds(config_path: str, trace_args: list[str], cache: Path, out: Path) -> tuple[float, float]:
    """Wall and CPU (user + sys) seconds of one `recycle simulate` process: on a loaded machine the CPU seconds
    are what the run costs, the wall seconds what it waited besides."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "recycle", "simulate", "--config", config_path, *trace_args,
                    "--replicas", "auto", "--out", str(out), "--plan-cache", str(cache)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "gpt3-6.7b-a100.toml"))
    parser.add_argument("--traces", nargs="*", help="trace names to run (default: every shipped one and long-400)")
    parser.add_argument("--no-old", action="store_true", help="skip the old path (minutes per trace)")
    parser.add_argument("--no-before", action="store_true", help="skip the plan cache as it was before the cold work")
    parser.add_argument("--keep-cache", metavar="DIR", help="keep each trace's plan cache in DIR/<trace> (default: "
                        "a temporary folder, removed)")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    traces: list[tuple[str, object, list[str]]] = []
    folder = find_traces_dir(ROOT)
    if folder is not None:
        traces += [(p.stem, read_trace(p), ["--trace", str(p)]) for p in sorted(folder.glob("*.csv"))]
    else:
        print("no ../shared/data/traces beside the checkout: the generated trace only", file=sys.stderr)
    traces.append(("long-400", parse_generate_spec(LONG_SPEC), ["--generate", LONG_SPEC]))
    if args.traces:
        traces = [t for t in traces if t[0] in args.traces]

    print("| trace | change points | D | old s (CPU) | before s (CPU) | cold s (CPU) | warm s | CLI warm s (CPU) | "
          "old / cold | before / cold (CPU) | plans made cold | entries read warm | goodput same |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    nan = (float("nan"), float("nan"), None)
    for name, trace, trace_args in traces:
        with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
            cache_dir = Path(args.keep_cache) / name if args.keep_cache else Path(tmp) / "plans"
            old_s, old_cpu, old = _timed(config, trace, None, share_schedules=False) if not args.no_old else nan
            before_s, before_cpu, before = nan if args.no_before else _timed(
                config, trace, PlanCache(Path(tmp) / "before", period_only=False), share_schedules=False)
            cold_s, cold_cpu, cold = _timed(config, trace, PlanCache(cache_dir))
            warm_s, _, warm = _timed(config, trace, PlanCache(cache_dir))
            cli_s, cli_cpu = _cli_seconds(args.config, trace_args, cache_dir, Path(tmp) / "out")
        results = [r for r in (old, before, cold, warm) if r is not None]
        diff = max(abs(a - b) / max(abs(b), 1e-300) for r in results
                   for a, b in zip(_goodputs(r).values(), _goodputs(cold).values()))
        same_decisions = all(_decisions(r) == _decisions(cold) for r in results)
        changes = len(cold.timeline.times_s)
        cold_stats, warm_stats = cold.extra["plan_cache"], warm.extra["plan_cache"]
        print(f"| {name} | {changes} | {cold.extra['num_replicas']} | {old_s:.1f} ({old_cpu:.1f}) | "
              f"{before_s:.1f} ({before_cpu:.1f}) | {cold_s:.1f} ({cold_cpu:.1f}) | {warm_s:.2f} | "
              f"{cli_s:.2f} ({cli_cpu:.2f}) | {old_s / cold_s:.2f}x | {before_s / cold_s:.2f}x "
              f"({before_cpu / cold_cpu:.2f}x) | {cold_stats['misses']} | {warm_stats['hits']} | "
              f"{'yes' if diff == 0 else f'{diff:.0e}' if diff <= 1e-9 else 'NO: ' + str([_goodputs(r) for r in results])}"
              f"{'' if same_decisions else ' (decisions differ)'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
