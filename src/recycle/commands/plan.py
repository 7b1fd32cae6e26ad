"""`recycle plan`: plan one failure state (print, JSON, Gantt) or precompute a plan store for up to F failures."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recycle import api
from recycle.commands import add_set_option
from recycle.config import Config, load_config
from recycle.errors import PlanError
from recycle.ir.plan import Plan
from recycle.ir.validate import format_grid
from recycle.ir.worker import workers_text
from recycle.planner.api import ROUTINGS, SOLVERS, baseline_1f1b_period, fault_free_period, resolve_options
from recycle.planner.failures import normalize, parse_worker
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import traffic
from recycle.report.units import human_time, speed_words
from recycle.sim.simulator import SimResult

if TYPE_CHECKING:
    from recycle.planner.partition import PartitionChoice

__all__ = ["register", "run", "plan_summary"]

_GRID_MAX_WORKERS = 32  # larger plans are left out of the text output (use --gantt or --json)
# --compare auto: plan the fault-free references only up to this many actions per iteration (two extra plans and
# simulations: ~10 s at D=64, S=16, M=128).
COMPARE_AUTO_LIMIT = 20_000


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan", help="adaptive plan for failed workers, or a plan store for up to F failures",
        description="Plan a failure state: re-route the failed workers' micro-batches to surviving peers of the "
                    "same stage and schedule every worker (decoupled backward and staggered optimizer on by "
                    "default). With --max-failures F --out DIR, precompute the plan of every normalized failure "
                    "state with at most F failures into a plan store.")
    parser.add_argument("--config", required=True, help="TOML config file, e.g. configs/toy.toml")
    add_set_option(parser)
    parser.add_argument("--fail", action="append", default=[], metavar="R:S",
                        help="failed worker replica:stage (repeat for several), e.g. --fail 1:2")
    parser.add_argument("--solver", choices=SOLVERS, default="heuristic",
                        help="heuristic list scheduler (ms) or exact CP-SAT warm-started from it (default heuristic)")
    parser.add_argument("--time-limit", type=float, default=10.0, metavar="S",
                        help="seconds per state for the exact solver (default 10)")
    parser.add_argument("--no-decouple", action="store_true", help="fused backward only (no B/W split)")
    parser.add_argument("--no-stagger", action="store_true",
                        help="all stages step together after all work (default: staggered per-stage step)")
    parser.add_argument("--memory-cap", default=None, metavar="{N,1f1b,none}",
                        help="live micro-batches per worker: N, '1f1b' (fault-free 1F1B peak per stage) or 'none' "
                             "(the config's memory budget; the default)")
    parser.add_argument("--no-search", action="store_true",
                        help="priority rules only: skip the local search that small instances above the lower "
                             "bound get (a fixed work budget: up to ~0.1 s per plan)")
    parser.add_argument("--split-microbatches", action="store_true",
                        help="also try cutting a failed worker's micro-batches into pieces shared equally by its "
                             "stage's survivors; kept when the simulated period is strictly lower (meta.notes says)")
    parser.add_argument("--routing", choices=ROUTINGS, default="traffic",
                        help="failure sets no pipeline relabelling covers: plan the real layout so only failed "
                             "workers' micro-batches move (traffic, default) or relabel the key's canonical plan per "
                             "stage (canonical; moves healthy micro-batches too)")
    parser.add_argument("--compare", choices=("auto", "yes", "no"), default="auto",
                        help="also plan the fault-free references (fault-free 1F1B and the planner's own fault-free "
                             f"plan) for the slowdown figures; auto (default): only up to {COMPARE_AUTO_LIMIT:,} "
                             "actions per iteration")
    parser.add_argument("--repartition", action="store_true",
                        help="also choose how many layers each stage holds for this failure state (balanced work "
                             "per live worker within the memory caps; needs [model] layers_per_stage or n_layer) and "
                             "print the partition beside re-routing alone and the ideal live-proportional period")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    parser.add_argument("--gantt", metavar="PNG", help="write a Gantt chart of the simulated iterations")
    parser.add_argument("--save", metavar="FILE", help="write the plan (real ranks) for the runtime, as --format says")
    parser.add_argument("--format", choices=("json", "pipelining-csv"), default="json",
                        help="what --save writes: json (the recycle runtime's plan, default) or pipelining-csv (one "
                             "replica's pipeline as torch.distributed.pipelining's compute-only schedule CSV; "
                             "cannot express cross-pipeline re-routing, see docs/api.md)")
    parser.add_argument("--replica", type=int, default=0, metavar="R",
                        help="with --format pipelining-csv: the replica whose pipeline to write (default 0)")
    parser.add_argument("--max-failures", type=int, metavar="F", help="build a plan store for up to F failures")
    parser.add_argument("--out", metavar="DIR", help="plan store folder (with --max-failures)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N", help="processes for building a store")
    parser.set_defaults(func=run)
    return parser


def _options(args: argparse.Namespace, config: Config) -> PlannerOptions:
    return api.planner_options(config, decoupled=not args.no_decouple, staggered=not args.no_stagger,
                               memory_cap=args.memory_cap, search=not args.no_search,
                               split_microbatches=args.split_microbatches)


def plan_summary(plan: Plan, config: Config, result: SimResult, options: PlannerOptions,
                 compare: bool = True) -> dict[str, Any]:
    """The numbers `recycle plan --json` prints: all timing from the simulator, bound and (with `compare`) the
    fault-free references; without `compare` those four fields are None."""
    S = plan.num_stages
    moves = traffic(plan.host, plan.num_microbatches, plan.failed, plan.chunk_stages,
                    [plan.owner(mb) for mb in range(plan.num_microbatch_ids)])
    free = fault_free_period(config, options) if compare else None
    baseline = baseline_1f1b_period(config, options) if compare else None
    lb = plan.meta.lower_bound
    return {
        "config": config.name,
        "time_unit": config.time_unit,
        "num_replicas": plan.num_replicas,
        "num_stages": S,
        "num_microbatches": plan.num_microbatches,
        "failed": sorted([list(w) for w in plan.failed]),
        "failure_key": list(plan.meta.failure_key),
        "solver": plan.meta.solver,
        "status": plan.meta.status,
        "decoupled": options.decoupled,
        "staggered": options.staggered,
        "memory_cap": list(options.memory_cap) if options.memory_cap is not None else None,
        "period": result.period,
        "makespan": result.makespan,
        "lower_bound": lb,
        "gap": (result.period - lb) / result.period if lb is not None and result.period > 0 else None,
        # The paper's fault-free reference: 1F1B with a fused backward (what ReCycle runs with nothing failed, at
        # 1F1B's memory). The planner's own plan for no failures under the same options is reported beside it: with
        # decoupling and no memory cap it is a zero-bubble-like schedule that leaves fewer bubbles to absorb work.
        "fault_free_period": baseline,
        "slowdown": result.period / baseline if baseline else None,
        "planner_fault_free_period": free,
        "slowdown_vs_planner_fault_free": result.period / free if free else None,
        "throughput_mb_per_unit": plan.total_microbatches / result.period if result.period > 0 else None,
        "bubble_fraction": result.bubble_fraction,
        # Chunked plans ([topology] chunks_per_worker = C > 1) count chunk activations, 1/C of a stage's each.
        "chunks_per_worker": plan.chunks,
        "peak_activations": list(result.peak_activations),
        "peak_activations_per_stage": [max(result.peak_activations[r] for r in range(s, plan.num_workers, S))
                                       for s in range(S)],
        "decoupled_backwards": len(plan.decoupled_pairs),
        # Traffic per iteration: (stage, mb) pairs run off their own pipeline (and how many of those belong to a
        # live worker), activations + input-gradients sent between pipelines, and between nodes when the config's
        # [topology] workers_per_node says which workers share one.
        **moves,
        "cross_node_messages": cross_node_messages(plan, config) if config.topology.workers_per_node else None,
        # The routing the plan actually uses: "traffic-aware" when only the failed workers' micro-batches leave
        # their pipeline (nested sets relabelled, or planned on the real ranks), "canonical" when healthy ones move
        # too (the key's plan relabelled per stage: --routing canonical, --solver exact, or the fall-back below).
        "routing": "traffic-aware" if moves["moved_healthy"] == 0 else "canonical",
        # Why a failure set planned with traffic-aware routing got the canonical plan instead (it was faster);
        # None when it did not fall back.
        "routing_fallback": plan.meta.routing_fallback or None,
        "notes": plan.meta.notes,
    }


def cross_node_messages(plan: Plan, config: Config) -> int:
    """Forward activations and input-gradients per iteration whose sender and receiver are on different nodes."""
    node = config.topology.node
    count = 0
    for s in range(plan.num_chunks - 1):  # consecutive stages, or chunks when chunked
        here, there = plan.host[s], plan.host[s + 1]
        for mb in range(plan.num_microbatch_ids):
            if node(plan.chunk_rank(here[mb], s)) != node(plan.chunk_rank(there[mb], s + 1)):
                count += 2
    return count


def _summary_text(d: dict[str, Any]) -> str:
    cap = "none" if d["memory_cap"] is None else "/".join(map(str, d["memory_cap"]))
    failed = workers_text(map(tuple, d["failed"])) or "none"
    unit = d["time_unit"]

    def t(value: float) -> str:
        return human_time(value, unit)

    gap = f"  (gap {100 * d['gap']:.1f}%)" if d["gap"] is not None else ""
    compared = d["fault_free_period"] is not None
    versus_1f1b = speed_words(d["period"], d["fault_free_period"], "fault-free 1F1B") if compared else ""
    versus_own = speed_words(d["period"], d["planner_fault_free_period"], "the planner's fault-free plan") \
        if compared else ""
    rows = [
        ("config", f"{d['config']}: D={d['num_replicas']} S={d['num_stages']} M={d['num_microbatches']}, "
                   f"time unit {d['time_unit']}"),
        ("failed", f"{failed} (key {tuple(d['failure_key'])})"),
        ("options", f"{'decoupled' if d['decoupled'] else 'fused'} backward, "
                    f"{'staggered' if d['staggered'] else 'coupled'} optimizer, memory cap {cap}"),
        ("solver", f"{d['solver']} ({d['status']}); {d['notes']}"),
        ("period", f"{t(d['period'])}  ({versus_1f1b} at {t(d['fault_free_period'])}; {versus_own} at "
                   f"{t(d['planner_fault_free_period'])})" if d["fault_free_period"] is not None else
                   f"{t(d['period'])}  (fault-free comparisons skipped: pass --compare yes)"),
        ("makespan", t(d["makespan"])),
        ("lower bound", f"{t(d['lower_bound'])}{gap}" if d["lower_bound"] is not None else "none"),
        ("peak activations", "/".join(map(str, d["peak_activations_per_stage"]))
         + (" micro-batches per stage (max over replicas)" if d["chunks_per_worker"] == 1 else
            f" chunk activations per stage (max over replicas; {d['chunks_per_worker']} make one micro-batch's)")),
        ("traffic", f"{d['moved_microbatches']} (stage, micro-batch) pairs off their pipeline ({d['moved_healthy']} of "
                    f"live workers); {d['cross_pipeline_messages']} cross-pipeline messages per iteration"
                    + (f", {d['cross_node_messages']} cross-node" if d["cross_node_messages"] is not None else "")),
    ]
    if d.get("routing_fallback"):
        rows.append(("routing", f"fell back to the {d['routing_fallback']}"))
    elif d["routing"] == "canonical":
        rows.append(("routing", "canonical: the failure key's plan relabelled per stage (healthy micro-batches "
                                "move too)"))
    part = d.get("partition")
    if part is not None:
        moved = "" if part["partition"] != part["configured"] else " (kept: no partition is faster)"
        rows.append(("layers per stage", f"{'/'.join(map(str, part['partition']))}{moved}; configured "
                     f"{'/'.join(map(str, part['configured']))} re-routing alone {t(part['configured_period'])}, "
                     f"ideal live-proportional {t(part['ideal_period'])}; {part['evaluated']} partitions screened"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


class _LineSink:
    """A text stream for build_store's progress that hands each complete line to `report` (a bar or plain lines)."""

    def __init__(self, report) -> None:
        self.report, self.pending = report, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.report(line)
        return len(text)

    def flush(self) -> None:
        pass


