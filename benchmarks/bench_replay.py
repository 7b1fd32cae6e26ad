"""Replay speed: every default system over each shipped trace and a 400-change-point trace, the path before the plan
cache and the new one (cold and warm cache) side by side in one run, with the ratios and a check that every
system's goodput is unchanged.

Run: nice -n 15 .venv/bin/python benchmarks/bench_replay.py [--config configs/gpt3-6.7b-a100.toml] [--traces NAME ...]
     [--no-old]

Job: the config sized to each trace (`--replicas auto`: D = most live nodes // S, at most 20 here), every default
system (ReCycle+ included), the default costs. Columns, all measured in this process one after the other:
* old: `run_job(..., plan_cache=None)`: the planner's in-process caches only, every weighed key planned (the path
  before this benchmark's change); the planner's caches are emptied first, so each trace starts cold;
* cold: the plan cache in a fresh folder (each plan and partition choice made once, reshapes that cannot pay ruled
  out by a bound before planning their key);
* warm: the same folder again, in-process caches emptied: every plan read from disk and validated;
* CLI warm: the whole `recycle simulate` command (new process: imports, trace, report and plot) on the warm cache.
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


def _timed(config, trace, cache: PlanCache | None):
    _cold_process()
    start = time.perf_counter()
    result = run_job(config, trace, SYSTEM_NAMES, setup=JobSetup(replicas="auto"), plan_cache=cache)
    return time.perf_counter() - start, result


def _goodputs(result) -> dict[str, float]:
    return {name: run.goodput for name, run in result.runs.items()}


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

    header = (f"{'trace':<22} {'changes':>7} {'D':>2} | {'old s':>7} {'cold s':>7} {'warm s':>6} "
              f"{'CLI warm s (CPU s)':>18} | "
              f"{'old/cold':>8} {'old/warm':>8} | {'planned cold':>12} {'read warm':>9} | goodput unchanged")
    print(header)
    print("-" * len(header))
    for name, trace, trace_args in traces:
        with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
            cache_dir = Path(args.keep_cache) / name if args.keep_cache else Path(tmp) / "plans"
            old_s, old = _timed(config, trace, None) if not args.no_old else (float("nan"), None)
            cold_s, cold = _timed(config, trace, PlanCache(cache_dir))
            warm_s, warm = _timed(config, trace, PlanCache(cache_dir))
            cli_s, cli_cpu = _cli_seconds(args.config, trace_args, cache_dir, Path(tmp) / "out")
        same = _goodputs(cold) == _goodputs(warm) and (old is None or _goodputs(old) == _goodputs(cold))
        changes = len(cold.timeline.times_s)
        cold_stats, warm_stats = cold.extra["plan_cache"], warm.extra["plan_cache"]
        print(f"{name:<22} {changes:>7} {cold.extra['num_replicas']:>2} | {old_s:7.1f} {cold_s:7.1f} {warm_s:6.2f} "
              f"{cli_s:9.2f} ({cli_cpu:5.2f}) | {old_s / cold_s:7.2f}x {old_s / warm_s:7.1f}x | {cold_stats['misses']:>12} "
              f"{warm_stats['hits']:>9} | {'yes' if same else 'NO: ' + str((_goodputs(old or cold), _goodputs(warm)))}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
