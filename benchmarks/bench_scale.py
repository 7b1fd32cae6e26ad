"""A 16,384-GPU job (D=128, S=16, TP=8: Llama 3 405B's layout) over 54 days at Llama 3's failure rate: goodput of
every system, and the time the replay takes. ReCycle's per-state throughput uses the closed-form estimate
(docs/traces.md), checked here against the real planner on a few of the states the trace visits.
Run: .venv/bin/python benchmarks/bench_scale.py [--seed N] [--repair-h H] [--check-keys K]"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from recycle.traces.experiments import JobSetup, named_config, run_job  # noqa: E402
from recycle.traces.generate import LLAMA3_DAYS, generate_trace, llama3_model  # noqa: E402
from recycle.traces.throughput import estimate_period, reference_period  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repair-h", type=float, default=2.0, help="mean repair time of a failed node (assumption)")
    parser.add_argument("--check-keys", type=int, default=3, help="states to re-plan with the real planner")
    args = parser.parse_args()

    config = named_config("llama3-405b-like-16k")
    gpus = config.num_replicas * config.num_stages * config.topology.gpus_per_worker
    t0 = time.time()
    trace = generate_trace(llama3_model(days=LLAMA3_DAYS, repair_mean_h=args.repair_h, seed=args.seed))
    t_trace = time.time() - t0
    print(f"job: {config.name}, D={config.num_replicas} S={config.num_stages} TP={config.topology.gpus_per_worker} "
          f"= {gpus} GPUs on {len(trace.initial)} 8-GPU nodes")
    print(f"trace: Llama 3 rate (419 unexpected interruptions / 54 days / 16,384 GPUs), {LLAMA3_DAYS} days, repair "
          f"{args.repair_h} h (exponential), seed {args.seed}: {trace.num_removals()} node failures "
          f"(generated in {t_trace:.2f} s)")

    t1 = time.time()
    result = run_job(config, trace, setup=JobSetup(gpus_per_node=8, period_model="estimate", reference="1f1b"))
    t_sim = time.time() - t1
    ff = result.fault_free_rate
    print(f"simulated in {t_sim:.1f} s (includes the 1F1B reference simulation); {result.extra['keys_planned']} "
          f"distinct normalized states; fault-free {ff:.2f} samples/s ({ff * config.workload.seq_len / 1e6:.2f}M "
          "tokens/s)")
    print(f"\n{'system':28s} {'goodput':>9s} {'mean % of ff':>12s}   time lost (hours) by cause")
    for run in result.runs.values():
        lost = ", ".join(f"{cause} {seconds / 3600:.1f}" for cause, seconds in sorted(
            run.lost_s.items(), key=lambda kv: -kv[1]) if seconds > 0) or "-"
        print(f"{run.label:28s} {run.goodput:9.2%} {run.mean_throughput / ff:12.2%}   {lost}")

    # Validate the estimate at full size on the worst states of the kind this trace visits (units laid out on the
    # grid in order), against the real planner.
    if args.check_keys > 0:
        try:
            from recycle.planner.api import plan_for_key
        except ImportError:
            print("\n(planner not available: estimate not re-checked at scale)")
            return 0
        from recycle.traces.mapping import map_trace_to_units
        from recycle.planner.failures import normalize

        timeline = map_trace_to_units(trace, 8, config.topology.gpus_per_worker)
        layout_keys: Counter = Counter()
        total = set(range(config.num_replicas * config.num_stages))
        for live in timeline.live:
            # units map to grid slots in order (unit u -> replica u // S, stage u % S) for this count
            failed = [(u // config.num_stages, u % config.num_stages) for u in total - set(live) if u in total]
            layout_keys[normalize(failed, config.num_replicas, config.num_stages).key] += 1
        reference = reference_period(config)
        print(f"\nestimate vs real planner (heuristic) at full size, capped at the 1F1B reference "
              f"{reference / 1e6:.3f} s:")
        worst_first = sorted((k for k in layout_keys if sum(k) > 0), key=lambda k: (-max(k), -sum(k), k))
        for key in worst_first[: args.check_keys]:
            t2 = time.time()
            planned = plan_for_key(config, key).meta.predicted_period
            spent = time.time() - t2
            est = estimate_period(config, key, reference)
            print(f"  key with {sum(key)} failure(s) on stage(s) {[s for s, k in enumerate(key) if k]}: planner "
                  f"{planned / 1e6:.3f} s (capped {max(planned, reference) / 1e6:.3f} s, {spent:.1f} s to plan), "
                  f"estimate {est / 1e6:.3f} s, ratio {est / max(planned, reference):.3f}")
        print(f"  planning all {result.extra['keys_planned']} states this way would take about "
              f"{result.extra['keys_planned'] * spent:.0f} s; the estimate takes microseconds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
