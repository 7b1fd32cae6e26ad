"""Replay speed: every default system over each shipped trace and a 400-change-point trace, the path before the plan
cache, the plan cache before issue 27 item 4's cold-replay work and the current one (cold and warm cache) side by
side in one run, with the ratios and a check that every system's goodput is unchanged.

Run: nice -n 10 .venv/bin/python benchmarks/bench_replay.py [--config configs/gpt3-6.7b-a100.toml] [--traces NAME ...]
     [--no-old] [--no-before]
     nice -n 10 .venv/bin/python benchmarks/bench_replay.py --compare-with COMMIT [--traces NAME ...]
     nice -n 10 .venv/bin/python benchmarks/bench_replay.py --screens [--traces NAME ...]

--compare-with COMMIT: cold replays only, the commit's src/ (from `git archive`) and this tree's, each in a child
interpreter with a fresh plan cache folder, one after the other per trace: wall and CPU seconds, plans made (cache
misses, and the heuristic plans behind them), and whether every system's goodput and every decision of ReCycle
and ReCycle+ (time and policy of each log entry, the states ReCycle+ ran in) are identical. Against a commit
from before quick partition screens (below), ReCycle+'s goodput and decisions may differ: that is the change of
plan `--screens` measures.

--screens: cold replays of this tree only, in child interpreters, with ReCycle+'s exact partition screens (every
priority rule: `run_job(..., exact_screens=True)`, `recycle simulate --exact-screens`) and then with the default
quick ones (the first QUICK_SCREEN_RULES rules): CPU seconds and every system's goodput in both, with its relative
change (quick screens are a change of plan: the partition polished may differ).

Job: the config sized to each trace (`--replicas auto`: D = most live nodes // S, at most 20 here), every default
system (ReCycle+ included), the default costs. Columns, all measured in this process one after the other (wall
seconds; CPU seconds of this process beside the cold ones, since the machine is shared):
* old: `run_job(..., plan_cache=None)`: the planner's in-process caches only, every weighed key planned by
  `plan_for_key` (the path before the plan cache), rule schedules not shared between plans;
* before: the plan cache in a fresh folder as it was before the cold-replay work: every key planned in full by
  `plan_for_key` (`PlanCache(period_only=False)`), rule schedules not shared (`heuristic._RANKED_LIMIT = 0`, and no
  list schedule or simulation kept);
* cold: the plan cache in a fresh folder now: `period_plan_for_key` (a plan ends at the first schedule the planner
  is sure to pick once it reaches the lower bound) and a key planned without and then with the search reuses its
  rule schedules, and any list schedule or candidate simulation asked for again is reused;
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
import json
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
    limits = heuristic._RANKED_LIMIT, heuristic._SCHEDULES_LIMIT, heuristic._SCORED_LIMIT
    if not share_schedules:
        heuristic._RANKED_LIMIT = heuristic._SCHEDULES_LIMIT = heuristic._SCORED_LIMIT = 0
    try:
        start, cpu = time.perf_counter(), time.process_time()
        result = run_job(config, trace, SYSTEM_NAMES, setup=JobSetup(replicas="auto"), plan_cache=cache)
        return time.perf_counter() - start, time.process_time() - cpu, result
    finally:
        heuristic._RANKED_LIMIT, heuristic._SCHEDULES_LIMIT, heuristic._SCORED_LIMIT = limits


def _goodputs(result) -> dict[str, float]:
    return {name: run.goodput for name, run in result.runs.items()}


def _decisions(result) -> tuple:
    """Every decision of ReCycle and ReCycle+: the policy logs (ReCycle's with its rates to 0.01 samples/s; ReCycle+'s
    time and policy of each entry: with the plan cache, a layer move made against the left layout's rate bound logs
    the bound, the path without it the planned rate) and the states ReCycle+ ran in."""
    extra = result.extra
    return (extra["recycle_policy"], [(e["time_s"], e["policy"]) for e in extra["recycle_plus_policy"]],
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


# The --compare-with child: one cold replay with a fresh cache folder, printed as JSON (floats round-trip exactly).
CHILD = r"""
import json, sys, tempfile, time
from pathlib import Path
import recycle.planner.api as planner_api
from recycle.config import load_config
from recycle.traces.experiments import SYSTEM_NAMES, JobSetup, run_job
from recycle.traces.generate import parse_generate_spec
from recycle.traces.plan_cache import PlanCache
from recycle.traces.reader import read_trace

config_path, kind, value = sys.argv[1:4]
screens = {"exact_screens": sys.argv[4] == "exact"} if len(sys.argv) > 4 else {}  # older trees: their default
trace = read_trace(value) if kind == "--trace" else parse_generate_spec(value)
plans = []
real = planner_api.schedule_heuristic
planner_api.schedule_heuristic = lambda *a, **k: plans.append(1) or real(*a, **k)
with tempfile.TemporaryDirectory(prefix="bench-replay-child-") as tmp:
    start, cpu = time.perf_counter(), time.process_time()
    result = run_job(load_config(config_path), trace, SYSTEM_NAMES, setup=JobSetup(replicas="auto"),
                     plan_cache=PlanCache(Path(tmp) / "plans"), **screens)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
