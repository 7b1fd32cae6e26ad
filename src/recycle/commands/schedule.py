"""`recycle schedule`: build a fault-free schedule for a config, time it, print a summary and write its outputs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from recycle import api
from recycle.commands import add_set_option
from recycle.config import Config, load_config
from recycle.ir.plan import Plan
from recycle.ir.text import write_csv
from recycle.schedules.fault_free import SCHEDULES
from recycle.sim.simulator import SimResult

__all__ = ["register", "run", "summary_dict", "summary_table"]

# Grids wider or taller than this are left out of the text output (the Gantt/trace files show them instead).
_GRID_MAX_WORKERS = 32
_GRID_COLUMNS = 100


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("schedule", help="time a fault-free schedule (GPipe, 1F1B, ZB-H1) on a config",
                                   description="Build a fault-free pipeline schedule for every replica, simulate "
                                   "it and print makespan, period, bubble fraction and peak activations.")
    parser.add_argument("--config", required=True, help="TOML config file, e.g. configs/toy.toml")
    add_set_option(parser)
    parser.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES), help="which schedule")
    parser.add_argument("--staggered", action="store_true",
                        help="per-stage optimizer step (default: all stages step together)")
    parser.add_argument("--iterations", type=int, default=4, help="iterations to simulate (>= 1; default 4)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--gantt", metavar="PNG", help="write a Gantt chart of the simulated iterations")
    parser.add_argument("--trace", metavar="JSON", help="write a Chrome trace (open it at ui.perfetto.dev)")
    parser.add_argument("--csv", metavar="FILE", help="write the plan as CSV (one row per worker)")
    parser.set_defaults(func=run)
    return parser


def summary_dict(plan: Plan, config: Config, result: SimResult) -> dict[str, Any]:
    """The numbers a user asks for, JSON-ready: the simulator's measurements plus what was run."""
    d = result.to_dict()
    d.update({
        "schedule": plan.meta.schedule,
        "config": config.name,
        "time_unit": config.time_unit,
        "num_replicas": plan.num_replicas,
        "num_stages": plan.num_stages,
        "num_microbatches": plan.num_microbatches,
        "plan_actions": plan.num_actions,
    })
    return d


def _time(value: float, unit: str) -> str:
    """Microseconds read better as milliseconds; slots stay as they are."""
    return f"{value / 1000:,.1f} ms" if unit == "us" else f"{value:g}"


def summary_table(plan: Plan, config: Config, result: SimResult) -> str:
    """A few aligned lines: what ran and what it measured."""
    S = plan.num_stages
    unit = config.time_unit
    stage_peaks = "/".join(str(max(result.peak_activations[r] for r in range(s, plan.num_workers, S)))
                           for s in range(S))
    rows = [
        ("schedule", f"{plan.meta.schedule} ({'staggered' if plan.staggered else 'coupled'} optimizer)"),
        ("config", f"{config.name}: D={plan.num_replicas} S={S} M={plan.num_microbatches}, "
                   f"time unit {config.time_unit}"),
        ("makespan", f"{_time(result.makespan, unit)} (first iteration {_time(result.first_makespan, unit)})"),
        ("period", f"{_time(result.period, unit)} over {result.num_iterations} iterations"),
        ("bubble fraction", f"{result.bubble_fraction:.4f}"),
        ("peak activations", f"{stage_peaks} micro-batches per stage (max over replicas)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


MAX_ITERATIONS = 1_000
MAX_SIMULATED_PAIRS = 4 * 1_048_576  # the default 4 iterations of the largest plan a config allows


def run(args: argparse.Namespace) -> int:
    from recycle.errors import ConfigError

    if args.iterations < 1:
        raise ConfigError(f"--iterations = {args.iterations} must be >= 1; pass e.g. --iterations 4")
    if args.iterations > MAX_ITERATIONS:
        raise ConfigError(f"--iterations = {args.iterations} is above the limit of {MAX_ITERATIONS:,} (the period "
                          "settles within a few); pass e.g. --iterations 4")
    config = load_config(args.config, args.set)
    pairs = config.num_replicas * config.num_stages * config.num_microbatches
    if args.iterations * pairs > MAX_SIMULATED_PAIRS:
        raise ConfigError(f"--iterations {args.iterations} x {pairs:,} (stage, micro-batch) pairs of {config.name!r} "
                          f"is above the limit of {MAX_SIMULATED_PAIRS:,} simulated (each ~20 us and, for the charts, "
                          f"~1 KB); use --iterations {max(1, MAX_SIMULATED_PAIRS // pairs)} or fewer")
    plan = api.schedule(config, args.schedule, staggered=args.staggered)
    want_timeline = bool(args.gantt or args.trace) or not args.json
    result = api.simulate(plan, config, iterations=args.iterations, record=want_timeline)
    plan = plan.with_meta(predicted_period=result.period, predicted_makespan=result.makespan)
    written: dict[str, str] = {}
    if args.csv:
        written["csv"] = str(write_csv(plan, args.csv))
    if args.gantt:
        from recycle.report.gantt import write_gantt

        title = (f"{config.name}: {args.schedule}, {'staggered' if args.staggered else 'coupled'} optimizer; "
                 f"period {_time(result.period, config.time_unit)}, makespan "
                 f"{_time(result.makespan, config.time_unit)}" + ("" if config.time_unit == "us" else " slots"))
        written["gantt"] = str(write_gantt(result, plan, args.gantt, title=title, time_unit=config.time_unit))
    if args.trace:
        from recycle.report.chrome_trace import write_chrome_trace

        written["trace"] = str(write_chrome_trace(result, plan, args.trace))
    if args.json:
        d = summary_dict(plan, config, result)
        d["written"] = written
        print(json.dumps(d))
        return 0
    print(summary_table(plan, config, result))
    if plan.num_workers <= _GRID_MAX_WORKERS:
        from recycle.report.grid import timed_grid

        print()
        print(timed_grid(result, plan, iteration=0, columns=_GRID_COLUMNS))
    for what, path in written.items():
        print(f"wrote {what}: {Path(path)}")
    return 0
