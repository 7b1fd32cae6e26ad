"""`recycle simulate`: replay a failure trace over a training job for ReCycle and the baseline models."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from recycle.api import load_trace, simulate_trace
from recycle.commands import add_set_option
from recycle.config import load_config
from recycle.errors import ConfigError
from recycle.traces.experiments import SYSTEM_NAMES, JobSetup, check_replay, check_systems
from recycle.traces.generate import GENERATE_HELP
from recycle.traces.model import JobCosts
from recycle.traces.placement import PLACEMENT_HELP, PLACEMENTS
from recycle.traces.report import PLUS_DECISIONS, write_report

__all__ = ["register", "run"]


# JobCosts knobs a user can set from the command line (--detect-s ...).
COST_FLAGS = ("detect_s", "plan_switch_s", "redo_fraction", "restart_s", "checkpoint_interval_s", "checkpoint_cost_s",
              "fallback_checkpoint_interval_s", "fallback_checkpoint_cost_s", "checkpoint_every_steps",
              "checkpoint_latency_s", "steps_done_at_start", "oobleck_reconfig_s",
              "bamboo_reconfig_s", "bamboo_rc_overhead", "reshape_horizon_s", "repartition_prior_s",
              "torchft_detect_s", "torchft_quorum_s", "torchft_lost_step_fraction", "torchft_heal_bytes_per_s",
              "torchft_restart_s")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate", help="replay a failure trace over a job: ReCycle vs baseline models",
        description="Replay a failure/availability trace over a D x S training job and compare ReCycle with "
                    "baseline models (fault-free, fault-scaled, checkpoint-restart, Oobleck-like, Bamboo-like, "
                    "torchft-like). Writes DIR/report.md (with every ReCycle+ decision), DIR/throughput.png and "
                    "DIR/summary.json; stdout gets the summary. Plans are kept in a cache folder across runs "
                    "(--plan-cache), so a second replay of the same job plans nothing.")
    p.add_argument("--config", required=True, help="job config (TOML), e.g. configs/gpt3-6.7b-a100.toml")
    add_set_option(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="failure trace (CSV): time_ms,add|remove,node events, time_ms,live counts, or "
                     "Bamboo's 'YYYY-MM-DD, HH:MM:SS, live' availability logs (detected from the first data line)")
    src.add_argument("--generate", metavar="SPEC", help=GENERATE_HELP)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--json", action="store_true", help="print one JSON object with the summary on stdout")
    p.add_argument("--systems", nargs="+", default=list(SYSTEM_NAMES), metavar="SYSTEM",
                   help=f"systems to replay (default: all of {', '.join(SYSTEM_NAMES)})")
    p.add_argument("--strict", action="store_true", help="fail on repeated or out-of-order trace events instead "
                   "of fixing them (the fixes are always counted and reported)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per trace node (default 1: a node is a GPU)")
    p.add_argument("--replicas", choices=("keep", "auto"), default="keep",
                   help="keep the config's D, or size D to the trace (most live units // S; the rest are spares)")
    p.add_argument("--period-model", choices=("auto", "planner", "estimate"), default="auto",
                   help="ReCycle's period per failure state: the planner (cached per key) or the closed-form "
                        "estimate (for very large jobs)")
    p.add_argument("--reference", choices=("1f1b", "planner"), default="1f1b",
                   help="fault-free reference: plain 1F1B as in the paper (ReCycle capped at it), or ReCycle's "
                        "own fault-free plan")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--plan-cache", metavar="DIR", default=None,
                       help="folder of plans kept across runs, keyed by the config's planning values, the failure "
                            "key, the layer partition and the code version; every entry is validated when read "
                            "(default: $RECYCLE_CACHE_DIR, else $XDG_CACHE_HOME/recycle/plans, else "
                            "~/.cache/recycle/plans)")
    cache.add_argument("--no-plan-cache", action="store_true",
                       help="keep nothing on disk: each plan is still made only once within the run")
    p.add_argument("--slot-seconds", type=float, default=1.0, help="seconds per slot for slot-unit configs")
    p.add_argument("--seed", type=int, default=0, help="seed for availability traces (which nodes fail; also the "
                   "default seed of --generate paper-gcp)")
    p.add_argument("--placement", choices=PLACEMENTS, default=None,
                   help=f"availability traces (a time_ms,live --trace, or --generate paper-gcp without a placement "
                        f"key): {PLACEMENT_HELP}. Default random (reproducible with --seed); spread and worst act on "
                        "the job's grid (config stages and replicas, --gpus-per-node, --replicas)")
    costs = JobCosts()
    for name in COST_FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(costs, name),
                       help=f"(default {getattr(costs, name)})")
    p.add_argument("--torchft-regroup", action="store_true",
                   help="torchft-like pools the idle survivors of broken replica groups into complete groups instead "
                        "of each group waiting for its own repair")
    p.add_argument("--runtime-layout", action="store_true",
                   help="ReCycle follows the runtime's layout rules: a node that comes back takes back its slot, a "
                        "lost stage is refilled by moving workers within their pipelines, no reshape")
    p.add_argument("--restore-expected-loss", action="store_true",
                   help="ReCycle's restores lose the expected progress since the newest complete checkpoint (half "
                        "an interval plus the latency), not what the replay's own checkpoint phase gives; needs "
                        "--checkpoint-every-steps (or --calibrate-checkpoints)")
    p.add_argument("--calibrate-from", metavar="METRICS",
                   help="a `recycle train --metrics` file: ReCycle's detect, plan-switch and restart pauses and its "
                        "redone share are fitted to its recoveries (replacing those flags); slots are "
                        "--slot-seconds long")
    p.add_argument("--calibrate-checkpoints", metavar="DIR",
                   help="with --calibrate-from: that run's --checkpoint-dir; its files give the checkpoint interval "
                        "and how long after its step a checkpoint is restorable")
    p.add_argument("--no-reshape", action="store_true",
                   help="ReCycle never reshapes into D' = live // S pipelines; it only re-routes on the D x S grid "
                        "(and restores from the checkpoint when a stage is lost)")
    p.add_argument("--split-microbatches", action="store_true",
                   help="ReCycle+ may cut a failed worker's micro-batches into pieces so every survivor of its stage "
                        "carries an equal share, where the plan is strictly faster (ReCycle keeps whole ones)")
    p.add_argument("--exact-screens", action="store_true",
                   help="ReCycle+ screens each candidate layer partition with every priority rule (slower) instead "
                        "of the first two; the partition it polishes, and so its goodput, may differ slightly")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    check_systems(args.systems)  # before the config and the trace are read
    config = load_config(args.config, args.set)
    costs = JobCosts(**{name: getattr(args, name) for name in COST_FLAGS}, reshape=not args.no_reshape,
                     torchft_regroup=args.torchft_regroup, runtime_layout=args.runtime_layout)
    JobSetup(gpus_per_node=args.gpus_per_node, slot_seconds=args.slot_seconds)  # checks both before the trace is read
    if args.calibrate_checkpoints and not args.calibrate_from:
        raise ConfigError("--calibrate-checkpoints DIR needs --calibrate-from METRICS (the same run's --metrics file)")
    if args.calibrate_from:
        from recycle.traces.calibration import calibrate, iteration_work_units, read_metrics

        fit = calibrate(read_metrics(args.calibrate_from), iteration_work_units(config) * args.slot_seconds,
                        args.calibrate_checkpoints or "")
        costs = fit.costs(costs)
        print(f"calibrated from {args.calibrate_from}: {fit.describe()}", file=sys.stderr)
    costs = replace(costs, restore_expected_loss=args.restore_expected_loss)  # checked once the interval is known
    trace = load_trace(config, args.trace, generate=args.generate or "", seed=args.seed,
                       placement=args.placement or "random", gpus_per_node=args.gpus_per_node, replicas=args.replicas,
                       strict=args.strict)
    check_replay(trace, args.gpus_per_node, config.topology.gpus_per_worker, costs)  # before the notes on it
    if args.placement and not trace.placement:
        raise ConfigError(f"--placement {args.placement} applies to availability traces (counts of live nodes), but "
                          f"{trace.source} is an event trace that already names the failing nodes; drop --placement")
    if trace.placement:
        print(f"note: {trace.source}: availability counts -> failing workers: placement {trace.placement}",
              file=sys.stderr)
    for message in trace.notes.messages():
        print(f"warning: {trace.source}: {message}", file=sys.stderr)
    from recycle.progress import progress_lines
    from recycle.traces.plan_cache import default_cache_dir

    plan_cache = None if args.no_plan_cache else (args.plan_cache or default_cache_dir())
    with progress_lines("trace replay") as report:
        result = simulate_trace(config, trace, systems=args.systems, gpus_per_node=args.gpus_per_node,
                                replicas=args.replicas, slot_seconds=args.slot_seconds,
                                period_model=args.period_model, reference=args.reference, costs=costs,
                                progress=report, plan_cache=plan_cache,
                                split_microbatches=args.split_microbatches, exact_screens=args.exact_screens)
    cache = result.extra.get("plan_cache")
    if cache and (cache["hits"] or cache["misses"]):
        where = f"plan cache {cache['folder']}" if cache["folder"] else "plans (no cache on disk)"
        print(f"{where}: {cache['hits']} read, {cache['misses']} planned, {cache['rejected']} rejected",
              file=sys.stderr)
    for name, why in result.extra.get("skipped", {}).items():
        print(f"note: {name} skipped: {why}", file=sys.stderr)
    summary = write_report(result, args.out, title=f"{config.name} over {trace.source}")
    print(f"wrote {args.out}/report.md, throughput.png, summary.json", file=sys.stderr)
    goodput_ratio, mean_ratio = summary["recycle_goodput_ratio_to"], summary["recycle_mean_ratio_to"]
    if args.json:
        out: dict = {"fault_free_throughput": summary["fault_free_throughput"]}
        for name, run_summary in summary["systems"].items():
            out[name] = {"goodput": run_summary["goodput"], "mean_throughput": run_summary["mean_throughput"],
                         "recycle_ratio_goodput": goodput_ratio.get(name),
                         "recycle_ratio_mean": mean_ratio.get(name), "reason": run_summary["reason"]}
        print(json.dumps(out, sort_keys=True, allow_nan=False))
    else:
        for name, run_summary in summary["systems"].items():
            line = (f"{name:20s} goodput {run_summary['goodput']:6.1%}   mean {run_summary['mean_throughput']:10.3f} "
                    "samples/s")
            if name != "recycle" and goodput_ratio.get(name) is not None:
                line += f"   ReCycle/this {goodput_ratio[name]:.2f}x by goodput, {mean_ratio[name]:.2f}x by mean"
            if run_summary["reason"]:
                line += f"   ({run_summary['reason']})"
            print(line)
        torchft = summary.get("torchft_like")
        if torchft and torchft["best_recycle_goodput_ratio"] is not None:
            print(f"best ReCycle line ({torchft['best_recycle']}) / torchft-like: "
                  f"{torchft['best_recycle_goodput_ratio']:.2f}x by goodput (torchft-like's global batch changes: "
                  f"{torchft['mean_global_batch_samples']:.1f} of {torchft['full_global_batch_samples']} samples on "
                  "average)")
        decisions = [e for e in result.extra.get("recycle_plus_policy", []) if e["policy"] in PLUS_DECISIONS]
        if decisions:
            print(f"ReCycle+ made {len(decisions)} layer decision(s): listed in {args.out}/report.md")
    return 0