extra = result.extra
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "misses": extra["plan_cache"]["misses"], "plans": len(plans),
                  "D": extra["num_replicas"], "changes": len(result.timeline.times_s),
                  "goodput": {name: run.goodput for name, run in result.runs.items()},
                  "decisions": [[(e["time_s"], e["policy"]) for e in extra[log]]
                                for log in ("recycle_policy", "recycle_plus_policy")],
                  "states": [(s["key"], s["partition"], s["seconds"]) for s in extra["recycle_plus_states"]]}))
"""


def _cold_child(src: Path, config: str, trace_args: list[str], screens: str | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, config, *trace_args, *([screens] if screens else [])],
                         check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(src)})
    return json.loads(out.stdout)


def compare_with(commit: str, config: str, traces: list[tuple[str, object, list[str]]]) -> int:
    """Cold replays of `commit` and this tree side by side (see the module docstring); 1 if any result differs."""
    print(f"| trace | change points | D | {commit} cold s (CPU s) | this tree cold s (CPU s) | CPU ratio | "
          "plans made (heuristic plans) | goodput same | decisions same |")
    print("|---|---|---|---|---|---|---|---|---|")
    differs = False
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        archive = subprocess.run(["git", "archive", commit, "src"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        for name, _, trace_args in traces:
            old = _cold_child(Path(tmp) / "src", config, trace_args)
            new = _cold_child(ROOT / "src", config, trace_args)
            same_goodput = old["goodput"] == new["goodput"]
            same_decisions = (old["decisions"], old["states"]) == (new["decisions"], new["states"])
            differs |= not (same_goodput and same_decisions)
            print(f"| {name} | {new['changes']} | {new['D']} | {old['wall_s']:.1f} ({old['cpu_s']:.1f}) | "
                  f"{new['wall_s']:.1f} ({new['cpu_s']:.1f}) | {old['cpu_s'] / new['cpu_s']:.2f}x | "
                  f"{old['misses']} ({old['plans']}) -> {new['misses']} ({new['plans']}) | "
                  f"{'yes' if same_goodput else 'NO: ' + str((old['goodput'], new['goodput']))} | "
                  f"{'yes' if same_decisions else 'NO'} |", flush=True)
    return 1 if differs else 0


def compare_screens(config: str, traces: list[tuple[str, object, list[str]]]) -> int:
    """Cold replays of this tree with exact partition screens (every rule) and quick ones (the default), one after
    the other per trace: CPU seconds and every system's goodput, old and new (a change of plan, measured as one)."""
    print("| trace | change points | D | exact screens s (CPU s) | quick screens s (CPU s) | CPU ratio | "
          "plans made (heuristic plans) | goodput exact -> quick per system (relative change) | decisions same |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, _, trace_args in traces:
        old = _cold_child(ROOT / "src", config, trace_args, "exact")
        new = _cold_child(ROOT / "src", config, trace_args, "quick")
        goodput = "; ".join(
            f"{system} {old['goodput'][system]:.6f} -> {value:.6f}"
            f" ({(value - old['goodput'][system]) / old['goodput'][system]:+.2e})"
            if old["goodput"][system] else f"{system} {old['goodput'][system]:.6f} -> {value:.6f}"
            for system, value in new["goodput"].items())
        same_decisions = (old["decisions"], old["states"]) == (new["decisions"], new["states"])
        print(f"| {name} | {new['changes']} | {new['D']} | {old['wall_s']:.1f} ({old['cpu_s']:.1f}) | "
              f"{new['wall_s']:.1f} ({new['cpu_s']:.1f}) | {old['cpu_s'] / new['cpu_s']:.2f}x | "
              f"{old['misses']} ({old['plans']}) -> {new['misses']} ({new['plans']}) | {goodput} | "
              f"{'yes' if same_decisions else 'NO'} |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "gpt3-6.7b-a100.toml"))
    parser.add_argument("--traces", nargs="*", help="trace names to run (default: every shipped one and long-400)")
    parser.add_argument("--no-old", action="store_true", help="skip the old path (minutes per trace)")
    parser.add_argument("--no-before", action="store_true", help="skip the plan cache as it was before the cold work")
    parser.add_argument("--keep-cache", metavar="DIR", help="keep each trace's plan cache in DIR/<trace> (default: "
                        "a temporary folder, removed)")
    parser.add_argument("--compare-with", metavar="COMMIT", help="cold replays of COMMIT and this tree side by side "
                        "(child interpreters; nothing else is run)")
    parser.add_argument("--screens", action="store_true", help="cold replays of this tree with exact and with "
                        "quick partition screens side by side, every system's goodput in each (nothing else is run)")
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
    if args.compare_with:
        return compare_with(args.compare_with, args.config, traces)
    if args.screens:
        return compare_screens(args.config, traces)

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