def _build_store(args: argparse.Namespace, config: Config, options: PlannerOptions) -> int:
    if args.fail:
        raise PlanError("--fail and --max-failures are exclusive: --fail plans one state, --max-failures F --out "
                        "DIR precomputes every state with up to F failures")
    if not args.out:
        raise PlanError("--max-failures needs --out DIR, the folder to write the plan store to")
    from recycle.progress import progress_lines

    with progress_lines("plan store") as report:
        index = api.plan_store(config, args.max_failures, args.out, options=options, solver=args.solver,
                               time_limit=args.time_limit, jobs=args.jobs, progress=_LineSink(report))
    print(f"wrote plan store: {index}")
    return 0


MAX_TIME_LIMIT_S = 86_400.0  # a day per failure state for the exact solver


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.time_limit) and 0 < args.time_limit <= MAX_TIME_LIMIT_S):
        raise PlanError(f"--time-limit {args.time_limit:g} must be a number of seconds in (0, {MAX_TIME_LIMIT_S:g}] "
                        "(how long the exact solver may take per failure state), e.g. 10")
    config = load_config(args.config, args.set)
    options = _options(args, config)
    if args.max_failures is not None:
        if args.repartition:
            raise PlanError("--repartition plans one failure state (--fail ...); a plan store keeps the configured "
                            "partition for every key: drop --repartition or --max-failures")
        return _build_store(args, config, options)
    if args.format != "json" and not args.save:
        raise PlanError(f"--format {args.format} says what --save writes; add --save FILE")
    if args.out:
        raise PlanError("--out is for building a plan store and needs --max-failures F; to save one plan use "
                        "--save FILE")
    failed = [parse_worker(text, config.num_replicas, config.num_stages) for text in args.fail]
    normalize(failed, config.num_replicas, config.num_stages)  # a stage without survivors fails here, clearly
    plan, choice, timing = _make_plan(args, config, options, failed)
    options = resolve_options(config, options)
    result = api.simulate(plan, timing, record=bool(args.gantt))
    compare = args.compare == "yes" or (args.compare == "auto" and plan.num_actions <= COMPARE_AUTO_LIMIT)
    summary = plan_summary(plan, config, result, options, compare)
    if choice is not None:
        summary["memory_cap"] = list(plan.meta.memory_cap) or None
    summary["partition"] = choice.to_dict() if choice is not None else None
    written = _write_outputs(args, plan, config, result, summary)
    if args.json:
        summary["written"] = written
        print(json.dumps(summary))
        return 0
    print(_summary_text(summary))
    if plan.num_workers <= _GRID_MAX_WORKERS:
        print()
        print(format_grid(plan, max_cols=60))
    for what, path in written.items():
        print(f"wrote {what}: {Path(path)}")
    return 0


def _make_plan(args: argparse.Namespace, config: Config, options: PlannerOptions,
               failed: list[tuple[int, int]]) -> tuple[Plan, PartitionChoice | None, Config]:
    """(plan, the partition chosen with --repartition, the config the simulator times the plan with)."""
    if not args.repartition:
        plan = api.plan(config, failed, options=options, solver=args.solver, time_limit=args.time_limit,
                        routing=args.routing)
        return plan, None, config
    from recycle.planner.partition import make_repartitioned_plan, partition_config

    # The config's memory budget is re-derived for each partition (a stage that gains layers holds fewer
    # micro-batches); an explicit --memory-cap N / 1f1b is kept as given.
    explicit = args.memory_cap is not None and args.memory_cap.strip().lower() != "none"
    plan, choice = make_repartitioned_plan(config, failed, options if explicit else
                                           replace(options, memory_cap=None), args.solver, args.routing,
                                           time_limit_s=args.time_limit)
    return plan, choice, partition_config(config, plan.partition)  # the simulator times the plan on its own layers


def _write_outputs(args: argparse.Namespace, plan: Plan, config: Config, result: SimResult,
                   summary: dict[str, Any]) -> dict[str, str]:
    """Write --save (plan JSON or torch's pipelining CSV) and --gantt; what was written -> its path."""
    written: dict[str, str] = {}
    if args.save:
        from recycle.fileio import atomic_write_text

        if args.format == "pipelining-csv":
            from recycle.ir.pipelining import pipelining_csv

            written["pipelining csv"] = str(atomic_write_text(args.save, pipelining_csv(plan, args.replica)))
            print(f"note: {args.save}: replica {args.replica}'s pipeline; the optimizer step (OPT) is left out "
                  "(torch's runtime reduces gradients itself and steps after schedule.step())", file=sys.stderr)
        else:
            written["plan"] = str(atomic_write_text(args.save, plan.to_json()))
    if args.gantt:
        from recycle.report.gantt import write_gantt  # matplotlib: only when a chart is asked for
        period = human_time(result.period, config.time_unit) + ("" if config.time_unit == "us" else " slots")
        title = f"{config.name}: failed {' '.join(args.fail) or 'none'}, {summary['solver']}; period {period}"
        written["gantt"] = str(write_gantt(result, plan, args.gantt, title=title, time_unit=config.time_unit))
    return written
